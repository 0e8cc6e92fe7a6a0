"""Exact samplers of the discrete Gaussian N_Z(0, sigma^2), sigma^2 = t v (integers t, v).

Both follow Canonne, Kamath & Steinke, "The Discrete Gaussian for Differential Privacy",
NeurIPS 2020, Algorithm 3: a discrete Laplace proposal Y, P(y) ∝ exp(-|y| / t), accepted
with probability exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2)) = exp(-(|Y| - v)^2 / (2 t v)).
They differ in how the coins Bernoulli(exp(-gamma)) (gamma rational) are tossed:

- :func:`discrete_gaussian` (the one dpfl uses; about 1e6-1e7 coordinates/s on one core,
  ``bench/ddgauss_sampler.py``): every coin is ``U < exp(-gamma)`` for a uniform real U in
  [0, 1) whose binary digits are drawn LAZILY. Its first 53 bits are drawn in bulk for a
  whole batch; the float64 value of exp(-gamma), widened by a relative margin m = 2^-36,
  decides the coin whenever U's 53-bit interval [h 2^-53, (h + 1) 2^-53) lies entirely
  below or above [exp(-gamma)(1 - m), exp(-gamma)(1 + m)]. Otherwise (probability about
  2 m + 2^-52 per coin) the SAME U gets 32 more bits at a time and is compared with
  rigorous bounds of exp(-gamma) from Python's ``decimal`` (correctly rounded exp) and
  exact rationals, until the comparison is decided. U < exp(-gamma) is therefore decided
  exactly, for every U: the coin has probability exp(-gamma) exactly (exp(-gamma) is
  irrational for rational gamma > 0, so the refinement stops with probability 1). The
  geometric magnitude of the discrete Laplace is drawn the same way, by inversion:
  X = k iff exp(-(k + 1) / t) < U <= exp(-k / t), so P(X = k) = (1 - q) q^k, q = exp(-1/t).
  The float filter is sound when float64 gamma (from exact integers: relative error
  <= 3 * 2^-53, i.e. <= 2^-42 on exp(-gamma) for gamma <= 512) and torch's float64 exp
  (documented at <= 1 ulp; ``tests/test_ddgauss.py`` checks <= 2^-45 against ``decimal``)
  together stay below m / 2 = 2^-37; coins with float gamma > 512 always take the exact
  route. No error is folded into delta: the draws are exact.
- :func:`discrete_gaussian_integer_coins`: the original integer-only version (Algorithms
  1-2 with every coin a comparison of uniform integers), about 40 µs per coordinate; kept
  as a second exact implementation (the benchmark's "old" column).

Randomness: every bit comes from the caller's ``torch.Generator`` (the client's secret
one). ``torch.randint`` reduces a 64-bit word modulo the range, which is exact for the
power-of-two ranges used here (2, 2^31, 2^32, 2^53).
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, ROUND_HALF_EVEN, Decimal, localcontext
from fractions import Fraction

import torch

HEAD_BITS = 53
MARGIN = 2.0 ** -36          # relative widening of float64 exp(-gamma) (see module doc)
FAST_GAMMA = 512.0           # float gamma above this: always the exact route
OVERPROVISION = 1.6          # proposals per wanted draw (CKS's acceptance is ~0.6-0.7)
_HEAD = float(1 << HEAD_BITS)


def exp_bounds(num: int, den: int, digits: int) -> tuple[Fraction, Fraction]:
    """(lo, hi) rationals with lo <= exp(-num / den) <= hi, relative width ~10^(2 - digits):
    num / den rounded down and up in ``digits`` decimal digits, then ``Decimal.exp``
    (correctly rounded, so within 10^(1 - digits) relative) widened by that much."""
    with localcontext() as ctx:
        ctx.prec = digits
        ctx.rounding = ROUND_FLOOR
        g_lo = Decimal(num) / Decimal(den)
        ctx.rounding = ROUND_CEILING
        g_hi = Decimal(num) / Decimal(den)
        ctx.rounding = ROUND_HALF_EVEN
        e_lo, e_hi = (-g_hi).exp(), (-g_lo).exp()
    rel = Fraction(1, 10 ** (digits - 1))
    return Fraction(e_lo) * (1 - rel), Fraction(e_hi) * (1 + rel)


class LazyUniform:
    """A uniform real U in [0, 1) known by its first ``bits`` binary digits ``head``; more
    digits are drawn from ``generator`` only when a comparison needs them."""

    def __init__(self, head: int, generator: torch.Generator, bits: int = HEAD_BITS) -> None:
        self.head, self.bits, self.gen = int(head), bits, generator

    def _refine(self) -> None:
        word = int(torch.randint(0, 1 << 32, (1,), generator=self.gen, dtype=torch.int64))
        self.head, self.bits = (self.head << 32) | word, self.bits + 32

    def below_exp(self, num: int, den: int) -> bool:
        """U < exp(-num / den), decided exactly (num >= 0, den > 0 integers)."""
        if num == 0:
            return True
        while True:
            lo, hi = exp_bounds(num, den, int(self.bits * 0.302) + 12)
            if Fraction(self.head + 1, 1 << self.bits) <= lo:
                return True
            if Fraction(self.head, 1 << self.bits) >= hi:
                return False
            self._refine()


def _heads(count: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 1 << HEAD_BITS, (count,), generator=gen, dtype=torch.int64)


def _coin_filter(head: torch.Tensor, gamma: torch.Tensor, margin: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(surely U < exp(-gamma), surely U > exp(-gamma)) from U's 53-bit head."""
    e = torch.exp(-gamma) * _HEAD
    h = head.to(torch.float64)
    fast = gamma <= FAST_GAMMA
    return fast & (h + 1.0 <= e * (1.0 - margin)), fast & (h >= e * (1.0 + margin))


def _geometric(count: int, t: int, gen: torch.Generator, margin: float) -> torch.Tensor:
    """``count`` draws of X with P(X = k) = (1 - q) q^k, q = exp(-1 / t), by inversion of a
    lazy uniform (see module docstring)."""
    head = _heads(count, gen)
    u = (head.to(torch.float64) + 0.5) / _HEAD
    k = torch.floor(-float(t) * torch.log(u)).clamp_(min=0.0)
    below_k, _ = _coin_filter(head, k / t, margin)            # U < q^k
    _, above_k1 = _coin_filter(head, (k + 1.0) / t, margin)   # U > q^(k + 1)
    out = k.to(torch.int64)
    for i in torch.nonzero(~(below_k & above_k1)).reshape(-1).tolist():
        lazy = LazyUniform(int(head[i]), gen)
        j = int(out[i])
        while j > 0 and not lazy.below_exp(j, t):
            j -= 1
        while lazy.below_exp(j + 1, t):
            j += 1
        out[i] = j
    return out


def _proposals(count: int, t: int, v: int, gen: torch.Generator, margin: float
               ) -> torch.Tensor:
    """``count`` CKS Algorithm 3 rounds: the accepted values (fewer than ``count``)."""
    x = _geometric(count, t, gen, margin)
    sign = torch.randint(0, 2, (count,), generator=gen, dtype=torch.int64)
    valid = ~((sign == 1) & (x == 0))                      # DLap: -0 is rejected
    y = (1 - 2 * sign) * x
    gap = (x - v).abs()
    num_f = gap.to(torch.float64)
    gamma = num_f * num_f / float(2 * t * v)
    head = _heads(count, gen)
    accept, reject = _coin_filter(head, gamma, margin)
    for i in torch.nonzero(valid & ~accept & ~reject).reshape(-1).tolist():
        g = int(gap[i])
        accept[i] = LazyUniform(int(head[i]), gen).below_exp(g * g, 2 * t * v)
    return y[valid & accept]


def discrete_gaussian(shape: torch.Size | tuple[int, ...], t: int, v: int,
                      generator: torch.Generator, margin: float = MARGIN) -> torch.Tensor:
    """Exact draws of N_Z(0, t v), int64, in batches (CKS 2020 Algorithm 3 with lazily
    compared uniforms; see module docstring). ``margin`` only trades speed for exact-route
    work (tests widen it to exercise that route); it never changes the distribution."""
    if t < 1 or v < 1:
        raise ValueError("the discrete Gaussian needs integers t, v >= 1")
    if 2 * t * v >= 1 << 53:
        raise OverflowError("t v must stay below 2^52 (float64 filter of exact integers)")
    count = int(math.prod(shape))
    out = torch.empty(count, dtype=torch.int64)
    filled = 0
    while filled < count:
        need = count - filled
        got = _proposals(int(need * OVERPROVISION) + 64, t, v, generator, margin)
        take = min(need, got.numel())
        out[filled:filled + take] = got[:take]
        filled += take
    return out.reshape(tuple(shape))


# -- the integer-coin version (the previous sampler) ------------------------------------

# uniform integers are drawn below 2^62 (two exact 31-bit halves), so every bound b of a
# Bernoulli(a / b) coin must stay below it; larger cases go to Python integers
_WORD = 1 << 62
_HALF = 1 << 31


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


def discrete_gaussian_integer_coins(shape: torch.Size | tuple[int, ...], t: int, v: int,
                                    generator: torch.Generator) -> torch.Tensor:
    """Exact draws of N_Z(0, t v) with integer coins only (CKS 2020, Algorithms 1-3), int64."""
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
