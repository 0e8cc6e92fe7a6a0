"""Every DP method runs from `flwr run` by name (2 clients, 2-3 rounds, real simulation: each
run submitted to one simulation SuperLink per test file, tests/e2e/federation.py) and
does what the method does, read back from its run directory: GCFL's conflict counts and the
projection they cause, DP-SCAFFOLD's server control variate, FedExP's step size against its
closed form, PEGASUS' selection rule, AADP-FL's Rényi filter stopping a client, FedACG's
momentum. (FedCompDP,
DP-FedASGP and Fed-SMP: test_methods_sparse_adaptive.py.)"""

import json

import pytest

from federation import read_run as _read
from federation import simulate_digits as _simulate

pytestmark = pytest.mark.e2e


# Client-level update DP (trainer=update-dp) runs end to end in the AADP-FL test below (and
# DP-FedSAM's local SAM under update DP in test_dpfedsam.py through the real ClientApp);
# DP-FedProx, DP-FedSAM (DP-SAT) and Fed-SMP over DP-SGD here.
@pytest.mark.parametrize("strategy,extra", [
    ("dpfedprox", ["prox-mu=0.1"]),
    ("dpfedsam", ["sam-rho=0.05"]),
    # sample-level Fed-SMP: DP-SGD, then the top-k of the noised update (post-processing)
    ("fedsmp", ["fedsmp-mask=topk", "fedsmp-ratio=0.3"]),
    # FedACG over DP-SGD: lookahead broadcast, the regulariser after every DP step
    ("fedacg", ["acg-lambda=0.85", "acg-beta=0.002"]),
])
def test_method_runs_by_name(tmp_path, strategy, extra):
    _simulate(tmp_path, "m", f"strategy={strategy}", "num-rounds=2", "lr=0.5",
              "target-epsilon=8.0", *extra)
    summary = json.loads((tmp_path / "m" / "summary.json").read_text())
    rounds = [json.loads(l) for l in (tmp_path / "m" / "rounds.jsonl").read_text().splitlines()]
    assert summary["guarantee"]["verdict"] == "formal"
    assert [r["train"]["accepted"] for r in rounds] == [2, 2]
    assert summary["guarantee"]["unit"] == "sample"
    assert summary["final"]["accuracy"] > summary["initial"]["accuracy"]
    assert all(c["epsilon"] <= 8.0 for c in summary["clients"].values())
    assert not list((tmp_path / "m").glob("*.png"))  # plots=false (federation.simulate)
    if strategy == "fedacg":   # m after round 1 is the mean update: non-zero, recorded
        assert all(r["train"]["acg-momentum-norm"] > 0 for r in rounds)


def test_gcfl_records_conflicts_and_projects_them(tmp_path):
    """Each round GCFL draws one reference among the two updates and projects the other one
    when their cosine is negative. The record must say so consistently: a conflict <=>
    a negative smallest cosine <=> one corrected update <=> an aggregate moved away from
    the plain weighted mean (correction norm > 0); no conflict <=> none of these. (With DP
    noise the sign of the cosine is a coin flip per round: both branches are valid.)"""
    run = _simulate(tmp_path, "g", "strategy=gcfl", "num-rounds=3", "lr=0.5",
                    "target-epsilon=8.0")
    rounds, ledger, summary, _ = _read(run)
    assert summary["guarantee"]["verdict"] == "formal"
    assert ledger["mismatches"] == []
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        t = r["train"]
        print(f"round {r['round']}: conflicts {t['gcfl-conflicts']}, min cosine "
              f"{t['gcfl-min-cosine']:.4g}, correction norm {t['gcfl-correction-norm']:.4g}")
        assert t["accepted"] == 2 and t["gcfl-references"] == 1
        assert t["gcfl-conflicts"] in (0, 1)  # one non-reference update x one reference
        assert -1.0 <= t["gcfl-min-cosine"] <= 1.0
        conflict = t["gcfl-conflicts"] == 1
        assert (t["gcfl-min-cosine"] < 0) == conflict, t
        assert t["gcfl-corrected"] == t["gcfl-conflicts"], t
        assert (t["gcfl-correction-norm"] > 0) == conflict, t
    assert summary["final"]["accuracy"] > summary["initial"]["accuracy"]
    assert all(c["epsilon"] <= 8.0 for c in summary["clients"].values())


def test_dpscaffold_server_control_variate_moves(tmp_path):
    """c starts at 0 and moves every round by (|S|/N) mean_i Delta c_i; the recorded norms
    agree with each other and with the control variate saved in the checkpoint."""
    import torch

    run = _simulate(tmp_path, "s", "strategy=dpscaffold", "num-rounds=2", "lr=0.5",
                    "target-epsilon=8.0")
    rounds, ledger, summary, _ = _read(run)
    assert summary["guarantee"]["verdict"] == "formal"
    assert ledger["mismatches"] == []
    t1, t2 = rounds[0]["train"], rounds[1]["train"]
    for t in (t1, t2):
        assert t["accepted"] == 2 and t["scaffold-participation"] == 1.0  # 2 of 2 clients
        assert t["scaffold-delta-norm"] > 0 and t["scaffold-control-step-norm"] > 0
        assert t["scaffold-control-step-norm"] == pytest.approx(
            t["scaffold-participation"] * t["scaffold-delta-norm"], rel=1e-4)
    # from c = 0, round 1's step is the whole control variate: non-zero after round 1
    assert t1["scaffold-control-norm"] > 0
    assert t1["scaffold-control-norm"] == pytest.approx(t1["scaffold-control-step-norm"],
                                                        rel=1e-4)
    assert t2["scaffold-control-norm"] != t1["scaffold-control-norm"]
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=False)
    control = checkpoint["strategy"]["control"]
    assert float(control.norm()) == pytest.approx(t2["scaffold-control-norm"], rel=1e-6)
    params = sum(v.numel() for k, v in checkpoint["model"].items()
                 if not k.endswith(("running_mean", "running_var", "num_batches_tracked")))
    assert control.numel() == params


def test_dpfedexp_step_size_follows_the_closed_form(tmp_path):
    """The recorded server step size is eta_g = max(1, sum_i ||Delta_i||^2 /
    (2 M (||Delta_bar||^2 + eps))) of the recorded quantities (eps = fedexp-epsilon)."""
    run = _simulate(tmp_path, "x", "strategy=dpfedexp", "num-rounds=2", "lr=0.5",
                    "target-epsilon=8.0")
    rounds, ledger, summary, config = _read(run)
    assert summary["guarantee"]["verdict"] == "formal"
    assert ledger["mismatches"] == []
    eps = config["fedexp-epsilon"]
    for r in rounds:
        t = r["train"]
        m, total, mean_sq = t["fedexp-clients"], t["fedexp-sum-sq-norm"], t["fedexp-mean-sq-norm"]
        print(f"round {r['round']}: eta_g {t['server-step-size']:.6g}, sum {total:.6g}, "
              f"mean^2 {mean_sq:.6g}")
        assert m == t["accepted"] == 2
        assert total >= m * mean_sq * (1 - 1e-9)  # sum ||D_i||^2 >= M ||mean D||^2
        assert t["server-step-size"] == pytest.approx(
            max(1.0, total / (2 * m * (mean_sq + eps))), rel=1e-9)
        assert t["server-step-size"] >= 1.0
    assert summary["final"]["accuracy"] > summary["initial"]["accuracy"]


def test_pegasus_selects_below_mean_clients(tmp_path):
    """Size-skewed clients have different sampling rates, hence different epsilons: from
    round 2 on only clients strictly below the mean epsilon are asked to train."""
    _simulate(tmp_path, "p", "strategy=pegasus", "partitioning=size", "num-rounds=3", "lr=0.5",
              "target-epsilon=8.0", "noise-multiplier=1.0", clients=3)
    rounds = [json.loads(l) for l in (tmp_path / "p" / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds[0]["sampled-nodes"]) == 3
    for prev, cur in zip(rounds, rounds[1:]):
        eps = prev["epsilon"]
        mean = sum(eps.values()) / len(eps)
        below = {c for c, e in eps.items() if e < mean} or set(eps)
        chosen = set(cur["clients"])
        assert chosen == below
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert summary["guarantee"]["verdict"] == "formal"


def test_aadp_renyi_filter_stops_a_client(tmp_path):
    """AADP-FL: longitudinal clipping + per-round calibrated noise, Nadam server, per-round
    budgets proportional to data. Each client's history is adaptive and bounded by a Rényi
    filter at target-epsilon: with a budget of 8 and per-round budgets 4 x (2/3, 4/3), some
    client's filter refuses a round. The refusal is recorded with a budget reason, charges
    nothing, and is exactly the filter's verdict on the recorded events (derived here from
    ledger.json with dpfl.privacy.accounting.filter, not from hard-coded numbers).
    aadp-threshold is tiny so the per-round budgets never rise: the planned event of a
    refused round then has the public parameters of the client's earlier ones."""
    from dpfl.privacy.accounting.events import PrivacyEvent
    from dpfl.privacy.accounting.filter import RenyiFilter

    run = _simulate(tmp_path, "a", "strategy=aadp", "trainer=update-dp", "partitioning=size",
                    "num-rounds=3", "lr=0.05", "clip-norm=1.0", "server-lr=0.01",
                    "target-epsilon=8.0", "aadp-epsilon=4.0", "aadp-threshold=1e-12")
    rounds, ledger, summary, config = _read(run)
    assert summary["guarantee"]["verdict"] == "formal"
    assert "Rényi filter" in summary["guarantee"]["scope"]
    # the guarantee of an adaptive history is the filter's budget; the plain composition
    # of the rounds run is informative only
    assert all(c["adaptive"] and c["guaranteed-epsilon"] == 8.0
               for c in summary["clients"].values())
    assert ledger["mismatches"] == []
    flt = RenyiFilter(config["target-epsilon"], config["delta"], "client")
    sigmas = {}
    for name, info in ledger["clients"].items():
        assert info["adaptive"] and info["unit"] == "client"
        events = [PrivacyEvent(**e) for e in info["events"]]
        # budgets never rose: one sigma per client; and every prefix stayed inside the filter
        assert len({e.sigma for e in events}) == 1, info["events"]
        sigmas[name] = events[0].sigma
        for k in range(1, len(events) + 1):
            assert flt.admits(events[:k]), (name, k)
    # size-skewed data: the bigger client gets the bigger per-round epsilon, less noise
    assert sigmas["client-1"] < sigmas["client-0"]
    assert len({r["train"]["mean-round-epsilon"] for r in rounds if r["train"]}) == 1

    refusals = [(r["round"], c, info) for r in rounds for c, info in r["clients"].items()
                if info["status"] == "refused"]
    assert refusals, f"no client was refused: {[r['clients'] for r in rounds]}"
    checked = 0
    for rnd, client, info in refusals:
        assert info["reason"].startswith("budget"), info
        recorded = ledger["clients"].get(client, {"events": []})["events"]
        assert all(e["round"] != rnd for e in recorded), (client, rnd)  # charged nothing
        before = [PrivacyEvent(**e) for e in recorded if e["round"] < rnd]
        prev = [r for r in rounds if r["round"] == rnd - 1]
        if prev and client in prev[0]["epsilon"]:  # the round's epsilon did not move
            now = next(r for r in rounds if r["round"] == rnd)["epsilon"][client]
            assert now == pytest.approx(prev[0]["epsilon"][client], rel=1e-12)
        if not before:
            continue
        planned = PrivacyEvent(**{**recorded[-1], "round": rnd})
        assert flt.admits(before), (client, rnd)
        assert flt.would_exceed(before, planned), (client, rnd)
        checked += 1
    assert checked, "no refusal came after at least one admitted round"
