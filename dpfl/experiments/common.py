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
        "randomness": ("public (reproducible=true)" if str(overrides.get("reproducible", ""))
                       .lower() == "true" else "secret (OS entropy)"),
        "samples-per-second": trained * int(overrides.get("local-epochs", 1)) / max(train_seconds, 1e-9),
        "wall-seconds": round(time.time() - t0, 1),
        "accuracy-by-round": [r["central"]["accuracy"] for r in rounds],
        "selected-by-round": [len(r["sampled-nodes"]) for r in rounds],
        "mean-epsilon-by-round": [sum(e.values()) / clients if e else 0.0 for e in eps_rounds],
        "epsilon-by-round": eps_rounds,
    }


PUBLIC_SEEDED = ("none: DP noise seeded from public values (recorded before dpfl drew DP "
                 "randomness from OS entropy)")


def randomness_of(record: dict[str, Any]) -> str:
    """How a record's DP noise and sampling were drawn. Records without the field were made
    before the fix: their noise came from a seed the server could recompute."""
    return record.get("randomness", "public-seeded (before the fix)")


def honest_verdict(record: dict[str, Any]) -> str:
    """The record's verdict, downgraded when its DP randomness was public."""
    if "randomness" not in record:
        return PUBLIC_SEEDED
    return record["verdict"]


def randomness_note(runs: list[dict[str, Any]]) -> str:
    """One line for a results table: which randomness produced its runs, and what that means."""
    modes: dict[str, int] = {}
    for r in runs:
        modes[randomness_of(r)] = modes.get(randomness_of(r), 0) + 1
    parts = ", ".join(f"{n} run(s) {m}" for m, n in sorted(modes.items()))
    note = f"DP randomness: {parts}."
    if any("randomness" not in r for r in runs):
        note += (" Public-seeded runs used noise and Poisson sampling seeded from the run-config "
                 "seed, partition id and round (today's `reproducible=true`): their accuracy "
                 "and ε stand — the noise had the right distribution — but anyone knowing the "
                 "run-config could regenerate the noise, so their verdict is `none`; "
                 "rerunning them today draws the randomness from OS entropy (verdict formal).")
    return note


def write_record(results: Path, name: str, record: dict[str, Any]) -> Path:
    out = results / "runs" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    return out
