"""How often do the two clients' round updates conflict (cos < 0) in the GCFL presets?

Replays DP-FedAvg rounds in-process with the preset's settings (2 clients, batch 32, C 1.5,
sigma calibrated to epsilon = 2 after 5 rounds, lr 0.03) and prints the cosine between the
two clients' updates each round. GCFL corrects only when it is negative.

    python -m dpfl.experiments.probes.gcfl_cosine partitioning=gcfl-contiguous \
        > results/gcfl/cosine_probe_noniid.log
"""

from __future__ import annotations

import sys
import warnings

import torch

from dpfl.client.trainers import train_dpsgd
from dpfl.config import RunConfig
from dpfl.data import client_data
from dpfl.experiments.probes import config_from, parse_args
from dpfl.models import build_model
from dpfl.privacy.plan import noise_multiplier_for
from dpfl.tensors import flatten, state_difference, unflatten

BASE = RunConfig(dataset="mnist", batch_size=32, max_grad_norm=1.5, target_epsilon=2.0,
                 num_rounds=5, val_fraction=0.0, lr=0.03)


def main(argv: list[str]) -> None:
    """Print cos(update_0, update_1) after each DP-FedAvg round of ``BASE`` + ``argv``."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cfg = config_from(BASE, parse_args(argv))
    data = [client_data(cfg, i, 2) for i in range(2)]
    torch.manual_seed(cfg.seed)
    g = build_model(cfg.model, (1, 28, 28), 10).state_dict()
    for r in range(1, cfg.num_rounds + 1):
        ups = []
        for i in range(2):
            m = build_model(cfg.model, (1, 28, 28), 10)
            m.load_state_dict(g)
            gen = torch.Generator().manual_seed(r * 10 + i)  # public seed: a probe, not a release
            train_dpsgd(m, data[i], cfg, noise_multiplier_for(cfg, len(data[i].y_train)),
                        gen, gen, torch.device("cpu"))
            ups.append(flatten(state_difference(m.state_dict(), g)))
        cos = float(torch.nn.functional.cosine_similarity(ups[0], ups[1], dim=0))
        print(f"{cfg.partitioning} round {r}: cos(update_0, update_1) = {cos:+.4f}", flush=True)
        g = unflatten(flatten(g) + torch.stack(ups).mean(0), g)


if __name__ == "__main__":
    main(sys.argv[1:])
