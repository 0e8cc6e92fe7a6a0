"""The privacy record under careless and hostile use (fast cases; the federations are in
tests/e2e/test_record_integrity_federation.py).

- a run folder's name stays one folder inside output-dir; every number is finite and in
  a sensible range at start;
- one writer per run folder (an OS lock naming its holder; a killed holder's lock is
  taken over);
- a resume may not change the run's identity (config.json);
- the ledger is brought up to the checkpoint's copy and to rounds.jsonl on resume, never
  left behind them;
- a hostile node (real ClientApp replies, tampered): a x1e6 update, an inflated
  num-examples, a switched identity and a replay relabelled to the current round are each
  refused or neutralised, charged at no less than the plan, and the round goes on.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from dpfl.apps.client import train
from dpfl.config import ConfigError, RunConfig, parse_node_partitions
from dpfl.data import splits_for
from dpfl.errors import UserError
from dpfl.methods import build_strategy, parse_run_config
from dpfl.models import build_model
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import Ledger
from dpfl.privacy.plan import dpsgd_norm_bound, planned_event
from dpfl.privacy_report import EXIT_OVER_BUDGET, build_privacy_report
from dpfl.runlock import WRITER_LOCK, RunLock, check_unlocked
from dpfl.runtime.preflight import check_cpus_per_client
from dpfl.server.rundir import RunDir, run_dir_path
from dpfl.server.runidentity import resume_difference, resume_overrides
from dpfl.tensors import flatten

from flower_helpers import context, message
from rundir_helpers import RunWriter

# ---------------------------------------------------------------------------------------
# paths and values (issue cases 6 and 7)


@pytest.mark.parametrize("name", ["../../etc/evil", "/etc/evil", "a/b", "..", ".", " ",
                                  "   ", "a b", "tab\there", "bad\udcffname", "x" * 101,
                                  ".hidden", "-flag", "new\nline"])
def test_a_run_name_is_one_plain_folder_name(name):
    with pytest.raises(ConfigError, match="run-name"):
        RunConfig(run_name=name).replace()


@pytest.mark.parametrize("name", ["run-1", "ε-sweep_2026.11", "a" * 100])
def test_plain_run_names_are_accepted(name, tmp_path):
    cfg = RunConfig(run_name=name, output_dir=str(tmp_path)).replace()
    assert run_dir_path(cfg).parent == tmp_path


def test_a_run_folder_never_resolves_outside_output_dir(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "link").symlink_to(tmp_path / "elsewhere")
    cfg = RunConfig(run_name="link", output_dir=str(tmp_path / "out")).replace()
    with pytest.raises(UserError, match="outside output-dir"):
        run_dir_path(cfg)


@pytest.mark.parametrize("raw", [{"max-grad-norm": 1e308}, {"target-epsilon": math.inf},
                                 {"target-epsilon": math.nan}, {"clip-norm": 1e7},
                                 {"num-rounds": 10 ** 7}, {"lr": math.inf},
                                 {"target-epsilon": 1e16}, {"delta": math.nan}])
def test_out_of_range_numbers_stop_the_run_at_start(raw):
    key = next(iter(raw))
    with pytest.raises(ConfigError, match=f"'{key}'"):
        parse_run_config(raw)


@pytest.mark.parametrize("cpus", [0.0, -1.0, math.inf, math.nan, (os.cpu_count() or 1) + 1])
def test_cpus_per_client_out_of_range_is_refused(cpus):
    with pytest.raises(UserError, match="--cpus-per-client"):
        check_cpus_per_client(cpus)
    check_cpus_per_client(0.5)


def test_node_partitions_parse_and_refuse_doubles():
    assert parse_node_partitions("11:0, 22:1,-5:2") == {11: 0, 22: 1, -5: 2}
    for bad in ("11:0,11:1", "11:0,22:0", "11", "a:1", "11:-1"):
        with pytest.raises(ValueError):
            parse_node_partitions(bad)
    with pytest.raises(ConfigError, match="node-partitions"):
        parse_run_config({"node-partitions": "1:0,2:0"})


# ---------------------------------------------------------------------------------------
# one writer per run folder (case 3)


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    with RunLock(tmp_path, WRITER_LOCK, "first"):
        with pytest.raises(UserError, match=f"in use by process {os.getpid()} \\(first\\)"):
            RunLock(tmp_path, WRITER_LOCK, "second").acquire()
        with pytest.raises(UserError, match="in use"):
            check_unlocked(tmp_path)
    check_unlocked(tmp_path)          # released: free again
    with RunLock(tmp_path, WRITER_LOCK, "third"):
        pass


@contextmanager
def _writer_lock_held_elsewhere(folder: Path):
    """Another process holding ``folder``'s writer lock (killed when the block ends)."""
    code = ("import time; from pathlib import Path; from dpfl.runlock import RunLock; "
            f"RunLock(Path({str(folder)!r})).acquire(); print('held', flush=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_holders_lock_is_taken_over(tmp_path):
    with _writer_lock_held_elsewhere(tmp_path) as proc:
        with pytest.raises(UserError, match=f"process {proc.pid}"):
            RunLock(tmp_path).acquire()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        with RunLock(tmp_path, role="successor") as lock:   # the stale lock: taken over
            assert (tmp_path / WRITER_LOCK).read_text().startswith(f"{os.getpid()} ")
            assert lock.held


def test_removing_the_lock_file_under_a_live_writer_lets_nobody_in(tmp_path):
    """Issue 46.8: lock files removed under a live run let a second writer in (8 releases
    per client, a ledger showing 4). The writer also holds the folder's own lock."""
    with _writer_lock_held_elsewhere(tmp_path) as proc:
        (tmp_path / WRITER_LOCK).unlink()
        with pytest.raises(UserError, match="in use by another process \\(its .lock was "
                                            "removed or replaced\\)"):
            RunLock(tmp_path).acquire()
        (tmp_path / WRITER_LOCK).write_text("1 forged\n")       # a replaced file: same
        with pytest.raises(UserError, match="in use"):
            RunLock(tmp_path).acquire()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        with RunLock(tmp_path, role="successor") as lock:   # the folder's lock went with it
            assert lock.held


def test_the_server_opens_a_run_folder_only_under_its_lock(tmp_path):
    cfg = RunConfig(run_name="r", output_dir=str(tmp_path)).replace()
    first = RunDir.open(cfg)
    try:
        with pytest.raises(UserError, match="in use by process"):
            RunDir.open(cfg)
    finally:
        first.close()
    RunDir.open(cfg).close()


# ---------------------------------------------------------------------------------------
# identity fixed at start (case 1)

SAVED = {"trainer": "update-dp", "delta": 1e-5, "target-epsilon": 8.0, "num-rounds": 2,
         "noise-multiplier": 0.0, "clip-norm": 1.0, "num-clients": 2, "run-name": "a",
         "output-dir": "runs", "resume": False}


@pytest.mark.parametrize("change", [{"delta": 0.01}, {"target-epsilon": 50.0},
                                    {"noise-multiplier": 0.3}, {"trainer": "dpsgd"},
                                    {"num-clients": 4}, {"clip-norm": 2}])
def test_a_resume_may_not_change_the_guarantee_or_the_split(change):
    key = next(iter(change))
    assert resume_difference(SAVED, {**SAVED, **change})[0] == key
    with pytest.raises(ConfigError, match=key if key != "num-clients" else "clients"):
        resume_overrides(SAVED, change, "runs/a")


def test_a_resume_may_extend_the_run_and_loads_the_saved_config():
    merged = resume_overrides(SAVED, {"num-rounds": 5, "resume": True, "clip-norm": 1,
                                      "num-clients": 2}, "runs/a")
    assert merged["num-rounds"] == 5 and merged["trainer"] == "update-dp"
    assert merged["delta"] == 1e-5 and "num-clients" not in merged
    assert resume_difference(SAVED, {**SAVED, "num-rounds": 9, "round-timeout": 5.0}) is None


# ---------------------------------------------------------------------------------------
# the ledger is never behind the run's own records (case 2)

SIGMA = 1.5


def _event(r: int) -> PrivacyEvent:
    return PrivacyEvent.gaussian(r, SIGMA, relation="replace-one")


def _three_round_run(tmp_path: Path) -> tuple[Path, str]:
    """A run of 2 clients x 3 rounds; returns its folder and ledger.json after round 2."""
    writer = RunWriter(tmp_path / "run", Ledger(1e-5, "rdp"))
    older = ""
    for r in (1, 2, 3):
        for c in ("client-0", "client-1"):
            writer.charge(c, r, [_event(r)])
        writer.end_round(r)
        if r == 2:
            writer.write(summary=False)
            older = (tmp_path / "run" / "ledger.json").read_text()
    writer.write(summary=False)
    return tmp_path / "run", older


def test_an_older_ledger_without_checkpoint_is_repaired_from_rounds_jsonl(tmp_path, caplog):
    run, older = _three_round_run(tmp_path)
    (run / "ledger.json").write_text(older)          # an older, valid ledger put back
    assert not (run / "checkpoint.pt").exists()
    point = RunDir(run).resume_point(without_checkpoint=True)
    assert point.round == 3
    expected = PrivacyHistory([_event(1), _event(2), _event(3)]).epsilon(1e-5, "rdp")
    for c in ("client-0", "client-1"):
        assert [e.round for e in point.ledger.clients[c].events] == [1, 2, 3]
        assert point.ledger.recomputed(c) == pytest.approx(expected, rel=1e-12)
    assert "ledger.json was behind rounds.jsonl: restored 2 charges" in caplog.text
    on_disk = Ledger.load(run / "ledger.json")       # repaired on disk, not only in memory
    assert on_disk.recomputed("client-0") == pytest.approx(expected, rel=1e-12)
    assert json.loads((run / "resumes.jsonl").read_text())["repair"] == "rounds.jsonl"
    # a second reconciliation restores nothing more (a multiset, not a union of sets)
    again = RunDir(run).resume_point(without_checkpoint=True)
    assert len(again.ledger.clients["client-0"].events) == 3


def test_a_charge_made_twice_is_kept_twice():
    ledger = Ledger(1e-5, "rdp")
    twice = {"client": "client-0", "round": 1, "note": "n", "source": "client",
             "events": [_event(1).to_dict()]}
    ledger.restore([twice, twice], "rounds.jsonl")
    assert len(ledger.clients["client-0"].events) == 2
    assert ledger.restore([twice, twice], "rounds.jsonl") == []


def test_population_releases_are_restored_for_every_client():
    ledger = Ledger(1e-5, "rdp")
    charge = {"client": "population", "round": 1, "note": "central", "source": "population",
              "clients": 3, "events": [_event(1).to_dict()]}
    ledger.restore([charge], "rounds.jsonl", population=["client-0", "client-1", "client-2"])
    assert ledger.recomputed("client-2") == pytest.approx(
        PrivacyHistory([_event(1)]).epsilon(1e-5, "rdp"))


def test_over_budget_clients_are_flagged_and_the_report_exits_non_zero(tmp_path):
    writer = RunWriter(tmp_path / "run", Ledger(1e-5, "rdp", budget=1.0))
    for r in (1, 2):
        writer.charge("client-0", r, [_event(r)])
        writer.end_round(r)
    run = writer.write(summary=False)
    data = json.loads((run / "ledger.json").read_text())
    assert data["over-budget"] == ["client-0"] and data["clients"]["client-0"]["over-budget"]
    report = build_privacy_report(run)
    assert "OVER BUDGET client-0" in report.text
    assert report.exit_code == EXIT_OVER_BUDGET


# ---------------------------------------------------------------------------------------
# bounds the server can check (case 5)


def test_dpsgd_bound_by_hand_and_over_a_real_dpsgd_round():
    cfg = RunConfig(dataset="digits", model="mlp", batch_size=64, lr=0.1, momentum=0.5)
    # by hand: n = 600, B = 64 -> q = 1/10, E[B] = 60; binomial(600, 0.1) 1-1e-12 quantile
    from scipy.stats import binom

    bmax = binom.isf(1e-12, 600, 0.1) + 1
    hand = 0.1 * 10 * (bmax * 1.0 + 2.0 * (math.sqrt(1000) + 10)) / 60 / 0.5
    assert dpsgd_norm_bound(cfg, 600, 2.0, 10, 1000) == pytest.approx(hand, rel=1e-12)
    # an honest DP-SGD update (the real ClientApp) stays below it, within two orders
    run_config = {"dataset": "digits", "model": "mlp", "batch-size": 64, "lr": 0.5,
                  "target-epsilon": 8.0, "num-rounds": 2}
    cfg = parse_run_config(run_config)
    n = len(list(splits_for(cfg, 2))[0].train)
    event = planned_event(cfg, n, 1)
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    reply = train(message(RecordDict({"arrays": arrays, "config": ConfigRecord(
        {"server-round": 1})})), context(run_config, 0, 2))
    norm = float(flatten(reply.content["arrays"].to_torch_state_dict()).norm())
    dim = sum(a.numel() for a in build_model("mlp", (1, 8, 8), 10).state_dict().values())
    bound = dpsgd_norm_bound(cfg, n, event.sigma, int(event.steps), dim)
    assert 0 < norm < bound < 100 * norm


# ---------------------------------------------------------------------------------------
# a hostile node (case 4 and 5 together; real ClientApp replies, then tampered)

HOSTILE = {"dataset": "digits", "model": "mlp", "batch-size": 64, "lr": 0.5,
           "target-epsilon": 4.0, "num-rounds": 2, "strategy": "dpfedavg"}
NODES = {101: 0, 102: 1, 103: 2, 104: 3}     # the operator's map: node id -> partition


class _Grid:
    def get_node_ids(self):
        return list(NODES)


def _federation(extra: dict):
    run_config = {**HOSTILE, **extra}
    cfg = parse_run_config(run_config)
    splits = list(splits_for(cfg, len(NODES)))
    ledger = Ledger(cfg.delta, cfg.accountant, budget=cfg.target_epsilon)
    strategy = build_strategy(cfg, {i: len(s.train) for i, s in enumerate(splits)},
                              ledger=ledger)
    contexts = {node: context(run_config, pid, len(NODES)) for node, pid in NODES.items()}
    return strategy, ledger, contexts, splits


def _honest_replies(strategy, contexts, arrays, rnd):
    messages, record = strategy.start_round(rnd, arrays, _Grid())
    replies = {}
    for m in messages:
        node = int(m.metadata.dst_node_id)
        reply = train(message(m.content, src_node_id=0, dst_node_id=node), contexts[node])
        replies[node] = reply.content
    return record, replies


def _as_from(node: int, content: RecordDict, **changes) -> object:
    """``content`` as a reply of ``node``, with arrays scaled or metrics replaced."""
    arrays = content["arrays"]
    if "scale" in changes:
        arrays = ArrayRecord({k: v * changes["scale"] for k, v in
                              arrays.to_torch_state_dict().items()})
    metrics = dict(content["metrics"])
    metrics.update(changes.get("metrics", {}))
    records = {"arrays": changes.get("arrays", arrays), "metrics": MetricRecord(metrics),
               "privacy": changes.get("privacy", content["privacy"])}
    return message(RecordDict(records), src_node_id=node)


@pytest.mark.parametrize("mapped", [True, False], ids=["operator-map", "no-map"])
def test_a_hostile_node_is_refused_charged_the_plan_and_the_round_goes_on(
        mapped, server_identity, caplog):
    extra = {"node-partitions": ",".join(f"{n}:{p}" for n, p in NODES.items())} if mapped \
        else {}
    strategy, ledger, contexts, splits = _federation(extra)
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    record, honest = _honest_replies(strategy, contexts, arrays, 1)
    if not mapped:   # without a map, nodes are pinned by their honest first claims
        first = strategy.finish_round(1, record, [_as_from(n, c) for n, c in honest.items()])
        assert len(first.record.accepted) == 4
        arrays = first.arrays
        record, round2 = _honest_replies(strategy, contexts, arrays, 2)
        rnd, previous, honest = 2, honest, round2
    else:
        rnd, previous = 1, None
    sizes = strategy.partition_sizes
    replies = [
        _as_from(101, honest[101], scale=1e6),                        # x1e6 update
        _as_from(102, honest[102], metrics={"num-examples": 10 ** 9}),  # inflated weight
        _as_from(103, honest[103], metrics={"partition-id": 3}),       # claims client-3
        _as_from(104, honest[104]),                                    # honest client-3
    ]
    if previous is not None:   # a replay of round 1's update, relabelled to round 2
        replies[3] = _as_from(104, honest[104], arrays=previous[104]["arrays"])
    charged_before = {c: len(h.events) for c, h in ledger.clients.items()}
    outcome = strategy.finish_round(rnd, record, replies)
    reasons = {r.node_id: r.reason for r in outcome.record.rejected}
    assert "exceeds the mechanism's bound" in reasons[101]
    assert "differs from this node's 2" in reasons[103]
    accepted = {u.node_id: u for u in outcome.record.accepted}
    assert accepted[102].num_examples == sizes[1]        # the public size, not 1e9
    if previous is not None:
        assert "a replay" in reasons[104]
        assert set(accepted) == {102}
    else:
        assert set(accepted) == {102, 104}
        # the weighted mean uses public sizes: with two accepted updates, by hand
        u2, u3 = accepted[102].flat, accepted[104].flat
        mean = (sizes[1] * u2 + sizes[3] * u3) / (sizes[1] + sizes[3])
        new = flatten(outcome.arrays.to_torch_state_dict())
        assert torch.allclose(new, flatten(arrays.to_torch_state_dict()) + mean, atol=1e-6)
    # every received update charged, at no less than the plan, to the partition it holds
    for node, pid in NODES.items():
        client = f"client-{pid}"
        new_events = ledger.clients[client].events[charged_before.get(client, 0):]
        assert len(new_events) == 1, client
        assert new_events[0] == planned_event(strategy.cfg, sizes[pid], rnd)
    assert ledger.over_budget() == {}
    assert all(e <= 4.0 * (1 + 1e-6) for e in ledger.epsilons().values())


def test_without_a_map_a_held_partition_cannot_be_claimed_by_another_node(server_identity):
    strategy, ledger, contexts, _ = _federation({})
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    record, honest = _honest_replies(strategy, contexts, arrays, 1)
    replies = [_as_from(104, honest[104]),                              # client-3, first
               _as_from(103, honest[103], metrics={"partition-id": 3})]  # 3 again, node 103
    outcome = strategy.finish_round(1, record, replies)
    reasons = {r.node_id: r.reason for r in outcome.record.rejected}
    assert "already belongs to node 104" in reasons[103]
    assert len(ledger.clients["client-3"].events) == 1         # only its own release
    assert len(ledger.clients["node-103"].events) == 1         # the impostor, charged apart


def test_a_mapped_partition_outside_the_federation_stops_the_run(server_identity):
    from dpfl.apps.server import check_operator_map

    strategy, _, _, _ = _federation({"node-partitions": "101:0,102:7"})
    with pytest.raises(ConfigError, match="node-partitions"):
        check_operator_map(strategy, 4, _Grid())



def test_a_verdict_never_improves_over_the_runs_history(tmp_path):
    """Issue 46.7: rounds run with report-train-loss=true (verdict none), resumed with
    false, read formal. The run's verdict keeps every earlier part's reasons; a part whose
    verdict was not recorded (a damaged line, an older resume record) is unknown, never
    assumed formal."""
    from dpfl.privacy.verdict import UNKNOWN_PART, Guarantee, over_history
    from dpfl.server.rundir import RESUMES_FILE, RunDir

    formal = Guarantee("formal", "client", "replace-one", "none", 1e-5, "rdp", "s")
    loss = "none: train-loss is released in the clear (set report-train-loss=false)"
    assert over_history(formal, ["formal", "formal"]) == formal
    assert over_history(formal, ["formal", loss]).verdict == (
        "none: train-loss is released in the clear (set report-train-loss=false) (in an "
        "earlier part of this run)")
    # the current part's own reasons come first; a reason already current is not repeated
    now = Guarantee(loss, "client", "replace-one", "none", 1e-5, "rdp", "s")
    assert over_history(now, [loss, "none: a; b"]).verdict == loss + (
        "; a (in an earlier part of this run); b (in an earlier part of this run)")
    assert over_history(formal, [None]).verdict == "none: " + UNKNOWN_PART
    # the resume log: one verdict per line, damaged or verdict-less lines unknown
    run = tmp_path / "run"
    run.mkdir()
    (run / RESUMES_FILE).write_text(json.dumps({"verdict": "formal"}) + "\n"
                                    + "{damaged\n" + json.dumps({"resumed-after-round": 2})
                                    + "\n" + json.dumps({"repair": "rounds.jsonl"}) + "\n"
                                    + json.dumps({"verdict": loss}) + "\n")
    assert RunDir(run).resume_verdicts() == ["formal", None, None, loss]


def test_every_instruction_carries_the_ledger_a_node_must_count(server_identity):
    """Issue 46.5: after a resume the recorded events went only to the nodes sampled in
    the FIRST resumed round; a node sampled later (fraction-train < 1) trained on an empty
    history and two clients ended at 4.57 > 4.2. Now every instruction carries them: a
    node pinned to a partition gets its partition's, a node not pinned yet gets every
    partition's, in every round; a client on a fresh node adopts them before its check."""
    strategy, ledger, contexts, _ = _federation({})
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    record, honest = _honest_replies(strategy, contexts, arrays, 1)
    strategy.finish_round(1, record, [_as_from(n, c) for n, c in honest.items()])
    round1 = {c: list(h.events) for c, h in ledger.clients.items()}
    assert sorted(round1) == [f"client-{p}" for p in range(4)]
    # rounds 2 and 3, long after any resume: pinned nodes get their own partition's events
    for rnd in (2, 3):
        messages, _ = strategy.start_round(rnd, arrays, _Grid())
        for m in messages:
            config = m.content["config"]
            pid = NODES[int(m.metadata.dst_node_id)]
            assert set(config["ledger-client"]) == {pid}
            assert len(config["ledger-round"]) == len(round1[f"client-{pid}"])
    # a node the server has not pinned (a new node id after a resume) gets every partition's
    strategy.nodes.node_partition.clear()
    messages, _ = strategy.start_round(3, arrays, _Grid())
    config = messages[0].content["config"]
    assert sorted(set(config["ledger-client"])) == [0, 1, 2, 3]
    # built once per ledger state for all unpinned nodes, and anew after a charge
    before = len(strategy.guard.history_record(None)["ledger-round"])
    ledger.record("client-2", 2, [PrivacyEvent.dpsgd(2, 1.0, 0.1, 5)])
    assert len(strategy.guard.history_record(None)["ledger-round"]) == before + 1
    # ... and its client, on a node whose state was lost, counts round 1 before round 3
    node = int(messages[0].metadata.dst_node_id)
    fresh = context({**HOSTILE}, NODES[node], len(NODES))
    reply = train(message(messages[0].content, src_node_id=0, dst_node_id=node), fresh)
    spent = PrivacyHistory.load(fresh.state)
    assert [e.round for e in spent.events] == [1, 3]
    assert spent.events[0] == round1[f"client-{NODES[node]}"][0]
    assert reply.content["metrics"]["epsilon"] > 0


def test_a_copied_run_folder_cannot_resume_beside_its_original(tmp_path, monkeypatch):
    """Issue 46.6: copy a run folder, resume both: three releases per partition, each
    ledger showing 3.996. A copy is a fork of the record: refused while its original
    exists; a moved folder (same directory) keeps its identity; a folder whose original is
    gone takes the identity over."""
    import shutil

    from dpfl.server import runregistry

    monkeypatch.setenv(runregistry.STATE_ENV, str(tmp_path / "state"))
    original = tmp_path / "runs" / "r"
    original.mkdir(parents=True)
    identity = runregistry.start(original)
    assert (tmp_path / "state" / "runs" / f"{identity}.json").exists()
    assert runregistry.claim(original) == identity            # resuming the run itself
    copy = tmp_path / "elsewhere" / "r-copy"
    shutil.copytree(original, copy)
    with pytest.raises(UserError, match=f"{copy} is a copy of {original}.*twice"):
        runregistry.claim(copy)
    moved = tmp_path / "runs" / "r-moved"
    original.rename(moved)                                    # a move keeps the directory
    assert runregistry.claim(moved) == identity
    with pytest.raises(UserError, match=f"is a copy of {moved}"):
        runregistry.claim(copy)
    shutil.rmtree(moved)                                      # the original is gone
    assert runregistry.claim(copy) == identity
    # a damaged identity file is not a fresh start
    (copy / runregistry.IDENTITY_FILE).write_text("{")
    with pytest.raises(UserError, match="damaged run identity"):
        runregistry.claim(copy)


def test_a_partition_split_over_two_ledger_keys_is_flagged(tmp_path):
    """Issue 46.4: a resume with a node-partitions map naming a node that is not connected
    (the real node's replies charged to node-<id>), then a resume without the map: the
    partition's releases split over node-<id> and client-0, each below the budget 4.2,
    the partition over it, no flag, privacy-report exit 0. The unidentified sender's
    claim is kept with its charge and the partition's figure over both keys is checked."""
    from dpfl.privacy.accounting.events import history_epsilon

    sigma = 4.5
    events = [PrivacyEvent.gaussian(r, sigma, relation="replace-one") for r in range(1, 7)]
    split_eps = history_epsilon(events[:3], 1e-5, "rdp")
    whole = history_epsilon(events, 1e-5, "rdp")
    assert split_eps < 4.2 < whole            # each key under the budget, the partition over
    ledger = Ledger(1e-5, "rdp", budget=4.2)
    writer = RunWriter(tmp_path / "run", ledger)
    for r, e in enumerate(events[:3], start=1):          # resumed with the wrong map
        ledger.record("node-77", r, [e], None, "node 77 is not in node-partitions",
                      claimed=0)
        writer.end_round(r)
    for r, e in enumerate(events[3:], start=4):          # resumed without it
        writer.charge("client-0", r, [e])
        writer.end_round(r)
    assert ledger.epsilons()["client-0"] == pytest.approx(split_eps)
    assert ledger.claimed_figures() == {"client-0": pytest.approx(whole)}
    assert ledger.over_budget() == {"client-0": pytest.approx(whole)}
    run = writer.write(summary=False)
    assert build_privacy_report(run).exit_code == EXIT_OVER_BUDGET


@pytest.mark.parametrize("trainer", ["update-dp", "dpsgd"])
def test_an_honest_size_claim_is_never_flagged_and_a_false_one_is(trainer, server_identity,
                                                                  caplog):
    """Issue 48.3: under update-dp the client sends num-examples = 1 on purpose (equal
    weights: its size is private) and the server logged it as a false claim for every honest
    client. One protocol now: 1 under update-dp, the public size under DP-SGD; only another
    value is logged."""
    import logging

    strategy, ledger, contexts, splits = _federation({"trainer": trainer, "lr": 0.1,
                                                      "clip-norm": 0.5})
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    record, honest = _honest_replies(strategy, contexts, arrays, 1)
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.finish_round(1, record, [_as_from(n, c) for n, c in honest.items()])
    assert not [r for r in caplog.records if "claims" in r.getMessage()]
    record, honest = _honest_replies(strategy, contexts, arrays, 2)
    caplog.clear()
    lying = {n: _as_from(n, c, metrics={"num-examples": 10_000} if n == 101 else {})
             for n, c in honest.items()}
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.finish_round(2, record, list(lying.values()))
    lines = [r.getMessage() for r in caplog.records if "claims" in r.getMessage()]
    assert len(lines) == 1 and "client-0 claims 10000 examples" in lines[0], lines
