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

import importlib.util
import io
import json
import logging
import math
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
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from dpfl.apps.server import first_round_affordable
from dpfl.apps.status import STATUS_ENV, SUMMARY_ENV, end_of_log_line, read_status
from dpfl.config import (
    MAX_CANARY_EXAMPLES_PER_CLIENT,
    MIN_EXAMPLES_PER_CLIENT,
    ConfigError,
    RunConfig,
)
from dpfl.data import check_dataset, splits_for
from dpfl.errors import UserError, writable_dir_problem
from dpfl.logs import known_warnings_option
from dpfl.methods import DEFAULT_METHOD, build_strategy, configured, parse_run_config
from dpfl.runlock import LAUNCHER_LOCK, WRITER_LOCK, RunLock, check_unlocked
from dpfl.runtime.fab import stage_app
from dpfl.runtime.process_backend import WORKERS_ENV
from dpfl.runtime.warm_clientapps import EARLY_ZYGOTE_ENV, EarlyZygote
from dpfl.runtime.watchdog import (
    ENDED_GRACE,
    STOP_POLL_SECONDS,
    alive,
    descendants,
    die_with_parent,
)
from dpfl.server.rundir import (
    RunDir,
    check_run_dir,
    resolve_output_dir,
    run_dir_path,
    unique_run_name,
)
from dpfl.server.runidentity import NUM_CLIENTS, resume_overrides
from dpfl.server.trust import server_trust

CONNECTION = "dpfl-sim"
SUPEREXEC_POLL_SECONDS = "0.1"
DEFAULT_CLIENTS = 4
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


def check_ray_address(address: str, timeout: float = 5.0) -> str:
    """``--ray-address``: ``HOST:PORT`` of a running Ray cluster's head (the GCS port given to
    ``ray start --head --port``) that accepts a TCP connection from here within ``timeout``
    seconds; else a one-line :class:`UserError` (Ray itself would retry for minutes, then
    fail in a traceback). Returns the address as Ray will read it."""
    text = address.strip()
    host, sep, port = text.rpartition(":")
    if "://" in text:
        raise UserError(f"--ray-address {address!r}: give the head's HOST:PORT (the GCS "
                        "address of `ray start --head --port`), not a URL (Ray Client "
                        "ray:// addresses are not supported)")
    if not (sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536):
        raise UserError(f"--ray-address {address!r}: expected HOST:PORT of the Ray head, "
                        "e.g. 10.0.0.1:6379")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise UserError(f"--ray-address {text}: no Ray head answers there "
                        f"({exc.strerror or type(exc).__name__}); start one with `ray start "
                        f"--head --port {port}` on that host") from None
    return text


class RunFailed(RuntimeError):
    """The federation did not finish (the ServerApp crashed, was killed, or Flower failed)."""


def check_cpus_per_client(num_cpus: float, cluster: bool = False) -> None:
    """``--cpus-per-client``: a finite number in (0, the machine's CPUs] (Ray would wait
    forever for a client it cannot place, and refuses 0 or less in a traceback). On a Ray
    cluster (``cluster``) another node may have more CPUs than this machine: only > 0."""
    if cluster:
        if not (math.isfinite(num_cpus) and num_cpus > 0):
            raise UserError(f"--cpus-per-client must be a number > 0, got {num_cpus:g}")
        return
    available = os.cpu_count() or 1
    if not (math.isfinite(num_cpus) and 0 < num_cpus <= available):
        raise UserError(f"--cpus-per-client must be in (0, {available}] (the CPUs of this "
                        f"machine), got {num_cpus:g}")


def check_parallel_clients(parallel: int | None, num_cpus: float,
                           cluster: bool = False) -> None:
    """``--parallel-clients``: a whole number >= 1 whose CPUs (times ``--cpus-per-client``)
    are whole, on a private Ray only (a cluster's size is its own). None: Ray's default, as
    many ClientApp actors as the machine's CPUs hold."""
    if parallel is None:
        return
    if cluster:
        raise UserError("--parallel-clients sizes the private Ray; with --ray-address the "
                        "cluster's CPUs decide (start its nodes with `ray start --num-cpus`)")
    if parallel < 1:
        raise UserError(f"--parallel-clients must be at least 1, got {parallel}")
    if not float(parallel * num_cpus).is_integer():
        raise UserError(f"--parallel-clients {parallel} x --cpus-per-client {num_cpus:g} must "
                        "be a whole number of CPUs")


def check_data_size(cfg: RunConfig, num_clients: int, n_train: int) -> None:
    """``--clients``, ``server-holdout`` and ``train-subset`` against the dataset's
    ``n_train`` training examples (one-line :class:`UserError` each): every client gets at
    least :data:`MIN_EXAMPLES_PER_CLIENT` examples of what the server's holdout leaves, and a
    ``train-subset`` is 0 (all) or between that and what is left."""
    least = MIN_EXAMPLES_PER_CLIENT * num_clients
    most_clients = n_train // MIN_EXAMPLES_PER_CLIENT
    if num_clients > most_clients:
        raise UserError(f"--clients {num_clients}: {cfg.dataset} has {n_train} training "
                        f"examples, enough for at most {most_clients} clients "
                        f"({MIN_EXAMPLES_PER_CLIENT} examples each)")
    if cfg.server_holdout > n_train - least:
        raise ConfigError(f"run-config key 'server-holdout': must be at most {n_train - least} "
                          f"({cfg.dataset} has {n_train} training examples and each of the "
                          f"{num_clients} clients needs {MIN_EXAMPLES_PER_CLIENT}), got "
                          f"{cfg.server_holdout}")
    left = n_train - cfg.server_holdout
    if cfg.train_subset and not least <= cfg.train_subset <= left:
        raise ConfigError(f"run-config key 'train-subset': must be 0 (all) or in [{least}, "
                          f"{left}] ({MIN_EXAMPLES_PER_CLIENT} examples for each of the "
                          f"{num_clients} clients; {cfg.dataset}'s {n_train} training examples "
                          f"less server-holdout {cfg.server_holdout}), got {cfg.train_subset}")


def check_audit_canaries(cfg: RunConfig, num_clients: int) -> None:
    """``audit-canaries``: client-level canaries are clients (at most ``num_clients``);
    DP-SGD's are examples, at most :data:`MAX_CANARY_EXAMPLES_PER_CLIENT` per client."""
    if cfg.trainer == "dpsgd":
        most, what = MAX_CANARY_EXAMPLES_PER_CLIENT * num_clients, (
            f"{MAX_CANARY_EXAMPLES_PER_CLIENT} canary examples per client, {num_clients} "
            "clients")
    else:
        most, what = num_clients, "canaries are clients under client-level DP"
    if cfg.audit_canaries > most:
        raise ConfigError(f"run-config key 'audit-canaries': must be at most {most} ({what}), "
                          f"got {cfg.audit_canaries}")


def preflight(cfg: RunConfig, num_clients: int, run_dir: Path, num_cpus: float = 1.0,
              ray_address: str | None = None, parallel: int | None = None) -> None:
    """Settings that cannot work stop here, before any process starts (one-line
    :class:`UserError` each): no clients, no Ray installed, more ``min-train-nodes`` than
    clients (the server would wait for nodes that never come), a new run on an existing run
    directory, a resume of a directory that is not there or whose ledger or round log is
    damaged, a dataset or data-dir that is not there, a budget that one round at an explicit
    ``noise-multiplier`` already exceeds, a ``ray_address`` that is malformed or where
    nothing answers, more clients, ``server-holdout`` or ``train-subset`` than the dataset's
    training examples hold (:func:`check_data_size`), more ``audit-canaries`` than the
    clients can host. Nothing here writes a file: :func:`simulate` runs it before taking the
    run folder's lock."""
    if num_clients < 1:
        raise UserError(f"--clients must be at least 1, got {num_clients}")
    if importlib.util.find_spec("ray") is None:   # else flwr-simulation fails in the log
        raise UserError("dpfl simulate needs Flower's simulation engine (Ray), which is not "
                        "installed here: pip install 'dpfl[simulation]'")
    check_cpus_per_client(num_cpus, cluster=ray_address is not None)
    check_parallel_clients(parallel, num_cpus, cluster=ray_address is not None)
    if ray_address is not None:
        check_ray_address(ray_address)
    if cfg.min_train_nodes > num_clients:
        raise UserError(f"run-config key 'min-train-nodes': {cfg.min_train_nodes} nodes "
                        f"needed but --clients is {num_clients}: the server would wait for "
                        "nodes that never come")
    check_run_dir(run_dir, cfg.resume)
    if cfg.resume:   # its ledger and round log, as the ServerApp would read them
        RunDir(run_dir).check_resumable()
    check_data_size(cfg, num_clients, check_dataset(cfg.dataset, cfg.data_dir, cfg.download))
    check_audit_canaries(cfg, num_clients)
    if (cfg.is_private and cfg.noise_multiplier > 0 and not cfg.resume
            and not server_trust(cfg).secure_sum):
        # an explicit sigma: is one round affordable? (calibrated sigmas are by construction;
        # the ServerApp checks every case again, in deployments too; a distributed round's
        # charge depends on the model's size, which only the ServerApp has built)
        with _errors_only("flwr"):  # no strategy warnings here
            strategy = build_strategy(configured(cfg), {
                i: len(s.train) for i, s in enumerate(splits_for(cfg, num_clients))})
        if not round_one_fits_by_rdp(strategy, cfg):
            first_round_affordable(strategy, cfg)   # the run's own accountant decides


@contextmanager
def _errors_only(logger: str) -> Iterator[None]:
    """The named logger shows only errors inside the block (its level restored after)."""
    log_ = logging.getLogger(logger)
    level = log_.level
    log_.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log_.setLevel(level)


def round_one_fits_by_rdp(strategy: Any, cfg: RunConfig) -> bool:
    """Whether the RDP accountant already shows one round within ``target-epsilon``: RDP's
    epsilon bounds the true epsilon from above, so the round fits, and the launcher skips its
    own accountant's check (a PLD evaluation: 0.6 s at q = 0.1, 0.9 s at q = 0.01, on the
    way to round 1; the ServerApp checks again with the run's accountant before any
    training). False: ask the run's accountant."""
    if cfg.accountant == "rdp":
        return False
    try:
        with _errors_only("absl"):   # dp-accounting's notes on fractional RDP orders
            first_round_affordable(strategy, replace(cfg, accountant="rdp"))
    except ConfigError:
        return False
    return True


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


def resolved(path: Path, option: str) -> Path:
    """``path`` made absolute with its symbolic links resolved, or a :class:`UserError`
    naming ``option`` (a symbolic link loop, a component that cannot be read)."""
    try:
        return path.resolve()
    except RuntimeError as exc:   # Python < 3.13: "Symlink loop from '...'"
        raise UserError(f"{option} {path}: a symbolic link loop ({exc})") from None
    except OSError as exc:
        raise UserError(f"{option} {path}: cannot resolve it "
                        f"({exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''})"
                        ) from None


def simulate(app_dir: Path, num_clients: int | None, overrides: dict[str, object],
             output_root: Path, flwr_home: Path | None = None, num_cpus: float = 1.0,
             timeout: float | None = None, quiet: bool = False,
             prints_summary: bool = False, ray_address: str | None = None,
             parallel: int | None = None, early_zygote: EarlyZygote | None = None) -> Path:
    """Run one simulated federation; return its run directory, whose ``summary.json`` this
    run wrote. Raises :class:`UserError` for settings that cannot work (before anything
    starts) or that the ServerApp refused, :class:`RunFailed` when it did not finish.

    ``num_clients`` None: the resumed run's, else :data:`DEFAULT_CLIENTS`. A resume loads
    the run's saved config (``config.json``) and applies only the overrides a resume may
    change (:func:`dpfl.server.runidentity.resume_overrides`). The launcher holds the run
    folder's launcher lock for its whole life (a second launch or a resume of a live run is
    refused naming the holder's PID). ``prints_summary``: the caller prints the privacy
    summary when the run ends, so the ServerApp does not log it too. ``ray_address``: run
    the clients on that Ray cluster (HOST:PORT of its head) instead of a private Ray.
    ``parallel``: at most this many ClientApp actors (processes, ~1.5-1.9 GB each) train at
    once (the private Ray gets ``parallel * num_cpus`` CPUs); None: one per
    ``num_cpus`` of the machine's CPUs. Fewer actors start fewer processes: a small
    federation finishes sooner on few cores, and a large one fits in less memory.
    ``early_zygote``: the simulation forks from it (started by the caller before its
    imports; the caller stops it), not from a zygote the SuperExec starts."""
    output_root = resolved(output_root, "--output-dir")
    overrides = dict(overrides)
    overrides.setdefault("run-name", unique_run_name(str(overrides.get("strategy") or
                                                         DEFAULT_METHOD)))
    output_key = "run-config key 'output-dir'" if "output-dir" in overrides else "--output-dir"
    overrides.setdefault("output-dir", str(output_root))
    defaults = tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    cfg = parse_run_config({**defaults["config"], **overrides})
    resolved(resolve_output_dir(cfg, output_root), output_key)
    run_dir = run_dir_path(cfg, output_root)  # where the ServerApp will put it
    why = writable_dir_problem(run_dir)   # before the lock below creates the folder
    if why is not None:
        raise UserError(f"{output_key} {resolve_output_dir(cfg, output_root)}: {why}")
    for name in (LAUNCHER_LOCK, WRITER_LOCK):   # a live run first: name its process
        check_unlocked(run_dir, name)
    check_run_dir(run_dir, cfg.resume)
    saved = RunDir(run_dir).saved_config() if cfg.resume else None
    if saved is not None:
        explicit = dict(overrides)
        if num_clients is not None:
            explicit[NUM_CLIENTS] = num_clients
        overrides = resume_overrides(saved, explicit, str(run_dir))
        num_clients = int(saved[NUM_CLIENTS]) if NUM_CLIENTS in saved else num_clients
        cfg = parse_run_config({**defaults["config"], **overrides})
    num_clients = DEFAULT_CLIENTS if num_clients is None else num_clients
    layout = node_layout(cfg, num_clients, num_cpus, parallel, ray_address is not None)
    workers = process_workers(cfg, num_cpus, parallel, ray_address is not None)
    overrides["cohort-clients"] = layout.cohort_clients
    # every check before the lock: a refused launch writes nothing (not even the lock file
    # or its "taking over" line); after it, what another launch may have changed meanwhile
    preflight(cfg, num_clients, run_dir, num_cpus, ray_address, parallel)
    created = not run_dir.exists()
    lock = RunLock(run_dir, LAUNCHER_LOCK, "dpfl simulate")
    try:
        lock.acquire()
        check_unlocked(run_dir, WRITER_LOCK)
        check_run_dir(run_dir, cfg.resume)
        if cfg.resume:
            RunDir(run_dir).check_resumable()
    except BaseException:
        lock.release()
        if created:   # leave no empty run folder behind a refused launch
            (run_dir / LAUNCHER_LOCK).unlink(missing_ok=True)
            (run_dir / WRITER_LOCK).unlink(missing_ok=True)
            try:
                run_dir.rmdir()
            except OSError:
                pass
        raise
    try:
        return _launch(app_dir, cfg, layout.supernodes, overrides, output_root, run_dir,
                       flwr_home, num_cpus, timeout, quiet, prints_summary, ray_address,
                       parallel, workers, early_zygote)
    finally:
        lock.release()


def _launch(app_dir: Path, cfg: RunConfig, supernodes: int, overrides: dict[str, object],
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

    with simulation_superlink(flwr_home, env, while_starting=stage,
                              before_stop=stop_simulation, run_ended=run_ended) as address:
        write_flower_config(flwr_home, address)
        cmd = [flower_bin("flwr"), "run", str(app), CONNECTION, "--stream",
               "--run-config", run_config_arg(overrides),
               "--federation-config",
               federation_config(supernodes, num_cpus, parallel)]
        out = subprocess.DEVNULL if quiet else subprocess.PIPE
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.PIPE,
                                cwd=str(app_dir), preexec_fn=die_with_parent)
        _active[proc.pid] = "flwr run"
        # flwr run's stream (stdout; not when quiet) and its own messages (stderr), minus
        # Flower's misleading or useless lines
        relays = [threading.Thread(target=relay_stream, args=(proc.stderr, _binary(sys.stderr)),
                                   daemon=True, name="flwr-run-stderr")]
        # set once the stream relayed the ServerApp's last line (None: nothing to relay)
        log_relayed = None if quiet else threading.Event()
        if log_relayed is not None:
            relays.append(threading.Thread(
                target=relay_stream, args=(proc.stdout, None, end_of_log_line(status_file),
                                           log_relayed),
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
            _active.pop(proc.pid, None)
            for relay in relays:   # the stream ends with flwr run (a grandchild holding
                relay.join(timeout=5.0)   # the pipe open cannot hold the launcher up)
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


@dataclass(frozen=True)
class NodeLayout:
    """How a simulation hosts its clients: ``supernodes`` simulated SuperNodes, and
    ``cohort_clients`` clients between them (0: one client per node)."""

    supernodes: int
    cohort_clients: int


# cohort nodes per ClientApp running at once (cohort-nodes = -1): a round's sampled clients
# fall on the nodes by id, so the nodes' cohorts differ in size; with 4 per ClientApp and the
# largest dispatched first (process_backend.add_messages_on_arrival) the two workers of this
# machine ended a 1,000-client round 0.02 s apart on average, 0.12 s with 2 per ClientApp
# in arrival order
COHORTS_PER_CLIENTAPP = 4


def node_layout(cfg: RunConfig, num_clients: int, num_cpus: float, parallel: int | None,
                cluster: bool = False) -> NodeLayout:
    """The simulation's nodes for ``num_clients`` clients under ``cohort-nodes``: K > 0
    nodes when K < clients; automatic (-1): :data:`COHORTS_PER_CLIENTAPP` times the
    ClientApps that run at once (so that a round's cohorts balance over them), when there
    are more clients than that, on a
    private Ray and not under SecAgg+ (whose stages are per node); else one node per
    client."""
    one_each = NodeLayout(num_clients, 0)
    k = cfg.cohort_nodes
    if k == 0:
        return one_each
    if server_trust(cfg).secure_sum:
        if k > 0:
            raise UserError("run-config key 'cohort-nodes': SecAgg+ (trust=distributed) runs "
                            "its stages per node: one client per node (set 0 or -1)")
        return one_each
    if k < 0:
        if cluster:   # the cluster's size is its own: keep Flower's one node per client
            return one_each
        k = COHORTS_PER_CLIENTAPP * parallel_clientapps(num_cpus, parallel)
    return one_each if k >= num_clients else NodeLayout(k, num_clients)


def parallel_clientapps(num_cpus: float, parallel: int | None) -> int:
    """How many ClientApps run at once on this machine: ``parallel``, else one per
    ``num_cpus`` of its CPUs (as Flower sizes its Ray actor pool)."""
    return parallel if parallel is not None else max(1, int((os.cpu_count() or 1) // num_cpus))


def process_workers(cfg: RunConfig, num_cpus: float, parallel: int | None,
                    cluster: bool) -> int:
    """The worker processes the simulation forks for its ClientApps
    (:mod:`dpfl.runtime.process_backend`); 0 = Flower's Ray actors (``simulation-backend =
    "ray"``, or a Ray cluster)."""
    if cluster or cfg.simulation_backend != "process":
        return 0
    return parallel_clientapps(num_cpus, parallel)


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
