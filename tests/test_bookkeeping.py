"""Book-keeping clipping (opacus-mode=bk) against Opacus' hooks mode on the same batch:
per-sample gradient norms and the clipped sum, every layer type and both conv norm paths;
then whole DP-SGD runs: same noise, same Poisson batches, same accountant history."""

import copy

import pytest
import torch
from opacus import GradSampleModule
from torch import nn

from dpfl.client import bookkeeping
from dpfl.client.bookkeeping import BookKeeper, UnsupportedLayer, check_model
from dpfl.client.trainers import train_dpsgd
from dpfl.config import RunConfig
from dpfl.data import ClientData
from dpfl.models import MODELS, build_model


class SeqNet(nn.Module):
    """A Linear over 3-d inputs (ghost norm over positions), an in-place ReLU after a conv
    and after a GroupNorm, a bias-free conv with stride, padding and dilation."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2, padding=2, dilation=2, bias=False)
        self.norm = nn.GroupNorm(2, 8)
        self.seq = nn.Linear(4, 5)
        self.head = nn.Linear(8 * 4 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.norm(self.conv2(self.relu(self.conv(x)))))   # B x 8 x 4 x 4
        return self.head(self.seq(h.flatten(1, 2)).flatten(1))           # B x 32 x 5


def opacus_hooks(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """Per-sample norms, and the clipped sum for a bound (the median norm, so that some
    samples are clipped and some are not), as Opacus' hooks mode and DPOptimizer form
    them."""
    ref = copy.deepcopy(model)
    for m in ref.modules():   # Opacus' backward hooks forbid in-place ops after a layer
        if isinstance(m, nn.ReLU):
            m.inplace = False
    gsm = GradSampleModule(ref, loss_reduction="mean")
    nn.functional.cross_entropy(gsm(x), y).backward()
    params = [p for p in gsm.parameters() if p.requires_grad]
    norms = torch.stack([p.grad_sample.reshape(len(x), -1).norm(2, dim=-1) for p in params],
                        dim=1).norm(2, dim=1)
    max_norm = float(norms.median())
    c = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    sums = [torch.einsum("i,i...", c, p.grad_sample) for p in params]
    gsm._close()
    return norms, sums, max_norm


def bk(model: nn.Module, x: torch.Tensor, y: torch.Tensor, max_norm: float):
    keeper = BookKeeper(model)
    losses = nn.functional.cross_entropy(keeper.forward(model, x), y, reduction="none")
    norms = keeper.clip_and_sum(losses, max_norm)
    keeper.remove()
    return norms, [p.grad for p in model.parameters() if p.requires_grad]


def assert_same(model, x, y):
    ref_norms, ref_sums, max_norm = opacus_hooks(model, x, y)
    norms, sums = bk(model, x, y, max_norm)
    assert torch.allclose(norms, ref_norms, rtol=1e-4, atol=1e-6)
    assert bool((norms > max_norm).any()) and bool((norms < max_norm).any())  # both branches
    assert len(sums) == len(ref_sums)
    for got, ref in zip(sums, ref_sums):
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name,shape", [("mnist-cnn", (1, 28, 28)), ("cifar-cnn", (3, 32, 32)),
                                        ("alexnet", (3, 32, 32)), ("mlp", (1, 8, 8))])
def test_norms_and_clipped_sum_equal_opacus_hooks(name, shape):
    torch.manual_seed(1)
    model = build_model(name, shape, 10)
    x, y = torch.randn(12, *shape), torch.randint(0, 10, (12,))
    assert_same(model, x, y)


@pytest.mark.parametrize("instantiate_max", [bookkeeping.INSTANTIATE_MAX, 0])
def test_ghost_norm_path_and_in_place_ops(monkeypatch, instantiate_max):
    """INSTANTIATE_MAX = 0 forces every conv onto the ghost norm (2) and the product (5)."""
    monkeypatch.setattr(bookkeeping, "INSTANTIATE_MAX", instantiate_max)
    torch.manual_seed(2)
    model = SeqNet()
    x, y = torch.randn(10, 2, 8, 8), torch.randint(0, 3, (10,))
    assert_same(model, x, y)


def test_unsupported_layers_are_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    with pytest.raises(UnsupportedLayer, match=r"layer '1' \(LayerNorm\)"):
        BookKeeper(model)
    with pytest.raises(UnsupportedLayer, match=r"'0' \(Conv2d\)"):
        BookKeeper(nn.Sequential(nn.Conv2d(4, 4, 3, groups=2)))
    frozen = nn.Sequential(nn.Linear(4, 2))
    frozen[0].bias.requires_grad_(False)
    with pytest.raises(UnsupportedLayer, match="partly frozen"):
        BookKeeper(frozen)
    # the trainer refuses before any training step, naming the layer
    data = ClientData(torch.randn(8, 4), torch.randint(0, 2, (8,)), torch.empty(0, 4),
                      torch.empty(0, dtype=torch.long), 2)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(UnsupportedLayer, match="LayerNorm"):
        train_dpsgd(model, data, RunConfig(opacus_mode="bk", batch_size=4), 1.0, gen, gen,
                    torch.device("cpu"))


def test_tied_layer_is_refused():
    lin = nn.Linear(3, 3)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    keeper = BookKeeper(model)
    with pytest.raises(UnsupportedLayer, match="twice"):
        keeper.forward(model, torch.randn(2, 3))


def _run(mode: str, sigma: float, model: nn.Module, data: ClientData):
    cfg = RunConfig(model="mnist-cnn", batch_size=16, lr=0.5, max_grad_norm=0.1,
                    opacus_mode=mode, local_epochs=2)
    m = copy.deepcopy(model)
    result = train_dpsgd(m, data, cfg, sigma, torch.Generator().manual_seed(5),
                         torch.Generator().manual_seed(6), torch.device("cpu"))
    return m, result


@pytest.mark.parametrize("sigma", [0.0, 1.3])
def test_training_equals_opacus_hooks_noise_batches_and_accounting(sigma):
    """Same Poisson batches (sampling generator), same N(0, sigma^2 C^2) draws (Opacus'
    optimizer with the same noise generator), same steps and rate: the trained models
    agree to float tolerance; with sigma > 0 the noise dominates the update, so a
    different noise law or scale would not."""
    torch.manual_seed(3)
    model = build_model("mnist-cnn", (1, 28, 28), 10)
    g = torch.Generator().manual_seed(4)
    data = ClientData(torch.randn(64, 1, 28, 28, generator=g),
                      torch.randint(0, 10, (64,), generator=g), torch.empty(0, 1, 28, 28),
                      torch.empty(0, dtype=torch.long), 10)
    ref, ref_result = _run("hooks", sigma, model, data)
    got, result = _run("bk", sigma, model, data)
    assert (result.steps, result.sample_rate) == (ref_result.steps, ref_result.sample_rate)
    assert result.steps == 8
    assert result.train_loss == pytest.approx(ref_result.train_loss, rel=1e-4)
    start = dict(model.named_parameters())
    for (name, p), q in zip(got.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name
        assert not torch.equal(p, start[name])
    # hooks are gone from the shared model afterwards
    assert not any(m._forward_hooks for m in got.modules())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_default_mode_takes_every_registered_model(name):
    """opacus-mode defaults to bk: every model dpfl can build must pass its layer check
    (with and without the channel-reduction layer on the CNNs)."""
    if name.startswith("resnet"):
        pytest.importorskip("torchvision")
    assert RunConfig().opacus_mode == "bk"
    shape = (1, 28, 28) if name in ("mlp", "mnist-cnn") else (3, 32, 32)
    assert check_model(build_model(name, shape, 10))
    if name not in ("mlp",):
        assert check_model(build_model(name, shape, 10, channel_reduction=0.5))
