"""The trust models' client halves: how a client releases what it trained.

- :class:`NoDpRelease` (``trainer=plain``): the update as trained, no guarantee.
- :class:`CentralRelease` (``trust=central``): the update clipped to the round's C for a
  trusted server, which adds the noise and charges every client (nothing spent here).
- :class:`LocalRelease` (``trust=local``): DP-SGD's output as is, or the update clipped
  and noised by the method's :meth:`~dpfl.method.ClientHalf.release_update`.
- :class:`DistributedRelease` (``trust=distributed``): an integer share of the clipped
  update with this client's part of the noise, for SecAgg+.

The client's one branch on ``trust`` is :func:`release_for`. A release that ``charges``
spends this client's budget: the client plans its event, checks the budget, trains, then
releases (``dpfl.apps.client``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dpfl.client.canary import canary_update, is_canary
from dpfl.client.job import TRAIN_LOSS, ClientJob
from dpfl.client.local_training import Trained
from dpfl.client.secure import UNCLIPPED_KEY, central_release, distributed_share
from dpfl.config import RunConfig
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.mechanisms.randomness import mechanism_generator
from dpfl.privacy.plan import EQUAL_WEIGHTS_CLAIM, noise_multiplier_for
from dpfl.privacy.trust import (
    distributed_noise_multiplier,
    distributed_planned_event,
    own_noise,
    share_variance,
)
from dpfl.tensors import flatten


@dataclass
class Released:
    """What leaves the client: ``arrays``, its ``metrics`` (besides the job's base ones),
    and either the ``event`` it spent (with the ``clip`` it used and the size it claims) or,
    for a release that spends nothing, its ``privacy`` record as is."""

    arrays: dict[str, torch.Tensor]
    metrics: dict[str, Any] = field(default_factory=dict)
    event: PrivacyEvent | None = None
    clip: float = 0.0
    num_examples: int = 0
    privacy: dict[str, Any] | None = None


class ClientRelease(Protocol):
    charges: bool

    def planned_event(self, job: ClientJob) -> PrivacyEvent: ...

    def warm(self, cfg: RunConfig, num_examples: int, shared_plan: bool) -> None:
        """Before round 1: compute what this release's first plan will ask for (a
        calibration, a memo check) so that the first instruction does not wait on it.
        ``shared_plan``: the method keeps the shared plan (no plan or sigma of its own)."""
        ...

    def release(self, job: ClientJob, trained: Trained, planned: PrivacyEvent | None,
                state_bytes: int) -> Released: ...


def _update_release_inputs(job: ClientJob, trained: Trained
                           ) -> tuple[torch.Tensor, float, torch.Generator]:
    """What an update-level release works on: the flat update (an audit's canary client:
    its canary), the round's clip C and this client's noise generator (on the CPU, where
    the flat update lives; secret unless ``reproducible``)."""
    cfg = job.cfg
    return (canary_update(cfg, job.pid, flatten(trained.update)),
            job.plan.round_clip(cfg),
            mechanism_generator(cfg.reproducible, cfg.seed, job.pid, job.server_round))


class NoDpRelease:
    """``trainer=plain``: the trained update (an audit's canary client: its canary)."""

    charges = False

    def planned_event(self, job: ClientJob) -> PrivacyEvent:
        raise TypeError("a release without DP plans no event")

    def warm(self, cfg: RunConfig, num_examples: int, shared_plan: bool) -> None:
        pass

    def release(self, job: ClientJob, trained: Trained, planned: PrivacyEvent | None,
                state_bytes: int) -> Released:
        update = trained.update
        if is_canary(job.cfg, job.pid):
            update = job.as_state(canary_update(job.cfg, job.pid, flatten(update)))
        return Released(update, {"num-examples": job.num_examples, "epsilon": math.inf,
                                 "steps": trained.result.steps},
                        privacy={"mechanism": "none"})


class CentralRelease:
    """``trust=central``: clip to the round's C (the server's ``central-clip``) and send the
    clipped update with its within-C bit; the trusted server adds the noise and charges
    everyone. ``central-impl=flower`` (C = 0 here): Flower's wrapper clips on the server."""

    charges = False

    def planned_event(self, job: ClientJob) -> PrivacyEvent:
        raise TypeError("under trust=central the server plans and charges")

    def warm(self, cfg: RunConfig, num_examples: int, shared_plan: bool) -> None:
        pass

    def release(self, job: ClientJob, trained: Trained, planned: PrivacyEvent | None,
                state_bytes: int) -> Released:
        raw = flatten(trained.update)
        clip = float(job.config.get("central-clip", job.cfg.clip_norm))
        metrics: dict[str, Any] = {"node-state-bytes": state_bytes, "num-examples": 1,
                                   "steps": trained.result.steps}
        clipped = raw
        if clip > 0:
            clipped, metrics[UNCLIPPED_KEY] = central_release(raw, clip)
        return Released(job.as_state(clipped), metrics,
                        privacy={"mechanism": "none", "trust": "central", "clip": clip})


class LocalRelease:
    """``trust=local``: the client is the mechanism. DP-SGD's trained update is already
    the release; an update-level client clips and noises its update with the method's
    ``release_update`` and claims equal weights (its data set size is private there)."""

    charges = True

    def planned_event(self, job: ClientJob) -> PrivacyEvent:
        return job.plan.event_for(job.cfg, job.num_examples, job.server_round)

    def warm(self, cfg: RunConfig, num_examples: int, shared_plan: bool) -> None:
        """The shared plan's noise multiplier (calibrated once per process, its memo entry
        checked), when the method keeps the shared plan."""
        if shared_plan:
            noise_multiplier_for(cfg, num_examples)

    def release(self, job: ClientJob, trained: Trained, planned: PrivacyEvent | None,
                state_bytes: int) -> Released:
        if trained.event is not None:   # DP-SGD
            return Released(trained.update, trained.metrics, trained.event,
                            float(trained.clip or 0.0), job.num_examples)
        assert planned is not None
        cfg, half = job.cfg, job.half
        raw, clip, noise_rng = _update_release_inputs(job, trained)
        values = job.hooks.local_values
        local = {TRAIN_LOSS: trained.result.train_loss,
                 **(values(job.model, job.data) if values is not None else {})}
        noisy, event, metrics = half.release_update(cfg, job.config, raw, planned.sigma, clip,
                                                    noise_rng, job.server_round, local,
                                                    clip_fn=job.plan.clip_fn)
        return Released(job.as_state(noisy), metrics, event, clip, EQUAL_WEIGHTS_CLAIM)


class DistributedRelease:
    """``trust=distributed``: the clipped update as an integer share with this client's
    part of the noise (a method's own quantiser and noise when it has one), summed under
    SecAgg+; the event is the planned one (the sum's, charged to every client)."""

    charges = True

    def planned_event(self, job: ClientJob) -> PrivacyEvent:
        return distributed_planned_event(job.cfg, job.server_round, job.dim, job.nparts)

    def warm(self, cfg: RunConfig, num_examples: int, shared_plan: bool) -> None:
        pass   # its noise depends on the model's size, known with the first instruction

    def release(self, job: ClientJob, trained: Trained, planned: PrivacyEvent | None,
                state_bytes: int) -> Released:
        assert planned is not None
        cfg = job.cfg
        if job.pid == cfg.secagg_drop_partition:
            raise RuntimeError(f"secagg-drop-partition={job.pid}: dropping out of SecAgg+ "
                               "after sharing keys (fault injection)")
        raw, clip, noise_rng = _update_release_inputs(job, trained)
        n_min = int(job.config["secagg-n-min"])
        sigma = distributed_noise_multiplier(cfg, job.dim, job.nparts)
        own = own_noise(cfg)
        if own is not None:
            share = own.secure_share(cfg, raw, clip, sigma, n_min, noise_rng, job.server_round)
        else:
            share = distributed_share(raw, clip, cfg.secagg_scale,
                                      share_variance(sigma, cfg, n_min), noise_rng,
                                      cfg.secure_noise)
        return Released({"share": share}, {}, planned, clip, EQUAL_WEIGHTS_CLAIM)


_NO_DP, _CENTRAL = NoDpRelease(), CentralRelease()
_LOCAL, _DISTRIBUTED = LocalRelease(), DistributedRelease()


def release_for(cfg: RunConfig) -> ClientRelease:
    """The client half of ``cfg``'s trust model (no DP at all under ``trainer=plain``)."""
    if cfg.trainer == "plain":
        return _NO_DP
    return {"central": _CENTRAL, "local": _LOCAL, "distributed": _DISTRIBUTED}[cfg.trust]
