"""Text report of a run: the guarantee first, then per-client epsilon."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console
from rich.table import Table

from dpfl.privacy.verdict import weak_epsilon_note


def epsilon_table(summary: dict[str, Any]) -> str:
    """The guarantee and a per-client table (client, unit, relation, sampling, delta,
    epsilon, rounds taken part in), rendered as plain text."""
    g = summary["guarantee"]
    final = summary.get("final", {})
    table = Table(title=f"privacy per client — verdict: {g['verdict']}")
    clients = summary.get("clients", {})
    adaptive = any(info.get("adaptive") for info in clients.values())
    numeric = ("delta", "epsilon", "guaranteed epsilon", "rounds")
    columns = ("client", "unit", "relation", "sampling", "delta")
    columns += ("guaranteed epsilon", "epsilon") if adaptive else ("epsilon",)
    for col in columns + ("rounds",):
        table.add_column(col + (" (informative)" if adaptive and col == "epsilon" else ""),
                         justify="right" if col in numeric else "left")
    for client, info in clients.items():
        # relation and sampling as the client's charges were accounted (older summaries:
        # the guarantee's)
        row = [client, g["unit"], info.get("relation", g["relation"]),
               info.get("sampling", g["sampling"]), f"{g['delta']:g}"]
        if adaptive:   # the filter's budget is the guarantee of an adaptive history
            bound = info.get("guaranteed-epsilon")
            row.append(f"<= {bound:g} (filter)" if bound is not None else "-")
        table.add_row(*row, f"{info['epsilon']:.4f}", str(len(info["rounds"])))
    buf = io.StringIO()
    console = Console(file=buf, width=110, color_system=None)
    shown = [info.get("guaranteed-epsilon", info.get("epsilon")) for info in clients.values()]
    largest = max((e for e in shown if isinstance(e, (int, float))), default=None)
    console.print(f"guarantee: {g['verdict']}{weak_epsilon_note(g['verdict'], largest)} — "
                  f"{g['scope']}")
    if summary.get("epsilon-budget") is not None:
        console.print(f"epsilon budget per client: {summary['epsilon-budget']} "
                      f"(delta {g['delta']:g}, accountant {g['accountant']})")
    console.print(table)
    if final:
        console.print("final test: " + ", ".join(f"{k} {v:.4f}" for k, v in final.items())
                      + f" | wall {summary.get('wall-seconds', 0):.1f} s")
    return buf.getvalue()
