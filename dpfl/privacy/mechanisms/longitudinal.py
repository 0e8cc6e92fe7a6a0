"""AADP-FL's longitudinal clipping: Algorithm 2 of Cheng, Li, Qin and Tu, "Differential
Privacy Federated Learning Based on Adaptive Adjustment", Computers, Materials & Continua,
2025.

Algorithm 2 zeroes the smallest-magnitude coordinate, one at a time, until ||theta||_2 <= S.
Its result keeps the m largest-magnitude coordinates, m the largest count whose sum of
squares is <= S^2, and zeroes the rest. We find that m from the largest coordinates down,
summing the squares of the kept set only. (An earlier version took the kept sum as
total - cumulative sum of the zeroed squares, which cancels catastrophically when S is
small against ||theta||: on 10^5 equal coordinates with S = 1e-3 it zeroed one coordinate
and released a norm of 1058.)

The cut is found by radix selection, O(d), no sort: the bit pattern of a float's magnitude,
read as an unsigned integer, orders like the magnitude, so one ``np.bincount`` over the top
bits of |theta| (16 of them for d >= 2^15, about log2 d below), weighted by theta^2, gives
the sum of squares of every magnitude range; summed from the top they locate the range
holding the cut, and the lower bits are resolved the same way inside that range only, until
the coordinates left share one magnitude. Sums of squares are taken in float64, where the
square of a float16/float32 is exact. (``bench/longitudinal.py``: ~10-15 ms at d = 1.2M on
two cores, ~10x faster than the argsort it replaces, same outputs on ordinary inputs.)

Ties: coordinates of equal magnitude are zeroed in index order, as the literal loop's
argmin does, so of a tied group the highest indices survive.

Edge case (documented choice): if the largest coordinate alone exceeds S, the literal
algorithm zeroes every coordinate (only then is the norm <= S), releasing nothing. We keep
that one coordinate (the first index among equal maxima) and set its magnitude to S (sign
kept; the largest value of the tensor's dtype that is <= S), i.e. fall back to norm
clipping of what remains: the output norm is still <= S, so the sensitivity argument is
unchanged, and the most informative coordinate survives. ``literal=True`` gives the
paper's behaviour (all zeros).

Hard check: the output is returned only once the exact norm of its values is certified
<= S (``_certified``). Their float64 sum of squares is computed from the output itself; a
float64 sum of m non-zero non-negative terms, in any order, is within a relative
gamma_{m-1} = (m-1)u / (1 - (m-1)u) of the exact sum (u = 2^-53; float16/32 squares are
exact in float64, float64 squares add one rounding), so outside that band around S^2 the
sum decides, and inside it an exact evaluation does (error-free terms summed by
``math.fsum``, whose correctly rounded result has the exact sign; slower, and rare).
Exactness holds down to the underflow of float64 squares (|theta_i| < 1e-154, float64
inputs only). The search aims at S^2 in float64, as the literal loop does, and normally
passes; should rounding have kept a set whose exact norm exceeds S (a sum within ~gamma of
S^2: relative ~1e-10 at d ~ 10^6), the search is redone aiming at S^2 (1 - (4d + 16)u)
(which, for a top coordinate within that margin of S, can leave only the edge case above,
and with ``literal=True`` zeros), and only if that failed too would the output be scaled
by S / norm * (1 - 1e-6) (all zeros as the last resort). The early exit (norm already
<= S: the input returned as is) uses the same check, so a clipped output is a fixpoint.

The output norm is <= S in every case, so replacing one client's data moves the released
update by at most 2S (replace-one, the relation of noise added on the client); the Gaussian
noise is calibrated for that (``dpfl.privacy.plan``), not with the paper's S^4 l / (|w| eps^2) variance.
Non-finite inputs (and float64 inputs whose sum of squares overflows) raise ``ValueError``:
no bound can be certified for them.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import torch

# float dtype -> (unsigned integer of the same width, number of magnitude bits)
_UINT: dict[np.dtype[Any], tuple[type[np.unsignedinteger[Any]], int]] = {
    np.dtype(np.float16): (np.uint16, 15),
    np.dtype(np.float32): (np.uint32, 31),
    np.dtype(np.float64): (np.uint64, 63),
}
_U = Fraction(1, 2 ** 53)   # unit roundoff of float64
_RESCALE_ATTEMPTS = 8       # scale down at most this many times, then give up to zeros


def _sumsq(x: np.ndarray, buf: np.ndarray) -> float:
    """Float64 sum of squares of ``x``; leaves the squares in ``buf``."""
    np.copyto(buf, x)
    np.multiply(buf, buf, out=buf)
    return float(buf.sum())


def _exactly_within(x: np.ndarray, bound: float) -> bool:
    """sum(x_i^2) <= bound^2 decided exactly: error-free terms of the squares (x^2 itself for
    float16/32; hi^2, 2 hi lo, lo^2 of a Veltkamp split for float64) and -bound^2 as a sum of
    two floats, summed by ``math.fsum``, whose correctly rounded result has the exact sign.
    O(d) in Python: only for the rare sums within rounding of the bound."""
    x = x[x != 0]
    if x.dtype == np.float64:
        c = x * 134217729.0                     # 2^27 + 1
        hi = c - (c - x)
        lo = x - hi
        terms = [hi * hi, 2.0 * hi * lo, lo * lo]
    else:
        x = x.astype(np.float64)
        terms = [x * x]
    s2 = Fraction(bound) ** 2
    s2_hi = float(s2)
    s2_lo = float(s2 - Fraction(s2_hi))
    if Fraction(s2_hi) + Fraction(s2_lo) != s2 or not all(np.isfinite(t).all() for t in terms):
        return False                            # under- or overflow: cannot decide, refuse
    return math.fsum([v for t in terms for v in t.tolist()] + [-s2_hi, -s2_lo]) <= 0


def _certified(x: np.ndarray, sumsq: float, bound: float) -> bool:
    """The hard check: the exact L2 norm of ``x`` is <= bound, given ``sumsq``, the float64
    sum of its squares (``_sumsq``).

    A float64 sum of m non-negative terms, in any order, is within a relative
    gamma_{m-1} = (m-1)u / (1 - (m-1)u) of the exact sum (u = 2^-53; terms that are zero add
    no error); float64 squares add one rounding each (gamma_m then). Outside that band
    around bound^2 the float64 sum decides; inside it, ``_exactly_within``."""
    if not math.isfinite(sumsq):
        return False
    if math.isinf(bound):
        return True
    k = max(int(np.count_nonzero(x)) - 1, 0) + (x.dtype == np.float64)
    gamma = k * _U / (1 - k * _U)
    s2, f = Fraction(bound) ** 2, Fraction(sumsq)
    if f <= s2 * (1 - gamma):
        return True
    if f > s2 * (1 + gamma):
        return False
    return _exactly_within(x, bound)


def _descend(bucket: np.ndarray, sq: np.ndarray, acc: float, bits: int,
             budget: float) -> tuple[float, int] | None:
    """One radix level: (sum of squares above the bucket holding the cut, that bucket), or
    None if the whole range fits in the budget after all (rounding in the level above)."""
    sums = np.bincount(bucket, weights=sq, minlength=1 << bits)
    from_top = acc + np.cumsum(sums[::-1])   # kept sum of squares if cut below each bucket
    over = from_top > budget
    if not over.any():
        return None
    j = int(np.argmax(over))
    return (float(from_top[j - 1]) if j > 0 else acc), (1 << bits) - 1 - j


def _radix_bits(n: int, left: int) -> int:
    """Bits to resolve at one level of n coordinates: about log2 n (bincount's fixed cost
    is 2^bits), between 4 and 16, at most the bits left."""
    return min(left, 16, max(4, n.bit_length()))


def _keep_largest(flat: np.ndarray, sq: np.ndarray, budget: float) -> np.ndarray:
    """Algorithm 2's result: ``flat`` with all but its largest-magnitude coordinates set to
    zero, keeping as many as have a sum of squares (added from the top) <= budget; of equal
    magnitudes the higher indices are kept. Assumes the whole sum exceeds the budget."""
    uint, left = _UINT[flat.dtype]
    absmask = uint(np.iinfo(uint).max >> 1)
    bits = _radix_bits(flat.size, left)
    left -= bits
    bucket = np.empty(flat.size, dtype=np.intp)   # top bits of |theta|, built in place
    np.bitwise_and(flat.view(uint), absmask, out=bucket, casting="unsafe")
    if left:
        np.right_shift(bucket, left, out=bucket)
    step = _descend(bucket, sq, 0.0, bits, budget)
    if step is None:
        return flat.copy()
    acc, top_cut = step
    cand = np.flatnonzero(bucket == top_cut)   # the top-level range holding the cut
    key = flat[cand].view(uint) & absmask      # |theta| there, as ordered integers
    sq_c = sq[cand]
    loc = None                                 # positions in cand still undecided (None: all)
    while left:
        k = key if loc is None else key[loc]
        if k.min() == k.max():                 # one magnitude left
            break
        bits = _radix_bits(k.size, left)
        left -= bits
        sub = ((k >> left) & ((1 << bits) - 1)).astype(np.intp)
        step = _descend(sub, sq_c if loc is None else sq_c[loc], acc, bits, budget)
        if step is None:                       # rounding: the range fits whole; keep it
            inside = k == k.min()
            acc = -math.inf
        else:
            acc, cut = step
            inside = sub == cut
        loc = np.flatnonzero(inside) if loc is None else loc[inside]
    # ties: the coordinates of the one magnitude left, ascending index; keep the r highest
    ties = cand if loc is None else cand[loc]
    kt = key[0] if loc is None else key[loc[0]]
    v2 = float(sq[ties[0]])
    n = ties.size
    if acc == -math.inf or v2 == 0:
        r = n
    else:                                      # the largest r with acc + r v^2 <= budget
        q = (budget - acc) / v2                # may overflow to inf: then r = n
        r = n if q >= n else max(0, math.floor(q))
        while r > 0 and acc + r * v2 > budget:
            r -= 1
        while r < n and acc + (r + 1) * v2 <= budget:
            r += 1
    keep = np.concatenate([cand[key > kt], ties[n - r:]])
    out: np.ndarray = flat * (bucket > top_cut)  # a multiply: much faster than a masked copy
    out[keep] = flat[keep]
    out += 0                                   # -0.0 -> +0.0
    return out


def _select(flat: np.ndarray, sq: np.ndarray, budget: float, bound: float,
            literal: bool) -> np.ndarray:
    """The search, with the edge case: if nothing fits (the largest coordinate alone exceeds
    S), all zeros, or with ``literal=False`` the first largest coordinate at magnitude S."""
    out = _keep_largest(flat, sq, budget)
    if not literal and not out.any():
        top = int(np.argmax(np.abs(flat)))     # the first index among equal maxima
        mag = flat.dtype.type(bound)
        while float(mag) > bound:              # rounded up to the dtype: step down
            mag = np.nextafter(mag, flat.dtype.type(0))
        mag = min(mag, abs(flat[top]))         # never above the input (aiming lower)
        out[top] = mag if flat[top] > 0 else -mag
    return out


def longitudinal_clip(theta: torch.Tensor, bound: float, literal: bool = False) -> torch.Tensor:
    """Zero the smallest-magnitude coordinates of a tensor until its L2 norm <= bound."""
    if not bound > 0:
        raise ValueError("bound must be > 0")
    flat = np.ascontiguousarray(theta.detach().reshape(-1).cpu().numpy())
    if flat.dtype not in _UINT:
        raise TypeError(f"longitudinal_clip supports float16/32/64 tensors, not {flat.dtype}")
    d = flat.size
    buf = np.empty(d, dtype=np.float64)
    total = _sumsq(flat, buf)                   # buf: the squares of flat
    if not math.isfinite(total):
        raise ValueError("longitudinal_clip: non-finite input (or its sum of squares overflows)")
    if _certified(flat, total, bound):          # already within S: unchanged
        return theta.clone()
    out = _select(flat, buf, bound * bound, bound, literal)
    if not _certified(out, _sumsq(out, buf), bound):   # rounding at the boundary: aim lower
        _sumsq(flat, buf)
        budget = bound * bound * (1 - (4 * d + 16) * 2.0 ** -53)
        out = _select(flat, buf, budget, bound, literal)
        shrink = 1.0 - max(1e-6, 4 * float(np.finfo(flat.dtype).eps))
        for _ in range(_RESCALE_ATTEMPTS):      # last resort: scale down
            sumsq = _sumsq(out, buf)
            if _certified(out, sumsq, bound):
                break
            out = (out.astype(np.float64) * (bound / math.sqrt(sumsq) * shrink)).astype(flat.dtype)
        else:
            if not _certified(out, _sumsq(out, buf), bound):
                out[:] = 0
    return torch.from_numpy(out).view_as(theta).to(theta.device)
