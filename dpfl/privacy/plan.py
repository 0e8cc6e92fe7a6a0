"""The planned privacy release of one client in one round, computed from public values.

Client and server compute the same plan independently: the client to check its budget
before it trains, the server to check what the client says it did and to charge the
planned cost when a reply misreports it (a received update was released either way).

A plan is a :class:`~dpfl.privacy.accounting.events.PrivacyEvent`:

- ``trainer=dpsgd`` (sample level, add/remove, Poisson): sigma, q = 1 / ceil(n / B),
  steps = E ceil(n / B), where n is the client's training-set size (public, as in Opacus).
- ``trainer=update-dp`` (client level, noise added on the client): one Gaussian release of
  the update clipped to C, accounted under **replace-one** (sensitivity 2C): the server sees
  each client's message, so the natural neighbouring datasets are "this client's data" vs
  "any other data of this client", not "present" vs "absent". Add/remove belongs to trust
  models that hide presence (central or distributed noise with client sampling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from dpfl.config import RunConfig
from dpfl.privacy.accounting.accountants import calibrate_dpsgd_noise, calibrate_noise
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.record import decode_event, encode_event

if TYPE_CHECKING:
    import torch

# a client-level update's clipping other than L2 norm clipping: (update, C) -> clipped, with
# norm <= C (e.g. AADP-FL's longitudinal clip)
UpdateClip = Callable[["torch.Tensor", float], "torch.Tensor"]

UPDATE_DP_RELATION = "replace-one"
# what a client-level (update-dp) client reports as ``num-examples``: its data set size is
# private there, so every update weighs the same and the claim is this constant, by protocol
# (the server checks it; anything else is a misreport)
EQUAL_WEIGHTS_CLAIM = 1

# DP-SGD: the round's noisy fraction of unclipped per-sample gradients, released jointly
# with the gradient (a method's ReleasePlan.count_std > 0)
UNCLIPPED_FRACTION = "dpsgd-unclipped-fraction"


@dataclass(frozen=True)
class PlanInputs:
    """The public values one client's release in one round is planned from. Both halves
    hold them: the client from its instruction, the server from what it sent."""

    server_round: int
    config: Mapping[str, Any]      # the round's shared config (the strategy's round_config)
    partition_id: int | None       # None: a sender whose partition is not known yet
    num_examples: int | None       # its public training-set size (None: unknown)
    num_params: int                # trainable parameters of the model


@dataclass(frozen=True)
class ReleasePlan:
    """What a method sets of a round's release; None (or the neutral value) keeps the
    run's shared plan. Client and server compute it with the same function
    (:attr:`dpfl.method.Method.plan`) from the same :class:`PlanInputs`, so the two halves
    agree by construction, not by convention.

    - ``sigma``: the round's noise multiplier (e.g. AADP-FL's sigma at eps_i^t);
    - ``clip``: the round's clip norm: of the update (update DP) or per sample (DP-SGD),
      e.g. FedCompDP's adapted C_t;
    - ``event``: a release the shared Gaussian/DP-SGD plan cannot express (e.g. a
      pure-epsilon Laplace or sparse-vector release);
    - ``noise_scale``: the released update's noise std over sigma C (> 1 when scalars share
      the release), for the server's norm bound;
    - ``count_std``: DP-SGD: the noise std of the per-step unclipped count released with
      the gradient (0: none);
    - ``clip_fn``: update DP: the update's clipping when it is not L2 norm clipping (its
      output norm must be <= C; e.g. AADP-FL's longitudinal clip)."""

    sigma: float | None = None
    clip: float | None = None
    event: PrivacyEvent | None = None
    noise_scale: float = 1.0
    count_std: float = 0.0
    clip_fn: UpdateClip | None = None

    def round_clip(self, cfg: RunConfig) -> float:
        """The clip C of the round: the method's, else ``max-grad-norm`` (DP-SGD's per-sample
        clip) or ``clip-norm`` (update DP)."""
        if self.clip is not None:
            return self.clip
        return cfg.max_grad_norm if cfg.trainer == "dpsgd" else cfg.clip_norm

    def event_for(self, cfg: RunConfig, num_examples: int, server_round: int) -> PrivacyEvent:
        """The event a client of ``num_examples`` spends under local DP: the method's own,
        else the shared plan at this plan's sigma."""
        if self.event is not None:
            return self.event
        return planned_event(cfg, num_examples, server_round, self.sigma)


PlanFn = Callable[[RunConfig, PlanInputs], ReleasePlan]
SHARED_PLAN = ReleasePlan()


def shared_plan(cfg: RunConfig, inputs: PlanInputs) -> ReleasePlan:
    """The plan of a method that sets nothing of its own: the run's sigma and clip."""
    return SHARED_PLAN


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """Batches per epoch; Opacus' Poisson loader uses q = 1 / this."""
    return max(1, math.ceil(num_examples / batch_size))


def dpsgd_sample_rate(num_examples: int, batch_size: int) -> float:
    """Opacus' Poisson sampling rate: 1 / len(data_loader)."""
    return 1.0 / steps_per_epoch(num_examples, batch_size)


def planned_dpsgd_steps(num_examples: int, cfg: RunConfig) -> int:
    """DP-SGD steps of one round (local epochs x batches per epoch)."""
    return cfg.local_epochs * steps_per_epoch(num_examples, cfg.batch_size)


def noise_multiplier_for(cfg: RunConfig, num_examples: int) -> float:
    """sigma: the configured one, or the smallest that keeps the client at
    ``target-epsilon`` after ``num-rounds`` rounds of participation."""
    if cfg.noise_multiplier > 0:
        return cfg.noise_multiplier
    if cfg.trainer == "dpsgd":
        steps = cfg.num_rounds * planned_dpsgd_steps(num_examples, cfg)
        return calibrate_dpsgd_noise(cfg.target_epsilon, cfg.delta,
                                     dpsgd_sample_rate(num_examples, cfg.batch_size), steps,
                                     cfg.accountant)
    return calibrate_noise(cfg.target_epsilon, cfg.delta, cfg.num_rounds,
                           accountant=cfg.accountant, relation=UPDATE_DP_RELATION)


def planned_event(cfg: RunConfig, num_examples: int, server_round: int,
                  sigma: float | None = None) -> PrivacyEvent:
    """The release a client with ``num_examples`` training samples makes in a round
    (``sigma`` overrides the run's noise multiplier, e.g. a method's per-round budget)."""
    if sigma is None:
        sigma = noise_multiplier_for(cfg, num_examples)
    if cfg.trainer == "dpsgd":
        return PrivacyEvent.dpsgd(server_round, sigma,
                                  dpsgd_sample_rate(num_examples, cfg.batch_size),
                                  planned_dpsgd_steps(num_examples, cfg))
    return PrivacyEvent.gaussian(server_round, sigma, relation=UPDATE_DP_RELATION)


def plan_problem(reported: PrivacyEvent, plan: PrivacyEvent, rtol: float = 1e-9) -> str | None:
    """Why a reported event differs from the plan (None when it matches)."""
    if reported.mechanism != plan.mechanism or reported.relation != plan.relation:
        return (f"mechanism {reported.mechanism}/{reported.relation} differs from the plan "
                f"{plan.mechanism}/{plan.relation}")
    for name in ("sigma", "rate", "epsilon"):
        a, b = float(getattr(reported, name)), float(getattr(plan, name))
        if abs(a - b) > rtol * max(abs(a), abs(b), 1e-300):
            return f"{name} {a:.6g} differs from the plan {b:.6g}"
    if int(reported.steps) != int(plan.steps) or int(reported.round) != int(plan.round):
        return (f"steps/round {reported.steps}/{reported.round} differ from the plan "
                f"{plan.steps}/{plan.round}")
    return None


def gaussian_norm_bound(clip_norm: float, noise_multiplier: float, dim: int,
                        tail: float = 10.0) -> float:
    """A bound the norm of a clipped-and-noised update (clip C, noise N(0, sigma^2 C^2 I_d))
    exceeds with probability < exp(-tail^2 / 2): C + sigma C (sqrt(d) + tail) (Gaussian norm
    concentration). The server rejects updates above it."""
    return clip_norm + noise_multiplier * clip_norm * (math.sqrt(dim) + tail)


# Per-step probability that an honest client's Poisson batch is larger than the bound uses.
BATCH_TAIL = 1e-12


def dpsgd_norm_bound(cfg: RunConfig, num_examples: int, noise_multiplier: float, steps: int,
                     dim: int, tail: float = 10.0, clip: float | None = None) -> float:
    """A bound on the L2 norm of an honest DP-SGD client's round update (trained minus
    received model) that it exceeds with negligible probability; the server rejects
    updates above it.

    Each of the ``steps`` Opacus steps moves the weights by lr g_t with
    g_t = (sum of |B_t| per-sample gradients clipped to C + N(0, sigma^2 C^2 I_d)) / E[B],
    E[B] = floor(n q) (Opacus' expected batch size, q = 1 / ceil(n / B)), so
    ||g_t|| <= (|B_t| C + sigma C (sqrt(d) + tail)) / E[B], where |B_t| ~ Binomial(n, q)
    is bounded by its (1 - 1e-12) quantile and the Gaussian norm by sqrt(d) + tail
    (exceeded w.p. < exp(-tail^2 / 2)). Momentum mu scales the sum by at most 1 / (1 - mu).
    Audit canary examples (at most ``audit-canaries`` per client) count towards n. ``clip``:
    the round's per-sample C when the method adapts it (default ``max-grad-norm``);
    ``noise_multiplier`` is the gradient's (raised when a count shares the release)."""
    from scipy.stats import binom

    n = num_examples + cfg.audit_canaries
    q = dpsgd_sample_rate(num_examples, cfg.batch_size)
    expected = max(1, int(n * q))
    batch_max = float(binom.isf(BATCH_TAIL, n, q)) + 1.0
    clip = cfg.max_grad_norm if clip is None else clip
    per_step = (batch_max * clip + noise_multiplier * clip * (math.sqrt(dim) + tail)) / expected
    return cfg.lr * steps * per_step / (1.0 - cfg.momentum)


PLAN_PREFIX = "plan-"


def plan_to_record(event: PrivacyEvent) -> dict[str, object]:
    """The plan as ``plan-*`` keys of a round's ConfigRecord (what the server asks for)."""
    return encode_event(event, PLAN_PREFIX)


def plan_from_record(config: Mapping[str, Any], server_round: int) -> PrivacyEvent | None:
    """The plan the server sent in a ConfigRecord (None when it sent none; ValueError when
    it is incomplete)."""
    if f"{PLAN_PREFIX}mechanism" not in config:
        return None
    return decode_event(config, PLAN_PREFIX, server_round)
