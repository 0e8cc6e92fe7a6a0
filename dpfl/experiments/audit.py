"""`dpfl reproduce audit`: the privacy table. Every method (and the variants whose verdict
is ``none``) at matched accounted epsilon per client, beside what is measured: the one-run
audit's epsilon lower bound (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1)
Training Run", NeurIPS 2023; :mod:`dpfl.attacks.audit`) and membership inference on a
client's update as the server received it and on the final global model
(:mod:`dpfl.attacks.command`), with the test accuracy.

Each run is ONE audit run (``conf/audit/mnist.toml``): all 50 clients are canary clients
(half of them, by secret coin flips, release a canary vector through their method instead
of their training update; under DP-SGD the canaries are 500 examples, 10 hosted per
client, each added with probability 1/2), every client takes part in every round, and the attack target
is the first of clients 0..7 whose coin came up 0 (it trained on its data as usual; its
update was kept, ``record-updates``). Cells ``eps1``, ``eps4``, ``eps8``: the whole-run
budget per client (``target-epsilon``; Gaussian arms calibrate sigma to it over the
rounds); methods whose budget is set per round get budget / rounds per round
(DP-FedASGP's ``asgp-epsilon``, AADP-FL's ``aadp-epsilon``: basic composition, so their
ledger stays at or under the budget). The non-private FedAvg reference runs once per cell
(its accounted epsilon is infinite).

Records: ``results/audit/runs/<cell>__<arm>__seed<k>.json``; table ``table.md`` /
``table.json``; ROC curves ``roc/<cell>__<arm>__seed<k>-<target>.png``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from dpfl.attacks.audit import score_audit_run
from dpfl.attacks.command import attack_run
from dpfl.experiments.common import (
    Reproduction,
    load_records,
    table_header,
    write_table,
)
from dpfl.privacy.audit.canaries import canary_bits

CLIENTS = 50
EPSILONS = {"eps1": 1.0, "eps4": 4.0, "eps8": 8.0}
CELLS = {cell: "mnist.toml" for cell in EPSILONS}
_UPDATE_DP = {"trainer": "update-dp"}
_DPSGD = {"trainer": "dpsgd", "audit-canaries": 500, "record-updates": 50}
METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedavg", "trainer": "plain"},
    "dpfedavg": {"strategy": "dpfedavg", **_UPDATE_DP},
    "dpfedsam": {"strategy": "dpfedsam", **_UPDATE_DP},
    "dpfedprox": {"strategy": "dpfedprox", **_UPDATE_DP},
    "dpfedexp": {"strategy": "dpfedexp", **_UPDATE_DP},
    "dpfedavgm": {"strategy": "dpfedavgm", **_UPDATE_DP},
    "pegasus": {"strategy": "pegasus", **_UPDATE_DP},
    "gcfl": {"strategy": "gcfl", **_UPDATE_DP},
    "fedsmp-randk": {"strategy": "fedsmp", **_UPDATE_DP, "fedsmp-mask": "randk"},
    "fedsmp-topk": {"strategy": "fedsmp", **_UPDATE_DP, "fedsmp-mask": "topk"},
    # sparse canaries (100 coordinates): the auditor also reads the replies' zero pattern
    "fedsmp-topk-sparse": {"strategy": "fedsmp", **_UPDATE_DP, "fedsmp-mask": "topk",
                           "audit-canary-support": 100},
    "fedsmp-randk-sparse": {"strategy": "fedsmp", **_UPDATE_DP, "fedsmp-mask": "randk",
                            "audit-canary-support": 100},
    "fedasgp-strict": {"strategy": "fedasgp", **_UPDATE_DP, "asgp-variant": "strict"},
    "fedasgp-paper": {"strategy": "fedasgp", **_UPDATE_DP, "asgp-variant": "paper"},
    "fedcompdp": {"strategy": "fedcompdp", **_UPDATE_DP, "server-holdout": 1000},
    "fedcompdp-rawnorm": {"strategy": "fedcompdp", **_UPDATE_DP, "server-holdout": 1000,
                          "adpc": "raw-norm"},
    "aadp": {"strategy": "aadp", **_UPDATE_DP, "aadp-noise": "calibrated"},
    # the published noise costs ~1e8 per round: a budget out of reach, so that it runs and
    # its ledger shows what it spends (verdict none)
    "aadp-paper": {"strategy": "aadp", **_UPDATE_DP, "aadp-noise": "paper",
                   "target-epsilon": 1e15},
    # sample-level DP-SGD: 500 canary examples (10 per client), every host's update kept
    "dpfedavg-dpsgd": {"strategy": "dpfedavg", **_DPSGD},
    "dpscaffold": {"strategy": "dpscaffold", **_DPSGD},
}
DEFAULT_METHODS = tuple(METHODS)
PER_ROUND_KEYS = {"fedasgp": "asgp-epsilon", "aadp": "aadp-epsilon"}
TARGET_CANDIDATES = 8   # = record-updates of the preset


def _run_config(preset: dict[str, Any], cell: str, method: str) -> dict[str, Any]:
    eps = EPSILONS[cell]
    keys = dict(METHODS[method])
    per_round = PER_ROUND_KEYS.get(keys["strategy"])
    if per_round is not None:
        keys[per_round] = eps / int(preset["num-rounds"])
    return {**preset, "target-epsilon": eps, **keys}


def attack_client(audit_seed: int, canaries: int, trainer: str) -> int:
    """The first of clients 0..7 whose canary coin is 0 (it trained normally); client 0
    under DP-SGD (its canaries are examples: every client trains)."""
    if trainer == "dpsgd":
        return 0
    bits = canary_bits(audit_seed, canaries)
    for pid in range(min(TARGET_CANDIDATES, canaries)):
        if not bool(bits[pid]):
            return pid
    return 0


def _measure(record: dict[str, Any]) -> dict[str, Any]:
    """Audit scoring and the attacks on one finished audit run."""
    run_dir = Path(record["run-dir"])
    audit = score_audit_run(run_dir)
    config = record["config"]
    client = attack_client(int(config["audit-seed"]), int(config["audit-canaries"]),
                           str(config["trainer"]))
    attack = attack_run(run_dir, client=client, seed=record["seed"], log=lambda m: None)
    return {"audit": audit, "attack": attack}


def _best(attacks: list[dict[str, Any]], key: str) -> tuple[float, str]:
    best = max(attacks, key=lambda a: a[key])
    return float(best[key]), str(best["name"])


def build_table(results: Path, command: str) -> str:
    runs = load_records(results)
    roc = results / "roc"
    roc.mkdir(exist_ok=True)
    lines = table_header(
        "Privacy table: accounted vs audited epsilon and membership inference", command,
        "Per run: the ledger's largest epsilon over the canary clients (client level, "
        "replace-one, delta 1e-5), the one-run audit's epsilon lower bound at 95 % "
        "confidence (correct / guesses), the best attack's AUC and TPR at 1 % FPR against "
        "the target client's update as the server received it and against the final "
        "global model, and the final test accuracy (an audit run: about half the clients "
        "sent canaries instead of training).", runs)
    lines += ["| cell | arm | verdict | accounted ε | audited ε ≥ (correct/guesses) | "
              "update: AUC / TPR@1%FPR (best attack) | global: AUC / TPR@1%FPR | accuracy % |",
              "|---|---|---|---|---|---|---|---|"]
    table = []
    for rec in sorted(runs, key=lambda r: (list(EPSILONS).index(r["cell"]),
                                           list(METHODS).index(r["method"]), r["seed"])):
        audit, attack = rec["audit"], rec["attack"]
        cols = {}
        for target in ("update", "global"):
            attacks = attack["targets"].get(target, {}).get("attacks", [])
            if attacks:
                auc, name = _best(attacks, "auc")
                tpr, _ = _best(attacks, "tpr@1%fpr")
                cols[target] = f"{auc:.3f} / {tpr:.3f} ({name})"
            else:
                cols[target] = "—"
            src = Path(rec["run-dir"]) / "attack" / f"roc-{target}.png"
            if src.exists():
                shutil.copyfile(src, roc / f"{rec['cell']}__{rec['method']}__seed"
                                f"{rec['seed']}-{target}.png")
        acc = audit["accounted-epsilon-max"]
        lines.append(
            f"| {rec['cell']} | {rec['method']} | {rec['verdict'][:60]} | "
            f"{acc:.3g} | {audit['epsilon-lower-bound']:.3f} ({audit['correct']}/"
            f"{audit['guesses']}) | {cols['update']} | {cols['global']} | "
            f"{100 * rec['accuracy']:.2f} |")
        table.append({"cell": rec["cell"], "arm": rec["method"], "seed": rec["seed"],
                      "verdict": rec["verdict"], "accounted-epsilon": acc,
                      "audited-epsilon": audit["epsilon-lower-bound"],
                      "bound-exceeds-accounted": audit["bound-exceeds-accounted"],
                      "attack": {t: v["attacks"] for t, v in attack["targets"].items()},
                      "accuracy": rec["accuracy"]})
    return write_table(results, lines, {"runs": table})


REPRODUCTION = Reproduction(
    name="audit", presets="audit", clients=CLIENTS, cells=CELLS,
    default_cells=tuple(EPSILONS), methods=tuple(METHODS), default_methods=DEFAULT_METHODS,
    build_table=build_table, run_config=_run_config, extra=_measure)
