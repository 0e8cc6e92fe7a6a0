"""Per-run plots: accuracy by round (rounds in which clients dropped are marked), and
cumulative epsilon by round per client (clients with identical curves are drawn once and
named together; the others get distinct markers and line styles). Rounds are integer ticks.

``*_figure`` build a matplotlib Figure (tests inspect it); ``plot_*`` save it as a PNG.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

# matplotlib is imported where a figure is drawn: its import (~1 s of CPU) is not paid by
# every ServerApp and launcher that imports this module
if TYPE_CHECKING:
    from matplotlib.figure import Figure

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")
DROP_LABEL = "round with dropped clients (dropped/asked)"
MAX_LEGEND = 12   # more curves than this: no legend
ALL_TICKS = 12    # runs spanning fewer rounds than this get a tick at every round
NAMES_IN_LABEL = 4  # a group of identical curves names up to this many clients in full


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _integer_rounds(ax, rounds: list[int]) -> None:
    """Integer round ticks: every round up to ``ALL_TICKS`` of them (Matplotlib falls back to
    fractional ticks when a view holds fewer than two integers), else integer steps."""
    ax.set_xlabel("round")
    if not rounds:
        return
    lo, hi = min(rounds), max(rounds)
    if hi - lo < ALL_TICKS:
        ax.set_xticks(range(lo, hi + 1))
        if lo == hi:
            ax.set_xlim(lo - 0.5, hi + 0.5)
    else:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


# -- accuracy ------------------------------------------------------------------------------

def dropped(line: dict[str, Any]) -> tuple[int, int]:
    """(clients asked but not aggregated, clients asked) in one ``rounds.jsonl`` line:
    errors, refusals, invalid updates and replies that did not arrive in time."""
    statuses = [c.get("status") for c in line.get("clients", {}).values()]
    accepted = int(line.get("train", {}).get("accepted", statuses.count("accepted")))
    asked = max(len(line.get("sampled-nodes", [])), len(statuses))
    return asked - accepted, asked


def accuracy_figure(rounds: list[dict[str, Any]], title: str = "") -> Figure:
    """Central test accuracy and macro F1 by round; a red cross with ``k/n`` on the
    accuracy of every round in which k of the n clients asked were not aggregated."""
    central = [r for r in rounds if "central" in r]
    xs = [r["round"] for r in central]
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.5))
    ax = fig.subplots()
    for key in ("accuracy", "macro-f1"):
        ax.plot(xs, [r["central"][key] for r in central], marker="o", label=key)
    drops = [(r["round"], r["central"]["accuracy"], *dropped(r)) for r in central
             if dropped(r)[0] > 0]
    if drops:
        ax.plot([d[0] for d in drops], [d[1] for d in drops], linestyle="none", marker="X",
                markersize=10, color="red", zorder=3, label=DROP_LABEL)
        for x, y, k, n in drops:
            ax.annotate(f"{k}/{n}", (x, y), textcoords="offset points", xytext=(0, 8),
                        ha="center", fontsize=7, color="red")
    _integer_rounds(ax, xs)
    ax.set_ylabel("test metric")
    ax.set_title(title or "central evaluation")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def plot_accuracy(rounds: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """``accuracy.png``: see :func:`accuracy_figure`."""
    return _save(accuracy_figure(rounds, title), path)


# -- epsilon -------------------------------------------------------------------------------

Series = list[tuple[int, float]]


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def identical_groups(per_client: dict[str, Series]) -> list[tuple[list[str], Series]]:
    """Clients whose epsilon curves are equal (to 10 significant digits), each group's
    names in natural order (client-2 before client-10), groups by their first name."""
    groups: dict[tuple, tuple[list[str], Series]] = {}
    for client in sorted(per_client, key=_natural):
        points = list(per_client[client])
        if points:
            key = tuple((int(x), f"{float(y):.10g}") for x, y in points)
            groups.setdefault(key, ([], points))[0].append(client)
    return list(groups.values())


def group_label(names: list[str]) -> str:
    """``client-0``; ``client-0, client-1 (same ε)``; for more than ``NAMES_IN_LABEL``, the
    first two, the last and the count."""
    if len(names) == 1:
        return names[0]
    if len(names) <= NAMES_IN_LABEL:
        return f"{', '.join(names)} (same ε)"
    return f"{names[0]}, {names[1]}, …, {names[-1]} ({len(names)} clients, same ε)"


def epsilon_figure(per_client: dict[str, Series], budget: float | None = None,
                   title: str = "") -> Figure:
    """Cumulative epsilon by round: one step line per group of identical curves, each with
    its own marker and line style; the budget as a red dashed line."""
    groups = identical_groups(per_client)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 3.5))
    ax = fig.subplots()
    for i, (names, points) in enumerate(groups):
        xs, ys = zip(*points)
        ax.step(xs, ys, where="post", marker=MARKERS[i % len(MARKERS)],
                linestyle=LINESTYLES[i % len(LINESTYLES)], markersize=5,
                label=group_label(names) if len(groups) <= MAX_LEGEND else None)
    if budget is not None:
        ax.axhline(budget, color="red", linestyle="--", linewidth=1, label="budget")
    _integer_rounds(ax, [int(x) for _, points in groups for x, _ in points])
    ax.set_ylabel("cumulative epsilon")
    ax.set_title(title or "privacy spend per client")
    ax.grid(alpha=0.3)
    if len(groups) <= MAX_LEGEND:
        ax.legend(fontsize=7)
    return fig


def plot_epsilon(per_client: dict[str, Series], path: Path, budget: float | None = None,
                 title: str = "") -> Path:
    """``epsilon.png`` / ``privacy-report.png``: see :func:`epsilon_figure`."""
    return _save(epsilon_figure(per_client, budget, title), path)
