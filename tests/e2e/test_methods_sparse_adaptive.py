"""FedCompDP (its formal reading, update DP and DP-SGD), DP-FedASGP (strict, and over DP-SGD)
and Fed-SMP rand-k run from `dpfl simulate` and state their verdicts; each one's mechanism
read back from its run directory (split from test_methods.py so that two test workers share
the e2e load)."""


import pytest

from federation import read_run as _read
from federation import simulate_digits as _simulate

pytestmark = pytest.mark.e2e


# The readings that release in the clear (adpc=raw-norm, cra-score=client-f1: verdict none)
# are checked through the strategy and the client's release in tests/test_fedcompdp.py
# (test_next_clip_per_reading, test_verdict_per_reading,
# test_client_release_raw_norm_reports_the_pre_noise_norm): a federation costs ~27 s of CPU,
# so only the formal reading runs end to end, under both trainers.
@pytest.mark.parametrize("trainer", ["update-dp", "dpsgd"])
def test_fedcompdp_formal_reading_runs_under_both_trainers(tmp_path, trainer):
    """FedCompDP from `dpfl simulate` with ADPC's private quantile and CRA scored on the
    server's validation split (3 clients, 2 rounds): the verdict is formal, at client level
    under update DP and at sample level under DP-SGD; every client is charged one release
    per round at the run's sigma whatever C_t is (a Gaussian under update DP, a DP-SGD round
    under dpsgd); C_t of round 2 follows the noisy unclipped fraction; the CRA weights sum
    to 1; the clients send the noisy count their trainer releases and no raw norm."""
    run = _simulate(tmp_path, "f", "strategy=fedcompdp", f"trainer={trainer}",
                    "adpc=private-quantile", "cra-score=server-val", "num-rounds=2", "lr=0.5",
                    "noise-multiplier=0.3", "target-epsilon=1e6", "server-holdout=100",
                    "llcm-ratio=0.5", clients=3)
    rounds, ledger, summary, config = _read(run)
    assert summary["guarantee"]["verdict"] == "formal", summary["guarantee"]
    assert summary["guarantee"]["unit"] == ("sample" if trainer == "dpsgd" else "client")
    assert ledger["mismatches"] == []
    mechanism = "dpsgd" if trainer == "dpsgd" else "gaussian"
    for info in ledger["clients"].values():
        assert [(e["mechanism"], e["sigma"]) for e in info["events"]] == [(mechanism, 0.3)] * 2
    first, second = (r["train"] for r in rounds)
    assert first["accepted"] == second["accepted"] == 3
    assert first["clip-norm"] == 1.0
    assert 0.7 < second["clip-norm"] < 1.4  # exp(-0.2 (b - 0.5)), b the noisy fraction
    for t in (first, second):
        weights = [v for k, v in t.items() if k.startswith("cra-weight-")]
        assert len(weights) == 3 and sum(weights) == pytest.approx(1.0)
    reported = rounds[0]["clients"]["client-0"]
    assert "update-norm" not in reported
    assert ("adpc-unclipped" in reported) is (trainer == "update-dp")
    assert ("dpsgd-unclipped-fraction" in reported) is (trainer == "dpsgd")


# The paper variant (verdict none: its loss goes out in the clear and its noise is not
# calibrated) runs through the real ClientApp and the strategy in tests/test_fedasgp.py
# (test_client_app_release_equals_the_servers_plan_and_is_accepted[paper], test_verdicts,
# test_reply_problems): only the formal variants run end to end here (DP-SGD: below).
def test_fedasgp_strict_variant_runs_and_is_formal(tmp_path):
    """DP-FedASGP's strict variant from `dpfl simulate` (3 clients, 2 rounds, update DP):
    every client is charged one pure sparse-vector event per round at the round's epsilon
    (1.0), planned and reported alike (no mismatch); the eq. 16 weights of the 3 clients sum
    to 1; a client releases at most c coordinates and no loss; the verdict is formal."""
    import torch

    run = _simulate(tmp_path, "a", "strategy=fedasgp", "trainer=update-dp",
                    "asgp-variant=strict", "asgp-max-coords=50", "num-rounds=2", "lr=0.5",
                    "target-epsilon=4.0", clients=3)
    rounds, ledger, summary, _ = _read(run)
    assert summary["guarantee"]["verdict"] == "formal", summary["guarantee"]
    assert ledger["mismatches"] == []
    assert len(ledger["clients"]) == 3
    for info in ledger["clients"].values():
        assert [(e["mechanism"], e["relation"]) for e in info["events"]] == \
            [("sparse-vector", "replace-one")] * 2
        assert all(e["epsilon"] == pytest.approx(1.0, rel=1e-12) for e in info["events"])
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=False)
    dim = sum(v.numel() for v in checkpoint["model"].values())
    for r in rounds:
        t = r["train"]
        assert t["accepted"] == 3
        assert t["asgp-round-epsilon"] == pytest.approx(1.0)
        weights = [v for k, v in t.items() if k.startswith("asgp-gamma-client-")]
        assert len(weights) == 3 and sum(weights) == pytest.approx(1.0)
        assert t["asgp-gamma-spread"] == pytest.approx(max(weights) - min(weights))
        assert 0 < t["asgp-significant-fraction"] * dim <= 50 + 1e-9
    assert "asgp-loss" not in rounds[0]["clients"]["client-0"]
    assert all(c["epsilon"] == pytest.approx(2.0, rel=1e-9)
               for c in summary["clients"].values())


def test_fedasgp_over_dpsgd_selects_by_eq14_and_weights_by_the_servers_proxy(tmp_path):
    """DP-FedASGP over DP-SGD (3 clients, 2 rounds): one DP-SGD event per client and round
    (sample level, formal); clients send no loss; the kept share of coordinates is eq. 14's
    (T = 2: about half in round 1, a tenth in round 2); the eq. 16 weights from the server's
    validation-loss proxy sum to 1."""
    run = _simulate(tmp_path, "d", "strategy=fedasgp", "trainer=dpsgd", "server-holdout=100",
                    "num-rounds=2", "lr=0.5", "target-epsilon=8.0", clients=3)
    rounds, ledger, summary, _ = _read(run)
    assert (summary["guarantee"]["verdict"], summary["guarantee"]["unit"]) == ("formal", "sample")
    assert ledger["mismatches"] == []
    for info in ledger["clients"].values():
        assert [e["mechanism"] for e in info["events"]] == ["dpsgd"] * 2
    for r, share in zip(rounds, (0.5, 0.1)):
        t = r["train"]
        assert t["accepted"] == 3
        assert t["asgp-significant-fraction"] == pytest.approx(share, abs=1e-3)
        weights = [v for k, v in t.items() if k.startswith("asgp-gamma-client-")]
        assert len(weights) == 3 and sum(weights) == pytest.approx(1.0)
        assert not any(k in c for c in r["clients"].values()
                       for k in ("asgp-loss", "train-loss", "asgp-significant"))
    assert summary["final"]["accuracy"] > summary["initial"]["accuracy"]


def test_fedsmp_randk_runs_with_the_public_mask_and_the_shared_plan(tmp_path):
    """Fed-SMP rand-k from `dpfl simulate` (3 clients, 2 rounds, digits): every client is
    charged one Gaussian per round at the run's calibrated sigma under replace-one, planned
    and reported alike (no mismatch); each round's replies keep k = round(0.1 d) coordinates
    (the kept fraction) and, the mask being public, the server rejected none of them as
    outside it; the verdict is formal and the clients end within target-epsilon."""
    import torch

    from dpfl.methods.fedsmp import kept_count

    run = _simulate(tmp_path, "smp", "strategy=fedsmp", "trainer=update-dp", "fedsmp-mask=randk",
                    "fedsmp-ratio=0.1", "num-rounds=2", "lr=0.5", "target-epsilon=8.0",
                    clients=3)
    rounds, ledger, summary, _ = _read(run)
    assert summary["guarantee"]["verdict"] == "formal", summary["guarantee"]
    assert ledger["mismatches"] == []
    sigmas = set()
    for info in ledger["clients"].values():
        assert [(e["mechanism"], e["relation"]) for e in info["events"]] == \
            [("gaussian", "replace-one")] * 2
        sigmas |= {e["sigma"] for e in info["events"]}
    assert len(sigmas) == 1 and len(ledger["clients"]) == 3
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=False)
    dim = sum(v.numel() for v in checkpoint["model"].values())
    for r in rounds:
        t = r["train"]
        assert t["accepted"] == 3 and t["rejected"] == 0
        assert t["fedsmp-kept-fraction"] == pytest.approx(kept_count(dim, 0.1) / dim, rel=1e-6)
    assert all(c["epsilon"] <= 8.0 * (1 + 1e-6) for c in summary["clients"].values())
