"""What ``trust=central`` with correlated noise (``central-noise=tree|banded-mf``) costs
each client, one participation at a time, and the noise it is calibrated to.

The whole run is ONE Gaussian mechanism on ``x -> C x`` (:mod:`dpfl.privacy.
correlated_accounting`): a client whose participations are the rounds pi has privacy loss
exactly that of a Gaussian at noise multiplier sigma / sens(pi), sens(pi)^2 = max_g
||sum_(i in pi) C[:, i] g_i^T||_F^2 (add-remove, no sampling). The ledger composes
per-round events, so each participation is charged one ``PrivacyEvent.gaussian`` at
multiplier sigma / w_t (rate 1, add-remove) with weights w chosen so that, for EVERY pattern
pi the schema allows, sum_(t in pi) w_t^2 >= sens(pi)^2: Gaussian events compose exactly
(1 / z^2 adds: k events at z sqrt(k) are one at z, in dp-accounting's RDP exactly and in its
PLD up to discretisation), so the composed charge is an upper bound for every client, and
equals the mechanism for the worst pattern when max_pi sum_(t in pi) w_t^2 = sens_k^2.

- ``banded-mf`` (band <= separation, or one participation): columns of C at distance >=
  the separation are orthogonal, so sens(pi)^2 = sum_(t in pi) ||C[:, t]||^2 EXACTLY
  ((Amplified) Banded MF, banded sensitivity theorem): w_t = ||C[:, t]|| (the column
  norm: ||c|| for a whole column, less for the last band - 1 rounds). Each client is
  charged exactly its own mechanism; a client with the worst pattern exactly sens_k.
  (For whole columns this is the proportional charge (k' / k) sens_k^2 of k'
  participations.)
- ``tree``: C is 0/1 and its columns overlap (the upper nodes), sens(pi)^2 is not additive
  over participations. Proportional charging (w^2 = sens_k^2 / k per participation) is a
  valid bound only if sens_m^2 <= (m / k) sens_k^2 for every m <= k (sens_m: the worst
  pattern of m participations), which fails for many schemas (e.g. n = 100, k = b = 10:
  sens_1^2 / 1 > sens_10^2 / 10). dpfl computes sens_m for every m exactly (the tree's
  dynamic program): when the condition holds (always for k = 1) it charges
  proportionally (:attr:`CorrelatedCharge.proportional_exact`); otherwise it charges
  conservatively: the WHOLE run's Gaussian (sigma / sens_k) at a client's first
  participation and nothing at its later ones (``first_only``), so every client that takes
  part is charged the worst pattern's epsilon, an upper bound on its own.

sigma (``noise_std``, units of the clipping bound) is calibrated with
:func:`dpfl.privacy.accounting.correlated_accounting.calibrate_noise_std` at the charged sensitivity.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from dpfl.config import RunConfig
from dpfl.privacy.accounting.correlated_accounting import (
    calibrate_noise_std,
    correlated_epsilon,
    max_separated_sum,
)
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.participation import ParticipationSchema
from dpfl.privacy.mechanisms.banded_mf import default_band, optimal_banded, toeplitz_sensitivity
from dpfl.privacy.mechanisms.tree_aggregation import Estimator, tree_sensitivity

FloatArray = NDArray[np.float64]
CORRELATED_RELATION = "add-remove"
TREE_ESTIMATOR: Estimator = "efficient"


def schema_of(cfg: RunConfig) -> ParticipationSchema:
    """The run's participation schema (rounds 1..num-rounds)."""
    return ParticipationSchema(cfg.num_rounds, cfg.max_participations, cfg.min_separation,
                               first_round=1)


def band_of(cfg: RunConfig) -> int:
    """``central-band``, or (0) the largest band the exact accounting allows."""
    schema = schema_of(cfg)
    return min(cfg.central_band or default_band(schema), schema.rounds)


@dataclass(frozen=True)
class CorrelatedCharge:
    """A correlated-noise run's noise and per-participation charge.

    ``sensitivity``: sens_k of C under the schema (exact); ``charged_sensitivity``: sqrt of
    the most any allowed pattern is charged (= ``sensitivity``: sigma is calibrated to
    it); ``weights2[t - 1]``: w_t^2 of round t;
    ``noise_std``: sigma in units of C; ``coefficients``: banded C's (empty for the tree)."""

    mode: str
    schema: ParticipationSchema
    sensitivity: float
    charged_sensitivity: float
    weights2: tuple[float, ...]
    noise_std: float
    coefficients: tuple[float, ...] = ()
    restart_every: int | None = None
    proportional_exact: bool = True
    # the tree when proportional charging is no bound: the whole run at the first
    # participation, nothing at the later ones
    first_only: bool = False

    def multiplier(self, server_round: int) -> float:
        """The noise multiplier sigma / w_t a participation in ``server_round`` is charged."""
        w2 = self.weights2[server_round - self.schema.first_round]
        return self.noise_std / math.sqrt(w2)

    def event(self, server_round: int) -> PrivacyEvent:
        """One participation in ``server_round``: a Gaussian (rate 1, add-remove)."""
        return PrivacyEvent.gaussian(server_round, self.multiplier(server_round),
                                     relation=CORRELATED_RELATION)

    def charges(self, server_round: int, prior: int) -> list[PrivacyEvent]:
        """What a participation in ``server_round`` costs a client that took part
        ``prior`` times before (none for a later participation under ``first_only``)."""
        if self.first_only and prior > 0:
            return []
        return [self.event(server_round)]

    def worst_epsilon(self, delta: float, accountant: str) -> float:
        """epsilon of the most-charged client: the Gaussian at sigma / charged sensitivity."""
        return correlated_epsilon(self.noise_std, self.charged_sensitivity, delta, accountant)

    def statement(self) -> str:
        """The charge in words (for the guarantee's scope)."""
        if self.mode == "banded-mf":
            how = ("each participation charged a Gaussian at sigma / ||C[:, t]|| (columns the "
                   "schema lets one client share are orthogonal: the composed charge is each "
                   "client's own mechanism exactly)")
        elif self.proportional_exact:
            how = ("each participation charged a Gaussian at sigma sqrt(k) / sensitivity "
                   "(proportional charging is a valid bound here: sens_m^2 <= (m / k) "
                   "sens_k^2 for every m, computed exactly)")
        else:
            how = ("proportional charging is no bound for this schema (sens_m^2 > (m / k) "
                   "sens_k^2 for some m < k), so a client is charged the whole run's "
                   "Gaussian (sigma / sensitivity) at its first participation and nothing "
                   "after: conservative for a client that takes part fewer than k times")
        return (f"sensitivity of C under the schema {self.sensitivity:.6g} C, noise std "
                "sigma = "
                f"{self.noise_std:.6g} C; " + how)


def tree_pattern_sensitivities(schema: ParticipationSchema,
                               restart_every: int | None = None) -> list[float]:
    """sens_m for m = 1..k_eff (the worst pattern of at most m participations)."""
    return [tree_sensitivity(dataclasses.replace(schema, max_participations=m), restart_every)
            for m in range(1, schema.effective_participations + 1)]


def tree_proportional_valid(sensitivities: list[float]) -> bool:
    """Whether sens_m^2 <= (m / k) sens_k^2 for every m (``sensitivities``: sens_1..sens_k)."""
    k = len(sensitivities)
    top = sensitivities[-1] ** 2 / k
    return all(s * s / m <= top * (1 + 1e-12)
               for m, s in enumerate(sensitivities, start=1))


def banded_weights2(coefficients: FloatArray | tuple[float, ...], rounds: int) -> FloatArray:
    """||C[:, t]||^2 of the banded Toeplitz C for t = 0..n-1 (the last band - 1 columns
    are cut off by the end of the run)."""
    c = np.asarray(coefficients, dtype=np.float64)
    sq = np.cumsum((c * c)[:rounds])
    return np.array([sq[min(c.size, rounds - t) - 1] for t in range(rounds)])


def correlated_charge(cfg: RunConfig) -> CorrelatedCharge:
    """The run's :class:`CorrelatedCharge` (``central-noise=tree|banded-mf``): sigma is
    ``noise-multiplier`` when set, else calibrated to ``target-epsilon`` at the charged
    sensitivity."""
    return _charge(cfg.central_noise, cfg.num_rounds, cfg.max_participations,
                   cfg.min_separation, band_of(cfg) if cfg.central_noise == "banded-mf" else 0,
                   cfg.tree_restart, cfg.noise_multiplier, cfg.target_epsilon, cfg.delta,
                   cfg.accountant)


@lru_cache(maxsize=16)
def _charge(mode: str, rounds: int, k: int, b: int, band: int, restart: int,
            noise_multiplier: float, target: float, delta: float,
            accountant: str) -> CorrelatedCharge:
    schema = ParticipationSchema(rounds, k, b, first_round=1)
    restart_every = restart or None
    coefficients: tuple[float, ...] = ()
    first_only = False
    if mode == "tree":
        sensitivities = tree_pattern_sensitivities(schema, restart_every)
        sens, exact = sensitivities[-1], tree_proportional_valid(sensitivities)
        first_only = not exact
        w2 = sens * sens if first_only else sens * sens / schema.effective_participations
        weights2 = tuple([w2] * rounds)
        charged = sens
    elif mode == "banded-mf":
        fact = optimal_banded(rounds, band, schema.effective_participations)
        coefficients = tuple(float(v) for v in fact.coefficients)
        sens = toeplitz_sensitivity(fact.coefficients, schema)
        weights2 = tuple(float(v) for v in banded_weights2(fact.coefficients, rounds))
        # the most any allowed pattern is charged: the DP over the column norms (exact)
        worst, _ = max_separated_sum(np.array(weights2), k, b)
        charged, exact = math.sqrt(worst), True
    else:
        raise ValueError(f"central-noise must be 'tree' or 'banded-mf', got {mode!r}")
    sigma = (noise_multiplier if noise_multiplier > 0 else
             calibrate_noise_std(target, delta, charged, accountant))
    return CorrelatedCharge(mode, schema, sens, charged, weights2, sigma, coefficients,
                            restart_every, exact, first_only)
