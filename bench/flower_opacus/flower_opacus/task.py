"""The model (dpfl's mnist-cnn architecture, written out) and the exported data."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import nn


class Net(nn.Module):
    """Two 5x5 conv layers (16, 32 channels; ReLU, 2x2 max-pool), fc 512 -> 128 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.fc1 = nn.Linear(512, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.features(x).flatten(1))))


@lru_cache(maxsize=1)
def load(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def partition(path: str, pid: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = load(path)
    return torch.from_numpy(d[f"x{pid}"]), torch.from_numpy(d[f"y{pid}"])


def test_set(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    d = load(path)
    return torch.from_numpy(d["x_test"]), torch.from_numpy(d["y_test"])
