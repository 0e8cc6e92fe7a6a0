"""Deployment cost in one run: a 3-round namespace federation (gRPC, TLS + SuperNode auth,
deploy/netns.sh) with cold ClientApps (Flower's: a new interpreter per instruction), the same
with warm ones (dpfl.runtime.supernode --warm-clientapps: forked from a zygote that imported the
libraries once), the same run in simulation (dpfl simulate), and the bytes the SuperLink
reports for the run (`flwr ls --format json`) against the model's size.

    sudo .venv/bin/python bench/deploy_speed.py [--rounds 3] [--clients 2]

Prints the wall times, the CPU seconds of each federation's processes (a cgroup v1 cpuacct
group holds every process the federation starts, when the host has one), their ratios, and
bytes per round beside what the strategy must move at least: every round sends the global
model to each client and receives one update back, 2 x clients x model bytes.
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


class _CpuGroup:
    """A cgroup v1 cpuacct group that this process and its children join: the CPU seconds
    of everything started while inside (None where the host has no such hierarchy)."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self, name: str) -> None:
        self.path = self.ROOT / f"dpfl-bench-{name}-{os.getpid()}"

    def __enter__(self) -> "_CpuGroup":
        self.ok = self.ROOT.is_dir() and os.access(self.ROOT, os.W_OK)
        if self.ok:
            self.path.mkdir()
            (self.path / "tasks").write_text(str(os.getpid()))
        return self

    def seconds(self) -> float | None:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9 if self.ok else None

    def __exit__(self, *exc) -> None:
        if self.ok:
            (self.ROOT / "tasks").write_text(str(os.getpid()))
            try:
                self.path.rmdir()
            except OSError:  # a process of the federation outlived `down`
                pass


def _namespace_run(script: str, work: Path, config: str, clients: int, kind: str
                   ) -> tuple[float, float | None, list[dict], dict]:
    """(wall seconds of `netns.sh run`, CPU seconds of up + run + down, flwr ls runs, the
    run's summary) of one namespace federation with ``kind`` ClientApps (cold | warm)."""
    state = work / f"fed-{kind}"
    cold = ["--cold-clientapps"] if kind == "cold" else []
    with _CpuGroup(kind) as cpu:
        try:
            subprocess.run([script, "up", str(state), "--nodes", str(clients), "--prefix",
                            f"dpflb{kind[0]}", *cold], check=True, capture_output=True)
            t0 = time.monotonic()
            subprocess.run([script, "run", str(state), "--run-config",
                            f'{config} run-name="{kind}" output-dir="{work / "runs"}"'],
                           check=True, capture_output=True)
            wall = time.monotonic() - t0
            runs = _flwr_ls(state)
        finally:
            subprocess.run([script, "down", str(state)], capture_output=True)
        seconds = cpu.seconds()
    summary = json.loads((work / "runs" / kind / "summary.json").read_text())
    return wall, seconds, runs, summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=2)
    args = ap.parse_args()
    script = str(ROOT / "deploy" / "netns.sh")
    work = Path(tempfile.mkdtemp(prefix="dpfl-bench-"))
    config = f'{CONFIG} num-rounds={args.rounds}'
    measured = {kind: _namespace_run(script, work, config, args.clients, kind)
                for kind in ("cold", "warm")}
    t0 = time.monotonic()
    subprocess.run([str(ROOT / ".venv" / "bin" / "dpfl"), "simulate", "--clients",
                    str(args.clients), "--output-dir", str(work / "sim"), *config.split(),
                    "run-name=sim"], check=True, capture_output=True)
    t_sim = time.monotonic() - t0
    t_ns, _, runs, ns_summary = measured["warm"]
    run = runs[0]
    sim_summary = json.loads((work / "sim" / "sim" / "summary.json").read_text())
    model = _model_bytes()
    traffic = run["network-traffic"]
    sent, recv = int(traffic["outbound-bytes"]), int(traffic["inbound-bytes"])
    floor = 2 * args.clients * model
    print(f"{args.rounds} rounds, {args.clients} clients, digits + mnist-cnn, DP-SGD")
    for kind, (wall, cpu, _, summary) in measured.items():
        cpu_text = "" if cpu is None else f", {cpu:6.1f} s CPU (up + run + down)"
        print(f"namespace federation, {kind} ClientApps: {wall:6.1f} s wall "
              f"(ServerApp {summary['wall-seconds']:.1f} s){cpu_text}")
    (cold_wall, cold_cpu, *_), (warm_wall, warm_cpu, *_) = measured.values()
    cpu_ratio = "" if cold_cpu is None or warm_cpu is None else \
        f", {warm_cpu / cold_cpu:.2f}x CPU"
    print(f"ratio warm / cold:                       {warm_wall / cold_wall:6.2f}x wall"
          f"{cpu_ratio}")
    print(f"simulation (Ray):                        {t_sim:6.1f} s wall "
          f"(ServerApp {sim_summary['wall-seconds']:.1f} s)")
    print(f"ratio namespace (warm) / simulation:     {t_ns / t_sim:6.2f}x wall, "
          f"{ns_summary['wall-seconds'] / sim_summary['wall-seconds']:.2f}x ServerApp")
    print(f"flwr ls: network-traffic {json.dumps(traffic)}, compute-time "
          f"{json.dumps(run['compute-time'])}")
    per_round = (sent + recv) / args.rounds
    print(f"bytes per round (sent + received): {per_round:,.0f}; model {model:,} bytes; "
          f"floor 2 x clients x model = {floor:,} -> {per_round / floor:.2f}x the floor")


if __name__ == "__main__":
    main()
