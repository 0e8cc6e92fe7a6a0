"""What a method may add to a client's local training and to its reply.

Everything a hook uses must be public or already released (the global model, control
variates built from DP outputs): hooks are post-processing of the DP mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from flwr.app import ArrayRecord

from dpfl.client.trainers import PostStep, TrainResult


@dataclass
class MethodHooks:
    """A post-step correction for local training and extra reply records."""

    post_step: PostStep | None = None
    finish: Callable[[torch.nn.Module, TrainResult], dict[str, ArrayRecord]] = field(
        default=lambda model, result: {})
