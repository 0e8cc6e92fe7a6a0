"""``dpfl privacy-report RUN_DIR``: the guarantee first, then a per-client table (client,
unit, relation, sampling, delta, epsilon, rounds charged, server releases composed into the
epsilon, verdict), one ``SERVER`` line per release the server made itself (with the clients
it covers), and a PNG of epsilon by round per client (``privacy-report.png``)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from dpfl.privacy.events import PURE
from dpfl.privacy.ledger import Ledger


def server_releases(charges: list[dict[str, Any]]
                    ) -> dict[tuple[int, str, tuple], list[str]]:
    """The server's own releases, one per (round, note, events), with the clients covered."""
    out: dict[tuple[int, str, tuple], list[str]] = {}
    for c in charges:
        key = (c["round"], c["note"], tuple(tuple(sorted(e.items())) for e in c["events"]))
        out.setdefault(key, []).append(c["client"])
    return out


def _describe(event: tuple) -> str:
    e = dict(event)
    if e["mechanism"] in PURE:
        return f"{e['mechanism']} eps={e['epsilon']:g}"
    rate = f" q={e['rate']:g}" if e["rate"] < 1 else ""
    return f"{e['mechanism']} sigma={e['sigma']:g}{rate} x{e['steps']} ({e['relation']})"


# draws epsilon by round per client: (series, path, budget or None, title) -> path
PlotEpsilon = Callable[[dict[str, list[tuple[int, float]]], Path, Any, str], Path]


def privacy_report(run_dir: Path, plot: PlotEpsilon | None = None) -> str:
    """The report's text. ``plot``: the function that draws ``privacy-report.png``
    (the CLI passes ``dpfl.server.plots.plot_epsilon``: the privacy layer imports nothing
    from the server); None draws nothing."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = Ledger.load(run_dir / "ledger.json")
    g = summary["guarantee"]
    verdict = g["verdict"]
    table = Table(title=f"{run_dir.name}: privacy per client")
    numeric = ("delta", "epsilon", "rounds", "server releases")
    for col in ("client", "unit", "relation", "sampling") + numeric + ("verdict",):
        table.add_column(col, justify="right" if col in numeric else "left")
    eps = ledger.epsilons()
    server = ledger.server_charges()
    for client, value in eps.items():
        history = ledger.history(client)
        mark = verdict if not history.adaptive else f"{verdict} (Rényi filter)"
        releases = sum(1 for c in server if c["client"] == client)
        table.add_row(client, history.unit, g["relation"], g["sampling"], f"{ledger.delta:g}",
                      f"{value:.4f}", str(len(history.rounds)), str(releases), mark)
    buf = io.StringIO()
    console = Console(file=buf, width=120, color_system=None, markup=False)
    console.print(f"verdict: {verdict}")
    console.print(f"scope: {g['scope']}")
    off_plan = [c for c in ledger.charges
                if c.get("source", "client") == "client" and c["note"] != "reported = plan"]
    releases = server_releases(server)
    console.print(f"accountant: {ledger.accountant}; server-recomputed epsilon (never below a "
                  f"client's own report); {len(ledger.mismatches)} mismatch(es) with client "
                  f"reports; {len(off_plan)} charge(s) not matching the plan; "
                  f"{len(releases)} server release(s) composed into the clients' epsilon",
                  soft_wrap=True)
    console.print(table)
    for m in ledger.mismatches:
        console.print(f"MISMATCH {m['client']} round {m['round']}: reported "
                      f"{m['reported']:.6g}, recomputed {m['recomputed']:.6g}")
    for c in off_plan:
        console.print(f"CHARGE {c['client']} round {c['round']}: {c['note']}")
    for (server_round, note, events), clients in releases.items():
        described = ", ".join(_describe(e) for e in events)
        console.print(f"SERVER round {server_round}: {note or 'server release'} [{described}] "
                      f"charged to {', '.join(clients)}", soft_wrap=True)
    if plot is not None and eps:
        series = {c: [(0, 0.0)] + ledger.epsilon_by_round(c) for c in eps}
        path = plot(series, run_dir / "privacy-report.png", summary.get("epsilon-budget"),
                    f"epsilon by round: {run_dir.name}")
        console.print(f"plot: {path}")
    return buf.getvalue()
