"""A simulation that outgrows one machine: `dpfl simulate --ray-address` runs its ClientApps
on a two-node Ray cluster, and Ray's own task records show clients ran on both nodes.

The two "hosts" are two network namespaces joined by one veth link (10.79.0.1 and
10.79.0.2): the head (``ray start --head``) and the run (``dpfl simulate``, its SuperLink and
the ``flwr-simulation`` Ray driver) in the first, a worker node (``ray start --address``) in
the second, each node with 1 CPU. The worker reaches the head only over that link, so the
node addresses, ports and cross-node traffic are those of two machines (the filesystem and
the Python environment are shared, as a cluster with the same venv and data on every node
would have them: see docs/ray-cluster.md). Inside the namespaces no port can collide with
another user's Ray, and the run cannot attach to anyone else's cluster.

Which node ran each ClientApp comes from Ray, not from dpfl: the cluster's task timeline
(``ray.timeline()``, read after the run by a driver in the head's namespace) lists every
``ClientAppActor.run`` task with the IP address of the node that executed it.

Everything the test starts is stopped by PID (the ``ray start --block`` process groups and
their descendants), the namespaces are then checked empty (``ip netns pids``) and deleted;
``ray stop`` is never used (it stops every Ray of the user). Needs root, iproute2 with
network namespaces and Ray's ``ray`` CLI beside this Python: without them the test skips, or
fails under CI=true (``tests/requirements.py``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from federation import process_cmdline, stop_ray_processes
from requirements import command_works, require

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
HEAD_IP, WORKER_IP, GCS_PORT = "10.79.0.1", "10.79.0.2", 6390
CLIENTS = 4
OBJECT_STORE = 150 * 1024 * 1024   # per node; Ray's default is 30 % of the RAM


def _ray_cli() -> str | None:
    local = Path(sys.executable).parent / "ray"
    return str(local) if local.exists() else shutil.which("ray")


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore",
           "RAY_USAGE_STATS_ENABLED": "0", "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    return env


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=check)


def _netns_pids(ns: str) -> list[int]:
    from dpfl.runtime.watchdog import alive

    out = _ip("netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit() and alive(int(p))]


class TwoNodeCluster:
    """Two namespaces joined by a veth link, a Ray head in the first and a worker node in
    the second; :meth:`stop` stops what it started by PID and returns what was left."""

    def __init__(self, work: Path) -> None:
        tag = f"dr{os.getpid() % 10000}{secrets.token_hex(2)}"   # + h/w: <= 15 characters
        self.head_ns, self.worker_ns = f"{tag}h", f"{tag}w"
        self.work = work
        # Ray's sockets live under --temp-dir: a short path (AF_UNIX paths <= 107 bytes)
        self.ray_tmp = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir="/tmp"))
        self.procs: list[subprocess.Popen] = []
        self.sigkilled: list[str] = []   # what SIGTERM did not stop within its grace
        self.env = _env()

    def run_in_head(self, *cmd: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.head_ns, *cmd], env=self.env,
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)

    def _network(self) -> None:
        h, w = self.head_ns, self.worker_ns
        for ns in (h, w):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", h, "type", "veth", "peer", "name", w)
        for ns, ip in ((h, HEAD_IP), (w, WORKER_IP)):
            _ip("link", "set", ns, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ip}/30", "dev", ns)
            _ip("-n", ns, "link", "set", ns, "up")

    def _node(self, ns: str, name: str, *args: str) -> Path:
        log = self.work / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, _ray_cli(), "start", "--block", "--num-cpus", "1",
                 "--temp-dir", str(self.ray_tmp / name), "--object-store-memory",
                 str(OBJECT_STORE), "--disable-usage-stats", *args],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert proc.poll() is None, f"ray start ({name}) exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"ray start ({name}) not ready in 120 s"
            time.sleep(0.5)
        return log

    def start(self) -> None:
        self._network()
        self._node(self.head_ns, "head", "--head", "--node-ip-address", HEAD_IP, "--port",
                   str(GCS_PORT), "--include-dashboard", "false")
        self._node(self.worker_ns, "worker", "--address", f"{HEAD_IP}:{GCS_PORT}",
                   "--node-ip-address", WORKER_IP)

    def stop(self) -> list[str]:
        """Stop both nodes at once (:func:`federation.stop_ray_processes`), then SIGKILL
        anything still in the namespaces (and report it), then delete them."""
        self.sigkilled = stop_ray_processes(self.procs)
        left = []
        for ns in (self.head_ns, self.worker_ns):
            deadline = time.monotonic() + 10
            while _netns_pids(ns) and time.monotonic() < deadline:
                time.sleep(0.5)
            for pid in _netns_pids(ns):
                left.append(f"{ns}: {pid} {process_cmdline(pid)[:120]}")
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", ns, check=False)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        return left


PROBE = """
import collections, json, sys, time
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
nodes = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
# task events reach the GCS about once a second: wait for every ClientApp run
deadline = time.monotonic() + 20
while True:
    runs = collections.Counter(e["pid"] for e in ray.timeline()
                               if e.get("cat") == "task::ClientAppActor.run")
    if sum(runs.values()) >= int(sys.argv[2]) or time.monotonic() > deadline:
        break
    time.sleep(1)
print(json.dumps({"nodes": nodes, "runs": runs}))
"""


def _probe(cluster: TwoNodeCluster, runs: int) -> dict:
    """The cluster's live nodes and, per node IP, its ClientAppActor.run tasks (waiting up
    to 20 s for ``runs`` of them to be reported)."""
    proc = cluster.run_in_head(sys.executable, "-c", PROBE, f"{HEAD_IP}:{GCS_PORT}",
                               str(runs), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_simulation_spreads_clients_over_two_ray_nodes(tmp_path):
    require(root=True, tools=("ip",),
            probes={"ip netns": command_works("ip", "netns", "list"),
                    "ray CLI (Ray's `ray` beside this Python or on PATH)":
                        lambda: _ray_cli() is not None},
            what="the Ray-cluster test")
    cluster = TwoNodeCluster(tmp_path)
    phases, start = {}, time.monotonic()
    try:
        # `ray start` says "Ray runtime started" once its raylet is registered with the GCS
        cluster.start()
        phases["two nodes up"] = time.monotonic() - start
        out = tmp_path / "runs"
        proc = cluster.run_in_head(
            sys.executable, "-m", "dpfl.cli", "simulate", "--clients", str(CLIENTS),
            "--output-dir", str(out), "--ray-address", f"{HEAD_IP}:{GCS_PORT}",
            "dataset=digits", "num-rounds=1", "batch-size=32", "target-epsilon=8.0",
            "run-name=cluster", timeout=600)
        phases["dpfl simulate"] = time.monotonic() - start - sum(phases.values())
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        run = out / "cluster"
        summary = json.loads((run / "summary.json").read_text())
        ledger = json.loads((run / "ledger.json").read_text())
        names = {f"client-{i}" for i in range(CLIENTS)}
        assert set(summary["clients"]) == names and set(ledger["clients"]) == names
        for name, info in ledger["clients"].items():
            assert 0 < info["epsilon"] <= 8.0, (name, info["epsilon"])
            assert [e["round"] for e in info["events"]] == [1], name
        assert ledger["mismatches"] == []
        # Ray's record: two ClientApp runs per client (its node's query.warm before round 1,
        # then its train message), on both nodes
        seen = _probe(cluster, 2 * CLIENTS)
        phases["timeline probe"] = time.monotonic() - start - sum(phases.values())
        assert seen["nodes"] == [HEAD_IP, WORKER_IP], seen
        assert sum(seen["runs"].values()) == 2 * CLIENTS, seen
        assert set(seen["runs"]) == {HEAD_IP, WORKER_IP}, seen
    finally:
        left = cluster.stop()
        phases["teardown"] = time.monotonic() - start - sum(phases.values())
        print("phases (s):", {k: round(v, 1) for k, v in phases.items()},
              "; needed SIGKILL:", cluster.sigkilled)
    assert left == [], f"processes left in the test's namespaces: {left}"
