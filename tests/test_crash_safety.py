"""The privacy history survives every interruption: durable writes, what a run directory
allows (a new run never reuses one; a resume never restarts a run whose model is lost or
whose ledger cannot be read), and a property test with real SIGKILLs: a process that
persists rounds exactly as the ServerApp does (``RunDir.save_ledger`` then
``RunDir.publish_round``) is killed at random instants and at each persistence boundary,
resumed from disk each time, and no client's recorded epsilon ever goes down."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from dpfl.durable import atomic_write_text, read_lines
from dpfl.errors import UserError
from dpfl.methods import run_config
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import Ledger
from dpfl.server.rundir import RunDir, unique_run_name

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path: Path, **kw):
    return run_config(output_dir=str(tmp_path), run_name="r", **kw)


def _ledger(rounds: int, clients: int = 2, sigma: float = 2.0) -> Ledger:
    ledger = Ledger(1e-5, "rdp")
    for r in range(1, rounds + 1):
        for c in range(clients):
            ledger.record(f"client-{c}", r, [PrivacyEvent.gaussian(r, sigma)], None, "test")
    return ledger


def _run_dir(tmp_path: Path, rounds: int, checkpoint_round: int | None) -> RunDir:
    """A run directory after ``rounds`` charged rounds, checkpointed at ``checkpoint_round``."""
    run = RunDir.open(_cfg(tmp_path)).create()
    ledger = _ledger(rounds)
    run.save_ledger(ledger)
    for r in range(1, rounds + 1):
        run.append_round({"round": r})
    if checkpoint_round is not None:
        run.save_checkpoint({"round": checkpoint_round, "model": {"w": torch.ones(2)},
                             "strategy": {}, "initial": {"accuracy": 0.1},
                             "ledger": _ledger(checkpoint_round).to_json()})
    return run


# -- durable writes --------------------------------------------------------------------------

def test_atomic_write_leaves_the_old_version_when_the_write_fails(tmp_path):
    target = tmp_path / "ledger.json"
    atomic_write_text(target, "old")

    def boom(f):
        f.write(b"half")
        raise OSError("disk full")

    from dpfl.durable import atomic_write

    with pytest.raises(OSError):
        atomic_write(target, boom)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.json"]  # no temp file left


def test_read_lines_separates_a_partial_last_line(tmp_path):
    path = tmp_path / "rounds.jsonl"
    path.write_text('{"round": 1}\n{"round": 2}\n{"rou')
    assert read_lines(path) == (['{"round": 1}', '{"round": 2}'], '{"rou')
    path.write_text('{"round": 1}\n')
    assert read_lines(path) == (['{"round": 1}'], None)


# -- run directories ------------------------------------------------------------------------

def test_a_new_run_never_reuses_a_run_directory(tmp_path):
    _run_dir(tmp_path, 1, 1)
    with pytest.raises(UserError, match=r"r already exists \(holds checkpoint.pt, ledger.json"):
        RunDir.open(_cfg(tmp_path))
    # a launcher's own FLWR_HOME alone does not make a run
    (tmp_path / "fresh" / ".flwr").mkdir(parents=True)
    RunDir.open(run_config(output_dir=str(tmp_path), run_name="fresh"))


def test_resume_needs_a_run_to_resume(tmp_path):
    with pytest.raises(UserError, match="no run to resume in .*/r: check run-name"):
        RunDir.open(_cfg(tmp_path, resume=True))


def test_run_names_do_not_collide():
    names = {unique_run_name("dpfedavg") for _ in range(2000)}
    assert len(names) == 2000


def test_resume_uses_the_ledger_file_when_it_is_ahead_of_the_checkpoint(tmp_path):
    """Killed after round 3's charges were saved, before its checkpoint: the model of round
    2, the history of 3 rounds (round 3 will be trained and charged again)."""
    run = _run_dir(tmp_path, 3, 2)
    point = run.resume_point()
    assert point.round == 2 and [r["round"] for r in point.rounds] == [1, 2]
    assert point.ledger.rounds("client-0") == [1, 2, 3]
    assert point.ledger.epsilons() == _ledger(3).epsilons()
    assert [r["round"] for r in run.read_rounds()] == [1, 2]


@pytest.mark.parametrize("as_text", [True, False], ids=["json-text", "older-dict"])
def test_a_checkpoint_ledger_longer_than_the_file_wins(tmp_path, as_text):
    """The checkpoint keeps its ledger copy as one JSON text (older checkpoints: a dict)."""
    import json

    run = _run_dir(tmp_path, 1, None)
    copy = _ledger(2).to_json()
    run.save_checkpoint({"round": 2, "model": {}, "strategy": {}, "initial": {},
                         "ledger": json.dumps(copy) if as_text else copy})
    assert run.resume_point().ledger.rounds("client-1") == [1, 2]


def test_a_damaged_ledger_copy_in_the_checkpoint_is_one_line(tmp_path):
    run = _run_dir(tmp_path, 1, None)
    run.save_checkpoint({"round": 2, "model": {}, "strategy": {}, "initial": {},
                         "ledger": '{"delta": 1e-5, "clie'})
    with pytest.raises(UserError, match="checkpoint.pt: its copy of the ledger is damaged"):
        run.resume_point()


@pytest.mark.parametrize("damage", ["missing", "damaged", "foreign"])
def test_resume_refuses_when_the_model_is_lost(tmp_path, damage):
    run = _run_dir(tmp_path, 2, 2)
    ckpt = run.file("checkpoint.pt")
    if damage == "missing":
        ckpt.unlink()
    elif damage == "damaged":
        ckpt.write_bytes(ckpt.read_bytes()[:40])
    else:
        torch.save([1, 2, 3], ckpt)
    before = run.file("ledger.json").read_text()
    with pytest.raises(UserError) as err:
        run.resume_point()
    msg = str(err.value)
    assert "\n" not in msg
    assert f"checkpoint.pt is {'missing' if damage == 'missing' else ''}" in msg or \
        "not a dpfl checkpoint" in msg
    assert "2 clients up to round 2" in msg and "resume-without-checkpoint=true" in msg
    assert run.file("ledger.json").read_text() == before  # nothing rewritten
    # asked explicitly: a fresh model after round 2, the spend kept
    point = run.resume_point(without_checkpoint=True)
    assert point.model is None and point.round == 2
    assert point.ledger.epsilons() == _ledger(2).epsilons()


@pytest.mark.parametrize("content", ["", "{}", '{"delta": 1e-5, "clients": {', "[1, 2]"])
def test_a_damaged_ledger_is_never_read_as_an_empty_history(tmp_path, content):
    run = _run_dir(tmp_path, 2, 2)
    run.file("ledger.json").write_text(content)
    with pytest.raises(UserError, match=r"ledger.json: (privacy ledger is empty|privacy ledger "
                                        r"is damaged|not a privacy ledger)"):
        run.resume_point()


def test_a_checkpoint_without_its_ledger_file_is_refused(tmp_path):
    run = _run_dir(tmp_path, 2, 2)
    run.file("ledger.json").unlink()
    with pytest.raises(UserError, match="ledger.json is missing but the run has a checkpoint"):
        run.resume_point()


def test_nothing_recorded_resumes_as_a_fresh_start(tmp_path):
    run = RunDir.open(_cfg(tmp_path)).create()
    run.save_ledger(Ledger(1e-5, "rdp"))  # killed right after start_fresh's first write
    assert run.resume_point() is None


def test_a_damaged_round_line_is_named(tmp_path):
    run = _run_dir(tmp_path, 2, 2)
    run.file("rounds.jsonl").write_text('{"round": 1}\nnot json\n{"round": 2}\n')
    with pytest.raises(UserError, match="rounds.jsonl: line 2 is damaged"):
        run.read_rounds()


# -- property: no kill ever lowers a recorded epsilon ------------------------------------

def _persist_rounds(out: Path, rounds: int, die_at: str, report) -> None:
    """What the ServerApp does with a run directory, round after round (resume included),
    with optional SIGKILLs of itself at persistence boundaries; reports on ``report`` every
    epsilon once it is durably saved."""
    run = RunDir(out / "r").create()
    point = run.resume_point() if (out / "r" / "ledger.json").exists() else None
    ledger = point.ledger if point else Ledger(1e-5, "rdp")
    if point is None:
        run.save_ledger(ledger)
        run.file("rounds.jsonl").write_text("")
        run.save_checkpoint({"round": 0, "model": {}, "strategy": {}, "initial": {},
                             "ledger": ledger.to_json()})
    report.write("ready\n")
    report.flush()
    for r in range((point.round + 1) if point else 1, rounds + 1):
        for c in range(3):  # client c's noise depends on the round: histories differ
            ledger.record(f"client-{c}", r, [PrivacyEvent.gaussian(r, 3.0 + c + r % 2)],
                          None, "test")
        run.save_ledger(ledger)
        report.write(json.dumps({"saved": r, "eps": ledger.epsilons()}) + "\n")
        report.flush()
        if die_at == f"after-ledger-{r}":
            os.kill(os.getpid(), signal.SIGKILL)
        run.append_round({"round": r, "epsilon": ledger.epsilons()})
        if die_at == f"after-line-{r}":
            os.kill(os.getpid(), signal.SIGKILL)
        run.save_checkpoint({"round": r, "model": {"w": torch.full((64,), float(r))},
                             "strategy": {}, "initial": {}, "ledger": ledger.to_json()})
    report.write(json.dumps({"done": rounds}) + "\n")
    report.flush()


class _Worker:
    """:func:`_persist_rounds` in a forked child process (a real process, really killed)."""

    def __init__(self, out: Path, rounds: int, die_at: str = "") -> None:
        read_fd, write_fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # child
            os.close(read_fd)
            code = 0
            try:
                with os.fdopen(write_fd, "w") as report:
                    _persist_rounds(out, rounds, die_at, report)
            except BaseException:
                code = 1
            os._exit(code)
        os.close(write_fd)
        self.report = os.fdopen(read_fd)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def finish(self) -> tuple[int, str]:
        """(exit status as -signal or code, everything it reported)."""
        out = self.report.read()
        self.report.close()
        _, status = os.waitpid(self.pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return code, out


def _saved_maxima(stdout: str, best: dict[str, float]) -> bool:
    """Fold the epsilons the worker reported as durably saved into ``best``; True if done."""
    done = False
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue  # a line cut by the kill
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        done = done or "done" in msg
        for client, eps in msg.get("eps", {}).items():
            best[client] = max(best.get(client, 0.0), eps)
    return done


def _on_disk(out: Path) -> dict[str, float]:
    point = RunDir(out / "r").resume_point()
    return point.ledger.epsilons() if point else {}


def test_no_kill_and_resume_ever_lowers_a_recorded_epsilon(tmp_path):
    """40 rounds; first a SIGKILL at each persistence boundary of some rounds, then 20 at
    random instants (seeded) of the persistence work after a first save, then a run to the end. After every
    kill the history on disk holds at least every epsilon the worker had reported saved,
    and at the end every round was charged at least once and appears once in rounds.jsonl."""
    rounds, best = 40, {}
    for die_at in ("after-ledger-1", "after-line-2", "after-ledger-4", "after-line-4"):
        code, out = _Worker(tmp_path, rounds, die_at).finish()
        assert code == -signal.SIGKILL, die_at
        _saved_maxima(out, best)
        on_disk = _on_disk(tmp_path)
        assert all(on_disk[c] >= e for c, e in best.items()), (die_at, on_disk, best)
    rng, cut_mid_run = random.Random(2026), 0
    for _ in range(20):  # SIGKILL at a random instant of the persistence work
        worker = _Worker(tmp_path, rounds)
        assert worker.report.readline() == "ready\n"
        # Wait for the first durable save, then kill within the next rounds' persistence:
        # the instant is random, but it lands mid-run however loaded the machine is.
        first_save = worker.report.readline()
        time.sleep(rng.uniform(0.0, 0.004))
        worker.kill()
        _, out = worker.finish()
        out = first_save + out
        cut_mid_run += '"saved"' in out and not _saved_maxima(out, best)
        on_disk = _on_disk(tmp_path)
        assert all(on_disk[c] >= e for c, e in best.items()), (on_disk, best)
    assert cut_mid_run >= 3, "the random kills never landed inside the rounds"
    code, out = _Worker(tmp_path, rounds).finish()
    assert code == 0 and _saved_maxima(out, best)
    ledger = Ledger.load(tmp_path / "r" / "ledger.json")
    for c in range(3):
        assert set(ledger.rounds(f"client-{c}")) == set(range(1, rounds + 1))
    rounds_file = [json.loads(l)["round"] for l in (tmp_path / "r" / "rounds.jsonl").read_text()
                   .splitlines()]
    assert rounds_file == list(range(1, rounds + 1))
