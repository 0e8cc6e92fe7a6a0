"""Does GCFL help when it projects per-step noisy gradients, as the paper's Algorithm 1 does?

dpfl's `gcfl` strategy projects the clients' round updates (one local epoch of DP-SGD each);
those are nearly orthogonal (gcfl_cosine), so GCFL rarely fires and equals DP-FedAvg.
Algorithm 1 instead exchanges every client's noisy gradient at every local iteration and
projects those. This probe runs that protocol in one process for the preset's setting
(2 clients, batch 32 by Poisson sampling, per-sample clip C = 1.5, sigma calibrated so each
client reaches the target epsilon after 5 epochs, plain SGD lr 0.03, mnist-cnn) and compares
    avg:  theta <- theta - lr * (n_0 g_0 + n_1 g_1) / (n_0 + n_1)
    gcfl: the same after the projection of the non-reference gradient (reference drawn
          uniformly per step, seeded), dpfl.methods.gcfl.gcfl_aggregate.
Each client's noisy gradient is exactly one DP-SGD step (Poisson rate q_i = 1/ceil(n_i/32),
sum of clipped per-sample gradients + N(0, sigma_i^2 C^2), divided by q_i n_i), so both arms
are (epsilon, 1e-5)-DP per client at sample level, the same accounting as the Flower runs;
the projection is post-processing. Steps: the smaller client's 5-epoch budget, so no client
exceeds its calibration.

    python -m dpfl.experiments.probes.gcfl_per_step [partitioning=gcfl-contiguous] \
        [target-epsilon=2] [seed=1] [arms=avg,gcfl]      # log: results/gcfl/per_step_probe.log

Prints test accuracy after each epoch, the share of steps whose two gradients conflict
(cos < 0) and their mean cosine.
"""

from __future__ import annotations

import math
import sys
import time
import warnings

import torch
from torch.func import functional_call, grad, vmap

from dpfl.config import RunConfig
from dpfl.data import client_data, test_tensors
from dpfl.experiments.probes import config_from, parse_args
from dpfl.methods.gcfl import gcfl_aggregate
from dpfl.models import build_model
from dpfl.models.evaluation import evaluate_model
from dpfl.privacy.plan import noise_multiplier_for, steps_per_epoch

BASE = RunConfig(dataset="mnist", model="mnist-cnn", batch_size=32, max_grad_norm=1.5,
                 target_epsilon=2.0, num_rounds=5, val_fraction=0.0, lr=0.03)


def per_sample_clipped_sum(model: torch.nn.Module, params: dict[str, torch.Tensor],
                           x: torch.Tensor, y: torch.Tensor, clip: float) -> torch.Tensor:
    """Sum over the batch of per-sample gradients clipped to norm ``clip`` (flat)."""
    def loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, yi.unsqueeze(0))
    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.reshape(len(x), -1) for g in grads.values()], dim=1)
    scale = (clip / (flat.norm(dim=1) + 1e-12)).clamp(max=1.0)
    return (flat * scale[:, None]).sum(0)


def run(cfg: RunConfig, arm: str) -> None:
    """One arm (``avg`` or ``gcfl``) for ``num-rounds`` epochs; one line per epoch."""
    data = [client_data(cfg, i, 2) for i in range(2)]
    n = [len(d.y_train) for d in data]
    q = [1.0 / steps_per_epoch(k, cfg.batch_size) for k in n]
    sigma = [noise_multiplier_for(cfg, k) for k in n]
    per_epoch = min(steps_per_epoch(k, cfg.batch_size) for k in n)
    x_test, y_test = test_tensors(cfg.dataset, cfg.data_dir)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, (1, 28, 28), 10)
    names = [k for k, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    weights = torch.tensor(n, dtype=torch.float32)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    conflicts, cosines, t0 = 0, [], time.time()
    for epoch in range(1, cfg.num_rounds + 1):
        for _ in range(per_epoch):
            params, off = {}, 0
            for name, shape in zip(names, shapes):
                size = math.prod(shape)
                params[name] = theta[off:off + size].view(shape)
                off += size
            g = torch.empty(2, theta.numel())
            for i, d in enumerate(data):
                mask = torch.rand(n[i], generator=gen) < q[i]
                total = per_sample_clipped_sum(model, params, d.x_train[mask], d.y_train[mask],
                                               cfg.max_grad_norm) if mask.any() else 0.0
                noise = torch.randn(theta.numel(), generator=gen) * sigma[i] * cfg.max_grad_norm
                g[i] = (total + noise) / (q[i] * n[i])
            cos = float(torch.nn.functional.cosine_similarity(g[0], g[1], dim=0))
            cosines.append(cos)
            conflicts += cos < 0
            if arm == "gcfl":
                ref = int(torch.randint(2, (1,), generator=gen))
                step = gcfl_aggregate(g, weights, [ref])
            else:
                step = (weights[:, None] * g).sum(0) / weights.sum()
            theta = theta - cfg.lr * step
        torch.nn.utils.vector_to_parameters(theta, model.parameters())
        _, pred = evaluate_model(model, x_test, y_test, torch.device("cpu"))
        acc = 100.0 * float((pred == y_test).float().mean())
        steps = epoch * per_epoch
        print(f"{cfg.partitioning} eps={cfg.target_epsilon} {arm}: epoch {epoch} "
              f"({steps} steps) test acc {acc:.2f} %  conflicts {conflicts}/{steps} "
              f"({100.0 * conflicts / steps:.1f} %)  mean cos {sum(cosines) / steps:+.4f}  "
              f"[{time.time() - t0:.0f} s]", flush=True)
    print(f"sigma per client {[round(s, 4) for s in sigma]}, q {[round(v, 6) for v in q]}, "
          f"steps {cfg.num_rounds * per_epoch}", flush=True)


def main(argv: list[str]) -> None:
    """Run the arms (``arms=avg,gcfl`` by default) on ``BASE`` + ``argv``."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    kw = parse_args(argv)
    arms = kw.pop("arms", "avg,gcfl").split(",")
    cfg = config_from(BASE, kw)
    for arm in arms:
        run(cfg, arm)


if __name__ == "__main__":
    main(sys.argv[1:])
