"""Privacy auditing with one training run (Steinke, Nasr & Jagielski, "Privacy Auditing
with One (1) Training Run", NeurIPS 2023).

The audit: m canaries, each included in the training input independently with probability
1/2 (:mod:`dpfl.privacy.audit.canaries`). After the single run the auditor scores every canary,
guesses "included" for the k+ highest scores and "excluded" for the k- lowest, abstains on
the rest (r = k+ + k- guesses), and counts the v correct guesses. If the run was
(epsilon, delta)-DP with respect to each canary, v cannot be much larger than it would be
for randomised response with accuracy e^eps / (1 + e^eps); :func:`epsilon_lower_bound`
turns an observed v into the largest epsilon that this rejects at the given confidence,
i.e. a statistically valid LOWER bound on the run's epsilon. An audit can therefore expose
a broken DP implementation (a lower bound above the claimed epsilon), never certify one.

:func:`gaussian_epsilon` and :func:`audit_gaussian_mechanism` are the validation: a
Gaussian mechanism of known, exact epsilon, audited the same way; the lower bound must stay
below it (and come close to it only with many canaries).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats
import torch

from dpfl.privacy.audit.canaries import canary_bits

# Default abstention levels: k+ = k- = m // d for each d (2 = no abstention, r = m).
DEFAULT_DIVISORS = (2, 4, 10, 20, 50, 100)
# Bisection steps of the paper's procedure (precision eps_max / 2**30).
_BISECTION_STEPS = 30
# Domain-separation constants of the validation experiment's own streams (see canaries).
_DOMAIN_NOISE = 0x41554e31  # "AUN1": the Gaussian noise of the audited mechanism
_DOMAIN_FRAME = 0x41554631  # "AUF1": the orthonormal canary frame (``dim`` given)


@dataclass(frozen=True)
class AuditResult:
    """Outcome of :func:`audit_scores`: the reported (largest) lower bound and the guess
    counts that gave it; ``confidence`` is the family-wise confidence over all ``tried``
    candidates, each tested at the Bonferroni level; ``tried`` holds one
    ``(k_plus, k_minus, r, v, epsilon_lower)`` per candidate."""

    epsilon_lower: float
    m: int
    r: int
    v: int
    k_plus: int
    k_minus: int
    confidence: float
    tried: tuple[tuple[int, int, int, int, float], ...]


def _check_counts(m: int, r: int, v: int) -> None:
    if not (0 <= v <= r <= m):
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P-value of observing >= v correct out of r guesses (m canaries) if the algorithm is
    (epsilon, delta)-DP: the tail bound of Steinke, Nasr & Jagielski 2023's main theorem,

        P[V >= v] <= P[Binomial(r, q) >= v] + 2 m delta * alpha,   q = e^eps / (1 + e^eps),
        alpha = max_{i = 1..v} P[v - i <= Binomial(r, q) < v] / i,

    computed exactly as the paper's appendix procedure does (its loop over i replaced by a
    cumulative sum over the same terms, in the same order), capped at 1."""
    _check_counts(m, r, v)
    if epsilon < 0 or not (0.0 <= delta <= 1.0):
        raise ValueError(f"need epsilon >= 0 and 0 <= delta <= 1, got {epsilon}, {delta}")
    q = float(scipy.special.expit(epsilon))  # accuracy of epsilon-DP randomised response
    beta = float(scipy.stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    alpha = 0.0
    if v >= 1 and delta > 0:
        # term i (1-based) = P[v > Binomial(r, q) >= v - i] = sum_{j=1..i} pmf(v - j)
        cum = np.cumsum(scipy.stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))
        alpha = max(0.0, float(np.max(cum / np.arange(1, v + 1))))
    return min(beta + alpha * delta * 2 * m, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float,
                        confidence: float = 0.95) -> float:
    """The epsilon lower bound of Steinke, Nasr & Jagielski 2023 (one training run).

    m canaries, each included independently with probability 1/2; r guesses (m - r
    abstentions), v of them correct. Returns the largest epsilon (on the bisection grid)
    such that "the algorithm is (epsilon, delta)-DP" is rejected at level
    ``1 - confidence``, i.e. with ``p_value(m, r, v, epsilon, delta) < 1 - confidence``.

    What is implemented: the paper's appendix procedure, reproduced faithfully. Its p-value
    (:func:`p_value`) is the main theorem's tail bound: for an (epsilon, delta)-DP
    algorithm the number of correct guesses is stochastically dominated by
    Binomial(r, e^eps / (1 + e^eps)) up to the additive delta term
    2 m delta * max_i P[v - i <= Binomial(r, q) < v] / i. The search is the paper's too:
    eps_max grows by 1 from 1 until the p-value reaches ``1 - confidence``, then 30
    bisection steps on [0, eps_max]; the lower end (where the null is still rejected) is
    returned, so the result errs low by at most eps_max / 2**30.

    Short cuts (the same value the procedure returns): 0 when r = 0 or v <= r / 2 (at
    epsilon = 0 the p-value is already >= 1/2). ``confidence`` must lie in [0.5, 1).
    """
    _check_counts(m, r, v)
    if not (0.0 <= delta <= 1.0):
        raise ValueError(f"need 0 <= delta <= 1, got {delta}")
    if not (0.5 <= confidence < 1.0):
        raise ValueError(f"need 0.5 <= confidence < 1, got {confidence}")
    if r == 0 or 2 * v <= r:
        return 0.0
    level = 1.0 - confidence
    eps_min, eps_max = 0.0, 1.0  # p(eps_min) < level (or eps_min = 0), p(eps_max) >= level
    while p_value(m, r, v, eps_max, delta) < level:
        eps_max += 1.0
    for _ in range(_BISECTION_STEPS):
        eps = (eps_min + eps_max) / 2
        if p_value(m, r, v, eps, delta) < level:
            eps_min = eps
        else:
            eps_max = eps
    return eps_min


def guesses_from_scores(scores: torch.Tensor, k_plus: int, k_minus: int) -> torch.Tensor:
    """Guesses from scores (higher = more likely included): +1 (included) for the k_plus
    highest, -1 (excluded) for the k_minus lowest, 0 (abstain) for the rest; int8 tensor.
    Ties are broken by index (stable sort), never by the secret bits."""
    s = torch.as_tensor(scores).detach().reshape(-1).to(torch.float64)
    m = s.numel()
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
        raise ValueError(f"need k_plus, k_minus >= 0 and k_plus + k_minus <= m = {m}, "
                         f"got {k_plus}, {k_minus}")
    if torch.isnan(s).any():
        raise ValueError("scores contain NaN")
    order = torch.argsort(s, stable=True)  # ascending
    guesses = torch.zeros(m, dtype=torch.int8)
    guesses[order[:k_minus]] = -1
    if k_plus:
        guesses[order[m - k_plus:]] = 1
    return guesses


def default_guess_counts(m: int) -> tuple[tuple[int, int], ...]:
    """The default candidates (k_plus, k_minus): no abstention (m // 2, m - m // 2), then
    k+ = k- = m // d for d in 4, 10, 20, 50, 100, clipped to [1, m // 2], deduplicated."""
    out: list[tuple[int, int]] = []
    for d in DEFAULT_DIVISORS:
        if d == 2:
            pair = (m // 2, m - m // 2)
        else:
            k = min(max(1, m // d), m // 2)
            pair = (k, k)
        if sum(pair) > 0 and pair not in out:
            out.append(pair)
    return tuple(out)


def audit_scores(scores: torch.Tensor, included: torch.Tensor, delta: float,
                 confidence: float = 0.95,
                 guess_counts: Sequence[tuple[int, int]] | None = None) -> AuditResult:
    """Audit one run from its canary scores (Steinke, Nasr & Jagielski 2023).

    ``included`` holds the secret inclusion bits. Every candidate (k_plus, k_minus) of
    ``guess_counts`` (default :func:`default_guess_counts`) is scored and bounded with
    :func:`epsilon_lower_bound` at confidence ``1 - (1 - confidence) / len(candidates)``;
    the largest bound is reported. By the union (Bonferroni) bound, choosing the best
    candidate after seeing the outcome keeps the reported bound valid at ``confidence``,
    provided the candidate list and the scores were fixed without looking at the bits.
    """
    s = torch.as_tensor(scores).detach().reshape(-1).to(torch.float64)
    inc = torch.as_tensor(included).detach().reshape(-1).to(torch.bool)
    m = s.numel()
    if inc.numel() != m:
        raise ValueError(f"{m} scores but {inc.numel()} inclusion bits")
    candidates = tuple(default_guess_counts(m) if guess_counts is None
                       else ((int(a), int(b)) for a, b in guess_counts))
    if not candidates:
        raise ValueError("no candidate guess counts")
    per_test = 1.0 - (1.0 - confidence) / len(candidates)
    tried: list[tuple[int, int, int, int, float]] = []
    for k_plus, k_minus in candidates:
        g = guesses_from_scores(s, k_plus, k_minus)
        r = int((g != 0).sum())
        v = int(((g == 1) & inc).sum() + ((g == -1) & ~inc).sum())
        tried.append((k_plus, k_minus, r, v,
                      epsilon_lower_bound(m, r, v, delta, per_test)))
    best = max(tried, key=lambda t: t[4])  # first of the largest
    return AuditResult(epsilon_lower=best[4], m=m, r=best[2], v=best[3], k_plus=best[0],
                       k_minus=best[1], confidence=confidence, tried=tuple(tried))


def _gaussian_delta(epsilon: float, sigma: float) -> float:
    """delta(epsilon) of the Gaussian mechanism, sensitivity 1, noise sigma (Balle & Wang
    2018, Thm 8): Phi(1/(2 sigma) - eps sigma) - e^eps Phi(-1/(2 sigma) - eps sigma),
    written as Phi(x1) (1 - exp(eps + log Phi(x2) - log Phi(x1))) to avoid cancellation."""
    a = 1.0 / (2.0 * sigma)
    log1 = float(scipy.special.log_ndtr(a - epsilon * sigma))
    log2 = float(scipy.special.log_ndtr(-a - epsilon * sigma))
    return math.exp(log1) * -math.expm1(epsilon + log2 - log1)


def gaussian_epsilon(sigma: float, delta: float) -> float:
    """Exact epsilon(delta) of one Gaussian mechanism with L2 sensitivity 1 and noise
    N(0, sigma^2) (the analytic Gaussian mechanism of Balle & Wang 2018, solved for
    epsilon with Brent's method to ~1e-12); inf for sigma = 0 or delta = 0, 0 when delta
    is at least the total variation distance. The reference the audits are checked
    against (Steinke, Nasr & Jagielski 2023 validate their bound the same way)."""
    if sigma < 0 or not (0.0 <= delta <= 1.0):
        raise ValueError(f"need sigma >= 0 and 0 <= delta <= 1, got {sigma}, {delta}")
    if sigma == 0 or delta == 0:
        return math.inf
    if delta >= _gaussian_delta(0.0, sigma):
        return 0.0
    hi = 1.0
    while _gaussian_delta(hi, sigma) > delta:
        hi *= 2.0
    return float(scipy.optimize.brentq(lambda e: _gaussian_delta(e, sigma) - delta,
                                       0.0, hi, xtol=1e-12, rtol=1e-14))


def _rng(seed: int, domain: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(
        np.random.SeedSequence(int(seed), spawn_key=(domain,))))


def audit_gaussian_mechanism(sigma: float, m: int, delta: float, seed: int,
                             dim: int | None = None, confidence: float = 0.95,
                             guess_counts: Sequence[tuple[int, int]] | None = None
                             ) -> AuditResult:
    """Validation experiment of Steinke, Nasr & Jagielski 2023: audit a Gaussian mechanism.

    m canaries with secret bits b = :func:`canary_bits` (seed, m). The release is
    sum_i b_i u_i + N(0, sigma^2 I) for orthonormal u_i; one canary moves it by a unit
    vector, so it is exactly a Gaussian mechanism with sensitivity 1 and
    epsilon = :func:`gaussian_epsilon` (sigma, delta) per canary. Scores are
    <release, u_i>. With ``dim=None`` the equivalent per-canary form is drawn directly,
    score_i = b_i + N(0, sigma^2); with ``dim`` (>= m) the release is built in R^dim on a
    seeded random orthonormal frame (QR of a Gaussian matrix). sigma = 0 is the no-DP case
    (scores equal the bits). Returns :func:`audit_scores` of the scores.
    """
    if sigma < 0:
        raise ValueError(f"need sigma >= 0, got {sigma}")
    bits = canary_bits(seed, m)
    b = bits.numpy().astype(np.float64)
    noise_rng = _rng(seed, _DOMAIN_NOISE)
    if dim is None:
        scores = b + sigma * noise_rng.standard_normal(m)
    else:
        if dim < m:
            raise ValueError(f"need dim >= m for orthonormal canaries, got {dim} < {m}")
        frame, _ = np.linalg.qr(_rng(seed, _DOMAIN_FRAME).standard_normal((dim, m)))
        release = frame @ b + sigma * noise_rng.standard_normal(dim)
        scores = frame.T @ release
    return audit_scores(torch.from_numpy(scores), bits, delta, confidence, guess_counts)
