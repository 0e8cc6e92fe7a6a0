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
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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


def _children_map() -> dict[int, list[int]]:
    """ppid -> child pids, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the SuperLink starts its SuperExec, the simulation and
    Ray in process groups of their own, so a group signal alone does not reach them)."""
    children, out, todo = _children_map(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


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
    while time.monotonic() < deadline and any(_alive(p) for p in pids[1:]):
        time.sleep(0.2)
    _signal_groups(pgids, signal.SIGKILL)
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    (flwr_home / "superlink.pid").write_text(str(proc.pid))
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


def simulate(app_dir: Path, num_clients: int, overrides: dict[str, object],
             output_root: Path, flwr_home: Path | None = None, num_cpus: float = 1.0,
             timeout: float | None = None, quiet: bool = False) -> Path:
    """Run one simulated federation; return its run directory (which holds summary.json)."""
    output_root = output_root.resolve()
    overrides = dict(overrides)
    overrides.setdefault("run-name", f"{time.strftime('%Y%m%d-%H%M%S')}-"
                         f"{overrides.get('strategy', 'dpfedavg')}")
    overrides.setdefault("output-dir", str(output_root))
    run_dir = Path(str(overrides["output-dir"])) / str(overrides["run-name"])
    flwr_home = (flwr_home or run_dir / ".flwr").resolve()
    env = flower_env(flwr_home, output_root)
    with simulation_superlink(flwr_home, env) as address:
        write_flower_config(flwr_home, address)
        cmd = [_bin("flwr"), "run", str(app_dir), CONNECTION, "--stream",
               "--run-config", run_config_arg(overrides),
               "--federation-config",
               f"num-supernodes={num_clients} client-resources-num-cpus={_num(num_cpus)}"]
        out = subprocess.DEVNULL if quiet else None
        subprocess.run(cmd, env=env, check=True, timeout=timeout, stdout=out,
                       cwd=str(app_dir))
    if not (run_dir / "summary.json").exists():
        raise RuntimeError(f"the run ended without {run_dir / 'summary.json'}; see "
                           f"{flwr_home / 'superlink.log'}")
    return run_dir


def _num(value: float) -> int | float:
    """Flower's federation-config wants integers where the value is integral."""
    return int(value) if float(value).is_integer() else value
