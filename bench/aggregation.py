"""One aggregation of M client updates of d ~ 1.2M floats: FedAvg's weighted mean vs GCFL's
projection correction + weighted mean, and vs FedCompDP's CRA (update norms, EMAs, scores,
softmax weights, weighted mean, then the primal-dual correction against 10 kept CD-norm
constraints), with the ratios to FedAvg per M. (CRA's server-side F1 scoring evaluates a
model per client: that is evaluation, not aggregation, and is not timed here.)

    python bench/aggregation.py [--dim 1200000] [--ms 2 10 50 100] [--chunks 1024 16384 ...]

Updates are a weak shared direction plus per-client noise (as DP-SGD updates are), so a
realistic share of pairs has negative cosine (printed). GCFL is timed with 1 reference and
with M/10 references. ``--chunks`` adds a sweep of the column-block width (1 reference).
"""

from __future__ import annotations

import argparse

import torch
from timing import best_time

from dpfl.methods.fedcompdp import (
    Constraints,
    cra_weights,
    ema,
    linearised_direction,
    primal_dual_step,
    reliability_scores,
)
from dpfl.methods.gcfl import gcfl_aggregate
from dpfl.server.aggregation import server_sgd_step, weighted_mean


def cra_aggregate(u: torch.Tensor, norms: torch.Tensor, w_prev: torch.Tensor,
                  f1: torch.Tensor, state: dict, constraints: Constraints) -> torch.Tensor:
    """FedCompDP's server aggregation as the strategy runs it (eqs. 11-19); the update
    norms (eq. 10) come with the replies (validation computes them for every method)."""
    f1_ema = torch.tensor([ema(state["f1"].get(i), float(f), 0.5) for i, f in enumerate(f1)])
    norm_ema = torch.tensor([ema(state["norm"].get(i), float(n), 0.5)
                             for i, n in enumerate(norms)])
    weights = cra_weights(reliability_scores(f1_ema, norm_ema, 0.1), 0.1)
    w_tilde = server_sgd_step(w_prev, weighted_mean(u, weights), 1.0)
    new = constraints.add(linearised_direction(w_tilde, w_prev), 0)
    return primal_dual_step(w_tilde, w_prev, constraints, 1.0, 0.5, new)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1_200_000)
    parser.add_argument("--ms", type=int, nargs="+", default=[2, 10, 50, 100])
    parser.add_argument("--chunks", type=int, nargs="*", default=[],
                        help="also time GCFL (1 reference) with these column-block widths")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(args.dim, generator=g)
    print(f"d = {args.dim:,}, float32, {torch.get_num_threads()} threads")
    print(f"{'M':>4} {'neg-cos':>8} {'FedAvg ms':>10} {'GCFL(1) ms':>11} {'ratio':>6} "
          f"{'GCFL(M/10) ms':>14} {'ratio':>6} {'CRA ms':>8} {'ratio':>6}")
    for m in args.ms:
        u = 0.02 * shared + torch.randn(m, args.dim, generator=g)
        w = torch.randint(500, 1500, (m,), generator=g).float()
        un = u / u.norm(dim=1, keepdim=True)
        cos = un @ un.T
        neg = float((cos[~torch.eye(m, dtype=torch.bool)] < 0).float().mean()) if m > 1 else 0.0
        t_avg = best_time(lambda: weighted_mean(u, w))
        refs1 = [0]
        refs10 = list(range(0, m, 10))[: max(1, m // 10)]
        t_g1 = best_time(lambda: gcfl_aggregate(u, w, refs1))
        t_g10 = best_time(lambda: gcfl_aggregate(u, w, refs10))
        w_prev = torch.randn(args.dim, generator=g)
        f1 = torch.rand(m, generator=g)
        state = {"f1": {i: 0.5 for i in range(m)}, "norm": {i: 1.0 for i in range(m)}}
        dirs = torch.randn(10, args.dim, generator=g)
        kept = Constraints(dirs / dirs.norm(dim=1, keepdim=True),
                           torch.full((10,), 1e-9, dtype=torch.float64),
                           torch.arange(10))   # 10 active constraints, the worst case
        norms = torch.linalg.vector_norm(u, dim=1)
        t_cra = best_time(lambda: cra_aggregate(u, norms, w_prev, f1, state, kept))
        print(f"{m:>4} {neg:>8.2f} {1e3 * t_avg:>10.1f} {1e3 * t_g1:>11.1f} {t_g1 / t_avg:>6.2f} "
              f"{1e3 * t_g10:>14.1f} {t_g10 / t_avg:>6.2f} {1e3 * t_cra:>8.1f} "
              f"{t_cra / t_avg:>6.2f}")
        for chunk in args.chunks:
            t = best_time(lambda: gcfl_aggregate(u, w, refs1, chunk=chunk))
            print(f"{'':>4} chunk {chunk:>8}: GCFL(1) {1e3 * t:.1f} ms, ratio {t / t_avg:.2f}")
        del u, un


if __name__ == "__main__":
    main()
