"""Trust models: who adds the noise, who must be trusted, what each party sees, and what
one round costs every client (``trust`` run-config key).

- ``local`` (dpfl's default): every client clips and noises its own update; the server sees
  each noisy update and who sent it. Client-level, replace-one, no amplification.
- ``central``: clients clip (C fixed, or adapted by Andrew, Thakkar, McMahan & Ramaswamy,
  "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021) and send the
  clipped update; a TRUSTED server samples every client independently with probability q
  (Poisson, secret randomness), adds N(0, sigma^2 C^2) to the sum and divides by the
  expected count q N (McMahan, Ramage, Talwar & Zhang, ICLR 2018). Only the noisy models
  leave the server, and they hide whether a client took part: add-remove of a client's
  whole data, amplified by sampling — one ``PoissonSampledDpEvent(q, Gaussian(sigma))``
  per round charged to EVERY client, sampled or not (plus the clipped count's
  ``PoissonSampledDpEvent(q, Gaussian(2 sigma_b))`` when C adapts).
- ``distributed``: clients clip, scale by s, round at random to integers and add a Skellam
  share of variance mu / n_min (``dpfl.privacy.mechanisms.skellam``); Flower's SecAgg+ masks every
  share so the server learns only the sum, which carries Sk(>= mu) whenever at least n_min
  clients survive (a round with fewer is discarded: nothing is released). The server knows
  who took part, so there is no amplification and the relation is replace-one; each
  participant is charged one ``skellam`` event per round it sends a masked vector.
  ``secure-noise=ddgauss`` replaces the Skellam share by a discrete Gaussian share
  N_Z(0, mu / n_min) (``dpfl.privacy.mechanisms.ddgauss``; Kairouz, Liu & Steinke 2021), charged one
  ``ddgauss`` event (the paper's bound for a SUM of discrete Gaussians) per round.
  A method with its own integer noise (cpSGD's quantiser and binomial) carries it in its
  run-config parameters (:func:`own_noise`: ``secure_event``, ``secure_sigma``,
  ``secure_share``, ``secure_mean``, ``secure_check``, ``secure_scope``), which then
  replace the shared share, event, calibration, dequantisation and range check.
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from dpfl.config import ConfigError, RunConfig
from dpfl.privacy.accounting.accountants import SIGMA_MAX, bisect_sigma, calibrate_events
from dpfl.privacy.accounting.events import PrivacyEvent, history_epsilon
from dpfl.privacy.mechanisms import ddgauss, skellam

if TYPE_CHECKING:
    import torch

CENTRAL_RELATION = "add-remove"
# central + adaptive clipping: the client's bit 1[||Delta|| <= C] in its reply metrics
UNCLIPPED_KEY = "clip-unclipped"
DISTRIBUTED_RELATION = "replace-one"
# Flower's central wrappers sample a fixed number of clients: analysed under replace-one
FLOWER_RELATION = "replace-one"
# the probability that a SecAgg+ share overflows its integer range must stay below this
# fraction of delta (the run is refused at start otherwise)
OVERFLOW_SHARE_OF_DELTA = 1e-3
# SecAgg+ modulus (Flower's default) and the int32 quantised range of its client mod
SECAGG_MODULUS = 1 << 32


def expected_clients(cfg: RunConfig, num_clients: int) -> float:
    """q N: the fixed denominator of central DP-FedAvg and the count's m."""
    return cfg.fraction_train * num_clients


def count_stddev(cfg: RunConfig, num_clients: int) -> float:
    """sigma_b of the clipped count: ``clip-count-stddev``, or m / 20 (Andrew et al.)."""
    return cfg.clip_count_stddev or expected_clients(cfg, num_clients) / 20.0


def central_events(round_: int, sigma: float, q: float,
                   count_std: float | None = None) -> list[PrivacyEvent]:
    """One central round: the noisy sum (Gaussian sigma, Poisson rate q, add-remove) and,
    with adaptive clipping, the noisy clipped count (centred bits: sensitivity 1/2, so
    multiplier 2 sigma_b)."""
    events = [PrivacyEvent.gaussian(round_, sigma, rate=q, relation=CENTRAL_RELATION)]
    if count_std is not None:
        events.append(PrivacyEvent.gaussian(round_, 2.0 * count_std, rate=q,
                                            relation=CENTRAL_RELATION,
                                            mechanism="quantile-count"))
    return events


def _calibrate(events_for: Callable[[float], list[PrivacyEvent]], target: float,
               delta: float, accountant: str, rel_tol: float = 1e-3) -> float:
    """Smallest sigma (to ``rel_tol``) whose history ``events_for(sigma)`` meets target."""
    def eps(sigma: float) -> float:
        return history_epsilon(events_for(sigma), delta, accountant)

    lo, hi = 0.05, 1.0
    while eps(hi) > target:
        lo, hi = hi, 2.0 * hi
        if hi > SIGMA_MAX:
            raise ValueError(f"target epsilon unreachable with sigma <= {SIGMA_MAX:g}")
    while eps(lo) <= target and lo > 1e-4:
        hi, lo = lo, lo / 2.0
    return bisect_sigma(eps, lo, hi, target, rel_tol)


def central_noise_multiplier(cfg: RunConfig, num_clients: int) -> float:
    """sigma of the central sum: ``noise-multiplier``, or the smallest that keeps every
    client at ``target-epsilon`` after ``num-rounds`` rounds (count included)."""
    if cfg.noise_multiplier > 0:
        return cfg.noise_multiplier
    std = count_stddev(cfg, num_clients) if cfg.adaptive_clip else None
    if std is not None:
        count = dataclasses.replace(central_events(1, 1.0, cfg.fraction_train, std)[1],
                                    steps=cfg.num_rounds)
        eps = history_epsilon([count], cfg.delta, cfg.accountant)
        if eps >= cfg.target_epsilon:
            raise ConfigError(
                f"run-config key 'clip-count-stddev': the clipped count alone (std {std:.4g},"
                f" {cfg.num_rounds} rounds at q = {cfg.fraction_train:g}) costs epsilon "
                f"{eps:.4g} >= target-epsilon {cfg.target_epsilon:g}: raise it (Andrew et "
                "al. suggest expected clients per round / 20) or turn adaptive-clip off")
    return _calibrate_central(cfg.target_epsilon, cfg.delta, cfg.accountant, cfg.num_rounds,
                              cfg.fraction_train, std)


@lru_cache(maxsize=64)
def _calibrate_central(target: float, delta: float, accountant: str, rounds: int, q: float,
                       count_std: float | None) -> float:
    return calibrate_events(lambda s: [(e.key, rounds) for e in central_events(1, s, q,
                                                                              count_std)],
                            target, delta, accountant)


def secure_event(noise: str, round_: int, sigma: float, clip: float, scale: float, dim: int,
                 num_clients: int) -> PrivacyEvent:
    """One distributed round's charge for ``secure-noise`` ``noise`` (replace-one):
    :func:`dpfl.privacy.mechanisms.skellam.skellam_event` or :func:`dpfl.privacy.mechanisms.ddgauss.ddgauss_event`
    (its tau at n = ``num_clients``, an upper bound on n_min)."""
    if noise == "ddgauss":
        return ddgauss.ddgauss_event(round_, sigma, clip, scale, dim, DISTRIBUTED_RELATION,
                                     num_clients)
    return skellam.skellam_event(round_, sigma, clip, scale, dim, DISTRIBUTED_RELATION)


@runtime_checkable
class OwnSecureNoise(Protocol):
    """A method's own integer noise under SecAgg+ (:func:`own_noise`; cpSGD's quantiser and
    binomial, ``dpfl.methods.cpsgd``): what replaces the shared share, event, calibration,
    dequantisation, range check and scope text."""

    def secure_event(self, cfg: RunConfig, server_round: int, dim: int,
                     sigma: float) -> PrivacyEvent: ...

    def secure_sigma(self, cfg: RunConfig, dim: int) -> float: ...

    def secure_share(self, cfg: RunConfig, update: torch.Tensor, clip: float, sigma: float,
                     n_min: int, generator: torch.Generator,
                     server_round: int) -> torch.Tensor: ...

    def secure_mean(self, cfg: RunConfig, total: torch.Tensor, survivors: int, n_min: int,
                    dim: int, sigma: float, server_round: int) -> torch.Tensor: ...

    def secure_check(self, cfg: RunConfig, dim: int, sigma: float, sampled: int, n_min: int,
                     limit: int) -> float: ...

    def secure_scope(self, cfg: RunConfig) -> tuple[str, str]: ...


def own_noise(cfg: RunConfig) -> OwnSecureNoise | None:
    """The method's own secure-sum noise (its parameters, when the method declares
    ``own_secure_noise`` and they implement :class:`OwnSecureNoise`; the registry checks the
    two agree), or None: the shared ``secure-noise`` path."""
    return cfg.params if isinstance(cfg.params, OwnSecureNoise) else None


def distributed_noise_multiplier(cfg: RunConfig, dim: int, num_clients: int) -> float:
    """sigma of the secure sum (noise of variance mu = (sigma C s)^2): ``noise-multiplier``,
    or the smallest that keeps a client taking part in every round at ``target-epsilon``
    (``num_clients``: the federation's clients, which bounds DDGauss's tau)."""
    own = own_noise(cfg)
    if own is not None:
        return own.secure_sigma(cfg, dim)
    if cfg.noise_multiplier > 0:
        return cfg.noise_multiplier
    return _calibrate_distributed(cfg.target_epsilon, cfg.delta, cfg.accountant,
                                  cfg.num_rounds, cfg.clip_norm, cfg.secagg_scale, dim,
                                  cfg.secure_noise, num_clients)


@lru_cache(maxsize=64)
def _calibrate_distributed(target: float, delta: float, accountant: str, rounds: int,
                           clip: float, scale: float, dim: int, noise: str = "skellam",
                           num_clients: int = 2) -> float:
    return _calibrate(lambda s: [dataclasses.replace(
        secure_event(noise, 1, s, clip, scale, dim, num_clients), steps=rounds)],
        target, delta, accountant)


def distributed_planned_event(cfg: RunConfig, server_round: int, dim: int,
                              num_clients: int) -> PrivacyEvent:
    """What a client of a distributed round is charged (``dpfl.privacy.mechanisms.skellam`` or
    ``dpfl.privacy.mechanisms.ddgauss``, by ``secure-noise``; or the method's own, :func:`own_noise`)."""
    own = own_noise(cfg)
    if own is not None:
        return own.secure_event(cfg, server_round, dim,
                                distributed_noise_multiplier(cfg, dim, num_clients))
    return secure_event(cfg.secure_noise, server_round,
                        distributed_noise_multiplier(cfg, dim, num_clients), cfg.clip_norm,
                        cfg.secagg_scale, dim, num_clients)


def min_survivors(cfg: RunConfig, sampled: int) -> int:
    """n_min of a round with ``sampled`` clients (0 in the config: all of them)."""
    return cfg.secagg_min_survivors or sampled


def noise_shares(cfg: RunConfig, sampled: int) -> int:
    """h = n_min - t: the honest count the noise is split over (each share carries
    variance mu / h). A sum of >= n_min survivors of whom at most t = ``secagg-noiseless``
    omit their share still carries >= mu (Kairouz, Liu & Steinke 2021 calibrate to such a
    minimum honest count); with t = 0 a survivor that omits its noise leaves the sum with
    (h - 1) / h of it and the guarantee does not hold as stated."""
    return min_survivors(cfg, sampled) - cfg.secagg_noiseless


def share_variance(sigma: float, cfg: RunConfig, n_min: int) -> float:
    """mu_i = (sigma C s)^2 / n_min: the variance of each client's noise share."""
    return (sigma * cfg.clip_norm * cfg.secagg_scale) ** 2 / n_min


def share_limit(sampled: int) -> int:
    """c: every share coordinate must lie in [-c, c] so that Flower's quantiser maps it to
    an int32 exactly (target range 2c, one integer per unit) and the sum of ``sampled``
    shifted shares (each in [0, 2c]) stays below the 2^32 modulus."""
    return (SECAGG_MODULUS // (2 * (sampled + 1))) - 1


def check_overflow(cfg: RunConfig, sigma: float, dim: int, sampled: int, n_min: int) -> float:
    """The delta a run's SecAgg+ share overflow adds to the guarantee, after checking it is
    at most ``OVERFLOW_SHARE_OF_DELTA`` delta (ValueError otherwise: the guarantee would
    not hold as stated).

    A share coordinate outside [-c, c] wraps around the modulus: the sum released is then
    not the one accounted. With p the bound on one share (:func:`share_overflow`), the
    probability that ANY share of the run overflows is P <= p x ``sampled`` shares x
    ``num-rounds`` (union bound); the real mechanism differs from the accounted one only
    on that event, in both neighbouring worlds, so an (epsilon, delta) guarantee of the
    accounted one gives (epsilon, delta + (1 + e^epsilon) P) for the real one (epsilon:
    the budget, which bounds every client's). A method's own noise (:func:`own_noise`)
    makes its own check, whose extra delta it already pays inside delta: 0 added."""
    own = own_noise(cfg)
    if own is not None:
        own.secure_check(cfg, dim, sigma, sampled, n_min, share_limit(sampled))
        return 0.0
    p_run = min(1.0, share_overflow(cfg, sigma, dim, sampled, n_min) * sampled
                * cfg.num_rounds)
    added = overflow_delta(p_run, cfg.target_epsilon)
    if added > OVERFLOW_SHARE_OF_DELTA * cfg.delta:
        raise ValueError(f"a SecAgg+ share of {sampled} clients may overflow its integer "
                         f"range (probability <= {p_run:.3g} over {sampled} shares x "
                         f"{cfg.num_rounds} rounds, delta + {added:.3g} > "
                         f"{OVERFLOW_SHARE_OF_DELTA:g} delta): lower secagg-scale or the noise")
    return added


def overflow_delta(p_run: float, epsilon: float) -> float:
    """(1 + e^epsilon) P: the delta an event of probability P on which the released and the
    accounted mechanisms may differ adds to an epsilon-DP guarantee (inf when e^epsilon
    overflows a float)."""
    if p_run <= 0.0:
        return 0.0
    return p_run * (1.0 + math.exp(epsilon)) if epsilon < 700 else math.inf


def share_overflow(cfg: RunConfig, sigma: float, dim: int, sampled: int, n_min: int) -> float:
    """P(some coordinate of ONE share overflows [-c, c]) (a bound; ``secure-noise``'s)."""
    if cfg.secure_noise == "ddgauss" and share_variance(sigma, cfg, n_min) < 0.25:
        raise ValueError("a discrete Gaussian share needs variance >= 1/4 (Kairouz, Liu & "
                         "Steinke's sigma >= 1/2): raise secagg-scale")
    bound = ddgauss.overflow_bound if cfg.secure_noise == "ddgauss" else skellam.overflow_bound
    return bound(cfg.clip_norm, cfg.secagg_scale, share_variance(sigma, cfg, n_min), dim,
                 share_limit(sampled))


def trust_scope(cfg: RunConfig) -> str:
    """What the trust model assumes and what each party sees (for the guarantee)."""
    if cfg.trust == "central" and cfg.central_impl == "flower":
        return ("trust=central through Flower's DifferentialPrivacyServerSideFixedClipping "
                "around FedAvg (central-impl=flower): the server must be trusted — it sees "
                "every raw update and who sent it; it samples a fixed k = q N clients, clips "
                f"each update to C = {cfg.clip_norm:g} and adds N(0, (sigma C / k)^2) to the "
                "mean over k (missing replies count as zero updates, so the noise on the sum "
                "is sigma C whatever arrives); accounted as one Gaussian per round under "
                "replace-one with no amplification by sampling (an upper bound), every "
                "client charged every round")
    if cfg.trust == "central" and cfg.central_noise != "gaussian":
        return correlated_scope(cfg)
    if cfg.trust == "central":
        clip = ("C adapted each round towards the "
                f"{cfg.clip_target_quantile:g}-quantile of the update norms from a noisy "
                "clipped count (Andrew et al. 2021; the count is charged)"
                if cfg.adaptive_clip else f"C = {cfg.clip_norm:g}")
        return ("trust=central: the server must be trusted — it sees every clipped update "
                "and who sent it; clients are sampled by Poisson(q = "
                f"{cfg.fraction_train:g}) with the server's secret randomness and the server "
                "adds N(0, sigma^2 C^2) to the sum, divided by q N; " + clip + "; everyone "
                "else sees only the noisy models, which hide participation: add-remove of a "
                "client's whole data, amplification by sampling accounted, every client "
                "charged every round")
    if cfg.trust == "distributed":
        own = own_noise(cfg)
        share, carried = own.secure_scope(cfg) if own is not None else (
            ("a discrete Gaussian share (exact sampler of Canonne, Kamath & Steinke 2020)",
             "the sum of >= n_min discrete Gaussians of total variance >= (sigma C s)^2, "
             "accounted by Kairouz, Liu & Steinke 2021's Proposition 14 (alpha rho + tau d),")
            if cfg.secure_noise == "ddgauss" else
            ("a Skellam share", "Skellam noise of variance >= (sigma C s)^2"))
        return ("trust=distributed: nobody sees an individual update — clients round their "
                f"clipped update (scale s = {cfg.secagg_scale:g}) and add {share}, "
                "Flower's SecAgg+ masks it and the server learns only the sum, which "
                f"carries {carried} when at least n_min "
                "clients survive (else the round is discarded and nothing released) and "
                f"at most t = {cfg.secagg_noiseless} of them omit their noise share (each "
                "share carries 1/(n_min - t) of the noise: the guarantee assumes n_min - t "
                "honest survivors, secagg-noiseless); "
                "assumes an honest-but-curious server that does not add fake clients and "
                "fewer colluding parties than the SecAgg+ threshold; the server knows who "
                "took part (replace-one, no amplification); SecAgg+ masks are pseudo-random "
                "from Flower 1.39's numpy generator seeded with 32 bits folded from the "
                "shared keys, so the hiding is only as strong as a 2^32 search")
    return ""


def correlated_scope(cfg: RunConfig) -> str:
    """trust=central with ``central-noise=tree|banded-mf``: the schema in place of Poisson
    sampling, the factorization, and how each participation is charged."""
    from dpfl.privacy.correlated_charging import correlated_charge, schema_of

    mechanism = ("tree aggregation (DP-FTRL, Kairouz et al. 2021; Honaker's estimator"
                 + (f", restarted every {cfg.tree_restart} rounds" if cfg.tree_restart else "")
                 + ")" if cfg.central_noise == "tree" else
                 "a banded Toeplitz matrix factorization (Choquette-Choo et al. 2023)")
    charge = correlated_charge(cfg)
    return ("trust=central with correlated noise (central-noise="
            f"{cfg.central_noise}): the server must be trusted — it sees every clipped update "
            f"(C = {cfg.clip_norm:g}) and who sent it; " + schema_of(cfg).statement() + "; "
            "each round a cohort of fixed size round(fraction-train x clients) is drawn "
            "among the clients the schema allows (availability: no sampling is claimed and "
            "no amplification accounted); the server releases the noisy prefix sums of the "
            f"clipped sums with noise of {mechanism}, divided by the cohort size; everyone "
            "else sees only the models; add-remove of a client's whole data; the whole run "
            "is one Gaussian mechanism at sigma / sensitivity, " + charge.statement()
            + "; only the clients that took part are charged; the noise stream's state "
            "(generator, pending tree nodes or the last band - 1 increments) is kept in the "
            "server's checkpoint so that a resume continues it: that file is as secret as "
            "the clipped updates")


def overflow_note(added: float, delta: float) -> str:
    """The guarantee's words for :func:`check_overflow`'s added delta."""
    if added <= 0:
        return ""
    return (f"a SecAgg+ share may wrap around the modulus with probability P over the run's "
            f"shares and rounds; (1 + e^epsilon) P <= {added:.3g} is added to delta "
            f"({delta:g} + {added:.3g} = {delta + added:.6g}, the delta stated)")
