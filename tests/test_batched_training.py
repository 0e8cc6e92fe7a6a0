"""Batched local training (dpfl/client/batched_training.py): a cohort's clients trained in
one torch.func.vmap call give the updates the sequential loop (train_plain) gives each of
them, to float rounding: same batches, padded and masked for clients of other sizes, with
SGD momentum over several local epochs; and what cannot be batched is said."""

import copy

import pytest
import torch
from torch import nn

from dpfl.client.batched_training import client_batches, train_plain_batched, why_not_batched
from dpfl.client.hooks import MethodHooks
from dpfl.client.trainers import train_plain
from dpfl.data import ClientData
from dpfl.methods import parse_run_config
from dpfl.models import build_model


def _clients(count: int, seed: int = 0) -> list[ClientData]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = 9 + 7 * (i % 4)          # 9, 16, 23, 30 examples: last batches and step counts differ
        out.append(ClientData(torch.randn(n, 1, 28, 28, generator=g),
                              torch.randint(0, 10, (n,), generator=g),
                              torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long), 10))
    return out


@pytest.mark.parametrize("model,momentum,epochs", [("mlp", 0.0, 1), ("mlp", 0.9, 2),
                                                   ("mnist-cnn", 0.5, 2)])
def test_batched_clients_get_the_sequential_updates(model, momentum, epochs):
    cfg = parse_run_config({"dataset": "mnist", "model": model, "trainer": "update-dp",
                            "batch-size": 8, "lr": 0.05, "momentum": momentum,
                            "local-epochs": epochs})
    datas = _clients(6)
    torch.manual_seed(3)
    base = build_model(cfg.model, (1, 28, 28), 10)
    seeds = [100 + i for i in range(len(datas))]
    alone = [copy.deepcopy(base) for _ in datas]
    together = [copy.deepcopy(base) for _ in datas]
    cpu = torch.device("cpu")
    expected = [train_plain(m, d, cfg, s, cpu) for m, d, s in zip(alone, datas, seeds)]
    got = train_plain_batched(together, datas, cfg, seeds, cpu)
    assert [r.steps for r in got] == [r.steps for r in expected]
    assert len({r.steps for r in got}) > 1           # the masks were exercised
    for a, b, ra, rb in zip(alone, together, expected, got):
        assert rb.num_examples == ra.num_examples and rb.sample_rate == ra.sample_rate
        assert rb.train_loss == pytest.approx(ra.train_loss, rel=1e-5)
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.allclose(pa, pb, rtol=1e-4, atol=1e-6), name
        assert not torch.equal(next(a.parameters()), next(base.parameters()))   # it trained


def test_a_client_trains_on_the_sequential_loops_batches():
    cfg = parse_run_config({"dataset": "mnist", "batch-size": 8, "local-epochs": 2})
    data = _clients(4)[3]
    batches = client_batches(data, cfg, 7)
    assert len(batches) == 2 * 4                     # 30 examples: 8, 8, 8, 6 per epoch
    seen = torch.cat([y for _, y in batches[:4]])
    assert sorted(seen.tolist()) == sorted(data.y_train.tolist())   # each epoch: every example


def test_what_cannot_be_batched_is_named():
    cfg = parse_run_config({"dataset": "mnist", "model": "mlp", "trainer": "update-dp"})
    model = build_model("mlp", (1, 28, 28), 10)
    assert why_not_batched(cfg, model, MethodHooks()) is None
    assert "pre_step" in why_not_batched(cfg, model, MethodHooks(pre_step=lambda m: None))
    dpsgd = parse_run_config({"dataset": "mnist", "model": "mlp", "trainer": "dpsgd"})
    assert "Opacus" in why_not_batched(dpsgd, model, MethodHooks())
    assert "buffers" in why_not_batched(cfg, nn.Sequential(nn.BatchNorm1d(4)), MethodHooks())
    assert "dropout" in why_not_batched(cfg, nn.Sequential(nn.Dropout(0.5)), MethodHooks())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_the_batched_path_runs_on_cuda_with_the_sequential_updates():
    cfg = parse_run_config({"dataset": "mnist", "model": "mnist-cnn", "trainer": "update-dp",
                            "batch-size": 8, "lr": 0.05})
    datas, cuda = _clients(4), torch.device("cuda")
    base = build_model(cfg.model, (1, 28, 28), 10)
    alone = [copy.deepcopy(base) for _ in datas]
    together = [copy.deepcopy(base) for _ in datas]
    for m, d, s in zip(alone, datas, range(4)):
        train_plain(m, d, cfg, s, cuda)
    train_plain_batched(together, datas, cfg, list(range(4)), cuda)
    for a, b in zip(alone, together):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.allclose(pa, pb, rtol=1e-3, atol=1e-5)


def test_the_automatic_batch_is_for_gpus():
    from dpfl.client.batched_training import AUTO_BATCH_ON_CUDA, batch_size

    assert batch_size(-1, torch.device("cpu")) == 0
    assert batch_size(-1, torch.device("cuda")) == AUTO_BATCH_ON_CUDA
    assert batch_size(8, torch.device("cpu")) == 8
