"""`dpfl reproduce gcfl`: the MNIST tables (II-IV) of Wan, Zhu, Liu, Fan & Xu, "GCFL: A
Gradient Correction-based Federated Learning Framework for Privacy-preserving CPSS"
(arXiv:2506.03618, 2025) with dpfl.

Every (cell, method, seed) is one real Flower simulation (2 SuperNodes) from the preset
``conf/gcfl/<cell>.toml`` plus ``strategy`` and ``seed``. Each run's key numbers go to
``results/gcfl/runs/<cell>__<method>__seed<k>.json``; the table (mean +- std over seeds,
beside the paper's numbers) to ``results/gcfl/table.md`` and ``results/gcfl/table.json``,
and a bar plot per cell to ``results/gcfl/accuracy.png``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from dpfl.experiments.common import (
    Reproduction,
    load_records,
    mean_std,
    pyplot,
    save_figure,
    table_header,
    write_table,
)

CLIENTS = 2
METHODS = ("dpfedavg", "dpfedprox", "dpscaffold", "dpfedexp", "gcfl")
DEFAULT_METHODS = METHODS
LABELS = {"dpfedavg": "DP-FedAvg", "dpfedprox": "DP-FedProx", "dpscaffold": "DP-SCAFFOLD",
          "dpfedexp": "DP-FedExP", "gcfl": "GCFL"}
CELLS = {
    "eps2": "mnist_eps2.toml",
    "eps3": "mnist_eps3.toml",
    "eps4": "mnist_eps4.toml",
    "noniid-eps2": "mnist_noniid_eps2.toml",
    "paper-sigma": "mnist_paper_sigma.toml",
}
DEFAULT_CELLS = ("eps2", "noniid-eps2", "eps3", "eps4")
# Paper (accuracy, recall, F1) in %, MNIST: Table III (eps 2/3/4, IID) and Table IV (non-IID).
PAPER: dict[str, dict[str, tuple[float, float, float]]] = {
    "eps2": {"dpfedavg": (85.50, 85.26, 85.12), "dpfedprox": (86.28, 86.07, 85.97),
             "dpscaffold": (87.13, 86.96, 86.92), "dpfedexp": (89.37, 88.94, 89.22),
             "gcfl": (91.11, 91.02, 91.03)},
    "eps3": {"dpfedavg": (88.73, 88.62, 88.59), "dpfedprox": (90.57, 90.49, 90.47),
             "dpscaffold": (90.98, 90.82, 90.90), "dpfedexp": (91.57, 91.37, 91.47),
             "gcfl": (92.76, 92.43, 92.70)},
    "eps4": {"dpfedavg": (90.51, 90.43, 90.41), "dpfedprox": (92.18, 92.13, 92.12),
             "dpscaffold": (92.13, 92.09, 92.09), "dpfedexp": (92.33, 92.28, 92.31),
             "gcfl": (93.15, 93.13, 93.09)},
    # Table IV's recall/F1 are not in our reading guide; accuracy only.
    "noniid-eps2": {"dpfedavg": (84.53, float("nan"), float("nan")),
                    "dpfedprox": (86.95, float("nan"), float("nan")),
                    "dpscaffold": (86.98, float("nan"), float("nan")),
                    "dpfedexp": (87.69, float("nan"), float("nan")),
                    "gcfl": (88.98, float("nan"), float("nan"))},
}
PAPER["paper-sigma"] = PAPER["eps2"]


def build_table(results: Path, command: str) -> str:
    """Markdown table of every recorded run, our mean +- std beside the paper."""
    runs = load_records(results)
    lines = table_header(
        "GCFL reproduction (MNIST)", command,
        "Accuracy / macro recall / macro F1 in % on the MNIST test set (10,000 images), "
        "mean ± std over seeds (n = seeds run); paper = Tables III-IV of Wan et al., "
        "GCFL (arXiv:2506.03618, 2025).", runs)
    table: dict[str, Any] = {}
    for cell in CELLS:
        cell_runs = [r for r in runs if r["cell"] == cell]
        if not cell_runs:
            continue
        lines += [f"## {cell}", "",
                  "| method | n | ours acc | paper acc | ours recall | paper recall | ours F1 | "
                  "paper F1 | max ε | samples/s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for method in METHODS:
            rs = [r for r in cell_runs if r["method"] == method]
            if not rs:
                continue
            paper = PAPER[cell][method]
            eps = max(max(r["epsilon"].values()) for r in rs)
            sps = statistics.fmean(r["samples-per-second"] for r in rs)
            row = {k: [r[k] for r in rs] for k in ("accuracy", "macro-recall", "macro-f1")}
            table.setdefault(cell, {})[method] = {**row, "paper": paper, "max-epsilon": eps,
                                                  "samples-per-second": sps,
                                                  "seeds": [r["seed"] for r in rs]}
            p = ["—" if v != v else f"{v:.2f}" for v in paper]
            acc, recall, f1 = (mean_std(row[k]) for k in ("accuracy", "macro-recall", "macro-f1"))
            lines.append(f"| {LABELS[method]} | {len(rs)} | {acc} | {p[0]} | {recall} | {p[1]} | "
                         f"{f1} | {p[2]} | {eps:.3f} | {sps:,.0f} |")
        lines.append("")
    text = write_table(results, lines, table)
    _plot(table, results / "accuracy.png")
    return text


def _plot(table: dict[str, Any], path: Path) -> None:
    import numpy as np

    plt = pyplot()
    cells = list(table)
    if not cells:
        return
    fig, axes = plt.subplots(1, len(cells), figsize=(4 * len(cells), 3.5), squeeze=False)
    for ax, cell in zip(axes[0], cells):
        methods = list(table[cell])
        x = np.arange(len(methods))
        ours = [100 * statistics.fmean(table[cell][m]["accuracy"]) for m in methods]
        err = [100 * statistics.stdev(table[cell][m]["accuracy"]) if len(table[cell][m]["accuracy"]) > 1
               else 0.0 for m in methods]
        paper = [table[cell][m]["paper"][0] for m in methods]
        ax.bar(x - 0.2, ours, 0.4, yerr=err, label="dpfl")
        ax.bar(x + 0.2, paper, 0.4, label="paper")
        ax.set_xticks(x, [LABELS[m] for m in methods], rotation=35, ha="right", fontsize=8)
        ax.set_ylim(min(ours + paper) - 5, 100)
        ax.set_title(cell)
        ax.set_ylabel("test accuracy (%)")
    axes[0][0].legend(fontsize=8)
    save_figure(fig, path)


REPRODUCTION = Reproduction(
    name="gcfl", presets="gcfl", clients=CLIENTS, cells=CELLS, default_cells=DEFAULT_CELLS,
    methods=METHODS, default_methods=DEFAULT_METHODS, build_table=build_table)


def run_one(root: Path, cell: str, method: str, seed: int, results: Path,
            work: Path) -> dict[str, Any]:
    """One simulation (preset + ``strategy`` + ``seed``); writes and returns its record."""
    return REPRODUCTION.run_one(root, cell, method, seed, results, work)
