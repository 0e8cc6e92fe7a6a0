"""The reproduction table: mean ± std over seeds beside the paper's numbers."""

import json

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
    for method, eps, sel in (("dpfedavg", 8.0, 50), ("pegasus", 3.0, 20)):
        rec = {"method": method, "seed": 0, "accuracy": 0.97,
               "epsilon": {f"client-{i}": eps for i in range(4)}, "selected-by-round": [sel],
               "mean-epsilon-by-round": [eps], "run-dir": str(tmp_path)}
        (tmp_path / "runs" / f"{method}__seed0.json").write_text(json.dumps(rec))
    from dpfl.privacy.ledger import Ledger

    Ledger(1e-5).save(tmp_path / "ledger.json")  # the staircase plot reads the run's ledger
    text = pegasus_table(tmp_path, "dpfl reproduce pegasus")
    assert "**62.5 %**" in text  # 1 - 3/8
    assert json.loads((tmp_path / "table.json").read_text())["reduction-percent"] == 62.5


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
