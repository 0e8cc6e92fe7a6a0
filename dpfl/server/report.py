"""Text report of a run: the guarantee first, then per-client epsilon."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console
from rich.table import Table


def epsilon_table(summary: dict[str, Any]) -> str:
    """The guarantee and a per-client table (client, unit, relation, sampling, delta,
    epsilon, rounds taken part in), rendered as plain text."""
    g = summary["guarantee"]
    final = summary.get("final", {})
    table = Table(title=f"privacy per client — verdict: {g['verdict']}")
    for col in ("client", "unit", "relation", "sampling", "delta", "epsilon", "rounds"):
        table.add_column(col, justify="right" if col in ("delta", "epsilon", "rounds") else "left")
    for client, info in summary.get("clients", {}).items():
        table.add_row(client, g["unit"], g["relation"], g["sampling"], f"{g['delta']:g}",
                      f"{info['epsilon']:.4f}", str(len(info["rounds"])))
    buf = io.StringIO()
    console = Console(file=buf, width=110, color_system=None)
    console.print(f"guarantee: {g['verdict']} — {g['scope']}")
    if summary.get("epsilon-budget") is not None:
        console.print(f"epsilon budget per client: {summary['epsilon-budget']} "
                      f"(delta {g['delta']:g}, accountant {g['accountant']})")
    console.print(table)
    if final:
        console.print("final test: " + ", ".join(f"{k} {v:.4f}" for k, v in final.items())
                      + f" | wall {summary.get('wall-seconds', 0):.1f} s")
    return buf.getvalue()
