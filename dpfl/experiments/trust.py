"""``dpfl reproduce trust``: accuracy against per-client epsilon for the three trust models
(``dpfl.privacy.trust``) on the same MNIST split — the figure a user needs to choose one —
plus Flower's own central-DP wrapper on the same round and the non-private reference.

Cells: ``eps2`` / ``eps4`` / ``eps8`` at 100 clients (``conf/trust/mnist100.toml``),
``k1000-eps2`` / ``k1000-eps4`` / ``k1000-eps8`` at 1,000 clients
(``conf/trust/mnist1000.toml``), ``k1000-dir-eps8`` on a Dirichlet(0.5) split of 1,000
clients (``conf/trust/mnist1000-dirichlet.toml``) and ``cmp``, dpfl's central arm beside
Flower's wrapper at one fixed noise multiplier where central DP learns
(``conf/trust/mnist100-cmp.toml``). Arms:

- ``local``: DP-FedAvg with client-side Gaussian noise (calibrated so a client taking part
  in every round reaches the cell's epsilon; the ledger records what each really spent);
- ``central``: trust=central, Poisson sampling, adaptive clipping (count charged);
- ``central-fixed``: the same with the clip fixed at the preset's ``clip-norm`` (no count
  to charge): the control for the adaptive clip's feedback at small epsilon (not in the
  default grid);
- ``distributed``: trust=distributed, Skellam shares over SecAgg+, n_min = 80 % of a round;
- ``ddgauss``: the same with discrete Gaussian shares (``secure-noise=ddgauss``, Kairouz,
  Liu & Steinke 2021; not in the default grid: its exact sampler is slow on the CNN);
- ``flower-central``: Flower's ``DifferentialPrivacyServerSideFixedClipping`` around
  ``FedAvg`` at the sigma dpfl's central arm calibrated (``central-impl=flower``; Flower's
  adaptive wrapper is refused, its noise depends on the same round's count): Flower
  reports no epsilon; dpfl's ledger charges what it did (no amplification claimed);
- ``fedavg``: non-private FedAvg (trainer=plain) on the same split.

The plot puts every run at the LARGEST per-client epsilon of its ledger (x) against its
final test accuracy (y), one line per trust model; several seeds of a cell are averaged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpfl.experiments.common import (
    Reproduction,
    load_records,
    pyplot,
    save_figure,
    table_header,
    write_table,
)

EPSILONS = {"eps2": 2.0, "eps4": 4.0, "eps8": 8.0, "k1000-eps2": 2.0, "k1000-eps4": 4.0,
            "k1000-eps8": 8.0, "k1000-dir-eps8": 8.0, "cmp": 1e6}
CELLS = {"eps2": "mnist100.toml", "eps4": "mnist100.toml", "eps8": "mnist100.toml",
         "k1000-eps2": "mnist1000.toml", "k1000-eps4": "mnist1000.toml",
         "k1000-eps8": "mnist1000.toml", "k1000-dir-eps8": "mnist1000-dirichlet.toml",
         "cmp": "mnist100-cmp.toml"}
ARMS: dict[str, dict[str, Any]] = {
    "local": {"strategy": "dpfedavg", "trust": "local"},
    "central": {"strategy": "dpfedavg", "trust": "central", "adaptive-clip": True},
    "central-fixed": {"strategy": "dpfedavg", "trust": "central", "adaptive-clip": False},
    "distributed": {"strategy": "dpfedavg", "trust": "distributed"},
    "ddgauss": {"strategy": "dpfedavg", "trust": "distributed", "secure-noise": "ddgauss"},
    "flower-central": {"strategy": "dpfedavg", "trust": "central", "central-impl": "flower",
                       "adaptive-clip": False},
    "fedavg": {"strategy": "fedavg", "trainer": "plain"},
}
COLOURS = {"local": "tab:red", "central": "tab:blue", "central-fixed": "tab:cyan",
           "distributed": "tab:green", "ddgauss": "tab:olive",
           "flower-central": "tab:purple", "fedavg": "black"}


def clients_of(cell: str) -> int:
    return 1000 if cell.startswith("k1000") else 100


def split_of(cell: str) -> str:
    return "dirichlet" if "-dir-" in cell else "iid"


def _run_config(preset: dict[str, Any], cell: str, arm: str) -> dict[str, Any]:
    from dpfl.config import RunConfig
    from dpfl.privacy.trust import central_noise_multiplier

    eps = EPSILONS[cell]
    out = {**preset, **ARMS[arm], "target-epsilon": eps}
    if arm in ("distributed", "ddgauss"):
        out["secagg-min-survivors"] = int(0.8 * preset["min-train-nodes"])
    if arm == "flower-central":
        # Flower's wrapper at the sigma dpfl's central arm runs with; its charge (no
        # amplification) would pass the cell's budget, so the budget is lifted: its epsilon
        # is what the ledger reports
        central = RunConfig(trainer="update-dp", trust="central", adaptive_clip=True,
                            fraction_train=float(preset["fraction-train"]),
                            num_rounds=int(preset["num-rounds"]), target_epsilon=eps,
                            delta=float(preset["delta"]), accountant=preset["accountant"])
        out["noise-multiplier"] = (float(preset.get("noise-multiplier", 0.0))
                                   or central_noise_multiplier(central, clients_of(cell)))
        out["target-epsilon"] = 1e6
    return out


def _max_eps(record: dict[str, Any]) -> float:
    eps = list(record["epsilon"].values())
    return max(eps) if eps else float("inf")


def build_table(results: Path, command: str) -> str:
    runs = load_records(results)
    lines = table_header(
        "Trust models: accuracy against per-client epsilon", command,
        "Per run: the largest and mean per-client epsilon on the ledger (client level, "
        "delta 1e-5, PLD; central: add-remove with amplification, every client charged "
        "every round; local and distributed: replace-one, charged for the rounds a client "
        "took part in; Flower's wrapper: replace-one without amplification, at its "
        "effective noise), the final test accuracy and the wall time.", runs)
    lines += ["| cell | clients | arm | seed | verdict | max ε | mean ε | accuracy % | minutes |",
              "|---|---|---|---|---|---|---|---|---|"]
    table = []
    order = list(EPSILONS)
    for rec in sorted(runs, key=lambda r: (order.index(r["cell"]), list(ARMS).index(r["method"]),
                                           r["seed"])):
        eps = list(rec["epsilon"].values())
        mean = sum(eps) / len(eps) if eps else float("inf")
        lines.append(f"| {rec['cell']} | {clients_of(rec['cell'])} | {rec['method']} | "
                     f"{rec['seed']} | {rec['verdict'][:40]} | {_max_eps(rec):.3g} | {mean:.3g} | "
                     f"{100 * rec['accuracy']:.2f} | {rec['wall-seconds'] / 60:.1f} |")
        table.append({"cell": rec["cell"], "arm": rec["method"], "seed": rec["seed"],
                      "max-epsilon": _max_eps(rec), "mean-epsilon": mean,
                      "accuracy": rec["accuracy"], "verdict": rec["verdict"]})
    plot(runs, results / "accuracy-vs-epsilon.png")
    return write_table(results, lines, {"runs": table})


def _seed_means(runs: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(largest epsilon, mean accuracy %) per cell over its seeds, by epsilon."""
    cells: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault(r["cell"], []).append(r)
    return sorted((max(_max_eps(r) for r in rs), 100 * sum(r["accuracy"] for r in rs) / len(rs))
                  for rs in cells.values())


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Accuracy against the largest per-client epsilon, one line per trust model and
    federation size (100 clients solid with dots, 1,000 dashed with stars, the Dirichlet
    split of 1,000 as diamonds); non-private FedAvg as horizontal lines."""
    runs = [r for r in runs if r["cell"] != "cmp"]   # another setting (q = 0.5, fixed sigma)
    if not runs:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in ARMS:
        for size, split, marker in ((100, "iid", "o"), (1000, "iid", "*"),
                                    (1000, "dirichlet", "D")):
            pts = _seed_means([r for r in runs
                               if r["method"] == arm and clients_of(r["cell"]) == size
                               and split_of(r["cell"]) == split])
            if not pts:
                continue
            what = f"{size} clients" + (", Dirichlet(0.5)" if split == "dirichlet" else "")
            if arm == "fedavg":
                for _, acc in pts:
                    ax.axhline(acc, color=COLOURS[arm], lw=1,
                               ls={100: "--", 1000: ":"}[size] if split == "iid" else "-.",
                               label=f"non-private FedAvg ({what})")
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker=marker, ms=13 if marker == "*" else 7, color=COLOURS[arm],
                    ls={100: "-", 1000: "--"}[size] if split == "iid" else "none",
                    label=f"{arm} ({what})")
    ax.set_xscale("log")
    ticks = sorted({round(_max_eps(r), 1) for r in runs if r["method"] != "fedavg"})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("largest per-client ε on the ledger (δ = 1e-5)")
    ax.set_ylabel("test accuracy %")
    ax.set_title("MNIST: accuracy vs per-client ε by trust model")
    ax.legend(fontsize=7, loc="center left")
    ax.grid(alpha=0.3)
    save_figure(fig, path)


REPRODUCTION = Reproduction(
    name="trust", presets="trust", clients=100, cells=CELLS,
    default_cells=("eps2", "eps4", "eps8"), methods=tuple(ARMS),
    default_methods=tuple(a for a in ARMS if a not in ("central-fixed", "ddgauss")),
    build_table=build_table,
    run_config=_run_config, clients_of=clients_of)


def run_one(root: Path, cell: str, method: str, seed: int, results: Path,
            work: Path) -> dict[str, Any]:
    """One run of the grid (its record)."""
    return REPRODUCTION.run_one(root, cell, method, seed, results, work)
