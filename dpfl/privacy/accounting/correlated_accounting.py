"""Sensitivity and epsilon of a matrix-factorization (correlated-noise) mechanism under a
participation schema, without sampling.

The mechanism (Choquette-Choo, McMahan, Rush & Thakurta, "Multi-Epoch Matrix Factorization
Mechanisms for Private Machine Learning", ICML 2023, Sec. 2; written MMRT23 below) releases
the prefix sums ``A x`` of the per-round clipped sums ``x`` (n rounds x model dimension d) as
``B (C x + z)`` with ``A = B C`` and ``z`` i.i.d. N(0, sigma^2). Privacy is that of ONE
Gaussian mechanism on ``x -> C x``: its sensitivity over neighbouring datasets, one client
added or removed (add-remove; each participation moves ``x`` by a vector of norm <= 1 in
units of the clipping bound), is

    sens(C) = max over patterns pi of  max_{||g_i|| <= 1}  || sum_{i in pi} C[:, i] g_i^T ||_F

    sens(C)^2 = max_pi max_g  sum_{i, j in pi} X_ij <g_i, g_j>,   X = C^T C   (MMRT23, Eq. 3).

- If every entry of X is >= 0, all g_i equal (one direction, full norm) is worst, so
  sens(C)^2 = max_pi u_pi^T X u_pi with u_pi the 0/1 participation vector (MMRT23, Thm. 2.1).
- In general, sum_{i,j in pi} |X_ij| is an upper bound and the best sign choice
  (g_i = s_i e, s in {-1, +1}^pi) a lower bound; the true value (an SDP over the Gram matrix
  of the g_i) lies between. :func:`sensitivity_bruteforce` reports both.
- If X_ij = 0 whenever |i - j| >= b (e.g. C lower triangular with at most b nonzero
  diagonals, "b-banded") and the schema has b-min-separation, the cross terms vanish for
  every pattern and sens(C)^2 = max_pi sum_{i in pi} ||C[:, i]||^2 exactly, whatever the
  signs (Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu, "(Amplified)
  Banded Matrix Factorization", NeurIPS 2023, the banded sensitivity theorem; a dynamic
  program over the diagonal, their Alg. 3): :func:`banded_sensitivity`.

Epsilon: dp-accounting's Gaussian mechanism at noise multiplier sigma / (sens x clip),
composed once, PLD or RDP (:mod:`dpfl.privacy.accounting.accountants`); no amplification claimed.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from dpfl.privacy.accounting import accountants as accounting
from dpfl.privacy.accounting.participation import ParticipationSchema

FloatArray = NDArray[np.float64]
# |X_ij| below this (relative to max |X|) counts as zero in the structural checks
ZERO_TOL = 1e-12
# sensitivity_bruteforce refuses schemas with more patterns than this
MAX_PATTERNS = 2_000_000


@dataclass(frozen=True)
class Sensitivity:
    """L2 sensitivity of ``x -> C x`` under a schema, in units of the clipping bound.

    ``value`` is always a valid (sound) sensitivity: the exact one when ``exact``, else the
    upper bound; ``lower`` is attained by some pattern and sign choice; ``pattern`` is a
    worst-case participation pattern (0-based rounds) for ``lower``."""

    value: float
    exact: bool
    lower: float
    pattern: tuple[int, ...]
    method: str


def gram(encoder: ArrayLike) -> FloatArray:
    """X = C^T C of an encoder C (rows: noise coordinates, columns: rounds)."""
    c = np.asarray(encoder, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"the encoder must be a matrix, got shape {c.shape}")
    return c.T @ c


def is_nonnegative_gram(encoder: ArrayLike, tol: float = ZERO_TOL) -> bool:
    """Whether every entry of C^T C is >= 0 (up to ``tol`` x max |X|): then the worst case
    puts every participation in the same direction (MMRT23, Thm. 2.1)."""
    x = gram(encoder)
    scale = float(np.max(np.abs(x))) if x.size else 0.0
    return bool(np.all(x >= -tol * scale))


def max_separated_sum(weights: ArrayLike, max_count: int,
                      min_separation: int) -> tuple[float, tuple[int, ...]]:
    """max sum_{i in S} w_i over index sets S of at most ``max_count`` indices, any two at
    least ``min_separation`` apart (the empty set gives 0), and one best S.

    A dynamic program in O(n k) ("(Amplified) Banded MF", Alg. 3, VecSens): F_j[i], the
    best with at most j indices from i on, is max(F_j[i + 1], w_i + F_{j-1}[i + b])."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError("weights must be a vector")
    if max_count < 0 or min_separation < 1:
        raise ValueError("max_count must be >= 0 and min_separation >= 1")
    n, b = w.size, min_separation
    tables = [np.zeros(n + b + 1)]
    for _ in range(max_count):
        prev = tables[-1]
        cur = np.zeros(n + b + 1)
        cur[:n] = w + prev[b:b + n]
        cur[:n + 1] = np.maximum.accumulate(cur[:n + 1][::-1])[::-1]
        tables.append(cur)
    chosen: list[int] = []
    i, j = 0, max_count
    while j > 0 and i < n:
        if tables[j][i] == tables[j][i + 1]:
            i += 1
        else:
            chosen.append(i)
            i, j = i + b, j - 1
    return float(tables[max_count][0]), tuple(chosen)


def banded_sensitivity(encoder: ArrayLike, schema: ParticipationSchema,
                       tol: float = ZERO_TOL) -> float:
    """Exact sensitivity of C when its columns i, j with |i - j| >= b are orthogonal (C^T C
    is zero off its 2b - 1 central diagonals; true for a lower-triangular C with at most b
    nonzero diagonals) under b-min-separation: sqrt(max_pi sum_{i in pi} ||C[:, i]||^2)
    ("(Amplified) Banded MF", banded sensitivity theorem). ValueError when the structure
    does not hold (or the schema has a single participation: then any C qualifies)."""
    x = gram(encoder)
    n = x.shape[0]
    if n != schema.rounds:
        raise ValueError(f"the encoder has {n} columns, the schema {schema.rounds} rounds")
    b = schema.min_separation
    if schema.effective_participations > 1:
        i, j = np.indices(x.shape)
        off = np.abs(x[np.abs(i - j) >= b])
        scale = float(np.max(np.abs(x))) if x.size else 0.0
        if off.size and float(off.max()) > tol * scale:
            raise ValueError(f"columns of C at distance >= {b} (the schema's separation) "
                             "are not orthogonal: the banded closed form does not apply")
    value, _ = max_separated_sum(np.diag(x), schema.max_participations, b)
    return math.sqrt(value)


def sensitivity_upper_bound(encoder: ArrayLike, schema: ParticipationSchema) -> float:
    """A valid upper bound for any C: sqrt(max_pi sum_{i in pi} max_pi' sum_{j in pi'}
    |X_ij|) (rows and columns chosen independently; "(Amplified) Banded MF", Alg. 4).
    O(n^2 k). Not tight even for banded C: a row's best pattern may take two columns on
    either side of the diagonal (random banded C in the tests: up to 6 % above)."""
    x = np.abs(gram(encoder))
    k, b = schema.max_participations, schema.min_separation
    rows = np.array([max_separated_sum(row, k, b)[0] for row in x])
    return math.sqrt(max_separated_sum(rows, k, b)[0])


def sensitivity_bruteforce(encoder: ArrayLike, schema: ParticipationSchema,
                           max_patterns: int = MAX_PATTERNS) -> Sensitivity:
    """Sensitivity of C by enumerating every feasible pattern (small cases, tests).

    With C^T C >= 0 entrywise: exact, max_pi u^T X u. Otherwise: upper bound
    max_pi sum |X_pi,pi|, lower bound max_pi max_signs s^T X_pi,pi s; ``exact`` when they
    meet (to 1e-12 relative)."""
    x = gram(encoder)
    if x.shape[0] != schema.rounds:
        raise ValueError(f"the encoder has {x.shape[0]} columns, the schema "
                         f"{schema.rounds} rounds")
    count = schema.count_patterns()
    if count > max_patterns:
        raise ValueError(f"{count} participation patterns, more than max_patterns="
                         f"{max_patterns}; use a closed form or an upper bound")
    nonneg = is_nonnegative_gram(encoder)
    best_lo, best_hi = 0.0, 0.0
    worst: tuple[int, ...] = ()
    for pattern in schema.patterns(maximal_only=nonneg):
        sub = x[np.ix_(pattern, pattern)]
        if nonneg:
            lo = hi = float(sub.sum())
        else:
            hi = float(np.abs(sub).sum())
            lo = _best_signs(sub)
        if lo > best_lo:
            best_lo, worst = lo, pattern
        best_hi = max(best_hi, hi)
    exact = nonneg or best_hi - best_lo <= 1e-12 * max(best_hi, 1.0)
    method = ("brute force, C^T C >= 0 (same direction is worst)" if nonneg
              else "brute force, signed: upper = sum |X|, lower = best signs")
    return Sensitivity(math.sqrt(best_hi), exact, math.sqrt(best_lo), worst, method)


def _best_signs(sub: FloatArray) -> float:
    m = sub.shape[0]
    if m == 1:
        return float(sub[0, 0])
    signs = np.array([(1.0,) + s for s in itertools.product((1.0, -1.0), repeat=m - 1)])
    return float(np.max(np.einsum("pi,ij,pj->p", signs, sub, signs)))


def prefix_error(decoder: ArrayLike, sensitivity: float,
                 objective: str = "rms") -> float:
    """Error of the released prefix sums at noise multiplier 1 (sigma = sensitivity, in
    units of the clipping bound), the scale-free figure of merit of MMRT23 Sec. 2:
    ``rms``: sens x sqrt(||B||_F^2 / n); ``max``: sens x max_t ||B[t]||."""
    b = np.asarray(decoder, dtype=np.float64)
    rows = np.sum(b * b, axis=1)
    if objective == "rms":
        return sensitivity * math.sqrt(float(rows.mean()))
    if objective == "max":
        return sensitivity * math.sqrt(float(rows.max()))
    raise ValueError(f"objective must be 'rms' or 'max', got {objective!r}")


def gaussian_epsilon(noise_multiplier: float, delta: float, accountant: str = "pld") -> float:
    """Epsilon of ONE Gaussian release at ``noise_multiplier`` = sigma / (sensitivity x clip)
    with dp-accounting (``GaussianDpEvent``, add-remove, no sampling): the whole run of a
    factorized mechanism is that one release (MMRT23, Sec. 2)."""
    if not noise_multiplier > 0:
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
    return accounting.gaussian_epsilon(noise_multiplier, 1, delta, accountant=accountant)


def correlated_epsilon(noise_std: float, sensitivity: float, delta: float,
                       accountant: str = "pld", clip_norm: float = 1.0) -> float:
    """Epsilon of the mechanism B (C x + z), z ~ N(0, noise_std^2), whose C has
    ``sensitivity`` (units of ``clip_norm``) under the run's schema."""
    if not sensitivity > 0 or not clip_norm > 0:
        raise ValueError("sensitivity and clip_norm must be > 0")
    return gaussian_epsilon(noise_std / (sensitivity * clip_norm), delta, accountant)


def calibrate_noise_std(target_epsilon: float, delta: float, sensitivity: float,
                        accountant: str = "pld", clip_norm: float = 1.0,
                        rel_tol: float = 1e-4) -> float:
    """Smallest noise std (to ``rel_tol``) whose :func:`correlated_epsilon` meets
    ``target_epsilon``: the Gaussian noise multiplier found by bisection over dp-accounting
    (:func:`dpfl.privacy.accounting.accountants.calibrate_noise`, one release) x sensitivity x clip."""
    if not sensitivity > 0 or not clip_norm > 0:
        raise ValueError("sensitivity and clip_norm must be > 0")
    z = accounting.calibrate_noise(float(target_epsilon), float(delta), 1,
                                   accountant=accountant, rel_tol=rel_tol)
    return z * sensitivity * clip_norm
