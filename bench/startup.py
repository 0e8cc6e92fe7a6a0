"""Where a simulation's start goes: a timeline from `dpfl simulate` to round 1's first reply.

    .venv/bin/python bench/startup.py [--runs 2] [--clients 4] [--train-subset 0]
                                      [--env KEY=VALUE ...] [--no-importtime] [--no-probe]
                                      [--keep]

Issue 47 (item 3) asks for round 1 to start within 10 s of `dpfl simulate` on an idle
machine. This bench runs real federations (`dpfl simulate --clients 4 num-rounds=1`: the demo
at one round, MNIST, DP-SGD at epsilon <= 4) and prints, for each, a timeline of milestones in
seconds since the launcher's process started, with what each one waits on, and the same for
round 1's first reply. Nothing in dpfl is changed; every time comes from one of these sources:

- the launcher: the bench starts a launcher process (``bench/startup.py --launcher``) that
  calls ``dpfl.cli.main(["simulate", ...])`` in-process, with ``dpfl.runtime.launch``'s phases
  timed once that module is imported (its import, its checks' forked child, ``stage_app``, the
  SuperLink's start up to its health check, every ``Popen``);
- a probe in every Python process of the federation: the bench writes a ``sitecustomize.py``
  (:data:`PROBE_SOURCE`) into a temporary folder first on ``PYTHONPATH`` (the launcher passes
  its environment to the SuperLink, the SuperLink to ``flwr-simulation``, that one to Ray's
  processes and workers). In each process it records wall-clock JSON lines: when the
  interpreter reached it, the first import of each module of :data:`IMPORTS` (begin and end,
  nested imports included) and the first calls of each function of :data:`CALLS`, wrapped
  where it is defined right after its module's import (Flower's FAB build and install,
  ``ray.init``, the actor pool, the ServerApp's setup steps, the ClientApp call with its data
  load, model build, calibration check, Opacus setup, training and accounting). It costs a
  few microseconds per import and per wrapped call;
- the SuperLink's log (``<run>/.flwr/superlink.log``: StartRun, Started task; ms stamps);
- the run's ``rounds.jsonl`` (round 1's ``started`` and ``phase-seconds``);
- ``/proc``, polled every 0.1 s by this process: every descendant of the launcher, its start
  time (``/proc/<pid>/stat`` starttime, 10 ms ticks), its title over time (Ray renames a
  worker ``ray::IDLE``, then ``ray::ClientAppActor.run`` when a task reaches it) and its CPU
  seconds over time; and the machine's busy CPU, from which the CPU that other jobs took
  during the run is printed beside the load averages;
- ``python -X importtime -c "import M"`` for the top module of each kind of process (after
  the federations, one at a time): import seconds by package.

Then it prints the key intervals of every run side by side and two ranked lists of
candidate savings, computed from their means: what would move round 1's start, and what would
shorten round 1's exchange up to its first reply. dpfl's memo (calibrated sigmas,
partitions; ``~/.cache/dpfl``) is used as a second launch of the same command finds it
(``--env DPFL_CACHE_DIR=DIR`` points it elsewhere). ``--env KEY=VALUE`` sets a variable for the
launcher and everything under it, to try a Flower or Ray setting without changing code.
``--no-probe`` runs without the probe (the /proc, log and rounds.jsonl times only), to see
that it does not move them. ``--keep`` keeps the raw measurements (probe events, processes,
logs) in the work folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE_ENV = "DPFL_STARTUP_PROBE"
POLL_SECONDS = 0.1

# modules whose first import is timed in every process (begin, end; nested imports included)
IMPORTS = (
    "dpfl.cli", "dpfl.runtime.launch", "dpfl.apps.server", "dpfl.apps.client",
    "dpfl.apps.client_handlers", "torch", "torch._dynamo",
    "numpy", "scipy", "opacus", "dp_accounting", "flwr", "flwr.simulation.app",
    "flwr.simulation.ray_transport.ray_actor", "flwr.superlink.cli", "flwr.supercore.cli",
    "flwr.cli.app", "ray", "grpc", "fastapi", "httpx", "sklearn", "matplotlib.pyplot", "zarr",
    "flwr_datasets", "datasets", "pyarrow", "pandas", "rich",
)

# `python -X importtime -c "import M"` after the runs: (M, the kind of process that imports it)
LIGHT_LAUNCHER = "launcher, torch-free part"
IMPORT_COSTS = [("dpfl.runtime.launch", "launcher"),
                ("dpfl.cli, dpfl.config, dpfl.runtime.fab, dpfl.runlock, dpfl.errors, dpfl.logs, "
                 "flwr.cli.build", LIGHT_LAUNCHER),
                ("flwr.superlink.cli", "SuperLink"), ("flwr.cli.app", "flwr run"),
                ("flwr.simulation.app", "flwr-simulation"), ("dpfl.apps.server", "ServerApp"),
                ("dpfl.apps.client", "ClientApp"), ("opacus", "ClientApp's first training"),
                ("ray", "Ray's workers and helpers")]

# module -> [(attribute, label[, index of a positional argument to record[, record the
# result]])]: the first
# calls of each are timed in whichever process runs them (patched where they are defined,
# right after the module's import, so every `from ... import` binds the timed one)
CALLS: dict[str, list[tuple]] = {
    "dpfl.runtime.launch": [("_wait_http", "launcher.superlink_health_wait")],
    "dpfl.runtime.fab": [("stage_app", "launcher.stage_app")],
    "flwr.cli.build": [("build_fab_from_disk", "flwr-run.build_fab")],
    "flwr.cli.install": [("install_from_fab", "sim.install_fab")],
    "flwr.simulation.run_simulation": [("_run_simulation", "sim.run_simulation")],
    "flwr.server.run_serverapp": [("run", "sim.serverapp")],
    "flwr.server.superlink.fleet.vce.vce_api": [("start_vce", "sim.start_vce"),
                                                ("_register_nodes", "sim.register_nodes"),
                                                ("run_api", "sim.run_api")],
    "flwr.server.superlink.fleet.vce.backend.raybackend": [
        ("RayBackend.init_ray", "sim.ray_init"), ("RayBackend.build", "sim.actor_pool")],
    "flwr.clientapp.client_app": [("ClientApp.__call__", "actor.task")],
    "dpfl.methods": [("configured", "dpfl.configured"),
                     ("build_strategy", "dpfl.build_strategy")],
    "dpfl.privacy.accounting.calibration_cache": [("memoised", "dpfl.calibration"),
                                       ("lookup", "dpfl.calibration_lookup", None, True)],
    "dpfl.data.loaders": [("load_dataset", "data.load_dataset", 0),
                          ("check_dataset", "data.check_dataset", 0)],
    "dpfl.data.partition": [("partition_indices", "data.partition_indices")],
    "dpfl.data": [("_splits", "data.splits"), ("test_tensors", "data.test_tensors"),
                  ("client_data", "data.client_data", 1)],
    "dpfl.data.plots": [("plot_label_counts", "server.plot_labels")],
    "dpfl.server.evaluation": [("classification_metrics", "server.evaluate")],
    "dpfl.server.exchange": [("ReplyExchange.send_and_receive", "server.exchange", 2),
                             ("ReplyExchange._progress", "server.reply", 3)],
    "dpfl.apps.server": [("setup", "server.setup"), ("start_fresh", "server.start_fresh"),
                         ("wait_for_nodes", "server.wait_for_nodes"),
                         ("first_round_affordable", "server.first_round_affordable"),
                         ("run_round", "server.round", 1)],
    "dpfl.apps.client_handlers": [("_job", "client.job"), ("_model", "client.model"),
                                  ("warm", "client.warm")],
    "dpfl.client.budget": [("ClientBudget.refusal", "client.budget_check"),
                           ("ClientBudget.charge", "client.charge")],
    "dpfl.client.release": [("LocalRelease.planned_event", "client.plan"),
                            ("LocalRelease.release", "client.release")],
    "dpfl.client.local_training": [("train_dpsgd", "client.train_dpsgd")],
    "opacus.privacy_engine": [("PrivacyEngine.make_private", "client.make_private")],
}

PROBE_SOURCE = '''\
"""dpfl startup probe, written by bench/startup.py (not part of dpfl): in each Python process
started with this folder on PYTHONPATH and ${env} set, record wall-clock JSON lines in
$${env}/<pid>.jsonl: this point of the interpreter's start, the first import of IMPORTS, the
first calls of CALLS."""
import os as _os
import sys as _sys
import time as _time

_T_SITE = _time.time()
_DIR = _os.environ.get("${env}")
IMPORTS = frozenset(${imports})
CALLS = ${calls}
MAX_CALLS = 8
_fd = [None, None]
_done = set()
_after = {}


def emit(**record):
    """Append one event to this process's file (one write: whole lines, any thread)."""
    if not _DIR:
        return
    try:
        import json
        pid = _os.getpid()
        if _fd[1] != pid:
            _fd[0] = _os.open(_os.path.join(_DIR, "%d.jsonl" % pid),
                              _os.O_WRONLY | _os.O_CREAT | _os.O_APPEND, 0o644)
            _fd[1] = pid
        record["pid"] = pid
        _os.write(_fd[0], (json.dumps(record, default=str) + "\\n").encode())
    except Exception:
        pass


def _thread():
    threading = _sys.modules.get("threading")
    return threading.current_thread().name if threading else "MainThread"


def timed(fn, label, arg=None, ret=False):
    """``fn`` whose first MAX_CALLS calls are recorded (begin, end, thread, an argument, the
    result)."""
    if getattr(fn, "_startup_probe", False):
        return fn
    count = [0]

    def wrapper(*args, **kwargs):
        count[0] += 1
        if count[0] > MAX_CALLS:
            return fn(*args, **kwargs)
        t0, error, result = _time.time(), None, None
        try:
            result = fn(*args, **kwargs)
            return result
        except BaseException as exc:
            error = type(exc).__name__
            raise
        finally:
            record = {"ev": "call", "name": label, "t0": t0, "t1": _time.time(),
                      "n": count[0], "thread": _thread()}
            if arg is not None and len(args) > arg:
                record["arg"] = repr(args[arg])[:60]
            if ret:
                record["ret"] = repr(result)[:60]
            if error:
                record["error"] = error
            emit(**record)

    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        try:
            setattr(wrapper, name, getattr(fn, name))
        except (AttributeError, TypeError):
            pass
    wrapper.__wrapped__ = fn
    wrapper._startup_probe = True
    return wrapper


def after_import(name, callback):
    """Call ``callback(module)`` once ``name`` is imported (at once if it already is)."""
    if name in _sys.modules:
        callback(_sys.modules[name])
    else:
        _after.setdefault(name, []).append(callback)


def _patch(name, module):
    for spec in CALLS.get(name, ()):
        attr, label, arg, ret = (tuple(spec) + (None, False))[:4]
        try:
            owner, parts = module, attr.split(".")
            for part in parts[:-1]:
                owner = getattr(owner, part)
            setattr(owner, parts[-1], timed(getattr(owner, parts[-1]), label, arg, ret))
        except Exception as exc:
            emit(ev="patch-failed", name=label, error=repr(exc))
    for callback in _after.pop(name, ()):
        try:
            callback(module)
        except Exception as exc:
            emit(ev="patch-failed", name=name, error=repr(exc))


class _Loader:
    def __init__(self, loader, name):
        self._loader, self._name = loader, name

    def __getattr__(self, attr):
        return getattr(self._loader, attr)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:   # the module sees its own loader, as without the probe
            module.__loader__ = self._loader
            if module.__spec__ is not None:
                module.__spec__.loader = self._loader
        except Exception:
            pass
        t0 = _time.time()
        try:
            self._loader.exec_module(module)
        finally:
            if self._name in IMPORTS and self._name not in _done:
                emit(ev="import", name=self._name, t0=t0, t1=_time.time(), thread=_thread())
        if self._name not in _done:
            _done.add(self._name)
            _patch(self._name, module)


class _Finder:
    """First on sys.meta_path: for a watched module, the spec the other finders give, with
    its loader wrapped by a timer; None (the usual search) for every other module. (A
    find_spec without an import, e.g. Flower's check of an app reference, only wraps.)"""

    def find_spec(self, name, path=None, target=None):
        if name in _done or (name not in IMPORTS and name not in CALLS and name not in _after):
            return None
        try:
            for finder in _sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    if getattr(spec.loader, "exec_module", None) is not None:
                        spec.loader = _Loader(spec.loader, name)
                    return spec
        except Exception:
            return None
        return None


if _DIR:
    emit(ev="start", t=_T_SITE, argv=list(getattr(_sys, "orig_argv", _sys.argv)))
    _sys.meta_path.insert(0, _Finder())
'''


# --------------------------------------------------------------------------------------------
# The launcher process: `dpfl simulate` in-process, its phases timed
# --------------------------------------------------------------------------------------------

def launcher_main(argv: list[str]) -> int:
    """``bench/startup.py --launcher -- simulate ...``: `dpfl`'s own main, with
    dpfl.runtime.launch's SuperLink context (start to healthy, stop) and its Popen calls timed."""
    from dpfl.cli import main

    try:
        import sitecustomize as probe  # the probe above, first on PYTHONPATH
    except ImportError:
        probe = None
    if not hasattr(probe, "after_import"):   # --no-probe: dpfl as it is
        return main(argv)
    probe.emit(ev="mark", name="launcher.main", t=time.time())
    probe.after_import("dpfl.runtime.launch", lambda module: _patch_launch(module, probe))

    code = main(argv)
    probe.emit(ev="mark", name="launcher.exit", t=time.time(), code=code)
    return code


def _patch_launch(launch, probe) -> None:
    import contextlib
    import types

    superlink = launch.simulation_superlink

    @contextlib.contextmanager
    def simulation_superlink(flwr_home, env, **kwargs):
        t0 = time.time()
        with superlink(flwr_home, env, **kwargs) as address:
            probe.emit(ev="call", name="launcher.superlink_up", t0=t0, t1=time.time())
            try:
                yield address
            finally:
                probe.emit(ev="mark", name="launcher.federation_stop", t=time.time())
        probe.emit(ev="mark", name="launcher.federation_stopped", t=time.time())

    def popen(*args, **kwargs):
        t0 = time.time()
        proc = subprocess.Popen(*args, **kwargs)
        cmd = args[0] if args else kwargs.get("args")
        probe.emit(ev="popen", t0=t0, t1=time.time(), child=proc.pid,
                   argv=[str(a) for a in cmd][:6])
        return proc

    wrapped_subprocess = types.SimpleNamespace(**{k: getattr(subprocess, k)
                                                  for k in dir(subprocess)
                                                  if not k.startswith("__")})
    wrapped_subprocess.Popen = popen
    launch.simulation_superlink = simulation_superlink
    launch.subprocess = wrapped_subprocess

    class TimedChecks(launch.LaunchChecks):   # the checks' child: from its fork to its plan
        @classmethod
        def start(cls, *args, **kwargs):
            t0 = time.time()
            started = super().start(*args, **kwargs)
            started.t0 = t0
            return started

        def plan(self):
            plan = super().plan()
            probe.emit(ev="call", name="launcher.checks", t0=self.t0, t1=time.time())
            return plan

    launch.LaunchChecks = TimedChecks


# --------------------------------------------------------------------------------------------
# /proc: the launcher's process tree, its start times, titles and CPU
# --------------------------------------------------------------------------------------------

@dataclass
class Proc:
    pid: int
    ppid: int
    ticks: int                       # starttime in clock ticks since boot (identity)
    start: float                     # epoch seconds
    titles: list[tuple[float, str]] = field(default_factory=list)
    cpu: list[tuple[float, float]] = field(default_factory=list)
    last_seen: float = 0.0
    gone: bool = False
    role: str = ""

    def cpu_at(self, t: float) -> float:
        """CPU seconds used by time ``t`` (the last sample before it)."""
        used = 0.0
        for when, seconds in self.cpu:
            if when > t:
                break
            used = seconds
        return used

    def title_since(self, needle: str) -> float | None:
        return next((t for t, title in self.titles if needle in title), None)


class ProcessWatch:
    """Every process under ``root``, sampled every :data:`POLL_SECONDS`."""

    def __init__(self, root: int) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")
        self.boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
        self.root = root
        self.procs: dict[int, Proc] = {}
        self.others: dict[int, int] = {}
        self.machine: list[tuple[float, float]] = []   # (time, busy CPU seconds of all CPUs)

    def _stat(self, pid: int) -> tuple[int, int, float]:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        fields = text[text.rindex(")") + 2:].split()
        return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / self.tick

    @staticmethod
    def _cmdline(pid: int) -> str:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()

    def machine_busy(self) -> float:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        return (cpu[0] + cpu[1] + cpu[2] + sum(cpu[5:8])) / self.tick

    def poll(self) -> None:
        now = time.time()
        self.machine.append((now, self.machine_busy()))
        new = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in self.procs:
                continue
            pid = int(name)
            try:
                ppid, ticks, cpu = self._stat(pid)
            except (OSError, ValueError, IndexError):
                continue
            if self.others.get(pid) != ticks:
                new.append((pid, ppid, ticks, cpu))
        added = True
        while added:
            added = False
            for item in list(new):
                pid, ppid, ticks, cpu = item
                if pid == self.root or ppid in self.procs:
                    self.procs[pid] = Proc(pid, ppid, ticks, self.boot + ticks / self.tick)
                    new.remove(item)
                    added = True
        for pid, _, ticks, _ in new:
            self.others[pid] = ticks
        for proc in self.procs.values():
            if proc.gone:
                continue
            try:
                _, ticks, cpu = self._stat(proc.pid)
                title = self._cmdline(proc.pid)
            except (OSError, ValueError, IndexError):
                proc.gone = True
                continue
            if ticks != proc.ticks:
                proc.gone = True
                continue
            proc.cpu.append((now, cpu))
            proc.last_seen = now
            if title and (not proc.titles or proc.titles[-1][1] != title):
                proc.titles.append((now, title))


ZYGOTE = "dpfl.runtime.warm_clientapps --zygote"


def role_of(proc: Proc, launcher: int, procs: dict[int, Proc] | None = None) -> str:
    """What a process is, from its titles (a forked child's first title may still be its
    parent's command line: Ray's processes are matched on any title, first). The warm
    simulation path (dpfl.runtime.warm_clientapps): its SuperExec, its zygote, and flwr-simulation
    as the zygote's forked child (same title as its parent)."""
    if proc.pid == launcher:
        return "launcher"
    every = " ".join(title for _, title in proc.titles)
    last = proc.titles[-1][1] if proc.titles else ""
    ray_rules = (("gcs_server", "ray gcs_server"), ("raylet/raylet", "ray raylet"),
                 ("dashboard/dashboard.py", "ray dashboard"),
                 ("dashboard/agent.py", "ray dashboard agent"),
                 ("DashboardAgent", "ray dashboard agent"),
                 ("runtime_env/agent", "ray runtime-env agent"),
                 ("RuntimeEnvAgent", "ray runtime-env agent"),
                 ("log_monitor.py", "ray log monitor"),
                 ("autoscaler/_private/monitor.py", "ray autoscaler monitor"),
                 ("ClientAppActor", "ClientApp actor"),
                 ("default_worker.py", "ray worker, never an actor"),
                 ("ray::", "ray worker, never an actor"))
    for needle, role in ray_rules:
        if needle in every:
            return role
    if ZYGOTE in last:
        parent = (procs or {}).get(proc.ppid)
        parent_last = parent.titles[-1][1] if parent is not None and parent.titles else ""
        return "flwr-simulation" if ZYGOTE in parent_last else "simulation zygote"
    rules = (("dpfl.runtime.watchdog", "watchdog"), ("flower-superlink", "flower-superlink"),
             ("dpfl.runtime.warm_clientapps --warm", "flower-superexec"),
             ("flower-superexec", "flower-superexec"), ("flwr-simulation", "flwr-simulation"),
             ("/flwr run ", "flwr run"), ("dpfl.runtime.flwr_run run ", "flwr run"))
    for needle, role in rules:
        if needle in last:
            return role
    return "other: " + last[:40]


# --------------------------------------------------------------------------------------------
# One measured federation
# --------------------------------------------------------------------------------------------

SUPERLINK_LINE = re.compile(r"^(\w+) flwr (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \| [^|]*\| (.*)$")


@dataclass
class Run:
    index: int
    folder: Path
    code: int = 0
    t0: float = 0.0                                   # the launcher's process start
    procs: dict[int, Proc] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    superlink_log: list[tuple[float, str]] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)
    load_before: str = ""
    load_after: str = ""
    others_cpu: float = 0.0                           # CPU seconds of other jobs during the run
    wall: float = 0.0

    # ---- queries
    def role(self, pid: int) -> str:
        proc = self.procs.get(pid)
        if proc is not None:
            return proc.role
        start = next((e for e in self.events if e["pid"] == pid and e["ev"] == "start"), None)
        return "unseen: " + " ".join(start["argv"][:3]) if start else "unseen"

    def calls(self, name: str, role: str | None = None, pid: int | None = None) -> list[dict]:
        return sorted((e for e in self.events if e["ev"] == "call" and e["name"] == name
                       and (role is None or self.role(e["pid"]) == role)
                       and (pid is None or e["pid"] == pid)), key=lambda e: e["t0"])

    def call(self, name: str, role: str | None = None, pid: int | None = None) -> dict | None:
        found = self.calls(name, role, pid)
        return found[0] if found else None

    def imported(self, name: str, role: str | None = None, pid: int | None = None
                 ) -> dict | None:
        found = sorted((e for e in self.events if e["ev"] == "import" and e["name"] == name
                        and (role is None or self.role(e["pid"]) == role)
                        and (pid is None or e["pid"] == pid)), key=lambda e: e["t0"])
        return found[0] if found else None

    def mark(self, name: str) -> float | None:
        return next((e["t"] for e in self.events if e["ev"] == "mark" and e["name"] == name),
                    None)

    def log_time(self, text: str) -> float | None:
        return next((t for t, line in self.superlink_log if text in line), None)

    def of_role(self, role: str) -> list[Proc]:
        return sorted((p for p in self.procs.values() if p.role == role), key=lambda p: p.start)

    def rel(self, t: float | None) -> float | None:
        return None if t is None else t - self.t0

    # ---- key times (epoch), None when not measured
    @property
    def round1(self) -> float | None:
        call = self.call("server.round")
        if call is not None:
            return call["t0"]
        return self.rounds[0]["started"] if self.rounds else None

    @property
    def exchange(self) -> dict | None:
        return self.call("server.exchange")

    @property
    def first_reply(self) -> float | None:
        reply = self.call("server.reply")
        return reply["t0"] if reply else None


def measure(index: int, work: Path, simulate_args: list[str], extra_env: dict[str, str],
            timeout: float, probe: bool = True) -> Run:
    """Run the launcher under the probe (unless not ``probe``) and the /proc watch; collect
    every source."""
    folder = work / f"run-{index}"
    events_dir, probe_dir = folder / "events", folder / "probe"
    for path in (events_dir, probe_dir):
        path.mkdir(parents=True)
    calls = {module: [tuple(spec) for spec in specs] for module, specs in CALLS.items()}
    source = (PROBE_SOURCE.replace("${imports}", repr(sorted(IMPORTS)))
              .replace("${calls}", repr(calls)).replace("${env}", PROBE_ENV))
    (probe_dir / "sitecustomize.py").write_text(source)
    env = dict(os.environ)
    env.update(extra_env)
    if probe:
        env[PROBE_ENV] = str(events_dir)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe_dir), env.get("PYTHONPATH"))
                                            if p)
    runs_dir = folder / "runs"
    argv = [*simulate_args, "--output-dir", str(runs_dir)]
    run = Run(index, folder)
    run.load_before = Path("/proc/loadavg").read_text().strip()
    with open(folder / "launcher.out", "wb") as out, open(folder / "launcher.err", "wb") as err:
        started, own = time.time(), time.process_time()
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--launcher",
                                  "--", *argv], env=env, stdout=out, stderr=err, cwd=str(ROOT))
        watch = ProcessWatch(child.pid)
        try:
            while child.poll() is None:
                watch.poll()
                if time.time() - started > timeout:
                    child.send_signal(signal.SIGTERM)
                    child.wait(timeout=60)
                    break
                time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:
            child.send_signal(signal.SIGTERM)
            child.wait(timeout=60)
            raise
        watch.poll()
    run.code = child.returncode
    run.wall = time.time() - started
    run.load_after = Path("/proc/loadavg").read_text().strip()
    run.procs = watch.procs
    for proc in run.procs.values():
        proc.role = role_of(proc, child.pid, run.procs)
    run.t0 = run.procs[child.pid].start if child.pid in run.procs else started
    ours = sum(p.cpu[-1][1] for p in run.procs.values() if p.cpu)
    ours += time.process_time() - own   # this process's polling
    if len(watch.machine) >= 2:
        run.others_cpu = max(0.0, watch.machine[-1][1] - watch.machine[0][1] - ours)
    for path in sorted(events_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                run.events.append(json.loads(line))
            except ValueError:
                continue
    run_dirs = [p for p in runs_dir.iterdir() if p.is_dir()] if runs_dir.is_dir() else []
    if run_dirs:
        log = run_dirs[0] / ".flwr" / "superlink.log"
        if log.exists():
            for line in log.read_text(errors="replace").splitlines():
                m = SUPERLINK_LINE.match(line)
                if m:
                    stamp = datetime.strptime(m.group(2), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    run.superlink_log.append((stamp, m.group(3)))
        rounds = run_dirs[0] / "rounds.jsonl"
        if rounds.exists():
            run.rounds = [json.loads(x) for x in rounds.read_text().splitlines() if x.strip()]
    snapshot = {"code": run.code, "t0": run.t0, "events": run.events,
                "superlink_log": run.superlink_log, "rounds": run.rounds,
                "procs": [vars(p) for p in run.procs.values()]}
    (folder / "measurement.json").write_text(json.dumps(snapshot, default=str))
    return run


# --------------------------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------------------------

def _span(e: dict | None) -> tuple[float, float] | None:
    return None if e is None else (e["t0"], e["t1"])


def _dur(e: dict | None) -> float | None:
    return None if e is None else e["t1"] - e["t0"]


def task_partition(run: Run, task: dict) -> str:
    """The partition a ClientApp task trained (its client_data call's argument)."""
    data = next((e for e in run.calls("data.client_data", pid=task["pid"])
                 if task["t0"] <= e["t0"] <= task["t1"]), None)
    return data.get("arg", "?") if data else "?"


def first_actor(run: Run) -> tuple[int | None, dict | None]:
    """The actor whose ClientApp task ended first, and that task."""
    tasks = run.calls("actor.task")
    if not tasks:
        return None, None
    first = min(tasks, key=lambda e: e["t1"])
    return first["pid"], first


def task_received(run: Run, pid: int) -> float | None:
    """When Ray started the actor's first task (the worker renames itself
    ``ray::ClientAppActor.run``; 0.1 s polls)."""
    proc = run.procs.get(pid)
    return proc.title_since("ClientAppActor.run") if proc else None


def timeline(run: Run) -> list[tuple[float, float | None, str, str]]:
    """(end time, duration or None, milestone, what it waits on), in time order."""
    rows: list[tuple[float, float | None, str, str]] = []

    def point(t: float | None, label: str, waits: str) -> None:
        if t is not None:
            rows.append((t, None, label, waits))

    def span(e: dict | None, label: str, waits: str) -> None:
        if e is not None:
            rows.append((e["t1"], e["t1"] - e["t0"], label, waits))

    sim, launcher = "flwr-simulation", "launcher"
    point(run.t0, "launcher process starts (`dpfl simulate`)", "-")
    point(run.mark("launcher.main"), "launcher: Python up, dpfl.cli main() called",
          "interpreter start, site, the bench's module (stdlib only)")
    span(run.imported("dpfl.runtime.launch", launcher), "launcher: dpfl.runtime.launch imported",
         "the CLI's and the launcher's light modules (Flower's CLI parts, no torch: the "
         "checks run in a forked child)")
    span(run.call("launcher.checks"), "launcher: launch checked (forked child)",
         "the child imports the method registry, the dataset catalogue, the ledger reader "
         "(torch, Flower, dp-accounting), parses the run-config, checks the dataset and run dir")
    span(run.call("launcher.stage_app"), "launcher: app staged (FAB files copied)",
         "walks dpfl/ and copies the FAB's files into <run>/.flwr/app")
    for p in run.of_role("flower-superlink")[:1]:
        point(p.start, "flower-superlink process starts", "watchdog Popen, then its exec")
    point(run.log_time("Starting Flower SuperLink"),
          "SuperLink logs 'Starting Flower SuperLink'",
          "flower-superlink's imports (Flower, FastAPI, gRPC)")
    for p in run.of_role("flower-superexec")[:1]:
        point(p.start, "flower-superexec process starts (beside)",
              "spawned by the SuperLink at its start")
    span(run.call("launcher.superlink_up"), "launcher: SuperLink /health answers",
         "the SuperLink's HTTP server; the launcher polls /health every 0.3 s")
    flwr_run = run.of_role("flwr run")[:1]
    for p in flwr_run:
        point(p.start, "flwr run process starts",
              "Popen beside the SuperLink's (dpfl.runtime.flwr_run: it imports, then waits "
              "for the launcher's go once the SuperLink answers)")
        span(run.imported("flwr.cli.app", pid=p.pid), "flwr run: its CLI imported",
             "flwr run's imports (typer, Flower CLI)")
    span(run.call("flwr-run.build_fab"), "flwr run: FAB built",
         "zips the staged app (hashes every file)")
    point(run.log_time("ControlServicer.StartRun"), "SuperLink: StartRun received",
          "flwr run's FAB upload")
    for p in run.of_role(sim)[:1]:
        point(p.start, "flwr-simulation process starts",
              "the SuperExec's task poll (every 1 s: FLWR_SUPEREXEC_TASK_POLL_INTERVAL)")
    span(run.imported("flwr.simulation.app", sim), "flwr-simulation: its module imported",
         "Flower's simulation imports (httpx, gRPC, protobuf)")
    point(run.log_time("Started task"), "SuperLink: 'Started task' (simulation has its input)",
          "flwr-simulation's imports, then PullTaskInput")
    span(run.call("sim.install_fab", sim), "flwr-simulation: FAB installed",
         "unzips the FAB into $FLWR_HOME/apps")
    span(run.call("sim.register_nodes", sim), "flwr-simulation: SuperNodes registered",
         "in-memory link state (from here the ServerApp sees its nodes)")
    span(run.imported("dpfl.apps.server", sim),
         "ServerApp thread: dpfl.apps.server imported",
         "torch, dp-accounting, dpfl; in the same process as the ClientApp test-load")
    span(run.imported("dpfl.apps.client", sim),
         "flwr-simulation: ClientApp test-loaded (import dpfl.apps.client)",
         "Flower loads the ClientApp in the main thread before it starts Ray; the import "
         "lock and the GIL are shared with the ServerApp thread's imports")
    span(run.call("sim.ray_init", sim), "flwr-simulation: ray.init() returned",
         "gcs_server, raylet, dashboard, agents, monitors (Python processes importing ray)")
    for role in ("ray gcs_server", "ray autoscaler monitor", "ray dashboard",
                 "ray log monitor", "ray raylet", "ray dashboard agent", "ray runtime-env agent"):
        for p in run.of_role(role)[:1]:
            point(p.start, f"{role} process starts", "ray.init()")
    span(run.call("sim.actor_pool", sim), "flwr-simulation: actor pool requested",
         "Ray actor creation requests (asynchronous)")
    idle = run.of_role("ray worker, never an actor")
    if idle:
        point(idle[0].start, f"{len(idle)} Ray worker(s) prestarted, never used as actors",
              "the raylet prestarts workers for the first driver; the actors' runtime_env "
              "(Flower's PYTHONPATH) differs, so other workers are started for them")
    actors = run.of_role("ClientApp actor")
    if actors:
        point(actors[0].start, f"first ClientApp actor process starts ({len(actors)} in all)",
              "a worker with the job's runtime_env: Ray's setup_worker.py imports ray, then "
              "execs default_worker.py, which imports ray again")
        idle_at = [t for t in (p.title_since("ray::IDLE") for p in actors) if t is not None]
        if idle_at:
            point(min(idle_at), "first actor worker registered (ray::IDLE)",
                  "the worker's imports (ray)")
    span(run.call("dpfl.configured", sim), "ServerApp: config resolved (configured)",
         "dpfl's method registry")
    span(run.call("data.load_dataset", sim), "ServerApp: dataset loaded",
         "reads and decodes the MNIST archive (zarr/Blosc)")
    span(run.call("data.test_tensors", sim), "ServerApp: test set as tensors",
         "normalises 10k test images")
    span(run.call("server.wait_for_nodes", sim), "ServerApp: nodes connected",
         "the simulation's node registration (already done)")
    span(run.call("data.splits", sim), "ServerApp: partitions",
         "the partition memo (checked against flwr-datasets' partitioner) or the partitioner")
    span(run.call("dpfl.calibration", sim), "ServerApp: sigma calibrated (memo checked)",
         "PLD accountant: a memo hit is checked with two evaluations, a miss is a bisection")
    span(run.call("server.first_round_affordable", sim), "ServerApp: first round fits",
         "the calibration above, then one accountant evaluation per client")
    span(run.call("server.plot_labels", sim), "ServerApp: labels.png written",
         "matplotlib import and render")
    span(run.call("server.setup", sim), "ServerApp: setup() returns",
         "all of the ServerApp steps above")
    span(run.call("server.evaluate", sim), "ServerApp: initial model evaluated",
         "a forward pass over 10k test images")
    span(run.call("server.start_fresh", sim), "ServerApp: round 0 done",
         "config, ledger, rounds files, the evaluation above, checkpoint")
    point(run.round1, "ROUND 1 STARTS", "the ServerApp chain above")
    if run.exchange:
        point(run.exchange["t0"], "round 1: instructions pushed (exchange starts)",
              "configure_train (plans, per-client config)")
    received = [t for t in (task_received(run, p.pid) for p in actors) if t is not None]
    if received:
        point(min(received), "first task reaches an actor (ray::ClientAppActor.run)",
              "the actor's creation (imports flwr), Ray's delivery")
    tasks = run.calls("actor.task")
    if tasks:
        point(tasks[0]["t0"], "first ClientApp call starts",
              "unpickling the message imports torch, dp-accounting, dpfl.apps.client")
    point(run.first_reply, "FIRST REPLY received by the ServerApp", "see the breakdown below")
    replies = run.calls("server.reply")
    if replies:
        point(replies[-1]["t0"], f"last reply received ({len(replies)})",
              "each actor trains a second client")
    round1 = run.call("server.round")
    if round1:
        point(round1["t1"], "round 1 ends", "aggregation, ledger, evaluation, checkpoint")
    point(run.mark("launcher.federation_stop"), "launcher: federation stop begins",
          "the ServerApp's finish (summary, plots), flwr run's exit")
    point(run.mark("launcher.exit"), "launcher exits", "SuperLink, Ray stopped")
    return sorted(rows, key=lambda r: r[0])


def first_reply_rows(run: Run) -> list[tuple[float, float | None, str]]:
    """The timeline of the actor whose task ended first: (time, duration, what)."""
    pid, first = first_actor(run)
    if pid is None or first is None:
        return []
    rows: list[tuple[float, float | None, str]] = []

    def span(e: dict | None, label: str) -> None:
        if e is not None:
            rows.append((e["t0"], e["t1"] - e["t0"], label))

    proc = run.procs.get(pid)
    if proc is not None:
        rows.append((proc.start, None, f"actor process starts (pid {pid})"))
        for needle, what in (("ray::IDLE", "worker registered with the raylet (ray::IDLE)"),
                             ("ClientAppActor.run", "task received (ray::ClientAppActor.run)")):
            t = proc.title_since(needle)
            if t is not None:
                rows.append((t, None, what))
    own = sorted((e for e in run.events if e["pid"] == pid), key=lambda e: e.get("t", 0.0))
    for e in (e for e in own if e["ev"] == "start"):
        script = next((Path(a).name for a in e["argv"] if a.endswith(".py")), "?")
        rows.append((e["t"], None, f"Python up ({script})"))
    for e in (e for e in own if e["ev"] == "import" and e["name"] == "ray"):
        span(e, "import ray")
    span(run.imported("flwr", pid=pid), "import flwr (the actor class)")
    for name in ("torch", "dp_accounting", "dpfl.apps.client", "dpfl.apps.client_handlers"):
        span(run.imported(name, pid=pid), f"import {name} (unpickling the message)")
    span(first, f"ClientApp call (partition {task_partition(run, first)})")
    span(run.call("client.warm", pid=pid), "  warm-up (query.warm): imports, data, sigma")
    span(run.call("client.job", pid=pid), "  job: config, data, model, hooks")
    span(run.call("data.client_data", pid=pid), "    client data")
    span(run.call("data.load_dataset", pid=pid), "      load_dataset (MNIST archive)")
    span(run.call("data.splits", pid=pid), "      partitions (memo)")
    span(run.call("client.model", pid=pid), "    model build + received weights")
    span(run.call("client.plan", pid=pid), "  planned privacy event")
    span(run.call("dpfl.calibration", pid=pid), "    sigma: calibration memo checked")
    span(run.call("client.budget_check", pid=pid), "  budget check (accountant)")
    span(run.call("client.train_dpsgd", pid=pid), "  DP-SGD training (one local epoch)")
    span(run.imported("opacus", pid=pid), "    import opacus")
    span(run.imported("torch._dynamo", pid=pid), "    import torch._dynamo (first optimizer)")
    span(run.call("client.make_private", pid=pid), "    Opacus make_private")
    span(run.call("client.release", pid=pid), "  release")
    span(run.call("client.charge", pid=pid), "  charge (accountant)")
    if run.first_reply is not None:
        rows.append((run.first_reply, None, "the ServerApp reads the reply (0.25 s poll)"))
    return sorted(rows, key=lambda r: r[0])


def cpu_by_role(run: Run, until: float | None) -> dict[str, float]:
    totals: dict[str, float] = {}
    if until is None:
        return totals
    for p in run.procs.values():
        totals[p.role] = totals.get(p.role, 0.0) + p.cpu_at(until)
    return totals


def key_intervals(run: Run) -> dict[str, float]:
    """Measured intervals (seconds) that the candidate fixes act on."""
    out: dict[str, float] = {}

    def put(name: str, value: float | None) -> None:
        if value is not None:
            out[name] = value

    sim = "flwr-simulation"
    put("launch -> round 1 starts", run.rel(run.round1))
    put("launch -> first reply", run.rel(run.first_reply))
    if run.exchange and run.first_reply:
        put("exchange -> first reply", run.first_reply - run.exchange["t0"])
    put("launcher: import dpfl.runtime.launch",
        _dur(run.imported("dpfl.runtime.launch", "launcher")))
    put("launcher: checks (forked)", _dur(run.call("launcher.checks")))
    put("launcher: stage_app", _dur(run.call("launcher.stage_app")))
    put("launcher: SuperLink start -> health", _dur(run.call("launcher.superlink_up")))
    flwr_run = run.of_role("flwr run")
    start_run = run.log_time("ControlServicer.StartRun")
    if flwr_run and start_run:
        put("flwr run: start -> StartRun", start_run - flwr_run[0].start)
        put("flwr run: imports", _dur(run.imported("flwr.cli.app", pid=flwr_run[0].pid)))
    sims = run.of_role(sim)
    if sims and start_run:
        put("StartRun -> flwr-simulation starts", sims[0].start - start_run)
    started_task = run.log_time("Started task")
    if sims and started_task:
        put("flwr-simulation: start -> Started task", started_task - sims[0].start)
    ray_init = run.call("sim.ray_init", sim)
    if started_task and ray_init:
        put("sim: Started task -> ray.init starts", ray_init["t0"] - started_task)
    put("sim: ClientApp test-load import", _dur(run.imported("dpfl.apps.client", sim)))
    put("sim: ServerApp import", _dur(run.imported("dpfl.apps.server", sim)))
    put("sim: ray.init", _dur(ray_init))
    serverapp, setup = run.call("sim.serverapp", sim), run.call("server.setup", sim)
    if serverapp and setup:
        put("server: thread start -> setup", setup["t0"] - serverapp["t0"])
    put("server: setup", _dur(setup))
    put("server: load_dataset", _dur(run.call("data.load_dataset", sim)))
    put("server: partitions", _dur(run.call("data.splits", sim)))
    put("server: calibration (memo)", _dur(run.call("dpfl.calibration", sim)))
    put("server: first_round_affordable", _dur(run.call("server.first_round_affordable", sim)))
    put("server: plot labels", _dur(run.call("server.plot_labels", sim)))
    put("server: start_fresh", _dur(run.call("server.start_fresh", sim)))
    put("server: initial evaluation", _dur(run.call("server.evaluate", sim)))
    pid, task = first_actor(run)
    proc = run.procs.get(pid) if pid is not None else None
    if pid is not None and task is not None:
        received = task_received(run, pid)
        if proc and received:
            put("actor: process start -> task received", received - proc.start)
        if received:
            put("actor: task received -> ClientApp call", task["t0"] - received)
        if received and run.exchange:
            put("exchange -> first task received", received - run.exchange["t0"])
        rays = [e for e in run.events if e["pid"] == pid and e["ev"] == "import"
                and e["name"] == "ray"]
        if len(rays) > 1:
            put("actor: setup_worker.py import ray", _dur(rays[0]))
        put("actor: ClientApp call", _dur(task))
        put("actor: client data", _dur(run.call("data.client_data", pid=pid)))
        put("actor: load_dataset", _dur(run.call("data.load_dataset", pid=pid)))
        put("actor: calibration memo check", _dur(run.call("dpfl.calibration", pid=pid)))
        train = run.call("client.train_dpsgd", pid=pid)
        put("actor: train_dpsgd", _dur(train))
        opacus = _dur(run.imported("opacus", pid=pid)) or 0.0
        dynamo = _dur(run.imported("torch._dynamo", pid=pid)) or 0.0
        put("actor: import opacus", opacus)
        put("actor: import torch._dynamo", dynamo)
        if train:
            put("actor: training loop (train_dpsgd less imports)",
                _dur(train) - opacus - dynamo)  # type: ignore[operator]
        put("actor: charge", _dur(run.call("client.charge", pid=pid)))
    ready = [e["t1"] for p in run.of_role("ClientApp actor")
             for e in [run.imported("flwr", pid=p.pid)] if e is not None]
    if ready and run.round1:
        put("actor ready (class loaded) - round 1 starts", min(ready) - run.round1)
    helpers = [p for p in run.procs.values() if p.role.startswith("ray ")
               and p.role not in ("ray gcs_server", "ray raylet")]
    if run.first_reply:
        put("Ray helpers: CPU by the first reply", sum(p.cpu_at(run.first_reply)
                                                       for p in helpers))
    idle = run.of_role("ray worker, never an actor")
    put("unused Ray workers: CPU", sum(p.cpu[-1][1] for p in idle if p.cpu))
    return out


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------

def fmt(x: float | None, width: int = 6) -> str:
    return " " * (width - 1) + "-" if x is None else f"{x:{width}.2f}"


def print_run(run: Run) -> None:
    print(f"\n=== run {run.index}: exit {run.code}, wall {run.wall:.1f} s; load average before "
          f"[{run.load_before}] after [{run.load_after}]; other jobs' CPU during the run "
          f"{run.others_cpu:.1f} s (of 2 x {run.wall:.0f} s)")
    if run.code != 0:
        print(f"    the launcher failed: see {run.folder}/launcher.err")
    for e in (e for e in run.events if e["ev"] == "patch-failed"):
        print(f"    the probe could not wrap {e['name']}: {e['error']}")
    print(f"\n{'s':>6} {'dur':>6}  milestone  |  what it waits on")
    for t, d, label, waits in timeline(run):
        marker = ">>" if label.startswith(("ROUND", "FIRST")) else "  "
        print(f"{fmt(run.rel(t))} {fmt(d)}{marker}{label}  |  {waits}")
    if run.rounds:
        r = run.rounds[0]
        print(f"\nrounds.jsonl, round 1: started at {fmt(run.rel(r['started'])).strip()} s, "
              f"{r['seconds']:.2f} s, phase-seconds {r['phase-seconds']}")
    rows, ex = first_reply_rows(run), run.exchange
    if rows and ex:
        print(f"\nthe first reply (s since launch, s since the exchange started at "
              f"{fmt(run.rel(ex['t0'])).strip()} s, duration):")
        for t, d, label in rows:
            print(f"{fmt(run.rel(t))} {fmt(t - ex['t0'])} {fmt(d)}  {label}")
        print("every ClientApp call of round 1 (s since the exchange started):")
        for task in run.calls("actor.task"):
            print(f"    partition {task_partition(run, task)} on actor {task['pid']}: "
                  f"{task['t0'] - ex['t0']:6.2f} -> {task['t1'] - ex['t0']:6.2f} "
                  f"({task['t1'] - task['t0']:.2f} s)")
    print("\nprocesses: s since launch (start -> last seen), role, CPU s used by round 1's "
          "start / by the first reply / in all")
    for p in sorted(run.procs.values(), key=lambda p: p.start):
        if p.role.startswith("other") and (not p.cpu or p.cpu[-1][1] < 0.05):
            continue   # shell helpers (e.g. Ray's GPU probes)
        total = p.cpu[-1][1] if p.cpu else 0.0
        print(f"  {fmt(run.rel(p.start))} -> {fmt(run.rel(p.last_seen))}  {p.role:<27} "
              f"{p.pid:<7} {fmt(p.cpu_at(run.round1 or 0), 5)} "
              f"{fmt(p.cpu_at(run.first_reply or 0), 5)} {fmt(total, 5)}")
    for label, until in (("round 1's start", run.round1), ("the first reply", run.first_reply)):
        by_role = cpu_by_role(run, until)
        if by_role and until:
            span = until - run.t0
            top = sorted(by_role.items(), key=lambda kv: -kv[1])
            print(f"  CPU used by {label} ({span:.1f} s, 2 cores: {2 * span:.0f} CPU s): "
                  f"{sum(by_role.values()):.1f} s: " +
                  ", ".join(f"{role} {cpu:.1f}" for role, cpu in top if cpu >= 0.05))


def print_comparison(runs: list[Run]) -> dict[str, float]:
    """Key intervals of every run side by side; returns their means."""
    table = [key_intervals(r) for r in runs]
    names = list(dict.fromkeys(k for t in table for k in t))
    print("\n=== key intervals (s)" + " " * 26 +
          "".join(f"{'run ' + str(r.index):>8}" for r in runs) + f"{'mean':>8}")
    means = {}
    for name in names:
        values = [t.get(name) for t in table]
        known = [v for v in values if v is not None]
        means[name] = statistics.mean(known) if known else 0.0
        print(f"  {name:<45}" + "".join(f"{v:8.2f}" if v is not None else f"{'-':>8}"
                                        for v in values) + f"{means[name]:8.2f}")
    return means


def import_costs(modules: list[tuple[str, str]]) -> dict[str, float]:
    """``python -X importtime -c 'import M'`` per kind of process: its wall time, and the
    packages that take most import time (each package's modules' own times summed).
    Returns the wall times by kind of process."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", PROBE_ENV)}
    print("\n=== import cost of each process's top module (python -X importtime, one fresh "
          "interpreter each; s of import time by package, its modules' own time summed)")
    walls = {}
    for module, who in modules:
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                              capture_output=True, text=True, env=env, cwd="/tmp")
        wall = time.time() - t0
        tops: dict[str, int] = {}   # package -> its modules' own import time (us)
        for line in proc.stderr.splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| \s*(\S+)", line)
            if m:
                name = m.group(3).split(".")[0]
                tops[name] = tops.get(name, 0) + int(m.group(1))
        total = sum(tops.values()) / 1e6
        top = sorted(tops.items(), key=lambda kv: -kv[1])[:7]
        walls[who] = wall
        print(f"  {who}: import {module}\n      wall {wall:5.2f} s, imports {total:5.2f} s: " +
              ", ".join(f"{name} {us / 1e6:.2f}" for name, us in top))
    return walls


def candidates(m: dict[str, float], walls: dict[str, float]
               ) -> tuple[list[tuple[float, str, str, str]], list[tuple[float, str, str, str]]]:
    """Two ranked lists of (estimated saving s, the cost, a fix, how the saving is
    estimated) from the mean intervals (and the import walls): what would move round 1's
    start, and what would shorten round 1's exchange up to its first reply."""
    def g(name: str) -> float:
        return m.get(name, 0.0)

    start: list[tuple[float, str, str, str]] = []
    exchange: list[tuple[float, str, str, str]] = []

    def add(to: list, saving: float, cost: str, fix: str, basis: str) -> None:
        to.append((max(0.0, saving), cost, fix, basis))

    imports = g("launcher: import dpfl.runtime.launch") + g("launcher: checks (forked)")
    light = walls.get(LIGHT_LAUNCHER)
    overlap = min(imports, g("launcher: SuperLink start -> health"))
    add(start, max(overlap, imports - light) if light is not None else overlap,
        f"the launcher's checks (a forked child importing torch, Flower and dp-accounting: "
        f"the method registry, the dataset catalogue, the ledger reader) end before it "
        f"starts anything ({imports:.1f} s with the launcher's own import)",
        "a torch-free path to the SuperLink: the method registry's parsing and the run "
        "folder's checks without torch, or start the SuperLink first and check while it "
        "starts (stopping it and removing what it wrote if the checks refuse)",
        "the larger of: launcher import + checks less the torch-free modules' import "
        f"({'-' if light is None else f'{light:.1f} s'}, measured below), and min(launcher "
        "import + checks, SuperLink start -> health) by overlapping")
    add(start,
        g("flwr run: start -> StartRun") - g("launcher: SuperLink start -> health") - 0.3,
        f"`flwr run` is a subprocess: interpreter, Flower CLI imports (beside the SuperLink's "
        f"start), FAB build, upload ({g('flwr run: start -> StartRun'):.1f} s)",
        "start the run from the launcher in-process (Flower's flwr.cli.run API over the "
        "launcher's already imported Flower), keeping the stream relay",
        "flwr run start -> StartRun, less ~0.3 s of CLI imports the launcher lacks")
    add(start, g("flwr-simulation: start -> Started task") + g("server: thread start -> setup")
        - 0.5,
        f"flwr-simulation imports Flower ({g('flwr-simulation: start -> Started task'):.1f} s),"
        f" then its ServerApp thread imports torch, dp-accounting, dpfl "
        f"({g('server: thread start -> setup'):.1f} s) after the task is handed over",
        "a warm SuperExec for the simulation task, as dpfl.runtime.warm_clientapps does for "
        "ClientApps: a zygote started with the SuperLink imports these while flwr run "
        "builds the FAB, and flwr-simulation is forked from it",
        "flwr-simulation start -> Started task + ServerApp import, less ~0.5 s of fork and "
        "dpfl's own modules")
    add(start, g("server: calibration (memo)") / 2,
        f"the ServerApp checks the calibration memo's sigma with two PLD evaluations "
        f"({g('server: calibration (memo)'):.1f} s), on the way to round 1",
        "run the check in a thread from the ServerApp's start (it needs the config and the "
        "partition sizes only), or check privacy (eps(sigma) <= target, one evaluation) on "
        "the way and minimality after round 1",
        "half its duration (one evaluation of two); all of it if it overlaps")
    add(start, g("server: plot labels"),
        f"labels.png (imports matplotlib, renders) before round 1 "
        f"({g('server: plot labels'):.1f} s)",
        "draw it after the last round with the other plots (or in a thread)",
        "its measured duration")
    add(start, g("server: initial evaluation"),
        f"round 0: the initial model's evaluation on 10k test images "
        f"({g('server: initial evaluation'):.1f} s)",
        "evaluate the initial model while round 1 trains (the server waits for replies "
        "anyway) and write its line when it is done",
        "its measured duration")
    add(start, g("StartRun -> flwr-simulation starts") - 0.1,
        f"the SuperExec polls for tasks every 1 s "
        f"({g('StartRun -> flwr-simulation starts'):.2f} s here; 0.5 s on average)",
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1 in dpfl.runtime.launch.flower_env",
        "StartRun -> flwr-simulation start, less a 0.1 s poll")
    add(start, g("server: load_dataset") - 0.05,
        f"the ServerApp decodes the MNIST archive ({g('server: load_dataset'):.2f} s; every "
        f"actor does it again: {g('actor: load_dataset'):.2f} s)",
        "keep the decoded arrays in dpfl's memo (.npy) and memory-map them",
        "load_dataset less ~0.05 s for a memory map")

    cold = g("actor: task received -> ClientApp call") + g("actor: import opacus") + \
        g("actor: import torch._dynamo")
    add(exchange, cold,
        f"each actor imports torch, dp-accounting and dpfl when round 1's message arrives "
        f"({g('actor: task received -> ClientApp call'):.1f} s), then Opacus and "
        f"torch._dynamo when it first trains ({g('actor: import opacus'):.1f} + "
        f"{g('actor: import torch._dynamo'):.1f} s)",
        "warm the actors before round 1: right after wait_for_nodes the ServerApp sends every "
        "node a no-op message whose handler imports these, loads the node's data and checks "
        "its sigma (or the ClientApp imports them when its actor starts)",
        "these imports, when the actors are ready before round 1 (see 'actor ready')")
    add(exchange, g("actor: calibration memo check"),
        f"each actor checks the calibration memo's sigma with two PLD evaluations "
        f"({g('actor: calibration memo check'):.1f} s) before it trains",
        "in the warm-up above (round 1's sigma depends on the config only), or one "
        "evaluation (privacy) in the ClientApp",
        "its measured duration")
    add(exchange, g("actor: client data"),
        f"each actor loads and partitions its data in its first call "
        f"({g('actor: client data'):.2f} s)",
        "in the warm-up above; the .npy memo makes it cheaper still", "its measured duration")
    add(exchange, g("sim: Started task -> ray.init starts") - 0.3,
        f"ray.init starts {g('sim: Started task -> ray.init starts'):.1f} s after the "
        f"simulation has its task: Flower's ClientApp test-load in the main thread waits for "
        f"the ServerApp thread's imports (torch, dp-accounting) that dpfl.apps.client needs too",
        "import torch, Opacus, dp-accounting and dpfl.client.* inside the ClientApp's "
        "handlers (dpfl.apps.client light at module level): Ray starts beside the ServerApp's "
        "imports; on the first reply's path only when Ray's chain is the later one",
        "Started task -> ray.init starts, less ~0.3 s of FAB install and Flower's checks")
    add(exchange, g("actor: setup_worker.py import ray"),
        f"every actor worker is started through Ray's runtime-env setup_worker.py, which "
        f"imports ray ({g('actor: setup_worker.py import ray'):.1f} s) and then execs "
        f"default_worker.py, which imports it again; 2 prestarted workers are never used "
        f"({g('unused Ray workers: CPU'):.1f} CPU s); Ray's helpers take "
        f"{g('Ray helpers: CPU by the first reply'):.1f} CPU s",
        "no runtime_env for the actors (Flower passes one only to carry PYTHONPATH, which "
        "the environment already carries), RAY_prestart_worker_first_driver=0: on the first "
        "reply's path only when Ray's chain is the later one ('actor ready ...' above > 0)",
        "setup_worker.py's import of ray, per actor")
    return (sorted(start, key=lambda c: -c[0]), sorted(exchange, key=lambda c: -c[0]))


def main() -> int:
    if "--launcher" in sys.argv[1:2]:
        argv = sys.argv[2:]
        return launcher_main(argv[1:] if argv[:1] == ["--"] else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="federations to measure")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--train-subset", type=int, default=0,
                        help="run-config train-subset (0: the demo's full MNIST)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the launcher and its processes")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds to wait between runs (default 10)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--no-importtime", action="store_true")
    parser.add_argument("--no-probe", action="store_true",
                        help="no probe in the processes (only /proc, the SuperLink's log and "
                             "rounds.jsonl): shows what the probe itself costs")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    extra_env = dict(pair.split("=", 1) for pair in args.env)
    simulate_args = ["simulate", "--clients", str(args.clients), "num-rounds=1"]
    if args.train_subset:
        simulate_args.append(f"train-subset={args.train_subset}")
    work = Path(tempfile.mkdtemp(prefix="dpfl-startup-"))
    print(f"bench/startup.py: `dpfl {' '.join(simulate_args)}` x {args.runs}"
          + (f" with {extra_env}" if extra_env else "") + f"; work folder {work}")
    runs = []
    try:
        for i in range(1, args.runs + 1):
            if i > 1:
                time.sleep(args.settle)
            run = measure(i, work, simulate_args, extra_env, args.timeout, not args.no_probe)
            runs.append(run)
            print_run(run)
        means = print_comparison(runs)
        walls = {} if args.no_importtime else import_costs(IMPORT_COSTS)
        if args.no_probe:   # the intervals the estimates need come from the probe
            return 0 if all(r.code == 0 for r in runs) else 1
        start, exchange = candidates(means, walls)
        for title, ranked in (("round 1's start", start),
                              ("round 1's exchange, up to the first reply", exchange)):
            print(f"\n=== what would move {title}: largest saving first (estimated from the "
                  "mean intervals above; the items share 2 cores and overlap, so the savings "
                  "do not simply add up)")
            for i, (saving, cost, fix, basis) in enumerate(ranked, 1):
                print(f"{i:2}. ~{saving:4.1f} s  {cost}\n      fix: {fix}\n"
                      f"      estimate: {basis}")
        loop = means.get("actor: training loop (train_dpsgd less imports)", 0.0)
        print(f"    what stays: the first client's training itself ({loop:.1f} s: one local "
              "epoch of DP-SGD, two actors sharing two cores) and the reply's transport")
    finally:
        if args.keep:
            print(f"\nraw measurements kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if runs and all(r.code == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
