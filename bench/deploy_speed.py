"""Deployment cost in one run: a 3-round namespace federation (gRPC, TLS + SuperNode auth,
deploy/netns.sh) against the same run in simulation (dpfl simulate), and the bytes the
SuperLink reports for the run (`flwr ls --format json`) against the model's size.

    sudo .venv/bin/python bench/deploy_speed.py [--rounds 3] [--clients 2]

Prints both wall times, their ratio, and bytes per round beside what the strategy must move
at least: every round sends the global model to each client and receives one update back,
2 x clients x model bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = 'dataset="digits" batch-size=32 lr=0.5 target-epsilon=8.0 model="mnist-cnn"'


def _model_bytes() -> int:
    from dpfl.models import build_model

    model = build_model("mnist-cnn", (1, 8, 8), 10)
    return sum(p.numel() * p.element_size() for p in model.state_dict().values())


def _flwr_ls(state: Path) -> list[dict]:
    env = {**os.environ, "FLWR_HOME": str(state / "flwr-home"),
           "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    prefix = (state / "prefix").read_text().strip()
    out = subprocess.run(["ip", "netns", "exec", f"{prefix}-link", "flwr", "ls", "--format",
                          "json"], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{"):])["runs"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=2)
    args = ap.parse_args()
    script = str(ROOT / "deploy" / "netns.sh")
    work = Path(tempfile.mkdtemp(prefix="dpfl-bench-"))
    state = work / "fed"
    config = f'{CONFIG} num-rounds={args.rounds}'
    try:
        subprocess.run([script, "up", str(state), "--nodes", str(args.clients), "--prefix",
                        "dpflb"], check=True, capture_output=True)
        t0 = time.monotonic()
        subprocess.run([script, "run", str(state), "--run-config",
                        f'{config} run-name="ns" output-dir="{work / "runs"}"'], check=True,
                       capture_output=True)
        t_ns = time.monotonic() - t0
        runs = _flwr_ls(state)
    finally:
        subprocess.run([script, "down", str(state)], capture_output=True)
    t0 = time.monotonic()
    subprocess.run([str(ROOT / ".venv" / "bin" / "dpfl"), "simulate", "--clients",
                    str(args.clients), "--output-dir", str(work / "sim"), *config.split(),
                    "run-name=sim"], check=True, capture_output=True)
    t_sim = time.monotonic() - t0
    run = runs[0]
    ns_summary = json.loads((work / "runs" / "ns" / "summary.json").read_text())
    sim_summary = json.loads((work / "sim" / "sim" / "summary.json").read_text())
    model = _model_bytes()
    traffic = run["network-traffic"]
    sent, recv = int(traffic["outbound-bytes"]), int(traffic["inbound-bytes"])
    floor = 2 * args.clients * model
    print(f"{args.rounds} rounds, {args.clients} clients, digits + mnist-cnn, DP-SGD")
    print(f"namespace federation (gRPC, TLS + auth): {t_ns:6.1f} s wall "
          f"(ServerApp {ns_summary['wall-seconds']:.1f} s)")
    print(f"simulation (Ray):                        {t_sim:6.1f} s wall "
          f"(ServerApp {sim_summary['wall-seconds']:.1f} s)")
    print(f"ratio namespace / simulation:            {t_ns / t_sim:6.2f}x wall, "
          f"{ns_summary['wall-seconds'] / sim_summary['wall-seconds']:.2f}x ServerApp")
    print(f"flwr ls: network-traffic {json.dumps(traffic)}, compute-time "
          f"{json.dumps(run['compute-time'])}")
    per_round = (sent + recv) / args.rounds
    print(f"bytes per round (sent + received): {per_round:,.0f}; model {model:,} bytes; "
          f"floor 2 x clients x model = {floor:,} -> {per_round / floor:.2f}x the floor")


if __name__ == "__main__":
    main()
