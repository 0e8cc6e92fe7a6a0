"""The reproduction table: mean ± std over seeds beside the paper's numbers."""

import json
from pathlib import Path

import pytest

from dpfl.experiments.gcfl import PAPER, build_table


def _record(tmp, cell, method, seed, acc):
    rec = {"cell": cell, "method": method, "seed": seed, "accuracy": acc,
           "macro-recall": acc - 0.01, "macro-f1": acc - 0.02, "epsilon": {"client-0": 1.99},
           "samples-per-second": 1000.0}
    (tmp / "runs").mkdir(exist_ok=True)
    (tmp / "runs" / f"{cell}__{method}__seed{seed}.json").write_text(json.dumps(rec))


def test_table_means_stds_and_paper_columns(tmp_path):
    _record(tmp_path, "eps2", "gcfl", 0, 0.90)
    _record(tmp_path, "eps2", "gcfl", 1, 0.92)
    _record(tmp_path, "eps2", "dpfedavg", 0, 0.88)
    text = build_table(tmp_path, "dpfl reproduce gcfl --seeds 0 1")
    gcfl_row = next(l for l in text.splitlines() if l.startswith("| GCFL"))
    # mean 91.00, sample std of (90, 92) = 1.41; paper 91.11
    assert "| 2 | 91.00 ± 1.41 | 91.11 |" in gcfl_row
    fedavg_row = next(l for l in text.splitlines() if l.startswith("| DP-FedAvg"))
    assert f"| 1 | 88.00 | {PAPER['eps2']['dpfedavg'][0]:.2f} |" in fedavg_row
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["eps2"]["gcfl"]["seeds"] == [0, 1]
    assert (tmp_path / "accuracy.png").exists()


def test_pegasus_table_reduction(tmp_path):
    from dpfl.experiments.pegasus import build_table as pegasus_table

    (tmp_path / "runs").mkdir()
    for method, eps, sel in (("dpfedavg", 8.0, 50), ("pegasus", 3.0, 20), ("uniform", 4.0, 25)):
        rec = {"method": method, "seed": 0, "accuracy": 0.97,
               "epsilon": {f"client-{i}": eps for i in range(4)}, "selected-by-round": [sel],
               "mean-epsilon-by-round": [eps], "run-dir": str(tmp_path)}
        (tmp_path / "runs" / f"{method}__seed0.json").write_text(json.dumps(rec))
    from dpfl.privacy.accounting.ledger import Ledger

    Ledger(1e-5).save(tmp_path / "ledger.json")  # old records: the staircase reads the ledger
    text = pegasus_table(tmp_path, "dpfl reproduce pegasus")
    assert "**62.5 %**" in text  # 1 - 3/8
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["calibrated"]["reduction-percent"] == 62.5  # records without a cell
    assert table["calibrated"]["uniform-reduction-percent"] == 50.0  # the control: 1 - 4/8
    assert "per round at the same σ: final mean ε reduction **50.0 %**" in text
    assert "common-sigma" not in table


def test_pegasus_cells_are_tabulated_apart(tmp_path):
    from dpfl.experiments.pegasus import build_table as pegasus_table
    from dpfl.experiments.pegasus import record_name

    (tmp_path / "runs").mkdir()
    for cell, peg_eps in (("calibrated", 6.0), ("common-sigma", 2.0)):
        for method, eps in (("dpfedavg", 8.0), ("pegasus", peg_eps)):
            rec = {"cell": cell, "method": method, "seed": 0, "accuracy": 0.9,
                   "epsilon": {"client-0": eps, "client-1": eps}, "selected-by-round": [2, 1],
                   "mean-epsilon-by-round": [eps / 2, eps],
                   "epsilon-by-round": [{"client-0": eps / 2, "client-1": eps / 2},
                                        {"client-0": eps, "client-1": eps}]}
            name = record_name(cell, method, 0)
            (tmp_path / "runs" / f"{name}.json").write_text(json.dumps(rec))
    assert record_name("calibrated", "pegasus", 3) == "pegasus__seed3"
    assert record_name("common-sigma", "pegasus", 3) == "common-sigma__pegasus__seed3"
    pegasus_table(tmp_path, "dpfl reproduce pegasus --cells calibrated common-sigma")
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["calibrated"]["reduction-percent"] == 25.0  # 1 - 6/8
    assert table["common-sigma"]["reduction-percent"] == 75.0  # 1 - 2/8
    assert table["common-sigma"]["pegasus"]["clients-per-round"] == [1.5]
    assert (tmp_path / "epsilon.png").exists()


def test_pegasus_staircase_picks_spread_clients():
    from dpfl.experiments.pegasus import _staircases

    final = {f"client-{i}": float(i) for i in range(20)}
    rec = {"epsilon-by-round": [{c: e / 2 for c, e in final.items()}, final]}
    picks = _staircases(rec, count=4)
    # ranks 0, 6, 13, 19 of 20 clients sorted by final epsilon: lowest, two between, highest
    assert list(picks) == ["client-0", "client-6", "client-13", "client-19"]
    assert picks["client-6"] == [(1, 3.0), (2, 6.0)]
    assert _staircases({"run-dir": "/nonexistent"}) == {}


def test_aadp_table_median_and_units(tmp_path):
    from dpfl.experiments.aadp import PAPER as AADP_PAPER
    from dpfl.experiments.aadp import build_table as aadp_table

    (tmp_path / "runs").mkdir()
    for seed, acc in enumerate((0.90, 0.80, 0.95)):  # median of three = 90
        rec = {"cell": "mnist-mlp", "method": "aadp", "seed": seed, "accuracy": acc,
               "epsilon": {"client-0": 51.0 + seed}, "verdict": "formal",
               "accuracy-by-round": [acc], "raised-at-rounds": [30]}
        (tmp_path / "runs" / f"mnist-mlp__aadp__seed{seed}.json").write_text(json.dumps(rec))
    text = aadp_table(tmp_path, "dpfl reproduce aadp")
    row = next(l for l in text.splitlines() if l.startswith("| AADP-FL (calibrated"))
    assert f"| 3 | 90.00 | {AADP_PAPER['mnist-mlp']['aadp']:.2f} | client, per round | 53 |" in row
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["mnist-mlp"]["aadp"]["median-accuracy"] == 90.0


def test_aadp_table_non_private_row(tmp_path):
    """FedAvg has no DP: no client epsilon at all; its row says so instead of failing."""
    from dpfl.experiments.aadp import build_table as aadp_table

    (tmp_path / "runs").mkdir()
    rec = {"cell": "mnist-mlp", "method": "fedavg", "seed": 0, "accuracy": 0.93,
           "epsilon": {}, "verdict": "none: no DP mechanism", "accuracy-by-round": [0.93]}
    (tmp_path / "runs" / "mnist-mlp__fedavg__seed0.json").write_text(json.dumps(rec))
    row = next(l for l in aadp_table(tmp_path, "x").splitlines() if l.startswith("| FedAvg"))
    assert "| 93.00 | 92.13 | — | — | none |" in row


def test_reproduce_rejects_unknown_cells_before_running(tmp_path, capsys):
    from dpfl.cli import main

    for paper in ("gcfl", "pegasus", "aadp"):
        for option in ("--cells", "--methods"):
            assert main(["reproduce", paper, option, "nope", "--results", str(tmp_path)]) == 2
            assert "unknown" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing ran, nothing written


def test_aadp_sweep_methods_are_calibrated_aadp_with_a_larger_budget(tmp_path):
    """The eps sweep is the calibrated method with only the per-round budget changed; it has no
    paper number, and the default grid does not run it."""
    from pathlib import Path

    from dpfl.experiments.aadp import (
        DEFAULT_METHODS,
        METHODS,
        SWEEP_EPSILONS,
        overrides_for,
    )
    from dpfl.experiments.aadp import build_table as aadp_table

    root = Path(__file__).resolve().parents[1]
    base = overrides_for(root, "mnist-mlp", "aadp", 0)
    for eps in SWEEP_EPSILONS:
        swept = overrides_for(root, "mnist-mlp", f"aadp-eps{eps}", 0)
        assert swept["aadp-epsilon"] == float(eps) and "aadp-noise" not in METHODS[f"aadp-eps{eps}"]
        differs = {k for k in swept if swept[k] != base.get(k)}
        assert differs == {"aadp-epsilon", "run-name"}
        assert f"aadp-eps{eps}" not in DEFAULT_METHODS
    (tmp_path / "runs").mkdir()
    rec = {"cell": "mnist-mlp", "method": "aadp-eps256", "seed": 0, "accuracy": 0.5,
           "epsilon": {"client-0": 9e4}, "verdict": "formal", "accuracy-by-round": [0.5],
           "randomness": "secret (OS entropy)"}
    (tmp_path / "runs" / "mnist-mlp__aadp-eps256__seed0.json").write_text(json.dumps(rec))
    row = next(l for l in aadp_table(tmp_path, "x").splitlines() if "ε = 256" in l)
    assert "| 1 | 50.00 | — | client, per round | 9.00e+04 | formal |" in row
    # a record made before DP randomness was secret cannot keep its 'formal' verdict
    del rec["randomness"]
    (tmp_path / "runs" / "mnist-mlp__aadp-eps256__seed0.json").write_text(json.dumps(rec))
    text = aadp_table(tmp_path, "x")
    row = next(l for l in text.splitlines() if "ε = 256" in l)
    assert row.endswith("| none |") and "1 run(s) public-seeded" in text


def test_pegasus_epsilon_spread_is_min_and_max_over_clients_per_round():
    from dpfl.experiments.pegasus import epsilon_spread

    record = {"epsilon-by-round": [{"client-0": 1.0, "client-1": 3.0},
                                   {"client-0": 2.5, "client-1": 3.0, "client-2": 0.5}]}
    assert epsilon_spread(record) == ([1.0, 0.5], [3.0, 3.0])
    assert epsilon_spread({"run-dir": "/old"}) == ([], [])


def test_aadp_sweep_points_order_by_round_budget_and_take_medians(tmp_path):
    from dpfl.experiments.aadp import build_table as aadp_table
    from dpfl.experiments.aadp import sweep_points

    def rec(method, seed, acc, eps):
        return {"cell": "mnist-mlp", "method": method, "seed": seed, "accuracy": acc,
                "epsilon": {"client-0": eps}, "verdict": "formal", "accuracy-by-round": [acc]}

    runs = [rec("aadp-eps64", 0, 0.9, 1700.0), rec("aadp", 0, 0.2, 46.0),
            rec("aadp", 1, 0.1, 47.0), rec("aadp", 2, 0.3, 45.0), rec("fedavg", 0, 0.95, 0.0)]
    assert sweep_points(runs, "mnist-mlp") == [(4.0, 0.2, 47.0), (64.0, 0.9, 1700.0)]
    assert sweep_points(runs, "mnist-cnn") == []
    (tmp_path / "runs").mkdir()
    for i, r in enumerate(runs):
        (tmp_path / "runs" / f"r{i}.json").write_text(json.dumps(r))
    aadp_table(tmp_path, "x")
    assert (tmp_path / "sweep.png").exists() and (tmp_path / "accuracy.png").exists()


def test_fedasgp_matched_budget_is_the_strict_ledger_of_a_client_in_every_round():
    """Every arm's target: the ledger of R pure events at the cell's epsilon per round (basic
    composition R eps when it is smaller, else the pure-DP RDP bound); a Gaussian arm
    calibrated to it over R rounds ends at that epsilon too."""
    import numpy as np
    from dp_accounting.rdp.rdp_privacy_accountant import (
        DEFAULT_RDP_ORDERS,
        compute_epsilon,
    )

    from dpfl.experiments.fedasgp import matched_epsilon
    from dpfl.privacy.accounting.accountants import calibrate_noise
    from dpfl.privacy.accounting.events import PrivacyEvent, history_epsilon

    assert matched_epsilon(4.0, 30, 1e-5, "rdp") == 120.0
    orders = np.asarray(DEFAULT_RDP_ORDERS)
    rdp, _ = compute_epsilon(orders, 30 * np.minimum(0.1, orders * 0.1 ** 2 / 2), 1e-5)
    assert matched_epsilon(0.1, 30, 1e-5, "rdp") == rdp < 3.0
    for eps in (0.1, 2.0):
        target = matched_epsilon(eps, 30, 1e-5, "rdp")
        sigma = calibrate_noise(target, 1e-5, 30, accountant="rdp", relation="replace-one")
        gaussian = [PrivacyEvent.gaussian(r, sigma, relation="replace-one") for r in range(30)]
        assert history_epsilon(gaussian, 1e-5, "rdp") == pytest.approx(target, rel=1e-3)


def test_fedasgp_run_config_gives_every_arm_the_cells_budget():
    from dpfl.experiments.fedasgp import MIA_METHODS, REPRODUCTION, matched_epsilon

    root = Path(__file__).resolve().parents[1]
    for cell, eps, rounds in (("eps0.2", 0.2, 30), ("paper-eps0.2", 0.2, 200)):
        target = matched_epsilon(eps, rounds, 1e-5, "rdp")
        for arm in [a for a in REPRODUCTION.methods if a not in MIA_METHODS]:
            o = REPRODUCTION.overrides(root, cell, arm, 0)
            assert o["target-epsilon"] == target and o["num-rounds"] == rounds
            assert o["trainer"] == "update-dp" and o["noise-multiplier"] == 0.0
            assert o["fraction-train"] == 0.1 and o["dirichlet-alpha"] == 1.0
            assert o.get("asgp-epsilon") == (eps if arm.startswith("fedasgp") else None)
    assert REPRODUCTION.overrides(root, "paper-eps1", "dpfedavg", 0)["train-subset"] == 0


def test_fedasgp_table_budget_ledger_paper_columns_and_plots(tmp_path):
    from dpfl.experiments.fedasgp import PAPER
    from dpfl.experiments.fedasgp import build_table as fedasgp_table

    (tmp_path / "runs").mkdir()
    arms = (("dpfedavg", "formal", None, 0.80), ("fedasgp-paper", "none: raw", 0.5, 0.90),
            ("fedasgp-strict", "formal", 0.5, 0.20), ("fedsmp-randk", "formal", None, 0.70))
    for seed in (0, 1):
        for arm, verdict, round_eps, acc in arms:
            rec = {"cell": "eps0.5", "method": arm, "seed": seed, "accuracy": acc + seed / 100,
                   "config": {"target-epsilon": 15.0}, "verdict": verdict,
                   "randomness": "secret (OS entropy)",
                   "epsilon": {"client-0": 1.5, "client-7": 3.0 + seed},
                   "accuracy-by-round": [0.1, acc], "round-epsilon": round_eps}
            if arm.startswith("fedasgp"):
                rec["significant-fraction-by-round"] = [0.01, 0.02]
                rec["gamma-spread-by-round"] = [0.05, None]
            (tmp_path / "runs" / f"eps0.5__{arm}__seed{seed}.json").write_text(json.dumps(rec))
    text = fedasgp_table(tmp_path, "dpfl reproduce fedasgp --cells eps0.5")
    row = next(l for l in text.splitlines() if l.startswith("| eps0.5 | 0.5 |"))
    assert "| 15 | 80.50 ± 0.71 (n = 2) | 90.50 ± 0.71 (n = 2) |" in row
    assert row.endswith(f"| {PAPER[0.5][0]:.2f} | {PAPER[0.5][1]:.2f} |")
    strict = next(l for l in text.splitlines()
                  if l.startswith("| eps0.5 | DP-FedASGP strict"))
    assert "| 4 / 2.5 (2/2) | 0.5 | formal |" in strict
    assert "| 1 | 15.15 |" in text          # the strict variant at the paper's scales
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["eps0.5"]["fedasgp-paper"]["paper"] == PAPER[0.5][1]
    assert table["eps0.5"]["budget"] == 15.0
    for plot in ("accuracy.png", "significant.png", "gamma.png"):
        assert (tmp_path / plot).exists()


def test_pegasus_uniform_control_is_dpfedavg_at_pegasus_participation():
    from dpfl.experiments.pegasus import REPRODUCTION, UNIFORM_FRACTION

    over = REPRODUCTION.overrides(Path(__file__).parent.parent, "calibrated", "uniform", 3)
    assert over["strategy"] == "dpfedavg" and over["fraction-train"] == UNIFORM_FRACTION == 0.51
    assert over["noise-multiplier"] == 0.0 and over["target-epsilon"] == 8.0  # same sigma
    assert over["run-name"] == "uniform__seed3"   # the calibrated cell names runs without it


@pytest.mark.parametrize("eps", [4, 8])
def test_fedcompdp_control_cells_calibrate_sigma_to_a_protective_client_level_epsilon(eps):
    """The control cells run FedCompDP's grid at sigma calibrated for the whole run (20
    participations, replace-one Gaussian) to end at client-level epsilon 4 or 8."""
    import tomllib

    from dpfl.experiments.fedcompdp import REPRODUCTION
    from dpfl.methods import guarantee, parse_run_config
    from dpfl.privacy.accounting.budget import PrivacyHistory
    from dpfl.privacy.accounting.events import PrivacyEvent
    from dpfl.privacy.plan import noise_multiplier_for

    root = Path(__file__).parent.parent
    defaults = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    over = REPRODUCTION.overrides(root, f"mnist-dir0.5-eps{eps}", "fedcompdp", 0)
    cfg = parse_run_config({**defaults, **over})
    sigma = noise_multiplier_for(cfg, 1)
    events = [PrivacyEvent.gaussian(r, sigma, relation="replace-one") for r in range(1, 21)]
    spent = PrivacyHistory(events).epsilon(cfg.delta, cfg.accountant)
    assert spent == pytest.approx(eps, rel=0.01) and spent <= eps
    assert guarantee(cfg).verdict == "formal" and guarantee(cfg).unit == "client"


def test_fedasgp_attack_cells_run_dpsgd_arms_at_the_composed_budget():
    """The Table III cells: 10 clients, every arm over DP-SGD (the ceiling plain), the
    whole-run target = 5 pure events of the cell's epsilon composed (over 5 rounds basic
    composition, 5 x epsilon, is the smaller bound at every cell's epsilon), the per-round models
    kept for CS-MIA; the attack arms refuse the Table VI cells and the reverse."""
    from dpfl.experiments.fedasgp import MIA_METHODS, REPRODUCTION, matched_epsilon

    root = Path(__file__).resolve().parents[1]
    assert REPRODUCTION.clients_for("mia-eps0.5") == 10 and REPRODUCTION.clients_for("eps1") == 100
    o = REPRODUCTION.overrides(root, "mia-eps0.5", "fedasgp-dpsgd", 0)
    assert o["trainer"] == "dpsgd" and o["record-global-models"] is True
    assert o["num-rounds"] == 5 and "asgp-epsilon" not in o and o["server-holdout"] > 0
    assert o["target-epsilon"] == pytest.approx(2.5)
    assert REPRODUCTION.overrides(root, "mia-eps0.1", "dpfedavg-dpsgd", 0)["target-epsilon"] \
        == matched_epsilon(0.1, 5, 1e-5, "pld") == pytest.approx(0.5)
    ceiling = REPRODUCTION.overrides(root, "mia-eps0.2", "fedavg-plain", 0)
    assert ceiling["trainer"] == "plain" and ceiling["local-epochs"] == 5
    assert REPRODUCTION.overrides(root, "mia-eps0.2", "fedsmp-dpsgd", 0)["fedsmp-mask"] == "topk"
    with pytest.raises(ValueError, match="attack cells"):
        REPRODUCTION.overrides(root, "eps0.5", "dpfedavg-dpsgd", 0)
    with pytest.raises(ValueError, match="attack cells"):
        REPRODUCTION.overrides(root, "mia-eps0.5", "dpfedavg", 0)
    assert set(MIA_METHODS) <= set(REPRODUCTION.methods)
    assert not set(MIA_METHODS) & set(REPRODUCTION.default_methods)


def test_fedasgp_attack_table_beside_the_papers_row(tmp_path):
    from dpfl.experiments.fedasgp import PAPER_MIA
    from dpfl.experiments.fedasgp import build_table as fedasgp_table

    (tmp_path / "runs").mkdir()
    for seed, cs in ((0, 0.52), (1, 0.54)):
        rec = {"cell": "mia-eps0.5", "method": "dpfedavg-dpsgd", "seed": seed,
               "accuracy": 0.6, "config": {"target-epsilon": 2.5}, "verdict": "formal",
               "randomness": "secret (OS entropy)", "epsilon": {"client-0": 2.5},
               "attack": {name: {"accuracy": 0.5, "auc": 0.5, "tpr@1%fpr": 0.01,
                                 "members": 100}
                          for name in ("loss", "ml-leaks", "rmia", "gradient-norm")}}
        rec["attack"]["cs-mia"] = {"accuracy": cs, "auc": 0.55, "tpr@1%fpr": 0.02,
                                   "members": 100}
        (tmp_path / "runs" / f"mia-eps0.5__dpfedavg-dpsgd__seed{seed}.json").write_text(
            json.dumps(rec))
    text = fedasgp_table(tmp_path, "dpfl reproduce fedasgp --cells mia-eps0.5")
    assert "## Accuracy (Table VI shape)" not in text       # no Table VI record
    row = next(l for l in text.splitlines() if l.startswith("| 0.5 | 2.5 | DP-FedAvg"))
    # columns: Basic-MIA, ML-Leaks, White-box, CS-MIA (mean ± std of 52 and 54), RMIA
    assert ("| 2 | 60.00 ± 0.00 | 50.00 ± 0.00 | 50.00 ± 0.00 | 50.00 ± 0.00 | 53.00 ± 1.41 "
            "| 50.00 ± 0.00 |") in row
    assert row.endswith("| 50.13 / 50.39 / 50.83 / 51.46 |")
    assert PAPER_MIA[0.5]["DP-FedAvg"] == (50.13, 50.39, 50.83, 51.46)
    assert any(l.startswith("| 0.5 | 2.5 | cpSGD: not run in this cell (arm `cpsgd-secagg`)")
               for l in text.splitlines())
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["attacks"]["mia-eps0.5"]["dpfedavg-dpsgd"]["attacks"]["cs-mia"] == [0.52, 0.54]
