"""Helpers of the end-to-end tests: a real `dpfl simulate` on digits and its run records."""

import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# One ClientApp actor per federation: the clients train one after the other in one process.
# On digits a client's round takes well under a second, while each actor costs ~9 s of CPU
# to start (torch, Opacus, Flower, a Ray worker): two tests in parallel on two cores finish
# sooner this way. test_simulation's end-to-end run and the README examples keep Ray's
# default (one actor per CPU).
ONE_ACTOR = ("--parallel-clients", "1")


# The method tests' federations run their ClientApps on one Ray head per test process (an
# xdist worker), started on first use and stopped after each test file (tests/conftest.py:
# an idle head costs ~1.4 s of CPU a minute). They are submitted with `flwr run` to one
# simulation SuperLink per test file (SharedSimulation, stopped with the head); the audits
# run through `dpfl audit --ray-address` (docs/ray-cluster.md). A private Ray per
# federation costs ~3 s of CPU and ~4.5 s of wall time more to start and stop (GCS,
# raylet, dashboard and runtime-env agents, log and autoscaler monitors: 30.5 vs 27.6 s
# of CPU, 28.9 vs 24.5 s wall for a 2-client, 2-round digits run, measured system-wide on
# an idle machine). The
# head has one CPU: one ClientApp actor, the clients one after the other, as ONE_ACTOR.
# The launcher's own private Ray (the default a user runs) keeps its tests: test_simulation,
# test_readme_examples, test_record_integrity_federation, test_interruptions. Set
# DPFL_TEST_PRIVATE_RAY=1 to run every federation on its own private Ray.
PRIVATE_RAY_ENV = "DPFL_TEST_PRIVATE_RAY"


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now (held together while they are chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SharedRayHead:
    """``ray start --head --block`` on loopback with one CPU, its sockets and logs in a
    short temporary folder; :meth:`stop` stops it by process group and PID."""

    def __init__(self) -> None:
        ray = Path(sys.executable).parent / "ray"
        port, client_port, agent_port = free_ports(3)
        self.address = f"127.0.0.1:{port}"
        self.tmp = Path(tempfile.mkdtemp(prefix="dpfl-ray-", dir="/tmp"))  # AF_UNIX: short
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONWARNINGS="ignore")
        self.log = self.tmp / "head.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [str(ray), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                 "--port", str(port), "--num-cpus", "1", "--temp-dir", str(self.tmp / "r"),
                 "--include-dashboard", "false", "--disable-usage-stats",
                 "--object-store-memory", str(150 * 1024 * 1024),
                 # each test process has its own head, all on one host: `ray start` hands
                 # every head's workers and drivers ports from the same 10002-19999 range,
                 # and two heads gave their first drivers port 10003 at once (the loser's
                 # core worker aborts: flwr-simulation died at "Address already in use" and
                 # its run ended 60 s later on the missing heartbeat). The OS picks them
                 # here, as it picks every other port of the head
                 "--min-worker-port", "0", "--max-worker-port", "0",
                 "--ray-client-server-port", str(client_port),
                 "--dashboard-agent-listen-port", str(agent_port)],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = self.log.read_text()[-3000:]
                self.stop()
                raise RuntimeError(f"the tests' Ray head did not start:\n{text}")
            time.sleep(0.3)

    def stop(self) -> None:
        stop_ray_processes([self.proc], grace=3.0)   # nothing to keep: its runs are over
        shutil.rmtree(self.tmp, ignore_errors=True)


def process_cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def stop_ray_processes(procs: list[subprocess.Popen], grace: float = 10.0) -> list[str]:
    """Stop ``ray start --block`` processes (each started in its own session) and all they
    started: SIGTERM to each one's process group and every descendant, then SIGKILL to what
    is left after ``grace`` seconds (after a run, a head's `ray start`, GCS and autoscaler
    monitor were seen still there 20 s after SIGTERM); never signals a PID that has exited.
    Returns the command lines that needed SIGKILL."""
    from dpfl.runtime.watchdog import alive, descendants

    pids = [p for proc in procs for p in (proc.pid, *descendants(proc.pid))]
    sigkilled: list[str] = []
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        living = [p for p in pids if alive(p)]
        if sig == signal.SIGKILL:
            sigkilled = [process_cmdline(p)[:100] for p in living]
        groups = [proc.pid for proc in procs] if sig == signal.SIGTERM else []
        for kill, target in [(os.killpg, g) for g in groups] + [(os.kill, p) for p in living]:
            try:
                kill(target, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            for proc in procs:
                proc.poll()   # reap the `ray start` processes
            time.sleep(0.2)
    for proc in procs:
        proc.wait(timeout=5)
    return sigkilled


class SharedSimulation:
    """One simulation SuperLink (``flower-superlink --simulation`` and its SuperExec, under
    dpfl's watchdog, as ``dpfl simulate`` starts it:
    :func:`dpfl.runtime.launch.simulation_superlink`)
    whose runs' ClientApps go to the shared Ray head. :meth:`run` submits one run to it with
    ``flwr run --stream``, as an operator submits runs to a running SuperLink (Flower's CLI
    forked from a process that imported it once: tests/e2e/flwr_forks.py); the SuperExec
    starts a ``flwr-simulation`` process per run. A `dpfl simulate` per run would start a
    launcher, a SuperLink and a SuperExec for each one (~7 s of CPU and ~6 s of wall time
    more a run); the launcher's own checks and exit codes keep their tests
    (test_simulation.py, test_record_integrity_federation.py, test_interruptions.py)."""

    def __init__(self, ray_address: str) -> None:
        from dpfl.runtime.fab import stage_app
        from dpfl.runtime.launch import flower_env, simulation_superlink, write_flower_config

        self.home = Path(tempfile.mkdtemp(prefix="dpfl-sim-", dir="/tmp"))
        self.env = flower_env(self.home)
        self.env["RAY_ADDRESS"] = ray_address
        self.app = stage_app(ROOT, self.home / "app")
        self._stack = ExitStack()
        self._stack.callback(shutil.rmtree, self.home, ignore_errors=True)
        try:
            address = self._stack.enter_context(simulation_superlink(self.home, self.env))
            write_flower_config(self.home, address)
            # `flwr`, imported once and forked per run (tests/e2e/flwr_forks.py)
            self._flwr = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("flwr_forks.py"))],
                env=self.env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, start_new_session=True)
            self._stack.callback(self._stop_flwr)
        except BaseException:
            self._stack.close()
            raise

    def _stop_flwr(self) -> None:
        self._flwr.stdin.close()   # its loop ends at end of input
        try:
            self._flwr.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._flwr.kill()
            self._flwr.wait()

    def _flwr_command(self, argv: list[str], out: Path, timeout: float) -> int:
        """``flwr ARGV`` from the forking `flwr` (output to ``out``); its exit code. Past
        ``timeout`` seconds the command is killed and the test fails."""
        self._flwr.stdin.write(json.dumps({"argv": argv, "out": str(out)}) + "\n")
        self._flwr.stdin.flush()
        pid = int(self._flwr.stdout.readline())
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            os.kill(pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            code = int(self._flwr.stdout.readline())   # the child's exit code, once reaped
        finally:
            timer.cancel()
        assert not killed.is_set(), \
            f"flwr {argv[0]} took over {timeout:.0f} s:\n{out.read_text()[-3000:]}" \
            + self.log_tail()
        return code

    def run(self, run_dir: Path, clients: int, overrides: dict[str, object]) -> Path:
        """One run of ``clients`` simulated SuperNodes writing ``run_dir``; fails the test
        with the run's output when the ServerApp wrote no summary."""
        from dpfl.runtime.launch import CONNECTION, federation_config, run_config_arg

        config = {**overrides, "output-dir": str(run_dir.parent), "run-name": run_dir.name}
        out = self.home / f"flwr-run-{run_dir.name}-{time.monotonic_ns()}.log"
        code = self._flwr_command(
            ["run", str(self.app), CONNECTION, "--stream", "--run-config",
             run_config_arg(config), "--federation-config",
             federation_config(clients, 1.0, None)], out, timeout=600)
        assert code == 0 and (run_dir / "summary.json").exists(), \
            out.read_text()[-6000:] + self.log_tail()
        return run_dir

    def log_tail(self) -> str:
        log = self.home / "superlink.log"
        return "\nsuperlink.log: " + (log.read_text()[-3000:] if log.exists() else "none")

    def stop(self) -> None:
        """Stop the SuperLink and its SuperExec, then remove their folder."""
        self._stack.close()


_shared_head: SharedRayHead | None = None
_shared_simulation: SharedSimulation | None = None


# What these federations set unless a test names the key itself: plots=false (the tests
# read the run's records; test_simulation.py checks the figures).
TEST_RUN_DEFAULTS = ("plots=false",)


def with_test_defaults(overrides: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """:data:`TEST_RUN_DEFAULTS` whose key ``overrides`` does not give, then ``overrides``."""
    given = {o.split("=", 1)[0].strip() for o in overrides}
    return (*(d for d in TEST_RUN_DEFAULTS if d.split("=", 1)[0] not in given), *overrides)


def simulate(tmp_path: Path, name: str, overrides: list[str] | tuple[str, ...],
             clients: int = 2) -> Path:
    """A federation of ``clients`` on the shared simulation SuperLink and Ray head (or, with
    DPFL_TEST_PRIVATE_RAY=1, a `dpfl simulate` on a private Ray, ONE_ACTOR); ``overrides``
    as ``key=value`` strings, after :data:`TEST_RUN_DEFAULTS`. Returns the run directory
    ``tmp_path/name``."""
    global _shared_simulation
    overrides = with_test_defaults(overrides)
    if os.environ.get(PRIVATE_RAY_ENV) == "1":
        proc = subprocess.run(
            [sys.executable, "-m", "dpfl.cli", "simulate", "--clients", str(clients),
             *ONE_ACTOR, "--output-dir", str(tmp_path), f"run-name={name}", *overrides],
            cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return tmp_path / name
    from dpfl.cli import parse_overrides

    address = client_runtime_args()[1]
    if _shared_simulation is None:
        _shared_simulation = SharedSimulation(address)
    return _shared_simulation.run(tmp_path / name, clients, parse_overrides(list(overrides)))


def client_runtime_args() -> tuple[str, ...]:
    """Where a test federation's ClientApps run: the shared Ray head of this test process
    (started now if it is not up yet), or ONE_ACTOR on a private Ray with
    DPFL_TEST_PRIVATE_RAY=1."""
    global _shared_head
    if os.environ.get(PRIVATE_RAY_ENV) == "1":
        return ONE_ACTOR
    if _shared_head is None:
        _shared_head = SharedRayHead()
    return ("--ray-address", _shared_head.address)


def stop_shared_ray() -> None:
    """Stop this test process' shared simulation SuperLink and Ray head, if it started them
    (after each test file's last test, and at the session's end: tests/conftest.py)."""
    global _shared_head, _shared_simulation
    try:
        if _shared_simulation is not None:
            _shared_simulation.stop()
    finally:
        _shared_simulation = None
        if _shared_head is not None:
            _shared_head.stop()
            _shared_head = None


def simulate_digits(tmp_path: Path, name: str, *overrides: str, clients: int = 2) -> Path:
    """A federation on digits (batch 32) by :func:`simulate`; returns the run directory."""
    return simulate(tmp_path, name, ("dataset=digits", "batch-size=32", *overrides), clients)


def read_run(run: Path) -> tuple[list[dict], dict, dict, dict]:
    """rounds.jsonl, ledger.json, summary.json, config.json of a run."""
    rounds = [json.loads(l) for l in (run / "rounds.jsonl").read_text().splitlines()]
    return (rounds, *(json.loads((run / f).read_text())
                      for f in ("ledger.json", "summary.json", "config.json")))


# -- dpfl's own warnings and everyone else's ---------------------------------------------------

_PRINTF = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdifrgeExX%]")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# a WARNING log line (Flower's "WARNING :   ...", Ray's "... WARNING file.py:12 -- ...") or a
# Python warning ("path.py:12: UserWarning: ...")
_WARNING_LINE = re.compile(r"\bWARNING\b|\b[A-Z]\w*Warning: ")
_FLOWER_WARNING = re.compile(r"\s*WARNING\s*:\s+(?P<message>.*?)\s*")


@lru_cache(maxsize=1)
def dpfl_warning_messages() -> tuple[re.Pattern[str], ...]:
    """dpfl's own WARNING messages: the format string of every ``<logger>.warning(fmt, ...)``
    and ``<logger>.log(<level>, fmt, ...)`` call in dpfl's sources (all of dpfl's loggers are
    ``flwr.dpfl.*``, printed by Flower's handler as ``WARNING :   <message>``), each as a
    regex whose ``%`` fields match anything."""
    patterns = []
    for path in sorted((ROOT / "dpfl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            position = {"warning": 0, "log": 1}.get(node.func.attr)
            if position is None or len(node.args) <= position:
                continue
            fmt = node.args[position]
            if isinstance(fmt, ast.Constant) and isinstance(fmt.value, str):
                parts = _PRINTF.split(fmt.value)
                patterns.append(re.compile(".*?".join(map(re.escape, parts)), re.S))
    return tuple(patterns)


def foreign_warnings(output: str) -> list[str]:
    """The lines of a `dpfl simulate` output that are a warning and not one of dpfl's own
    (:func:`dpfl_warning_messages`): Flower's, Ray's, Python warnings of any library."""
    foreign = []
    for line in _ANSI.sub("", output).splitlines():
        if not _WARNING_LINE.search(line):
            continue
        own = _FLOWER_WARNING.fullmatch(line)
        if own and any(p.fullmatch(own["message"]) for p in dpfl_warning_messages()):
            continue
        foreign.append(line)
    return foreign
