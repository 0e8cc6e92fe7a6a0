"""Models: output shapes and Opacus compatibility."""

import pytest
import torch
from opacus.validators import ModuleValidator

from dpfl.models import MODELS, build_model

SHAPES = {"mlp": [(1, 28, 28), (1, 8, 8)], "mnist-cnn": [(1, 28, 28), (1, 8, 8)],
          "cifar-cnn": [(3, 32, 32)], "alexnet": [(1, 28, 28), (3, 32, 32)],
          "resnet18-gn": [(3, 32, 32)], "resnet50-gn": [(3, 32, 32)]}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shapes_and_opacus_valid(name):
    for shape in SHAPES[name]:
        model = build_model(name, shape, 10)
        out = model(torch.zeros(3, *shape))
        assert out.shape == (3, 10)
        assert ModuleValidator.validate(model, strict=False) == []


@pytest.mark.parametrize("name", ["resnet18-gn", "resnet50-gn"])
def test_resnets_keep_torchvisions_function_without_in_place_ops(name):
    """The out-of-place blocks compute what torchvision's own blocks compute on the same
    weights, and no ReLU is in place (Opacus' backward hooks forbid it)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = build_model(name, (3, 32, 32), 10).eval()
    builder = {"resnet18-gn": torchvision.models.resnet18,
               "resnet50-gn": torchvision.models.resnet50}[name]
    reference = builder(weights=None, num_classes=10,
                        norm_layer=lambda ch: torch.nn.GroupNorm(min(32, ch), ch))
    reference.conv1 = torch.nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
    reference.maxpool = torch.nn.Identity()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model(x), reference.eval()(x), atol=1e-5)
    assert not any(m.inplace for m in model.modules() if isinstance(m, torch.nn.ReLU))


def test_resnet_per_sample_gradient_norms_match_a_per_example_loop():
    """Opacus' per-sample gradients on resnet18-gn (hooks) against one backward per example."""
    pytest.importorskip("torchvision")
    from opacus import GradSampleModule

    torch.manual_seed(1)
    model = build_model("resnet18-gn", (1, 8, 8), 10)
    x, y = torch.randn(3, 1, 8, 8), torch.tensor([0, 4, 9])
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    expected = []
    for i in range(3):
        model.zero_grad()
        loss_fn(model(x[i:i + 1]), y[i:i + 1]).backward()
        expected.append(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())))
    gsm = GradSampleModule(model, loss_reduction="sum")
    gsm.zero_grad()
    loss_fn(gsm(x), y).backward()
    norms = torch.sqrt(sum((p.grad_sample.reshape(3, -1) ** 2).sum(1)
                           for p in model.parameters()))
    assert torch.allclose(norms, torch.stack(expected), rtol=1e-4)


def test_feature_size_is_computed_once_per_architecture_and_shape_and_draws_nothing():
    """The flat-size probe (a forward pass of zeros) runs once per architecture and input
    shape in a process; a model built with the memo equals one built without it, from the
    same seed (the probe draws no random number)."""
    import torch

    from dpfl.models import nets

    nets._FLAT_SIZES.clear()
    torch.manual_seed(3)
    fresh = nets.MnistCNN((1, 28, 28), 10)
    assert len(nets._FLAT_SIZES) == 1
    torch.manual_seed(3)
    memo = nets.MnistCNN((1, 28, 28), 10)
    digits = nets.MnistCNN((1, 8, 8), 10)   # padded convs: another architecture and shape
    assert len(nets._FLAT_SIZES) == 2 and digits.fc1.in_features == 32 * 2 * 2
    assert fresh.fc1.in_features == 32 * 4 * 4
    for a, b in zip(fresh.state_dict().values(), memo.state_dict().values()):
        assert torch.equal(a, b)
