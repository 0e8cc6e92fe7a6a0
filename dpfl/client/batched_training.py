"""Local SGD for several clients at once: the plain trainer's loop over a cohort, batched.

A cohort host (:mod:`dpfl.apps.cohort_host`) trains its sampled clients one after
another; each client's local training is a few small steps (at 1,000 MNIST clients, 4 steps
of 16 examples), so Python and the per-call overhead of torch dominate. Here the clients'
parameters are stacked along a leading client axis and one step of every client runs as
one call: ``torch.func.vmap`` over ``torch.func.grad_and_value`` of the model's functional
form (``torch.func.functional_call``), then the SGD update on the stacked tensors.

Each client sees exactly the batches :func:`dpfl.client.trainers.train_plain` would give it
(the same DataLoader, seed and epochs, materialised up front). Batches of different sizes
(a client's last batch, or clients with fewer steps) are padded and masked: a padded
example has weight 0 in the loss, which is the mean cross-entropy over the real examples
(``nn.CrossEntropyLoss``'s), and a client with no batch left at a step keeps its parameters
and momentum unchanged. torch's SGD is reproduced for its options dpfl uses (``lr``,
``momentum``; no dampening, no Nesterov, no weight decay): buf <- momentum * buf + grad
(buf = grad at the first step), p <- p - lr * buf. So the updates equal the sequential
loop's to float rounding (the summation order of a batched kernel differs).

What cannot be batched keeps the sequential loop (:func:`why_not_batched` says why): DP-SGD
(per-sample clipping and Poisson sampling live in Opacus), a method's local-step hooks, a
model with buffers (BatchNorm statistics) or dropout (its randomness would differ).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from dpfl.client.hooks import MethodHooks
from dpfl.client.trainers import TrainResult, _loader
from dpfl.config import RunConfig
from dpfl.data import ClientData

BATCHED_TRAINERS = ("plain", "update-dp")
# clients per batched call under ``cohort-batch = -1`` on a GPU; on a CPU the automatic
# setting trains one client after another: bench/cohort_batch.py measured the batched call
# slower there (mnist-cnn, 25 clients of 54 examples: 0.39 s batched, 0.30 s one by one)
AUTO_BATCH_ON_CUDA = 32


def batch_size(setting: int, device: torch.device) -> int:
    """Clients per batched call for ``cohort-batch`` = ``setting`` on ``device`` (below 2:
    one after another)."""
    if setting >= 0:
        return setting
    return AUTO_BATCH_ON_CUDA if device.type == "cuda" else 0


def why_not_batched(cfg: RunConfig, model: nn.Module, hooks: MethodHooks) -> str | None:
    """None when this client's local training can join a batched cohort, else why not."""
    if cfg.trainer not in BATCHED_TRAINERS:
        return f"trainer={cfg.trainer} (per-sample DP-SGD runs in Opacus, client by client)"
    for name in ("pre_step", "step", "post_step", "noisy_grad", "perturb"):
        if getattr(hooks, name) is not None:
            return f"the method changes the local step ({name})"
    if any(True for _ in model.buffers()):
        return "the model has buffers (e.g. BatchNorm statistics)"
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return "the model has dropout"
    return None


def client_batches(data: ClientData, cfg: RunConfig, seed: int
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (x, y) batches :func:`dpfl.client.trainers.train_plain` trains one client on,
    in order (every local epoch)."""
    loader = _loader(data, cfg.batch_size, torch.Generator().manual_seed(seed))
    return [batch for _ in range(cfg.local_epochs) for batch in loader]


def _padded(batches: Sequence[tuple[torch.Tensor, torch.Tensor] | None], size: int,
            like: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's (x, y, weight) over the clients: each batch padded to ``size`` examples
    (weight 0), a client with no batch all padding."""
    x0, y0 = like
    xs = torch.zeros((len(batches), size, *x0.shape[1:]), dtype=x0.dtype)
    ys = torch.zeros((len(batches), size), dtype=y0.dtype)
    ws = torch.zeros((len(batches), size), dtype=torch.float32)
    for i, batch in enumerate(batches):
        if batch is not None:
            x, y = batch
            xs[i, :len(y)] = x
            ys[i, :len(y)] = y
            ws[i, :len(y)] = 1.0
    return xs, ys, ws


def train_plain_batched(models: Sequence[nn.Module], datas: Sequence[ClientData],
                        cfg: RunConfig, seeds: Sequence[int], device: torch.device
                        ) -> list[TrainResult]:
    """:func:`dpfl.client.trainers.train_plain` (no hooks) for every client at once;
    each model is left holding its client's trained parameters."""
    if not models:
        return []
    base = models[0].to(device).train()
    names = [name for name, _ in base.named_parameters()]
    params = {name: torch.stack([dict(m.named_parameters())[name].detach().to(device)
                                 for m in models]) for name in names}
    momentum = {name: torch.zeros_like(p) for name, p in params.items()}
    plans = [client_batches(data, cfg, seed) for data, seed in zip(datas, seeds)]
    like = next((p[0] for p in plans if p), None)
    totals = torch.zeros(len(models), dtype=torch.float64)
    counts = torch.zeros(len(models), dtype=torch.float64)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
             w: torch.Tensor) -> torch.Tensor:
        out = functional_call(base, p, (x,))
        per_example = nn.functional.cross_entropy(out, y, reduction="none")
        return (per_example * w).sum() / w.sum().clamp_min(1.0)

    step_all = vmap(grad_and_value(loss))
    size = cfg.batch_size
    for t in range(max(len(p) for p in plans)):
        batches = [p[t] if t < len(p) else None for p in plans]
        assert like is not None
        x, y, w = (v.to(device) for v in _padded(batches, size, like))
        grads, losses = step_all(params, x, y, w)
        active = torch.tensor([b is not None for b in batches], device=device)
        n = w.sum(dim=1).double().cpu()
        totals += losses.detach().double().cpu() * n
        counts += n
        with torch.no_grad():
            for name in names:
                mask = active.view(-1, *([1] * (params[name].dim() - 1)))
                g = grads[name]
                buf = torch.where(mask, momentum[name] * cfg.momentum + g, momentum[name]) \
                    if cfg.momentum else g
                momentum[name] = buf
                params[name] = torch.where(mask, params[name] - cfg.lr * buf, params[name])
    results = []
    with torch.no_grad():
        for i, (model, data, plan) in enumerate(zip(models, datas, plans)):
            for name, p in model.named_parameters():
                p.copy_(params[name][i])
            n = len(data.y_train)
            results.append(TrainResult(n, float(totals[i] / max(counts[i], 1.0)), len(plan),
                                       min(1.0, cfg.batch_size / n)))
    return results
