"""Channel reduction (a learnable 1x1 conv C -> ceil(r*C) after the first conv block):
shapes for every CNN, C' and the parameter count, gradients, Opacus validity and one DP-SGD
step in ghost and hooks mode."""

import math
import warnings

import pytest
import torch
from opacus import PrivacyEngine
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpfl.models import add_channel_reduction, build_model, find_channel_reduction
from dpfl.models.channel_reduction import reduced_channels

CNNS = ["mnist-cnn", "cifar-cnn", "alexnet", "resnet18-gn", "resnet50-gn"]
# cifar-cnn's two unpadded 5x5 convs do not fit an 8x8 digit (nor does the unreduced net)
SHAPES = {name: [(1, 28, 28), (3, 32, 32), (1, 8, 8)] for name in CNNS}
SHAPES["cifar-cnn"] = [(1, 28, 28), (3, 32, 32)]
# ResNets (11M / 23.5M parameters) on fewer shapes, to stay fast: the 1-channel stem is
# the same for 8x8 and 28x28
SHAPES["resnet18-gn"] = [(3, 32, 32), (1, 8, 8)]
SHAPES["resnet50-gn"] = [(1, 8, 8)]
# channels C entering the reduction: the first block's output (ResNet: layer1's output)
CHANNELS = {"mnist-cnn": 16, "cifar-cnn": 32, "alexnet": 64, "resnet18-gn": 64,
            "resnet50-gn": 256}


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", CNNS)
def test_shapes_layer_size_and_opacus_valid(name):
    torch.manual_seed(0)
    for shape in SHAPES[name]:
        model = build_model(name, shape, 10, channel_reduction=0.5)
        with torch.no_grad():
            assert model(torch.zeros(2, *shape)).shape == (2, 10)
        layer = find_channel_reduction(model)
        c = CHANNELS[name]
        assert layer.weight.shape == (c // 2, c, 1, 1) and layer.bias is None
        assert sum(p.numel() for p in layer.parameters()) == (c // 2) * c
        assert ModuleValidator.validate(model, strict=False) == []


@pytest.mark.parametrize("ratio, channels, expected", [
    (0.5, 16, 8), (0.3, 16, 5), (0.25, 64, 16), (0.1, 32, 4), (1.0, 16, 16), (0.01, 16, 1),
    (0.7, 10, 7),  # 0.7 * 10 is 7.000000000000001 in floating point: still 7
])
def test_reduced_channels_is_ceil_of_ratio_times_c(ratio, channels, expected):
    assert reduced_channels(channels, ratio) == expected


def test_hand_computed_layer_sizes_on_mnist_cnn():
    for ratio, reduced in ((0.5, 8), (0.3, 5), (1.0, 16)):
        model = build_model("mnist-cnn", (1, 28, 28), 10, channel_reduction=ratio)
        layer = find_channel_reduction(model)
        assert layer.weight.numel() == reduced * 16 == reduced * layer.in_channels
        assert model.features[4].in_channels == reduced  # the rebuilt second conv
    base = build_model("mnist-cnn", (1, 28, 28), 10)
    reduced_model = build_model("mnist-cnn", (1, 28, 28), 10, channel_reduction=0.5)
    # + 8*16 for W, - 8*32*5*5 for the second conv's dropped input channels
    assert _count(reduced_model) == _count(base) + 8 * 16 - 8 * 32 * 25 < _count(base)


def test_the_input_model_is_not_changed_and_ratio_one_computes_the_same_function():
    torch.manual_seed(0)
    base = build_model("alexnet", (1, 8, 8), 10).eval()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    same = add_channel_reduction(base, 1.0).eval()
    add_channel_reduction(base, 0.5)
    assert base.state_dict().keys() == before.keys()
    assert all(torch.equal(base.state_dict()[k], v) for k, v in before.items())
    layer = find_channel_reduction(same)
    assert torch.equal(layer.weight[:, :, 0, 0], torch.eye(64))  # [I | 0] at ratio 1: I
    x = torch.randn(3, 1, 8, 8)
    assert torch.allclose(same(x), base(x), atol=1e-5)


def test_resnet_reduction_sits_after_layer1_and_layer2_is_rebuilt():
    model = build_model("resnet18-gn", (1, 8, 8), 10, channel_reduction=0.25)
    assert model.layer1[-1] is find_channel_reduction(model)
    assert model.layer2[0].conv1.in_channels == 16
    assert model.layer2[0].downsample[0].in_channels == 16


def test_gradients_reach_the_reduction_weight():
    model = build_model("mnist-cnn", (1, 28, 28), 10, channel_reduction=0.5)
    loss = nn.functional.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.arange(4))
    loss.backward()
    grad = find_channel_reduction(model).weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    # every entry of W gets a gradient, the dropped channels' columns included
    assert (grad[:, 8:].abs().sum() > 0)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, math.nan])
def test_a_ratio_outside_0_1_is_an_error(bad):
    base = build_model("mnist-cnn", (1, 28, 28), 10)
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        add_channel_reduction(base, bad)


def test_build_model_zero_is_the_registered_model_and_negative_is_an_error():
    torch.manual_seed(0)
    plain = build_model("mnist-cnn", (1, 28, 28), 10)
    torch.manual_seed(0)
    zero = build_model("mnist-cnn", (1, 28, 28), 10, channel_reduction=0.0)
    assert plain.state_dict().keys() == zero.state_dict().keys()
    with pytest.raises(ValueError, match="channel_reduction"):
        build_model("mnist-cnn", (1, 28, 28), 10, channel_reduction=-0.1)


def test_a_model_without_conv_layers_is_an_error_naming_it():
    with pytest.raises(ValueError) as exc:
        build_model("mlp", (1, 28, 28), 10, channel_reduction=0.5)
    assert str(exc.value) == "channel reduction needs a CNN: MLP has no conv layer"
    single = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    with pytest.raises(ValueError, match="Sequential has no nn.Sequential child with two"):
        add_channel_reduction(single, 0.5)


@pytest.mark.parametrize("name, shape, mode", [
    ("mnist-cnn", (1, 28, 28), "ghost"), ("mnist-cnn", (1, 28, 28), "hooks"),
    ("alexnet", (1, 8, 8), "ghost"), ("alexnet", (1, 8, 8), "hooks"),
    # torchvision's blocks are made out-of-place (models.nets.without_in_place_ops)
    ("resnet18-gn", (1, 8, 8), "hooks"), ("resnet18-gn", (1, 8, 8), "ghost")])
def test_one_opacus_dp_sgd_step(name, shape, mode):
    torch.manual_seed(0)
    model = build_model(name, shape, 10, channel_reduction=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = TensorDataset(torch.randn(4, *shape), torch.arange(4))
    criterion = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' "Secure RNG turned off", hook warnings
        engine = PrivacyEngine(accountant="rdp")
        made = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=criterion, data_loader=DataLoader(data, batch_size=4),
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
            grad_sample_mode=mode)
        if mode == "ghost":
            dp_model, opt, dp_criterion, loader = made
        else:
            (dp_model, opt, loader), dp_criterion = made, criterion
        x, y = next(iter(loader))
        opt.zero_grad()
        loss = dp_criterion(dp_model(x), y)
        loss.backward()
        opt.step()
    assert torch.isfinite(loss.detach()).all()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(before)  # noise reaches every parameter, W included
    reduction = next(n for n, p in model.named_parameters()
                     if p is find_channel_reduction(model).weight)
    assert reduction in changed
