"""The client half of a privacy audit (Steinke, Nasr & Jagielski, "Privacy Auditing with
One (1) Training Run", 2023): in an audit run (``audit-canaries`` = m > 0) clients
0 .. m-1 are canary clients. Canary client i, when its secret bit b_i is 1, replaces the
update its local training produced by the canary vector ``audit-canary-norm`` * u_i (u_i a
secret uniformly random unit direction), *before* the method's release (clipping, noise,
sparsification): a canary is a change of that one client's data, so the run's client-level
guarantee covers it, and the auditor (the server) measures the mechanism exactly as
deployed. With b_i = 0 the client trains as usual. Bits and directions come from
``audit-seed``, the auditor's secret (:mod:`dpfl.privacy.canaries`).
"""

from __future__ import annotations

import torch

from dpfl.config import RunConfig
from dpfl.privacy.canaries import canary_bits, canary_direction


def canary_norm(cfg: RunConfig) -> float:
    """The canary vector's norm: ``audit-canary-norm``, or ``clip-norm`` when 0 (a canary
    at the clipping bound: the largest change a clipped mechanism lets through)."""
    return cfg.audit_canary_norm if cfg.audit_canary_norm > 0 else cfg.clip_norm


def is_canary(cfg: RunConfig, partition_id: int) -> bool:
    """Whether ``partition_id`` is a canary client of this (audit) run."""
    return 0 <= partition_id < cfg.audit_canaries


def canary_update(cfg: RunConfig, partition_id: int, update: torch.Tensor) -> torch.Tensor:
    """The flat update canary client ``partition_id`` releases through its method: the
    canary vector when its secret bit is 1, else ``update`` unchanged (also for every
    client that is not a canary)."""
    if not is_canary(cfg, partition_id):
        return update
    if not bool(canary_bits(cfg.audit_seed, cfg.audit_canaries)[partition_id]):
        return update
    direction = canary_direction(cfg.audit_seed, partition_id, update.numel())
    return (canary_norm(cfg) * direction).to(update.dtype).to(update.device)
