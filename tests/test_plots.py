"""Run plots built from small hand-made inputs: integer round ticks, drop marks at the right
rounds, identical epsilon curves grouped under one label, distinct styles otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from dpfl.server.plots import (
    DROP_LABEL,
    accuracy_figure,
    dropped,
    epsilon_figure,
    group_label,
    plot_accuracy,
    plot_epsilon,
)


def _round(rnd: int, acc: float, statuses: list[str], sampled: int | None = None) -> dict:
    """A rounds.jsonl line as run_round writes it (train is {} when nothing was accepted)."""
    clients = {f"client-{i}": {"status": s} for i, s in enumerate(statuses)}
    accepted = statuses.count("accepted")
    return {"round": rnd, "central": {"accuracy": acc, "macro-f1": acc - 0.05},
            "train": {"accepted": accepted, "rejected": len(statuses) - accepted}
            if accepted else {},
            "sampled-nodes": list(range(sampled if sampled is not None else len(statuses))),
            "clients": clients}


ROUNDS = [_round(1, 0.50, ["accepted"] * 4),
          _round(2, 0.60, ["accepted", "error", "accepted", "accepted"]),
          _round(3, 0.70, ["accepted"] * 3, sampled=4),          # one reply never came
          _round(4, 0.75, ["accepted"] * 4),
          _round(5, 0.75, ["refused"] * 4)]                       # no update: train is {}


def _line(ax, label):
    [line] = [l for l in ax.get_lines() if l.get_label() == label]
    return line


def _integers(ticks) -> bool:
    return len(ticks) > 0 and all(float(t).is_integer() for t in ticks)


def test_dropped_counts_errors_refusals_and_missing_replies():
    assert [dropped(r) for r in ROUNDS] == [(0, 4), (1, 4), (1, 4), (0, 4), (4, 4)]


def test_accuracy_ticks_are_rounds_and_drops_are_marked_where_they_happened():
    ax = accuracy_figure(ROUNDS).axes[0]
    assert _integers(ax.get_xticks())
    drops = _line(ax, DROP_LABEL)
    assert list(drops.get_xdata()) == [2, 3, 5]
    assert list(drops.get_ydata()) == [0.60, 0.70, 0.75]
    assert [t.get_text() for t in ax.texts] == ["1/4", "1/4", "4/4"]
    assert DROP_LABEL in [t.get_text() for t in ax.get_legend().get_texts()]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 11, 12, 50])
def test_round_ticks_are_integers_for_short_runs(n):
    rounds = [_round(r, 0.1 * r, ["accepted"] * 2) for r in range(1, n + 1)]
    ax = accuracy_figure(rounds).axes[0]
    assert _integers(ax.get_xticks())
    assert DROP_LABEL not in [l.get_label() for l in ax.get_lines()]
    for first in (0, n):  # a report's series starts at (0, 0.0); a lone point too
        eps = epsilon_figure({"client-0": [(r, 0.5 * r) for r in range(first, n + 1)]})
        assert _integers(eps.axes[0].get_xticks())


SERIES = {"client-1": [(0, 0.0), (1, 1.5), (2, 3.0)],
          "client-10": [(0, 0.0), (1, 1.5), (2, 3.0)],
          "client-0": [(0, 0.0), (1, 1.5), (2, 3.0)],
          "client-2": [(0, 0.0), (1, 1.0), (2, 2.0000000000001)],
          "client-3": [(0, 0.0), (1, 1.0), (2, 2.0)],
          "client-4": [(0, 0.0), (1, 2.5), (2, 3.9)]}


def test_identical_epsilon_curves_are_drawn_once_under_one_label():
    ax = epsilon_figure(SERIES, budget=4.0).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["client-0, client-1, client-10 (same ε)", "client-2, client-3 (same ε)",
                      "client-4", "budget"]
    curves = [l for l in ax.get_lines() if l.get_label() != "budget"]
    assert len(curves) == 3
    styles = {(l.get_marker(), l.get_linestyle()) for l in curves}
    assert len(styles) == 3
    assert list(_line(ax, "client-4").get_ydata()) == [0.0, 2.5, 3.9]
    assert _integers(ax.get_xticks())


def test_distinct_curves_keep_their_own_label():
    ax = epsilon_figure({"client-0": [(0, 0.0), (1, 1.0)],
                         "client-1": [(0, 0.0), (1, 1.1)]}).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["client-0", "client-1"]


def test_group_label_for_many_clients():
    names = [f"client-{i}" for i in range(20)]
    assert group_label(names[:4]) == "client-0, client-1, client-2, client-3 (same ε)"
    assert group_label(names) == "client-0, client-1, …, client-19 (20 clients, same ε)"


def test_the_plots_are_written(tmp_path):
    assert plot_accuracy(ROUNDS, tmp_path / "a.png").stat().st_size > 1000
    assert plot_epsilon(SERIES, tmp_path / "e.png", 4.0, "t").stat().st_size > 1000


def test_label_counts_of_many_clients_fit_a_bounded_figure(tmp_path):
    """Beyond MAX_BARS clients the counts are stacked areas on a figure of bounded width (one
    bar per client made a 353-inch figure of 10,000 patches at 1,000 clients)."""
    from PIL import Image

    from dpfl.data.plots import MAX_BARS, MAX_WIDTH_INCHES, plot_label_counts

    counts = np.random.default_rng(0).integers(0, 9, size=(MAX_BARS * 10, 10))
    path = plot_label_counts(counts, tmp_path / "labels.png", "many")
    assert Image.open(path).size[0] <= MAX_WIDTH_INCHES * 110 + 1
    few = plot_label_counts(counts[:5], tmp_path / "few.png", "few")
    assert Image.open(few).size[0] < Image.open(path).size[0]
