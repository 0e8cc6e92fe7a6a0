"""Privacy accounting on the field's libraries (Opacus for DP-SGD, dp-accounting otherwise).

No home-made accountant: every epsilon below comes from ``opacus.accountants`` or
``dp_accounting``. Conventions:

- ``noise_multiplier`` sigma is the Gaussian noise std divided by the clipping bound C.
- Neighbouring relation ``add-remove``: one unit (a sample for DP-SGD, a client's whole
  contribution for update-level DP) is added or removed; the clipped contribution moves the
  released sum by at most C. ``replace-one``: one unit is replaced by another; the sum moves
  by up to 2C, i.e. the effective noise multiplier is sigma / 2. That halving and the
  Poisson wrapping live in ONE place, :func:`dp_event_of` (the translation of a dpfl
  event into a dp-accounting ``DpEvent``), which :func:`gaussian_event`,
  :func:`dpsgd_event` and :meth:`dpfl.privacy.accounting.events.PrivacyEvent.to_dp_event` go
  through.
- Sampling ``poisson``: each unit joins a round independently with probability q (the
  Opacus DP-SGD model, add-remove only). ``fixed``: a fixed-size sample without
  replacement (analysed under replace-one, as in Wang, Balle & Kasiviswanathan 2019;
  ``rdp`` only: dp-accounting's PLD accountant has no such event).
  ``none``: every round uses the unit.
- No argument is silently dropped: a ``sampling_rate`` below 1 with ``sampling='none'`` is
  refused (Poisson sampling and sampling without replacement account differently, so the
  model is never guessed), as is a ``population_size`` without ``sampling='fixed'``; for
  dpfl events (:func:`check_event_key`), a rate below 1 on a pure event (Laplace,
  sparse vector: no subsampled analysis here), a relation other than add-remove on a DP-SGD
  event (Opacus' model), replace-one with a rate below 1, and a ``sigma`` on a pure event or
  an ``epsilon`` on a Gaussian one are refused (ValueError naming the arguments).

Accountants:

- ``rdp``: Rényi DP (Opacus' for DP-SGD, dp-accounting's otherwise). A valid upper bound,
  the loosest of the three.
- ``prv``: Opacus' PRV accountant, DP-SGD (sample-level) histories only; every
  client-level entry point refuses it (:func:`check_event_accountant`), it is never read
  as ``pld``.
- ``pld``: dp-accounting's ``PLDAccountant`` (privacy loss distributions, pessimistic
  discretisation: an upper bound at every discretisation interval) for both DP-SGD steps
  (``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))`` composed ``steps`` times,
  add-remove) and client-level events. The tightest of the three. Each distinct event is
  composed once with its count, plain Gaussians of different sigmas are merged exactly
  into one (:func:`_merge_gaussians`), and results are cached by the composition's
  canonical signature. When the grid at the default interval (1e-4) would be too large
  (very long or low-noise histories) it falls back to a coarser interval, then to RDP
  (both still upper bounds), logs a warning on ``flwr.dpfl.accounting`` and says which it
  used (:func:`events_epsilon_detail`).
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence, TypeAlias

import dp_accounting
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant

from dpfl import memo
from dpfl.privacy.accounting import calibration_cache
from dpfl.privacy.accounting.event_types import RELATIONS, EventKey, event_type, mechanisms

if TYPE_CHECKING:
    from opacus.accountants import IAccountant

log = logging.getLogger("flwr.dpfl.accounting")

# dpfl's mechanisms (the ``mechanism`` of :class:`dpfl.privacy.accounting.events.PrivacyEvent`): one
# class each in dpfl.privacy.accounting.event_types' registry, which says what each takes and how it
# is accounted. MECHANISMS: the built-in names (the registry's at import).
MECHANISMS = mechanisms()
PRV_CLIENT_LEVEL = ("accountant 'prv' is Opacus' DP-SGD accountant; use 'pld' or 'rdp' for "
                    "client-level events")
SAMPLINGS = ("none", "poisson", "fixed")
DPSGD_ACCOUNTANTS = ("rdp", "prv", "pld")
EVENT_ACCOUNTANTS = ("rdp", "pld")
NeighborRel: TypeAlias = dp_accounting.NeighboringRelation

# PLD discretisation intervals, finest first: the first whose grid fits is used, then RDP.
PLD_INTERVALS = (1e-4, 1e-3, 1e-2)
# Largest PLD grid (estimated number of points, see _pld_points) we try to build. ~4e6
# points keep every array of the FFT composition at ~64 MB and the build at a few seconds.
PLD_MAX_POINTS = 4_000_000
# Tail probability for the size estimate: dp-accounting truncates composed PLDs at 1e-15.
_PLD_TAIL_DELTA = 1e-15
# Integer RDP orders for the size estimate: several times faster than the default grid
# (no fractional series) and a subset of it, so their epsilon is never below the default
# one and the estimate only errs on the large side.
_PLD_SIZE_ORDERS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 63, 128, 256, 512, 1024)

# Calibration brackets (noise multipliers): a target that needs more noise than
# SIGMA_MAX is refused as unreachable; the bracket search stops shrinking at SIGMA_MIN
# (any smaller sigma would already be far beyond every useful epsilon).
SIGMA_MAX = 1e6
SIGMA_MIN = 1e-6
# calibrate_noise's first RDP bracket [lo, hi], doubled until eps(hi) <= target.
RDP_BRACKET = (1e-3, 1.0)
# _bisect_sigma's first guess and growth factor of the bracket around it.
SIGMA_GUESS = 1.0
BRACKET_FACTOR = 2.0

# (noise_multiplier, sample_rate, steps): Opacus' own history format for DP-SGD.
DpsgdHistory = Sequence[tuple[float, float, int]]
EventCounts = Iterable[tuple[dp_event.DpEvent, int]]
# A composition as a tuple of (event, count) pairs (hashable: the caches' keys)
Composition = tuple[tuple[dp_event.DpEvent, int], ...]


def _check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def check_event_accountant(accountant: str) -> None:
    """Client-level (non-DP-SGD) computations take ``rdp`` or ``pld``. ``prv`` is Opacus'
    DP-SGD accountant: it has no client-level events and is never translated into
    another accountant (ValueError naming ``pld`` and ``rdp``)."""
    if accountant == "prv":
        raise ValueError(f"accountant must be one of {EVENT_ACCOUNTANTS} here, got 'prv': "
                         f"{PRV_CLIENT_LEVEL}")
    if accountant not in EVENT_ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {EVENT_ACCOUNTANTS}, got {accountant!r}")


def _interval_label(interval: float) -> str:
    """1e-4 -> '1e-4' (method descriptions)."""
    mantissa, exponent = f"{interval:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


# ---------------------------------------------------------------------------------------
# dpfl events -> dp-accounting events


def check_event_key(key: EventKey) -> None:
    """ValueError when a dpfl event's parameters would be ignored by its accounting, as its
    registered type says (:meth:`dpfl.privacy.accounting.event_types.EventType.check`): e.g. a
    ``rate`` below 1 on a pure event (Laplace, sparse vector: no subsampled analysis here),
    a ``sigma`` on a pure event or an ``epsilon`` on a Gaussian one, a DP-SGD event under
    ``replace-one`` (Opacus' model is add-remove) and a Poisson rate below 1 under
    ``replace-one`` (Poisson subsampling is analysed under add-remove); an unknown
    mechanism."""
    event_type(key[0]).check(key)


def dp_event_of(key: EventKey) -> dp_event.DpEvent:
    """THE translation of a dpfl event (its key, :attr:`dpfl.privacy.accounting.events.PrivacyEvent.key`)
    into ONE step of a dp-accounting ``DpEvent``; every non-Opacus accountant path (RDP
    curves, PLD, :func:`gaussian_event`, :func:`dpsgd_event`, sigma calibration) goes
    through here, to the event's registered type
    (:meth:`dpfl.privacy.accounting.event_types.EventType.dp_event`):

    - ``laplace``: ``LaplaceDpEvent(1 / epsilon)`` (sensitivity 1, scale 1 / epsilon).
    - ``dpsgd``: ``GaussianDpEvent(sigma)`` on a Poisson(rate) sample, add-remove (the
      Opacus model; another relation is refused, see :func:`check_event_key`).
    - ``gaussian`` / ``quantile-count``: ``GaussianDpEvent(sigma)`` under add-remove;
      replace-one doubles the sensitivity of the released sum, i.e. ``sigma / 2``; a rate
      below 1 wraps it in ``PoissonSampledDpEvent(rate, .)`` (add-remove only).
    - ``sparse-vector``, ``skellam``, ``ddgauss`` and ``binomial`` have no dp-accounting
      event (ValueError): their RDP enters through their type's curve
      (:func:`dpfl.privacy.accounting.events.rdp_curve`).
    """
    kind = event_type(key[0])
    kind.check(key)
    event = kind.dp_event(key)
    if event is None:
        raise ValueError(f"no dp-accounting event for mechanism {key[0]!r}")
    return event


# ---------------------------------------------------------------------------------------
# DP-SGD (sample-level)


def _opacus_accountant(accountant: str) -> IAccountant:
    from opacus.accountants import PRVAccountant, RDPAccountant

    if accountant == "rdp":
        return RDPAccountant()
    if accountant == "prv":
        return PRVAccountant()
    raise ValueError(f"accountant must be one of {DPSGD_ACCOUNTANTS}, got {accountant!r}")


def dpsgd_event(noise_multiplier: float, sample_rate: float) -> dp_event.DpEvent:
    """The dp-accounting event of ONE DP-SGD step: a Gaussian of multiplier sigma on a
    Poisson(q) sample (add-remove, the Opacus model); q = 1 is the plain Gaussian.
    Built by :func:`dp_event_of`."""
    sigma, q = float(noise_multiplier), float(sample_rate)
    if not sigma > 0:
        raise ValueError("noise_multiplier must be > 0")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    return dp_event_of(("dpsgd", sigma, q, 0.0, "add-remove"))


def dpsgd_history_epsilon_detail(history: DpsgdHistory, delta: float,
                                 accountant: str = "rdp") -> tuple[float, str]:
    """(epsilon, method) of a DP-SGD history [(sigma, q, steps), ...].

    Sample-level, add-remove, Poisson sampling (the Opacus model). ``rdp``/``prv``:
    Opacus' accountants; ``pld``: dp-accounting's PLD accountant (method says which
    discretisation, or the RDP fallback, was used).
    """
    _check_delta(delta)
    if accountant not in DPSGD_ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {DPSGD_ACCOUNTANTS}, got {accountant!r}")
    entries = [(float(s), float(q), int(n)) for s, q, n in history if int(n) > 0]
    if not entries:
        return 0.0, accountant
    if accountant == "pld":
        return events_epsilon_detail([(dpsgd_event(s, q), n) for s, q, n in entries], delta,
                                     "pld")
    acc = _opacus_accountant(accountant)
    acc.history = entries
    return float(acc.get_epsilon(delta=delta)), accountant


def dpsgd_history_epsilon(history: DpsgdHistory, delta: float, accountant: str = "rdp") -> float:
    """Epsilon of a DP-SGD history [(sigma, q, steps), ...] (Opacus RDP/PRV or
    dp-accounting PLD); see :func:`dpsgd_history_epsilon_detail`."""
    return dpsgd_history_epsilon_detail(history, delta, accountant)[0]


def dpsgd_epsilon(sample_rate: float, noise_multiplier: float, steps: int, delta: float,
                  accountant: str = "rdp") -> float:
    """Epsilon after ``steps`` Poisson-subsampled Gaussian steps (RDP, PRV or PLD)."""
    return dpsgd_history_epsilon([(noise_multiplier, sample_rate, steps)], delta, accountant)


@lru_cache(maxsize=256)
def calibrate_dpsgd_noise(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                          accountant: str = "rdp", tolerance: float = 0.01,
                          rel_tol: float = 1e-3,
                          orders: tuple[float, ...] | None = None) -> float:
    """Smallest sigma whose DP-SGD epsilon after ``steps`` steps is <= ``target_epsilon``.

    ``rdp``/``prv``: Opacus' ``get_noise_multiplier`` (epsilon in
    [target - ``tolerance``, target]); ``orders``: the RDP orders of that search (``rdp``
    only; default Opacus', which stop at 63). ``pld``: bisection in sigma on
    :func:`dpsgd_epsilon` (the very function the history is later accounted with, so a
    calibrated run never overshoots by rounding): returns sigma with epsilon(sigma) <=
    target < epsilon(sigma * (1 - ``rel_tol``)).
    """
    if target_epsilon <= 0:
        raise ValueError("target_epsilon must be > 0")
    _check_delta(delta)
    if accountant == "pld":
        def items(sigma: float) -> Composition:
            return ((dpsgd_event(sigma, sample_rate), int(steps)),)

        return _calibrate_pld(items, delta, target_epsilon, rel_tol)
    if accountant not in DPSGD_ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {DPSGD_ACCOUNTANTS}, got {accountant!r}")
    from opacus.accountants.utils import get_noise_multiplier

    extra = {} if orders is None else {"alphas": list(orders)}
    if extra and accountant != "rdp":
        raise ValueError("orders apply to the rdp accountant only")
    return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                      sample_rate=sample_rate, steps=steps,
                                      accountant=accountant, epsilon_tolerance=tolerance,
                                      **extra))


# ---------------------------------------------------------------------------------------
# dp-accounting events (client-level, and DP-SGD steps for PLD)


def gaussian_event(noise_multiplier: float, sampling_rate: float = 1.0, sampling: str = "none",
                   relation: str = "add-remove", population_size: int | None = None
                   ) -> dp_event.DpEvent:
    """The dp-accounting event of one Gaussian release under the given sampling/relation.

    ``sampling``: ``'poisson'`` (rate q, add-remove), ``'fixed'`` (a sample of
    round(q * ``population_size``) without replacement, replace-one) or ``'none'`` (every
    round uses the unit). Nothing is dropped silently (ValueError naming the arguments):
    ``sampling_rate`` below 1 with ``sampling='none'`` (which sampling model applies cannot
    be guessed: Poisson and without-replacement account differently), and
    ``population_size`` without ``sampling='fixed'``. A rate of 1 is the unsampled
    Gaussian under any ``sampling``.
    """
    if relation not in RELATIONS:
        raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    if noise_multiplier <= 0:
        raise ValueError("noise_multiplier must be > 0")
    if not 0.0 < sampling_rate <= 1.0:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
    if sampling == "none" and sampling_rate < 1.0:
        raise ValueError(
            f"sampling_rate={sampling_rate} < 1 with sampling='none': the rate would be "
            "ignored (every round would be accounted as using the unit); pass "
            "sampling='poisson' (or sampling='fixed' with relation='replace-one') to account "
            "for the sampling, or sampling_rate=1.0")
    if population_size is not None and sampling != "fixed":
        raise ValueError(f"population_size={population_size} with sampling={sampling!r}: "
                         "it would be ignored (only sampling='fixed' uses it)")
    sigma, rate = float(noise_multiplier), float(sampling_rate)
    if sampling != "fixed" or rate >= 1.0:
        # replace-one's sigma / 2 and the Poisson wrapping (add-remove only, else
        # ValueError): dp_event_of, nowhere else
        return dp_event_of(("gaussian", sigma, rate if sampling == "poisson" else 1.0, 0.0,
                            relation))
    if relation != "replace-one":
        raise ValueError("fixed-size sampling without replacement is accounted under "
                         "replace-one (pass relation='replace-one')")
    if population_size is None or population_size < 1:
        raise ValueError("fixed-size sampling needs population_size (number of units)")
    sample_size = max(1, round(rate * population_size))
    base = dp_event_of(("gaussian", sigma, 1.0, 0.0, relation))
    return dp_event.SampledWithoutReplacementDpEvent(population_size, sample_size, base)


def _relation_enum(event: dp_event.DpEvent) -> NeighborRel:
    if isinstance(event, dp_event.SampledWithoutReplacementDpEvent):
        return NeighborRel.REPLACE_ONE
    return NeighborRel.ADD_OR_REMOVE_ONE


def _canonical(events: EventCounts) -> Composition:
    """Equal events merged (counts summed), sorted: the order-free signature of a
    composition. Equal signatures give bit-identical epsilons (and share the cache)."""
    counts: dict[dp_event.DpEvent, int] = {}
    for e, c in events:
        if int(c) > 0:
            counts[e] = counts.get(e, 0) + int(c)
    return tuple(sorted(counts.items(), key=lambda item: repr(item[0])))


def _relation_of(items: Sequence[tuple[dp_event.DpEvent, int]]) -> NeighborRel:
    relations = {_relation_enum(e) for e, _ in items}
    if len(relations) > 1:
        raise ValueError("cannot compose events under different neighbouring relations")
    return relations.pop()


def _rdp_epsilon(items: EventCounts, relation: NeighborRel, delta: float,
                 orders: Sequence[float] | None = None) -> float:
    acc = rdp_privacy_accountant.RdpAccountant(
        orders=None if orders is None else list(orders), neighboring_relation=relation)
    for event, count in items:
        acc.compose(event, count)
    return float(acc.get_epsilon(delta))


def _pld_points(rdp_tail_epsilon: float, interval: float) -> float:
    """Estimated size of the largest PLD grid dp-accounting builds for a composition.

    dp-accounting keeps the privacy loss over the range that carries all but 1e-15 of its
    mass; by the RDP (Chernoff) tail bound that range ends near the RDP epsilon at
    delta = 1e-15. Measured over Gaussian and Poisson-subsampled Gaussian compositions
    (sigma 0.003..5, q 1e-3..1, up to 1e5 steps) the grid's width in loss units was
    1.1-4.9 x that epsilon (default orders), and never more than 4 x it + 20: hence the
    estimate, evaluated with the coarser :data:`_PLD_SIZE_ORDERS` (a larger epsilon).
    """
    return (4.0 * rdp_tail_epsilon + 20.0) / interval


def _merge_gaussians(items: Sequence[tuple[dp_event.DpEvent, int]]
                     ) -> list[tuple[dp_event.DpEvent, int]]:
    """Plain Gaussian releases of multipliers sigma_i (count c_i) compose exactly to ONE
    Gaussian of multiplier (sum_i c_i / sigma_i^2)^(-1/2): a Gaussian's privacy loss
    depends only on 1/sigma and these add in quadrature (Dong, Roth & Su 2019, GDP
    composition; dp-accounting applies the same identity to a count, sigma / sqrt(c)).
    So a history of many different sigmas (AADP's per-round epsilons) needs one PLD, not
    one per sigma. A single Gaussian key is left to dp-accounting as it is."""
    gauss = [(e, c) for e, c in items if type(e) is dp_event.GaussianDpEvent]
    if len(gauss) < 2:
        return list(items)
    precision = math.fsum(c / e.noise_multiplier ** 2 for e, c in gauss)
    rest = [(e, c) for e, c in items if type(e) is not dp_event.GaussianDpEvent]
    return [(dp_event.GaussianDpEvent(precision ** -0.5), 1)] + rest


@lru_cache(maxsize=32)
def _sampled_gaussian_pld(sigma: float, rate: float, relation: NeighborRel,
                          interval: float) -> pld_lib.PrivacyLossDistribution:
    """One Poisson-sampled Gaussian's PLD, built exactly as dp-accounting's PLDAccountant
    builds it, and kept: a central run composes the same release one more time every
    round, and building this grid is most of the cost of the round's epsilon."""
    return pld_lib.from_gaussian_mechanism(standard_deviation=sigma,
                                       value_discretization_interval=interval,
                                       sampling_prob=rate, neighboring_relation=relation)


def _pld_of(event: dp_event.DpEvent, count: int, relation: NeighborRel,
            interval: float) -> pld_lib.PrivacyLossDistribution | None:
    """The PLD PLDAccountant composes for ``count`` x ``event`` (same calls, same order,
    so the same numbers), or None when the accountant must handle the event itself."""
    if type(event) is dp_event.GaussianDpEvent and event.noise_multiplier > 0:
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=event.noise_multiplier / math.sqrt(count),
            value_discretization_interval=interval, neighboring_relation=relation)
    if (type(event) is dp_event.PoissonSampledDpEvent
            and type(event.event) is dp_event.GaussianDpEvent
            and event.event.noise_multiplier > 0 and event.sampling_probability > 0):
        return _sampled_gaussian_pld(event.event.noise_multiplier,
                                     event.sampling_probability, relation,
                                     interval).self_compose(count)
    return None


def _pld_once(items: Sequence[tuple[dp_event.DpEvent, int]], relation: NeighborRel,
              delta: float, interval: float) -> float:
    items = _merge_gaussians(items)
    plds = [_pld_of(event, count, relation, interval) for event, count in items]
    if all(p is not None for p in plds):  # Gaussians, sampled or not: the cached route
        total = pld_lib.identity(value_discretization_interval=interval)
        for p in plds:
            total = total.compose(p)
        return float(total.get_epsilon_for_delta(delta))
    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=relation,
                                               value_discretization_interval=interval)
    for event, count in items:
        acc.compose(event, count)  # with its count: one self-composition, not a loop
    return float(acc.get_epsilon(delta))


@lru_cache(maxsize=4096)
def _pld_compute(items: Composition, delta: float,
                 finest: float) -> tuple[float, str, tuple[str, ...]]:
    """(epsilon, method, reasons for skipping finer grids) of a canonical composition:
    PLD at the finest feasible interval of :data:`PLD_INTERVALS` (>= ``finest``), else
    RDP. Every branch is an upper bound on the true epsilon."""
    relation = _relation_of(items)
    ladder = [iv for iv in PLD_INTERVALS if iv >= finest] or [finest]
    tail = _rdp_epsilon(items, relation, _PLD_TAIL_DELTA, _PLD_SIZE_ORDERS)
    skipped: list[str] = []
    for interval in ladder:
        label = _interval_label(interval)
        points = _pld_points(tail, interval) if math.isfinite(tail) else math.inf
        if points > PLD_MAX_POINTS:
            skipped.append(f"interval {label}: ~{points:.2g} grid points > {PLD_MAX_POINTS:g}")
            continue
        try:
            return _pld_once(items, relation, delta, interval), f"pld(interval={label})", \
                tuple(skipped)
        except MemoryError:
            skipped.append(f"interval {label}: MemoryError")
    return _rdp_epsilon(items, relation, delta), "rdp (pld fallback)", tuple(skipped)


_warned: set[tuple[Composition, float, float]] = set()


def _pld_detail(items: Composition, delta: float,
                finest: float = PLD_INTERVALS[0], warn: bool = True) -> tuple[float, str]:
    if any(isinstance(e, dp_event.SampledWithoutReplacementDpEvent) for e, _ in items):
        raise ValueError("dp-accounting's PLD accountant has no fixed-size sampling "
                         "(SampledWithoutReplacementDpEvent); use accountant 'rdp'")
    eps, method, skipped = _pld_compute(items, delta, finest)
    if skipped and warn and (items, delta, finest) not in _warned:
        _warned.add((items, delta, finest))
        log.warning("PLD accountant fell back to %s, epsilon %.6g (%s)", method, eps,
                    "; ".join(skipped))
    return eps, method


def events_epsilon_detail(events: EventCounts, delta: float,
                          accountant: str = "rdp") -> tuple[float, str]:
    """(epsilon, method) of composed (event, count) pairs with dp-accounting.

    ``rdp``: ``RdpAccountant`` (method ``"rdp"``). ``pld``: ``PLDAccountant`` composing
    each distinct event once with its total count; method ``"pld(interval=1e-4)"`` (the
    default discretisation), ``"pld(interval=1e-3)"``/``"pld(interval=1e-2)"`` when the
    finer grid would not fit, or ``"rdp (pld fallback)"``. Results are cached by the
    composition's canonical signature (order-free).
    """
    _check_delta(delta)
    check_event_accountant(accountant)
    items = _canonical(events)
    if not items:
        return 0.0, accountant
    if accountant == "rdp":
        return _rdp_epsilon(items, _relation_of(items), delta), "rdp"
    return _pld_detail(items, float(delta))


def events_epsilon(events: EventCounts, delta: float, accountant: str = "rdp") -> float:
    """Epsilon of composed (event, count) pairs with dp-accounting's RDP or PLD accountant
    (see :func:`events_epsilon_detail`)."""
    return events_epsilon_detail(events, delta, accountant)[0]


def gaussian_epsilon_detail(noise_multiplier: float, rounds: int, delta: float,
                            sampling_rate: float = 1.0, sampling: str = "none",
                            accountant: str = "rdp", relation: str = "add-remove",
                            population_size: int | None = None) -> tuple[float, str]:
    """(epsilon, method) of ``rounds`` Gaussian releases (client-level update DP). The
    arguments are those of :func:`gaussian_event`: a ``sampling_rate`` below 1 needs
    ``sampling='poisson'`` or ``'fixed'`` (ValueError with ``'none'``), even for 0 rounds."""
    check_event_accountant(accountant)
    event = gaussian_event(noise_multiplier, sampling_rate, sampling, relation, population_size)
    if rounds <= 0:
        return 0.0, accountant
    return events_epsilon_detail([(event, rounds)], delta, accountant)


def gaussian_epsilon(noise_multiplier: float, rounds: int, delta: float,
                     sampling_rate: float = 1.0, sampling: str = "none",
                     accountant: str = "rdp", relation: str = "add-remove",
                     population_size: int | None = None) -> float:
    """Epsilon of ``rounds`` Gaussian releases (client-level update DP), dp-accounting;
    see :func:`gaussian_epsilon_detail` (a rate below 1 needs an explicit ``sampling``)."""
    return gaussian_epsilon_detail(noise_multiplier, rounds, delta, sampling_rate, sampling,
                                   accountant, relation, population_size)[0]


# ---------------------------------------------------------------------------------------
# calibration


def _bisect_sigma(eps: Callable[[float], float], target: float, rel_tol: float,
                  guess: float = SIGMA_GUESS, factor: float = BRACKET_FACTOR) -> float:
    """hi with eps(hi) <= target < eps(lo), hi - lo <= rel_tol * hi (eps decreasing).

    The bracket is grown geometrically from ``guess`` (steps ``factor``, then doubling the
    excess) so a good guess costs only a few evaluations."""
    step = factor - 1.0
    hi = guess
    if eps(hi) > target:
        lo = hi
        while True:
            hi = lo * (1.0 + step)
            if hi > SIGMA_MAX:
                raise ValueError(f"target epsilon unreachable with sigma <= {SIGMA_MAX:g}")
            if eps(hi) <= target:
                break
            lo, step = hi, 2.0 * step
    else:
        while True:
            lo = hi / (1.0 + step)
            if lo < SIGMA_MIN:
                return hi
            if eps(lo) > target:
                break
            hi, step = lo, 2.0 * step
    return bisect_sigma(eps, lo, hi, target, rel_tol)


def bisect_sigma(eps: Callable[[float], float], lo: float, hi: float, target: float,
                 rel_tol: float) -> float:
    """Smallest sigma in (lo, hi] (to ``rel_tol``) with eps(sigma) <= target, given
    eps(lo) > target >= eps(hi); epsilon decreases in sigma."""
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        if eps(mid) > target:
            lo = mid
        else:
            hi = mid
    return hi


# Two noise multipliers at which a calibration's composition is written into its memo key
# (:mod:`dpfl.privacy.accounting.calibration_cache`): the events' parameters are affine in sigma.
_KEY_PROBES = (0.8731, 3.1416)


@lru_cache(maxsize=1)
def memo_version() -> str:
    """Whose answers the calibration memo holds: dp-accounting's version and a digest of
    this module's source."""
    return memo.code_version("dp-accounting", Path(__file__))


def _calibrate_pld(items: Callable[[float], Composition], delta: float, target: float,
                   rel_tol: float) -> float:
    """Bisection on the PLD epsilon, coarse to fine: located on the cheap 1e-2 grid, then
    refined on 1e-3 and finally on the accounting function itself (1e-4 with its
    fallbacks), which decides the answer: eps(sigma) <= target < eps(sigma (1 - rel_tol)).

    Answers are memoised on disk (:mod:`dpfl.privacy.accounting.calibration_cache`); a memoised sigma
    is returned only if the accounting function confirms eps(sigma) <= target <
    eps(sigma (1 - rel_tol)) (two evaluations: it meets the target and is the smallest)."""
    key = memo_version() + "\n" + repr(
        (tuple(_canonical(items(p)) for p in _KEY_PROBES), delta, target, rel_tol))
    return calibration_cache.memoised(
        key, lambda sigma: _pld_detail(_canonical(items(sigma)), delta)[0], target,
        lambda: _search_pld(items, delta, target, rel_tol), tolerance=rel_tol)


def _search_pld(items: Callable[[float], Composition], delta: float, target: float,
                rel_tol: float) -> float:
    """The coarse-to-fine bisection of :func:`_calibrate_pld`."""
    sigma, factor = SIGMA_GUESS, BRACKET_FACTOR
    stages = sorted(PLD_INTERVALS, reverse=True)
    for i, finest in enumerate(stages):
        # the coarse stages only steer the search: no fallback warnings from them
        def eps(s: float, finest: float = finest, last: bool = i == len(stages) - 1) -> float:
            return _pld_detail(_canonical(items(s)), delta, finest, warn=last)[0]

        sigma = _bisect_sigma(eps, target, rel_tol, sigma, factor)
        # a finer grid moves epsilon by ~1e-3 relative (1e-2 -> 1e-3) or ~1e-5
        # (1e-3 -> 1e-4): start the next stage with a bracket of that size
        factor = 1.0 + (2.0 * rel_tol if i == 0 else rel_tol)
    return sigma


@lru_cache(maxsize=256)
def calibrate_noise(target_epsilon: float, delta: float, rounds: int,
                    sampling_rate: float = 1.0, sampling: str = "none",
                    accountant: str = "rdp", relation: str = "add-remove",
                    population_size: int | None = None, rel_tol: float = 1e-4) -> float:
    """Smallest sigma (to ``rel_tol``) with ``gaussian_epsilon(sigma, ...) <= target``.

    Bisection on sigma; epsilon is decreasing in sigma. A ``sampling_rate`` below 1 needs
    ``sampling='poisson'`` or ``'fixed'``: with the default ``sampling='none'`` it is a
    ValueError naming both arguments (it used to be dropped, e.g. ``calibrate_noise(2.0,
    1e-5, 200, sampling_rate=0.05)`` returned the unsampled sigma ~30.4), and so is a
    ``population_size`` without ``sampling='fixed'`` (see :func:`gaussian_event`).
    """
    if target_epsilon <= 0:
        raise ValueError("target_epsilon must be > 0")
    _check_delta(delta)
    check_event_accountant(accountant)
    gaussian_event(1.0, sampling_rate, sampling, relation, population_size)  # validate

    if accountant == "pld" and rounds > 0:
        def items(sigma: float) -> Composition:
            return ((gaussian_event(sigma, sampling_rate, sampling, relation,
                                    population_size), int(rounds)),)

        return _calibrate_pld(items, delta, target_epsilon, rel_tol)

    def eps(sigma: float) -> float:
        return gaussian_epsilon(sigma, rounds, delta, sampling_rate, sampling, accountant,
                                relation, population_size)

    lo, hi = RDP_BRACKET
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * BRACKET_FACTOR
        if hi > SIGMA_MAX:
            raise ValueError(f"target epsilon unreachable with sigma <= {SIGMA_MAX:g}")
    return bisect_sigma(eps, lo, hi, target_epsilon, rel_tol)


def calibrate_events(keys_for: Callable[[float], Sequence[tuple[EventKey, int]]],
                     target_epsilon: float, delta: float, accountant: str = "rdp",
                     rel_tol: float = 1e-4) -> float:
    """Smallest sigma (to ``rel_tol``) whose composition ``keys_for(sigma)`` — dpfl event
    keys with their counts, e.g. a central round's noisy sum and clipped count — meets
    ``target_epsilon`` (the same coarse-to-fine PLD search as :func:`calibrate_noise`)."""
    _check_delta(delta)
    check_event_accountant(accountant)

    def items(sigma: float) -> Composition:
        return tuple((dp_event_of(k), int(n)) for k, n in keys_for(sigma))

    if accountant == "pld":
        return _calibrate_pld(items, delta, target_epsilon, rel_tol)
    return _bisect_sigma(lambda s: events_epsilon(items(s), delta, accountant),
                         target_epsilon, rel_tol)


# ---------------------------------------------------------------------------------------
# pure epsilon


def laplace_epsilon(epsilons: Sequence[float], delta_prime: float = 0.0) -> float:
    """Composition of pure eps-DP releases (e.g. Laplace with eps_i = sensitivity / b_i).

    delta_prime = 0: basic composition, sum of eps_i. delta_prime > 0: the better of basic
    and the advanced composition theorem (Dwork, Rothblum & Vadhan 2010; heterogeneous form
    of Kairouz et al.): sqrt(2 ln(1/delta') sum eps_i^2) + sum eps_i (e^eps_i - 1) / (e^eps_i + 1),
    which holds with total delta = delta_prime.
    """
    eps = [float(e) for e in epsilons]
    if any(e < 0 for e in eps):
        raise ValueError("epsilons must be >= 0")
    basic = sum(eps)
    if delta_prime <= 0.0:
        return basic
    _check_delta(delta_prime)
    advanced = (math.sqrt(2.0 * math.log(1.0 / delta_prime) * sum(e * e for e in eps))
                + sum(e * math.expm1(e) / (math.exp(e) + 1.0) for e in eps))
    return min(basic, advanced)
