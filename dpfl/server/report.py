"""Text report of a run: the guarantee first, then per-client epsilon."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console
from rich.table import Table

from dpfl.privacy.verdict import weak_epsilon_note

# the text fields of a summary's guarantee that epsilon_table prints
_GUARANTEE_TEXT = ("verdict", "scope", "unit", "relation", "sampling")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def summary_problem(summary: Any) -> str | None:
    """What makes ``summary`` (a ``summary.json`` as parsed) unprintable by
    :func:`epsilon_table`, in a few words; None when it is printable."""
    if not isinstance(summary, dict):
        return f"a JSON object expected, found a JSON {type(summary).__name__}"
    g = summary.get("guarantee")
    if not isinstance(g, dict):
        return "no 'guarantee' object"
    for key in _GUARANTEE_TEXT:
        if not isinstance(g.get(key), str):
            return f"'guarantee' has no text '{key}'"
    if not _is_number(g.get("delta")):
        return "'guarantee' has no number 'delta'"
    if summary.get("epsilon-budget") is not None and not isinstance(g.get("accountant"), str):
        return "'guarantee' has no text 'accountant'"
    clients = summary.get("clients", {})
    if not isinstance(clients, dict):
        return "'clients' is not a JSON object"
    for name, info in clients.items():
        if not isinstance(info, dict):
            return f"client '{name}' is not a JSON object"
        if not isinstance(info.get("rounds"), list):
            return f"client '{name}' has no list 'rounds'"
        if "epsilon" not in info:
            return f"client '{name}' has no 'epsilon'"
    if not isinstance(summary.get("final", {}), dict):
        return "'final' is not a JSON object"
    return None


def _number(value: Any, spec: str) -> str:
    """``value`` formatted by ``spec``, or "n/a" when it is not a number (a diverged
    run's metrics are JSON null)."""
    return format(value, spec) if _is_number(value) else "n/a"


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
        row = [str(client), g["unit"], str(info.get("relation", g["relation"])),
               str(info.get("sampling", g["sampling"])), _number(g["delta"], "g")]
        if adaptive:   # the filter's budget is the guarantee of an adaptive history
            bound = info.get("guaranteed-epsilon")
            row.append(f"<= {_number(bound, 'g')} (filter)" if bound is not None else "-")
        table.add_row(*row, _number(info["epsilon"], ".4f"), str(len(info["rounds"])))
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
        console.print("final test: " + ", ".join(f"{k} {_number(v, '.4f')}"
                                                 for k, v in final.items())
                      + f" | wall {_number(summary.get('wall-seconds', 0), '.1f')} s")
    return buf.getvalue()
