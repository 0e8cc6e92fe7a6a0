"""The distributed discrete Gaussian (DDGauss): integer noise shares whose sum is accounted
by the paper's own bound (a sum of discrete Gaussians is NOT a discrete Gaussian).

Kairouz, Liu & Steinke, "The Distributed Discrete Gaussian Mechanism for Federated Learning
with Secure Aggregation", ICML 2021. Each client clips its update to C, scales it by ``s``
(integer units per unit of C), rounds it at random to integers and adds discrete Gaussian
noise N_Z(0, sigma_i^2) per coordinate; SecAgg+ reveals only the sum.

Choices made here (the paper's pipeline differs in two places):

- no random rotation / flattening: the paper flattens (randomised Hadamard) so that a few
  bits per coordinate suffice under modular clipping. dpfl's SecAgg+ field is 2^32 with a
  per-share range c that the overflow bound (:func:`overflow_bound`) keeps wrap-free
  except with a probability the run refuses unless it is below 1e-3 delta, exactly as the
  Skellam path does; rotation would only save bits, not change the guarantee;
- UNCONDITIONAL randomised rounding (as dpfl's Skellam path), not the paper's conditional
  rounding: the integer vector's norm is then always <= B = C s + sqrt(d)
  (:func:`dpfl.privacy.mechanisms.skellam.rounded_norm_bound`), no conditioning probability beta.

Sampler (:func:`dpfl.privacy.mechanisms.dgauss_sampler.discrete_gaussian`): Canonne, Kamath &
Steinke, "The Discrete Gaussian for Differential Privacy", NeurIPS 2020, Algorithm 3
(discrete Laplace proposal, rejection to the discrete Gaussian), EXACT and batched: every
coin U < exp(-gamma) compares a lazily drawn uniform real with exp(-gamma), decided by a
float64 filter with a rigorous margin and, in the rare undecided case, by more random bits
and exact rational bounds (see that module). The variance is written sigma^2 = t v with
integers t, v (t = floor(sqrt(target)) + 1, v = ceil(target / t), so sigma^2 >= the
target), which keeps every gamma = (|Y| - v)^2 / (2 t v) a ratio of integers.

Guarantee (Kairouz, Liu & Steinke 2021, Proposition 14 / Eq. 17, the first of its three
terms): for n clients each adding N_Z(0, sigma^2) (sigma >= 1/2) and any integer change
Delta of the sum, for every alpha >= 1

    D_alpha <= alpha ||Delta||_2^2 / (2 n sigma^2) + tau d,
    tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1)).

That is zCDP rho = ||Delta||^2 / (2 n sigma^2) (RDP alpha rho) plus the paper's additive
slack tau d. With m >= n_min survivors the extra m - n_min shares are independent noise
(post-processing), so n = n_min; tau grows with n at a fixed total variance mu = n sigma^2,
so dpfl evaluates it at n = the number of clients of the federation, an upper bound on
n_min that both the clients and the server know. At dpfl's scales (sigma^2 >> 100) tau is
exactly 0 in floating point and the bound is the Gaussian mechanism's.

dpfl charges one event per round (:func:`ddgauss_event`): mechanism ``ddgauss`` with
``sigma`` = sqrt(mu) / B (the Gaussian-equivalent multiplier per unit sensitivity, halved
under replace-one like every Gaussian event) and ``epsilon`` = tau d (the additive slack).
"""

from __future__ import annotations

import math

import torch

from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.mechanisms.dgauss_sampler import discrete_gaussian
from dpfl.privacy.mechanisms.skellam import randomized_round, rounded_norm_bound


def tau(n: int, sigma2: float) -> float:
    """tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1)) (Kairouz, Liu & Steinke
    2021, Theorem 1 / Proposition 14): the price of summing n discrete Gaussians."""
    return 10.0 * math.fsum(math.exp(-2.0 * math.pi ** 2 * sigma2 * k / (k + 1))
                            for k in range(1, n))


def ddgauss_rdp(alpha: float, d2: float, n: int, sigma2: float, dim: int) -> float:
    """Proposition 14's first term: alpha D2^2 / (2 n sigma^2) + tau d (alpha >= 1)."""
    if alpha < 1:
        return math.inf
    return alpha * d2 ** 2 / (2.0 * n * sigma2) + tau(n, sigma2) * dim


def ddgauss_event(round_: int, noise_multiplier: float, clip: float, scale: float, dim: int,
                  relation: str, num_clients: int) -> PrivacyEvent:
    """One round's charge when the secure sum carries n shares N_Z(0, mu / n), mu =
    (sigma C s)^2, with n <= ``num_clients``: the Gaussian-equivalent multiplier
    sqrt(mu) / B and the additive slack tau(n, mu / n) d at n = ``num_clients``."""
    mu = (noise_multiplier * clip * scale) ** 2
    n = max(2, int(num_clients))
    return PrivacyEvent(round_, "ddgauss",
                        sigma=math.sqrt(mu) / rounded_norm_bound(clip, scale, dim),
                        epsilon=tau(n, mu / n) * dim, relation=relation)


def variance_factors(variance: float) -> tuple[int, int]:
    """(t, v) with t = floor(sqrt(variance)) + 1 and v = ceil(variance / t): the sampled
    variance t v >= ``variance`` (more noise than accounted, never less)."""
    if not variance > 0:
        raise ValueError("the discrete Gaussian needs a positive variance")
    t = math.isqrt(math.floor(variance)) + 1
    return t, max(1, math.ceil(variance / t))


def discrete_gaussian_variance(sigma2: float, terms: int | None = None) -> float:
    """Var of N_Z(0, sigma^2) by summing its pmf (a reference for tests and docs)."""
    reach = terms if terms is not None else int(40 * math.sqrt(sigma2)) + 40
    weights = [math.exp(-y * y / (2.0 * sigma2)) for y in range(-reach, reach + 1)]
    return math.fsum(w * y * y for w, y in zip(weights, range(-reach, reach + 1))) / math.fsum(
        weights)


def quantise_with_noise(clipped: torch.Tensor, scale: float, share_variance: float,
                        generator: torch.Generator) -> torch.Tensor:
    """A client's share: round(s x) + N_Z(0, t v) with t v >= ``share_variance``, int64."""
    integer = randomized_round(clipped.to(torch.float64) * scale, generator)
    t, v = variance_factors(share_variance)
    return integer + discrete_gaussian(integer.shape, t, v, generator)


def overflow_bound(clip: float, scale: float, share_variance: float, dim: int,
                   limit: float) -> float:
    """An upper bound on P(some coordinate of a share exceeds ``limit`` in absolute value):
    the integer update contributes at most C s + 1 per coordinate; the discrete Gaussian
    is sub-Gaussian with variance proxy sigma^2 (CKS 2020, Proposition 19: E[exp(lambda X)]
    <= exp(lambda^2 sigma^2 / 2)), so P(|X| >= t) <= 2 exp(-t^2 / (2 sigma^2)), times d
    (union bound). sigma^2 is the SAMPLED variance t v."""
    t_, v_ = variance_factors(share_variance)
    gap = limit - clip * scale - 1.0
    if gap <= 0:
        return 1.0
    log_p = math.log(2.0 * dim) - gap * gap / (2.0 * t_ * v_)
    return math.exp(log_p) if log_p < 0 else 1.0
