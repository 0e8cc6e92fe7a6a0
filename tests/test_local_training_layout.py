"""Local SGD in channels-last layout (dpfl.client.trainers.train_plain): the same updates as
the contiguous layout to float rounding, the model contiguous again afterwards, and the
layout left alone where a method's hooks see the parameters or no convolution gains."""

import copy

import pytest
import torch

from dpfl.client import trainers
from dpfl.client.trainers import channels_last_pays, train_plain
from dpfl.data import ClientData
from dpfl.methods import parse_run_config
from dpfl.models import build_model

CPU = torch.device("cpu")


def _client(n: int = 30, seed: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    return ClientData(torch.randn(n, 1, 28, 28, generator=g),
                      torch.randint(0, 10, (n,), generator=g),
                      torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long), 10)


def _channels_last(model: torch.nn.Module) -> bool:
    """Whether the convolution weights with several input channels are channels-last (a
    one-channel tensor is both layouts at once)."""
    weights = [p for p in model.parameters() if p.dim() == 4 and p.shape[1] > 1]
    assert weights
    return all(not p.is_contiguous() and p.is_contiguous(memory_format=torch.channels_last)
               for p in weights)


def _spy_on_layouts(monkeypatch) -> list[bool]:  # type: ignore[no-untyped-def]
    """Whether each local SGD step ran channels-last, in order, from now on."""
    seen: list[bool] = []
    original = trainers.sgd_step

    def spy(model, opt, criterion, x, y, pre_step=None):  # type: ignore[no-untyped-def]
        seen.append(_channels_last(model))
        return original(model, opt, criterion, x, y, pre_step)

    monkeypatch.setattr(trainers, "sgd_step", spy)
    return seen


@pytest.mark.parametrize("momentum,epochs", [(0.0, 1), (0.9, 2)])
def test_channels_last_gives_the_contiguous_updates(monkeypatch, momentum, epochs):
    cfg = parse_run_config({"dataset": "mnist", "model": "mnist-cnn", "trainer": "update-dp",
                            "batch-size": 8, "lr": 0.05, "momentum": momentum,
                            "local-epochs": epochs})
    data = _client()
    torch.manual_seed(1)
    base = build_model("mnist-cnn", (1, 28, 28), 10)
    fast, plain = copy.deepcopy(base), copy.deepcopy(base)
    assert channels_last_pays(fast, data.x_train, CPU)
    seen = _spy_on_layouts(monkeypatch)
    got = train_plain(fast, data, cfg, 7, CPU)
    assert seen and all(seen)            # every step ran channels-last
    monkeypatch.setattr(trainers, "channels_last_pays", lambda *a: False)
    seen.clear()
    expected = train_plain(plain, data, cfg, 7, CPU)
    assert seen and not any(seen)
    assert got.steps == expected.steps and got.train_loss == pytest.approx(expected.train_loss,
                                                                           rel=1e-5)
    for (name, a), b in zip(plain.named_parameters(), fast.parameters()):
        assert b.is_contiguous(), name    # contiguous again: flattening sees the usual layout
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name
    assert not torch.equal(next(fast.parameters()), next(base.parameters()))   # it trained


def test_the_layout_is_left_alone_with_hooks_or_without_convolutions(monkeypatch):
    cfg = parse_run_config({"dataset": "mnist", "model": "mnist-cnn", "batch-size": 8})
    data = _client(16)
    mlp = build_model("mlp", (1, 28, 28), 10)
    assert not channels_last_pays(mlp, data.x_train, CPU)
    assert not channels_last_pays(build_model("mnist-cnn", (1, 28, 28), 10),
                                  data.x_train.flatten(1), CPU)
    cnn = build_model("mnist-cnn", (1, 28, 28), 10)
    assert channels_last_pays(cnn, data.x_train, CPU, steps=2)
    assert not channels_last_pays(cnn, data.x_train, CPU, steps=1)   # converting costs more
    layouts: list[bool] = []

    def pre_step(model):  # type: ignore[no-untyped-def]
        layouts.append(not _channels_last(model))

    train_plain(build_model("mnist-cnn", (1, 28, 28), 10), data, cfg, 0, CPU,
                pre_step=pre_step)
    assert layouts and all(layouts)      # a method's hook sees contiguous parameters


def test_a_one_step_client_trains_in_the_contiguous_layout(monkeypatch):
    """A client whose round is one step (fewer examples than a batch, one epoch) keeps the
    contiguous layout: the conversions there and back would cost more than they save."""
    cfg = parse_run_config({"dataset": "mnist", "model": "mnist-cnn", "batch-size": 8})
    seen = _spy_on_layouts(monkeypatch)
    train_plain(build_model("mnist-cnn", (1, 28, 28), 10), _client(8), cfg, 0, CPU)
    assert seen == [False]
    train_plain(build_model("mnist-cnn", (1, 28, 28), 10), _client(16), cfg, 0, CPU)
    assert seen[1:] == [True, True]
