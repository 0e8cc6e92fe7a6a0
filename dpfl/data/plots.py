"""Plot of label counts per client."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_label_counts(counts: np.ndarray, path: Path, title: str = "") -> Path:
    """Stacked bar chart: one bar per client, one colour per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_clients, n_classes = counts.shape
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * n_clients + 3), 3.5))
    bottom = np.zeros(n_clients)
    cmap = plt.get_cmap("tab10" if n_classes <= 10 else "tab20")
    for c in range(n_classes):
        ax.bar(np.arange(n_clients), counts[:, c], bottom=bottom, color=cmap(c % cmap.N),
               label=str(c) if n_classes <= 20 else None)
        bottom += counts[:, c]
    ax.set_xlabel("client (partition-id)")
    ax.set_ylabel("training samples")
    ax.set_title(title or "label counts per client")
    if n_classes <= 20:
        ax.legend(title="label", fontsize=7, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
