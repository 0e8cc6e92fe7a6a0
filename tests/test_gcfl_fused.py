"""GCFL's one-read aggregation (the fused C kernel of dpfl.server.fused) against a
straightforward implementation of the paper's equations, and against the two-pass BLAS
path it replaces."""

import shutil

import pytest
import torch

from dpfl.methods.gcfl import _mean_and_cross, gcfl_aggregate
from dpfl.server import fused

needs_cc = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                              reason="no C compiler: the fused kernel falls back to BLAS")


def paper_gcfl(updates: torch.Tensor, weights: torch.Tensor, refs: list[int]) -> torch.Tensor:
    """Wan et al. 2025, Alg. 1 lines 22-31, in float64 with explicit loops: for every
    non-reference g_i and each reference g_j in ascending order, if cos(g_i, g_j) < 0 then
    g_i <- g_i - (g_i . g_j / ||g_j||^2) g_j (line 25, current g_i each time); then the
    sample-count-weighted mean sum_i n_i g_i / sum_i n_i (line 31)."""
    g = [row.double().clone() for row in updates]
    for i in range(len(g)):
        if i in refs:
            continue
        for j in sorted(refs):
            ref = updates[j].double()
            cos = float(g[i] @ ref) / (float(g[i].norm()) * float(ref.norm()))
            if cos < 0:
                g[i] = g[i] - float(g[i] @ ref) / float(ref @ ref) * ref
    w = weights.double()
    return sum(w[i] * g[i] for i in range(len(g))) / w.sum()


def _updates(m: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, d, generator=gen) + 0.1 * torch.randn(1, d, generator=gen)


@needs_cc
def test_kernel_builds_here():
    assert fused.kernel() is not None


@needs_cc
@pytest.mark.parametrize("m,d,refs", [(2, 9, [1]), (7, 1001, [3]), (13, 5003, [0, 4, 12]),
                                      (30, 70_001, [2, 5, 11, 17, 29])])
def test_fused_aggregate_equals_the_papers_equations(m, d, refs):
    """float32 updates take the fused path (M not a multiple of the kernel's 4 rows, d not
    of its 8 lanes; d = 70001 spans two tiles and two threads)."""
    u = _updates(m, d, m)
    w = torch.rand(m, generator=torch.Generator().manual_seed(d)) + 0.5
    assert _mean_and_cross(u, w, refs)[0] is not None
    got = gcfl_aggregate(u, w, refs)
    expected = paper_gcfl(u, w, refs)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, rtol=0, atol=2e-6)
    # at least one update was corrected, so the correction path is exercised
    cross = u.double() @ u[refs].double().T
    assert bool((cross[[i for i in range(m) if i not in refs]] < 0).any())


@needs_cc
@pytest.mark.parametrize("tile,threads", [(8, 1), (64, 2), (1000, 3), (fused.TILE, 2)])
def test_kernel_tiles_and_threads_agree_with_float64(tile, threads):
    """Every tiling and column split gives the float64 mean and cross products (ragged
    last tile, a thread with a partial range)."""
    u = _updates(11, 4099, 0)
    w = torch.rand(11, generator=torch.Generator().manual_seed(1))
    refs = [0, 6, 10]
    mean, cross = fused.mean_and_cross(u, w, refs, threads=threads, tile=tile)
    u64 = u.double()
    assert torch.allclose(mean.double(), w.double() @ u64, rtol=0, atol=1e-5)
    assert cross.dtype == torch.float64 and cross.shape == (11, 3)
    assert torch.allclose(cross, u64 @ u64[refs].T, rtol=1e-6, atol=1e-4)


@needs_cc
def test_fused_and_blas_paths_agree():
    u = _updates(40, 100_003, 5)
    w = torch.rand(40, generator=torch.Generator().manual_seed(2)) + 0.5
    refs = [1, 8, 22, 39]
    a = gcfl_aggregate(u, w, refs, fused=True)
    b = gcfl_aggregate(u, w, refs, fused=False)
    assert torch.allclose(a, b, rtol=0, atol=1e-6)
    _, cross_fused = _mean_and_cross(u, w, refs, fused=True)
    _, cross_blas = _mean_and_cross(u, w, refs, fused=False)
    assert torch.allclose(cross_fused, cross_blas, rtol=1e-5, atol=1e-3)


def test_kernel_declines_what_it_does_not_handle():
    u = _updates(5, 100, 0)
    w = torch.ones(5)
    assert fused.mean_and_cross(u.double(), w, [0]) is None           # float64: BLAS path
    assert fused.mean_and_cross(u[:, ::2], w, [0]) is None            # not contiguous
    assert fused.mean_and_cross(u, w, list(range(fused.MAX_REFS + 1))) is None
    # and gcfl_aggregate then still answers through BLAS
    got = gcfl_aggregate(u.double(), w, [0])
    assert torch.allclose(got, paper_gcfl(u, w, [0]), atol=1e-9)
