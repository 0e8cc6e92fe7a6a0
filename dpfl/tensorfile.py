"""Tensor files as data only: what dpfl writes to a run folder (checkpoints, recorded
updates and global models) holds tensors and plain values, and is read back with
``torch.load(weights_only=True)``, which refuses any pickled object that is not one of
those: a planted ``checkpoint.pt`` cannot run code on ``resume=true`` or ``dpfl attack``.

A run folder is untrusted input (it can be copied, edited, downloaded). torch's default
``weights_only=False`` unpickles anything, and unpickling is code execution.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

PLAIN = (str, int, float, bool, type(None))


class UnsafeTensorFile(ValueError):
    """The file holds something other than tensors and plain values (not loaded)."""


def plain(obj: Any) -> Any:
    """``obj`` with numpy values turned into Python numbers and torch tensors (containers
    kept), so that ``weights_only`` loading accepts it; TypeError for anything else (a
    dpfl bug: state to checkpoint must be data)."""
    if isinstance(obj, np.generic):     # before PLAIN: np.float64 is a float subclass
        return obj.item()
    if isinstance(obj, torch.Tensor) or isinstance(obj, PLAIN):
        return obj
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, dict):
        return type(obj)((plain(k), plain(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    raise TypeError(f"not checkpointable as data: {type(obj).__name__}")


def save_tensors(obj: Any, f: BinaryIO | Path) -> None:
    """``torch.save`` of :func:`plain` ``obj``."""
    torch.save(plain(obj), f)


def load_tensors(path: Path) -> Any:
    """The file's content, loaded as data only (``weights_only=True``, on the CPU);
    :class:`UnsafeTensorFile` when it holds any other pickled object (never executed).
    Other damage raises what torch raises (OSError, EOFError, RuntimeError, ...)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", str(exc))
        what = f" ({found.group(1)})" if found else ""
        raise UnsafeTensorFile(f"{path}: holds objects other than tensors and plain "
                               f"values{what}; refused, never loaded as code") from None
