"""Text report of a run: the guarantee first, then per-client epsilon."""

from __future__ import annotations

import io
import math
from typing import Any

from rich.console import Console
from rich.table import Table

from dpfl.privacy.weak_epsilon import weak_epsilon_note

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


# clients a printed table shows at most (a 10,000-client run's full table took 13 s to
# render, twice: results/speed/README.md); summary.json always holds every client
TABLE_ROWS = 30


def _shown_epsilon(info: dict[str, Any]) -> float:
    value = info.get("guaranteed-epsilon", info.get("epsilon"))
    return float(value) if _is_number(value) else math.inf   # n/a first: worth a look


def epsilon_table(summary: dict[str, Any], max_rows: int | None = TABLE_ROWS) -> str:
    """The guarantee and a per-client table (client, unit, relation, sampling, delta,
    epsilon, rounds taken part in), rendered as plain text. Beyond ``max_rows`` clients
    (None: no limit) the table shows the ``max_rows`` of largest epsilon, and a line says
    how many more there are and their range."""
    g = summary["guarantee"]
    final = summary.get("final", {})
    table = Table(title=f"privacy per client — verdict: {g['verdict']}")
    every = summary.get("clients", {})
    clients = every
    if max_rows is not None and len(every) > max_rows:
        top = sorted(every, key=lambda c: _shown_epsilon(every[c]), reverse=True)[:max_rows]
        clients = {c: every[c] for c in top}
        figures = sorted(_shown_epsilon(info) for info in every.values())
        table.caption = (f"the {max_rows} clients of largest epsilon of {len(every):,}; "
                         f"all: min {figures[0]:.4f}, median "
                         f"{figures[len(figures) // 2]:.4f}, max {figures[-1]:.4f} "
                         "(every client: summary.json, `dpfl summary RUN_DIR --all`)")
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
    shown = [info.get("guaranteed-epsilon", info.get("epsilon")) for info in every.values()]
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
