"""The trainers as objects: ``plain`` (no DP), ``dpsgd`` (Opacus, sample level) and
``update-dp`` (plain local training whose update a trust model then releases with noise).

Each has one ``train(job, sigma) -> Trained``: the job's model is trained in place; the
result holds the update (trained - received, per tensor) and, for a trainer that is itself
the mechanism (DP-SGD), the event it released. The one branch on ``trainer`` of the client
is :func:`trainer_for`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from dpfl.client.canary import with_canary_examples
from dpfl.client.job import ClientJob
from dpfl.client.trainers import TrainResult, train_dpsgd, train_plain
from dpfl.config import RunConfig
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.mechanisms.randomness import mechanism_generator
from dpfl.privacy.mechanisms.release import DpsgdRelease
from dpfl.privacy.plan import UNCLIPPED_FRACTION
from dpfl.tensors import flatten


@dataclass
class Trained:
    """One client's local training: ``update`` per tensor; ``event`` the release the
    training itself made (DP-SGD; None when a trust model releases the update); ``clip``
    the per-sample bound it used (DP-SGD); ``metrics`` released with the update."""

    result: TrainResult
    update: dict[str, torch.Tensor]
    event: PrivacyEvent | None = None
    clip: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Trainer(Protocol):
    def train(self, job: ClientJob, sigma: float | None = None) -> Trained: ...

    def warm(self) -> None:
        """Before round 1: import what the first training would (so that it does not)."""
        ...


class PlainTrainer:
    """SGD with the method's local-step hooks; no noise (``trainer=plain``)."""

    def train(self, job: ClientJob, sigma: float | None = None) -> Trained:
        hooks = job.hooks
        result = train_plain(job.model, job.data, job.cfg, job.shuffle_seed, job.device,
                             hooks.post_step, hooks.pre_step, hooks.step)
        return Trained(result, job.update())

    def warm(self) -> None:
        pass


class UpdateDpTrainer(PlainTrainer):
    """``trainer=update-dp``: plain local training; the trust model clips and noises the
    whole update. DP-SGD's hooks (a noised gradient's transform, perturbed weights) have no
    meaning here."""

    def train(self, job: ClientJob, sigma: float | None = None) -> Trained:
        if job.hooks.noisy_grad is not None or job.hooks.perturb is not None:
            raise RuntimeError(f"strategy {job.cfg.strategy!r} sets DP-SGD-only hooks "
                               f"(noisy_grad, perturb) under trainer={job.cfg.trainer}")
        return super().train(job, sigma)


class DpSgdTrainer:
    """``trainer=dpsgd``: Opacus DP-SGD at noise multiplier ``sigma`` (Poisson sampling,
    per-sample clipping to the method's C); the trained update is the release, and the
    method's post-processing of it is free."""

    def warm(self) -> None:
        """Opacus (~0.9 s) and torch._dynamo (its optimizers' first use, ~0.5 s)."""
        import opacus  # noqa: F401
        import torch._dynamo  # noqa: F401

    def train(self, job: ClientJob, sigma: float | None = None) -> Trained:
        cfg, hooks = job.cfg, job.hooks
        if sigma is None:
            raise ValueError("DP-SGD needs the round's noise multiplier")
        if hooks.pre_step is not None or hooks.step is not None:
            raise RuntimeError(f"strategy {cfg.strategy!r} changes the local step, which "
                               "Opacus owns under trainer=dpsgd")
        noise_rng = mechanism_generator(cfg.reproducible, cfg.seed, job.pid, job.server_round,
                                        job.device)
        sampling_rng = (noise_rng if job.device.type == "cpu" else
                        mechanism_generator(cfg.reproducible, cfg.seed, job.pid,
                                            job.server_round))
        clip = job.plan.round_clip(cfg)
        result = train_dpsgd(job.model, with_canary_examples(cfg, job.pid, job.nparts, job.data),
                             cfg, sigma, sampling_rng, noise_rng, job.device, hooks.post_step,
                             public_examples=job.num_examples, clip=clip,
                             noisy_grad=hooks.noisy_grad, perturb=hooks.perturb,
                             count_std=job.plan.count_std)
        del noise_rng, sampling_rng
        event = DpsgdRelease(sigma, result.sample_rate, result.steps).event(job.server_round)
        metrics = ({} if result.unclipped_fraction is None   # released with the gradient
                   else {UNCLIPPED_FRACTION: result.unclipped_fraction})
        update = job.update()
        if job.post_process is not None:  # sees only the DP-SGD output: post-processing
            update = job.as_state(job.post_process(flatten(update)))
        return Trained(result, update, event, clip, metrics)


TRAINERS: dict[str, Trainer] = {"plain": PlainTrainer(), "update-dp": UpdateDpTrainer(),
                                "dpsgd": DpSgdTrainer()}


def trainer_for(cfg: RunConfig) -> Trainer:
    return TRAINERS[cfg.trainer]
