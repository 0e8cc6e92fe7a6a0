"""``dpfl reproduce ftrl``: private federated training without a sampling assumption
(issue 49) — correlated noise over the rounds against independent noise, at equal ε.

Setting (``conf/ftrl/mnist1000.toml``): MNIST, 1,000 clients × 60 examples, IID, cohorts
of 100 (``fraction-train`` = 0.1), 50 rounds, the MNIST CNN, DP-FedAvg with client-level
DP (``trainer=update-dp``, ``trust=central``: the server clips, noises and is trusted), a
fixed clip C = 0.5, δ = 1e-5, PLD accounting, server step linear in the released sum
(``dpfedavg``, server-lr 1: DP-FTRL as analysed). Cells ``eps2`` / ``eps4`` / ``eps8``: the
whole-run client-level ε every arm is calibrated to. A real cross-device deployment draws a
round's cohort from the devices that are available: it cannot promise Poisson sampling, so
the amplification the usual central accounting claims is not its to claim.

Arms (every one: unit client, add-remove of a client's whole data, trusted server):

- ``poisson``: ``central-noise=gaussian`` — fresh N(0, σ²C²) on the sum every round,
  clients sampled by Poisson(q = 0.1) with the server's secret randomness, amplification
  by sampling accounted, every client charged every round. What a deployment could claim
  ONLY if it really Poisson-samples; it bounds nobody's participations (a client may be in
  many more than 5 rounds). Beside the others, not in the ordering.
- ``independent``: ``central-noise=banded-mf`` with ``central-band=1`` — C = identity:
  fresh Gaussian noise per round as above, but no sampling claimed: a fixed cohort of 100
  drawn by availability under the participation schema (at most k = 5 participations per
  client, any two ≥ b = 10 rounds apart, enforced by the server), accounted exactly over a
  client's k participations without amplification. The honest baseline.
- ``tree``: ``central-noise=tree`` under the same schema — DP-FTRL tree aggregation with
  Honaker's estimator (Kairouz, McMahan, Song, Thakkar, Thakurta & Xu, "Practical and
  Private (Deep) Learning without Sampling or Shuffling", ICML 2021). For this schema the
  proportional charge is no bound, so a client is charged the whole run at its first
  participation (:mod:`dpfl.privacy.correlated_charging`).
- ``banded-mf``: ``central-noise=banded-mf`` with band 10 = the separation, under the same
  schema — banded Toeplitz matrix factorization (Choquette-Choo, McMahan, Rush &
  Thakurta, "Multi-Epoch Matrix Factorization Mechanisms for Private Machine Learning",
  ICML 2023; Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu, "(Amplified)
  Banded Matrix Factorization: A unified approach to private training", NeurIPS 2023),
  each participation charged at its column of C (exact).

The schema keys are not in the preset: ``central-noise=gaussian`` refuses them (it has no
schema), so :data:`SCHEMA` is added to the three correlated arms only. With 1,000 clients,
cohorts of 100, b = 10 and k = 5 over 50 rounds the schema can just fill every cohort (each
client in every 10th round, 5 times).

The published ordering to check, at equal ε without sampling: banded MF ≥ tree ≥
independent (test accuracy; ICML 2023 and NeurIPS 2023 above, multi-participation FL
experiments). ``build_table`` states, per cell, whether the seed means kept it (computed
from the records, :func:`ordering`). Each run's record also holds how many rounds each
client was in the cohort (from ``rounds.jsonl``'s ``sampled-nodes``: :func:`participations`).
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

from dpfl.experiments.common import (
    Reproduction,
    honest_verdict,
    load_records,
    mean_std,
    pyplot,
    save_figure,
    table_header,
    write_table,
)

CLIENTS = 1000
EPSILONS = {"eps2": 2.0, "eps4": 4.0, "eps8": 8.0}
CELLS = {cell: "mnist1000.toml" for cell in EPSILONS}
MAX_PARTICIPATIONS = 5    # k: at most 5 rounds per client
MIN_SEPARATION = 10       # b: 1,000 clients / cohorts of 100 = one "epoch" between two
SCHEMA: dict[str, Any] = {"max-participations": MAX_PARTICIPATIONS,
                          "min-separation": MIN_SEPARATION}
ARMS: dict[str, dict[str, Any]] = {
    "poisson": {"central-noise": "gaussian"},
    "independent": {"central-noise": "banded-mf", "central-band": 1, **SCHEMA},
    "tree": {"central-noise": "tree", **SCHEMA},
    "banded-mf": {"central-noise": "banded-mf", "central-band": MIN_SEPARATION, **SCHEMA},
}
# the published ordering at equal epsilon, best first (poisson is beside it)
ORDERING = ("banded-mf", "tree", "independent")
COLOURS = {"poisson": "tab:gray", "independent": "tab:red", "tree": "tab:green",
           "banded-mf": "tab:blue"}
MARKERS = {"poisson": "s", "independent": "o", "tree": "^", "banded-mf": "D"}


def run_config(preset: dict[str, Any], cell: str, arm: str) -> dict[str, Any]:
    """The preset, DP-FedAvg (a linear server step), the arm's keys, the cell's epsilon."""
    return {**preset, "strategy": "dpfedavg", **ARMS[arm], "target-epsilon": EPSILONS[cell]}


# -- participations -------------------------------------------------------------------------

def participations_of(run_dir: Path) -> dict[str, Any] | None:
    """How many rounds each client was in the cohort, from ``rounds.jsonl``: ``max`` and
    ``mean`` over the federation's clients (those never drawn count 0) of the rounds whose
    ``sampled-nodes`` held its node, and ``max-accepted``, the most rounds one client's
    update was accepted. None without the file."""
    path = Path(run_dir) / "rounds.jsonl"
    if not path.is_file():
        return None
    cohort: dict[int, int] = {}
    accepted: dict[str, int] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        for node in r.get("sampled-nodes", []):
            cohort[node] = cohort.get(node, 0) + 1
        for client, c in r.get("clients", {}).items():
            if c.get("status") == "accepted":
                accepted[client] = accepted.get(client, 0) + 1
    return {"max": max(cohort.values(), default=0),
            "mean": sum(cohort.values()) / CLIENTS,
            "max-accepted": max(accepted.values(), default=0)}


def participations(record: dict[str, Any]) -> dict[str, Any]:
    """The :class:`Reproduction`'s ``extra`` hook: the record's participations (read from
    its run directory; nothing when the directory has no round log)."""
    seen = participations_of(Path(record.get("run-dir", "")))
    return {} if seen is None else {"participations": seen}


def _participations(record: dict[str, Any]) -> dict[str, Any] | None:
    """A record's participations: kept in it, or read from its run directory if still there."""
    if "participations" in record:
        return record["participations"]
    return participations_of(Path(record["run-dir"])) if record.get("run-dir") else None


# -- the table --------------------------------------------------------------------------------

def _max_eps(record: dict[str, Any]) -> float:
    eps = list(record["epsilon"].values())
    return max(eps) if eps else float("inf")


def _mean_eps(record: dict[str, Any]) -> float:
    eps = list(record["epsilon"].values())
    return sum(eps) / len(eps) if eps else float("inf")


def _by_cell_arm(runs: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("cell") in EPSILONS and r.get("method") in ARMS:
            groups.setdefault((r["cell"], r["method"]), []).append(r)
    return groups


def ordering(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per cell with records: whether the seed-mean test accuracies kept banded-mf ≥ tree ≥
    independent. ``held``: True / False, None while an arm has no record; ``means``:
    arm -> mean accuracy; ``missing``: the arms without a record; ``broken``: the adjacent
    pairs (better, worse) the means put the other way round."""
    groups = _by_cell_arm(runs)
    out: dict[str, dict[str, Any]] = {}
    for cell in EPSILONS:
        if not any(c == cell for c, _ in groups):
            continue
        means = {arm: statistics.fmean(r["accuracy"] for r in groups[(cell, arm)])
                 for arm in ORDERING if (cell, arm) in groups}
        missing = [arm for arm in ORDERING if arm not in means]
        broken = [(a, b) for a, b in itertools.pairwise(ORDERING)
                  if a in means and b in means and means[a] < means[b]]
        held = False if broken else (None if missing else True)
        out[cell] = {"held": held, "means": means, "missing": missing, "broken": broken}
    return out


def ordering_line(cell: str, result: dict[str, Any]) -> str:
    """One line for the table: the cell, the means in the published order, the verdict."""
    means = result["means"]
    chain = " ≥ ".join(f"{arm} {100 * means[arm]:.2f}" if arm in means else f"{arm} —"
                       for arm in ORDERING)
    if result["held"] is True:
        verdict = "held"
    elif result["held"] is False:
        verdict = "did NOT hold (" + "; ".join(
            f"{a} {100 * means[a]:.2f} < {b} {100 * means[b]:.2f}"
            for a, b in result["broken"]) + ")"
    else:
        verdict = "not decided yet (no record of " + ", ".join(result["missing"]) + ")"
    return f"- {cell} (ε = {EPSILONS[cell]:g}): {chain} — {verdict}"


def _fmt_part(seen: dict[str, Any] | None) -> str:
    return "—" if seen is None else f"{seen['max']} ({seen['mean']:.2f})"


def build_table(results: Path, command: str) -> str:
    runs = [r for r in load_records(results)
            if r.get("cell") in EPSILONS and r.get("method") in ARMS]
    lines = table_header(
        "Private training without sampling: DP-FTRL and banded MF against independent noise",
        command,
        "Per run: the verdict, the largest and mean per-client ε on the ledger (client level, "
        "add-remove, δ 1e-5, PLD; poisson: Poisson(0.1) amplification, every client charged "
        "every round; independent / tree / banded-mf: no sampling, only the clients that took "
        "part charged, under the schema k = 5 participations ≥ 10 rounds apart), the final "
        "test accuracy, the wall time, and the participations: the most rounds one client "
        "was in the cohort (in brackets the mean over the 1,000 clients).", runs)
    lines += [("| cell | arm | seed | verdict | max ε | mean ε | accuracy % | "
               "participations max (mean) | minutes |"),
              "|---|---|---|---|---|---|---|---|---|"]
    order_cells, order_arms = list(EPSILONS), list(ARMS)
    rows = []
    for rec in sorted(runs, key=lambda r: (order_cells.index(r["cell"]),
                                           order_arms.index(r["method"]), r["seed"])):
        seen = _participations(rec)
        lines.append(f"| {rec['cell']} | {rec['method']} | {rec['seed']} | "
                     f"{honest_verdict(rec)[:40]} | {_max_eps(rec):.3g} | {_mean_eps(rec):.3g} | "
                     f"{100 * rec['accuracy']:.2f} | {_fmt_part(seen)} | "
                     f"{rec['wall-seconds'] / 60:.1f} |")
        rows.append({"cell": rec["cell"], "arm": rec["method"], "seed": rec["seed"],
                     "verdict": honest_verdict(rec), "max-epsilon": _max_eps(rec),
                     "mean-epsilon": _mean_eps(rec), "accuracy": rec["accuracy"],
                     "participations": seen, "minutes": rec["wall-seconds"] / 60})
    lines += ["", "Seed means (accuracy: mean ± sample std over the seeds):", "",
              "| cell | arm | seeds | accuracy % | max ε | participations max |",
              "|---|---|---|---|---|---|"]
    means = []
    groups = _by_cell_arm(runs)
    for cell in order_cells:
        for arm in order_arms:
            group = groups.get((cell, arm))
            if not group:
                continue
            seen = [s for s in (_participations(r) for r in group) if s is not None]
            most = max((s["max"] for s in seen), default=None)
            lines.append(f"| {cell} | {arm} | {len(group)} | "
                         f"{mean_std([r['accuracy'] for r in group])} | "
                         f"{max(_max_eps(r) for r in group):.3g} | "
                         f"{'—' if most is None else most} |")
            means.append({"cell": cell, "arm": arm, "seeds": len(group),
                          "accuracy": statistics.fmean(r["accuracy"] for r in group),
                          "max-epsilon": max(_max_eps(r) for r in group),
                          "participations-max": most})
    verdicts = ordering(runs)
    lines += ["", ("The published ordering at equal ε without sampling, banded-mf ≥ tree ≥ "
                   "independent (seed means of the test accuracy; poisson beside it):"), ""]
    lines += [ordering_line(cell, v) for cell, v in verdicts.items()] or ["- no records yet"]
    plot(runs, results / "accuracy-vs-epsilon.png")
    return write_table(results, lines, {"runs": rows, "means": means, "ordering": verdicts})


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Test accuracy against the largest per-client ε on the ledger, one line per arm (seed
    means, a bar of ± one sample std when a cell has several seeds)."""
    groups = _by_cell_arm(runs)
    if not groups:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for arm in ARMS:
        pts = []
        for cell in EPSILONS:
            group = groups.get((cell, arm))
            if not group:
                continue
            accs = [100 * r["accuracy"] for r in group]
            pts.append((max(_max_eps(r) for r in group), statistics.fmean(accs),
                        statistics.stdev(accs) if len(accs) > 1 else 0.0))
        if not pts:
            continue
        xs, ys, errs = zip(*sorted(pts))
        ax.errorbar(xs, ys, yerr=errs, marker=MARKERS[arm], color=COLOURS[arm], capsize=3,
                    ls="--" if arm == "poisson" else "-",
                    label=arm + (" (Poisson sampling claimed)" if arm == "poisson" else ""))
    ax.set_xscale("log")
    ticks = sorted(set(EPSILONS.values()))
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("largest per-client ε on the ledger (δ = 1e-5)")
    ax.set_ylabel("test accuracy %")
    ax.set_title("MNIST, 1,000 clients: noise without a sampling assumption")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path)


REPRODUCTION = Reproduction(
    name="ftrl", presets="ftrl", clients=CLIENTS, cells=CELLS,
    default_cells=tuple(EPSILONS), methods=tuple(ARMS), default_methods=tuple(ARMS),
    build_table=build_table, run_config=run_config, extra=participations)


def run_one(root: Path, cell: str, method: str, seed: int, results: Path,
            work: Path) -> dict[str, Any]:
    """One run of the grid (its record)."""
    return REPRODUCTION.run_one(root, cell, method, seed, results, work)
