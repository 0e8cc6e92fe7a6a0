"""``dpfl attack RUN_DIR``: membership inference against a finished run's target client.

Attacks (:mod:`dpfl.attacks.mia`) run against each target model of
:mod:`dpfl.attacks.target`: the final global model, and the target client's update as the
server received it (when the run kept it: ``record-updates``). Shadow and reference models
are trained "like the target" without DP (the attacker's best guess of the training):
for the update, the client's local recipe (``local-epochs``, ``lr``, ``batch-size``,
``momentum``) from the same round's global model; for the global model, a fresh model
trained centrally for ``shadow_epochs`` epochs (SGD, lr 0.05, momentum 0.9, batch 64).

CS-MIA (:mod:`dpfl.attacks.csmia`) joins the global model's attacks when the run kept the
global model of every round (``record-global-models = true``): the adversary is client
``csmia_attacker`` (default: the target client + 1, mod the number of clients), whose own
records label the attack model's members, and as many population records its non-members.

Writes ``RUN_DIR/attack/attack.json`` (per target and attack: accuracy, AUC, TPR at 0.1 %
and 1 % FPR) and ``roc-<target>.png`` (log-log ROC curves).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from dpfl.attacks.csmia import csmia_attack
from dpfl.attacks.metrics import plot_roc
from dpfl.attacks.mia import run_attacks
from dpfl.attacks.reference import train_reference_model
from dpfl.attacks.target import (
    attack_data,
    attacker_records,
    global_models,
    model_factory,
    run_config,
    target_models,
)
from dpfl.data import load_dataset
from dpfl.durable import atomic_write_text
from dpfl.errors import UserError
from dpfl.methods import guarantee, method_for

GLOBAL_RECIPE = {"lr": 0.05, "momentum": 0.9, "batch_size": 64}


def attack_run(run_dir: Path, client: int = 0, seed: int = 0, reference_models: int = 4,
               shadow_epochs: int = 10, max_members: int = 1000, population: int = 4000,
               out_dir: Path | None = None, log=print,
               csmia_attacker: int | None = None) -> dict[str, Any]:
    """Attack ``run_dir``'s client ``client``; write and return the report."""
    torch.manual_seed(seed)
    cfg, num_clients = run_config(run_dir)
    attacker = (client + 1) % num_clients if csmia_attacker is None else csmia_attacker
    if csmia_attacker is not None and not (0 <= attacker < num_clients and attacker != client):
        raise UserError(f"--csmia-attacker {attacker}: must be another client than the target "
                        f"{client}, in 0..{num_clients - 1}")   # before anything is written
    ds = load_dataset(cfg.dataset, cfg.data_dir, cfg.download)
    data = attack_data(cfg, num_clients, client, seed, max_members, population)
    n = len(data.members[1])
    log(f"attack {run_dir.name}: client {client}, {n} members, {n} non-members "
        f"({data.nonmember_source}), population {len(data.population[1])}")
    method = method_for(cfg)

    def build():
        return method.build_model(cfg, tuple(ds.input_shape), ds.num_classes)

    out_dir = out_dir or run_dir / "attack"
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "run-dir": str(run_dir), "client": client, "seed": seed,
        "strategy": cfg.strategy, "trainer": cfg.trainer,
        "verdict": guarantee(cfg).verdict,
        "members": n, "nonmember-source": data.nonmember_source,
        "population": len(data.population[1]), "reference-models": reference_models,
        "targets": {},
    }
    rounds, series_models = global_models(run_dir, cfg, ds.input_shape, ds.num_classes)
    if not rounds:
        report["cs-mia"] = {"skipped": "the run kept no per-round global models (run it "
                                       "with record-global-models=true)"}
    elif attacker == client:
        rounds = []
        report["cs-mia"] = {"skipped": "a one-client run has no other client to be the "
                                       "adversary"}
    else:
        report["cs-mia"] = {"attacker-client": attacker, "rounds": rounds}
    for target in target_models(run_dir, cfg, client, ds.input_shape, ds.num_classes):
        if target.start is None:
            recipe = {**GLOBAL_RECIPE, "epochs": shadow_epochs}
        else:
            recipe = {"lr": cfg.lr, "momentum": cfg.momentum, "batch_size": cfg.batch_size,
                      "epochs": cfg.local_epochs}

        def train(make, x, y, s, recipe=recipe):
            return train_reference_model(make, x, y, epochs=recipe["epochs"], lr=recipe["lr"],
                                         batch_size=recipe["batch_size"], seed=s,
                                         momentum=recipe["momentum"])

        t0 = time.time()
        log(f"target {target.name}: {target.note}")
        results = run_attacks(target.model, data.members, data.nonmembers, data.population,
                              model_factory(build, target.start), train, seed=seed,
                              reference_models=reference_models,
                              progress=lambda msg, t=target.name: log(f"  [{t}] {msg}"))
        if target.name == "global" and rounds:
            log(f"  [global] CS-MIA: confidence series over {len(rounds)} rounds' global "
                f"models, attack model trained on client {attacker}'s records")
            known_in, known_out = attacker_records(cfg, num_clients, attacker, seed,
                                                   data.population, max_members)
            results.append(csmia_attack(series_models(), data.members, data.nonmembers,
                                        known_in, known_out, seed=seed))
        plot_roc(results, out_dir / f"roc-{target.name}.png",
                 f"{cfg.strategy} ({guarantee(cfg).verdict[:40]}): client {client}, "
                 f"{target.name}")
        report["targets"][target.name] = {
            "note": target.note, "shadow-recipe": recipe,
            "seconds": round(time.time() - t0, 1),
            "attacks": [r.summary() for r in results]}
        for r in results:
            s = r.summary()
            log(f"  {target.name:6s} {s['name']:16s} AUC {s['auc']:.3f}  accuracy "
                f"{s['accuracy']:.3f}  TPR@1%FPR {s['tpr@1%fpr']:.3f}  TPR@0.1%FPR "
                f"{s['tpr@0.1%fpr']:.3f}")
    atomic_write_text(out_dir / "attack.json", json.dumps(report, indent=1))
    log(f"wrote {out_dir / 'attack.json'}")
    return report
