"""A deployment under faults and load: one network-namespace federation (deploy/netns.sh: a
SuperLink and N SuperNodes, gRPC over TLS, SuperNode authentication), DP-SGD on MNIST, and
a sequence of scenarios on it. Every scenario ends with the same privacy checks.

    sudo .venv/bin/python bench/faults.py [--nodes 20] [--rounds 5] [--fault-rounds 3]
        [--scenarios load lossy linkdrop churn restart] [--out results/faults]

Scenarios (in this order, on the one federation):

- ``load``: every node, ``--rounds`` rounds, no fault: round times and resident memory of
  every Flower process (SuperLink, SuperNodes, ServerApp, ClientApps), sampled every second
  from /proc (per class: peak of one process, peak of the class's sum).
- ``lossy``: a third of the nodes (every third index) dial the SuperLink through a relay in
  their own namespace that delays each chunk by 100 ± 50 ms each way (bench/delay_relay.py;
  this kernel has no ``sch_netem``), and drop 5 % of their packets in and out of eth0
  (iptables ``statistic --mode random``), for ``--fault-rounds`` rounds.
- ``linkdrop``: a third of the nodes lose their link entirely (iptables DROP on eth0) for
  20 s, starting 2 s into round 2, with a round timeout of 1.2x the load run's median round:
  their replies arrive late, and are charged when they arrive.
- ``churn``: three nodes leave (SuperNode and its ClientApps stopped by PID) 2 s into round
  2 and rejoin (same key, so the same node id and partition) when round 3 is recorded.
- ``restart``: the SuperLink (and the ServerApp with it) is restarted as soon as the first
  round-2 reply has reached it, then the run is resumed (``resume=true``) from its last
  checkpoint. That reply is a release the resumed run never reads; the node's own durable
  history (``privacy-dir``, dpfl.client.node_history) keeps it, the client reports it, and
  the ledger charges the report (``charged-at-client-report``).

Checks of every run (from its ledger.json, rounds.jsonl, summary.json): rounds completed;
replies accepted, rejected and charged late; **budget overruns** (a client whose ledger ε
exceeds the budget, or that the ledger flags over budget: must be 0); **charges below a
release** (a client whose reply a round accepted, but whose ledger lacks that round; or whose
ledger ε is below the ε it reported itself: must be 0); ledger mismatches; and after
``down``, **processes left** (any process still in one of the federation's namespaces or
naming its state folder: must be 0). Writes ``--out``/faults.json and faults.md (tables, the
command, the machine's load).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "netns.sh"
VENV_PY = ROOT / ".venv" / "bin" / "python"
PREFIX = "dpflq"
LINK = "10.77.0.1:9092"
RELAY_PORT = 19092
CLASSES = ("flower-superlink", "flower-supernode", "flwr-serverapp", "flwr-clientapp")
# command-line words that mark a class (netns.sh runs Flower's SuperLink and SuperNodes
# through dpfl.runtime.superlink / dpfl.runtime.supernode)
MARKERS = {"flower-superlink": ("flower-superlink", "dpfl.runtime.superlink"),
           "flower-supernode": ("flower-supernode", "dpfl.runtime.supernode"),
           "flwr-serverapp": ("flwr-serverapp",), "flwr-clientapp": ("flwr-clientapp",)}


def sh(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """deploy/netns.sh ARGS (output captured)."""
    return subprocess.run([str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=check)


def in_ns(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True,
                          check=check)


# -- memory of the federation's processes -----------------------------------------------------


def _ns_inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


def _pid_netns(pid: str) -> int | None:
    try:
        return int(os.readlink(f"/proc/{pid}/ns/net").split("[")[1].rstrip("]"))
    except (OSError, IndexError, ValueError):
        return None


def _memory_and_class(pid: str) -> tuple[int, int, str] | None:
    """(RSS bytes, PSS bytes, process class) of ``pid``. RSS counts shared pages (torch's
    libraries) in every process; PSS divides them among their users, so PSS sums to what
    the processes take together."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    words = " ".join(c.decode(errors="replace") for c in cmd[:4])
    cls = next((c for c in CLASSES if any(m in words for m in MARKERS[c])), "other")
    fields = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in rollup.splitlines()[1:]
              if l.split(":")[0] in ("Rss", "Pss")}
    return fields.get("Rss", 0), fields.get("Pss", 0), cls


class MemorySampler:
    """Per process class, every second, over every process in the given namespaces: the
    peak RSS of one process, the peak number of processes, and the peak PSS sum (what the
    class takes together); and the peak PSS sum of all."""

    def __init__(self, namespaces: list[str]) -> None:
        self.inodes = {_ns_inode(n) for n in namespaces}
        self.peak_one: dict[str, int] = {}
        self.peak_sum: dict[str, int] = {}
        self.peak_count: dict[str, int] = {}
        self.peak_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        sums: dict[str, int] = {}
        counts: dict[str, int] = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if _pid_netns(pid) not in self.inodes:
                continue
            got = _memory_and_class(pid)
            if got is None:
                continue
            rss, pss, cls = got
            sums[cls] = sums.get(cls, 0) + pss
            counts[cls] = counts.get(cls, 0) + 1
            self.peak_one[cls] = max(self.peak_one.get(cls, 0), rss)
        for cls, total in sums.items():
            self.peak_sum[cls] = max(self.peak_sum.get(cls, 0), total)
            self.peak_count[cls] = max(self.peak_count.get(cls, 0), counts[cls])
        self.peak_total = max(self.peak_total, sum(sums.values()))

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.sample()

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def table(self) -> dict[str, dict[str, float]]:
        mib = 1 << 20
        return {cls: {"processes": self.peak_count.get(cls, 0),
                      "peak-rss-one-MiB": round(self.peak_one.get(cls, 0) / mib),
                      "peak-pss-sum-MiB": round(self.peak_sum.get(cls, 0) / mib)}
                for cls in (*CLASSES, "other") if cls in self.peak_one}


# -- faults ------------------------------------------------------------------------------------


class Faults:
    """Network faults on SuperNode namespaces: packet loss, a dropped link, a delaying relay."""

    def __init__(self, state: Path, prefix: str) -> None:
        self.state, self.prefix = state, prefix
        self.relays: dict[int, subprocess.Popen] = {}

    def ns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def loss(self, node: int, probability: float) -> None:
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            in_ns(self.ns(node), "iptables", "-A", chain, flag, "eth0", "-m", "statistic",
                  "--mode", "random", "--probability", f"{probability}", "-j", "DROP")

    def cut(self, node: int) -> None:
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            in_ns(self.ns(node), "iptables", "-I", chain, "1", flag, "eth0", "-j", "DROP")

    def clear(self, node: int) -> None:
        for chain in ("INPUT", "OUTPUT"):
            in_ns(self.ns(node), "iptables", "-F", chain)

    def relay(self, node: int, delay_ms: float, jitter_ms: float) -> None:
        """Restart SuperNode ``node`` behind a delaying relay in its namespace."""
        sh("node-stop", str(self.state), str(node))
        log = open(self.state / f"relay-{node}.log", "w")
        self.relays[node] = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(node), sys.executable,
             str(ROOT / "bench" / "delay_relay.py"), "--listen", f"127.0.0.1:{RELAY_PORT}",
             "--to", LINK, "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms),
             "--seed", str(node), "--for-seconds", "7200"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        time.sleep(1.0)
        sh("node-start", str(self.state), str(node), "--superlink", f"127.0.0.1:{RELAY_PORT}")

    def direct(self, node: int) -> None:
        """SuperNode ``node`` back on its direct link, no relay, no iptables rule."""
        if node in self.relays:
            sh("node-stop", str(self.state), str(node))
            proc = self.relays.pop(node)
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
            self.clear(node)
            sh("node-start", str(self.state), str(node))
        else:
            self.clear(node)

    def stop_all(self) -> None:
        for proc in self.relays.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        self.relays.clear()


# -- one run and its checks --------------------------------------------------------------------


def _records(run: Path) -> list[dict]:
    f = run / "rounds.jsonl"
    return [json.loads(l) for l in f.read_text().splitlines()] if f.exists() else []


def wait_for_round(run: Path, n: int, proc: subprocess.Popen | None = None,
                   timeout: float = 1800) -> None:
    """Block until round ``n`` is recorded (or the run ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["round"] >= n for r in _records(run)):
            return
        if proc is not None and proc.poll() is not None:
            return
        time.sleep(0.5)
    raise TimeoutError(f"round {n} of {run.name} not recorded within {timeout:.0f} s")


def wait_for_log(log: Path, text: str, proc: subprocess.Popen, timeout: float = 1800) -> None:
    """Block until ``text`` appears in ``log`` (or the run ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        time.sleep(0.2)


def start_run(state: Path, runs: Path, name: str, config: str) -> subprocess.Popen:
    log = open(runs / f"{name}.log", "a")
    return subprocess.Popen(
        [str(SCRIPT), "run", str(state), "--run-config",
         f'{config} run-name="{name}" output-dir="{runs}"'],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def check_run(run: Path) -> dict[str, Any]:
    """Rounds, replies and the privacy checks of one finished run (module docstring)."""
    rounds = _records(run)
    ledger = json.loads((run / "ledger.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    budget = summary["epsilon-budget"]
    clients = ledger["clients"]
    accepted = {(c, r["round"]) for r in rounds
                for c, info in r.get("clients", {}).items() if info.get("status") == "accepted"}
    uncharged = sorted(f"{c}@{rnd}" for c, rnd in accepted
                       if rnd not in clients.get(c, {}).get("rounds", []))
    below_report = sorted(c for c, info in clients.items()
                          if info.get("reported-epsilon") is not None
                          and info["epsilon"] < info["reported-epsilon"] - 1e-9)
    overruns = sorted(c for c, info in clients.items()
                      if info.get("over-budget") or info["epsilon"] > budget * (1 + 1e-9))
    late = [c for c in ledger["charges"] if str(c.get("note", "")).startswith("late reply")]
    raised = sorted(c for c, info in clients.items()
                    if info.get("reported-epsilon") is not None
                    and info["reported-epsilon"] > info["recomputed-epsilon"] * (1 + 1e-9))
    seconds = [r["seconds"] for r in rounds]
    return {
        "rounds": [r["round"] for r in rounds],
        "round-seconds": [round(s, 1) for s in seconds],
        "median-round-seconds": round(statistics.median(seconds), 1) if seconds else None,
        "accepted-per-round": [r["train"].get("accepted", 0) for r in rounds],
        "rejected-per-round": [r["train"].get("rejected", 0) for r in rounds],
        "late-charged": len(late),
        "late-after-last-round": summary.get("late-replies-after-last-round", 0),
        "clients-charged": len(clients),
        "max-epsilon": round(max((i["epsilon"] for i in clients.values()), default=0.0), 4),
        "budget": budget,
        # a client over its budget by our reading or flagged by the ledger, counted once
        "budget-overruns": len(set(overruns) | set(ledger.get("over-budget", []))),
        "accepted-but-uncharged": uncharged,
        "ledger-below-client-report": below_report,
        "ledger-mismatches": len(ledger.get("mismatches", [])),
        # clients whose own report (their node's durable history) exceeds what the server
        # recomputed from the replies it received: the ledger charges the report
        "charged-at-client-report": raised,
        "resumes": summary.get("resumes"),
        "final-accuracy": round(summary["final"].get("accuracy", float("nan")), 4),
        "verdict": summary["guarantee"]["verdict"],
    }


def processes_left(state: Path, inodes: set[int]) -> list[str]:
    """Processes in one of the federation's (deleted) namespaces or naming its state folder."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if _pid_netns(pid) in inodes or str(state) in cmd:
            left.append(f"{pid} {cmd[:120]}")
    return left


def serverapps(link_ns: str) -> list[int]:
    """PIDs of ServerApp processes in the SuperLink's namespace."""
    inode = _ns_inode(link_ns)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if _pid_netns(pid) != inode:
            continue
        try:
            if b"flwr-serverapp" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def wait_serverapps_done(link_ns: str, timeout: float = 1800) -> bool:
    """Block until no ServerApp runs in ``link_ns`` (True) or ``timeout`` (False): `flwr run
    --stream` can end while its run goes on (its log stream broke)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not serverapps(link_ns):
            return True
        time.sleep(1.0)
    return False


def activations(state: Path) -> int:
    logs = [state / "superlink.log", *state.glob("superlink.log.*")]
    return sum(p.read_text(errors="replace").count("Activated") for p in logs if p.exists())


def wait_activations(state: Path, at_least: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and activations(state) < at_least:
        time.sleep(0.5)


# -- the scenarios -------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fault-rounds", type=int, default=3)
    ap.add_argument("--examples-per-node", type=int, default=600)
    ap.add_argument("--scenarios", nargs="+",
                    default=["load", "lossy", "linkdrop", "churn", "restart"],
                    choices=["load", "lossy", "linkdrop", "churn", "restart"])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "faults")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/faults.py: needs root (deploy/netns.sh makes network namespaces)")
    work = args.work or Path(tempfile.mkdtemp(prefix="dpfl-faults-"))
    state, runs = work / "fed", work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    config = (f'dataset="mnist" train-subset={args.nodes * args.examples_per_node} '
              'partitioning="iid" batch-size=64 lr=2.0 target-epsilon=8.0 '
              'min-train-nodes=1 evaluate-every=1000')
    third = [i for i in range(args.nodes) if i % 3 == 0]
    results: dict[str, Any] = {
        "command": "sudo .venv/bin/python bench/faults.py " + shlex.join(sys.argv[1:]),
        "nodes": args.nodes, "config": config, "load-before": os.getloadavg(),
        "scenarios": {}}
    # N ClientApps share this host's cores: one torch/OpenMP thread each (dpfl's ClientApp
    # reads DPFL_NUM_THREADS; the SuperNodes pass their environment on)
    os.environ.update(DPFL_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    results["threads-per-clientapp"] = 1
    t_up = time.monotonic()
    # cold ClientApps (Flower's own launch), as results/faults/ was measured: a warm node's
    # zygote stays resident (~0.8 GB RSS with this host's CUDA torch), 20 of them ~16 GB
    up = sh("up", str(state), "--nodes", str(args.nodes), "--prefix", PREFIX,
            "--cold-clientapps", check=False)
    if up.returncode != 0:
        sys.exit(f"bench/faults.py: netns.sh up failed: {up.stderr.strip()[-300:]}")
    results["up-seconds"] = round(time.monotonic() - t_up, 1)
    namespaces = [f"{PREFIX}-link", f"{PREFIX}-hub",
                  *(f"{PREFIX}-n{i}" for i in range(args.nodes))]
    inodes = {_ns_inode(n) for n in namespaces}
    faults = Faults(state, PREFIX)
    wait_activations(state, args.nodes)
    baseline = 120.0
    try:
        for scenario in args.scenarios:
            t0 = time.monotonic()
            info: dict[str, Any] = {}
            name = scenario
            rounds = args.rounds if scenario == "load" else args.fault_rounds
            cfg = f"{config} num-rounds={rounds}"
            timeout = 600.0
            if scenario == "linkdrop":
                timeout = round(max(30.0, 1.2 * baseline), 1)
            cfg += f" round-timeout={timeout}"
            info["round-timeout"] = timeout
            if scenario == "lossy":
                before = activations(state)
                for i in third:
                    faults.relay(i, 100.0, 50.0)
                    faults.loss(i, 0.05)
                wait_activations(state, before + len(third))
                info["faulty-nodes"] = third
                info["faults"] = "100 ± 50 ms each way (relay), 5 % packet loss in and out"
            with MemorySampler(namespaces) as mem:
                proc = start_run(state, runs, name, cfg)
                if scenario == "linkdrop":
                    wait_for_round(runs / name, 1, proc)
                    time.sleep(2.0)
                    for i in third:
                        faults.cut(i)
                    time.sleep(20.0)
                    for i in third:
                        faults.clear(i)
                    info["faulty-nodes"] = third
                    info["faults"] = "link dropped for 20 s (iptables DROP), 2 s into round 2"
                elif scenario == "churn":
                    leavers = list(range(min(3, args.nodes - 1)))
                    wait_for_round(runs / name, 1, proc)
                    time.sleep(2.0)
                    for i in leavers:
                        sh("node-stop", str(state), str(i))
                    wait_for_round(runs / name, 2, proc)
                    for i in leavers:
                        sh("node-start", str(state), str(i))
                    info["faulty-nodes"] = leavers
                    info["faults"] = "stopped 2 s into round 2, restarted after round 2"
                elif scenario == "restart":
                    # restart as soon as a round-2 reply has reached the SuperLink: that
                    # release is in the old run only; the node's own history keeps it
                    wait_for_log(runs / f"{name}.log", "round 2: client-", proc)
                    sh("restart-superlink", str(state))
                    proc.wait(timeout=300)
                    done = [r["round"] for r in _records(runs / name)]
                    info["interrupted-after-round"] = done[-1] if done else 0
                    time.sleep(5.0)  # the SuperNodes reconnect on their own
                    proc = start_run(state, runs, name, cfg + " resume=true")
                    info["faults"] = ("SuperLink restarted right after the first round-2 "
                                      "reply, run resumed")
                code = proc.wait(timeout=7200)
                if not (runs / name / "summary.json").exists() and serverapps(f"{PREFIX}-link"):
                    info["stream-ended-before-the-run"] = True
                    info["run-finished"] = wait_serverapps_done(f"{PREFIX}-link")
            info["exit-code"] = code
            info["wall-seconds"] = round(time.monotonic() - t0, 1)
            info["memory"] = mem.table()
            info["peak-total-MiB"] = round(mem.peak_total / (1 << 20))
            try:
                info.update(check_run(runs / name))
            except (OSError, KeyError, ValueError) as exc:
                info["check-error"] = f"{type(exc).__name__}: {exc}"
            if scenario == "load" and info.get("median-round-seconds"):
                baseline = info["median-round-seconds"]
            if scenario == "lossy":
                for i in third:
                    faults.direct(i)
                wait_activations(state, activations(state))
            results["scenarios"][scenario] = info
            print(json.dumps({scenario: info}), flush=True)
            (work / "faults.partial.json").write_text(json.dumps(results, indent=1))
    finally:
        faults.stop_all()
        sh("down", str(state), check=False)
        time.sleep(1.0)
        results["processes-left"] = processes_left(state, inodes)
        results["load-after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "faults.json").write_text(json.dumps(results, indent=1))
    (args.out / "faults.md").write_text(render(results))
    print(render(results))


def render(results: dict[str, Any]) -> str:
    """The tables of faults.md."""
    lines = [f"`{results['command']}` — {results['nodes']} SuperNodes, TLS + SuperNode auth, "
             f"netns; config `{results['config']}`; load average before "
             f"{results['load-before'][0]:.1f}, after {results.get('load-after', [0])[0]:.1f}",
             "", "| scenario | faults | nodes hit | rounds | accepted per round | late "
             "charged | median round s | max ε (budget) | overruns | uncharged releases | "
             "below client's report | charged at client's report | mismatches | exit |",
             "|---|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in results["scenarios"].items():
        lines.append(
            f"| {name} | {s.get('faults', 'none')} | {len(s.get('faulty-nodes', []))} | "
            f"{len(s.get('rounds', []))} | {s.get('accepted-per-round')} | "
            f"{s.get('late-charged')} | {s.get('median-round-seconds')} | "
            f"{s.get('max-epsilon')} ({s.get('budget')}) | {s.get('budget-overruns')} | "
            f"{len(s.get('accepted-but-uncharged', []))} | "
            f"{len(s.get('ledger-below-client-report', []))} | "
            f"{len(s.get('charged-at-client-report', []))} | {s.get('ledger-mismatches')} | "
            f"{s.get('exit-code')} |")
    lines += ["", f"Processes left after `down`: {len(results.get('processes-left', []))}", "",
              "| scenario | process class | processes (peak) | peak RSS of one (MiB) | "
              "peak PSS of all (MiB) |", "|---|---|---:|---:|---:|"]
    for name, s in results["scenarios"].items():
        for cls, m in s.get("memory", {}).items():
            lines.append(f"| {name} | {cls} | {m['processes']} | {m['peak-rss-one-MiB']} | "
                         f"{m['peak-pss-sum-MiB']} |")
        lines.append(f"| {name} | all | | | {s.get('peak-total-MiB')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
