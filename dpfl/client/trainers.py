"""Local trainers: plain SGD, sample-level DP-SGD (Opacus), client-level update DP.

The math is in plain functions; the ClientApp (``dpfl.apps.client``) wires them to Flower.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dpfl.client.bookkeeping import BookKeeper
from dpfl.config import RunConfig
from dpfl.data import ClientData
from dpfl.logs import quiet_known_warnings
from dpfl.privacy.plan import steps_per_epoch

# Known, harmless warnings that would otherwise flood every round's log (torch 2.14 on
# Opacus' hooks, Opacus without secure_mode, its RDP order range): each by message, category
# and module (dpfl.logs.KNOWN_WARNINGS says why each is harmless); any other one shows.
quiet_known_warnings()


@dataclass
class TrainResult:
    """What local training produced."""

    num_examples: int
    train_loss: float
    steps: int           # optimizer steps taken (= accountant steps for DP-SGD)
    sample_rate: float   # Poisson sampling rate q (DP-SGD), else batch / n
    # DP-SGD with an unclipped count: the sum over steps of each step's noisy count of
    # per-sample gradients whose norm was <= the clip (:func:`joint_gradient_noise`)
    noisy_unclipped: float | None = None

    @property
    def unclipped_fraction(self) -> float | None:
        """The noisy fraction of unclipped per-sample gradients over the round: the summed
        noisy counts over steps x the expected batch size n q (Andrew, Thakkar, McMahan &
        Ramaswamy, "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021,
        at sample level). None without a count."""
        if self.noisy_unclipped is None:
            return None
        return self.noisy_unclipped / max(self.steps * self.num_examples * self.sample_rate,
                                          1e-12)


class BatchedTensors(Dataset):
    """(x, y) tensors that a DataLoader fetches a whole batch at a time (one gather per
    batch instead of one index per sample, then a stack): same batches, less overhead."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return [(self.x[idx], self.y[idx])]


def _first(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[0]


class _FixedLengthLoader(DataLoader):
    """A DataLoader that reports ``length`` batches: Opacus samples at 1 / len(loader), so
    this fixes DP-SGD's Poisson rate whatever the dataset's actual size."""

    def __init__(self, *args, length: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._length = int(length)

    def __len__(self) -> int:
        return self._length


def _loader(data: ClientData, batch_size: int, generator: torch.Generator,
            length: int | None = None) -> DataLoader:
    dataset = BatchedTensors(data.x_train, data.y_train)
    if length is not None:
        return _FixedLengthLoader(dataset, batch_size=batch_size, shuffle=True,
                                  generator=generator, collate_fn=_first, length=length)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator,
                      collate_fn=_first)


def _optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)


PostStep = Callable[[nn.Module, float], None]
# A gradient transform between backward and the optimizer step (e.g. per-iteration
# clipping, sparsification); only for local training whose release is privatised later.
PreStep = Callable[[nn.Module], None]
# One whole local step (forward, backward, optimizer step) returning the batch loss (e.g.
# sharpness-aware minimisation's two passes).
LocalStep = Callable[[nn.Module, torch.optim.Optimizer, nn.Module, torch.Tensor,
                      torch.Tensor], torch.Tensor]


class WeightPerturbation(Protocol):
    """DP-SGD: a perturbation of the weights at which each step's per-sample gradients are
    taken (e.g. sharpness-aware training), built from public or already-released values
    only (the previous steps' noisy gradients): ``apply`` before the step's forward pass,
    ``restore`` after its backward pass (the optimizer then steps from the unperturbed
    weights), ``observe`` after the step (``p.grad`` then holds the step's noised
    gradient)."""

    def apply(self, model: nn.Module) -> None: ...

    def restore(self, model: nn.Module) -> None: ...

    def observe(self, model: nn.Module) -> None: ...


def joint_gradient_noise(sigma: float, count_std: float) -> float:
    """The gradient's noise multiplier sigma_g when each DP-SGD step also releases a count
    of sensitivity 1 (add/remove one example changes the clipped sum by at most C and the
    count by at most 1) with noise std ``count_std``, such that the pair is one Gaussian
    mechanism of multiplier sigma: sigma_g^-2 + count_std^-2 = sigma^-2 (Andrew et al.
    2021, Sec. 3). Its subsampled, composed privacy is then exactly DP-SGD's at sigma."""
    rest = sigma ** -2 - count_std ** -2
    if not (math.isfinite(rest) and rest > 0):
        raise ValueError(f"count noise std {count_std:g} must exceed sigma {sigma:g}")
    return rest ** -0.5


# local SGD steps from which channels-last pays for converting the model there and back
CHANNELS_LAST_MIN_STEPS = 2


def channels_last_pays(model: nn.Module, x: torch.Tensor, device: torch.device,
                       steps: int = CHANNELS_LAST_MIN_STEPS) -> bool:
    """Whether local SGD runs in channels-last layout: image (4-D) inputs into a model with
    2-D convolutions, on a CPU, for at least :data:`CHANNELS_LAST_MIN_STEPS` ``steps``.
    Measured on this 2-core machine (one thread): a client of the MNIST CNN (54 examples,
    batches of 16: 4 steps) trained in 10.5 ms contiguous and 7.9 ms channels-last, the
    same updates to float rounding (tests/test_local_training_layout.py); a one-step client
    (6 examples) was slower channels-last (the two conversions cost more than one step
    gains). Not measured on CUDA, so not used there."""
    return (device.type == "cpu" and x.dim() == 4 and steps >= CHANNELS_LAST_MIN_STEPS
            and any(isinstance(m, nn.Conv2d) for m in model.modules()))


def to_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` on ``device`` (``Module.to`` walks every submodule even when nothing
    moves: skipped then)."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.device != device for t in tensors):
        model.to(device)
    return model


@contextmanager
def memory_layout(model: nn.Module, layout: torch.memory_format | None) -> Iterator[None]:
    """``model``'s parameters in ``layout`` inside the block (None: untouched), contiguous
    again after it, so that flattening them (the update, its clip, its noise) sees the
    usual layout. The Parameters stay the same objects: an optimizer built before keeps
    them."""
    if layout is None:
        yield
        return
    model.to(memory_format=layout)
    try:
        yield
    finally:
        model.to(memory_format=torch.contiguous_format)


def sgd_step(model: nn.Module, opt: torch.optim.Optimizer, criterion: nn.Module,
             x: torch.Tensor, y: torch.Tensor, pre_step: PreStep | None = None
             ) -> torch.Tensor:
    """One plain local step: forward, backward, ``pre_step`` on the gradients, step."""
    opt.zero_grad(set_to_none=True)
    loss = criterion(model(x), y)
    loss.backward()
    if pre_step is not None:
        pre_step(model)
    opt.step()
    return loss


def train_plain(model: nn.Module, data: ClientData, cfg: RunConfig, seed: int,
                device: torch.device, post_step: PostStep | None = None,
                pre_step: PreStep | None = None, step: LocalStep | None = None
                ) -> TrainResult:
    """Local SGD without per-sample DP for ``local-epochs`` epochs (the non-private
    trainer, and the local half of client-level update DP, whose noise is added to the
    whole update afterwards). ``pre_step(model)`` transforms the gradients before each
    optimizer step; ``step`` replaces the whole step; ``post_step(model, lr)`` runs after
    every step (a method's data-independent correction)."""
    if pre_step is not None and step is not None:
        raise ValueError("give pre_step or step, not both")
    to_device(model, device).train()
    opt = _optimizer(model, cfg)
    criterion = nn.CrossEntropyLoss()
    loader = _loader(data, cfg.batch_size, torch.Generator().manual_seed(seed))
    total, count, steps = 0.0, 0, 0
    planned = cfg.local_epochs * len(loader)
    layout = (torch.channels_last if pre_step is None and step is None and post_step is None
              and channels_last_pays(model, data.x_train, device, planned) else None)
    with memory_layout(model, layout):
        for _ in range(cfg.local_epochs):
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                if layout is not None:
                    x = x.contiguous(memory_format=layout)
                if step is not None:
                    loss = step(model, opt, criterion, x, y)
                else:
                    loss = sgd_step(model, opt, criterion, x, y, pre_step)
                if post_step is not None:
                    post_step(model, cfg.lr)
                total += loss.item() * len(y)
                count += len(y)
                steps += 1
    n = len(data.y_train)
    return TrainResult(n, total / max(count, 1), steps, min(1.0, cfg.batch_size / n))


def train_dpsgd(model: nn.Module, data: ClientData, cfg: RunConfig, noise_multiplier: float,
                sampling_rng: torch.Generator, noise_rng: torch.Generator, device: torch.device,
                post_step: PostStep | None = None, public_examples: int | None = None,
                clip: float | None = None, noisy_grad: PreStep | None = None,
                perturb: WeightPerturbation | None = None, count_std: float = 0.0
                ) -> TrainResult:
    """Sample-level DP-SGD with Opacus: Poisson sampling, per-sample clipping to
    ``max-grad-norm``, Gaussian noise ``noise_multiplier * max-grad-norm``.
    ``opacus-mode`` picks how the clipped sum is formed: Opacus' ``ghost``, ``hooks``,
    ``functorch``, ``ew``, or ``bk`` (book-keeping, :mod:`dpfl.client.bookkeeping`: one
    backward pass; Opacus' ghost-mode optimizer, loader and accountant).

    ``sampling_rng`` (CPU) draws the Poisson batches and ``noise_rng`` (on ``device``) the
    noise: both are part of the mechanism and must be secret
    (:func:`dpfl.privacy.mechanisms.randomness.mechanism_generator`).

    ``post_step(model, lr)`` runs after every DP step: it may only use public or
    already-released values (the model itself, the global model, control variates), so it
    is post-processing and costs no privacy (a method's data-independent correction).

    ``public_examples``: sample at the rate of that many examples (the public partition
    size) although ``data`` holds more (an audit run's canary examples): the planned rate
    and steps stay those of the public size.

    ``clip``: the per-sample clip norm C (default ``max-grad-norm``; a method that adapts
    it per round passes the round's). ``noisy_grad(model)`` transforms each step's noised
    gradient (``p.grad`` after Opacus' noise) before the optimizer applies it, and
    ``perturb`` moves the weights at which the per-sample gradients are taken
    (:class:`WeightPerturbation`): both see only released or public values, so they are
    post-processing. ``count_std`` > 0 (book-keeping mode only): every step also releases
    its count of per-sample gradients with norm <= C plus N(0, count_std^2) noise, jointly
    with the gradient, whose noise multiplier is raised to
    :func:`joint_gradient_noise` so the pair costs DP-SGD's step at ``noise_multiplier``;
    the sum of the noisy counts is returned (``noisy_unclipped``).

    ``model``'s parameters are trained in place (Opacus wraps, the module is shared).
    The step count is read from the Opacus accountant attached to the optimizer.
    """
    from opacus import PrivacyEngine

    # book-keeping clipping (opacus-mode=bk) keeps everything of Opacus' ghost mode but its
    # two backward passes: same optimizer (noise, scaling), loader and accountant
    bk = cfg.opacus_mode == "bk"
    if count_std > 0 and not bk:
        raise ValueError("an unclipped count needs opacus-mode=bk (its per-sample norms)")
    clip = cfg.max_grad_norm if clip is None else float(clip)
    gradient_noise = (joint_gradient_noise(noise_multiplier, count_std) if count_std > 0
                      else noise_multiplier)
    mode = "ghost" if bk else cfg.opacus_mode
    keeper = BookKeeper(model) if bk else None   # refuses unsupported layers up front
    model.to(device).train()
    engine = PrivacyEngine(accountant="rdp")
    criterion = nn.CrossEntropyLoss()
    made = engine.make_private(
        module=model, optimizer=_optimizer(model, cfg), criterion=criterion,
        data_loader=_loader(data, cfg.batch_size, sampling_rng,
                            None if public_examples is None else
                            steps_per_epoch(public_examples, cfg.batch_size)),
        noise_multiplier=gradient_noise, max_grad_norm=clip,
        poisson_sampling=True, grad_sample_mode=mode, noise_generator=noise_rng,
    )
    if mode == "ghost":
        dp_model, opt, dp_criterion, loader = made
    else:
        (dp_model, opt, loader), dp_criterion = made, criterion
    if keeper is not None:
        dp_model.remove_hooks()  # BK forms the norms and the clipped sum itself
        per_sample_loss = nn.CrossEntropyLoss(reduction="none")
    sample_rate = float(loader.sample_rate)
    total, count = 0.0, 0
    counts = torch.zeros((), dtype=torch.float64, device=device) if count_std > 0 else None

    def step() -> None:  # the optimizer step, with the noised gradient's transform
        if noisy_grad is None:
            opt.step()
        elif opt.pre_step():   # Opacus: clip, accumulate, add noise, scale into p.grad
            noisy_grad(model)
            opt.original_optimizer.step()
        if perturb is not None:
            perturb.observe(model)
        if post_step is not None:
            post_step(model, cfg.lr)

    def add_count(unclipped: int) -> None:
        counts.add_(unclipped + count_std * torch.randn(
            (), generator=noise_rng, device=device, dtype=torch.float64))

    with _removed_after(keeper):
        for _ in range(cfg.local_epochs):
            for x, y in loader:
                opt.zero_grad(set_to_none=True)
                if len(y) == 0:  # an empty Poisson batch still is a (noise-only) step
                    _zero_gradients(model, mode)
                    if counts is not None:
                        add_count(0)
                    step()
                    continue
                x, y = x.to(device), y.to(device)
                if perturb is not None:
                    perturb.apply(model)
                if keeper is not None:
                    losses = per_sample_loss(keeper.forward(model, x), y)
                    norms = keeper.clip_and_sum(losses, clip)  # p.grad = clipped sum
                    loss = losses.detach().mean()
                    if counts is not None:
                        add_count(int((norms <= clip).sum()))
                else:
                    loss = dp_criterion(dp_model(x), y)
                    loss.backward()
                if perturb is not None:
                    perturb.restore(model)
                step()
                total += float(loss.item()) * len(y)
                count += len(y)
    steps = sum(n for _, _, n in engine.accountant.history)
    return TrainResult(len(data.y_train), total / max(count, 1), steps, sample_rate,
                       None if counts is None else float(counts))


@contextmanager
def _removed_after(keeper: BookKeeper | None) -> Iterator[None]:
    """Detach book-keeping hooks from the (shared) model however training ends."""
    try:
        yield
    finally:
        if keeper is not None:
            keeper.remove()


def _zero_gradients(model: nn.Module, mode: str) -> None:
    """Before the DP-SGD step of an empty Poisson batch: a zero clipped-gradient sum, so
    the step applies the noise N(0, sigma^2 C^2) divided by the expected batch size, as
    Opacus would. (Without a backward pass Opacus finds no per-sample gradients and
    raises.)"""
    for p in model.parameters():
        if not p.requires_grad:
            continue
        p.grad = torch.zeros_like(p)
        if mode != "ghost":  # per-sample modes clip p.grad_sample: give it zero rows
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
