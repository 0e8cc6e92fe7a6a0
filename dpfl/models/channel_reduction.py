"""Learnable channel reduction of an intermediate feature map.

``Z = W X`` for a feature map ``X`` of ``C`` channels and ``W`` of shape ``C' x C``,
``C' = ceil(ratio * C)``: a 1x1 convolution without bias, as in the local compressed
module of "An Adaptive Differentially Private Federated Learning Framework with Bi-level
Optimization", 2025. :func:`add_channel_reduction` inserts it after the first conv block
of a CNN's feature extractor and rebuilds the next layer(s) to take ``C'`` channels:

- a model with an ``nn.Sequential`` child holding two or more ``nn.Conv2d`` (``MnistCNN``,
  ``CifarCNN``, ``AlexNetSmall``): after the first conv block (conv, norm, activation,
  pooling: everything before the second conv), so the reduction runs on the pooled, smaller
  map; the second conv is rebuilt.
- a torchvision ResNet: after the first stage (``layer1``), appended to it; the first block
  of ``layer2`` is rebuilt (its ``conv1`` and its projection shortcut ``downsample[0]``).
  Not after the stem: ``layer1[0]`` of ResNet-18 has an identity shortcut, which needs its
  input to keep 64 channels, so reducing the stem would force a new projection shortcut
  into the network; ``layer2[0]`` always has one.

Initialisation: ``W = [I_C' | 0]`` (keep the first ``C'`` channels) and each rebuilt conv
takes the first ``C'`` input-channel slices of the conv it replaces. So at ratio 1 the
result computes exactly the input model's function, and at ratio < 1 it starts as the input
model with the last ``C - C'`` channels of the first block dropped; ``W`` then trains.
Only plain ``nn.Conv2d`` modules are used, so Opacus' per-sample gradients work in every
mode.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn


def reduced_channels(channels: int, ratio: float) -> int:
    """``C' = ceil(ratio * C)`` for a ratio in (0, 1]."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"channel-reduction ratio must be in (0, 1], got {ratio!r}")
    return max(1, math.ceil(ratio * channels - 1e-9))


def reduction_conv(channels: int, reduced: int) -> nn.Conv2d:
    """The 1x1 map ``C -> C'`` (no bias), initialised to ``[I | 0]``."""
    conv = nn.Conv2d(channels, reduced, kernel_size=1, bias=False)
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[:, :, 0, 0].copy_(torch.eye(reduced, channels))
    return conv


def narrowed_conv(conv: nn.Conv2d, in_channels: int) -> nn.Conv2d:
    """A copy of ``conv`` taking ``in_channels`` (<= its own) inputs: the first input-channel
    slices of its weight, its bias unchanged."""
    if conv.groups != 1:
        raise ValueError(f"cannot narrow a grouped conv ({conv})")
    new = nn.Conv2d(in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                    padding=conv.padding, dilation=conv.dilation, bias=conv.bias is not None,
                    padding_mode=conv.padding_mode)
    with torch.no_grad():
        new.weight.copy_(conv.weight[:, :in_channels])
        if conv.bias is not None:
            new.bias.copy_(conv.bias)
    return new


def _is_resnet(model: nn.Module) -> bool:
    return all(isinstance(getattr(model, name, None), nn.Sequential)
               for name in ("layer1", "layer2")) and hasattr(model, "fc")


def _reduce_resnet(model: nn.Module, ratio: float) -> None:
    first = model.layer2[0]
    channels = first.conv1.in_channels
    reduced = reduced_channels(channels, ratio)
    model.layer1.append(reduction_conv(channels, reduced))
    first.conv1 = narrowed_conv(first.conv1, reduced)
    if first.downsample is not None:
        first.downsample[0] = narrowed_conv(first.downsample[0], reduced)


def _conv_sequential(model: nn.Module) -> nn.Sequential | None:
    """The first direct ``nn.Sequential`` child holding two or more direct ``nn.Conv2d``."""
    for child in model.children():
        if isinstance(child, nn.Sequential) and \
                sum(isinstance(m, nn.Conv2d) for m in child) >= 2:
            return child
    return None


def _reduce_sequential(features: nn.Sequential, ratio: float) -> None:
    second = [i for i, m in enumerate(features) if isinstance(m, nn.Conv2d)][1]
    nxt = features[second]
    channels = nxt.in_channels
    reduced = reduced_channels(channels, ratio)
    features[second] = narrowed_conv(nxt, reduced)
    features.insert(second, reduction_conv(channels, reduced))


def add_channel_reduction(model: nn.Module, ratio: float) -> nn.Module:
    """A copy of ``model`` with a learnable 1x1 reduction ``C -> ceil(ratio*C)`` after its
    first conv block (see the module docstring for where, and the initialisation). The input
    model is not changed. ``ValueError`` for a ratio outside (0, 1] or a model without a
    supported conv layout (e.g. an MLP)."""
    reduced_channels(1, ratio)  # validate the ratio first
    name = type(model).__name__
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        raise ValueError(f"channel reduction needs a CNN: {name} has no conv layer")
    out = copy.deepcopy(model)
    if _is_resnet(out):
        _reduce_resnet(out, ratio)
        return out
    features = _conv_sequential(out)
    if features is None:
        raise ValueError(f"channel reduction: {name} has no nn.Sequential child with two "
                         "conv layers (and is not a torchvision ResNet)")
    _reduce_sequential(features, ratio)
    return out


def find_channel_reduction(model: nn.Module) -> nn.Conv2d:
    """The reduction layer :func:`add_channel_reduction` inserted: the first 1x1 conv
    without bias whose weight is ``C' x C`` with ``C' <= C`` and which feeds a conv."""
    for module in model.modules():
        if isinstance(module, nn.Sequential):
            items = list(module)
            for m, nxt in zip(items, items[1:] + [None]):
                if _looks_like_reduction(m) and (nxt is None or isinstance(nxt, nn.Conv2d)):
                    return m
    raise ValueError(f"{type(model).__name__} has no channel-reduction layer")


def _looks_like_reduction(m: nn.Module) -> bool:
    return (isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1) and m.bias is None
            and m.stride == (1, 1) and m.out_channels <= m.in_channels)
