"""`dpfl reproduce fedasgp`: Table VI of DP-FedASGP (Zhang, Mao, He, Huang & Wu, "Balancing
Privacy and Accuracy Using Significant Gradient Protection in Federated Learning", IEEE
Transactions on Computers, 2024) in shape: MNIST, the paper's CNN, 100 clients, 10 % per
round, Dirichlet(1), C = 1, batch 128, lr 0.1, epsilon per round in {0.1, 0.2, 0.5, 1, 2, 4}.

Cells are named by the epsilon per round of the paper: ``eps0.1`` ... ``eps4`` read
``conf/fedasgp/mnist.toml`` (a shortened run), ``paper-eps0.1`` ... ``paper-eps4`` read
``mnist-paper.toml`` (the paper's 200 rounds on all 60,000 examples; not in the default grid).

Arms, compared at EQUAL ACCOUNTED EPSILON. The paper's epsilon is DP-FedASGP's per round
(eps = eps_1 + eps_2 + eps_3); for a Gaussian arm a per-round epsilon means nothing without
the composition that follows. So every arm gets the same whole-run budget per client: the
epsilon that the ledger reports for a client of DP-FedASGP strict that takes part in every
one of the ``num-rounds`` rounds (:func:`matched_epsilon`: that many pure eps events, each
replace-one, composed as the ledger composes them: the smaller of basic composition and the
pure-DP RDP bound, at the preset's delta). It is every arm's ``target-epsilon``; the
Gaussian arms (``dpfedavg``, ``fedsmp-*``) calibrate their noise multiplier to it over
``num-rounds`` participations (``noise-multiplier = 0``), DP-FedASGP spends ``asgp-epsilon``
= the cell's epsilon per round. A client that takes part in fewer rounds (with 10 % per round
most take part in about a tenth of them; none is refused) ends below the target in every
arm; the table gives the largest and the mean ledger epsilon over the clients that took
part. Client selection is the base strategy's fixed-size seeded uniform sample of
``fraction-train`` x 100 = 10 nodes per round; no amplification by client sampling is
claimed for noise a client adds itself (each round a client takes part in is charged in
full).

- ``dpfedavg``: client-level DP-FedAvg (update clipped to C plus N(0, sigma^2 C^2)).
- ``fedasgp-paper``: DP-FedASGP as published (verdict none: raw non-significant
  coordinates and the loss in the clear; its ledger charges the nominal eps per round).
- ``fedasgp-strict``: the sparse-vector variant (formal), calibrated noise.
- ``fedsmp-randk``: Fed-SMP with a public random-k mask (k/d = ``fedsmp-ratio``, 0.1).
- ``fedsmp-topk``: Fed-SMP-top_k, the paper's baseline (verdict none: the top-k positions
  are released); not in the default grid.
- ``cpsgd``: cpSGD (Agarwal et al., NeurIPS 2018) over SecAgg+ (``trust=distributed``),
  accounted by ``dpfl.privacy.mechanisms.binomial``; not in the default grid (not run yet).

Table III (attack accuracy) in shape: cells ``mia-eps0.1``, ``mia-eps0.2``, ``mia-eps0.5``
read ``conf/fedasgp/mia.toml`` (10 clients, every method over DP-SGD: the paper's own
sample-level threat model; ``record-global-models`` on) and run the arms of
:data:`MIA_METHODS` at the whole-run sample-level target ``matched_epsilon`` of the cell's
epsilon per round; after each run, ``dpfl attack`` (:data:`MIA_ATTACK`) scores the final
global model with Basic-MIA (loss threshold), ML-Leaks, RMIA and the white-box gradient norm,
and CS-MIA over every round's global model; the table gives each attack's accuracy beside
the paper's MNIST CNN row. cpSGD runs as ``cpsgd-secagg`` (client level, over SecAgg+: it
has no DP-SGD reading); DP-FedSNLC (no algorithm available) is listed, not run.

Records go to ``results/fedasgp/runs/<cell>__<arm>__seed<k>.json``; the table (accuracy
mean ± std over seeds beside the paper's Table VI, each arm's ledger epsilon and verdict,
and the strict variant's true per-round epsilon at the paper's noise scales) to
``table.md`` / ``table.json``; plots: ``accuracy.png`` (accuracy by round per arm),
``significant.png`` (fraction of released significant coordinates per round, both
DP-FedASGP variants), ``gamma.png`` (the spread max - min of the eq. 16 weights per round).
"""

from __future__ import annotations

import json
import statistics
from functools import lru_cache
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

CLIENTS = 100
EPSILONS = {"eps0.1": 0.1, "eps0.2": 0.2, "eps0.5": 0.5, "eps1": 1.0, "eps2": 2.0, "eps4": 4.0}
PAPER_PREFIX = "paper-"
# Table III (attack accuracy): the paper's three budgets, sample level, conf/fedasgp/mia.toml
MIA_PREFIX = "mia-"
MIA_EPSILONS = ("eps0.1", "eps0.2", "eps0.5")
MIA_CLIENTS = 10
# cell -> preset file: the shortened preset, and the paper's length under "paper-<cell>"
CELLS: dict[str, str] = {**{cell: "mnist.toml" for cell in EPSILONS},
                         **{PAPER_PREFIX + cell: "mnist-paper.toml" for cell in EPSILONS},
                         **{MIA_PREFIX + cell: "mia.toml" for cell in MIA_EPSILONS}}
DEFAULT_CELLS = tuple(EPSILONS)
_UPDATE_DP = {"trainer": "update-dp"}
METHODS: dict[str, dict[str, Any]] = {
    "dpfedavg": {"strategy": "dpfedavg", **_UPDATE_DP},
    "fedasgp-paper": {"strategy": "fedasgp", **_UPDATE_DP, "asgp-variant": "paper"},
    "fedasgp-strict": {"strategy": "fedasgp", **_UPDATE_DP, "asgp-variant": "strict"},
    "fedsmp-randk": {"strategy": "fedsmp", **_UPDATE_DP, "fedsmp-mask": "randk"},
    "fedsmp-topk": {"strategy": "fedsmp", **_UPDATE_DP, "fedsmp-mask": "topk"},
    # cpSGD over SecAgg+ (trust=distributed): binomial shares, charged binomial events
    "cpsgd": {"strategy": "cpsgd", **_UPDATE_DP, "trust": "distributed"},
}
DEFAULT_METHODS = ("dpfedavg", "fedasgp-paper", "fedasgp-strict", "fedsmp-randk")
# The attack cells' arms: every method over DP-SGD (sample level; DP-FedASGP's two variants
# differ only in their update-dp release, so one arm), and a non-private ceiling trained to
# overfit (5 local epochs, batch 32, lr 0.1) that shows what the attacks find without DP.
_DPSGD = {"trainer": "dpsgd"}
MIA_METHODS: dict[str, dict[str, Any]] = {
    "dpfedavg-dpsgd": {"strategy": "dpfedavg", **_DPSGD},
    "fedasgp-dpsgd": {"strategy": "fedasgp", **_DPSGD},
    "fedsmp-dpsgd": {"strategy": "fedsmp", **_DPSGD, "fedsmp-mask": "topk"},
    "fedavg-plain": {"strategy": "fedavg", "trainer": "plain", "local-epochs": 5,
                     "batch-size": 32, "lr": 0.1},
    # cpSGD has no DP-SGD reading: its binomial noise is on the securely summed updates, a
    # client-level guarantee (stronger than the cell's sample-level one at the same epsilon)
    "cpsgd-secagg": {"strategy": "cpsgd", "trainer": "update-dp", "trust": "distributed",
                     "lr": 0.1},
}
METHODS.update(MIA_METHODS)
# dpfl attack on each attack-cell run: the target client, the attacker's sizes
MIA_ATTACK = {"client": 0, "reference_models": 2, "shadow_epochs": 5, "max_members": 500,
              "population": 1000}
# Table III, MNIST, CNN rows, attack accuracy %: epsilon -> method ->
# (Basic-MIA, ML-Leaks, White-box, CS-MIA)
PAPER_MIA: dict[float, dict[str, tuple[float, float, float, float]]] = {
    0.1: {"DP-FedAvg": (50.01, 50.02, 50.02, 51.09), "cpSGD": (50.01, 50.01, 50.02, 51.09),
          "DP-FedSNLC": (50.09, 50.21, 50.24, 51.15), "FedSMP": (50.06, 50.15, 50.20, 51.17),
          "DP-FedASGP": (50.04, 50.09, 50.11, 51.15)},
    0.2: {"DP-FedAvg": (50.04, 50.18, 50.35, 51.28), "cpSGD": (50.03, 50.16, 50.23, 51.22),
          "DP-FedSNLC": (50.15, 50.27, 50.55, 51.35), "FedSMP": (50.13, 50.25, 50.43, 51.31),
          "DP-FedASGP": (50.09, 50.21, 50.36, 51.30)},
    0.5: {"DP-FedAvg": (50.13, 50.39, 50.83, 51.46), "cpSGD": (50.10, 50.36, 50.81, 51.40),
          "DP-FedSNLC": (50.26, 50.52, 50.91, 51.55), "FedSMP": (50.19, 50.49, 50.88, 51.52),
          "DP-FedASGP": (50.17, 50.44, 50.86, 51.48)},
}
# our arm -> the paper's row; the attack names of dpfl attack -> the paper's columns
MIA_PAPER_ROW = {"dpfedavg-dpsgd": "DP-FedAvg", "fedasgp-dpsgd": "DP-FedASGP",
                 "fedsmp-dpsgd": "FedSMP", "cpsgd-secagg": "cpSGD"}
MIA_COLUMNS = (("loss", "Basic-MIA"), ("ml-leaks", "ML-Leaks"),
               ("gradient-norm", "White-box (grad. norm)"), ("cs-mia", "CS-MIA"),
               ("rmia", "RMIA (best threshold)"))
# rows the paper has that no arm here runs, and why
MIA_PENDING = {"DP-FedSNLC": "not implemented: its algorithm is not available (README)"}
LABELS = {
    "dpfedavg": "DP-FedAvg (client-level, Gaussian)",
    "fedasgp-paper": "DP-FedASGP as published (not DP)",
    "fedasgp-strict": "DP-FedASGP strict (sparse vector)",
    "fedsmp-randk": "Fed-SMP rand-k (public mask)",
    "fedsmp-topk": "Fed-SMP top-k (positions released)",
    "cpsgd": "cpSGD (quantised binomial over SecAgg+)",
    "dpfedavg-dpsgd": "DP-FedAvg (DP-SGD)",
    "fedasgp-dpsgd": "DP-FedASGP (DP-SGD; paper = strict here)",
    "fedsmp-dpsgd": "Fed-SMP top-k (DP-SGD)",
    "fedavg-plain": "FedAvg, no DP (overfitted ceiling)",
    "cpsgd-secagg": "cpSGD over SecAgg+ (client-level)",
}
# Table VI, MNIST CNN, % accuracy: epsilon -> (DP-FedAvg, DP-FedASGP)
PAPER: dict[float, tuple[float, float]] = {
    0.1: (88.34, 91.16), 0.2: (91.68, 93.24), 0.5: (93.87, 94.75), 1.0: (95.12, 95.83),
    2.0: (96.27, 96.68), 4.0: (96.89, 97.32)}
PAPER_COLUMN = {"dpfedavg": 0, "fedasgp-paper": 1, "fedasgp-strict": 1}


def cell_epsilon(cell: str) -> float:
    """The paper's epsilon per round of a cell (``eps0.5``, ``paper-eps0.5`` and
    ``mia-eps0.5``: 0.5)."""
    return EPSILONS[cell.removeprefix(PAPER_PREFIX).removeprefix(MIA_PREFIX)]


def is_mia_cell(cell: str) -> bool:
    return cell.startswith(MIA_PREFIX)


@lru_cache(maxsize=None)
def matched_epsilon(eps_round: float, rounds: int, delta: float, accountant: str) -> float:
    """The whole-run epsilon the ledger reports for a DP-FedASGP strict client that takes
    part in all ``rounds`` rounds at ``eps_round`` each: ``rounds`` pure sparse-vector events
    (replace-one) composed by :func:`dpfl.privacy.accounting.events.history_epsilon` (the smaller of
    rounds x eps and the pure-DP RDP bound eps-DP => (alpha, alpha eps^2 / 2)-RDP, at
    ``delta``). Every arm of a cell gets it as ``target-epsilon``."""
    from dpfl.privacy.accounting.events import PrivacyEvent, history_epsilon

    events = [PrivacyEvent.pure(r, eps_round, "sparse-vector", relation="replace-one")
              for r in range(1, rounds + 1)]
    return history_epsilon(events, delta, accountant)


def _run_config(preset: dict[str, Any], cell: str, method: str) -> dict[str, Any]:
    """Preset + the arm's keys + the cell's budget: DP-FedASGP's epsilon per round, and the
    matched whole-run target for every arm."""
    eps = cell_epsilon(cell)
    keys = dict(METHODS[method])
    if is_mia_cell(cell) != (method in MIA_METHODS):
        raise ValueError(f"method {method} does not run in cell {cell}: the attack cells "
                         f"(mia-*) run {list(MIA_METHODS)}, the others the rest")
    if keys["strategy"] == "fedasgp" and keys["trainer"] == "update-dp":
        keys["asgp-epsilon"] = eps
    target = matched_epsilon(eps, int(preset["num-rounds"]), float(preset["delta"]),
                             str(preset["accountant"]))
    return {**preset, **keys, "target-epsilon": target}


def _attack_extra(record: dict[str, Any]) -> dict[str, Any]:
    """Attack cells: ``dpfl attack`` on the finished run (target client 0, the final global
    model and CS-MIA over every round's global model); each attack's accuracy, AUC and
    TPR at 1 % FPR."""
    from dpfl.attacks.command import attack_run

    report = attack_run(Path(record["run-dir"]), seed=int(record["seed"]),
                        log=lambda msg: None, **MIA_ATTACK)
    attacks = {a["name"]: {k: a[k] for k in ("accuracy", "auc", "tpr@1%fpr", "members")}
               for a in report["targets"]["global"]["attacks"]}
    return {"attack": attacks, "attack-settings": {**MIA_ATTACK,
                                                   "cs-mia": report.get("cs-mia")}}


def rescore_csmia(results: Path, command: str) -> None:
    """Recompute CS-MIA alone (the same records and seed as :func:`_attack_extra`) on the run
    directory of every attack-cell record under ``results`` with the current code, keep the
    previous CS-MIA numbers as ``cs-mia-before-rescore``, rebuild the table. (Used once: the
    first attack-cell runs were scored before CS-MIA's known non-members were
    label-matched.)"""
    from dpfl.attacks.csmia import csmia_attack
    from dpfl.attacks.target import attack_data, attacker_records, global_models, run_config
    from dpfl.data import load_dataset

    a = MIA_ATTACK
    for path in sorted((results / "runs").glob(f"{MIA_PREFIX}*.json")):
        record = json.loads(path.read_text())
        run_dir, seed = Path(record["run-dir"]), int(record["seed"])
        cfg, num_clients = run_config(run_dir)
        ds = load_dataset(cfg.dataset, cfg.data_dir, cfg.download)
        data = attack_data(cfg, num_clients, a["client"], seed, a["max_members"],
                           a["population"])
        attacker = (a["client"] + 1) % num_clients
        _, models = global_models(run_dir, cfg, ds.input_shape, ds.num_classes)
        known = attacker_records(cfg, num_clients, attacker, seed, data.population,
                                 a["max_members"])
        s = csmia_attack(models(), data.members, data.nonmembers, *known, seed=seed).summary()
        previous = record["attack"].get("cs-mia")
        if previous is not None and "cs-mia-before-rescore" not in record["attack"]:
            record["attack"]["cs-mia-before-rescore"] = previous
        record["attack"]["cs-mia"] = {k: s[k] for k in ("accuracy", "auc", "tpr@1%fpr",
                                                        "members")}
        path.write_text(json.dumps(record, indent=1))
    build_table(results, command)


def _rounds_extra(record: dict[str, Any]) -> dict[str, Any]:
    """Per-round method metrics from rounds.jsonl: DP-FedASGP's significant fraction, eq. 16
    weights' spread, min and max and its round epsilon; Fed-SMP's kept fraction; on an
    attack cell, the attacks (:func:`_attack_extra`)."""
    out = _round_metrics(record)
    if is_mia_cell(record["cell"]):
        out.update(_attack_extra(record))
    return out


def _round_metrics(record: dict[str, Any]) -> dict[str, Any]:
    path = Path(record["run-dir"]) / "rounds.jsonl"
    if not path.exists():
        return {}
    rounds = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keys = {"significant-fraction-by-round": "asgp-significant-fraction",
            "gamma-spread-by-round": "asgp-gamma-spread", "gamma-min-by-round": "asgp-gamma-min",
            "gamma-max-by-round": "asgp-gamma-max", "kept-fraction-by-round": "fedsmp-kept-fraction"}
    out = {name: [r.get("train", {}).get(key) for r in rounds] for name, key in keys.items()}
    out = {k: v for k, v in out.items() if any(x is not None for x in v)}
    eps = [r.get("train", {}).get("asgp-round-epsilon") for r in rounds]
    if any(e is not None for e in eps):
        out["round-epsilon"] = next(e for e in eps if e is not None)
    return out


def strict_epsilon_at_paper_scales(eps_round: float) -> float:
    """What DP-FedASGP strict really spends per round with the paper's Laplace scales
    q C / eps_k (``asgp-noise=paper``) and the defaults (share 0.9, q = 2, c = 100):
    eps_2 / q + 2 c eps_1 / q + 2 sqrt(c) eps_3 / q (dpfl.methods.fedasgp.strict_epsilon)."""
    from dpfl.methods import run_config
    from dpfl.methods.fedasgp import round_epsilon

    return round_epsilon(run_config(strategy="fedasgp", trainer="update-dp",
                                    asgp_epsilon=eps_round, asgp_noise="paper"))


def _client_eps(r: dict[str, Any]) -> list[float]:
    return [float(v) for v in r.get("epsilon", {}).values()]


def build_table(results: Path, command: str) -> str:
    all_runs = load_records(results)
    runs = [r for r in all_runs if not is_mia_cell(r["cell"])]
    lines = table_header(
        "DP-FedASGP reproduction (Table VI in shape: MNIST CNN, 100 clients, 10 % per round)",
        command,
        "Test accuracy % (mean ± std over seeds, n = seeds) of every arm beside the paper's "
        "Table VI. Every arm of a cell has the same budget per client: the whole-run ε of a "
        "DP-FedASGP strict client taking part in every round at the cell's ε per round "
        "(column 'budget', δ = 1e-5, RDP); Gaussian arms calibrate σ to it. 'ledger ε': the "
        "largest / mean ε over the clients that took part, from each run's ledger. Rows of "
        "arms whose verdict is `none` are not differentially private.", runs)
    table: dict[str, Any] = {}
    arms = [a for a in METHODS if any(r["method"] == a for r in runs)]
    cells = [c for c in CELLS if any(r["cell"] == c for r in runs)]
    if cells:
        lines += ["## Accuracy (Table VI shape)", "",
                  "| cell | ε per round | budget (whole-run ε per client) | "
                  + " | ".join(LABELS[a] for a in arms)
                  + " | paper DP-FedAvg | paper DP-FedASGP |",
                  "|---|---|---|" + "---|" * len(arms) + "---|---|"]
    for cell in cells:
        eps = cell_epsilon(cell)
        cell_runs = [r for r in runs if r["cell"] == cell]
        budget = max((float(r.get("config", {}).get("target-epsilon", float("nan")))
                      for r in cell_runs), default=float("nan"))
        row = [cell, f"{eps:g}", f"{budget:.4g}"]
        for arm in arms:
            rs = [r for r in cell_runs if r["method"] == arm]
            accs = [r["accuracy"] for r in rs]
            row.append(f"{mean_std(accs)} (n = {len(rs)})" if rs else "—")
            if rs:
                client_eps = [e for r in rs for e in _client_eps(r)]
                table.setdefault(cell, {})[arm] = {
                    "accuracy": accs, "seeds": [r["seed"] for r in rs],
                    "max-epsilon": max(client_eps, default=None),
                    "mean-epsilon": statistics.fmean(client_eps) if client_eps else None,
                    "clients-charged": [len(_client_eps(r)) for r in rs],
                    "verdict": "; ".join(sorted({honest_verdict(r) for r in rs})),
                    "round-epsilon": rs[0].get("round-epsilon"),
                    "paper": (PAPER[eps][PAPER_COLUMN[arm]] if arm in PAPER_COLUMN else None)}
        table.setdefault(cell, {})["budget"] = budget
        row += [f"{PAPER[eps][0]:.2f}", f"{PAPER[eps][1]:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    if cells:
        lines += ["", "## Ledger ε per client and verdict", "",
                  "| cell | arm | n | acc % | ledger ε max / mean (clients charged) | "
                  "ε per round charged | verdict |", "|---|---|---|---|---|---|---|"]
    for cell in cells:
        for arm in arms:
            t = table.get(cell, {}).get(arm)
            if t is None:
                continue
            charged = "/".join(str(c) for c in t["clients-charged"])
            eps_text = ("—" if t["max-epsilon"] is None else
                        f"{t['max-epsilon']:.4g} / {t['mean-epsilon']:.4g} ({charged})")
            round_eps = "—" if t["round-epsilon"] is None else f"{t['round-epsilon']:.4g}"
            lines.append(f"| {cell} | {LABELS[arm]} | {len(t['accuracy'])} | "
                         f"{mean_std(t['accuracy'])} | {eps_text} | {round_eps} | "
                         f"{t['verdict']} |")
    lines += ["", "## DP-FedASGP strict at the paper's noise scales (computed, not run)", "",
              "The per-round ε a client really spends when the strict variant keeps the "
              "paper's Laplace scales q·C/ε_k (`asgp-noise=paper`; share 0.9, q = 2, cutoff "
              "c = 100): ε₂/q + 2c·ε₁/q + 2√c·ε₃/q.", "",
              "| paper's ε per round | true ε per round (strict, paper scales) |", "|---|---|"]
    paper_scales = {}
    for eps in PAPER:
        paper_scales[eps] = strict_epsilon_at_paper_scales(eps)
        lines.append(f"| {eps:g} | {paper_scales[eps]:.4g} |")
    table["strict-epsilon-at-paper-scales"] = paper_scales
    lines += _mia_section([r for r in all_runs if is_mia_cell(r["cell"])], table)
    text = write_table(results, lines, table)
    _plots(runs, results)
    return text


def _mia_section(runs: list[dict[str, Any]], table: dict[str, Any]) -> list[str]:
    """Table III in shape: attack accuracy % per arm and budget beside the paper's MNIST
    CNN rows (mean over seeds; ``table["attacks"]`` keeps every number)."""
    if not runs:
        return []
    lines = ["", "## Attack accuracy % (Table III shape, sample level: every arm over "
             "DP-SGD)", "",
             "`dpfl attack` on each run of the attack cells (`conf/fedasgp/mia.toml`: 10 "
             "clients, 5 rounds, MNIST CNN; target client 0's records, as many non-members "
             "no client held). Accuracy at each attack's own threshold (shadow data, or 0.5 "
             "for the attack models), RMIA at its best threshold (an upper estimate); "
             "'paper' = Table III's MNIST CNN row at the same ε (Basic-MIA / ML-Leaks / "
             "White-box / CS-MIA). Budget: the whole-run sample-level ε per client, the "
             "cell's ε per round composed over the 5 rounds (`matched_epsilon`).", "",
             "| ε per round | budget | arm | n | test acc % | "
             + " | ".join(label for _, label in MIA_COLUMNS) + " | paper |",
             "|---|---|---|---|---|" + "---|" * len(MIA_COLUMNS) + "---|"]
    out: dict[str, Any] = {}
    arms = [a for a in MIA_METHODS if any(r["method"] == a for r in runs)]
    for cell in [c for c in CELLS if is_mia_cell(c)]:
        eps = cell_epsilon(cell)
        cell_runs = [r for r in runs if r["cell"] == cell]
        if not cell_runs:
            continue
        budget = max(float(r.get("config", {}).get("target-epsilon", float("nan")))
                     for r in cell_runs)
        for arm in arms:
            rs = [r for r in cell_runs if r["method"] == arm and "attack" in r]
            if not rs:
                continue
            cols = {name: [r["attack"][name]["accuracy"] for r in rs if name in r["attack"]]
                    for name, _ in MIA_COLUMNS}
            paper = PAPER_MIA[eps].get(MIA_PAPER_ROW.get(arm, ""))
            lines.append(
                f"| {eps:g} | {budget:.3g} | {LABELS[arm]} | {len(rs)} | "
                f"{mean_std([r['accuracy'] for r in rs])} | "
                + " | ".join(mean_std(cols[name]) for name, _ in MIA_COLUMNS)
                + f" | {' / '.join(f'{v:.2f}' for v in paper) if paper else '—'} |")
            out.setdefault(cell, {})[arm] = {
                "budget": budget, "accuracy": [r["accuracy"] for r in rs],
                "attacks": {name: v for name, v in cols.items() if v},
                "auc": {name: [r["attack"][name]["auc"] for r in rs if name in r["attack"]]
                        for name, _ in MIA_COLUMNS},
                "verdict": "; ".join(sorted({honest_verdict(r) for r in rs})),
                "paper": paper}
        missing = {row: f"not run in this cell (arm `{arm}`)"
                   for arm, row in MIA_PAPER_ROW.items()
                   if not any(r["method"] == arm and "attack" in r for r in cell_runs)}
        for row, why in {**missing, **MIA_PENDING}.items():
            paper = PAPER_MIA[eps][row]
            lines.append(f"| {eps:g} | {budget:.3g} | {row}: {why} | — | — | "
                         + " | ".join("—" for _ in MIA_COLUMNS)
                         + f" | {' / '.join(f'{v:.2f}' for v in paper)} |")
    table["attacks"] = out
    return lines


def _plots(runs: list[dict[str, Any]], results: Path) -> None:
    plt = pyplot()
    cells = [c for c in CELLS if any(r["cell"] == c for r in runs) and not is_mia_cell(c)]
    if not cells:
        return
    first = {(r["cell"], r["method"]): r for r in sorted(runs, key=lambda r: -r["seed"])}
    for name, arms, key, ylabel in (
            ("accuracy.png", list(METHODS), "accuracy-by-round", "test accuracy (%)"),
            ("significant.png", ["fedasgp-paper", "fedasgp-strict"],
             "significant-fraction-by-round", "fraction of coordinates released as significant"),
            ("gamma.png", ["fedasgp-paper", "fedasgp-strict"], "gamma-spread-by-round",
             "eq. 16 weights: max γ - min γ")):
        fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 3.6), squeeze=False)
        for ax, cell in zip(axes[0], cells):
            for arm in arms:
                r = first.get((cell, arm))
                values = (r or {}).get(key) or []
                points = [(i, v) for i, v in enumerate(values, 1) if v is not None]
                if not points:
                    continue
                xs, ys = zip(*points)
                if key == "accuracy-by-round":
                    ys = [100 * y for y in ys]
                ax.plot(xs, ys, label=arm)
            if key == "significant-fraction-by-round":
                ax.set_yscale("log")
            ax.set(title=cell, xlabel="round", ylabel=ylabel)
            ax.legend(fontsize=6)
        save_figure(fig, results / name)


REPRODUCTION = Reproduction(
    name="fedasgp", presets="fedasgp", clients=CLIENTS, cells=CELLS,
    default_cells=DEFAULT_CELLS, methods=tuple(METHODS), default_methods=DEFAULT_METHODS,
    build_table=build_table, run_config=_run_config, extra=_rounds_extra,
    clients_of=lambda cell: MIA_CLIENTS if is_mia_cell(cell) else CLIENTS)


def run_one(root: Path, cell: str, method: str, seed: int, results: Path,
            work: Path) -> dict[str, Any]:
    """One simulation (preset + the arm's keys + the cell's budget + ``seed``); writes and
    returns its record."""
    return REPRODUCTION.run_one(root, cell, method, seed, results, work)
