"""The distributed Skellam mechanism: integer noise shares that sum to one exact mechanism.

Agarwal, Kairouz & Liu, "The Skellam Mechanism for Differentially Private Federated
Learning", NeurIPS 2021. Each client scales its clipped update by ``s`` (integer units per
unit of C), rounds it at random to integers and adds Skellam noise Sk(mu_i) =
Poisson(mu_i / 2) - Poisson(mu_i / 2) (variance mu_i per coordinate). A sum of independent
Skellams is a Skellam, so the secure sum of m >= n_min survivors carries exactly
Sk(sum_i mu_i), variance >= mu = n_min mu_i: no continuous-noise approximation and no
rounding of the noise (it is added after the quantisation, in the integers).

Guarantee (Theorem 3.5 / Corollary 3.6 of the paper): for integer orders alpha > 1 the
release of an integer vector with L2 sensitivity D2 and L1 sensitivity D1 plus Sk(mu) per
coordinate is (alpha, eps(alpha))-RDP with

    eps(alpha) <= alpha D2^2 / (2 mu) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 mu^2),
                                             3 D1 / (2 mu)).

The first term is the Gaussian mechanism's with multiplier sqrt(mu) / D2; the second is
the price of discreteness (tiny at dpfl's scales, see :func:`discreteness_surcharge`).
Randomised rounding moves every coordinate by less than 1, so a clipped update of norm
<= C becomes an integer vector of norm <= B = C s + sqrt(d) (always, no conditioning);
under add-remove D2 = B, under replace-one D2 = 2 B, and D1 <= min(sqrt(d) D2, D2^2) (an
integer vector's L1 norm is at most its squared L2 norm).

dpfl charges one event per round (:func:`skellam_event`): mechanism ``skellam`` with
``sigma`` = sqrt(mu) / B (the Gaussian-equivalent multiplier per unit sensitivity, halved
under replace-one like every Gaussian event) and ``epsilon`` = the discreteness surcharge
at the largest order used (it grows with alpha, so the curve alpha / (2 sigma^2) +
surcharge bounds the theorem's at every integer order used; fractional orders, which the
theorem does not cover, get an infinite curve).
"""

from __future__ import annotations

import math

import torch

from dpfl.privacy.accounting.events import PrivacyEvent

# the largest RDP order dpfl's client-level accountant uses (dp-accounting's grid)
MAX_ORDER = 1024


def rounded_norm_bound(clip: float, scale: float, dim: int) -> float:
    """B = C s + sqrt(d): the L2 norm bound of a randomly rounded, scaled clipped update."""
    return clip * scale + math.sqrt(dim)


def sensitivities(clip: float, scale: float, dim: int, relation: str) -> tuple[float, float]:
    """(D2, D1) of the integer update sum under ``relation`` (see module docstring)."""
    bound = rounded_norm_bound(clip, scale, dim)
    d2 = 2.0 * bound if relation == "replace-one" else bound
    return d2, min(math.sqrt(dim) * d2, d2 * d2)


def skellam_rdp(alpha: float, d2: float, d1: float, mu: float) -> float:
    """Agarwal, Kairouz & Liu 2021, Thm 3.5: RDP of order ``alpha`` (integer > 1) of the
    Skellam mechanism with variance ``mu`` per coordinate; ``inf`` at other orders."""
    if alpha <= 1 or alpha != int(alpha):
        return math.inf
    return alpha * d2 ** 2 / (2 * mu) + min(((2 * alpha - 1) * d2 ** 2 + 6 * d1) / (4 * mu ** 2),
                                           3 * d1 / (2 * mu))


def discreteness_surcharge(d2: float, d1: float, mu: float, max_order: int = MAX_ORDER) -> float:
    """The theorem's second term at the largest order used (it grows with the order)."""
    a = float(max_order)
    return min(((2 * a - 1) * d2 ** 2 + 6 * d1) / (4 * mu ** 2), 3 * d1 / (2 * mu))


def skellam_event(round_: int, noise_multiplier: float, clip: float, scale: float, dim: int,
                  relation: str) -> PrivacyEvent:
    """One round's charge when the secure sum carries Sk(mu) with mu = (sigma C s)^2: the
    Gaussian-equivalent multiplier sqrt(mu) / B and the discreteness surcharge."""
    mu = (noise_multiplier * clip * scale) ** 2
    bound = rounded_norm_bound(clip, scale, dim)
    d2, d1 = sensitivities(clip, scale, dim, relation)
    return PrivacyEvent(round_, "skellam", sigma=math.sqrt(mu) / bound,
                        epsilon=discreteness_surcharge(d2, d1, mu), relation=relation)


def randomized_round(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Unbiased random rounding to int64: floor(x) + Bernoulli(x - floor(x))."""
    floor = torch.floor(x)
    up = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device) < (x - floor)
    return (floor + up.to(x.dtype)).to(torch.int64)


def skellam_noise(shape: torch.Size | tuple[int, ...], variance: float,
                  generator: torch.Generator) -> torch.Tensor:
    """Sk(variance): Poisson(variance / 2) - Poisson(variance / 2), int64."""
    rate = torch.full(tuple(shape), variance / 2.0, dtype=torch.float64)
    a = torch.poisson(rate, generator=generator)
    b = torch.poisson(rate, generator=generator)
    return (a - b).to(torch.int64)


def quantise_with_noise(clipped: torch.Tensor, scale: float, share_variance: float,
                        generator: torch.Generator) -> torch.Tensor:
    """A client's share: round(s x) + Sk(share_variance), int64 (x already clipped)."""
    integer = randomized_round(clipped.to(torch.float64) * scale, generator)
    return integer + skellam_noise(integer.shape, share_variance, generator)


def overflow_bound(clip: float, scale: float, share_variance: float, dim: int,
                   limit: float) -> float:
    """An upper bound on P(some coordinate of a share exceeds ``limit`` in absolute value):
    the integer update contributes at most C s + 1 per coordinate; the rest is a Skellam
    tail, bounded by Bernstein's inequality for the difference of two Poissons
    (2 exp(-t^2 / (2 (v + t / 3))) per coordinate), times d (union bound)."""
    t = limit - clip * scale - 1.0
    if t <= 0:
        return 1.0
    log_p = math.log(2.0 * dim) - t * t / (2.0 * (share_variance + t / 3.0))
    return math.exp(log_p) if log_p < 0 else 1.0
