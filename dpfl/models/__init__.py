"""Model registry: name -> builder(input_shape, num_classes)."""

from __future__ import annotations

from typing import Callable

from torch import nn

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


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Instantiate a registered model."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name](input_shape, num_classes)


__all__ = ["MODELS", "build_model", "MLP", "MnistCNN", "CifarCNN", "AlexNetSmall",
           "resnet_groupnorm"]
