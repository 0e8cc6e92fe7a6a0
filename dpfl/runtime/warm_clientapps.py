"""Warm ClientApps (and simulations): Flower's task processes start from libraries already
imported.

    python -m dpfl.runtime.supernode --warm-clientapps [flower-supernode options...]
    python -m dpfl.runtime.warm_clientapps --warm simulation [flower-superexec options...]

Flower 1.39's SuperNode hands every instruction to a new ``flwr-clientapp`` process, started
by its SuperExec (``flower-superexec``, Flower's ``SubprocessExecutor``). That process
imports torch, Opacus, dp-accounting, SciPy and Flower before it reads its message: about
6 s of CPU on this project's x86 test machine, for every node in every round, and more than
Flower's 30 s start window on a slow ARM64 board (``results/edge/``).

Here the SuperNode's SuperExec is Flower's own (:func:`main` runs ``flower-superexec`` with
its arguments), with one change: a ClientApp task is not started with ``Popen`` but forked
from a *zygote*, a child process of the SuperExec that imported those libraries once
(:data:`PRELOAD`). The forked child runs Flower's own ``flwr-clientapp`` entry point with
the arguments Flower's ``SubprocessExecutor`` would pass (:func:`clientapp_args`), so it
pulls its message, installs the FAB, loads the app from the FAB, runs one task and exits,
as before. dpfl's own modules are never taken from the zygote: the FAB's code runs
(:func:`forget_dpfl_modules`). Every other task type, and any task when the zygote is gone,
starts the cold way.

The same executor serves the SuperExec that a simulation's SuperLink starts (``--warm
simulation``, the launcher's ``flower-superexec`` on the SuperLink's PATH,
:func:`dpfl.runtime.launch.warm_simulation_bin`): its ``flwr-simulation`` task is forked from a
zygote that imported Flower's simulation engine, torch, dp-accounting and SciPy
(:data:`SIMULATION_PRELOAD`) while ``flwr run`` built and sent the app: ~2.5 s less on the
way to round 1 (``results/speed/``).

What a fork shares and what it must not:
- the zygote only imports: it computes no tensor (torch's OpenMP pool starts in each child)
  and starts no thread of its own. The pools that libraries start at import (NumPy's and
  SciPy's OpenBLAS: 3 threads in all here) reinitialise in a forked child, as they do in
  PyTorch's DataLoader workers and in every `multiprocessing` fork;
- the DP noise of dpfl draws fresh operating-system entropy at every release
  (:mod:`dpfl.privacy.mechanisms.randomness`), never the process's generators; the child still reseeds
  NumPy's and torch's global generators from the OS, as a new process would have its own;
- the zygote ignores SIGCHLD (the kernel reaps its children: no zombie); the child restores
  the default, so its own subprocesses can be waited for.

Memory: the zygote stays resident, 0.82 GB RSS here (0.48 GB anonymous; `import torch`
alone is 0.5 GB with this host's CUDA build); a ClientApp's own pages are copied only when
written.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import IO, Any

from dpfl.runtime import process_backend
from dpfl.runtime.forking import exit_fork, forget_dpfl_modules, reseed_global_generators
from dpfl.runtime.watchdog import ENDED_SIGNAL

_log = logging.getLogger("flwr.dpfl.warm")

# Imported once by the zygote: everything heavy that dpfl's ClientApp imports, none of
# dpfl's own modules, nor scikit-learn (only the small digits dataset needs it, and it starts
# a jemalloc thread at import). torch._dynamo is imported by the first torch optimizer a
# process builds (torch.optim.Optimizer.__init__): 2.1 s of CPU here, the largest single
# import. A module that cannot be imported here is skipped: it then loads in the child, as
# it would without the zygote.
PRELOAD = (
    "numpy", "torch", "torch.nn", "torch.optim", "torch._dynamo", "opacus", "dp_accounting",
    "dp_accounting.pld", "dp_accounting.rdp", "scipy.optimize", "scipy.signal", "scipy.stats",
    "flwr.app", "flwr.clientapp", "flwr.supernode.cli",
    "flwr.supernode.runtime.run_clientapp",
)

# a simulation's ServerApp: Flower's simulation engine and what dpfl.apps.server imports
# (not Ray: the simulation starts it; not Opacus: the ServerApp never trains)
SIMULATION_PRELOAD = (
    "numpy", "torch", "torch.nn", "dp_accounting", "dp_accounting.pld", "dp_accounting.rdp",
    "scipy.optimize", "scipy.signal", "scipy.stats", "flwr.app", "flwr.serverapp",
    "flwr.clientapp", "flwr.simulation.app",
)

ZYGOTE_FLAG = "--zygote"
FIFO_FLAG = "--fifo"
# "<pid>:<fifo>": a simulation zygote `dpfl simulate` started before its own imports
# (:class:`EarlyZygote`); the SuperExec sends its simulation task there
EARLY_ZYGOTE_ENV = "DPFL_SIMULATION_ZYGOTE"
# how long the SuperExec waits for an early zygote to finish its imports and read its FIFO
EARLY_ZYGOTE_WAIT_SECONDS = 120.0
WARM_FLAG = "--warm"
# how the zygote's log names a forked task ("dpfl.runtime.warm_clientapps: ClientApp 3 forked ...")
LABELS = {"clientapp": "ClientApp", "simulation": "simulation"}
# kind -> (its task type's name, the modules its zygote imports, its entry point)
KINDS: dict[str, tuple[str, tuple[str, ...], tuple[str, str]]] = {
    "clientapp": ("CLIENT_APP", PRELOAD, ("flwr.supernode.cli", "flwr_clientapp")),
    "simulation": ("SIMULATION", SIMULATION_PRELOAD, ("flwr.simulation.app", "flwr_simulation")),
}


def clientapp_args(spec: Any) -> list[str]:
    """The ``flwr-clientapp`` arguments Flower 1.39's ``SubprocessExecutor.launch`` builds
    for ``spec`` (an ``ExecutionSpec``), without the program name. (Checked against
    Flower's own in tests/test_warm_clientapps.py.)"""
    from flwr.supercore.constant import TASK_TYPE_TO_APPIO_API_ADDRESS_ARG

    args = [TASK_TYPE_TO_APPIO_API_ADDRESS_ARG[spec.task_type], spec.runtime_api_address,
            "--token", spec.token]
    if spec.insecure:
        args.append("--insecure")
    elif spec.root_certificates_path is not None:
        args.extend(["--root-certificates", spec.root_certificates_path])
    if spec.parent_pid is not None:
        args.extend(["--parent-pid", str(spec.parent_pid)])
    if spec.runtime_dependency_install:
        args.append("--allow-runtime-dependency-installation")
    return args


def preload(modules: Sequence[str] = PRELOAD) -> None:
    """Import ``modules``, skipping any that cannot be imported (it loads in the child).
    The root logger gets dpfl's handler first (:func:`dpfl.logs.guard_root`): Opacus calls
    ``logging.basicConfig`` at import, which would print every Flower line a second time in
    each forked task."""
    import importlib

    from dpfl.logs import guard_root

    guard_root()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001, S112 - an optional library: it loads in the child
            continue


def _run_task_in_child(request: dict[str, Any], kind: str = "clientapp") -> None:
    """In a forked child: become the kind's Flower entry point (``flwr-clientapp``,
    ``flwr-simulation``) with the request's arguments, run one task, and exit with its
    code (never returns)."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the zygote's request pipe is not ours
        if "env" in request:   # an early zygote: the SuperExec's environment, not its own
            os.environ.clear()
            os.environ.update(request["env"])
        if "cwd" in request:
            os.chdir(request["cwd"])
        if request.get("suppress-output"):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
        forget_dpfl_modules()
        reseed_global_generators()
        if kind == "simulation":
            # its ClientApps' worker processes, forked now while no thread runs (the
            # launcher's request; none: Flower's Ray backend)
            process_backend.install(process_backend.requested_workers())
        import importlib

        module, function = KINDS[kind][2]
        entry = getattr(importlib.import_module(module), function)
        sys.argv = [request.get("program", "flwr-clientapp"), *request["args"]]
        try:
            entry()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a child never returns into the zygote's loop
        import traceback

        traceback.print_exc()
    finally:
        exit_fork(code)


def _remove_folder_of(path: str) -> None:
    import shutil

    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def serve(requests: IO[str] | str, kind: str = "clientapp") -> int:
    """The zygote: import the kind's modules (:data:`PRELOAD` for ClientApps), then fork
    one task per JSON line read from ``requests`` (``{"args": [...], "suppress-output":
    bool}``, and from an early zygote's SuperExec its ``"env"`` and ``"cwd"``) until end of
    file (the SuperExec closed the pipe or died). ``requests`` may be a FIFO's path, opened
    once the imports are done. Returns the number of children forked."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C is for the SuperNode's tree
    fifo = requests if isinstance(requests, str) else None
    if fifo is not None:   # an early zygote's private folder goes with it, whenever it ends
        signal.signal(signal.SIGTERM, lambda *_: (_remove_folder_of(fifo), os._exit(143)))
    preload(KINDS[kind][1])
    if kind == "simulation" and (fifo is not None or process_backend.requested_workers()):
        preload(PRELOAD)   # the ClientApps' libraries too: the workers fork from the simulation
    if fifo is not None:
        requests = open(fifo)   # noqa: SIM115 - blocks until the SuperExec opens it
        _remove_folder_of(fifo)   # both ends are open: the name is no longer needed
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    forked = 0
    for line in requests:
        try:
            request = json.loads(line)
            if not isinstance(request.get("args"), list):
                raise ValueError("no 'args' list")
        except ValueError as exc:
            print(f"dpfl.runtime.warm_clientapps: bad request skipped ({exc})", file=sys.stderr,
                  flush=True)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_task_in_child(request, kind)
        forked += 1
        print(f"dpfl.runtime.warm_clientapps: {LABELS[kind]} {forked} forked (pid {pid})",
              file=sys.stderr, flush=True)
    return forked


class WarmClientAppExecutor:
    """Flower's ``SubprocessExecutor`` whose ClientApp launches (``kind="simulation"``: its
    simulation launches) are forks of a zygote.

    Implements Flower 1.39's SuperExec ``Executor`` protocol by delegation.
    :func:`use_warm_executor` starts the zygote with the executor, so it imports while the
    node waits for its first task; a zygote found dead is started again on the next
    ClientApp task. It ends when this executor closes or its process dies (end of file on
    its stdin)."""

    def __init__(self, kind: str = "clientapp") -> None:
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        self.kind = kind
        self.task_type = getattr(TaskType, KINDS[kind][0])
        self._cold = SubprocessExecutor()
        self._zygote: subprocess.Popen[str] | None = None
        self.warm_launches = 0

    def start_zygote(self) -> None:
        """Start the zygote now (it imports while the node waits for its first task); not
        while an early zygote (:data:`EARLY_ZYGOTE_ENV`) may take the task."""
        if self.kind == "simulation" and os.environ.get(EARLY_ZYGOTE_ENV):
            return
        if self._zygote is None or self._zygote.poll() is not None:
            self._zygote = subprocess.Popen(  # noqa: S603 - this interpreter, this module
                [sys.executable, "-m", "dpfl.runtime.warm_clientapps", ZYGOTE_FLAG, self.kind],
                stdin=subprocess.PIPE, text=True)

    def get_eligible_capacity(self, supported_task_types, **kwargs):  # noqa: ANN001, ANN201
        return self._cold.get_eligible_capacity(supported_task_types, **kwargs)

    def wait_for_capacity(self, task_type=None, **kwargs) -> None:  # noqa: ANN001
        self._cold.wait_for_capacity(task_type, **kwargs)

    def launch(self, spec: Any) -> Any:
        """Fork a task of this executor's kind from the zygote; any other task, or a dead
        zygote: Flower's cold launch."""
        from flwr.supercore.constant import TASK_TYPE_TO_COMMAND

        if spec.task_type != self.task_type:
            return self._cold.launch(spec)
        request = {"program": TASK_TYPE_TO_COMMAND[spec.task_type],
                   "args": clientapp_args(spec), "suppress-output": bool(spec.suppress_output)}
        if self.kind == "simulation" and self._send_to_early_zygote(request):
            self.warm_launches += 1
            from flwr.supercore.superexec.executor.types import LaunchResult

            return LaunchResult.accepted()
        try:
            self.start_zygote()
            assert self._zygote is not None and self._zygote.stdin is not None
            self._zygote.stdin.write(json.dumps(request) + "\n")
            self._zygote.stdin.flush()
        except OSError as exc:
            _log.warning("warm %s launch failed (%s): starting task %d cold", self.kind, exc,
                         spec.task_id)
            return self._cold.launch(spec)
        self.warm_launches += 1
        if self.kind == "simulation":
            # a launcher's SuperLink runs one simulation: the zygote forks it and exits, so
            # its ~0.8 GB of imports are not held beside the simulation for the whole run
            # (a later simulation task would start a new zygote)
            self.release_zygote()
        from flwr.supercore.superexec.executor.types import LaunchResult

        return LaunchResult.accepted()

    def _send_to_early_zygote(self, request: dict[str, Any]) -> bool:
        """Hand the task to the early zygote named by :data:`EARLY_ZYGOTE_ENV` (once: its
        FIFO is closed after one task), with this process's environment and folder. False
        when there is none, it is gone, or it did not open its FIFO in time (then this
        executor starts its own zygote)."""
        named = os.environ.pop(EARLY_ZYGOTE_ENV, "")
        pid_text, _, fifo = named.partition(":")
        if not (pid_text.isdigit() and fifo):
            return False
        import time

        from dpfl.runtime.watchdog import alive

        deadline = time.monotonic() + EARLY_ZYGOTE_WAIT_SECONDS
        while True:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as exc:   # ENXIO: the zygote is still importing
                if not alive(int(pid_text)) or time.monotonic() > deadline:
                    _log.warning("early simulation zygote %s not reached (%s): starting one "
                                 "here", named, exc)
                    return False
                time.sleep(0.02)
        os.set_blocking(fd, True)
        request = {**request, "env": dict(os.environ), "cwd": os.getcwd()}
        with os.fdopen(fd, "w") as pipe:
            pipe.write(json.dumps(request) + "\n")
        return True

    def reconcile(self) -> None:
        self._cold.reconcile()

    def release_zygote(self) -> None:
        """Close the zygote's pipe (it exits at end of file, after the forks it was asked
        for); the tasks it forked run on."""
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            try:
                if zygote.stdin is not None:
                    zygote.stdin.close()
                zygote.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                zygote.kill()
                zygote.wait()

    def close(self) -> None:
        """Close the zygote's pipe (it exits at end of file); running ClientApps finish."""
        self.release_zygote()
        self._cold.close()


class EarlyZygote:
    """A simulation zygote that ``dpfl simulate`` starts first thing, before its own imports
    of torch and Flower: it imports the simulation's and the ClientApps' libraries while the
    launcher imports, checks and starts the SuperLink, so that the simulation task forks at
    once when it comes (the SuperExec's own zygote would only start with the SuperExec).

    It runs under a watchdog in a session of its own (``--outlive-command``: the simulation
    it forks stays watched after the zygote exits, and dies with the launcher); it takes
    one task from a FIFO in a private temporary folder (:data:`EARLY_ZYGOTE_ENV` names it to
    the SuperExec, :meth:`WarmClientAppExecutor._send_to_early_zygote`), then exits.
    :meth:`stop` ends it and whatever it forked. None of it is written in the run folder."""

    def __init__(self) -> None:
        import tempfile

        from dpfl.logs import known_warnings_option

        self.folder = tempfile.mkdtemp(prefix="dpfl-zygote-")
        self.fifo = os.path.join(self.folder, "tasks")
        os.mkfifo(self.fifo, 0o600)
        env = dict(os.environ, PYTHONWARNINGS=known_warnings_option(
            os.environ.get("PYTHONWARNINGS", "")))
        self.proc = subprocess.Popen(  # noqa: S603 - this interpreter, dpfl's modules
            [sys.executable, "-m", "dpfl.runtime.watchdog", "--parent", str(os.getpid()),
             "--outlive-command", "--", sys.executable, "-m", "dpfl.runtime.warm_clientapps",
             ZYGOTE_FLAG, "simulation", FIFO_FLAG, self.fifo],
            env=env, cwd=self.folder, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)

    @classmethod
    def start(cls) -> EarlyZygote | None:
        """One, unless warm simulations are off (``DPFL_WARM_SIMULATION=0``) or it cannot
        start (then the SuperExec starts its own, as before)."""
        if os.environ.get("DPFL_WARM_SIMULATION", "1") == "0":
            return None
        try:
            return cls()
        except OSError as exc:
            _log.warning("no early simulation zygote (%s)", exc)
            return None

    def env_value(self) -> str:
        """:data:`EARLY_ZYGOTE_ENV`'s value: the watchdog's PID and the FIFO."""
        return f"{self.proc.pid}:{self.fifo}"

    def terminate(self, run_ended: bool = False) -> None:
        """Tell the watchdog to stop the zygote and what it forked (SIGTERM), without
        waiting: the launcher stops the SuperLink meanwhile. ``run_ended``: the ServerApp
        said how its run ended, so the simulation's processes get the watchdog's short
        grace (a simulation of 10,000 clients took ~1.1 s to exit on SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.send_signal(ENDED_SIGNAL if run_ended else signal.SIGTERM)

    def stop(self, grace: float = 10.0) -> None:
        """Stop the watchdog, which stops the zygote and what it forked; remove the FIFO."""
        import shutil

        self.terminate()
        try:
            self.proc.wait(timeout=grace + 10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def use_warm_executor(kind: str = "clientapp") -> None:
    """Make this process's Flower SuperExec launch the kind's tasks with
    :class:`WarmClientAppExecutor` (local subprocess executor only)."""
    from flwr.supercore.constant import ExecutorType
    from flwr.supercore.superexec import run_superexec as module

    flower_get_executor = module.get_executor

    def get_executor(executor_type, executor_config=None, **kwargs):  # noqa: ANN001, ANN202
        if executor_type == ExecutorType.SUBPROCESS:
            executor = WarmClientAppExecutor(kind)
            executor.start_zygote()
            return executor
        return flower_get_executor(executor_type, executor_config, **kwargs)

    module.get_executor = get_executor


def main(argv: Sequence[str] | None = None) -> None:
    """``--zygote [KIND]``: serve fork requests on stdin. Otherwise: Flower's
    ``flower-superexec`` with the arguments given, its ClientApps (after ``--warm KIND``:
    that kind's tasks) forked from a zygote."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [ZYGOTE_FLAG] and len(args) == 4 and args[2] == FIFO_FLAG:
        serve(args[3], args[1])
        return
    if args[:1] == [ZYGOTE_FLAG] and len(args) <= 2:
        serve(sys.stdin, args[1] if len(args) == 2 else "clientapp")
        return
    kind = "clientapp"
    if args[:1] == [WARM_FLAG] and len(args) >= 2:
        kind, args = args[1], args[2:]
    if kind not in KINDS:
        raise SystemExit(f"dpfl.runtime.warm_clientapps: unknown kind {kind!r} "
                         f"(one of {sorted(KINDS)})")
    use_warm_executor(kind)
    from flwr.supercore.cli import flower_superexec

    sys.argv = ["flower-superexec", *args]
    flower_superexec()


if __name__ == "__main__":
    main()
