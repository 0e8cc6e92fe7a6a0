"""One aggregation of M client updates of d ~ 1.2M floats: FedAvg's weighted mean vs GCFL's
projection correction + weighted mean, vs FedCompDP's CRA (update norms, EMAs, scores,
softmax weights, weighted mean, then the primal-dual correction against 10 kept CD-norm
constraints), vs DP-FedASGP's eq. 16 weighting as its strategy runs it (the paper variant:
gamma_i from the public sizes and the reported losses, then the weighted mean; the strict
variant: n_i / n, then the weighted mean; its count of released coordinates per reply is
made once by the reply check, not here; goal <= 1.2x FedAvg at M = 100) and vs Fed-SMP's
(the weighted mean times d / k, the rand-k rescale), with the ratios to FedAvg per M. (CRA's server-side F1 scoring
evaluates a model per client: that is evaluation, not aggregation, and is not timed here.)

    python bench/aggregation.py [--dim 1200000] [--ms 2 10 50 100] [--chunks 1024 16384 ...]

Updates are a weak shared direction plus per-client noise (as DP-SGD updates are), so a
realistic share of pairs has negative cosine (printed). GCFL is timed with 1 reference and
with M/10 references, each as it runs (one read of U, the fused kernel of
dpfl.server.fused) and on its two-pass BLAS fallback (``2p``: the implementation before the
kernel, and what runs where no C compiler is found). ``--chunks`` adds a sweep of the
BLAS path's column-block width (1 reference). All arms of one M are timed interleaved
(best of ``--repeats`` rounds), so the ratios hold on a loaded machine.
"""

from __future__ import annotations

import argparse

import torch
from timing import best_time, best_times

from dpfl.methods import build_strategy, run_config
from dpfl.methods.fedasgp import LOSS_KEY, SIGNIFICANT_KEY
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
from dpfl.server.strategy import DPFLStrategy
from dpfl.server.validation import ClientUpdate


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


def method_strategy(strategy: str, m: int, **keys) -> DPFLStrategy:
    """A method's real strategy with M public partition sizes bound."""
    return build_strategy(run_config(strategy=strategy, trainer="update-dp", **keys),
                          {i: 100 + 7 * i for i in range(m)})


def method_aggregate(strategy: DPFLStrategy, accepted: list[ClientUpdate],
                     u: torch.Tensor) -> torch.Tensor:
    """What ``finish_round`` does between stacking the updates and the server step: the
    method's weights, then its aggregation."""
    return strategy.aggregate_updates(u, strategy.aggregation_weights(accepted))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1_200_000)
    parser.add_argument("--ms", type=int, nargs="+", default=[2, 10, 50, 100])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunks", type=int, nargs="*", default=[],
                        help="also time GCFL (1 reference) with these column-block widths")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(args.dim, generator=g)
    print(f"d = {args.dim:,}, float32, {torch.get_num_threads()} threads")
    print(f"{'M':>4} {'neg-cos':>8} {'FedAvg ms':>10} {'GCFL(1) ms':>11} {'ratio':>6} "
          f"{'2p ratio':>8} {'GCFL(M/10) ms':>14} {'ratio':>6} {'2p ratio':>8} "
          f"{'CRA ms':>8} {'ratio':>6} "
          f"{'ASGP-p ms':>10} {'ratio':>6} {'ASGP-s ms':>10} {'ratio':>6} "
          f"{'SMP ms':>8} {'ratio':>6}")
    for m in args.ms:
        u = 0.02 * shared + torch.randn(m, args.dim, generator=g)
        w = torch.randint(500, 1500, (m,), generator=g).float()
        un = u / u.norm(dim=1, keepdim=True)
        cos = un @ un.T
        neg = float((cos[~torch.eye(m, dtype=torch.bool)] < 0).float().mean()) if m > 1 else 0.0
        refs1 = [0]
        refs10 = list(range(0, m, 10))[: max(1, m // 10)]
        w_prev = torch.randn(args.dim, generator=g)
        f1 = torch.rand(m, generator=g)
        state = {"f1": {i: 0.5 for i in range(m)}, "norm": {i: 1.0 for i in range(m)}}
        dirs = torch.randn(10, args.dim, generator=g)
        kept = Constraints(dirs / dirs.norm(dim=1, keepdim=True),
                           torch.full((10,), 1e-9, dtype=torch.float64),
                           torch.arange(10))   # 10 active constraints, the worst case
        norms = torch.linalg.vector_norm(u, dim=1)
        losses = torch.rand(m, generator=g) + 0.5
        accepted = [ClientUpdate(node_id=i + 1, partition_id=i, flat=u[i], num_examples=1,
                                 metrics={LOSS_KEY: float(losses[i]), SIGNIFICANT_KEY: 0.1})
                    for i in range(m)]
        asgp = {v: method_strategy("fedasgp", m, asgp_variant=v) for v in ("paper", "strict")}
        smp = method_strategy("fedsmp", m)
        t = best_times({
            "avg": lambda: weighted_mean(u, w),
            "g1": lambda: gcfl_aggregate(u, w, refs1),
            "g1-2p": lambda: gcfl_aggregate(u, w, refs1, fused=False),
            "g10": lambda: gcfl_aggregate(u, w, refs10),
            "g10-2p": lambda: gcfl_aggregate(u, w, refs10, fused=False),
            "cra": lambda: cra_aggregate(u, norms, w_prev, f1, state, kept),
            "ap": lambda: method_aggregate(asgp["paper"], accepted, u),
            "as": lambda: method_aggregate(asgp["strict"], accepted, u),
            "smp": lambda: method_aggregate(smp, accepted, u),
        }, args.repeats)
        t_avg = t["avg"]
        print(f"{m:>4} {neg:>8.2f} {1e3 * t_avg:>10.1f} {1e3 * t['g1']:>11.1f} "
              f"{t['g1'] / t_avg:>6.2f} {t['g1-2p'] / t_avg:>8.2f} {1e3 * t['g10']:>14.1f} "
              f"{t['g10'] / t_avg:>6.2f} {t['g10-2p'] / t_avg:>8.2f} {1e3 * t['cra']:>8.1f} "
              f"{t['cra'] / t_avg:>6.2f} {1e3 * t['ap']:>10.1f} {t['ap'] / t_avg:>6.2f} "
              f"{1e3 * t['as']:>10.1f} {t['as'] / t_avg:>6.2f} {1e3 * t['smp']:>8.1f} "
              f"{t['smp'] / t_avg:>6.2f}")
        for chunk in args.chunks:
            tc = best_time(lambda: gcfl_aggregate(u, w, refs1, chunk=chunk))
            print(f"{'':>4} chunk {chunk:>8}: GCFL(1) 2p {1e3 * tc:.1f} ms, "
                  f"ratio {tc / t_avg:.2f}")
        u = un = accepted = None  # frees the M x d matrices before the next M


if __name__ == "__main__":
    main()
