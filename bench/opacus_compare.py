"""dpfl's demo beside Flower's own Opacus example, the peer a Flower user starts from.

    python bench/opacus_compare.py [--repeats 2] [--out results/speed/opacus]

The task is the demo's (`make demo`: `dpfl simulate --clients 4`, MNIST split 4 ways IID,
mnist-cnn, DP-SGD with Poisson sampling at batch 256, lr 2.0, clip 1.0, 5 rounds, central
evaluation on the 10,000 test images before round 1 and after each round). The peer is
Flower's examples/opacus (a ClientApp that wraps model, optimizer and loader in Opacus'
PrivacyEngine at every fit; FedAvg), rebuilt on Flower 1.39's Message API in
`bench/flower_opacus/`, trained on the very tensors dpfl's clients train on (exported to an
.npz, 90 % of each client's share as in dpfl, which keeps 10 % for local validation) and at
the sigma dpfl calibrated for epsilon 4 (read from its ledger). It runs as a Flower user
runs it: a simulation SuperLink and `flwr run --stream` with Flower's own SuperExec and Ray
backend, 4 SuperNodes, one CPU per ClientApp. The pairs are interleaved (dpfl, Flower,
dpfl, ...); each wall time runs from the first process's start to the last one's exit.

Writes OUT/opacus.md and OUT/opacus.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PEER = ROOT / "bench" / "flower_opacus"
CLIENTS = 4


def export(npz: Path) -> None:
    """The demo's four clients' training tensors and the test set, as dpfl normalises them."""
    import tomllib

    import numpy as np

    from dpfl.data import client_data, test_tensors
    from dpfl.methods import parse_run_config

    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    cfg = parse_run_config(dict(defaults["config"]))
    arrays = {}
    for pid in range(CLIENTS):
        data = client_data(cfg, pid, CLIENTS)
        arrays[f"x{pid}"] = data.x_train.numpy()
        arrays[f"y{pid}"] = data.y_train.numpy()
    x, y = test_tensors(cfg.dataset, cfg.data_dir, cfg.download)
    arrays["x_test"], arrays["y_test"] = x.numpy(), y.numpy()
    np.savez(npz, **arrays)


def run_dpfl(work: Path, name: str) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dpfl.cli", "simulate", "--clients", str(CLIENTS),
                           "--output-dir", str(work), f"run-name={name}"], cwd=ROOT,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"dpfl failed:\n{proc.stderr[-3000:]}")
    run = work / name
    summary = json.loads((run / "summary.json").read_text())
    ledger = json.loads((run / "ledger.json").read_text())
    sigmas = {e["sigma"] for c in ledger["clients"].values() for e in c["events"]}
    return {"system": "dpfl", "wall": wall, "accuracy": summary["final"]["accuracy"],
            "epsilon": max(c["epsilon"] for c in summary["clients"].values()),
            "sigma": sorted(sigmas)}


def run_flower(npz: Path, sigma: float, rounds: int) -> dict:
    """Flower's Opacus example on a simulation SuperLink, as its README runs it."""
    from dpfl.runtime.launch import (
        CONNECTION,
        flower_bin,
        simulation_superlink,
        write_flower_config,
    )

    home = Path(tempfile.mkdtemp(prefix="flower-opacus-"))
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0",
               FLWR_DISABLE_UPDATE_CHECK="1", FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               RAY_ADDRESS="local", RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    app = home / "app"
    shutil.copytree(PEER, app, ignore=shutil.ignore_patterns("__pycache__"))
    config = (f'data="{npz}" noise-multiplier={sigma!r} num-server-rounds={rounds}')
    t0 = time.perf_counter()
    try:
        with simulation_superlink(home, env) as address:
            write_flower_config(home, address)
            proc = subprocess.run(
                [flower_bin("flwr"), "run", str(app), CONNECTION, "--stream", "--run-config",
                 config, "--federation-config",
                 f"num-supernodes={CLIENTS} client-resources-num-cpus=1"],
                env=env, cwd=str(app), capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(home, ignore_errors=True)
    out = proc.stdout + proc.stderr
    found = re.search(r"FLOWER-OPACUS-RESULT (\{.*\})", out)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"Flower's Opacus example failed (exit {proc.returncode}):\n"
                         f"{out[-4000:]}")
    history = json.loads(found.group(1))["accuracy"]
    return {"system": "flower-opacus", "wall": wall, "accuracy": history[-1],
            "accuracy-history": history, "sigma": [sigma]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "speed" / "opacus")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="opacus-compare-"))
    npz = work / "split.npz"
    export(npz)
    load0 = os.getloadavg()
    runs = []
    for i in range(args.repeats):
        ours = run_dpfl(work, f"demo-{i}")
        runs.append(ours)
        print(f"dpfl  {i}: {ours['wall']:.1f} s, accuracy {ours['accuracy']:.4f}, "
              f"sigma {ours['sigma']}", flush=True)
        theirs = run_flower(npz, ours["sigma"][0], args.rounds)
        runs.append(theirs)
        print(f"flower {i}: {theirs['wall']:.1f} s, accuracy {theirs['accuracy']:.4f}",
              flush=True)
    load1 = os.getloadavg()
    pairs = [(runs[k]["wall"], runs[k + 1]["wall"]) for k in range(0, len(runs), 2)]
    ratios = [a / b for a, b in pairs]
    mean = {s: sum(r["wall"] for r in runs if r["system"] == s) / args.repeats
            for s in ("dpfl", "flower-opacus")}
    acc = {s: sum(r["accuracy"] for r in runs if r["system"] == s) / args.repeats
           for s in ("dpfl", "flower-opacus")}
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "git": git, "runs": runs,
              "ratio-per-pair": ratios, "load-before": load0, "load-after": load1}
    (args.out / "opacus.json").write_text(json.dumps(report, indent=1))
    lines = [
        "# dpfl's demo beside Flower's Opacus example", "",
        f"Measured {report['date']} (git {git}), {args.repeats} interleaved pair(s), load "
        f"average {load0[0]:.2f} before, {load1[0]:.2f} after. Written by "
        "`bench/opacus_compare.py` (the task and the peer are in its docstring).", "",
        "| system | wall s (mean) | final accuracy (mean) |", "|---|---|---|",
        f"| dpfl (`dpfl simulate --clients 4`) | {mean['dpfl']:.1f} | {acc['dpfl']:.4f} |",
        f"| Flower's Opacus example, rebuilt (`flwr run`, Ray) | {mean['flower-opacus']:.1f} | "
        f"{acc['flower-opacus']:.4f} |", "",
        f"**dpfl / Flower wall: {mean['dpfl'] / mean['flower-opacus']:.2f}x** (per pair: "
        + ", ".join(f"{r:.2f}x" for r in ratios) + f"); sigma {runs[0]['sigma']} for both "
        f"(dpfl's calibration to epsilon 4, delta 1e-5, PLD; dpfl's ledger: epsilon "
        f"{runs[0]['epsilon']:.3f} per client). The example itself keeps no ledger.",
    ]
    (args.out / "opacus.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
