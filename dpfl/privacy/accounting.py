"""Privacy accounting on the field's libraries (Opacus for DP-SGD, dp-accounting otherwise).

No home-made accountant: every epsilon below comes from ``opacus.accountants`` or
``dp_accounting``. Conventions:

- ``noise_multiplier`` sigma is the Gaussian noise std divided by the clipping bound C.
- Neighbouring relation ``add-remove``: one unit (a sample for DP-SGD, a client's whole
  contribution for update-level DP) is added or removed; the clipped contribution moves the
  released sum by at most C. ``replace-one``: one unit is replaced by another; the sum moves
  by up to 2C, i.e. the effective noise multiplier is sigma / 2.
- Sampling ``poisson``: each unit joins a round independently with probability q (the
  Opacus DP-SGD model, add-remove only). ``fixed``: a fixed-size sample without
  replacement (analysed under replace-one, as in Wang, Balle & Kasiviswanathan 2019).
  ``none``: every round uses the unit.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterable, Sequence

import dp_accounting
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

RELATIONS = ("add-remove", "replace-one")
SAMPLINGS = ("none", "poisson", "fixed")
NeighborRel = dp_accounting.NeighboringRelation

# (noise_multiplier, sample_rate, steps): Opacus' own history format for DP-SGD.
DpsgdHistory = Sequence[tuple[float, float, int]]


def _opacus_accountant(accountant: str):
    from opacus.accountants import PRVAccountant, RDPAccountant

    if accountant == "rdp":
        return RDPAccountant()
    if accountant == "prv":
        return PRVAccountant()
    raise ValueError(f"accountant must be 'rdp' or 'prv', got {accountant!r}")


def dpsgd_history_epsilon(history: DpsgdHistory, delta: float, accountant: str = "rdp") -> float:
    """Epsilon of a DP-SGD history [(sigma, q, steps), ...] with Opacus' accountant.

    Sample-level, add-remove, Poisson sampling (the Opacus model).
    """
    _check_delta(delta)
    entries = [(float(s), float(q), int(n)) for s, q, n in history if int(n) > 0]
    if not entries:
        return 0.0
    acc = _opacus_accountant(accountant)
    acc.history = entries
    return float(acc.get_epsilon(delta=delta))


def dpsgd_epsilon(sample_rate: float, noise_multiplier: float, steps: int, delta: float,
                  accountant: str = "rdp") -> float:
    """Epsilon after ``steps`` Poisson-subsampled Gaussian steps (Opacus RDP or PRV)."""
    return dpsgd_history_epsilon([(noise_multiplier, sample_rate, steps)], delta, accountant)


@lru_cache(maxsize=256)
def calibrate_dpsgd_noise(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                          accountant: str = "rdp", tolerance: float = 0.01) -> float:
    """Smallest sigma (within ``tolerance`` in epsilon) whose DP-SGD epsilon <= target
    (Opacus' ``get_noise_multiplier``)."""
    from opacus.accountants.utils import get_noise_multiplier

    if target_epsilon <= 0:
        raise ValueError("target_epsilon must be > 0")
    return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                      sample_rate=sample_rate, steps=steps,
                                      accountant=accountant, epsilon_tolerance=tolerance))


def _check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def gaussian_event(noise_multiplier: float, sampling_rate: float = 1.0, sampling: str = "none",
                   relation: str = "add-remove", population_size: int | None = None
                   ) -> dp_event.DpEvent:
    """The dp-accounting event of one Gaussian release under the given sampling/relation."""
    if relation not in RELATIONS:
        raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    if noise_multiplier <= 0:
        raise ValueError("noise_multiplier must be > 0")
    # replace-one doubles the sensitivity of the released sum: sigma_eff = sigma / 2
    sigma = noise_multiplier / 2.0 if relation == "replace-one" else noise_multiplier
    base = dp_event.GaussianDpEvent(sigma)
    if sampling == "none" or sampling_rate >= 1.0:
        return base
    if not 0.0 < sampling_rate <= 1.0:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
    if sampling == "poisson":
        if relation != "add-remove":
            raise ValueError("Poisson sampling is accounted under add-remove only")
        return dp_event.PoissonSampledDpEvent(sampling_rate, base)
    if relation != "replace-one":
        raise ValueError("fixed-size sampling without replacement is accounted under "
                         "replace-one (pass relation='replace-one')")
    if population_size is None or population_size < 1:
        raise ValueError("fixed-size sampling needs population_size (number of units)")
    sample_size = max(1, round(sampling_rate * population_size))
    return dp_event.SampledWithoutReplacementDpEvent(population_size, sample_size, base)


def _relation_enum(event: dp_event.DpEvent) -> NeighborRel:
    if isinstance(event, dp_event.SampledWithoutReplacementDpEvent):
        return NeighborRel.REPLACE_ONE
    return NeighborRel.ADD_OR_REMOVE_ONE


def events_epsilon(events: Iterable[tuple[dp_event.DpEvent, int]], delta: float,
                   accountant: str = "rdp") -> float:
    """Epsilon of composed (event, count) pairs with dp-accounting's RDP or PLD accountant."""
    _check_delta(delta)
    items = [(e, int(c)) for e, c in events if int(c) > 0]
    if not items:
        return 0.0
    relations = {_relation_enum(e) for e, _ in items}
    if len(relations) > 1:
        raise ValueError("cannot compose events under different neighbouring relations")
    relation = relations.pop()
    if accountant == "rdp":
        acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    elif accountant == "pld":
        acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=relation)
    else:
        raise ValueError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")
    for event, count in items:
        acc.compose(event, count)
    return float(acc.get_epsilon(delta))


def gaussian_epsilon(noise_multiplier: float, rounds: int, delta: float,
                     sampling_rate: float = 1.0, sampling: str = "none",
                     accountant: str = "rdp", relation: str = "add-remove",
                     population_size: int | None = None) -> float:
    """Epsilon of ``rounds`` Gaussian releases (client-level update DP), dp-accounting."""
    if rounds <= 0:
        return 0.0
    event = gaussian_event(noise_multiplier, sampling_rate, sampling, relation, population_size)
    return events_epsilon([(event, rounds)], delta, accountant)


@lru_cache(maxsize=256)
def calibrate_noise(target_epsilon: float, delta: float, rounds: int,
                    sampling_rate: float = 1.0, sampling: str = "none",
                    accountant: str = "rdp", relation: str = "add-remove",
                    population_size: int | None = None, rel_tol: float = 1e-4) -> float:
    """Smallest sigma (to ``rel_tol``) with ``gaussian_epsilon(sigma, ...) <= target``.

    Bisection on sigma; epsilon is decreasing in sigma.
    """
    if target_epsilon <= 0:
        raise ValueError("target_epsilon must be > 0")

    def eps(sigma: float) -> float:
        return gaussian_epsilon(sigma, rounds, delta, sampling_rate, sampling, accountant,
                                relation, population_size)

    lo, hi = 1e-3, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2.0
        if hi > 1e6:
            raise ValueError("target epsilon unreachable with sigma <= 1e6")
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        if eps(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi


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
