"""Helpers of the end-to-end tests: a real `dpfl simulate` on digits and its run records."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def simulate_digits(tmp_path: Path, name: str, *overrides: str, clients: int = 2) -> Path:
    """`dpfl simulate` on digits (batch 32); returns the run directory."""
    proc = subprocess.run(
        [sys.executable, "-m", "dpfl.cli", "simulate", "--clients", str(clients),
         "--output-dir", str(tmp_path), "dataset=digits", "batch-size=32", f"run-name={name}",
         *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / name


def read_run(run: Path) -> tuple[list[dict], dict, dict, dict]:
    """rounds.jsonl, ledger.json, summary.json, config.json of a run."""
    rounds = [json.loads(l) for l in (run / "rounds.jsonl").read_text().splitlines()]
    return (rounds, *(json.loads((run / f).read_text())
                      for f in ("ledger.json", "summary.json", "config.json")))
