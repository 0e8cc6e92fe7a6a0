"""`dpfl audit` and `dpfl attack` on real simulated federations (digits, 12 clients, 2-3
rounds): a non-private run leaks (canaries found, attacks score), a formal run's audited
bound stays under its ledger's epsilon, and both commands write their reports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dpfl.privacy.canaries import canary_bits

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 12


def _dpfl(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpfl.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _simulate(tmp_path: Path, name: str, *overrides: str) -> Path:
    proc = _dpfl("simulate", "--clients", str(CLIENTS), "--output-dir", str(tmp_path),
                 "dataset=digits", "model=mlp", "batch-size=32", "lr=0.5", "val-fraction=0",
                 f"min-train-nodes={CLIENTS}", f"run-name={name}", *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / name


def test_non_private_run_is_audited_and_attacked(tmp_path):
    # 20 local epochs on ~150 digits: each client's update overfits its records
    run = _simulate(tmp_path, "plain", "strategy=fedavg", "trainer=plain", "num-rounds=3",
                    f"audit-canaries={CLIENTS}", "audit-seed=11", "record-updates=3",
                    "local-epochs=20")
    bits = canary_bits(11, CLIENTS)
    assert bool(bits[0]) and not bool(bits[2])   # client 0 sent canaries, client 2 trained
    proc = _dpfl("audit", str(run))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    audit = json.loads((run / "audit.json").read_text())
    # no noise: the canary sums separate perfectly, the bound is what 12 canaries allow
    assert audit["canaries-seen"] == CLIENTS and audit["correct"] == audit["guesses"]
    assert audit["epsilon-lower-bound"] > 0.3
    assert audit["verdict"].startswith("none")
    proc = _dpfl("attack", str(run), "--client", "2", "--reference-models", "2",
                 "--shadow-epochs", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run / "attack" / "attack.json").read_text())
    assert set(report["targets"]) == {"global", "update"}
    for target in report["targets"].values():
        assert len(target["attacks"]) == 4
        for a in target["attacks"]:
            assert 0.0 <= a["auc"] <= 1.0 and a["members"] == a["non-members"] > 0
    # no DP: the server's view of the overfitted update leaks membership (AUC 0.71-0.73
    # for the four attacks in a trial run), clearly above chance
    for a in report["targets"]["update"]["attacks"]:
        assert a["auc"] > 0.6, a
    assert (run / "attack" / "roc-update.png").stat().st_size > 0
    # a client that released canaries has no training update to attack
    proc = _dpfl("attack", str(run), "--client", "0", "--reference-models", "2",
                 "--shadow-epochs", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run / "attack" / "attack.json").read_text())
    assert set(report["targets"]) == {"global"}
    assert "released its canary" in report["targets"]["global"]["note"]


def test_formal_run_audit_bound_stays_under_the_ledger(tmp_path):
    run = _simulate(tmp_path, "dp", "strategy=dpfedavg", "trainer=update-dp", "num-rounds=2",
                    "target-epsilon=2.0")
    # a finished ordinary run: `dpfl audit` trains its audit run (same config + canaries)
    proc = _dpfl("audit", str(run), "--audit-seed", "5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    audit = json.loads((run / "audit" / "audit-run" / "audit.json").read_text())
    assert audit["verdict"] == "formal" and audit["canaries"] == CLIENTS
    assert 0 < audit["accounted-epsilon-max"] <= 2.0 + 1e-9
    assert audit["epsilon-lower-bound"] <= audit["accounted-epsilon-max"]
    assert not audit["bound-exceeds-accounted"]
    config = json.loads((run / "audit" / "audit-run" / "config.json").read_text())
    assert config["num-rounds"] == 2 and config["audit-seed"] == 5


def test_dpsgd_run_is_audited_with_canary_examples(tmp_path):
    """Sample-level DP-SGD: 60 canary examples (5 per client) in one audit run; the hosts
    keep their public sampling rate (no refusal, no plan mismatch) and the bound stays under
    the hosts' per-sample epsilon."""
    run = _simulate(tmp_path, "dpsgd", "strategy=dpfedavg", "trainer=dpsgd", "num-rounds=2",
                    "target-epsilon=2.0", "audit-canaries=60", "audit-seed=9",
                    f"record-updates={CLIENTS}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ledger-mismatches"] == 0 and summary["charges-not-matching-plan"] == 0
    rounds = [json.loads(l) for l in (run / "rounds.jsonl").read_text().splitlines()]
    assert [r["train"]["accepted"] for r in rounds] == [CLIENTS, CLIENTS]
    proc = _dpfl("audit", str(run))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    audit = json.loads((run / "audit.json").read_text())
    assert audit["canary-kind"].startswith("examples") and audit["canaries-seen"] == 60
    assert audit["verdict"] == "formal"
    assert 0 < audit["accounted-epsilon-max"] <= 2.0 + 1e-9
    assert audit["epsilon-lower-bound"] <= audit["accounted-epsilon-max"]
