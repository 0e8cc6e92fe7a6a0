"""``dpfl privacy-report RUN_DIR``: the guarantee first, then a per-client table (client,
unit, relation, sampling, delta, epsilon, rounds taken part in, verdict), and a PNG of
epsilon by round per client (``privacy-report.png``)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dpfl.privacy.ledger import Ledger


def privacy_report(run_dir: Path, plot: bool = True) -> str:
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = Ledger.load(run_dir / "ledger.json")
    g = summary["guarantee"]
    verdict = g["verdict"]
    table = Table(title=f"{run_dir.name}: privacy per client")
    for col in ("client", "unit", "relation", "sampling", "delta", "epsilon", "rounds", "verdict"):
        table.add_column(col, justify="right" if col in ("delta", "epsilon", "rounds") else "left")
    eps = ledger.epsilons()
    for client, value in eps.items():
        history = ledger.clients[client]
        mark = verdict if not history.adaptive else f"{verdict} (Rényi filter)"
        table.add_row(client, history.unit, g["relation"], g["sampling"], f"{ledger.delta:g}",
                      f"{value:.4f}", str(len(history.rounds)), mark)
    buf = io.StringIO()
    console = Console(file=buf, width=120, color_system=None)
    console.print(f"verdict: {verdict}")
    console.print(f"scope: {g['scope']}")
    off_plan = [c for c in ledger.charges if c["note"] != "reported = plan"]
    console.print(f"accountant: {ledger.accountant}; server-recomputed epsilon (never below a "
                  f"client's own report); {len(ledger.mismatches)} mismatch(es) with client "
                  f"reports; {len(off_plan)} charge(s) not matching the plan")
    console.print(table)
    for m in ledger.mismatches:
        console.print(f"MISMATCH {m['client']} round {m['round']}: reported "
                      f"{m['reported']:.6g}, recomputed {m['recomputed']:.6g}")
    for c in off_plan:
        console.print(f"CHARGE {c['client']} round {c['round']}: {c['note']}")
    if plot and eps:
        from dpfl.server.plots import plot_epsilon

        series = {c: [(0, 0.0)] + ledger.epsilon_by_round(c) for c in eps}
        path = plot_epsilon(series, run_dir / "privacy-report.png",
                            summary.get("epsilon-budget"), f"epsilon by round: {run_dir.name}")
        console.print(f"plot: {path}")
    return buf.getvalue()
