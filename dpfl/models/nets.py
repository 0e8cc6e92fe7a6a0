"""The papers' networks, all Opacus-compatible (no BatchNorm; GroupNorm where needed)."""

from __future__ import annotations

import functools

import torch
from torch import nn

_FLAT_SIZES: dict[tuple[str, tuple[int, ...]], int] = {}


def _flat_size(module: nn.Module, input_shape: tuple[int, int, int]) -> int:
    """The number of features ``module`` makes of one input of ``input_shape``: one forward
    pass of zeros per architecture (its ``repr``: every layer's sizes) and shape in a
    process — a ClientApp builds the model for every instruction, and the pass was about
    20 ms of each build. Draws no random number."""
    key = (repr(module), tuple(input_shape))
    if key not in _FLAT_SIZES:
        with torch.no_grad():
            _FLAT_SIZES[key] = int(module(torch.zeros(1, *input_shape)).numel())
    return _FLAT_SIZES[key]


class MLP(nn.Module):
    """Two fully connected layers (AADP-FL's MLP): input -> hidden -> classes."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden: int = 200):
        super().__init__()
        c, h, w = input_shape
        self.fc1 = nn.Linear(c * h * w, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class MnistCNN(nn.Module):
    """Two 5x5 conv layers (each + ReLU + 2x2 max-pool) and two fc layers.

    Small channel counts (16, 32) and a 128-unit hidden layer: DP-SGD's noise grows with
    the parameter count, so this width trains better under DP than a wide LeNet.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int,
                 channels: tuple[int, int] = (16, 32), hidden: int = 128):
        super().__init__()
        c1, c2 = channels
        pad = 2 if input_shape[1] < 20 else 0  # keep 8x8 digits big enough for two pools
        self.features = nn.Sequential(
            nn.Conv2d(input_shape[0], c1, 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.fc1 = nn.Linear(_flat_size(self.features, input_shape), hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.features(x).flatten(1))))


class CifarCNN(nn.Module):
    """Two 5x5 conv layers and three fc layers (the classic CIFAR-10 tutorial net)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(input_shape[0], 32, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(_flat_size(self.features, input_shape), 384), nn.ReLU(),
            nn.Linear(384, 192), nn.ReLU(), nn.Linear(192, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class AlexNetSmall(nn.Module):
    """AlexNet-style net (5 conv, 3 fc) sized for 28x28 and 32x32 inputs; GroupNorm
    instead of local response normalisation so Opacus accepts it."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        c = input_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(c, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.GroupNorm(8, 128), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(),
            nn.Conv2d(256, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(_flat_size(self.features, input_shape), 512), nn.ReLU(),
            nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def resnet_groupnorm(depth: int, input_shape: tuple[int, int, int], num_classes: int,
                     groups: int = 32) -> nn.Module:
    """torchvision ResNet-18/50 with GroupNorm (needs the ``vision`` extra)."""
    try:
        import torchvision
    except ImportError as exc:
        raise ImportError("ResNet models need torchvision: pip install 'dpfl[vision]'") from exc
    builder = {18: torchvision.models.resnet18, 50: torchvision.models.resnet50}[depth]
    model = builder(weights=None, num_classes=num_classes,
                    norm_layer=lambda ch: nn.GroupNorm(min(groups, ch), ch))
    if input_shape[0] != 3 or input_shape[1] <= 64:
        # Small images: 3x3 stem without the max-pool, as usual for CIFAR-size inputs.
        model.conv1 = nn.Conv2d(input_shape[0], 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return without_in_place_ops(model)


def without_in_place_ops(model: nn.Module) -> nn.Module:
    """The same ResNet (same parameters, same function) with its in-place ops made
    out-of-place, so that Opacus' per-sample hooks can run on it: torch refuses a backward
    hook on a module whose output is then modified in place (torchvision's blocks do
    ``out += identity`` and use ``ReLU(inplace=True)``; pytorch/pytorch#61519)."""
    swap = _out_of_place_blocks()
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
        if type(module) in swap:
            module.__class__ = swap[type(module)]
    return model


@functools.cache
def _out_of_place_blocks() -> dict[type, type]:
    """torchvision's BasicBlock and Bottleneck -> subclasses that add the shortcut with
    ``out + identity`` (built on first use: torchvision is an optional extra, and slow to
    import)."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    def residual(block: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        identity = x if block.downsample is None else block.downsample(x)
        return block.relu(out + identity)

    class OutOfPlaceBasicBlock(BasicBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.relu(self.bn1(self.conv1(x)))
            return residual(self, x, self.bn2(self.conv2(out)))

    class OutOfPlaceBottleneck(Bottleneck):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            return residual(self, x, self.bn3(self.conv3(out)))

    return {BasicBlock: OutOfPlaceBasicBlock, Bottleneck: OutOfPlaceBottleneck}
