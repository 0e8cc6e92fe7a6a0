"""``dpfl privacy-report RUN_DIR``: the guarantee first, then a per-client table (client,
unit, relation, sampling, delta, epsilon, rounds charged, server releases composed into the
epsilon, verdict), one ``SERVER`` line per release the server made itself (with the clients
it covers), and a PNG of epsilon by round per client (``privacy-report.png``).

Before anything is reported the ledger is cross-checked against the run's other records
(:func:`check_ledger`):

- ``config.json``: the ledger's delta and accountant;
- ``summary.json`` (written when a run finishes): the same clients, each client's epsilon
  (and recomputed epsilon, and rounds) equal to the ledger's, recomputed from its events
  (relative tolerance :data:`EPSILON_RTOL`);
- ``rounds.jsonl``: every charge a round line records is in the ledger for that client and
  round (the ledger may hold MORE: replies charged after the last line, or a resumed round
  charged again — never fewer), and the last line's per-client epsilon is at most the
  ledger's;
- ``ledger.json`` itself: the epsilons it stores equal those recomputed from its events.

Any difference makes the verdict ``inconsistent``, with one ``DIFFERENCE`` line each
(client, what, ledger value vs file value), and :attr:`PrivacyReport.exit_code`
:data:`EXIT_INCONSISTENT`. A run without ``summary.json`` (unfinished or killed) is checked
against ``rounds.jsonl`` only, and the report says so. A missing, empty, damaged or
non-ledger ``ledger.json`` (likewise ``rounds.jsonl`` and ``summary.json``) is a
:class:`~dpfl.errors.UserError` naming the file.
"""

from __future__ import annotations

import io
import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

from dpfl.errors import UserError, one_line, read_json_file, read_text_file
from dpfl.logs import get_logger
from dpfl.numbers import is_number
from dpfl.privacy.accounting.event_types import event_type
from dpfl.privacy.accounting.events import PrivacyEvent, history_terms
from dpfl.privacy.accounting.ledger import Ledger
from dpfl.server.rundir import RunDir

log = get_logger("flwr.dpfl.report")
# Exit code of ``dpfl privacy-report`` when the records disagree (1 is a bug with its
# traceback, 2 a user error: a missing or damaged file, a bad argument).
EXIT_INCONSISTENT = 3
EXIT_OVER_BUDGET = 4
# Relative tolerance when comparing epsilons across files (JSON keeps floats exactly; this
# allows for another dp-accounting build recomputing the same history).
EPSILON_RTOL = 1e-6
# One event as its sorted (field, value) pairs (a key of server_releases)
EventItems = tuple[tuple[str, Any], ...]
# A charged event as (round, mechanism, sigma, rate, epsilon, steps, relation)
ChargeKey = tuple[int, str, float, float, float, int, str]


def server_releases(charges: list[dict[str, Any]]
                    ) -> dict[tuple[int, str, tuple[EventItems, ...]], list[str]]:
    """The server's own releases, one per (round, note, events), with the clients covered."""
    out: dict[tuple[int, str, tuple[EventItems, ...]], list[str]] = {}
    for c in charges:
        key = (c["round"], c["note"], tuple(tuple(sorted(e.items())) for e in c["events"]))
        out.setdefault(key, []).append(c["client"])
    return out


def _describe(event: EventItems) -> str:
    e = dict(event)
    if event_type(e["mechanism"]).pure:   # its epsilon is its cost
        return f"{e['mechanism']} eps={e['epsilon']:g}"
    rate = f" q={e['rate']:g}" if e["rate"] < 1 else ""
    return f"{e['mechanism']} sigma={e['sigma']:g}{rate} x{e['steps']} ({e['relation']})"


# draws epsilon by round per client: (series, path, budget or None, title) -> path
PlotEpsilon = Callable[[dict[str, list[tuple[int, float]]], Path, Any, str], Path]


# ---------------------------------------------------------------------------------------
# reading the run directory (UserError naming the file)


def _recomputed(ledger: Ledger, path: Path) -> dict[str, float]:
    """Every client's epsilon from the ledger's events, or a :class:`UserError` naming
    ``path`` when they cannot be composed (e.g. a history mixing units)."""
    try:
        return ledger.recomputed_all()
    except ValueError as exc:
        raise UserError(f"{path}: not a valid privacy ledger ({one_line(exc)})") from exc


def load_summary(path: Path) -> dict[str, Any] | None:
    """``summary.json`` (None when the run has none: unfinished or killed), or a
    :class:`UserError` naming it when it is empty, damaged or not a run summary."""
    if not path.exists():
        return None
    data = read_json_file(path, "run summary")
    g = data.get("guarantee") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(g, dict) or not all(
            isinstance(g.get(k), str) for k in ("verdict", "scope", "relation", "sampling")):
        raise UserError(f"{path}: not a run summary (no 'guarantee' with verdict, scope, "
                        "relation and sampling)")
    clients = data.get("clients")
    if not isinstance(clients, dict) or not all(isinstance(v, dict) and "epsilon" in v
                                                for v in clients.values()):
        raise UserError(f"{path}: not a run summary (no 'clients' with each client's "
                        "epsilon)")
    return data


def load_rounds(path: Path) -> list[dict[str, Any]]:
    """The complete lines of ``rounds.jsonl``, read as a resume reads them
    (:meth:`dpfl.server.rundir.RunDir.read_rounds`: a partial last line, a kill mid-append,
    is dropped with a warning; a damaged line is a :class:`UserError` naming the file and
    line), or a :class:`UserError` when the file is missing: a killed run that
    ``resume=true`` accepts is one the report reads."""
    read_text_file(path, "round log")   # missing or unreadable: one line naming it
    return RunDir(path.parent).read_rounds()



# ---------------------------------------------------------------------------------------
# cross-checks


@dataclass(frozen=True)
class Difference:
    """One way the ledger disagrees with another record of the run."""

    client: str     # the client, or "run" for run-wide values
    what: str       # what differs, e.g. "epsilon" or "round 2 charge ..."
    ledger: str     # the ledger's value
    file: str       # the other file
    value: str      # that file's value

    def line(self) -> str:
        return (f"DIFFERENCE {self.client} {self.what}: ledger {self.ledger} vs {self.file} "
                f"{self.value}")


def _number(value: Any) -> float | None:
    """A JSON number (or the run directory's "inf"/"-inf" strings) as a float."""
    if is_number(value):
        return float(value)
    if value in ("inf", "-inf"):
        return float(value)
    return None


def _differ(a: float, b: float) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a != b
    return abs(a - b) > EPSILON_RTOL * max(abs(a), abs(b))


def _event_key(e: PrivacyEvent) -> ChargeKey:
    return (int(e.round),) + e.key[:4] + (int(e.steps), e.key[4])


def _key_text(key: ChargeKey) -> str:
    _, mechanism, sigma, rate, epsilon, steps, relation = key
    items = (("mechanism", mechanism), ("sigma", sigma), ("rate", rate), ("epsilon", epsilon),
             ("steps", steps), ("relation", relation))
    return _describe(tuple(items))


def _run_checks(ledger: Ledger, config: dict[str, Any] | None) -> list[Difference]:
    out: list[Difference] = []
    if config is None:
        return out
    delta = _number(config.get("delta"))
    if delta is not None and _differ(ledger.delta, delta):
        out.append(Difference("run", "delta", f"{ledger.delta:g}", "config.json", f"{delta:g}"))
    accountant = config.get("accountant")
    if isinstance(accountant, str) and accountant != ledger.accountant:
        out.append(Difference("run", "accountant", ledger.accountant, "config.json",
                              accountant))
    return out


def _stored_checks(ledger: Ledger, data: dict[str, Any], recomputed: dict[str, float],
                   figures: dict[str, float]) -> list[Difference]:
    """ledger.json's stored epsilons against those recomputed from its events."""
    out = []
    for client, d in data["clients"].items():
        for key, ours in (("recomputed-epsilon", recomputed), ("epsilon", figures)):
            stored = _number(d.get(key))
            if stored is not None and client in ours and _differ(ours[client], stored):
                out.append(Difference(client, f"{key} (stored)",
                                      f"{ours[client]:.6g} (from its events)", "ledger.json",
                                      f"{stored:.6g}"))
    return out


def _summary_checks(ledger: Ledger, summary: dict[str, Any], recomputed: dict[str, float],
                    figures: dict[str, float]) -> list[Difference]:
    out = []
    clients = summary["clients"]
    for client in sorted(set(clients) | set(figures), key=_client_key):
        info = clients.get(client)
        if info is None:
            out.append(Difference(client, "client", f"present (epsilon {figures[client]:.6g})",
                                  "summary.json", "absent"))
            continue
        eps = _number(info.get("epsilon"))
        if client not in figures:
            shown = f"{eps:.6g}" if eps is not None else repr(info.get("epsilon"))
            out.append(Difference(client, "client", "absent", "summary.json",
                                  f"present (epsilon {shown})"))
            continue
        if eps is None or _differ(figures[client], eps):
            out.append(Difference(client, "epsilon", f"{figures[client]:.6g}", "summary.json",
                                  f"{eps:.6g}" if eps is not None else repr(info.get("epsilon"))))
        rec = _number(info.get("recomputed-epsilon"))
        if rec is not None and _differ(recomputed[client], rec):
            out.append(Difference(client, "recomputed-epsilon", f"{recomputed[client]:.6g}",
                                  "summary.json", f"{rec:.6g}"))
        rounds = info.get("rounds")
        if isinstance(rounds, list) and rounds != ledger.rounds(client):
            out.append(Difference(client, "rounds", str(ledger.rounds(client)), "summary.json",
                                  str(rounds)))
    return out


def _rounds_checks(ledger: Ledger, rounds: list[dict[str, Any]],
                   figures: dict[str, float]) -> list[Difference]:
    out = []
    logged: dict[str, Counter[ChargeKey]] = {}
    for line in rounds:
        for c in line.get("charges", []):
            counts = logged.setdefault(c["client"], Counter())
            counts.update(_event_key(PrivacyEvent(**e)) for e in c["events"])
    last: dict[str, Any] = rounds[-1] if rounds else {"round": 0, "epsilon": {}}
    last_eps = last.get("epsilon", {})
    for client in sorted(set(logged) | set(last_eps), key=_client_key):
        if client not in ledger.clients:
            n = sum(logged.get(client, Counter()).values())
            out.append(Difference(client, "client", "absent", "rounds.jsonl",
                                  f"present ({n} charged event(s))"))
            continue
        held = Counter(_event_key(e) for e in ledger.clients[client].events)
        for key, n in sorted(logged.get(client, Counter()).items()):
            if held[key] < n:
                out.append(Difference(client, f"round {key[0]} charge [{_key_text(key)}]",
                                      f"{held[key]}x", "rounds.jsonl", f"{n}x"))
        eps = _number(last_eps.get(client))
        if client in last_eps and (eps is None or (eps > figures[client]
                                                   and _differ(eps, figures[client]))):
            out.append(Difference(client, f"epsilon after round {last['round']}",
                                  f"{figures[client]:.6g}", "rounds.jsonl",
                                  f"{eps:.6g} (more than the ledger)" if eps is not None
                                  else repr(last_eps.get(client))))
    return out


def _client_key(name: str) -> tuple[int, str]:
    tail = name.rsplit("-", 1)[-1]
    return (int(tail), name) if tail.isdigit() else (1 << 30, name)


def check_ledger(ledger: Ledger, summary: dict[str, Any] | None,
                 rounds: list[dict[str, Any]], config: dict[str, Any] | None = None,
                 stored: dict[str, Any] | None = None,
                 recomputed: dict[str, float] | None = None) -> list[Difference]:
    """Every difference between the ledger and the run's other records (see the module
    docstring); ``summary`` None: an unfinished run, checked against ``rounds`` only.
    ``stored``: ledger.json's raw data (its stored epsilons are checked too);
    ``recomputed``: :meth:`Ledger.recomputed_all` when the caller has it already."""
    if recomputed is None:
        recomputed = ledger.recomputed_all()
    figures = {c: max(e, ledger.reported.get(c, 0.0)) for c, e in recomputed.items()}
    out = _run_checks(ledger, config)
    if stored is not None:
        out += _stored_checks(ledger, stored, recomputed, figures)
    if summary is not None:
        out += _summary_checks(ledger, summary, recomputed, figures)
    out += _rounds_checks(ledger, rounds, figures)
    return out


# ---------------------------------------------------------------------------------------
# the report


@dataclass
class PrivacyReport:
    """The report's text and the differences found (none: the records agree)."""

    text: str
    differences: list[Difference] = field(default_factory=list)
    finished: bool = True       # the run has a summary.json
    over_budget: dict[str, float] = field(default_factory=dict)   # client -> epsilon

    @property
    def consistent(self) -> bool:
        return not self.differences

    @property
    def exit_code(self) -> int:
        """0; :data:`EXIT_INCONSISTENT` when the records disagree; else
        :data:`EXIT_OVER_BUDGET` when some client's epsilon exceeds its budget."""
        if not self.consistent:
            return EXIT_INCONSISTENT
        return EXIT_OVER_BUDGET if self.over_budget else 0


def build_privacy_report(run_dir: Path, plot: PlotEpsilon | None = None) -> PrivacyReport:
    """The report of ``run_dir`` and the differences its records show. ``plot``: the
    function that draws ``privacy-report.png`` (the CLI passes
    ``dpfl.server.plots.plot_epsilon``: the privacy layer imports nothing from the server);
    None draws nothing."""
    run_dir = Path(run_dir)
    ledger_path = run_dir / "ledger.json"
    ledger, stored = Ledger.read(ledger_path)
    summary = load_summary(run_dir / "summary.json")
    rounds = load_rounds(run_dir / "rounds.jsonl")
    config_path = run_dir / "config.json"
    config = read_json_file(config_path, "run config") if config_path.exists() else None
    config = config if isinstance(config, dict) else None
    recomputed = _recomputed(ledger, ledger_path)
    differences = check_ledger(ledger, summary, rounds, config, stored, recomputed)
    eps = {c: max(e, ledger.reported.get(c, 0.0)) for c, e in recomputed.items()}
    if ledger.budget is None and config is not None and config.get("trainer") != "plain":
        ledger.budget = _number(config.get("target-epsilon"))   # ledgers of older runs
    over = ledger.over_budget(eps)

    g = summary["guarantee"] if summary is not None else None
    recorded = g["verdict"] if g is not None else "unknown (no summary.json)"
    against = ("summary.json, rounds.jsonl and config.json" if summary is not None
               else "rounds.jsonl and config.json only (no summary.json: unfinished or "
                    "killed run)")
    n_charges = sum(len(r.get("charges", [])) for r in rounds)
    buf = io.StringIO()
    console = Console(file=buf, width=120, color_system=None, markup=False)
    if differences:
        note = (f"summary.json records: {recorded}" if g is not None
                else "no summary.json: unfinished or killed run")
        console.print(f"verdict: inconsistent ({len(differences)} difference(s) between "
                      f"ledger.json and {against.split(' (')[0]}; {note})", soft_wrap=True)
        for d in differences:
            console.print(d.line(), soft_wrap=True)
    else:
        console.print(f"verdict: {recorded}", soft_wrap=True)
    console.print(f"checked: ledger.json against {against}: {len(rounds)} round line(s), "
                  f"{n_charges} charge(s); "
                  + ("agrees" if not differences else f"{len(differences)} difference(s)"),
                  soft_wrap=True)
    console.print(f"scope: {g['scope'] if g is not None else 'not recorded (no summary.json)'}",
                  soft_wrap=True)

    table = Table(title=f"{run_dir.name}: privacy per client")
    numeric = ("delta", "epsilon", "rounds", "server releases")
    for col in ("client", "unit", "relation", "sampling") + numeric + ("verdict",):
        table.add_column(col, justify="right" if col in numeric else "left")
    server = ledger.server_charges()
    differing = {d.client for d in differences}
    for client, value in eps.items():
        history = ledger.history(client)
        verdict = recorded if g is not None else "unknown"
        if "run" in differing or client in differing:
            verdict = "inconsistent"
        mark = verdict if not history.adaptive else f"{verdict} (Rényi filter)"
        releases = sum(1 for c in server if c["client"] == client)
        relation, sampling = history_terms(history.events)   # as charged, not as configured
        # the guarantee's delta: the ledger's plus what SecAgg+'s share overflow adds
        stated = _number(g.get("delta")) if g is not None else None
        delta = max(ledger.delta, stated) if stated is not None else ledger.delta
        # an adaptive history's guarantee is the filter's budget it held (the composition of
        # its adaptively chosen rounds is not a bound): that is the epsilon shown
        shown = (f"<= {ledger.budget:g} (filter; composed {value:.4f})"
                 if history.adaptive and ledger.budget is not None else f"{value:.4f}")
        table.add_row(client, history.unit, relation, sampling, f"{delta:g}",
                      shown, str(len(history.rounds)), str(releases), mark)
    off_plan = [c for c in ledger.charges
                if c.get("source", "client") == "client" and c["note"] != "reported = plan"]
    by_release = server_releases(server)
    console.print(f"accountant: {ledger.accountant}; server-recomputed epsilon (never below a "
                  f"client's own report); {len(ledger.mismatches)} mismatch(es) with client "
                  f"reports; {len(off_plan)} charge(s) not matching the plan; "
                  f"{len(by_release)} server release(s) composed into the clients' epsilon",
                  soft_wrap=True)
    console.print(table)
    for client, value in over.items():
        console.print(f"OVER BUDGET {client}: epsilon {value:.6g} > budget {ledger.budget:g}",
                      soft_wrap=True)
    for m in ledger.mismatches:
        console.print(f"MISMATCH {m['client']} round {m['round']}: reported "
                      f"{m['reported']:.6g}, recomputed {m['recomputed']:.6g}")
    for c in off_plan:
        console.print(f"CHARGE {c['client']} round {c['round']}: {c['note']}")
    for (server_round, note, events), clients in by_release.items():
        described = ", ".join(_describe(e) for e in events)
        console.print(f"SERVER round {server_round}: {note or 'server release'} [{described}] "
                      f"charged to {', '.join(clients)}", soft_wrap=True)
    if plot is not None and eps:
        series = {c: [(0, 0.0)] + ledger.epsilon_by_round(c) for c in eps}
        budget = summary.get("epsilon-budget") if summary is not None else None
        path = plot(series, run_dir / "privacy-report.png", budget,
                    f"epsilon by round: {run_dir.name}")
        console.print(f"plot: {path}")
    return PrivacyReport(buf.getvalue(), differences, summary is not None, over)


def privacy_report(run_dir: Path, plot: PlotEpsilon | None = None) -> str:
    """The report's text (:func:`build_privacy_report`); its first line says
    ``verdict: inconsistent`` when the records disagree."""
    return build_privacy_report(run_dir, plot).text


def privacy_report_command(run_dir: Path, plot: PlotEpsilon | None = None,
                           out: TextIO | None = None) -> int:
    """``dpfl privacy-report``: print the report; return 0, or :data:`EXIT_INCONSISTENT`
    when the ledger disagrees with the run's other records."""
    report = build_privacy_report(run_dir, plot)
    print(report.text, file=out if out is not None else sys.stdout)
    return report.exit_code
