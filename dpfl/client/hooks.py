"""What a method may add to a client's local training and to its reply.

Everything a hook uses must be public or already released (the global model, control
variates built from DP outputs): hooks are post-processing of the DP mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from flwr.app import ArrayRecord

from dpfl.client.trainers import LocalStep, PostStep, PreStep, TrainResult, WeightPerturbation
from dpfl.data import ClientData

# private values computed after local training that a method's release_update may release
# with the update (e.g. a local validation score): (trained model, the client's data) -> values
LocalValues = Callable[[torch.nn.Module, ClientData], dict[str, float]]


@dataclass
class MethodHooks:
    """Changes to local training (a gradient transform before each step, a whole
    replacement step, a correction after it) and extra reply records. ``pre_step`` and
    ``step`` apply to the training without per-sample DP only (``trainer=plain`` or
    ``update-dp``): under DP-SGD Opacus owns the step, and ``noisy_grad`` (a transform of
    each step's noised gradient) and ``perturb`` (the weights at which per-sample gradients
    are taken, :class:`~dpfl.client.trainers.WeightPerturbation`) apply instead.
    ``local_values``: private values for the method's update release (update DP)."""

    post_step: PostStep | None = None
    pre_step: PreStep | None = None
    step: LocalStep | None = None
    noisy_grad: PreStep | None = None
    perturb: WeightPerturbation | None = None
    finish: Callable[[torch.nn.Module, TrainResult], dict[str, ArrayRecord]] = field(
        default=lambda model, result: {})
    local_values: LocalValues | None = None
