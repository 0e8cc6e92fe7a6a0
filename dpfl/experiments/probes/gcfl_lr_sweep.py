"""The learning-rate sweep behind conf/gcfl/*.toml (run once, before the grid).

DP-FedAvg, 2 IID MNIST clients, batch 32, C = 1.5, sigma calibrated to epsilon = 2 after 5
rounds; accuracy on the clients' held-out 10% validation splits (never the test set).
In-process (no Flower) for speed; the same dpfl trainer and accountant as the runs.

    for lr in 0.02 0.03 0.05 0.1; do
        python -m dpfl.experiments.probes.gcfl_lr_sweep lr=$lr; done > results/gcfl/lr_sweep.log
"""

from __future__ import annotations

import sys
import time
import warnings

import torch

from dpfl.client.trainers import train_dpsgd
from dpfl.config import RunConfig
from dpfl.data import client_data
from dpfl.experiments.probes import config_from, parse_args
from dpfl.models import build_model
from dpfl.models.evaluation import evaluate_model
from dpfl.privacy.plan import noise_multiplier_for
from dpfl.tensors import flatten, state_difference, unflatten

BASE = RunConfig(dataset="mnist", batch_size=32, max_grad_norm=1.5, target_epsilon=2.0,
                 num_rounds=5, val_fraction=0.1)
CLIENTS = 2


def main(argv: list[str]) -> None:
    """Print validation accuracy after each DP-FedAvg round of ``BASE`` + ``argv``."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    kw = parse_args(argv)
    cfg = config_from(BASE, kw)
    data = [client_data(cfg, i, CLIENTS) for i in range(CLIENTS)]
    xv = torch.cat([d.x_val for d in data])
    yv = torch.cat([d.y_val for d in data])
    torch.manual_seed(0)
    model = build_model(cfg.model, (1, 28, 28), 10)
    g = model.state_dict()
    t = time.time()
    for r in range(1, cfg.num_rounds + 1):
        ups = []
        for i in range(CLIENTS):
            sigma = noise_multiplier_for(cfg, len(data[i].y_train))
            m = build_model(cfg.model, (1, 28, 28), 10)
            m.load_state_dict(g)
            gen = torch.Generator().manual_seed(r * 10 + i)  # public seed: a probe, not a release
            train_dpsgd(m, data[i], cfg, sigma, gen, gen, torch.device("cpu"))
            ups.append(flatten(state_difference(m.state_dict(), g)))
        g = unflatten(flatten(g) + torch.stack(ups).mean(0), g)
        model.load_state_dict(g)
        _, p = evaluate_model(model, xv, yv, torch.device("cpu"))
        acc = float((p == yv).float().mean())
        print(kw, r, f"val acc {acc:.4f}", f"sigma {sigma:.3f}", f"{time.time() - t:.0f}s",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
