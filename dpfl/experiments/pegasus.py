"""`dpfl reproduce pegasus`: PEGASUS vs DP-FedAvg (all clients every round), seed 003.

Writes ``results/pegasus/runs/<method>__seed<k>.json``, ``table.md`` / ``table.json`` (final
accuracy, final mean and max epsilon, clients per round, the epsilon reduction beside the
paper's ~97 % and "up to 58 %") and ``epsilon.png`` (mean epsilon by round, and the
per-client staircase of the first PEGASUS run's clients).
"""

from __future__ import annotations

import json
import statistics
import tomllib
from pathlib import Path
from typing import Any

METHODS = ("dpfedavg", "pegasus")
CLIENTS = 50
PAPER = {"accuracy": 97.0, "reduction": 58.0}


def run_one(root: Path, method: str, seed: int, results: Path, work: Path) -> dict[str, Any]:
    from dpfl.experiments.common import simulate_record, write_record

    preset = tomllib.loads((root / "conf" / "pegasus" / "mnist.toml").read_text())
    name = f"{method}__seed{seed}"
    record = {"method": method, "seed": seed,
              **simulate_record(root, CLIENTS, {**preset, "strategy": method, "seed": seed,
                                                "run-name": name}, work)}
    write_record(results, name, record)
    return record


def build_table(results: Path, command: str) -> str:
    runs = [json.loads(p.read_text()) for p in sorted((results / "runs").glob("*.json"))]
    by = {m: [r for r in runs if r["method"] == m] for m in METHODS}
    lines = ["# PEGASUS reproduction (MNIST, 50 clients, 50 rounds)", "",
             f"Command: `{command}`", "",
             "| method | n | final acc % | paper acc % | final mean ε | final max ε | "
             "clients/round (mean) |", "|---|---|---|---|---|---|---|"]
    table: dict[str, Any] = {}
    for m in METHODS:
        rs = by[m]
        if not rs:
            continue
        mean_eps = [statistics.fmean(r["epsilon"].values()) for r in rs]
        row = {"accuracy": [r["accuracy"] for r in rs], "mean-epsilon": mean_eps,
               "max-epsilon": [max(r["epsilon"].values()) for r in rs],
               "clients-per-round": [statistics.fmean(r["selected-by-round"]) for r in rs]}
        table[m] = row
        lines.append(f"| {m} | {len(rs)} | {100 * statistics.fmean(row['accuracy']):.2f} | "
                     f"{PAPER['accuracy']:.0f} | {statistics.fmean(mean_eps):.3f} | "
                     f"{statistics.fmean(row['max-epsilon']):.3f} | "
                     f"{statistics.fmean(row['clients-per-round']):.1f} |")
    if all(table.get(m) for m in METHODS):
        red = 100 * (1 - statistics.fmean(table["pegasus"]["mean-epsilon"])
                     / statistics.fmean(table["dpfedavg"]["mean-epsilon"]))
        table["reduction-percent"] = red
        lines += ["", f"Final mean ε reduction of PEGASUS vs DP-FedAvg: **{red:.1f} %** "
                      f"(paper: up to {PAPER['reduction']:.0f} %)."]
    (results / "table.json").write_text(json.dumps(table, indent=1))
    text = "\n".join(lines) + "\n"
    (results / "table.md").write_text(text)
    _plot(by, results / "epsilon.png")
    return text


def _plot(by: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(by.values()):
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for m, rs in by.items():
        for r in rs[:1]:
            axes[0].plot(range(1, len(r["mean-epsilon-by-round"]) + 1), r["mean-epsilon-by-round"],
                         label=m)
    axes[0].set_xlabel("round")
    axes[0].set_ylabel("mean cumulative ε")
    axes[0].legend()
    peg = by.get("pegasus") or []
    if peg:
        from dpfl.privacy.ledger import Ledger

        ledger = Ledger.load(Path(peg[0]["run-dir"]) / "ledger.json")
        for client in list(ledger.clients)[:8]:
            pts = [(0, 0.0)] + ledger.epsilon_by_round(client)
            axes[1].step([p[0] for p in pts], [p[1] for p in pts], where="post", label=client)
        axes[1].set_title("PEGASUS: ε per client (first 8)")
        axes[1].set_xlabel("round")
        axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reproduce(root: Path, results: Path, work: Path, seeds: list[int], skip_existing: bool,
              command: str) -> str:
    results.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for method in METHODS:
            if skip_existing and (results / "runs" / f"{method}__seed{seed}.json").exists():
                continue
            rec = run_one(root, method, seed, results, work)
            print(f"{method} seed {seed}: accuracy {rec['accuracy']:.4f}, mean eps "
                  f"{statistics.fmean(rec['epsilon'].values()):.3f}", flush=True)
            build_table(results, command)
    return build_table(results, command)
