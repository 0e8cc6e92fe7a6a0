"""What the server keeps of the updates it sees, for privacy measurement (``dpfl audit``,
``dpfl attack``); nothing here is used by training.

- Canary scores (client-level audit runs, ``audit-canaries`` > 0): for every accepted reply
  of a canary client, the projection <update, u_i> on its secret canary direction, one line per reply
  in ``audit.jsonl`` (with sparse canaries also the fraction of the canary's support
  that is non-zero in the reply; appended durably; a resumed run appends, and the auditor's statistic
  sums them: a round trained twice was released twice).
- Recorded updates (``record-updates`` = k > 0): the last accepted update of clients
  0 .. k-1 with the global model it was computed from, ``updates/client-<i>.pt``; the
  membership-inference attacks score the model the server could rebuild from it
  (global + update), the strongest attacker of the local trust model.
- Recorded global models (``record-global-models`` = true): the global model after every
  round, ``globals/round-<r>.pt`` (its state dict); CS-MIA reads the confidence series of a
  record across them. Every sampled client receives these models anyway: keeping them
  releases nothing new.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dpfl.config import RunConfig
from dpfl.durable import append_line, atomic_write
from dpfl.privacy.audit.canaries import canary_direction, canary_score, support_overlap
from dpfl.server.validation import ClientUpdate
from dpfl.tensorfile import save_tensors

AUDIT_FILE = "audit.jsonl"
UPDATES_DIR = "updates"
GLOBALS_DIR = "globals"


def recorded_update_path(run_dir: Path, partition_id: int) -> Path:
    return Path(run_dir) / UPDATES_DIR / f"client-{partition_id}.pt"


def recorded_global_path(run_dir: Path, server_round: int) -> Path:
    return Path(run_dir) / GLOBALS_DIR / f"round-{server_round}.pt"


def recorded_global_rounds(run_dir: Path) -> list[int]:
    """The rounds whose global model the run kept (``record-global-models``), ascending."""
    folder = Path(run_dir) / GLOBALS_DIR
    rounds = []
    for path in folder.glob("round-*.pt") if folder.is_dir() else ():
        suffix = path.stem.removeprefix("round-")
        if suffix.isdigit():
            rounds.append(int(suffix))
    return sorted(rounds)


class UpdateObserver:
    """Scores canary replies and keeps target clients' updates for one run directory."""

    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self._directions: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return (self.cfg.audit_canaries > 0 or self.cfg.record_updates > 0
                or self.cfg.record_global_models)

    def _direction(self, partition_id: int, dim: int) -> torch.Tensor:
        key = (partition_id, dim)
        if key not in self._directions:
            self._directions[key] = canary_direction(
                self.cfg.audit_seed, partition_id, dim, min(self.cfg.audit_canary_support, dim))
        return self._directions[key]

    def observe(self, server_round: int, accepted: list[ClientUpdate],
                global_flat: torch.Tensor) -> None:
        """Record what the server saw in ``server_round`` (``global_flat``: the model the
        round's clients started from)."""
        for u in accepted:
            if self.cfg.trainer != "dpsgd" and 0 <= u.partition_id < self.cfg.audit_canaries:
                direction = self._direction(u.partition_id, u.flat.numel())
                line = {"round": server_round, "client": u.partition_id,
                        "score": canary_score(u.flat, direction), "norm": float(u.flat.norm())}
                if self.cfg.audit_canary_support:
                    line["overlap"] = support_overlap(u.flat, direction)
                append_line(self.run_dir / AUDIT_FILE, json.dumps(line))
            if 0 <= u.partition_id < self.cfg.record_updates:
                path = recorded_update_path(self.run_dir, u.partition_id)
                path.parent.mkdir(exist_ok=True)
                state = {"round": server_round, "global": global_flat.clone(),
                         "update": u.flat.clone()}
                atomic_write(path, lambda f, state=state: save_tensors(state, f))

    def keep_global(self, server_round: int, state: dict[str, torch.Tensor]) -> None:
        """Keep the global model after ``server_round`` (``record-global-models``; a
        resumed run rewrites the rounds it trains again)."""
        if not self.cfg.record_global_models:
            return
        path = recorded_global_path(self.run_dir, server_round)
        path.parent.mkdir(exist_ok=True)
        state = {k: v.detach().clone() for k, v in state.items()}
        atomic_write(path, lambda f: save_tensors({"round": server_round, "model": state}, f))
