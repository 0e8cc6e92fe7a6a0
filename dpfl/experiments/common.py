"""Shared pieces of the paper reproductions: one simulation -> one JSON record."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def simulate_record(root: Path, clients: int, overrides: dict[str, Any],
                    work: Path) -> dict[str, Any]:
    """Run one real Flower simulation; return its key numbers (final metrics, per-client
    epsilon, per-round accuracy / mean epsilon / per-client epsilon / selected clients,
    throughput)."""
    from dpfl.launch import simulate

    t0 = time.time()
    run_dir = simulate(root, clients, overrides, work, quiet=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = [json.loads(l) for l in (run_dir / "rounds.jsonl").read_text().splitlines() if l]
    trained = sum(sum(c.get("num-examples", 0) for c in r["clients"].values()
                      if c.get("status") == "accepted") for r in rounds)
    train_seconds = sum(r["seconds"] for r in rounds)
    eps_rounds = [r.get("epsilon", {}) for r in rounds]
    return {
        "config": overrides, "run-dir": str(run_dir),
        "accuracy": summary["final"]["accuracy"], "macro-recall": summary["final"]["macro-recall"],
        "macro-f1": summary["final"]["macro-f1"],
        "epsilon": {c: v["epsilon"] for c, v in summary["clients"].items()},
        "rounds-run": summary.get("rounds-run"), "verdict": summary["guarantee"]["verdict"],
        "samples-per-second": trained * int(overrides.get("local-epochs", 1)) / max(train_seconds, 1e-9),
        "wall-seconds": round(time.time() - t0, 1),
        "accuracy-by-round": [r["central"]["accuracy"] for r in rounds],
        "selected-by-round": [len(r["sampled-nodes"]) for r in rounds],
        "mean-epsilon-by-round": [sum(e.values()) / clients if e else 0.0 for e in eps_rounds],
        "epsilon-by-round": eps_rounds,
    }


def write_record(results: Path, name: str, record: dict[str, Any]) -> Path:
    out = results / "runs" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    return out
