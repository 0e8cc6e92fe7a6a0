"""Run a Flower simulation with ``flwr run``, owning the SuperLink it needs.

``flwr run`` against Flower's ``:local:`` connection starts a detached SuperLink that
outlives the run and whose PID is not reported. This launcher instead starts
``flower-superlink --simulation`` itself on free loopback ports, in its own process group,
writes a Flower config (``$FLWR_HOME/config.toml``) pointing at it, calls
``flwr run <app> dpfl-sim --stream``, and stops the SuperLink (and the simulation
processes it spawned) by PID afterwards, whatever happened.

Ray: by default the simulation starts a private Ray instance of its own (``RAY_ADDRESS=local``
in the simulation's environment, so that ``ray.init()`` never attaches to a cluster someone
started on this machine with ``ray start``). ``ray_address`` (``dpfl simulate --ray-address
HOST:PORT``) instead runs the ClientApps on that running Ray cluster: Flower 1.39's federation
config has no Ray address field, so the launcher sets ``RAY_ADDRESS`` for the SuperLink and the
``flwr-simulation`` process it spawns, whose ``ray.init()`` reads it (docs/ray-cluster.md).
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator

from dpfl.apps.status import STATUS_ENV, SUMMARY_ENV, end_of_log_line, read_status
from dpfl.errors import UserError
from dpfl.logs import known_warnings_option
from dpfl.memo import PROOF_ENV
from dpfl.runlock import LAUNCHER_LOCK, WRITER_LOCK, RunLock
from dpfl.runtime.fab import stage_app
from dpfl.runtime.flwr_run import GO as FLWR_RUN_GO
from dpfl.runtime.launch_checks import LaunchChecks
from dpfl.runtime.process_backend import WORKERS_ENV
from dpfl.runtime.warm_clientapps import EARLY_ZYGOTE_ENV, EarlyZygote
from dpfl.runtime.watchdog import (
    ENDED_GRACE,
    STOP_POLL_SECONDS,
    alive,
    descendants,
    die_with_parent,
)

CONNECTION = "dpfl-sim"
SUPEREXEC_POLL_SECONDS = "0.1"
# After a SIGTERM the launcher stops its federation and exits within this many seconds; if
# anything blocks it longer, SIGALRM's default action ends the launcher and the watchdog
# above the SuperLink (dpfl.runtime.watchdog) stops the tree.
TERM_DEADLINE = 30
_active: dict[int, str] = {}    # pid -> what it is: processes a SIGTERM must stop
_terminated: list[int] = []     # signals received


def stop_active(signum: int) -> bool:
    """A SIGTERM handler's work, safe at any instant (no locks, no waits): signal every
    process this launcher is running (``flwr run``, the SuperLink's watchdog), arm the
    deadline, and let the main thread unwind when they are gone. False when nothing runs
    (the caller then exits at once)."""
    _terminated.append(signum)
    if not _active:
        return False
    for pid in list(_active):
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    signal.alarm(TERM_DEADLINE)
    return True


def _check_terminated() -> None:
    if _terminated:
        raise SystemExit(128 + _terminated[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flower_env(flwr_home: Path, output_root: Path | None = None) -> dict[str, str]:
    """Environment for every Flower process: private FLWR_HOME, no telemetry (Flower's nor
    Ray's usage stats), no update checks, no runtime `uv sync` of the app's dependencies,
    venv bin/ on PATH, the known harmless warnings filtered."""
    env = os.environ.copy()
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        # the raylet prestarts workers for the first driver that Flower's actors never use
        # (their runtime_env differs): 0.7 CPU s on a start that is CPU-bound on 2 cores
        "RAY_prestart_worker_first_driver": "0",
        # the known harmless third-party warnings, each by message, category and module
        # (dpfl.logs.KNOWN_WARNINGS); every other warning is still printed
        "PYTHONWARNINGS": known_warnings_option(os.environ.get("PYTHONWARNINGS", "")),
    })
    # the SuperExec polls the SuperLink for the simulation task every 1 s by default: 0.5 s
    # of an idle wait, on average, before each run starts (results/speed/startup-before.txt)
    env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", SUPEREXEC_POLL_SECONDS)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if output_root is not None:
        env["DPFL_OUTPUT_ROOT"] = str(output_root)
    return env


def warm_simulation_bin(flwr_home: Path) -> Path | None:
    """A folder holding a ``flower-superexec`` that runs Flower's SuperExec with its
    simulation task forked from a zygote which imported Flower's simulation engine, torch and
    dp-accounting while ``flwr run`` built and sent the app (:mod:`dpfl.runtime.warm_clientapps`,
    ``--warm simulation``); first on the SuperLink's PATH, it is the SuperExec the SuperLink
    starts (Flower 1.39 runs ``flower-superexec`` by name). None with
    ``DPFL_WARM_SIMULATION=0`` (Flower's own, cold: the bench's A/B)."""
    if os.environ.get("DPFL_WARM_SIMULATION", "1") == "0":
        return None
    folder = flwr_home / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "flower-superexec"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m dpfl.runtime.warm_clientapps --warm '
                      'simulation "$@"\n')
    script.chmod(0o755)
    return folder


def flower_bin(name: str) -> str:
    """The path of a Flower command (`flwr`, `flower-superlink`, ...) of this venv, else PATH's."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"`{name}` not found: install flwr[simulation] in this venv")
    return found


def write_flower_config(flwr_home: Path, address: str) -> Path:
    """A Flower config whose default connection is this launcher's SuperLink."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    path.write_text(f'[superlink]\ndefault = "{CONNECTION}"\n\n'
                    f'[superlink.{CONNECTION}]\naddress = "{address}"\ninsecure = true\n')
    return path


def _wait_http(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)   # a 0.3 s poll lost 0.15 s on average on the way to round 1
    raise TimeoutError("flower-superlink did not become ready")


def _signal_groups(pgids: set[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_process_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop a process we started and everything it started: SIGTERM the process groups of
    the process (started with start_new_session, so pgid == pid) and of its descendants,
    then SIGKILL whatever is left after ``grace`` seconds."""
    pids = [proc.pid] + descendants(proc.pid)
    pgids = set()
    for pid in pids:
        try:
            pgids.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    pgids.discard(os.getpgid(0))  # never our own group
    _signal_groups(pgids, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in pids[1:]):
        time.sleep(STOP_POLL_SECONDS)
    _signal_groups(pgids, signal.SIGKILL)
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


@contextmanager
def simulation_superlink(flwr_home: Path, env: dict[str, str],
                         while_starting: Callable[[], None] | None = None,
                         before_stop: Callable[[], None] | None = None,
                         run_ended: threading.Event | None = None) -> Iterator[str]:
    """A SuperLink in simulation mode on free ports; yields its connection address.
    ``while_starting`` runs once it was started, before its health check (the SuperLink
    takes ~1.3 s to answer: the launcher stages the app meanwhile); ``before_stop`` runs
    first thing when it is stopped (the early zygote's tree is told to stop with it).
    ``run_ended`` set when it is stopped: the ServerApp said how its run ended, and the
    SuperLink's in-memory state holds nothing more of it, so it gets the watchdog's
    :data:`~dpfl.runtime.watchdog.ENDED_GRACE` to exit on SIGTERM, not Flower's graceful shutdown
    (~0.5 s: its gRPC servers' grace and threads)."""
    http_port, control_port, fleet_port = free_port(), free_port(), free_port()
    log_file = flwr_home / "superlink.log"
    flwr_home.mkdir(parents=True, exist_ok=True)
    cmd = [flower_bin("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
           "--host", "127.0.0.1", "--port", str(http_port),
           "--control-api-address", f"127.0.0.1:{control_port}",
           "--fleet-api-address", f"127.0.0.1:{fleet_port}",
           "--disable-runtime-dependency-installation", "--log-file", str(log_file)]
    # under a watchdog that stops the whole tree when this process dies, even by SIGKILL
    watched = [sys.executable, "-m", "dpfl.runtime.watchdog", "--parent", str(os.getpid()), "--",
               *cmd]
    proc = subprocess.Popen(watched, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    _active[proc.pid] = "superlink watchdog"
    (flwr_home / "federation.pid").write_text(str(proc.pid))  # the watchdog: the tree's root
    try:
        if while_starting is not None:
            while_starting()
        _check_terminated()
        _wait_http(http_port, proc)
        yield f"127.0.0.1:{http_port}"
    finally:
        if before_stop is not None:
            before_stop()
        ended = run_ended is not None and run_ended.is_set()
        stop_process_group(proc, grace=ENDED_GRACE if ended else 10.0)
        _active.pop(proc.pid, None)


def run_config_arg(overrides: dict[str, object]) -> str:
    """Flower's ``--run-config`` syntax: key=value with TOML literals."""
    parts = []
    for key, value in overrides.items():
        if isinstance(value, bool):
            parts.append(f"{key}={'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            parts.append(f"{key}={value}")
        else:
            parts.append(f"{key}={json.dumps(str(value))}")
    return " ".join(parts)


class RunFailed(RuntimeError):
    """The federation did not finish (the ServerApp crashed, was killed, or Flower failed)."""


def _outcome(status_file: Path, run_dir: Path, returncode: int, log_file: Path) -> Path:
    """The run directory when the ServerApp of THIS launch wrote its summary; else the
    error it reported (:class:`UserError` for the user's, :class:`RunFailed` otherwise)."""
    status = read_status(status_file)
    if status is None:
        raise RunFailed(f"the ServerApp did not finish (flwr run exited {returncode}); see the "
                        f"log above and {log_file}")
    if status["status"] != "ok":
        if status.get("user-error"):
            raise UserError(status["message"])
        raise RunFailed(f"the ServerApp failed: {status['message']}; see the log above and "
                        f"{log_file}")
    if not (run_dir / "summary.json").exists():
        raise RunFailed(f"the ServerApp reported success but wrote no {run_dir / 'summary.json'}")
    return run_dir


def simulate(app_dir: Path, num_clients: int | None, overrides: dict[str, object],
             output_root: Path, flwr_home: Path | None = None, num_cpus: float = 1.0,
             timeout: float | None = None, quiet: bool = False,
             prints_summary: bool = False, ray_address: str | None = None,
             parallel: int | None = None, early_zygote: EarlyZygote | None = None) -> Path:
    """Run one simulated federation; return its run directory, whose ``summary.json`` this
    run wrote. Raises :class:`UserError` for settings that cannot work (before anything
    starts) or that the ServerApp refused, :class:`RunFailed` when it did not finish.

    The run is planned and checked in a forked child (:mod:`dpfl.runtime.launch_checks`,
    :func:`dpfl.runtime.preflight.plan_launch`: ``num_clients`` None is the resumed run's,
    else :data:`~dpfl.runtime.preflight.DEFAULT_CLIENTS`; a resume applies only the
    overrides a resume may change), so that this process never imports torch, Flower's
    server or dp-accounting. Every check comes before the run
    folder's lock: a refused launch writes nothing (not even the lock file or its "taking
    over" line). The launcher holds the lock for its whole life (a second launch or a
    resume of a live run is refused naming the holder's PID). ``prints_summary``: the
    caller prints the privacy summary when the run ends, so the ServerApp does not log it
    too. ``ray_address``: run the clients on that Ray cluster (HOST:PORT of its head)
    instead of a private Ray. ``parallel``: at most this many ClientApp actors (processes,
    ~1.5-1.9 GB each) train at once (the private Ray gets ``parallel * num_cpus`` CPUs);
    None: one per ``num_cpus`` of the machine's CPUs. Fewer actors start fewer processes: a
    small federation finishes sooner on few cores, and a large one fits in less memory.
    ``early_zygote``: the simulation forks from it (started by the caller before its
    imports; the caller stops it), not from a zygote the SuperExec starts."""
    checks = LaunchChecks.start(app_dir, num_clients, overrides, output_root, num_cpus,
                                ray_address, parallel)
    _active[checks.pid] = "launch checks"
    try:
        with checks:
            plan = checks.plan()
            created = not plan.run_dir.exists()
            lock = RunLock(plan.run_dir, LAUNCHER_LOCK, "dpfl simulate")
            try:
                lock.acquire()
                checks.recheck_after_lock()
            except BaseException:
                lock.release()
                if created:   # leave no empty run folder behind a refused launch
                    (plan.run_dir / LAUNCHER_LOCK).unlink(missing_ok=True)
                    (plan.run_dir / WRITER_LOCK).unlink(missing_ok=True)
                    try:
                        plan.run_dir.rmdir()
                    except OSError:
                        pass
                raise
    finally:
        _active.pop(checks.pid, None)
        _check_terminated()
    try:
        return _launch(app_dir, plan.supernodes, plan.overrides, plan.output_root,
                       plan.run_dir, flwr_home, num_cpus, timeout, quiet, prints_summary,
                       ray_address, parallel, plan.workers, early_zygote)
    finally:
        lock.release()


def _launch(app_dir: Path, supernodes: int, overrides: dict[str, object],
            output_root: Path, run_dir: Path, flwr_home: Path | None, num_cpus: float,
            timeout: float | None, quiet: bool, prints_summary: bool = False,
            ray_address: str | None = None, parallel: int | None = None,
            workers: int = 0, early_zygote: EarlyZygote | None = None) -> Path:
    flwr_home = (flwr_home or run_dir / ".flwr").resolve()
    env = flower_env(flwr_home, output_root)
    # the simulation forks this many ClientApp workers (dpfl.runtime.process_backend); 0: Ray
    env[WORKERS_ENV] = str(workers)
    # read by ray.init() in flwr-simulation: the cluster, else never one found on this machine
    env["RAY_ADDRESS"] = ray_address.strip() if ray_address else "local"
    warm = warm_simulation_bin(flwr_home)
    if warm is not None:
        env["PATH"] = str(warm) + os.pathsep + env["PATH"]
        if early_zygote is not None:
            env[EARLY_ZYGOTE_ENV] = early_zygote.env_value()
            # the simulation's tree: the early zygote's watchdog (federation.pid: the SuperLink's)
            flwr_home.mkdir(parents=True, exist_ok=True)
            (flwr_home / "simulation.pid").write_text(str(early_zygote.proc.pid))
    status_file = flwr_home / f"status-{secrets.token_hex(8)}.json"
    env[STATUS_ENV] = str(status_file)
    # this launch's processes take a memo entry another of them checked (dpfl.memo)
    env[PROOF_ENV] = secrets.token_hex(32)
    env.pop(SUMMARY_ENV, None)
    if prints_summary:
        env[SUMMARY_ENV] = "1"
    app = flwr_home / "app"   # staged: flwr run would walk the whole checkout

    def stage() -> None:
        stage_app(app_dir, app)

    run_ended = threading.Event()

    def stop_simulation() -> None:   # the early zygote's tree stops with the SuperLink
        if early_zygote is not None:
            early_zygote.terminate(run_ended.is_set())

    cmd = [sys.executable, "-m", "dpfl.runtime.flwr_run", "run", str(app), CONNECTION,
           "--stream", "--run-config", run_config_arg(overrides),
           "--federation-config", federation_config(supernodes, num_cpus, parallel)]
    out = subprocess.DEVNULL if quiet else subprocess.PIPE
    # started beside the SuperLink: it imports Flower's CLI while the SuperLink starts, and
    # runs when told to go (dpfl.runtime.flwr_run)
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=out,
                            stderr=subprocess.PIPE, cwd=str(app_dir), preexec_fn=die_with_parent)
    _active[proc.pid] = "flwr run"
    try:
        with simulation_superlink(flwr_home, env, while_starting=stage,
                                  before_stop=stop_simulation, run_ended=run_ended) as address:
            write_flower_config(flwr_home, address)
            try:
                proc.stdin.write(FLWR_RUN_GO)   # type: ignore[union-attr]
                proc.stdin.close()   # type: ignore[union-attr]
            except BrokenPipeError:
                pass   # it already exited: its exit code and its stderr say why
            # flwr run's stream (stdout; not when quiet) and its own messages (stderr), minus
            # Flower's misleading or useless lines
            relays = [threading.Thread(target=relay_stream,
                                       args=(proc.stderr, _binary(sys.stderr)),
                                       daemon=True, name="flwr-run-stderr")]
            # set once the stream relayed the ServerApp's last line (None: nothing to relay)
            log_relayed = None if quiet else threading.Event()
            if log_relayed is not None:
                relays.append(threading.Thread(
                    target=relay_stream, args=(proc.stdout, None,
                                               end_of_log_line(status_file), log_relayed),
                    daemon=True, name="flwr-run-stream"))
            for relay in relays:
                relay.start()
            try:
                _check_terminated()
                returncode = wait_for_run(proc, status_file, timeout, log_relayed)
                if run_said_how_it_ended(read_status(status_file)):
                    run_ended.set()
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
            finally:
                for relay in relays:   # the stream ends with flwr run (a grandchild holding
                    relay.join(timeout=5.0)   # the pipe open cannot hold the launcher up)
    finally:
        if proc.poll() is None:   # it never got to run (the SuperLink did not start)
            proc.kill()
            proc.wait()
        _active.pop(proc.pid, None)
    _check_terminated()
    return _outcome(status_file, run_dir, returncode, flwr_home / "superlink.log")


def run_said_how_it_ended(status: dict | None) -> bool:
    """Whether a ServerApp's status says its run ended as planned: ``ok``, or stopped by a
    user error it reported (a crash's status leaves Flower's own end to report it)."""
    return status is not None and (status.get("status") == "ok"
                                   or status.get("user-error") is True)


def wait_for_run(proc: subprocess.Popen, status_file: Path, timeout: float | None,
                 log_relayed: threading.Event | None = None, linger: float = 1.5,
                 poll: float = 0.02) -> int:
    """``flwr run``'s exit code. Once the ServerApp's status file says how it ended (``ok``,
    written after the run folder's last file: ledger, summary, plots; or a user error) and
    ``log_relayed`` is set (the stream relayed the ServerApp's last line; None: no stream is
    relayed), ``flwr run`` is stopped: Flower's own end of a simulation (the ServerApp's
    task finishing, the simulation's 3 s shutdown wait, the actors' exit) takes ~4 s more
    and changes nothing of the run. A last line that does not come within ``linger``
    seconds of the status is not waited for longer (Flower streams the log every ~0.7 s).
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    finished_at: float | None = None
    while True:
        try:
            return proc.wait(timeout=poll)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout or 0.0)
        if finished_at is None and run_said_how_it_ended(read_status(status_file)):
            finished_at = now
        if finished_at is not None and (log_relayed is None or log_relayed.is_set()
                                        or now - finished_at >= linger):
            proc.terminate()
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return 0


# Lines of `flwr run --stream` the launcher does not relay, each matched whole (colours
# removed). Flower 1.39's simulation process logs "Since flwr 1.32, default simulated
# SuperNodes changed from 10 to 2." at the start of every simulation, unconditionally
# (flwr/simulation/app.py, flwr_simulation), before any app code runs: dpfl always sets
# num-supernodes (--federation-config, the size asked for), so the line is only misleading.
# (Setting options.num-supernodes in the connection's config.toml would not stop it, and
# flwr 1.39 deprecates those options with a warning of its own.)
# "Manually terminating ClientAppActor" (each Ray actor, at a normal end) is dropped where it
# is logged, in the actors (dpfl.logs.RoutineFlowerRecords), and here too, for an actor that
# never loaded the ClientApp.
# The same process then logs "To change federation size, use the following command:" and
# "\tflwr federation simulation-config <federation> <superlink> --num-supernodes <N>": the
# wrong advice for dpfl, whose size is `dpfl simulate --clients N`. An INFO line with nothing
# after its level (Flower's spacer, log(INFO, "")) says nothing either.
DROPPED_FLOWER_LINES = (
    re.compile(r"WARNING\s*:\s*Since flwr 1\.32, default simulated SuperNodes changed from 10 "
               r"to 2\.\s*"),
    re.compile(r"INFO\s*:\s*To change federation size, use the following command:\s*"),
    re.compile(r"INFO\s*:\s*flwr federation simulation-config \S+ <superlink> "
               r"--num-supernodes <N>\s*"),
    re.compile(r"INFO\s*:\s*"),
    re.compile(r"(\(ClientAppActor pid=\d+\)\s*)?WARNING\s*:\s*Manually terminating "
               r"ClientAppActor\s*"),
    # the run id of a simulation whose SuperLink the launcher stops afterwards: nothing a
    # user can do with it (the run directory is printed at the end)
    re.compile(r"INFO\s*:\s*(Starting logstream for run_id `\d+`|Exiting logstream)\s*"),
)
_ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def _binary(stream: IO[str]) -> IO[bytes]:
    """A text stream's underlying bytes (a stream without one, e.g. a test's, as is)."""
    return getattr(stream, "buffer", None) or stream  # type: ignore[return-value]


def relay_stream(stream: IO[bytes], out: IO[bytes] | None = None, last_line: str = "",
                 relayed: threading.Event | None = None) -> None:
    """Copy ``stream`` line by line to ``out`` (default: this process's stdout), without
    the lines of :data:`DROPPED_FLOWER_LINES`; a line holding ``last_line`` is not copied
    but sets ``relayed``."""
    if out is None:
        out = _binary(sys.stdout)
    binary = not isinstance(out, io.TextIOBase)
    for raw in iter(stream.readline, b""):
        text = raw.decode(errors="replace")
        if last_line and last_line in text:
            if relayed is not None:
                relayed.set()
            continue
        if any(p.fullmatch(_ANSI_COLOUR.sub("", text)) for p in DROPPED_FLOWER_LINES):
            continue
        out.write(raw if binary else text)  # type: ignore[arg-type]
        out.flush()


def federation_config(num_clients: int, num_cpus: float, parallel: int | None) -> str:
    """`flwr run --federation-config`: the simulated SuperNodes, each ClientApp's CPUs and,
    with ``parallel``, the private Ray's CPUs (Flower starts one actor per client's worth)."""
    config = f"num-supernodes={num_clients} client-resources-num-cpus={_num(num_cpus)}"
    if parallel is not None:
        config += f" init-args-num-cpus={int(parallel * num_cpus)}"
    return config


def _num(value: float) -> int | float:
    """Flower's federation-config wants integers where the value is integral."""
    return int(value) if float(value).is_integer() else value
