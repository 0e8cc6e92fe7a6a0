"""`dpfl audit` and `dpfl attack` on real simulated federations (digits, 12 clients, 2
rounds): a non-private run leaks (canaries found, attacks score; CS-MIA runs over the kept
per-round global models), a DP-SGD run's
and a client-level run's audited bounds stay under their ledgers' epsilon, and both commands
write their reports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dpfl.privacy.audit.canaries import canary_bits

from federation import ROOT, client_runtime_args, simulate_digits

pytestmark = pytest.mark.e2e
CLIENTS = 12


def _dpfl(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpfl.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _simulate(tmp_path: Path, name: str, *overrides: str) -> Path:
    return simulate_digits(tmp_path, name, "model=mlp", "lr=0.5", "val-fraction=0",
                           f"min-train-nodes={CLIENTS}", *overrides, clients=CLIENTS)


def test_non_private_run_is_attacked_then_audited(tmp_path):
    """An ordinary non-private run: the server's view of an overfitted client update leaks
    membership; `dpfl audit` then trains the run's audit run (same config, every client a
    canary client) and finds the canaries."""
    # 20 local epochs on ~150 digits: each client's update overfits its records
    run = _simulate(tmp_path, "plain", "strategy=fedavg", "trainer=plain", "num-rounds=2",
                    "record-updates=1", "local-epochs=20", "record-global-models=true")
    assert sorted(p.name for p in (run / "globals").iterdir()) == ["round-1.pt", "round-2.pt"]
    proc = _dpfl("attack", str(run), "--client", "0", "--reference-models", "2",
                 "--shadow-epochs", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run / "attack" / "attack.json").read_text())
    assert set(report["targets"]) == {"global", "update"}
    # CS-MIA on the global models of both rounds, the attack model trained on client 1's
    # records, scored on the same members and non-members as the other attacks. (Its edge
    # over Basic-MIA on an overfitted federation is tests/test_csmia.py's: here the averaged
    # global model of 12 clients barely leaks, loss AUC 0.56 and CS-MIA 0.55 in trial runs,
    # a comparison within noise.)
    assert report["cs-mia"] == {"attacker-client": 1, "rounds": [1, 2]}
    names = [a["name"] for a in report["targets"]["global"]["attacks"]]
    assert names == ["loss", "ml-leaks", "rmia", "gradient-norm", "cs-mia"]
    loss, cs = (next(a for a in report["targets"]["global"]["attacks"] if a["name"] == n)
                for n in ("loss", "cs-mia"))
    assert cs["members"] == loss["members"] and cs["non-members"] == loss["non-members"]
    assert len(report["targets"]["update"]["attacks"]) == 4
    for target in report["targets"].values():
        for a in target["attacks"]:
            assert 0.0 <= a["auc"] <= 1.0 and a["members"] == a["non-members"] > 0
    # no DP: the overfitted update leaks (AUC 0.71-0.73 for the four attacks in a trial
    # run), clearly above chance
    for a in report["targets"]["update"]["attacks"]:
        assert a["auc"] > 0.6, a
    assert (run / "attack" / "roc-update.png").stat().st_size > 0

    proc = _dpfl("audit", str(run), *client_runtime_args(), "--audit-seed", "11")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    audit_run = run / "audit" / "audit-run"
    audit = json.loads((audit_run / "audit.json").read_text())
    config = json.loads((audit_run / "config.json").read_text())
    assert config["audit-canaries"] == CLIENTS and config["audit-seed"] == 11
    assert config["num-rounds"] == 2 and config["local-epochs"] == 20
    # no noise: the canary sums separate perfectly, the bound is what 12 canaries allow
    assert audit["canaries-seen"] == CLIENTS and audit["correct"] == audit["guesses"]
    assert audit["epsilon-lower-bound"] > 0.3
    assert audit["verdict"].startswith("none")
    # in the audit run client 0 released canaries: its update is not attacked there
    bits = canary_bits(11, CLIENTS)
    assert bool(bits[0])
    proc = _dpfl("attack", str(audit_run), "--client", "0", "--reference-models", "2",
                 "--shadow-epochs", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((audit_run / "attack" / "attack.json").read_text())
    assert set(report["targets"]) == {"global"}
    assert "released its canary" in report["targets"]["global"]["note"]


def test_formal_client_level_audit_stays_under_a_small_ledger(tmp_path):
    """Client-level DP at a small budget (0.3 per client over 2 rounds): 12 canary clients
    are too few to certify more than ~0.5, so a release without its noise would show
    here as a bound above the ledger."""
    run = _simulate(tmp_path, "dp", "strategy=dpfedavg", "trainer=update-dp", "num-rounds=2",
                    "target-epsilon=0.3", f"audit-canaries={CLIENTS}", "audit-seed=5",
                    "audit-canary-norm=5.0")
    proc = _dpfl("audit", str(run), *client_runtime_args())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    audit = json.loads((run / "audit.json").read_text())
    assert audit["verdict"] == "formal" and audit["canaries-seen"] == CLIENTS
    assert 0 < audit["accounted-epsilon-max"] <= 0.3 + 1e-9
    assert audit["epsilon-lower-bound"] <= audit["accounted-epsilon-max"]
    assert not audit["bound-exceeds-accounted"]


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
    proc = _dpfl("audit", str(run), *client_runtime_args())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    audit = json.loads((run / "audit.json").read_text())
    assert audit["canary-kind"].startswith("examples") and audit["canaries-seen"] == 60
    assert audit["verdict"] == "formal"
    assert 0 < audit["accounted-epsilon-max"] <= 2.0 + 1e-9
    assert audit["epsilon-lower-bound"] <= audit["accounted-epsilon-max"]
