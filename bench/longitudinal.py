"""Longitudinal clipping (AADP-FL Alg. 2: radix selection of the cut, O(d)) of d = 1.2M
floats, beside a plain L2 norm clip and the previous sort-based version (kept below for
timing only), with the ratios; also one adversarial input (all coordinates equal).

    python bench/longitudinal.py [--dim 1200000]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from timing import best_time

from dpfl.privacy.mechanisms.longitudinal import longitudinal_clip
from dpfl.privacy.mechanisms.release import l2_clip

GOAL_S = 0.025


def sort_based_reference(theta: torch.Tensor, bound: float) -> torch.Tensor:
    """The previous implementation (argsort + ascending cumulative sums, O(d log d)), for
    timing only: total - cumsum cancels catastrophically when S << ||theta|| (e.g. 10^5
    equal coordinates and S = 1e-3 gave a norm of 1058), which the current version fixes."""
    flat = theta.detach().reshape(-1).cpu().numpy()
    mag = np.abs(flat)
    sq = mag.astype(np.float64) ** 2
    total = float(sq.sum())
    if total <= bound * bound:
        return theta.clone()
    order = np.argsort(mag)
    remaining = total - np.cumsum(sq[order])
    k = int(np.argmax(remaining <= bound * bound + 1e-12 * total)) + 1
    out = flat.copy()
    if k >= flat.size:
        out[:] = 0
        top = int(np.argmax(mag))
        out[top] = np.sign(flat[top]) * bound
        return torch.from_numpy(out).view_as(theta)
    v = mag[order[k - 1]]
    tied_zeroed = int(np.count_nonzero(mag[order[:k]] == v))
    out[mag < v] = 0
    out[np.flatnonzero(mag == v)[:tied_zeroed]] = 0
    return torch.from_numpy(out).view_as(theta)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1_200_000)
    args = parser.parse_args()
    theta = torch.randn(args.dim, generator=torch.Generator().manual_seed(0)) * 1e-3
    bound = 0.5 * float(theta.norm())
    t_long = best_time(lambda: longitudinal_clip(theta, bound))
    t_norm = best_time(lambda: l2_clip(theta, bound))
    t_sort = best_time(lambda: sort_based_reference(theta, bound), repeats=3)
    out = longitudinal_clip(theta, bound)
    same = torch.equal(out, sort_based_reference(theta, bound))
    kept = int((out != 0).sum())
    print(f"d = {args.dim:,}, S = half the norm ({kept:,} coordinates kept), "
          f"{torch.get_num_threads()} threads")
    print(f"longitudinal clip: {1e3 * t_long:7.1f} ms   (goal <= {1e3 * GOAL_S:.0f} ms: "
          f"{'met' if t_long <= GOAL_S else 'NOT met'})")
    print(f"plain norm clip:   {1e3 * t_norm:7.1f} ms   longitudinal / norm clip: "
          f"{t_long / t_norm:.1f}x")
    print(f"sort-based (old):  {1e3 * t_sort:7.1f} ms   speed-up: {t_sort / t_long:.1f}x   "
          f"same output: {'yes' if same else 'NO'}")
    equal = torch.full((args.dim,), 3.3465347290039062)
    t_eq = best_time(lambda: longitudinal_clip(equal, 1e-3 * args.dim ** 0.5))
    print(f"all {args.dim:,} coordinates equal, S = 1e-3 sqrt(d): {1e3 * t_eq:7.1f} ms")


if __name__ == "__main__":
    main()
