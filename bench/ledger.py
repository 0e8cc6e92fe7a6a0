"""Epsilon of 1,000 clients after 500 rounds, each with its own participation pattern.

    python bench/ledger.py [--clients 1000] [--rounds 500]

Every client takes part in a random subset of rounds (its own rate in [0.05, 0.5]); three
client groups use different DP-SGD noise levels. The ledger builds each distinct event's RDP
curve once and combines them with one matrix product; the time printed is the full
``Ledger.epsilons()`` call. A naive per-client Opacus accountant on a sample of clients is
timed too, extrapolated to all clients, for the ratio.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import Ledger


def build(clients: int, rounds: int, seed: int = 0) -> Ledger:
    rng = np.random.default_rng(seed)
    ledger = Ledger(delta=1e-5)
    sigmas = (0.8, 1.0, 1.3)
    for c in range(clients):
        rate = rng.uniform(0.05, 0.5)
        taken = np.flatnonzero(rng.random(rounds) < rate) + 1
        sigma = sigmas[c % 3]
        ledger.clients[f"client-{c}"] = PrivacyHistory(
            [PrivacyEvent.dpsgd(int(r), sigma, 0.01, 100) for r in taken])
    return ledger


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=500)
    args = parser.parse_args()
    ledger = build(args.clients, args.rounds)
    events = sum(len(h.events) for h in ledger.clients.values())
    ledger.epsilons()  # warm the per-event curve cache once (3 distinct events)
    from dpfl.privacy.accounting.events import rdp_curve

    rdp_curve.cache_clear()
    t0 = time.perf_counter()
    eps = ledger.epsilons()
    fast = time.perf_counter() - t0
    values = np.array(list(eps.values()))
    print(f"{args.clients} clients, {args.rounds} rounds, {events:,} events")
    print(f"ledger epsilons (cold curve cache): {fast:.3f} s   "
          f"[eps min {values.min():.2f}, median {np.median(values):.2f}, max {values.max():.2f}]")
    from opacus.accountants import RDPAccountant

    sample = list(ledger.clients)[:20]
    t0 = time.perf_counter()
    for name in sample:
        acc = RDPAccountant()
        acc.history = [(e.sigma, e.rate, e.steps) for e in ledger.clients[name].events]
        assert abs(acc.get_epsilon(1e-5) - eps[name]) <= 1e-9 * eps[name]
    naive = (time.perf_counter() - t0) / len(sample) * args.clients
    print(f"naive per-client Opacus accountant (extrapolated): {naive:.2f} s   "
          f"-> {naive / fast:.0f}x; bound < 1 s: {'met' if fast < 1.0 else 'NOT met'}")


if __name__ == "__main__":
    main()
