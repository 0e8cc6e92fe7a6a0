"""A cohort host's local training: batched (dpfl/client/batched_training.py, one
torch.func.vmap call per step for up to K clients) against one client after another
(dpfl.client.trainers.train_plain), on the pfl-research task's shape (MNIST-sized inputs,
54 examples a client, batch 16, one local epoch), best of 3 after a warm-up.

    python bench/cohort_batch.py [--clients 25] [--models mlp mnist-cnn] [--chunks 8 16 32]
        [--threads 1] [--device cpu]

Prints seconds and the batched / sequential ratio per chunk size (< 1: batching pays).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _best(run: Callable[[], None], repeats: int = 3) -> float:
    run()   # warm-up: the first call of either path pays one-off costs
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=25)
    parser.add_argument("--examples", type=int, default=54)
    parser.add_argument("--models", nargs="+", default=["mlp", "mnist-cnn"])
    parser.add_argument("--chunks", nargs="+", type=int, default=[8, 16, 32])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    import torch

    from dpfl.client.batched_training import train_plain_batched
    from dpfl.client.trainers import train_plain
    from dpfl.data import ClientData
    from dpfl.methods import parse_run_config
    from dpfl.models import build_model

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    datas = [ClientData(torch.randn(args.examples, 1, 28, 28, generator=g),
                        torch.randint(0, 10, (args.examples,), generator=g),
                        torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long), 10)
             for _ in range(args.clients)]
    print(f"{args.clients} clients x {args.examples} examples, batch 16, 1 local epoch, "
          f"{args.threads} torch thread(s), {device}")
    for name in args.models:
        cfg = parse_run_config({"dataset": "mnist", "model": name, "trainer": "update-dp",
                                "batch-size": 16, "lr": 0.05, "local-epochs": 1})
        base = build_model(name, (1, 28, 28), 10)

        def one_by_one() -> None:
            for i, data in enumerate(datas):
                train_plain(copy.deepcopy(base), data, cfg, i, device)

        def batched(k: int) -> None:
            models = [copy.deepcopy(base) for _ in datas]
            for s in range(0, len(datas), k):
                train_plain_batched(models[s:s + k], datas[s:s + k], cfg,
                                    list(range(s, min(len(datas), s + k))), device)

        seq = _best(one_by_one)
        cells = [f"one by one {seq:.3f} s"]
        for k in args.chunks:
            t = _best(lambda k=k: batched(k))
            cells.append(f"batched {k}: {t:.3f} s ({t / seq:.2f}x)")
        print(f"  {name}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
