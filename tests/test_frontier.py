"""The frontier experiment's pieces (dpfl/experiments/frontier.py): every method's run-config
is valid over DP-SGD, the paired gap against a t-test worked by hand, selection on the
validation split, and the table and plot from hand-made records."""

import json
import math
from pathlib import Path

import pytest

from dpfl.experiments import frontier
from dpfl.experiments.common import write_record
from dpfl.methods import guarantee, parse_run_config

ROOT = Path(__file__).parent.parent


def _defaults() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


@pytest.mark.parametrize("method", frontier.ORDER)
def test_every_frontier_method_parses_over_dpsgd_with_a_formal_guarantee(method):
    """Each method's frontier run-config (preset, its keys, each tuning value, a cell's
    epsilon) is a valid run; every DP method runs sample-level DP-SGD with verdict formal."""
    base = frontier.METHODS[method].get("tuned-as", method)
    for config in frontier.TUNING[base]:
        for cell in ("mnist-eps2", "fmnist-eps8", "mnist-ceiling"):
            if (method == frontier.CEILING) != cell.endswith("ceiling"):
                continue
            cfg = parse_run_config({**_defaults(), **frontier.run_overrides(
                ROOT, cell, method, config, 0, "x")})
            if method == frontier.CEILING:
                assert cfg.trainer == "plain"
                continue
            assert cfg.trainer == "dpsgd" and cfg.target_epsilon == frontier.CELLS[cell][1]
            g = guarantee(cfg)
            assert (g.verdict, g.unit) == ("formal", "sample"), (method, g)


def test_paired_gap_matches_a_t_test_by_hand():
    """Diffs 2, 1, 5 pp: mean 8/3, sample sd sqrt(13/3), t = mean / (sd / sqrt 3); with 2
    degrees of freedom the two-sided p is 1 - t / sqrt(t^2 + 2) (closed form)."""
    method = [{"seed": s, "accuracy": a} for s, a in enumerate((0.90, 0.80, 0.85))]
    base = [{"seed": s, "accuracy": a} for s, a in enumerate((0.88, 0.79, 0.80))]
    gap, p, pairs = frontier.paired_gap(method, base)
    t = (8 / 3) / (math.sqrt(13 / 3) / math.sqrt(3))
    assert pairs == 3 and gap == pytest.approx(8 / 3)
    assert p == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-6)
    # only the seeds both ran are paired; one pair has no test
    gap, p, pairs = frontier.paired_gap(method[:1], base)
    assert (pairs, p) == (1, None) and gap == pytest.approx(2.0)


def _record(cell, method, seed, accuracy, **extra):
    return {"cell": cell, "method": method, "seed": seed, "accuracy": accuracy,
            "epsilon": {"client-0": 1.9, "client-1": 2.0}, "verdict": "formal",
            "randomness": "secret (OS entropy)", "validation-accuracy": accuracy, **extra}


def test_selection_is_on_validation_and_ablations_reuse_it(tmp_path):
    for i, val in enumerate((0.80, 0.91, 0.91)):
        write_record(tmp_path, frontier.tune_name("fedcompdp", i),
                     _record("mnist-eps4", "fedcompdp", 0, 0.5, tuning=i,
                             **{"validation-accuracy": val}))
    assert frontier.chosen_config(tmp_path, "fedcompdp") == (frontier.TUNING["fedcompdp"][1], 1)
    assert frontier.chosen_config(tmp_path, "fedcompdp-no-cra")[1] == 1
    assert frontier.chosen_config(tmp_path, "dpfedavg") is None   # not tuned yet


def test_table_and_plot_from_records(tmp_path):
    for seed, (a, b) in enumerate(((0.90, 0.88), (0.80, 0.79), (0.85, 0.80))):
        write_record(tmp_path, f"mnist-eps2__gcfl__seed{seed}", _record("mnist-eps2", "gcfl",
                                                                         seed, a))
        write_record(tmp_path, f"mnist-eps2__dpfedavg__seed{seed}",
                     _record("mnist-eps2", "dpfedavg", seed, b))
    write_record(tmp_path, "mnist-ceiling__fedavg__seed0",
                 {**_record("mnist-ceiling", "fedavg", 0, 0.98), "epsilon": {},
                  "verdict": "none"})
    write_record(tmp_path, "tune__gcfl__cfg0", _record("mnist-eps4", "gcfl", 0, 0.1, tuning=0))
    text = frontier.build_table(tmp_path, "dpfl reproduce frontier")
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["mnist-eps2"]["gcfl"]["gap-pp"] == pytest.approx(8 / 3)
    assert table["mnist-eps2"]["gcfl"]["max-epsilon"] == 2.0
    assert "mnist-eps4" not in table            # a tuning record is not a grid run
    assert "| GCFL | 3 | 85.00 ± 5.00 | +2.67 (3 seeds) |" in text
    assert "| FedAvg (no DP, ceiling) | 1 | 98.00 | — | — | ∞ | none |" in text
    assert (tmp_path / "frontier.png").stat().st_size > 10_000


@pytest.mark.parametrize("epsilon", [1.0, 8.0])
def test_aadp_per_round_epsilon_lets_the_mean_client_run_every_round(epsilon):
    """AADP-FL's aadp-epsilon in a frontier cell: the mean-size client's rounds, each at the
    sigma AADP-FL's client derives from it, fill its Rényi filter in num-rounds rounds: all
    10 are admitted, 11 are not."""
    from dpfl.methods.aadp import dpsgd_round_noise_multiplier
    from dpfl.privacy.accounting.filter import RenyiFilter
    from dpfl.privacy.mechanisms.release import DpsgdRelease
    from dpfl.privacy.plan import dpsgd_sample_rate, planned_dpsgd_steps

    over = frontier.run_overrides(ROOT, f"mnist-eps{epsilon:g}", "aadp", {}, 0, "x")
    cfg = parse_run_config({**_defaults(), **over})
    n = (20000 - 2000) // 10
    sigma = dpsgd_round_noise_multiplier(cfg, over["aadp-epsilon"], n)
    release = DpsgdRelease(sigma, dpsgd_sample_rate(n, cfg.batch_size),
                           planned_dpsgd_steps(n, cfg))
    events = [release.event(r) for r in range(1, 12)]
    budget = RenyiFilter(epsilon, cfg.delta)
    assert budget.admits(events[:10]) and not budget.admits(events)


def test_an_adaptive_runs_epsilon_is_its_filters_budget():
    """Issue 46.3: AADP-FL's frontier row showed 1.808, the plain PLD composition of its
    adaptively chosen rounds, beside "formal (Rényi filter)". What the run guarantees is
    the filter's budget (target-epsilon 2): records written before the fix are read so,
    and new records keep the composition apart, as informative."""
    from dpfl.experiments.common import record_epsilons

    old_aadp = {"config": {"strategy": "aadp", "trainer": "dpsgd", "target-epsilon": 2.0},
                "epsilon": {"client-0": 1.808, "client-1": 1.7}}
    assert record_epsilons(old_aadp) == {"client-0": 2.0, "client-1": 2.0}
    new_aadp = {**old_aadp, "epsilon": {"client-0": 2.0}, "composed-epsilon": {"client-0": 1.8}}
    assert record_epsilons(new_aadp) == {"client-0": 2.0}
    gcfl = {"config": {"strategy": "gcfl", "target-epsilon": 2.0}, "epsilon": {"client-0": 1.9}}
    assert record_epsilons(gcfl) == {"client-0": 1.9}
    plain = {"config": {"strategy": "aadp", "trainer": "plain"}, "epsilon": {"client-0": 0.0}}
    assert record_epsilons(plain) == {"client-0": 0.0}
