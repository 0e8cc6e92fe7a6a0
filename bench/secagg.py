"""The cost of one SecAgg+ round in dpfl's use (``trust=distributed``): dpfl's server half
(``dpfl.server.secagg``) with Flower 1.39's own ``secaggplus_mod`` on every client, all in
one process (``dpfl.apps.loopback``), for n clients per round and neighbourhoods of k.

    python bench/secagg.py [--clients 10 50 100] [--dim 80202] [--shares 0 11]

Prints per (n, k): the seconds of the whole round (every party's key agreement, Shamir
sharing, masking and the server's unmasking, run one after another: CPU seconds), per
client, and with one client dropping out (its masks reconstructed from shares). SecAgg+
costs O(n k) key agreements and O(k d) mask expansions per client; the training compute of
a round is not included.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from flwr.app import ConfigRecord, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from dpfl.apps.loopback import LoopbackGrid, share_app  # noqa: E402
from dpfl.privacy.trust import share_limit  # noqa: E402
from dpfl.server.secagg import SecAggPlusServer  # noqa: E402


def one_round(n: int, dim: int, shares: int, drop: bool) -> tuple[float, bool]:
    gen = torch.Generator().manual_seed(n)
    limit = share_limit(n)
    vectors = {i: torch.randint(-1000, 1000, (dim,), generator=gen, dtype=torch.int64)
               for i in range(1, n + 1)}

    def failing(msg, ctxt):
        raise RuntimeError("dropped out")

    apps = {i: share_app(v, i) for i, v in vectors.items()}
    if drop:
        apps[1] = failing
    server = SecAggPlusServer(LoopbackGrid(apps), limit, shares, 0.5, n - 1 if drop else n,
                              None, random.Random(0))
    t0 = time.perf_counter()
    result = server.run({i: RecordDict({"config": ConfigRecord({})}) for i in vectors}, "1")
    seconds = time.perf_counter() - t0
    expected = sum(v for i, v in vectors.items() if not (drop and i == 1))
    return seconds, result.total is not None and torch.equal(result.total, expected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--dim", type=int, default=80_202)
    parser.add_argument("--shares", type=int, nargs="+", default=[0, 11],
                        help="neighbourhood size k (0 = every client of the round)")
    args = parser.parse_args()
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    print(f"{'n':>5} {'k':>5} {'round s':>9} {'s/client':>9} {'1 drop s':>9} {'exact':>6}")
    for n in args.clients:
        for k in args.shares:
            if 0 < k >= n:
                continue
            full, ok = one_round(n, args.dim, k, drop=False)
            dropped, ok_drop = one_round(n, args.dim, k, drop=True)
            print(f"{n:>5} {k or n:>5} {full:>9.2f} {full / n:>9.3f} {dropped:>9.2f} "
                  f"{str(ok and ok_drop):>6}", flush=True)


if __name__ == "__main__":
    main()
