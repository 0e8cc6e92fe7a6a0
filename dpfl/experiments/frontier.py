"""`dpfl reproduce frontier`: every method over sample-level DP-SGD on one privacy-utility
frontier (issue 26).

One common setting (``conf/frontier/mnist.toml``, ``fmnist.toml``): 10 clients,
Dirichlet(0.5), a 20,000-example training subset (2,000 of them the server's validation
split), 10 rounds, DP-SGD with sigma calibrated per client so that the whole run ends at
the cell's sample-level epsilon (delta 1e-5, PLD).

Cells: ``mnist-eps1`` ... ``mnist-eps8`` and ``fmnist-eps2``, ``fmnist-eps8`` (the epsilon is
the whole run's target), plus the non-private ceiling (FedAvg, plain SGD) once per dataset
and seed (``<dataset>-ceiling``).

Hyperparameters are chosen on the server's validation split, never on the test set: every
method tries the same number of configurations (:data:`TUNING`, three step sizes) at MNIST
epsilon 4 with seed 0 (``tune`` records), and the one with the best validation accuracy is
used in every cell and seed. The chosen configuration's tuning run doubles as the grid's
``mnist-eps4`` seed-0 run (same run-config and seed; its test accuracy was never looked at
during selection). Ablations of a method reuse the method's chosen step size.

Records: ``results/frontier/runs/<cell>__<method>__seed<k>.json`` and
``tune__<method>__cfg<i>.json``; the table (accuracy mean ± std, the gap to DP-FedAvg with a
paired t-test over seeds, the ledger's max epsilon, the verdict) in ``table.md`` /
``table.json``; ``frontier.png`` (accuracy vs epsilon, one line per method).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from dpfl.experiments.common import (
    Reproduction,
    honest_verdict,
    load_preset,
    load_records,
    mean_std,
    pyplot,
    record_epsilons,
    record_path,
    set_aside_incomplete,
    simulate_record,
    table_header,
    write_record,
)

CLIENTS = 10
DATASETS = {"mnist": "mnist.toml", "fmnist": "fmnist.toml"}
EPSILONS = {"mnist": (1.0, 2.0, 4.0, 8.0), "fmnist": (2.0, 8.0)}
TUNE_EPSILON = 4.0
TUNE_SEED = 0
BASELINE = "dpfedavg"
CEILING = "fedavg"

# Each method: its fixed run-config keys (the paper's or a documented choice) and the axis
# tuned on the validation split (three values for every method). Ablations name the
# method whose tuned value they reuse.
METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {"keys": {"strategy": "fedavg", "trainer": "plain"}},
    "dpfedavg": {"keys": {"strategy": "dpfedavg"}},
    "dpfedprox": {"keys": {"strategy": "dpfedprox", "prox-mu": 0.01}},
    "dpscaffold": {"keys": {"strategy": "dpscaffold"}},
    "dpfedexp": {"keys": {"strategy": "dpfedexp"}},
    "dpfedavgm": {"keys": {"strategy": "dpfedavgm", "server-momentum": 0.9,
                           "server-lr": 0.5}},
    "gcfl": {"keys": {"strategy": "gcfl", "gcfl-references": 1}},
    "pegasus": {"keys": {"strategy": "pegasus"}},
    "fedsmp": {"keys": {"strategy": "fedsmp", "fedsmp-mask": "topk", "fedsmp-ratio": 0.3}},
    "dpfedsam": {"keys": {"strategy": "dpfedsam", "sam-rho": 0.05}},
    "fedcompdp": {"keys": {"strategy": "fedcompdp"}},
    "fedcompdp-no-adpc": {"keys": {"strategy": "fedcompdp", "adpc": "off"},
                          "tuned-as": "fedcompdp"},
    "fedcompdp-no-cra": {"keys": {"strategy": "fedcompdp", "cra": False,
                                  "cd-correction": False}, "tuned-as": "fedcompdp"},
    "fedcompdp-no-llcm": {"keys": {"strategy": "fedcompdp", "llcm-ratio": 0.0,
                                   "sparsify": "none"}, "tuned-as": "fedcompdp"},
    "aadp": {"keys": {"strategy": "aadp", "aadp-noise": "calibrated"},
             "per-cell": "aadp-epsilon"},
    "fedasgp": {"keys": {"strategy": "fedasgp"}},
}
# The tuned axis: the client learning rate (the step size of every method's update); three
# values around the demo's 2.0 (batch 256) for DP-SGD, whose per-sample clip bounds the
# gradient, and 0.2-0.8 for the non-private ceiling. Its first axis, 0.05-0.2, chose its top
# value (validation 90.00 / 92.75 / 93.40 %) and left the ceiling below DP arms at epsilon 8:
# moved up, those runs kept in results/frontier/off-axis/ceiling-lr-0.05-0.2/ (plain SGD
# diverged at lr 1: 11 %).
TUNING: dict[str, list[dict[str, Any]]] = {
    m: [{"lr": lr} for lr in ((0.2, 0.4, 0.8) if m == "fedavg" else (1.0, 2.0, 4.0))]
    for m in METHODS if "tuned-as" not in METHODS[m]}
# AADP-FL's server step is Nadam, which divides every coordinate by its own running RMS: the
# client lr barely changes the step, the server's rate does (the paper's 0.01 in the middle).
TUNING["aadp"] = [{"server-lr": lr} for lr in (0.003, 0.01, 0.03)]
# DP-FedExP extrapolates the server step (eta_g >= 1, larger the noisier the updates): at lr 1,
# 2, 4 it reached 51 %, 19 % (results/frontier/off-axis/) before its axis moved down.
TUNING["dpfedexp"] = [{"lr": lr} for lr in (0.25, 0.5, 1.0)]
ORDER = tuple(METHODS)
# the five papers' methods (and FedCompDP's ablations); the rest are baselines
PAPER_METHODS = frozenset({"gcfl", "pegasus", "fedcompdp", "fedcompdp-no-adpc",
                           "fedcompdp-no-cra", "fedcompdp-no-llcm", "aadp", "fedasgp"})
LABELS = {
    "fedavg": "FedAvg (no DP, ceiling)", "dpfedavg": "DP-FedAvg", "dpfedprox": "DP-FedProx",
    "dpscaffold": "DP-SCAFFOLD", "dpfedexp": "DP-FedExP", "dpfedavgm": "DP-FedAvgM",
    "gcfl": "GCFL", "pegasus": "PEGASUS", "fedsmp": "Fed-SMP (top-k)",
    "dpfedsam": "DP-FedSAM (DP-SAT)", "fedcompdp": "FedCompDP",
    "fedcompdp-no-adpc": "FedCompDP w/o ADPC", "fedcompdp-no-cra": "FedCompDP w/o CRA/DA",
    "fedcompdp-no-llcm": "FedCompDP w/o LLCM", "aadp": "AADP-FL", "fedasgp": "DP-FedASGP",
}


def cell_name(dataset: str, epsilon: float | None) -> str:
    return f"{dataset}-ceiling" if epsilon is None else f"{dataset}-eps{epsilon:g}"


CELLS: dict[str, tuple[str, float | None]] = {
    cell_name(d, e): (d, e) for d in DATASETS for e in (*EPSILONS[d], None)}
# the order the grid runs in: MNIST epsilon 2 first (the headline row), then the rest
DEFAULT_CELLS = ("mnist-eps2", "mnist-ceiling", "mnist-eps4", "mnist-eps8", "mnist-eps1",
                 "fmnist-eps2", "fmnist-ceiling", "fmnist-eps8")


def aadp_round_epsilon(preset: dict[str, Any], epsilon: float) -> float:
    """AADP-FL's base per-round epsilon (eq. 2's eps, ``aadp-epsilon``) for a cell: the
    sample-level epsilon of one DP-SGD round of the mean-size client (n = (train-subset -
    server-holdout) / clients) at the sigma that lets all ``num-rounds`` rounds fit the
    whole-run target under RDP (the accountant of its Rényi filter), with a 0.1 % margin so
    the last round is admitted. A client larger than the mean gets more per round (eq. 2)
    and may be stopped by its filter before the last round."""
    from dpfl.privacy.accounting.accountants import calibrate_dpsgd_noise, dpsgd_epsilon
    from dpfl.privacy.plan import dpsgd_sample_rate, steps_per_epoch

    n = (int(preset["train-subset"]) - int(preset["server-holdout"])) // CLIENTS
    batch = int(preset["batch-size"])
    steps = steps_per_epoch(n, batch) * int(preset["local-epochs"])
    q = dpsgd_sample_rate(n, batch)
    rounds = int(preset["num-rounds"])
    sigma = calibrate_dpsgd_noise(0.999 * epsilon, float(preset["delta"]), q, rounds * steps,
                                  accountant="rdp")
    return dpsgd_epsilon(q, sigma, steps, float(preset["delta"]), "rdp")


def run_overrides(root: Path, cell: str, method: str, config: dict[str, Any],
                  seed: int, name: str) -> dict[str, Any]:
    """The run-config of one run: the dataset's preset, the method's keys, its chosen
    configuration, the cell's epsilon (and what the method derives from it), the seed."""
    dataset, epsilon = CELLS[cell]
    preset = load_preset(root, "frontier", DATASETS[dataset])
    out = {**preset, **METHODS[method]["keys"], **config, "seed": seed, "run-name": name}
    if epsilon is not None:
        out["target-epsilon"] = epsilon
        if METHODS[method].get("per-cell") == "aadp-epsilon":
            out["aadp-epsilon"] = round(aadp_round_epsilon(preset, epsilon), 6)
    return out


# -- validation accuracy (the selection criterion) ------------------------------------------

def validation_accuracy(run_dir: Path) -> float:
    """Accuracy of the run's final global model on the server's validation split
    (``server-holdout`` training examples no client holds)."""
    import torch

    from dpfl.data import server_validation
    from dpfl.methods import METHODS as REGISTRY
    from dpfl.methods import parse_run_config
    from dpfl.models.evaluation import evaluate_model
    from dpfl.server.runidentity import NUM_CLIENTS
    from dpfl.tensorfile import load_tensors

    saved = json.loads((run_dir / "config.json").read_text())
    cfg = parse_run_config({k: v for k, v in saved.items() if k != NUM_CLIENTS})
    x, y = server_validation(cfg)
    model = REGISTRY[cfg.strategy].build_model(cfg, tuple(x.shape[1:]), 10)
    state = load_tensors(run_dir / "checkpoint.pt")["model"]
    model.load_state_dict(state)
    _, preds = evaluate_model(model, x, y, torch.device("cpu"))
    return float((preds == y).float().mean())


# -- running ------------------------------------------------------------------------------

def tune_name(method: str, i: int) -> str:
    return f"tune__{method}__cfg{i}"


def grid_name(cell: str, method: str, seed: int) -> str:
    return f"{cell}__{method}__seed{seed}"


def chosen_config(results: Path, method: str) -> tuple[dict[str, Any], int] | None:
    """The configuration with the best validation accuracy among the method's tuning
    records (ties: the first), and its index; None until all are recorded."""
    base = METHODS[method].get("tuned-as", method)
    records = []
    for i in range(len(TUNING[base])):
        path = record_path(results, tune_name(base, i))
        if not path.exists():
            return None
        records.append(json.loads(path.read_text()))
    best = max(range(len(records)), key=lambda i: (records[i]["validation-accuracy"], -i))
    return TUNING[base][best], best


def _run(root: Path, results: Path, work: Path, name: str, cell: str, method: str,
         config: dict[str, Any], seed: int, extra: dict[str, Any]) -> dict[str, Any]:
    overrides = run_overrides(root, cell, method, config, seed, name)
    set_aside_incomplete(work, name)   # a run stopped before its record was written
    record = {"cell": cell, "method": method, "seed": seed, "tuned": config, **extra,
              **simulate_record(root, CLIENTS, overrides, work)}
    record["validation-accuracy"] = validation_accuracy(Path(record["run-dir"]))
    write_record(results, name, record)
    return record


def _report(i: int, total: int, name: str, rec: dict[str, Any], t0: float) -> None:
    eps = list(record_epsilons(rec).values())
    print(f"[{i}/{total}] {name}: test accuracy {rec['accuracy']:.4f}, validation "
          f"{rec['validation-accuracy']:.4f}, max eps {max(eps, default=math.inf):.4g}, "
          f"{time.time() - t0:.0f} s", flush=True)


def tuning_cell(method: str) -> str:
    """Where a method is tuned: MNIST at epsilon 4 (the ceiling: MNIST without DP)."""
    return cell_name("mnist", None if method == CEILING else TUNE_EPSILON)


def tune(root: Path, results: Path, work: Path, methods: list[str]) -> None:
    """Every configuration of every method (its ablations excepted) at MNIST epsilon 4,
    seed 0, unless recorded."""
    todo = [(m, i) for m in methods if "tuned-as" not in METHODS[m]
            for i in range(len(TUNING[m]))
            if not record_path(results, tune_name(m, i)).exists()]
    for k, (method, i) in enumerate(todo, 1):
        t0 = time.time()
        rec = _run(root, results, work, tune_name(method, i), tuning_cell(method), method,
                   TUNING[method][i], TUNE_SEED, {"tuning": i})
        _report(k, len(todo), tune_name(method, i), rec, t0)


def grid(root: Path, results: Path, work: Path, cells: list[str], methods: list[str],
         seeds: list[int], command: str) -> None:
    """The cells x seeds x methods with each method's chosen configuration (the ceiling
    only in ``*-ceiling`` cells, DP methods only in epsilon cells), cell-major in the given
    order; a recorded run is skipped; the tuning run is reused where it coincides."""
    todo = [(c, s, m) for c in cells for s in seeds for m in methods
            if (m == CEILING) == (CELLS[c][1] is None)]
    for k, (cell, seed, method) in enumerate(todo, 1):
        name = grid_name(cell, method, seed)
        if record_path(results, name).exists():
            continue
        chosen = chosen_config(results, method)
        if chosen is None:
            print(f"[{k}/{len(todo)}] {name}: skipped (tuning of "
                  f"{METHODS[method].get('tuned-as', method)} not recorded)", flush=True)
            continue
        config, index = chosen
        reuse = record_path(results, tune_name(method, index))
        if cell == tuning_cell(method) and seed == TUNE_SEED and reuse.exists():
            record = {**json.loads(reuse.read_text()), "reused-from": reuse.name}
            write_record(results, name, record)
            continue
        t0 = time.time()
        rec = _run(root, results, work, name, cell, method, config, seed, {})
        _report(k, len(todo), name, rec, t0)
        build_table(results, command)


def reproduce(root: Path, results: Path, work: Path, cells: list[str], methods: list[str],
              seeds: list[int], skip_existing: bool, command: str) -> str:
    """Tune, then run the grid. Runs already recorded are always skipped (``skip_existing``
    is implied: the grid takes hours and resumes where it stopped)."""
    results.mkdir(parents=True, exist_ok=True)
    needed = sorted({METHODS[m].get("tuned-as", m) for m in methods}, key=ORDER.index)
    tune(root, results, work, needed)
    grid(root, results, work, cells, methods, seeds, command)
    return build_table(results, command)


# -- the table -----------------------------------------------------------------------------

def paired_gap(method_runs: list[dict[str, Any]], baseline_runs: list[dict[str, Any]]
               ) -> tuple[float, float | None, int]:
    """Mean accuracy gap (percentage points) of a method over DP-FedAvg on the seeds both
    ran, and the two-sided paired t-test's p-value (None with fewer than 2 pairs or no
    spread)."""
    from scipy.stats import ttest_rel

    base = {r["seed"]: r["accuracy"] for r in baseline_runs}
    pairs = [(r["accuracy"], base[r["seed"]]) for r in method_runs if r["seed"] in base]
    if not pairs:
        return math.nan, None, 0
    diffs = [100 * (a - b) for a, b in pairs]
    p = None
    if len(pairs) >= 2 and statistics.pstdev(diffs) > 0:
        p = float(ttest_rel([a for a, _ in pairs], [b for _, b in pairs]).pvalue)
    return statistics.fmean(diffs), p, len(pairs)


def _tuning_lines(results: Path) -> list[str]:
    lines = ["## Hyperparameter selection (MNIST, ε = 4, seed 0, server validation split)",
             "", "| method | " + " | ".join(f"cfg {i}" for i in range(3)) + " | chosen |",
             "|---|---|---|---|---|"]
    for m in ORDER:
        if m not in TUNING:
            continue
        cells = []
        for i, config in enumerate(TUNING[m]):
            path = record_path(results, tune_name(m, i))
            shown = ", ".join(f"{k}={v}" for k, v in config.items())
            if path.exists():
                shown += f": {100 * json.loads(path.read_text())['validation-accuracy']:.2f}"
            cells.append(shown)
        chosen = chosen_config(results, m)
        lines.append(f"| {LABELS[m]} | " + " | ".join(cells) + " | "
                     f"{'—' if chosen is None else f'cfg {chosen[1]}'} |")
    return lines + [""]


def build_table(results: Path, command: str) -> str:
    runs = [r for r in load_records(results) if "tuning" not in r or "reused-from" in r]
    lines = table_header(
        "Privacy-utility frontier: every method over sample-level DP-SGD", command,
        "Test accuracy in % (10,000 test images), mean ± std over seeds; gap: mean paired "
        "difference to DP-FedAvg over the seeds both ran (percentage points) with the "
        "two-sided paired t-test's p; max ε: the largest per-client ε guaranteed "
        "(sample-level, add/remove, Poisson, δ = 1e-5, PLD; for AADP-FL, whose budgets are "
        "chosen adaptively, the Rényi filter's budget, not the plain composition of its "
        "rounds). 10 clients, Dirichlet(0.5), "
        "20,000-example subset, 10 rounds (results/frontier/README.md).", runs)
    table: dict[str, Any] = {}
    by = {}
    for r in runs:
        by.setdefault(r["cell"], {}).setdefault(r["method"], []).append(r)
    for cell in CELLS:
        if cell not in by:
            continue
        lines += [f"## {cell}", "", "| method | n | accuracy % | gap to DP-FedAvg (pp) | "
                  "paired p | max ε | verdict |", "|---|---|---|---|---|---|---|"]
        base = by[cell].get(BASELINE, [])
        for m in ORDER:
            rs = sorted(by[cell].get(m, []), key=lambda r: r["seed"])
            if not rs:
                continue
            gap, p, pairs = (paired_gap(rs, base) if m != BASELINE and base
                             else (math.nan, None, 0))
            eps = max((max(record_epsilons(r).values(), default=math.inf) for r in rs),
                      default=math.inf)
            row = {"accuracy": [r["accuracy"] for r in rs], "seeds": [r["seed"] for r in rs],
                   "gap-pp": gap, "p": p, "pairs": pairs, "max-epsilon": eps,
                   "tuned": rs[0].get("tuned"), "verdict": honest_verdict(rs[0])}
            table.setdefault(cell, {})[m] = row
            gap_s = "—" if math.isnan(gap) else f"{gap:+.2f} ({pairs} seeds)"
            p_s = "—" if p is None else f"{p:.3f}"
            eps_s = "∞" if math.isinf(eps) else f"{eps:.3f}"
            lines.append(f"| {LABELS[m]} | {len(rs)} | {mean_std(row['accuracy'])} | {gap_s} | "
                         f"{p_s} | {eps_s} | {row['verdict'].split(':')[0]} |")
        lines.append("")
    lines += _tuning_lines(results)
    text = "\n".join(lines) + "\n"
    (results / "table.json").write_text(json.dumps(table, indent=1, default=str))
    (results / "table.md").write_text(text)
    _plot(table, results / "frontier.png")
    return text


def _plot(table: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(DATASETS), figsize=(14, 5.5), squeeze=False)
    markers = "osD^v<>pPhX*d18"
    for ax, dataset in zip(axes[0], DATASETS):
        eps_list = EPSILONS[dataset]
        for k, m in enumerate(ORDER):
            if m == CEILING:
                row = table.get(cell_name(dataset, None), {}).get(m)
                if row:
                    ax.axhline(100 * statistics.fmean(row["accuracy"]), color="dimgray",
                               ls=":", lw=1.5, label=LABELS[m])
                continue
            pts = [(e, table[c][m]["accuracy"]) for e in eps_list
                   if m in table.get(c := cell_name(dataset, e), {})]
            if not pts:
                continue
            xs = [e for e, _ in pts]
            ys = [100 * statistics.fmean(a) for _, a in pts]
            err = [100 * statistics.stdev(a) if len(a) > 1 else 0.0 for _, a in pts]
            paper = m in PAPER_METHODS
            ax.errorbar(xs, ys, yerr=err, marker=markers[k % len(markers)], capsize=3,
                        color="black" if m == BASELINE else plt.cm.tab20(k % 20),
                        ls="-" if paper or m == BASELINE else "--",
                        lw=2.6 if m == BASELINE else (1.6 if paper else 1.1), label=LABELS[m])
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(eps_list), [f"{e:g}" for e in eps_list])
        ax.set_xlabel("whole-run ε per client (sample-level, δ = 1e-5)")
        ax.set_ylabel("test accuracy %")
        ax.set_title({"mnist": "MNIST", "fmnist": "Fashion-MNIST"}[dataset] +
                     " — 10 clients, Dirichlet(0.5)")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="center right", fontsize=8,
                   title="solid: the five papers' methods", title_fontsize=8)
        fig.subplots_adjust(left=0.05, right=0.84, wspace=0.18)
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Frontier(Reproduction):
    """The frontier's own loop: tune on the validation split, then the grid."""

    def reproduce(self, root: Path, results: Path, work: Path, cells: list[str],
                  methods: list[str], seeds: list[int], skip_existing: bool,
                  command: str) -> str:
        return reproduce(root, results, work, cells, methods, seeds, skip_existing, command)


REPRODUCTION = Frontier(
    name="frontier", presets="frontier", clients=CLIENTS, cells=dict.fromkeys(CELLS, ""),
    default_cells=DEFAULT_CELLS, methods=ORDER, default_methods=ORDER,
    build_table=build_table,
)
