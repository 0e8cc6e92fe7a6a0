"""The run directory: config.json, rounds.jsonl, ledger.json, summary.json, checkpoint, plots."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpfl.config import RunConfig


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def default_run_name(cfg: RunConfig) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.strategy}-{cfg.dataset}"


def resolve_output_dir(cfg: RunConfig) -> Path:
    """``output-dir``; a relative path is taken from $DPFL_OUTPUT_ROOT, else the cwd."""
    out = Path(os.path.expanduser(cfg.output_dir))
    if not out.is_absolute():
        out = Path(os.environ.get("DPFL_OUTPUT_ROOT", os.getcwd())) / out
    return out


@dataclass
class RunDir:
    """Files of one run."""

    path: Path

    @classmethod
    def open(cls, cfg: RunConfig) -> "RunDir":
        name = cfg.run_name or default_run_name(cfg)
        path = resolve_output_dir(cfg) / name
        if not cfg.resume and any((path / f).exists() for f in ("config.json", "rounds.jsonl")):
            raise FileExistsError(f"run directory {path} exists; set resume=true to continue "
                                  "it or choose another run-name")
        path.mkdir(parents=True, exist_ok=True)
        return cls(path)

    def file(self, name: str) -> Path:
        return self.path / name

    def write_json(self, name: str, data: Any) -> Path:
        target = self.file(name)
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_text(json.dumps(_jsonable(data), indent=1))
        tmp.replace(target)
        return target

    def append_round(self, record: dict[str, Any]) -> None:
        with open(self.file("rounds.jsonl"), "a") as f:
            f.write(json.dumps(_jsonable(record)) + "\n")

    def read_rounds(self) -> list[dict[str, Any]]:
        path = self.file("rounds.jsonl")
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def truncate_rounds(self, last_round: int) -> list[dict[str, Any]]:
        """Keep the rounds up to ``last_round`` (those the checkpoint covers)."""
        kept = [r for r in self.read_rounds() if r["round"] <= last_round]
        self.file("rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        tmp = self.file("checkpoint.pt.tmp")
        torch.save(state, tmp)
        tmp.replace(self.file("checkpoint.pt"))

    def load_checkpoint(self) -> dict[str, Any] | None:
        path = self.file("checkpoint.pt")
        return torch.load(path, weights_only=False) if path.exists() else None
