"""End to end: the central and distributed trust models in a real Flower simulation
(`dpfl simulate`, Ray backend) on digits."""

import pytest

from dpfl.privacy.accounting.events import PrivacyEvent, history_epsilon
from dpfl.privacy.trust import central_events

from federation import read_run, simulate_digits

pytestmark = pytest.mark.e2e


def test_central_dp_charges_every_client_every_round_with_amplification(tmp_path):
    """6 clients, Poisson sampling q = 0.5, adaptive clipping: round sizes vary, every
    client (sampled or not) carries exactly the amplified central events of every round
    (dp-accounting's PLD of them recomputed here), C moves, nothing exceeds the budget.
    Central evaluation every 2nd round and on the last; each round's phases recorded."""
    run = simulate_digits(tmp_path, "central", "trainer=update-dp", "trust=central",
                          "fraction-train=0.5", "num-rounds=3", "adaptive-clip=true",
                          "clip-count-stddev=2.0", "target-epsilon=8", "noise-multiplier=1.0",
                          "clip-norm=0.1", "lr=0.05", "evaluate-every=2", clients=6)
    rounds, ledger, summary, config = read_run(run)
    # evaluate-every=2: round 2 and the last round (3) are evaluated centrally, round 1 not
    assert ["central" in r for r in rounds] == [False, True, True]
    assert summary["final"] == rounds[-1]["central"]
    assert summary["guarantee"]["verdict"] == "formal"
    assert summary["guarantee"]["relation"] == "add-remove"
    assert summary["guarantee"]["sampling"] == "poisson"
    assert "trust=central" in summary["guarantee"]["scope"]
    assert len(ledger["population"]["clients"]) == 6
    events = [PrivacyEvent(**e) for e in ledger["population"]["events"]]
    assert events == [e for r in (1, 2, 3) for e in central_events(r, 1.0, 0.5, 2.0)]
    expected = history_epsilon(events, 1e-5, "pld")
    assert all(c["epsilon"] == pytest.approx(expected, rel=1e-9)
               for c in summary["clients"].values())
    assert len(summary["clients"]) == 6 and expected <= 8.0
    unsampled = [r for r in rounds if len(r["sampled-nodes"]) < 6]
    assert unsampled, "Poisson sampling with q = 0.5 never left a client out in 3 rounds"
    accepted = [c for r in rounds for c in r["clients"].values() if c["status"] == "accepted"]
    assert accepted and all(c["clip-unclipped"] in (0.0, 1.0) for c in accepted)
    # each round's wall time is split into its phases (bench/scale.py reads them)
    for r in rounds:
        phases = r["phase-seconds"]
        assert list(phases) == ["select", "exchange", "aggregate", "ledger", "evaluate",
                                "accounting"]
        assert all(v >= 0 for v in phases.values())
        assert sum(phases.values()) <= r["seconds"] + 0.01
    assert [r["started"] for r in rounds] == sorted(r["started"] for r in rounds)


@pytest.mark.parametrize("noise,n_rounds", [("skellam", 2), ("ddgauss", 1), ("cpsgd", 1)])
def test_distributed_dp_over_secagg_plus_survives_a_dropout(tmp_path, noise, n_rounds):
    """4 clients, n_min = 3, client 2 drops out after sharing its keys every round: the
    rounds complete (its pairwise masks are reconstructed from Shamir shares), the server
    sees no update in the clear, and only the 3 survivors are charged their event (Skellam
    shares, discrete Gaussian ones, or cpSGD's quantised binomial ones (``strategy=cpsgd``,
    charged ``binomial`` events): one short round each for the last two)."""
    # cpSGD with a given noise multiplier: calibrating its binomial accounting to a target
    # epsilon sums pmfs for minutes (dpfl.privacy.mechanisms.binomial); the charge is the same code
    noise_args = (("strategy=cpsgd", "noise-multiplier=4.0") if noise == "cpsgd"
                  else (f"secure-noise={noise}",))
    run = simulate_digits(tmp_path, "distributed", "trainer=update-dp", "trust=distributed",
                          f"num-rounds={n_rounds}", "target-epsilon=8", "secagg-min-survivors=3",
                          "secagg-drop-partition=2", *noise_args, clients=4)
    mechanism = "binomial" if noise == "cpsgd" else noise
    rounds, ledger, summary, config = read_run(run)
    assert summary["guarantee"]["verdict"] == "formal"
    assert summary["guarantee"]["relation"] == "replace-one"
    assert sorted(summary["clients"]) == ["client-0", "client-1", "client-3"]
    assert all(r["train"]["accepted"] == 3 for r in rounds)
    for client in ("client-0", "client-1", "client-3"):
        events = [PrivacyEvent(**e) for e in ledger["clients"][client]["events"]]
        assert [e.mechanism for e in events] == [mechanism] * n_rounds
        assert ledger["clients"][client]["epsilon"] <= 8.0
    assert rounds[-1]["central"]["accuracy"] >= 0.0


def test_flower_central_arm_reports_what_its_ledger_charged(tmp_path):
    """central-impl=flower: Flower's fixed-clipping wrapper over k = 4 of 4 clients, each
    round charged one Gaussian at sigma under replace-one with no amplification; the
    guarantee, the summary's per-client rows and the printed table say replace-one and no
    sampling (they said add-remove and Poisson, the configuration's central defaults)."""
    from dpfl.server.report import epsilon_table

    run = simulate_digits(tmp_path, "flower-central", "trainer=update-dp", "trust=central",
                          "central-impl=flower", "num-rounds=2", "target-epsilon=8",
                          "noise-multiplier=2.0", "clip-norm=0.1", "lr=0.05", clients=4)
    rounds, ledger, summary, config = read_run(run)
    events = [PrivacyEvent(**e) for e in ledger["population"]["events"]]
    assert events == [PrivacyEvent.gaussian(r, 2.0, relation="replace-one") for r in (1, 2)]
    g = summary["guarantee"]
    assert (g["relation"], g["sampling"]) == ("replace-one", "none")
    assert "DifferentialPrivacyServerSideFixedClipping" in g["scope"]
    assert all((c["relation"], c["sampling"]) == ("replace-one", "none")
               for c in summary["clients"].values()) and len(summary["clients"]) == 4
    table = epsilon_table(summary)
    assert "replace-one" in table and "add-remove" not in table and "poisson" not in table
    expected = history_epsilon(events, 1e-5, config["accountant"])
    assert all(c["epsilon"] == pytest.approx(expected, rel=1e-9)
               for c in summary["clients"].values())
