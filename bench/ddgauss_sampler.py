"""The discrete Gaussian samplers of ``dpfl.privacy.mechanisms.dgauss_sampler``, old vs new, in one run:
the integer-coin CKS 2020 sampler (the previous one) and the batched lazy-uniform one dpfl
uses (both exact), at a DDGauss share's variance.

    python bench/ddgauss_sampler.py [--variance 2.5e9] [--count 1000000] [--old-count 20000]

Prints coordinates per second of CPU time of this process (``time.process_time``; the wall
rate is printed too, it is lower when other work shares the cores) and the sample variance
over t v (1 up to sampling error). Run with OMP_NUM_THREADS=1 for one core.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dpfl.privacy.mechanisms.ddgauss import variance_factors  # noqa: E402
from dpfl.privacy.mechanisms.dgauss_sampler import (  # noqa: E402
    discrete_gaussian,
    discrete_gaussian_integer_coins,
)


def rate(sampler, count: int, t: int, v: int) -> tuple[float, float, float]:
    gen = torch.Generator().manual_seed(count)
    cpu, wall = time.process_time(), time.perf_counter()
    x = sampler((count,), t, v, gen)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return count / cpu, count / wall, x.double().var().item() / (t * v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variance", type=float, default=2.5e9)
    ap.add_argument("--count", type=int, default=1_000_000)
    ap.add_argument("--old-count", type=int, default=20_000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t, v = variance_factors(args.variance)
    print(f"N_Z(0, t v), t = {t}, v = {v}; one thread")
    old = rate(discrete_gaussian_integer_coins, args.old_count, t, v)
    new = rate(discrete_gaussian, args.count, t, v)
    for name, count, (cpu, wall, var) in (("old (integer coins)", args.old_count, old),
                                          ("new (lazy uniforms)", args.count, new)):
        print(f"{name:22s} {count:>9d} draws  {cpu:12,.0f} coords/s CPU  {wall:12,.0f} wall"
              f"  var / (t v) = {var:.4f}")
    print(f"speed-up (CPU): {new[0] / old[0]:.0f}x")


if __name__ == "__main__":
    main()
