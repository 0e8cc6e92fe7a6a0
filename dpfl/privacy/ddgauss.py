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
  (:func:`dpfl.privacy.skellam.rounded_norm_bound`), no conditioning probability beta.

Sampler (:func:`discrete_gaussian`): Canonne, Kamath & Steinke, "The Discrete Gaussian for
Differential Privacy", NeurIPS 2020, Algorithms 1-3 (Bernoulli(exp(-gamma)), discrete
Laplace, rejection to the discrete Gaussian), EXACT: every coin is a comparison of a
uniform integer with an integer, no floating point. The variance is written sigma^2 = t v
with integers t, v (t = floor(sqrt(target)) + 1, v = ceil(target / t), so sigma^2 >= the
target), which keeps every acceptance ratio (|Y| - v)^2 / (2 t v) a ratio of int64s; the
rare candidate whose numbers would not fit int64 is decided with Python integers.

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

from dpfl.privacy.events import PrivacyEvent
from dpfl.privacy.skellam import randomized_round, rounded_norm_bound

# uniform integers are drawn below 2^62 (two exact 31-bit halves), so every bound b of a
# Bernoulli(a / b) coin must stay below it; larger cases go to Python integers
_WORD = 1 << 62
_HALF = 1 << 31


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


# -- the exact sampler (Canonne, Kamath & Steinke 2020) ---------------------------------

def _uniform_below(bound: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Uniform integers in [0, bound) per element (int64, 1 <= bound < 2^62), exactly: two
    31-bit halves give a uniform word below 2^62, rejected above the largest multiple of
    the bound."""
    if bound.numel() and int(bound.max()) >= _WORD:
        raise OverflowError("a Bernoulli bound reached 2^62 (variance too large)")
    out = torch.empty_like(bound)
    todo = torch.arange(bound.numel())
    while todo.numel():
        b = bound[todo]
        word = (torch.randint(0, _HALF, b.shape, generator=gen, dtype=torch.int64) * _HALF
                + torch.randint(0, _HALF, b.shape, generator=gen, dtype=torch.int64))
        ok = word < (_WORD // b) * b
        out[todo[ok]] = word[ok] % b[ok]
        todo = todo[~ok]
    return out


def _bernoulli(num: torch.Tensor, den: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Bernoulli(num / den) per element, exactly (0 <= num <= den < 2^62)."""
    return _uniform_below(den, gen) < num


def _bernoulli_exp_fraction(num: torch.Tensor, den: torch.Tensor,
                            gen: torch.Generator) -> torch.Tensor:
    """Bernoulli(exp(-num / den)) for 0 <= num <= den (CKS 2020, Algorithm 1, gamma <= 1):
    K = 1; while Bernoulli(gamma / K): K += 1; return K odd."""
    k = torch.ones_like(num)
    live = torch.arange(num.numel())
    while live.numel():
        go = _bernoulli(num[live], den[live] * k[live], gen)
        k[live[go]] += 1
        live = live[go]
    return (k % 2) == 1


def _bernoulli_exp(num: torch.Tensor, den: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Bernoulli(exp(-num / den)) for any num >= 0 (CKS 2020, Algorithm 1): a
    Bernoulli(exp(-1)) for each whole unit of gamma, then one for its fraction."""
    whole = num // den
    out = torch.ones(num.shape, dtype=torch.bool)
    unit = torch.ones_like(num)
    for j in range(int(whole.max()) if whole.numel() else 0):
        idx = torch.nonzero(out & (whole > j)).reshape(-1)
        if idx.numel() == 0:
            break
        out[idx] = _bernoulli_exp_fraction(unit[idx], unit[idx], gen)
    idx = torch.nonzero(out).reshape(-1)
    out[idx] = _bernoulli_exp_fraction(num[idx] - whole[idx] * den[idx], den[idx], gen)
    return out


def _discrete_laplace(count: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` draws of the discrete Laplace P(y) ∝ exp(-|y| / t) (CKS 2020, Algorithm 2)."""
    out = torch.empty(count, dtype=torch.int64)
    todo = torch.arange(count)
    tt = torch.full((count,), t, dtype=torch.int64)
    while todo.numel():
        m = todo.numel()
        u = _uniform_below(tt[:m], gen)
        keep = _bernoulli_exp_fraction(u, tt[:m], gen)     # Bernoulli(exp(-U / t))
        v = torch.zeros(m, dtype=torch.int64)              # Geometric: Bernoulli(exp(-1))s
        live = torch.arange(m)
        one = torch.ones(m, dtype=torch.int64)
        while live.numel():
            go = _bernoulli_exp_fraction(one[live], one[live], gen)
            v[live[go]] += 1
            live = live[go]
        x = u + t * v
        sign = torch.randint(0, 2, (m,), generator=gen, dtype=torch.int64)
        ok = keep & ~((sign == 1) & (x == 0))
        out[todo[ok]] = ((1 - 2 * sign) * x)[ok]
        todo = todo[~ok]
    return out


def _python_accept(y: int, t: int, v: int, gen: torch.Generator) -> bool:
    """The acceptance coin of a candidate whose numbers exceed int64, in Python integers
    (same algorithm; uniform draws by 31-bit words, rejection for uniformity)."""
    def below(b: int) -> int:
        words = max(1, -(-b.bit_length() // 31))
        limit = (1 << (31 * words)) // b * b
        while True:
            r = 0
            for w in torch.randint(0, _HALF, (words,), generator=gen).tolist():
                r = (r << 31) | int(w)
            if r < limit:
                return r % b

    def bern_exp(num: int, den: int) -> bool:   # gamma <= 1
        k = 1
        while below(den * k) < num:
            k += 1
        return k % 2 == 1

    num, den = (abs(y) - v) ** 2, 2 * t * v
    for _ in range(num // den):
        if not bern_exp(1, 1):
            return False
    return bern_exp(num % den, den)


def discrete_gaussian(shape: torch.Size | tuple[int, ...], t: int, v: int,
                      generator: torch.Generator) -> torch.Tensor:
    """Exact draws of N_Z(0, sigma^2), sigma^2 = t v (CKS 2020, Algorithm 3 with the
    discrete Laplace scale t): Y ~ DLap(t), accepted with probability
    exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2)) = exp(-(|Y| - v)^2 / (2 t v)). int64."""
    count = int(math.prod(shape))
    out = torch.empty(count, dtype=torch.int64)
    todo = torch.arange(count)
    limit = math.isqrt(_WORD - 1)            # (|Y| - v)^2 fits int64 below this gap
    while todo.numel():
        y = _discrete_laplace(todo.numel(), t, generator)
        gap = (y.abs() - v).abs()
        small = gap <= limit
        accept = torch.zeros(y.shape, dtype=torch.bool)
        idx = torch.nonzero(small).reshape(-1)
        if idx.numel():
            num = gap[idx] ** 2
            accept[idx] = _bernoulli_exp(num, torch.full_like(num, 2 * t * v), generator)
        for i in torch.nonzero(~small).reshape(-1).tolist():
            accept[i] = _python_accept(int(y[i]), t, v, generator)
        out[todo[accept]] = y[accept]
        todo = todo[~accept]
    return out.reshape(tuple(shape))


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
