"""Per-run plots: accuracy by round, epsilon by round per client."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(rounds: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Central test accuracy (and macro F1) by round."""
    plt = _plt()
    xs = [r["round"] for r in rounds if "central" in r]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for key in ("accuracy", "macro-f1"):
        ax.plot(xs, [r["central"][key] for r in rounds if "central" in r], marker="o", label=key)
    ax.set_xlabel("round")
    ax.set_ylabel("test metric")
    ax.set_title(title or "central evaluation")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_epsilon(per_client: dict[str, list[tuple[int, float]]], path: Path,
                 budget: float | None = None, title: str = "") -> Path:
    """Cumulative epsilon by round, one step line per client."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for client, points in per_client.items():
        if points:
            xs, ys = zip(*points)
            ax.step(xs, ys, where="post", marker=".", label=client if len(per_client) <= 12 else None)
    if budget is not None:
        ax.axhline(budget, color="red", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("round")
    ax.set_ylabel("cumulative epsilon")
    ax.set_title(title or "privacy spend per client")
    ax.grid(alpha=0.3)
    if len(per_client) <= 12:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
