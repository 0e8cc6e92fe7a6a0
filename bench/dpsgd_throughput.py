"""Samples/s of plain SGD and of DP-SGD in every exact mode, and the DP/plain ratios, on
each model in one run.

    python bench/dpsgd_throughput.py [--models mnist-cnn cifar-cnn] [--modes ...]
                                     [--batch 64] [--samples 3200] [--repeats 3]

Real MNIST images (1 x 28 x 28, also for cifar-cnn: 521k parameters there), the same model
and batch size for every arm. DP arms run train_dpsgd as training does (Opacus' Poisson
loader, optimizer and accountant; ``bk`` is dpfl's book-keeping mode); plain SGD uses a
shuffled loader. Each round runs every arm of a model once in turn after one warm-up
epoch each, and the best of ``--repeats`` rounds is kept: load from other jobs hits all
arms alike, so the ratios are stable on a shared machine where absolute rates are not.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from dpfl.client.trainers import train_dpsgd, train_plain
from dpfl.config import OPACUS_MODES, RunConfig
from dpfl.data import ClientData, load_dataset, to_tensor
from dpfl.models import build_model
from dpfl.privacy.mechanisms.randomness import secret_generator

SHAPE = (1, 28, 28)


def _data(n: int) -> ClientData:
    ds = load_dataset("mnist")
    return ClientData(to_tensor("mnist", ds.x_train[:n]), torch.from_numpy(ds.y_train[:n]),
                      torch.empty(0), torch.empty(0), 10)


def _arm(model: str, mode: str, batch: int, data: ClientData):
    """One epoch of plain SGD (mode "plain") or DP-SGD in ``mode`` on a fresh model."""
    dev = torch.device("cpu")

    def run() -> None:
        if mode == "plain":
            cfg = RunConfig(batch_size=batch, lr=0.05, model=model)
            train_plain(build_model(model, SHAPE, 10), data, cfg, 0, dev)
        else:
            cfg = RunConfig(batch_size=batch, lr=0.05, model=model, opacus_mode=mode)
            gen = secret_generator()
            train_dpsgd(build_model(model, SHAPE, 10), data, cfg, 1.0, gen, gen, dev)
    return run


def _rates(arms: dict, n: int, repeats: int) -> dict[str, float | str]:
    """Best samples/s of each arm over interleaved rounds (or the error of a failing arm)."""
    best: dict[str, float | str] = {}
    for name, fn in arms.items():
        try:
            fn()  # warm-up (allocations, hooks, the first call's lazy init)
            best[name] = 0.0
        except Exception as exc:  # a mode unsupported for this model
            best[name] = f"failed ({type(exc).__name__}: {exc})"
    for _ in range(repeats):
        for name, fn in arms.items():
            if isinstance(best[name], str):
                continue
            t0 = time.perf_counter()
            fn()
            best[name] = max(best[name], n / (time.perf_counter() - t0))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["mnist-cnn", "cifar-cnn"])
    parser.add_argument("--modes", nargs="+", default=list(OPACUS_MODES),
                        choices=OPACUS_MODES)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=3200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    data = _data(args.samples)
    print(f"batch {args.batch}, {args.samples} samples/epoch, {args.threads} threads, "
          f"best of {args.repeats} interleaved rounds")
    summary = []
    for model in args.models:
        params = sum(p.numel() for p in build_model(model, SHAPE, 10).parameters())
        print(f"model {model} ({params:,} parameters)")
        arms = {m: _arm(model, m, args.batch, data) for m in ["plain", *args.modes]}
        rates = _rates(arms, args.samples, args.repeats)
        base = rates["plain"]
        for name, rate in rates.items():
            label = "plain SGD" if name == "plain" else f"DP-SGD {name}"
            if isinstance(rate, str):
                print(f"  {label:<20}{rate}")
            else:
                print(f"  {label:<20}{rate:>10,.0f} samples/s   {rate / base:.2f}x")
        dp = {k: v for k, v in rates.items() if k != "plain" and not isinstance(v, str)}
        fastest = max(dp, key=dp.get)
        summary.append(f"{model}: " + ", ".join(f"{k} {v / base:.2f}x" for k, v in dp.items())
                       + f" (fastest {fastest})")
    print("ratios to plain SGD:")
    for line in summary:
        print("  " + line)


if __name__ == "__main__":
    main()
