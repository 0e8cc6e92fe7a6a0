"""Model registry: name -> builder(input_shape, num_classes)."""

from __future__ import annotations

from typing import Callable

from torch import nn

from dpfl.models.channel_reduction import add_channel_reduction, find_channel_reduction
from dpfl.models.nets import MLP, AlexNetSmall, CifarCNN, MnistCNN, resnet_groupnorm

ModelBuilder = Callable[[tuple[int, int, int], int], nn.Module]

MODELS: dict[str, ModelBuilder] = {
    "mlp": MLP,
    "mnist-cnn": MnistCNN,
    "cifar-cnn": CifarCNN,
    "alexnet": AlexNetSmall,
    "resnet18-gn": lambda shape, k: resnet_groupnorm(18, shape, k),
    "resnet50-gn": lambda shape, k: resnet_groupnorm(50, shape, k),
}


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int,
                channel_reduction: float = 0.0) -> nn.Module:
    """Instantiate a registered model; ``channel_reduction`` > 0 inserts a learnable 1x1
    reduction to ``ceil(channel_reduction * C)`` channels after its first conv block
    (:func:`add_channel_reduction`), 0 leaves the model as registered."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    if channel_reduction < 0:
        raise ValueError(f"channel_reduction must be 0 (off) or in (0, 1], got "
                         f"{channel_reduction!r}")
    model = MODELS[name](input_shape, num_classes)
    return add_channel_reduction(model, channel_reduction) if channel_reduction > 0 else model


__all__ = ["MODELS", "add_channel_reduction", "build_model", "find_channel_reduction", "MLP",
           "MnistCNN", "CifarCNN", "AlexNetSmall", "resnet_groupnorm"]
