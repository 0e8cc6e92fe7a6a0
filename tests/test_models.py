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
