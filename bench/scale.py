"""Cross-device scale: a real `dpfl simulate` (Flower's Ray backend) at 100 / 300 / 1,000
clients (and 10,000 at q = 0.01), central DP-FedAvg (trust=central, Poisson q = 0.1) on
MNIST.

    python bench/scale.py [--clients 100 300 1000] [--rounds 4] [--trust central]
        [--fraction-train 0.1] [--engine indexed flower] [--layout cohort one]
        [key=value ...]

``--layout``: cohort nodes (the default: ``cohort-nodes`` automatic, each simulated node
trains a cohort of clients per message) and/or one node per client (``cohort-nodes=0``);
with both, interleaved per size, with their ratio.

Prints per federation size: the peak resident memory of the whole simulation (every
process of the run's tree, read from /proc every 0.5 s); the round's cycle time (between
the starts of rounds 2..R in rounds.jsonl: round 1 includes the actors' start-up); the pure
training compute of the round (one client's local training timed here, times the round's
sampled clients, divided by the actors working in parallel); the exchange phase (the
instructions out and the replies in: Flower's transport plus that training); Flower's
overhead = 1 - compute / exchange, the whole round's = 1 - compute / cycle; dpfl's own
server work per round (validation and aggregation, the durable ledger, central evaluation,
accounting); and the bytes a node keeps between rounds (the clients' ``node-state-bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dpfl.runtime.watchdog import descendants  # noqa: E402


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/statm") as f:
                pages = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        p = int(entry)
        children.setdefault(int(fields[1]), []).append(p)
        rss[p] = pages * os.sysconf("SC_PAGE_SIZE")
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0)
        stack.extend(children.get(p, []))
    return total


def tree_pss(pid: int) -> int:
    """Proportional set size of ``pid`` and all its descendants: RSS counts the pages that
    processes share (torch's libraries, a fork's untouched pages) in every one of them; PSS
    divides each among its users, so the sum is what the tree takes together."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def wait_with_peak_memory(proc: subprocess.Popen) -> tuple[int, int, int]:
    """Wait for ``proc``; its exit code, the peak resident bytes (RSS summed) and the peak
    PSS (:func:`tree_pss`) of its process tree, sampled every 0.5 s."""
    peak, peak_pss, done = 0, 0, threading.Event()

    def watch() -> None:
        nonlocal peak, peak_pss
        while not done.is_set():
            peak = max(peak, _tree_rss(proc.pid))
            peak_pss = max(peak_pss, tree_pss(proc.pid))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code = proc.wait()
    done.set()
    watcher.join()
    return code, peak, peak_pss


def run_federation(clients: int, rounds: int, trust: str, out: Path,
                   extra: list[str], engine: str = "indexed",
                   fraction: float = 0.1, layout: str = "cohort") -> tuple[Path, int]:
    """One simulation; (run directory, peak RSS bytes of its process tree). ``engine``:
    "indexed" (dpfl.server.node_index, the default) or "flower" (Flower's own scan);
    ``layout``: "cohort" (cohort nodes, automatic) or "one" (one node per client)."""
    name = f"scale-{trust}-{clients}-{engine}-{layout}"
    if layout == "one":
        extra = [*extra, "cohort-nodes=0"]
    env = {**os.environ, "DPFL_FLOWER_NODE_INDEX": "1" if engine == "indexed" else "0"}
    cmd = [sys.executable, "-m", "dpfl.cli", "simulate", "--clients", str(clients),
           "--output-dir", str(out), f"run-name={name}", "trainer=update-dp",
           f"trust={trust}", f"fraction-train={fraction:g}",
           f"num-rounds={rounds}",
           "target-epsilon=8", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    code, peak, _ = wait_with_peak_memory(proc)
    if code != 0:
        raise SystemExit(f"the {clients}-client simulation failed (exit {code})")
    return out / name, peak


def training_seconds(cfg, clients: int, repeats: int = 5) -> float:
    """One client's local training of a round under the typed run-config ``cfg``
    (partition 0 of ``clients``, one thread), best of N."""
    import torch

    from dpfl.client.trainers import train_plain
    from dpfl.data import client_data
    from dpfl.methods import method_for

    data = client_data(cfg, 0, clients)
    torch.set_num_threads(1)
    best = float("inf")
    for _ in range(repeats):
        model = method_for(cfg).build_model(cfg, tuple(data.x_train.shape[1:]),
                                            data.num_classes)
        t0 = time.perf_counter()
        train_plain(model, data, cfg, 0, torch.device("cpu"))
        best = min(best, time.perf_counter() - t0)
    return best


def client_compute_seconds(clients: int, extra: list[str], repeats: int = 5) -> float:
    """One client's local training of a round (partition 0 of ``clients``), best of N."""
    from dpfl.methods import parse_run_config

    def literal(text: str) -> object:   # key=value as the CLI reads it: TOML's literals
        import tomllib
        try:
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            return text

    overrides = {k: literal(v) for k, v in (kv.split("=", 1) for kv in extra)}
    return training_seconds(parse_run_config({"trainer": "update-dp", **overrides}),
                            clients, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--trust", default="central")
    parser.add_argument("--actors", type=int, default=2, help="Ray actors (one per CPU)")
    parser.add_argument("--fraction-train", type=float, default=0.1,
                        help="Poisson q (0.01 at 10,000 clients: ~100 a round)")
    parser.add_argument("--engine", nargs="+", choices=("indexed", "flower"),
                        default=["indexed"],
                        help="Flower's instruction lookup: dpfl's per-node index, Flower's "
                             "own scan, or both (interleaved per size, with their ratio)")
    parser.add_argument("--layout", nargs="+", choices=("cohort", "one"),
                        default=["cohort"],
                        help="cohort nodes (default), one node per client, or both "
                             "(interleaved per size, with their ratio)")
    parser.add_argument("extra", nargs="*", help="run-config overrides key=value")
    args = parser.parse_args()
    print(f"{'clients':>8} {'engine':>8} {'layout':>7} {'peak GiB':>9} {'cycle s':>8} "
          f"{'compute s':>10} "
          f"{'exchange s':>11} {'Flower ovh':>11} {'round ovh':>10} {'server s':>9} "
          f"{'sampled':>8} {'state B':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.clients:
            cycles: dict[tuple[str, str], tuple[float, float]] = {}
            for engine in args.engine:
                for layout in args.layout:
                    cycles[engine, layout] = _measure(n, engine, layout, args, Path(tmp))
            for layout in args.layout:
                if len(args.engine) == 2:
                    (fc, fe), (ic, ie) = cycles["flower", layout], cycles["indexed", layout]
                    print(f"{n:>8} {layout}: indexed / flower: cycle {ic / fc:.2f}x, "
                          f"exchange {ie / fe:.2f}x", flush=True)
            for engine in args.engine:
                if len(args.layout) == 2:
                    (oc, oe), (cc, ce) = cycles[engine, "one"], cycles[engine, "cohort"]
                    print(f"{n:>8} {engine}: cohort / one node per client: cycle "
                          f"{cc / oc:.2f}x, exchange {ce / oe:.2f}x", flush=True)


def _measure(n: int, engine: str, layout: str, args: argparse.Namespace,
             tmp: Path) -> tuple[float, float]:
    """Run one size with one engine and layout, print its row; (cycle s, exchange s)."""
    run, peak = run_federation(n, args.rounds, args.trust, tmp, args.extra, engine,
                               args.fraction_train, layout)
    rounds = [json.loads(line) for line in
              (run / "rounds.jsonl").read_text().splitlines()]
    later = rounds[1:] or rounds
    starts = [r["started"] for r in rounds]
    cycle = (statistics.mean(b - a for a, b in zip(starts[1:], starts[2:]))
             if len(starts) > 2 else statistics.mean(r["seconds"] for r in later))
    exchange = statistics.mean(r["phase-seconds"]["exchange"] for r in later)
    server = statistics.mean(sum(v for k, v in r["phase-seconds"].items()
                                 if k not in ("select", "exchange")) for r in later)
    sampled = statistics.mean(len(r["sampled-nodes"]) for r in later)
    compute = client_compute_seconds(n, args.extra) * sampled / args.actors
    state = max((c.get("node-state-bytes", 0) for r in rounds
                 for c in r["clients"].values()), default=0)
    print(f"{n:>8} {engine:>8} {layout:>7} {peak / 2 ** 30:>9.2f} {cycle:>8.2f} "
          f"{compute:>10.2f} "
          f"{exchange:>11.2f} {1 - compute / exchange:>11.0%} "
          f"{1 - compute / cycle:>10.0%} {server:>9.2f} {sampled:>8.1f} {state:>8}",
          flush=True)
    print("          phases (s/round): " + ", ".join(
        f"{k} {statistics.mean(r['phase-seconds'][k] for r in later):.2f}"
        for k in later[0]["phase-seconds"]), flush=True)
    return cycle, exchange


if __name__ == "__main__":
    main()
