"""DP-FedASGP's client selection and perturbation of d = 1.2M coordinates (goal < 50 ms):
the whole ``release_update`` after local training (g = -Delta / lr, the clip, then the
paper variant's eq. 14 threshold by one ``torch.kthvalue`` + Laplace on the significant
coordinates, or the strict variant's sparse vector: d query draws, the positives, a random
c of them, Laplace on those), beside its parts and a plain L2 clip.

    python bench/fedasgp.py [--dim 1200000] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch
from timing import best_time

from dpfl.method import TRAIN_LOSS
from dpfl.methods import METHODS, run_config
from dpfl.methods.fedasgp import asgp_threshold, round_svt
from dpfl.privacy.mechanisms.release import l2_clip, laplace_noise

GOAL_S = 0.050


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1_200_000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    d = args.dim
    update = torch.randn(d, generator=torch.Generator().manual_seed(0)) * 1e-3
    half = METHODS["fedasgp"].client
    gen = torch.Generator().manual_seed(1)
    print(f"d = {d:,}, {torch.get_num_threads()} thread(s), goal < {1e3 * GOAL_S:.0f} ms")
    for variant, t in (("paper", 1), ("paper", 100), ("strict", 100)):
        cfg = run_config(strategy="fedasgp", trainer="update-dp", asgp_variant=variant,
                         num_rounds=200, lr=0.1)
        clip = cfg.clip_norm
        seconds = best_time(lambda: half.release_update(cfg, {}, update, 0.0, clip, gen, t,
                                                        {TRAIN_LOSS: 1.0}))
        out, _, metrics = half.release_update(cfg, {}, update, 0.0, clip, gen, t,
                                              {TRAIN_LOSS: 1.0})
        noised = (metrics.get("asgp-significant") if variant == "paper"
                  else int(torch.count_nonzero(out)) / d)
        print(f"{variant:6s} round {t:3d}/200: {1e3 * seconds:7.1f} ms   "
              f"({'met' if seconds < GOAL_S else 'NOT met'}; fraction noised/released "
              f"{noised:.4g})")
    g = l2_clip(update, 1.0)
    print("parts:")
    print(f"  L2 clip                       {1e3 * best_time(lambda: l2_clip(update, 1.0)):7.1f} ms")
    print(f"  kthvalue of |g'| (eq. 14)     "
          f"{1e3 * best_time(lambda: asgp_threshold(g, 100, 200)):7.1f} ms")
    print(f"  Laplace draws, d of them      "
          f"{1e3 * best_time(lambda: laplace_noise((d,), 1.0, gen)):7.1f} ms")
    svt = round_svt(run_config(strategy="fedasgp", trainer="update-dp"))
    print(f"  sparse-vector selection (c = {svt.max_answers})  "
          f"{1e3 * best_time(lambda: svt.select(g.abs(), gen)):7.1f} ms")


if __name__ == "__main__":
    main()
