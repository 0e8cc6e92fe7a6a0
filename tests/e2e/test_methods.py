"""Every DP method runs from `flwr run` by name: 2 clients, 2 rounds, real simulation."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("strategy,extra", [
    ("gcfl", []), ("dpfedprox", ["prox-mu=0.1"]), ("dpscaffold", []), ("dpfedexp", []),
    ("dpfedavg", ["trainer=update-dp", "clip-norm=0.5", "lr=0.1", "local-epochs=2"]),
])
def test_method_runs_by_name(tmp_path, strategy, extra):
    proc = subprocess.run(
        [sys.executable, "-m", "dpfl.cli", "simulate", "--clients", "2", "--output-dir",
         str(tmp_path), f"strategy={strategy}", "dataset=digits", "num-rounds=2",
         "batch-size=32", "lr=0.5", "target-epsilon=8.0", "run-name=m", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "m" / "summary.json").read_text())
    rounds = [json.loads(l) for l in (tmp_path / "m" / "rounds.jsonl").read_text().splitlines()]
    assert summary["guarantee"]["verdict"] == "formal"
    assert [r["train"]["accepted"] for r in rounds] == [2, 2]
    assert summary["final"]["accuracy"] > summary["initial"]["accuracy"]
    assert all(c["epsilon"] <= 8.0 for c in summary["clients"].values())


def test_pegasus_selects_below_mean_clients(tmp_path):
    """Size-skewed clients have different sampling rates, hence different epsilons: from
    round 2 on only clients strictly below the mean epsilon are asked to train."""
    proc = subprocess.run(
        [sys.executable, "-m", "dpfl.cli", "simulate", "--clients", "3", "--output-dir",
         str(tmp_path), "strategy=pegasus", "dataset=digits", "partitioning=size",
         "num-rounds=3", "batch-size=32", "lr=0.5", "target-epsilon=8.0",
         "noise-multiplier=1.0", "run-name=p"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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


def test_aadp_runs_with_a_renyi_filter(tmp_path):
    """AADP-FL: longitudinal clipping + per-round calibrated noise, Nadam server, adaptive
    per-round budgets; each client's history is adaptive and bounded by the filter."""
    proc = subprocess.run(
        [sys.executable, "-m", "dpfl.cli", "simulate", "--clients", "2", "--output-dir",
         str(tmp_path), "strategy=aadp", "trainer=update-dp", "dataset=digits",
         "partitioning=size", "num-rounds=3", "batch-size=32", "lr=0.05", "clip-norm=1.0",
         "server-lr=0.01", "target-epsilon=30.0", "aadp-epsilon=4.0", "run-name=a"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ledger = json.loads((tmp_path / "a" / "ledger.json").read_text())
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["guarantee"]["verdict"] == "formal"
    assert "Rényi filter" in summary["guarantee"]["scope"]
    sigmas = {}
    for name, info in ledger["clients"].items():
        assert info["adaptive"] and info["unit"] == "client"
        sigmas[name] = info["events"][0]["sigma"]
    # size-skewed data: the bigger client gets the bigger per-round epsilon, less noise
    assert sigmas["client-1"] < sigmas["client-0"]
