"""Samples/s of plain SGD and of DP-SGD in each exact Opacus mode, and the DP/plain ratios.

    python bench/dpsgd_throughput.py [--model mnist-cnn] [--batch 64] [--samples 12800]

Real MNIST images, the same model and batch size for every mode, one warm-up pass each.
Opacus' Poisson loader is used for DP (as in training); plain SGD uses a shuffled loader.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from dpfl.client.trainers import train_dpsgd, train_plain
from dpfl.config import RunConfig
from dpfl.data import ClientData, load_dataset, to_tensor
from dpfl.models import build_model
from dpfl.privacy.randomness import secret_generator

MODES = ("hooks", "functorch", "ghost")


def _data(n: int) -> ClientData:
    ds = load_dataset("mnist")
    return ClientData(to_tensor("mnist", ds.x_train[:n]), torch.from_numpy(ds.y_train[:n]),
                      torch.empty(0), torch.empty(0), 10)


def _time(fn, data: ClientData, repeats: int) -> float:
    fn(data)  # warm-up (allocations, hooks)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(data)
        best = min(best, time.perf_counter() - t0)
    return len(data.y_train) / best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mnist-cnn")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=12800)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    data = _data(args.samples)
    dev = torch.device("cpu")
    params = sum(p.numel() for p in build_model(args.model, (1, 28, 28), 10).parameters())
    print(f"model {args.model} ({params:,} parameters), batch {args.batch}, "
          f"{args.samples} samples/epoch, {args.threads} threads")

    def plain(d):
        cfg = RunConfig(batch_size=args.batch, lr=0.05, model=args.model)
        train_plain(build_model(args.model, (1, 28, 28), 10), d, cfg, 0, dev)

    base = _time(plain, data, args.repeats)
    print(f"{'plain SGD':<22}{base:>10,.0f} samples/s   1.00x")
    best = ("", 0.0)
    for mode in MODES:
        def dp(d, mode=mode):
            cfg = RunConfig(batch_size=args.batch, lr=0.05, model=args.model, opacus_mode=mode)
            gen = secret_generator()
            train_dpsgd(build_model(args.model, (1, 28, 28), 10), d, cfg, 1.0, gen, gen, dev)
        try:
            rate = _time(dp, data, args.repeats)
        except Exception as exc:  # a mode unsupported for this model
            print(f"{'DP-SGD ' + mode:<22}{'failed':>10}   ({type(exc).__name__}: {exc})")
            continue
        print(f"{'DP-SGD ' + mode:<22}{rate:>10,.0f} samples/s   {rate / base:.2f}x")
        if rate > best[1]:
            best = (mode, rate)
    print(f"fastest exact DP mode: {best[0]} at {best[1] / base:.2f}x plain SGD")


if __name__ == "__main__":
    main()
