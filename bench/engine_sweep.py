"""The cost of one sweep of Flower's simulation engine over its nodes, with Flower's own
instruction scan and with dpfl's per-node index (dpfl.server.node_index).

    python bench/engine_sweep.py [--nodes 1000 10000] [--per-round 100] [--repeats 5]

Flower 1.39's ``add_messages_to_queue`` calls ``get_message_ins(node, limit=1)`` for every
node every 0.1 s. This bench builds two real in-memory LinkStates as Flower's simulation
does, stores one round's instructions (``--per-round`` nodes get one each), and times (a)
the sweeps that deliver them and (b) one idle sweep afterwards (the delivered instructions
stay stored until their replies are pulled, so Flower keeps scanning them). The two states
alternate, and the printed ratio is indexed / Flower, from the best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfl.server import node_index  # noqa: E402


def one_round(nodes: int, per_round: int, indexed: bool, seed: int) -> tuple[float, float]:
    """(seconds of the sweeps that deliver a round, seconds of one idle sweep)."""
    state, grids, node_ids = node_index.simulation_state(nodes)
    if indexed:
        node_index.index_instructions_by_node(state)
    grid = grids[7]
    for k, node in enumerate(random.Random(seed).sample(node_ids, per_round)):
        node_index.push_instruction(grid, node, f"r{k}")
    delivered, t0 = 0, time.perf_counter()
    while delivered < per_round:
        for node in node_ids:
            delivered += len(state.get_message_ins(node_id=node, limit=1))
    deliver = time.perf_counter() - t0
    t0 = time.perf_counter()
    for node in node_ids:
        state.get_message_ins(node_id=node, limit=1)
    return deliver, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'nodes':>7} {'per round':>9} {'flower deliver ms':>18} {'indexed':>8} "
          f"{'flower idle ms':>15} {'indexed':>8} {'ratio deliver':>14} {'ratio idle':>11}")
    for n in args.nodes:
        best = {False: [float("inf")] * 2, True: [float("inf")] * 2}
        for r in range(args.repeats):
            for indexed in (False, True):
                d, i = one_round(n, args.per_round, indexed, seed=r)
                best[indexed] = [min(best[indexed][0], d), min(best[indexed][1], i)]
        (fd, fi), (xd, xi) = best[False], best[True]
        print(f"{n:>7} {args.per_round:>9} {fd * 1e3:>18.1f} {xd * 1e3:>8.1f} "
              f"{fi * 1e3:>15.1f} {xi * 1e3:>8.1f} {xd / fd:>13.3f}x {xi / fi:>10.3f}x",
              flush=True)


if __name__ == "__main__":
    main()
