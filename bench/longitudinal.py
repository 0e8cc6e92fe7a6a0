"""Longitudinal clipping (AADP-FL Alg. 2, sort + cumulative sums) of d = 1.2M floats, beside a
plain L2 norm clip, and their ratio.

    python bench/longitudinal.py [--dim 1200000]
"""

from __future__ import annotations

import argparse

import torch
from timing import best_time

from dpfl.privacy.longitudinal import longitudinal_clip
from dpfl.privacy.mechanisms import l2_clip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1_200_000)
    args = parser.parse_args()
    theta = torch.randn(args.dim, generator=torch.Generator().manual_seed(0)) * 1e-3
    bound = 0.5 * float(theta.norm())
    t_long = best_time(lambda: longitudinal_clip(theta, bound))
    t_norm = best_time(lambda: l2_clip(theta, bound))
    kept = int((longitudinal_clip(theta, bound) != 0).sum())
    print(f"d = {args.dim:,}, S = half the norm ({kept:,} coordinates kept), "
          f"{torch.get_num_threads()} threads")
    print(f"longitudinal clip: {1e3 * t_long:7.1f} ms   (goal < 50 ms: "
          f"{'met' if t_long < 0.05 else 'NOT met'})")
    print(f"plain norm clip:   {1e3 * t_norm:7.1f} ms   ratio {t_long / t_norm:.0f}x")


if __name__ == "__main__":
    main()
