"""End to end: trust=central with correlated noise (central-noise=banded-mf) in a real
Flower simulation on digits: cohorts drawn under the participation schema (no sampling),
only participants charged, each client's epsilon the Gaussian at sigma over its pattern's
sensitivity, the schema stated in the guarantee."""

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from dpfl.config import RunConfig, validate
from dpfl.privacy.accounting.events import PrivacyEvent, history_epsilon
from dpfl.privacy.correlated_charging import correlated_charge, schema_of

from federation import read_run, simulate_digits

pytestmark = pytest.mark.e2e


def test_banded_mf_central_run_keeps_the_schema_and_charges_participants_only(tmp_path):
    """4 clients, cohorts of 2 (fraction-train 0.5), 4 rounds, k = 2, b = 2: every round
    has 2 clients the schema allows; no client takes part twice within 2 rounds or more
    than twice; only participants are in the ledger, each charged one Gaussian per
    participation at sigma / ||C[:, t]||; a client with rounds 1 and 3 (whole columns) has
    exactly dp-accounting's Gaussian at sigma / sensitivity, at most target-epsilon."""
    run = simulate_digits(tmp_path, "banded", "trainer=update-dp", "trust=central",
                          "central-noise=banded-mf", "fraction-train=0.5", "num-rounds=4",
                          "max-participations=2", "min-separation=2", "target-epsilon=4",
                          "clip-norm=0.1", "lr=0.05", clients=4)
    rounds, ledger, summary, config = read_run(run)
    cfg = validate(RunConfig(trainer="update-dp", trust="central", central_noise="banded-mf",
                             fraction_train=0.5, num_rounds=4, max_participations=2,
                             min_separation=2, target_epsilon=4.0, delta=config["delta"],
                             accountant=config["accountant"]))
    charge = correlated_charge(cfg)
    schema = schema_of(cfg)
    g = summary["guarantee"]
    assert g["verdict"] == "formal" and (g["relation"], g["sampling"]) == ("add-remove", "none")
    assert schema.statement() in g["scope"] and "Poisson" not in g["scope"]
    assert not ledger["population"]["clients"] and not ledger["population"]["events"]
    took_part: dict[str, list[int]] = {}
    for r in rounds:
        assert len(r["sampled-nodes"]) <= 2
        for name, c in r["clients"].items():
            if c["status"] == "accepted":
                took_part.setdefault(name, []).append(r["round"])
    assert took_part, "no client took part"
    for name, part in took_part.items():
        assert schema.is_feasible([t - 1 for t in part]), (name, part)
    charged = {c for c, h in ledger["clients"].items() if h["server-events"]}
    assert charged == set(took_part) == set(summary["clients"])
    target_z = charge.noise_std / charge.sensitivity
    expected_full = pld_privacy_accountant.PLDAccountant().compose(
        dp_event.GaussianDpEvent(target_z)).get_epsilon(cfg.delta)
    for name, part in took_part.items():
        events = [PrivacyEvent(**e) for e in ledger["clients"][name]["server-events"]]
        assert sorted(e.round for e in events) == part
        assert [e.sigma for e in events] == pytest.approx(
            [charge.noise_std / math.sqrt(charge.weights2[t - 1]) for t in part], rel=1e-12)
        eps = summary["clients"][name]["epsilon"]
        assert eps == pytest.approx(history_epsilon(events, cfg.delta, cfg.accountant),
                                    rel=1e-9)
        assert eps <= 4.0 * (1 + 1e-3)
        if part == [1, 3]:   # whole columns at the separation: the worst pattern
            assert eps == pytest.approx(expected_full, rel=2e-3)
    assert rounds[-1]["central"]["accuracy"] >= 0.0
