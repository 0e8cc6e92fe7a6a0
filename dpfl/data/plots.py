"""Plot of label counts per client."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Beyond this many clients, one bar per client is unreadable and slow (1,000 clients x 10
# labels: 10,000 bar patches on a 353-inch figure, 11.7 s of the ServerApp's set-up): the
# counts are drawn as stacked areas over the client index on a figure of bounded width.
MAX_BARS = 100
MAX_WIDTH_INCHES = 16.0


def plot_label_counts(counts: np.ndarray, path: Path, title: str = "") -> Path:
    """Stacked bar chart: one bar per client, one colour per label (stacked areas over the
    client index beyond :data:`MAX_BARS` clients)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_clients, n_classes = counts.shape
    width = min(MAX_WIDTH_INCHES, max(5, 0.35 * n_clients + 3))
    fig, ax = plt.subplots(figsize=(width, 3.5))
    cmap = plt.get_cmap("tab10" if n_classes <= 10 else "tab20")
    colors = [cmap(c % cmap.N) for c in range(n_classes)]
    labels = [str(c) for c in range(n_classes)] if n_classes <= 20 else None
    if n_clients <= MAX_BARS:
        bottom = np.zeros(n_clients)
        for c in range(n_classes):
            ax.bar(np.arange(n_clients), counts[:, c], bottom=bottom, color=colors[c],
                   label=labels[c] if labels else None)
            bottom += counts[:, c]
    else:
        ax.stackplot(np.arange(n_clients), counts.T, colors=colors, labels=labels or (),
                     step="mid", linewidth=0)
        ax.set_xlim(-0.5, n_clients - 0.5)
    ax.set_xlabel("client (partition-id)")
    ax.set_ylabel("training samples")
    ax.set_title(title or "label counts per client")
    if n_classes <= 20:
        ax.legend(title="label", fontsize=7, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
