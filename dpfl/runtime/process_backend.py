"""ClientApps in worker processes forked from the simulation: Flower's simulation runtime
with a process pool where Ray's actors were.

Flower 1.39 runs a simulation's ClientApps through a ``Backend``
(``flwr.server.superlink.fleet.vce.backend.Backend``): the simulation runtime's worker
threads hand each instruction and its node's ``Context`` to ``Backend.process_message``
and store the reply; the only backend Flower ships is ``RayBackend``, one Ray actor per
ClientApp that runs at once. On one machine Ray costs what a short run cannot hide: its
head (GCS, raylet, dashboard agent, runtime-env agent, monitors) takes ~4 s of CPU to
start and ~1 GiB to keep, and each actor is a fresh interpreter that imports torch,
Opacus, dp-accounting and dpfl (~6 s of CPU) before its first reply.

:class:`ProcessBackend` is that ``Backend`` with forked processes instead:

- :func:`prefork_workers` runs in the simulation process **before it starts any thread**
  (:mod:`.warm_clientapps` calls it in a simulation forked from its zygote, whose imports
  the workers inherit). Each worker is a fork of that single-threaded process, holding one
  end of a pipe; nothing else is shared.
- ``build`` sends each worker the ClientApp loader Flower built (pickled by value with
  cloudpickle, as Ray ships it to its actors) and the CPUs each ClientApp may use
  (``client-resources-num-cpus``: torch's thread count, as Ray's actors get
  ``OMP_NUM_THREADS``).
- ``process_message`` takes an idle worker, sends it the message and the node's context,
  and returns the reply and the updated context: Flower's own loop does the rest, as with
  Ray. A ClientApp's exception comes back as Flower's ``ClientAppException`` (the worker
  logs its traceback), so the runtime replies with the same error message as under Ray.
- A worker that dies (killed, out of memory) is dropped with a logged reason; its message
  gets an error reply and the others go on. With none left, every message gets one.
- A worker exits when its pipe closes (the backend terminates, or the simulation dies)
  and, on Linux, when the simulation process dies (``PR_SET_PDEATHSIG``).

Flower constructs ``RayBackend(backend_config)`` by name inside ``start_vce``;
:func:`install` points that name at :func:`backend`, which returns a
:class:`ProcessBackend` when workers were preforked and Flower's ``RayBackend`` otherwise.
It also replaces the runtime's instruction poll (``add_messages_to_queue``, which
``run_api`` starts) by :func:`add_messages_on_arrival`, the same sweep woken by each stored
instruction instead of every 0.1 s. It patches only the Flower it was written against
(:data:`PATCHED_SOURCE_SHA256`: the source of ``start_vce``, which builds the backend, of
the simulation runtime's ``worker`` loop, which calls it, and of the poll and its caller)
and says so in the log either way.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from typing import Any

from dpfl.cohort import bundle_clients
from dpfl.flower_pin import INSTRUCTIONS_ARRIVED, pin_problem
from dpfl.runtime.forking import exit_fork, forget_dpfl_modules, reseed_global_generators
from dpfl.runtime.watchdog import die_with_parent

_log = logging.getLogger("flwr.dpfl.process_backend")

# the launcher's request: this many worker processes (unset or 0: Flower's Ray backend)
WORKERS_ENV = "DPFL_PROCESS_WORKERS"
# sha256 of the Flower functions whose behaviour this backend relies on (flwr 1.39.0)
PATCHED_SOURCE_SHA256 = {
    "start_vce": "2d5e267f893950a709c52adf9d6a90c81a7750d889b4eb99318dfffeea957f16",
    "worker": "60f308688ba34fb5bc942ac68c1d97be61b2010e8d4c3983833f646c5c038157",
    "add_messages_to_queue": "953f4bd41a931a7779a4a670ab17b633f6e20b08a0128535328674466419777a",
    "run_api": "f85c0cd6e902752f455c00ab9c7212c1cd94a8c681fa9bf294ba967463390898",
}
# seconds between checks, while every worker is busy, that at least one is still alive
_IDLE_POLL_SECONDS = 1.0


@dataclass
class Worker:
    """One forked ClientApp process and the simulation's end of its pipe."""

    pid: int
    conn: Connection


_preforked: list[Worker] = []


def requested_workers(environ: dict[str, str] | None = None) -> int:
    """How many worker processes the launcher asked for (:data:`WORKERS_ENV`), 0 if none."""
    raw = (os.environ if environ is None else environ).get(WORKERS_ENV, "")
    try:
        return max(0, int(raw))
    except ValueError:
        return 0


def prefork_workers(count: int) -> list[Worker]:
    """Fork ``count`` idle workers from this process, which must have no other thread
    (each worker is a copy of it). They wait for :meth:`ProcessBackend.build`."""
    if threading.active_count() != 1:
        raise RuntimeError("prefork_workers: the process already runs other threads")
    sys.stdout.flush()
    sys.stderr.flush()
    for _ in range(count):
        ours, theirs = Pipe(duplex=True)
        pid = os.fork()
        if pid == 0:   # the worker: drop every other worker's pipe, then serve
            ours.close()
            for other in _preforked:
                other.conn.close()
            _preforked.clear()
            _serve(theirs)
        theirs.close()
        _preforked.append(Worker(pid, ours))
    return list(_preforked)


def _serve(conn: Connection) -> None:
    """A worker's life (never returns): wait for the app, then run one message at a time
    until the pipe closes."""
    code = 0
    try:
        die_with_parent(signal.SIGKILL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # the simulation ends us, not Ctrl-C
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        reseed_global_generators()
        _, path, threads, loader = conn.recv()
        sys.path[:] = path
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(threads)
        forget_dpfl_modules()   # the worker loads dpfl from the app (the FAB)
        app_fn = pickle.loads(loader)   # noqa: S301 - the simulation process's own pickle
        while True:
            message, context = conn.recv()
            conn.send(_run(app_fn, message, context))
    except EOFError:
        pass
    except BaseException:  # noqa: BLE001 - a worker never returns into its parent's code
        traceback.print_exc()
        code = 1
    finally:
        exit_fork(code)


def _run(app_fn: Callable[[], Any], message: Any, context: Any) -> tuple:
    """What Flower's Ray actor does with a message (``ClientAppActor.run``): load the app,
    call it; an exception becomes ``ClientAppException`` (``LoadClientAppError`` stays)."""
    from flwr.clientapp.client_app import ClientAppException, LoadClientAppError

    try:
        app = app_fn()
        return ("ok", app(message=message, context=context), context)
    except LoadClientAppError as exc:
        traceback.print_exc()
        return ("error", LoadClientAppError(str(exc)))
    except Exception as exc:  # noqa: BLE001 - reported to Flower's loop as under Ray
        traceback.print_exc()
        return ("error", ClientAppException(str(exc)))


def _threads(backend_config: dict[str, Any]) -> int:
    """torch threads per ClientApp: its ``client_resources.num_cpus`` (Flower's default 2),
    at least 1."""
    resources = backend_config.get("client_resources") or {}
    try:
        return max(1, int(resources.get("num_cpus", 2)))
    except (TypeError, ValueError):
        return 1


class ProcessBackend:
    """Flower's simulation ``Backend`` over the preforked workers (see the module)."""

    def __init__(self, backend_config: dict[str, Any], workers: list[Worker]) -> None:
        self._threads = _threads(backend_config)
        self._workers = list(workers)
        self._idle: queue.Queue[Worker] = queue.Queue()
        self._lock = threading.Lock()

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def build(self, app_fn: Callable[[], Any]) -> None:
        """Send each worker the ClientApp loader and its thread count."""
        import cloudpickle

        loader = cloudpickle.dumps(app_fn)
        for worker in list(self._workers):
            try:
                worker.conn.send(("app", list(sys.path), self._threads, loader))
            except OSError as exc:
                self._drop(worker, f"it could not be sent the app ({exc})")
                continue
            self._idle.put(worker)
        _log.info("ClientApps run in %d worker processes forked from the simulation "
                  "(dpfl.runtime.process_backend), %d torch thread(s) each",
                  len(self._workers), self._threads)

    def is_worker_idle(self) -> bool:
        return not self._idle.empty()

    def _take(self) -> Worker:
        while True:
            with self._lock:
                if not self._workers:
                    from flwr.clientapp.client_app import ClientAppException

                    raise ClientAppException("no ClientApp worker process is left")
            try:
                return self._idle.get(timeout=_IDLE_POLL_SECONDS)
            except queue.Empty:
                continue

    def _drop(self, worker: Worker, why: str) -> None:
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
        worker.conn.close()
        _log.error("ClientApp worker process %d dropped: %s; %d left", worker.pid, why,
                   len(self._workers))

    def process_message(self, message: Any, context: Any) -> tuple[Any, Any]:
        """Run the ClientApp on ``message`` in an idle worker; its reply and context."""
        worker = self._take()
        try:
            worker.conn.send((message, context))
            reply = worker.conn.recv()
        except (EOFError, OSError) as exc:
            self._drop(worker, f"it ended while running a message ({type(exc).__name__})")
            from flwr.clientapp.client_app import ClientAppException

            raise ClientAppException(f"the ClientApp worker process {worker.pid} ended "
                                     "while running this message") from exc
        self._idle.put(worker)
        if reply[0] == "error":
            raise reply[1]
        return reply[1], reply[2]

    def terminate(self) -> None:
        """Close every pipe (a worker exits at end of file) and reap the workers."""
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.conn.close()
        for worker in workers:
            _reap(worker.pid)


def _reap(pid: int, timeout: float = 5.0) -> None:
    """Wait for a worker to exit; kill it after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.02)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def why_not_patchable() -> str | None:
    """None when the installed Flower is the one this backend was written against, else
    why not (:func:`dpfl.flower_pin.pin_problem`)."""
    try:
        from flwr.server.superlink.fleet.vce import vce_api
    except ImportError as exc:
        return f"Flower's simulation runtime cannot be imported ({exc})"
    return pin_problem(vce_api, "flwr vce_api", PATCHED_SOURCE_SHA256)


# Flower's instruction poll sleeps 0.1 s between sweeps: a round's instructions waited
# 30-110 ms for their first ClientApp call (measured at 1,000 clients, cohort nodes)
POLL_SECONDS = 0.1


# after a wake, the sweep waits this long for the rest of a push (a round's instructions are
# stored one by one) so that one sweep sees them all and can order them
SETTLE_SECONDS = 0.002


def _message_weight(msg: Any) -> int:
    """A cohort bundle's number of clients (a node's instruction otherwise weighs 0)."""
    try:
        return bundle_clients(msg.content)
    except Exception:  # noqa: BLE001 - an error message has no content: no weight
        return 0


def add_messages_on_arrival(state: Any, queue: Any, nodes_mapping: Any,
                            f_stop: threading.Event) -> None:
    """Flower's ``add_messages_to_queue`` (each node's next instruction into the runtime's
    queue, sweep after sweep, until ``f_stop``), with two changes:

    - it wakes as soon as an instruction is stored when the LinkState says so
      (:data:`dpfl.flower_pin.INSTRUCTIONS_ARRIVED`, set by dpfl's node index), else after
      Flower's 0.1 s as before;
    - a sweep queues its instructions largest cohort first (longest processing time first:
      the idle workers take them in queue order, and the round ends when the last worker
      does), one-client instructions in node order as Flower does."""
    while not f_stop.is_set():
        arrived = getattr(state, INSTRUCTIONS_ARRIVED, None)
        if arrived is not None:
            arrived.clear()   # before the sweep: a store during it wakes the next wait
            time.sleep(SETTLE_SECONDS)
        found = []
        for node_id in nodes_mapping.keys():
            found.extend(state.get_message_ins(node_id=node_id, limit=1))
        for msg in sorted(found, key=_message_weight, reverse=True):   # stable
            queue.put(msg)
        if arrived is not None:
            arrived.wait(POLL_SECONDS)
        else:
            f_stop.wait(POLL_SECONDS)


def backend(backend_config: dict[str, Any]) -> Any:
    """What Flower's ``start_vce`` builds where it names ``RayBackend``: the preforked
    workers' :class:`ProcessBackend`, else Flower's own ``RayBackend``."""
    if _preforked:
        workers = list(_preforked)
        _preforked.clear()
        return ProcessBackend(backend_config, workers)
    return _FLOWER_RAY_BACKEND[0](backend_config)


_FLOWER_RAY_BACKEND: list[Any] = []


def install(count: int) -> int:
    """In a simulation process with no thread yet: fork ``count`` workers and make Flower's
    simulation runtime use them. Returns the workers forked (0: Flower's Ray, logged why)."""
    if count <= 0:
        return 0
    why = why_not_patchable()
    if why is not None:
        print(f"dpfl.runtime.process_backend: Ray runs the ClientApps: {why}", file=sys.stderr,
              flush=True)
        return 0
    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.fleet.vce.backend import raybackend

    prefork_workers(count)
    if not _FLOWER_RAY_BACKEND:
        _FLOWER_RAY_BACKEND.append(raybackend.RayBackend)
    raybackend.RayBackend = backend   # type: ignore[assignment,misc]
    vce_api.add_messages_to_queue = add_messages_on_arrival  # run_api names it at call time
    return len(_preforked)
