"""Run a Flower simulation with ``flwr run``, owning the SuperLink it needs.

``flwr run`` against Flower's ``:local:`` connection starts a detached SuperLink that
outlives the run and whose PID is not reported. This launcher instead starts
``flower-superlink --simulation`` itself on free loopback ports, in its own process group,
writes a Flower config (``$FLWR_HOME/config.toml``) pointing at it, calls
``flwr run <app> dpfl-sim --stream``, and stops the SuperLink (and the simulation
processes it spawned) by PID afterwards, whatever happened.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dpfl.apps.server import first_round_affordable
from dpfl.apps.status import STATUS_ENV, read_status
from dpfl.config import RunConfig
from dpfl.data import check_dataset, splits_for
from dpfl.errors import UserError
from dpfl.methods import DEFAULT_METHOD, build_strategy, configured, parse_run_config
from dpfl.server.rundir import check_run_dir, run_dir_path, unique_run_name
from dpfl.watchdog import alive, descendants, die_with_parent

CONNECTION = "dpfl-sim"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flower_env(flwr_home: Path, output_root: Path | None = None) -> dict[str, str]:
    """Environment for every Flower process: private FLWR_HOME, no telemetry, no update
    checks, no runtime `uv sync` of the app's dependencies, venv bin/ on PATH."""
    env = os.environ.copy()
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_DEDUP_LOGS": "0",
        "PYTHONWARNINGS": "ignore",
    })
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if output_root is not None:
        env["DPFL_OUTPUT_ROOT"] = str(output_root)
    return env


def _bin(name: str) -> str:
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
        time.sleep(0.3)
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
        time.sleep(0.2)
    _signal_groups(pgids, signal.SIGKILL)
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


@contextmanager
def simulation_superlink(flwr_home: Path, env: dict[str, str]) -> Iterator[str]:
    """A SuperLink in simulation mode on free ports; yields its connection address."""
    http_port, control_port, fleet_port = free_port(), free_port(), free_port()
    log_file = flwr_home / "superlink.log"
    flwr_home.mkdir(parents=True, exist_ok=True)
    cmd = [_bin("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
           "--host", "127.0.0.1", "--port", str(http_port),
           "--control-api-address", f"127.0.0.1:{control_port}",
           "--fleet-api-address", f"127.0.0.1:{fleet_port}",
           "--disable-runtime-dependency-installation", "--log-file", str(log_file)]
    # under a watchdog that stops the whole tree when this process dies, even by SIGKILL
    watched = [sys.executable, "-m", "dpfl.watchdog", "--parent", str(os.getpid()), "--", *cmd]
    proc = subprocess.Popen(watched, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    (flwr_home / "federation.pid").write_text(str(proc.pid))  # the watchdog: the tree's root
    try:
        _wait_http(http_port, proc)
        yield f"127.0.0.1:{http_port}"
    finally:
        stop_process_group(proc)


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


def preflight(cfg: RunConfig, num_clients: int, run_dir: Path) -> None:
    """Settings that cannot work stop here, before any process starts (one-line
    :class:`UserError` each): no clients, more ``min-train-nodes`` than clients (the server
    would wait for nodes that never come), a new run on an existing run directory, a resume
    of a directory that is not there, a dataset or data-dir that is not there, a budget
    that one round at an explicit ``noise-multiplier`` already exceeds."""
    if num_clients < 1:
        raise UserError(f"--clients must be at least 1, got {num_clients}")
    if cfg.min_train_nodes > num_clients:
        raise UserError(f"run-config key 'min-train-nodes': {cfg.min_train_nodes} nodes "
                        f"needed but --clients is {num_clients}: the server would wait for "
                        "nodes that never come")
    check_run_dir(run_dir, cfg.resume)
    check_dataset(cfg.dataset, cfg.data_dir, cfg.download)
    if cfg.is_private and cfg.noise_multiplier > 0 and not cfg.resume:
        # an explicit sigma: is one round affordable? (calibrated sigmas are by construction;
        # the ServerApp checks every case again, in deployments too)
        flower = logging.getLogger("flwr")
        level = flower.level
        flower.setLevel(logging.ERROR)  # no strategy warnings here
        try:
            strategy = build_strategy(configured(cfg))
        finally:
            flower.setLevel(level)
        strategy.bind_partition_sizes({i: len(s.train)
                                       for i, s in enumerate(splits_for(cfg, num_clients))})
        first_round_affordable(strategy, cfg)


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


def simulate(app_dir: Path, num_clients: int, overrides: dict[str, object],
             output_root: Path, flwr_home: Path | None = None, num_cpus: float = 1.0,
             timeout: float | None = None, quiet: bool = False) -> Path:
    """Run one simulated federation; return its run directory, whose ``summary.json`` this
    run wrote. Raises :class:`UserError` for settings that cannot work (before anything
    starts) or that the ServerApp refused, :class:`RunFailed` when it did not finish."""
    output_root = output_root.resolve()
    overrides = dict(overrides)
    overrides.setdefault("run-name", unique_run_name(str(overrides.get("strategy") or
                                                         DEFAULT_METHOD)))
    overrides.setdefault("output-dir", str(output_root))
    defaults = tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    cfg = parse_run_config({**defaults["config"], **overrides})
    run_dir = run_dir_path(cfg, output_root)  # where the ServerApp will put it
    preflight(cfg, num_clients, run_dir)
    flwr_home = (flwr_home or run_dir / ".flwr").resolve()
    env = flower_env(flwr_home, output_root)
    status_file = flwr_home / f"status-{secrets.token_hex(8)}.json"
    env[STATUS_ENV] = str(status_file)
    with simulation_superlink(flwr_home, env) as address:
        write_flower_config(flwr_home, address)
        cmd = [_bin("flwr"), "run", str(app_dir), CONNECTION, "--stream",
               "--run-config", run_config_arg(overrides),
               "--federation-config",
               f"num-supernodes={num_clients} client-resources-num-cpus={_num(num_cpus)}"]
        out = subprocess.DEVNULL if quiet else None
        proc = subprocess.run(cmd, env=env, timeout=timeout, stdout=out, cwd=str(app_dir),
                              preexec_fn=die_with_parent, check=False)
    return _outcome(status_file, run_dir, proc.returncode, flwr_home / "superlink.log")


def _num(value: float) -> int | float:
    """Flower's federation-config wants integers where the value is integral."""
    return int(value) if float(value).is_integer() else value
