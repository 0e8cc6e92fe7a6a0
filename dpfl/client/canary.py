"""The client half of a privacy audit (Steinke, Nasr & Jagielski, "Privacy Auditing with
One (1) Training Run", 2023): in an audit run (``audit-canaries`` = m > 0) clients
0 .. m-1 are canary clients. Canary client i, when its secret bit b_i is 1, replaces the
update its local training produced by the canary vector ``audit-canary-norm`` * u_i (u_i a
secret uniformly random unit direction), *before* the method's release (clipping, noise,
sparsification): a canary is a change of that one client's data, so the run's client-level
guarantee covers it, and the auditor (the server) measures the mechanism exactly as
deployed. With b_i = 0 the client trains as usual. Bits and directions come from
``audit-seed``, the auditor's secret (:mod:`dpfl.privacy.audit.canaries`).

Sample-level DP-SGD (``trainer=dpsgd``): the m canaries are *examples* — out-of-distribution
inputs (standard normal noise in the model's normalised input space) with random labels,
secret like the bits — canary i hosted by client i mod N and added to its training set when
its bit is 1 (add/remove: the unit of DP-SGD's guarantee). The host keeps Poisson sampling
at the rate of its public size (:func:`dpfl.client.trainers.train_dpsgd`'s
``public_examples``), so the planned release and the accounting are unchanged and each
canary is covered by its host's per-sample epsilon.
"""

from __future__ import annotations

import torch

from dpfl.config import RunConfig
from dpfl.data import ClientData
from dpfl.privacy.audit.canaries import canary_bits, canary_direction

# domain separation of the canary examples' stream from the bits' and directions' streams
_EXAMPLES = 0x5A17


def canary_examples(cfg: RunConfig, input_shape: tuple[int, ...], num_classes: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """All m canary examples of a sample-level audit run (same on every party that knows
    ``audit-seed``): N(0, 1) inputs and uniformly random labels."""
    g = torch.Generator().manual_seed(int(cfg.audit_seed) * 1_000_003 + _EXAMPLES)
    m = cfg.audit_canaries
    x = torch.randn((m, *input_shape), generator=g)
    y = torch.randint(0, num_classes, (m,), generator=g)
    return x, y


def canary_host(index: int, num_partitions: int) -> int:
    """The client that holds canary example ``index``."""
    return index % num_partitions


def with_canary_examples(cfg: RunConfig, partition_id: int, num_partitions: int,
                         data: ClientData) -> ClientData:
    """``data`` plus the included canary examples this client hosts (DP-SGD audit runs
    only; otherwise ``data`` unchanged)."""
    if cfg.audit_canaries == 0 or cfg.trainer != "dpsgd":
        return data
    bits = canary_bits(cfg.audit_seed, cfg.audit_canaries)
    mine = [i for i in range(cfg.audit_canaries)
            if canary_host(i, num_partitions) == partition_id and bool(bits[i])]
    if not mine:
        return data
    x, y = canary_examples(cfg, tuple(data.x_train.shape[1:]), data.num_classes)
    idx = torch.tensor(mine)
    return ClientData(torch.cat([data.x_train, x[idx].to(data.x_train.dtype)]),
                      torch.cat([data.y_train, y[idx].to(data.y_train.dtype)]),
                      data.x_val, data.y_val, data.num_classes)


def canary_norm(cfg: RunConfig) -> float:
    """The canary vector's norm: ``audit-canary-norm``, or ``clip-norm`` when 0 (a canary
    at the clipping bound: the largest change a clipped mechanism lets through)."""
    return cfg.audit_canary_norm if cfg.audit_canary_norm > 0 else cfg.clip_norm


def is_canary(cfg: RunConfig, partition_id: int) -> bool:
    """Whether ``partition_id`` is a canary client of this (client-level audit) run."""
    return cfg.trainer != "dpsgd" and 0 <= partition_id < cfg.audit_canaries


def canary_update(cfg: RunConfig, partition_id: int, update: torch.Tensor) -> torch.Tensor:
    """The flat update canary client ``partition_id`` releases through its method: the
    canary vector when its secret bit is 1, else ``update`` unchanged (also for every
    client that is not a canary)."""
    if not is_canary(cfg, partition_id):
        return update
    if not bool(canary_bits(cfg.audit_seed, cfg.audit_canaries)[partition_id]):
        return update
    direction = canary_direction(cfg.audit_seed, partition_id, update.numel(),
                                 min(cfg.audit_canary_support, update.numel()))
    return (canary_norm(cfg) * direction).to(update.dtype).to(update.device)
