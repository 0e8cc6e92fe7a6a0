"""Tree aggregation for private prefix sums (DP-FTRL): the binary-tree factorization, its
plain and Honaker ("efficient") estimators, restarts, a streaming noise generator, the
per-round noise variance in closed form and the exact sensitivity under a schema.

Kairouz, McMahan, Song, Thakkar, Thakurta & Xu, "Practical and Private (Deep) Learning
without Sampling or Shuffling", ICML 2021 (KMSTTX21): every dyadic block of rounds
[j 2^h, (j + 1) 2^h) is a node of a binary tree; once its last round is in, the node's sum
is released with its own N(0, sigma^2) noise. As a matrix factorization A = B C
(Choquette-Choo et al., ICML 2023, Sec. 2): C has one 0/1 row per node (the rounds it
covers), and the estimator B reads the prefix sum of rounds 0..t off released nodes.

- ``plain``: the prefix [0, t] is the disjoint union of the dyadic blocks of the binary
  expansion of t + 1 (KMSTTX21, Alg. 1); its noise has variance sigma^2 popcount(t + 1).
- ``efficient``: Honaker, "Efficient Use of Differentially Private Binary Trees" (2015),
  as used by KMSTTX21 (Sec. 4, App. B.1): each node's sum is estimated from its own noisy
  value and its children's estimates, inverse-variance weighted, bottom-up. A node at level
  h then has variance v_h = sigma^2 / (2 - 2^-h) (1 / v_h = 1 / sigma^2 + 1 / (2 v_(h-1)));
  a node at level g below a block at level h enters that block's estimate with weight
  v_h 2^(g - h) / sigma^2. This is the variance-optimal (least-squares) estimate of the
  prefix from the nodes released so far (tested against the dense least-squares solution).
- Restarts every R rounds (KMSTTX21, Sec. 4, "restarting the tree"): a fresh tree per
  segment; the prefix of round t adds the estimates of the completed segments' totals.

Rows of C (and the columns of B, the noise coordinates z) are in the order the nodes
complete: at round t its leaf, then the nodes of levels 1, 2, ... ending at t. The streaming
generator draws them in that order, so its noise equals ``B z`` of the dense matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Sequence

import numpy as np
import torch
from numpy.typing import NDArray

from dpfl.privacy.accounting.participation import ParticipationSchema

Estimator = Literal["plain", "efficient"]
ESTIMATORS: tuple[Estimator, ...] = ("plain", "efficient")
FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
# the sensitivity DP's (max, +) products are done in chunks of at most this many entries
_DP_CHUNK = 1 << 22


class NoiseStep(NamedTuple):
    """One round of correlated noise: ``increment`` is added to the round's clipped sum
    (it is (C^-1 z)_t for an invertible C; for the tree, the difference of consecutive
    prefix noises), ``prefix`` is the noise of the released prefix sum, (B z)_t."""

    increment: torch.Tensor
    prefix: torch.Tensor


def stream_generator(noise_std: float, generator: torch.Generator | None, seed: int | None,
                     device: torch.device | str | None) -> torch.Generator:
    """The generator a streaming noise draws its z from (:class:`TreeNoise`,
    :class:`dpfl.privacy.mechanisms.banded_mf.BandedNoise`): ``generator``, else a fresh one seeded
    with ``seed`` (or from the OS when None). ValueError for a ``noise_std`` below 0 or NaN."""
    if not noise_std >= 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std}")
    if generator is None:
        generator = torch.Generator(device=device or "cpu")
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()
    return generator


def _check_estimator(estimator: str) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")


def _check_restart(rounds: int | None, restart_every: int | None) -> None:
    if rounds is not None and rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if restart_every is not None and restart_every < 1:
        raise ValueError(f"restart_every must be >= 1 or None, got {restart_every}")


def node_variance_factor(level: int, estimator: Estimator) -> float:
    """Variance of a level-``level`` node's estimate in units of sigma^2: 1 (plain) or
    1 / (2 - 2^-level) (Honaker's bottom-up estimate)."""
    _check_estimator(estimator)
    return 1.0 if estimator == "plain" else 1.0 / (2.0 - 2.0 ** -level)


def _partial_variance(m: int, estimator: Estimator) -> float:
    """Variance factor of the estimate of the sum of a segment's first m rounds."""
    return sum(node_variance_factor(h, estimator) for h in range(m.bit_length())
               if m >> h & 1)


def tree_noise_variance(rounds: int, estimator: Estimator = "efficient",
                        restart_every: int | None = None,
                        noise_std: float = 1.0) -> FloatArray:
    """Closed form of the noise variance of each released prefix sum (per coordinate),
    rounds 0..n-1: sigma^2 [s V(R) + V(p)] for round t = s R + p - 1 (s completed
    segments, p rounds into the current one), V(m) = sum over the set bits h of m of 1
    (plain, KMSTTX21 Alg. 1) or 1 / (2 - 2^-h) (efficient, Honaker 2015)."""
    _check_estimator(estimator)
    _check_restart(rounds, restart_every)
    period = restart_every or rounds
    full = _partial_variance(period, estimator)
    out = np.empty(rounds)
    for t in range(rounds):
        s, p = divmod(t, period)
        out[t] = s * full + _partial_variance(p + 1, estimator)
    return out * float(noise_std) ** 2


def tree_levels(rounds: int) -> int:
    """Number of levels of complete nodes over ``rounds`` rounds: floor(log2 n) + 1 (the
    number of nodes a round can be in: the single-participation sensitivity squared)."""
    return rounds.bit_length()


@dataclass(frozen=True)
class TreeFactorization:
    """Dense A = B C of the tree over ``rounds`` rounds (for tests, accounting and small
    n). ``encoder`` C: nodes x rounds, 0/1; ``decoder`` B: rounds x nodes; ``levels`` and
    ``starts`` (first round) of each node, nodes in completion order."""

    rounds: int
    estimator: Estimator
    restart_every: int | None
    encoder: FloatArray
    decoder: FloatArray
    levels: IntArray
    starts: IntArray


def _nodes(rounds: int, period: int) -> list[tuple[int, int]]:
    """(level, start) of every node, in completion order."""
    nodes = []
    for t in range(rounds):
        pos = t % period
        h = 0
        while (pos + 1) % (1 << h) == 0:
            nodes.append((h, t + 1 - (1 << h)))
            h += 1
    return nodes


def _blocks(start: int, length: int) -> list[tuple[int, int]]:
    """The dyadic blocks (level, start) of [start, start + length), largest first."""
    out = []
    for h in reversed(range(length.bit_length())):
        if length >> h & 1:
            out.append((h, start))
            start += 1 << h
    return out


def tree_factorization(rounds: int, estimator: Estimator = "efficient",
                       restart_every: int | None = None) -> TreeFactorization:
    """The tree's C and the estimator's B, built densely from their definitions (the
    binary expansion and Honaker's weights v_h 2^(g - h); see the module docstring)."""
    _check_estimator(estimator)
    _check_restart(rounds, restart_every)
    period = restart_every or rounds
    nodes = _nodes(rounds, period)
    row = {node: i for i, node in enumerate(nodes)}
    c = np.zeros((len(nodes), rounds))
    for i, (h, start) in enumerate(nodes):
        c[i, start:start + (1 << h)] = 1.0
    b = np.zeros((rounds, len(nodes)))
    for t in range(rounds):
        seg_start = t - t % period
        blocks = [blk for s in range(0, seg_start, period) for blk in _blocks(s, period)]
        blocks += _blocks(seg_start, t + 1 - seg_start)
        for h, start in blocks:
            if estimator == "plain":
                b[t, row[(h, start)]] += 1.0
                continue
            v_h = node_variance_factor(h, "efficient")
            for g in range(h + 1):
                for j in range(start, start + (1 << h), 1 << g):
                    b[t, row[(g, j)]] += v_h * 2.0 ** (g - h)
    levels = np.array([h for h, _ in nodes], dtype=np.int64)
    starts = np.array([s for _, s in nodes], dtype=np.int64)
    return TreeFactorization(rounds, estimator, restart_every, c, b, levels, starts)


class TreeNoise:
    """Streaming tree-aggregation noise, round by round (KMSTTX21, Alg. 1 with Honaker's
    estimator as an option): memory O(log2(R) x model size) — one estimate per completed
    block of the current segment (a binary counter), the completed segments' total, and the
    previous prefix noise. Node noises are drawn N(0, noise_std^2) from ``generator`` in
    completion order (the order of :func:`tree_factorization`'s rows), so the prefix noise
    of round t equals (B z)_t. ``seed`` makes a fresh generator when none is given."""

    def __init__(self, shape: Sequence[int] | torch.Size, noise_std: float,
                 estimator: Estimator = "efficient", restart_every: int | None = None,
                 generator: torch.Generator | None = None, seed: int | None = None,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        _check_estimator(estimator)
        _check_restart(None, restart_every)
        generator = stream_generator(noise_std, generator, seed, device)
        self.shape = torch.Size(shape)
        self.noise_std = float(noise_std)
        self.estimator: Estimator = estimator
        self.restart_every = restart_every
        self.generator = generator
        self.dtype = dtype
        self.device = device
        self.round = 0
        self._stack: list[tuple[int, torch.Tensor]] = []
        self._carried = self._zeros()
        self._previous = self._zeros()

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def _draw(self) -> torch.Tensor:
        z = torch.randn(self.shape, generator=self.generator, dtype=self.dtype,
                        device=self.device)
        return z * self.noise_std

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs to continue the same noise stream: the generator's state,
        the round, the pending blocks' estimates, the carried total, the last prefix."""
        return {"round": self.round, "generator": self.generator.get_state(),
                "levels": [h for h, _ in self._stack],
                "stack": [est.clone() for _, est in self._stack],
                "carried": self._carried.clone(), "previous": self._previous.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream :meth:`state_dict` saved (same shape and settings)."""
        self.round = int(state["round"])
        self.generator.set_state(state["generator"])
        self._stack = [(int(h), t.to(self.dtype)) for h, t in zip(state["levels"],
                                                                   state["stack"])]
        self._carried = state["carried"].to(self.dtype)
        self._previous = state["previous"].to(self.dtype)

    def next(self) -> NoiseStep:
        """The noise of the next round (0-based ``self.round`` before the call)."""
        period = self.restart_every
        if period is not None and self.round % period == 0 and self.round > 0:
            for _, est in self._stack:
                self._carried = self._carried + est
            self._stack = []
        self._stack.append((0, self._draw()))
        while len(self._stack) >= 2 and self._stack[-1][0] == self._stack[-2][0]:
            level = self._stack[-1][0] + 1
            (_, right), (_, left) = self._stack.pop(), self._stack.pop()
            own = self._draw()
            if self.estimator == "plain":
                est = own
            else:
                # weights v_h / sigma^2 on the node, v_h / (2 v_(h-1)) on its children
                v_h = node_variance_factor(level, "efficient")
                v_child = node_variance_factor(level - 1, "efficient")
                est = v_h * own + (v_h / (2.0 * v_child)) * (left + right)
            self._stack.append((level, est))
        prefix = self._carried.clone()
        for _, est in self._stack:
            prefix = prefix + est
        increment = prefix - self._previous
        self._previous = prefix
        self.round += 1
        return NoiseStep(increment, prefix)


def tree_sensitivity(schema: ParticipationSchema, restart_every: int | None = None) -> float:
    """Exact L2 sensitivity of the tree's C under ``schema`` (units of the clipping bound).

    C is 0/1, so C^T C >= 0 and the worst case is every participation in one direction
    (MMRT23, Thm. 2.1): sens^2 = max over patterns of sum over nodes of (participations in
    the node)^2. Computed exactly by a dynamic program over the tree (not enumeration):
    per subtree and number m of participations in it, the best value for each (distance of
    the first participation from the subtree's left edge, of the last from its right edge),
    both capped at b - 1, which is all the separation constraint needs to join siblings.
    With k = 1 this is :func:`tree_levels` (of R with restarts)."""
    _check_restart(schema.rounds, restart_every)
    k, b, n = schema.max_participations, schema.min_separation, schema.rounds
    period = restart_every or n
    total: _Table | None = None
    for start in range(0, n, period):
        length = min(period, n - start)
        last = start + length >= n
        seg = _subtree(length, 1 << (length - 1).bit_length(), k, b, start == 0, last)
        total = seg if total is None else _merge(total, seg, 0.0, k, b, True, last)
    assert total is not None
    best = float(np.max(total.values)) if total.values.size else 0.0
    return math.sqrt(max(best, 0.0))


@dataclass
class _Table:
    """Best sum of squared node counts inside a subtree whose existing rounds number
    ``size``: values[m - 1, f, l] with m participations, the first f rounds after the left
    edge, the last l rounds before the right edge of those rounds (both capped at b - 1);
    -inf where infeasible."""

    size: int
    values: FloatArray


def _subtree(valid: int, size: int, k: int, b: int, first: bool, last: bool) -> _Table:
    """Table of the padded subtree of ``size`` (a power of 2) rounds, of which the first
    ``valid`` exist; its root node counts (weight 1) when all of them exist. ``first`` /
    ``last``: the subtree starts / ends the whole run, so no participation lies beyond that
    edge and the offset from it is not kept (one column: the spine of the tree is cheap)."""
    if valid <= 0:
        return _Table(0, np.full((0, 0, 0), -np.inf))
    if size == 1:
        return _Table(1, np.ones((1, 1, 1)))
    half = size // 2
    left = _subtree(min(valid, half), half, k, b, first, last and valid <= half)
    right = _subtree(valid - half, half, k, b, False, last)
    return _merge(left, right, 1.0 if valid >= size else 0.0, k, b, first, last)


def _merge(left: _Table, right: _Table, weight: float, k: int, b: int,
           first: bool = False, last: bool = False) -> _Table:
    """Join adjacent subtrees under a parent node of ``weight`` (0: no node); ``first`` /
    ``last`` as in :func:`_subtree` (drop the offset from that edge)."""
    s_l, s_r = left.size, right.size
    w = min(s_l + s_r, b)
    tl, tr = left.values, right.values
    m_l, m_r = tl.shape[0], tr.shape[0]
    m_max = min(m_l + m_r, k)
    out = np.full((m_max, w, w), -np.inf)
    wl_f, wl_l = tl.shape[1], tl.shape[2]
    wr_f, wr_l = tr.shape[1], tr.shape[2]
    if m_l:  # only the left subtree: the last participation moves s_r further from the edge
        for l1 in range(wl_l):
            dst = min(l1 + s_r, b - 1)
            out[:m_l, :wl_f, dst] = np.maximum(out[:m_l, :wl_f, dst], tl[:, :, l1])
    if m_r:  # only the right subtree: the first moves s_l further
        for f2 in range(wr_f):
            dst = min(f2 + s_l, b - 1)
            out[:m_r, dst, :wr_l] = np.maximum(out[:m_r, dst, :wr_l], tr[:, f2, :])
    if m_l and m_r and m_max >= 2:
        # suffix max over the right's first offset: best with first >= g
        suffix = np.maximum.accumulate(tr[:, ::-1, :], axis=1)[:, ::-1, :]
        # gap (l1 + 1) + f2 >= b  <=>  f2 >= b - 1 - l1
        need = b - 1 - np.arange(wl_l)
        ok = need < wr_f
        for m1 in range(1, m_l + 1 if ok.any() else 1):
            a = tl[m1 - 1]
            if not np.isfinite(a).any():
                continue
            for m2 in range(1, min(m_r, k - m1) + 1):
                g = np.full((wl_l, wr_l), -np.inf)
                g[ok] = suffix[m2 - 1, np.maximum(need[ok], 0), :]
                out[m1 + m2 - 1, :wl_f, :wr_l] = np.maximum(
                    out[m1 + m2 - 1, :wl_f, :wr_l], _maxplus(a, g))
    if weight:
        out += weight * (np.arange(1, m_max + 1, dtype=np.float64) ** 2)[:, None, None]
    if first:
        out = out.max(axis=1, keepdims=True) if out.size else out[:, :1, :]
    if last:
        out = out.max(axis=2, keepdims=True) if out.size else out[:, :, :1]
    return _Table(s_l + s_r, out)


def _maxplus(a: FloatArray, g: FloatArray) -> FloatArray:
    """(max, +) product: out[f, l] = max_j a[f, j] + g[j, l], in bounded chunks."""
    rows, inner = a.shape
    cols = g.shape[1]
    out = np.full((rows, cols), -np.inf)
    step = max(1, _DP_CHUNK // max(1, rows * cols))
    for j0 in range(0, inner, step):
        j1 = min(inner, j0 + step)
        block = a[:, j0:j1, None] + g[None, j0:j1, :]
        np.maximum(out, block.max(axis=1), out=out)
    return out
