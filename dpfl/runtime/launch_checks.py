"""The launch's checks in a forked child, so that the launcher stays light.

Checking a launch (:mod:`dpfl.runtime.preflight`) takes the method registry, the dataset
catalogue and the ledger reader, with torch, Flower and dp-accounting under them: 0.66 GiB
of proportional memory that the launcher, which then only waits for the run, held until the
run's end. :class:`LaunchChecks` forks the launcher (before it has a thread or a child of
its own to share) and runs the checks in the child, in two steps over two pipes:

1. the child plans the launch (:func:`~dpfl.runtime.preflight.plan_launch`) and sends the
   :class:`~dpfl.runtime.launch_plan.LaunchPlan` as one JSON line, or the refusal (a
   :class:`~dpfl.errors.UserError`'s or :class:`~dpfl.config.ConfigError`'s one line);
2. the launcher takes the run folder's lock and says so; the child re-checks what another
   launch may have changed meanwhile (:func:`~dpfl.runtime.preflight.recheck_after_lock`),
   answers, and exits.

A refusal is raised in the launcher as the same error class with the same message (exit 2,
nothing written); any other failure of the checks prints the child's traceback and raises
:class:`ChecksFailed`. A forked child shares the launcher's state as it was, so what a test
patched in the launcher's modules holds in the checks too. It dies with the launcher
(``PR_SET_PDEATHSIG``), and a SIGTERM to the launcher reaches it (the caller registers
:attr:`LaunchChecks.pid` with the launcher's SIGTERM handler).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import IO, Any

from dpfl.config import ConfigError
from dpfl.errors import UserError
from dpfl.runtime.launch_plan import LaunchPlan

LOCKED = b"locked\n"


class ChecksFailed(RuntimeError):
    """The launch's checks failed for a reason that is not the user's (a bug, a crash)."""


class LaunchChecks:
    """The checks' child, from :meth:`start` to :meth:`close` (a context manager)."""

    def __init__(self, pid: int, answers: IO[bytes], orders: IO[bytes]) -> None:
        self.pid = pid
        self._answers = answers
        self._orders = orders
        self._exit: int | None = None

    @classmethod
    def start(cls, app_dir: Path, num_clients: int | None, overrides: dict[str, object],
              output_root: Path, num_cpus: float = 1.0, ray_address: str | None = None,
              parallel: int | None = None) -> LaunchChecks:
        """Fork the child that plans this launch (:func:`~dpfl.runtime.preflight.plan_launch`'s
        arguments)."""
        answers_r, answers_w = os.pipe()
        orders_r, orders_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()   # else the child's exit could write the launcher's buffers twice
        pid = os.fork()
        if pid == 0:   # pragma: no cover - the child; its answers are what tests check
            os.close(answers_r)
            os.close(orders_w)
            _child(os.fdopen(answers_w, "wb"), os.fdopen(orders_r, "rb"),
                   (app_dir, num_clients, overrides, output_root, num_cpus, ray_address,
                    parallel))
        os.close(answers_w)
        os.close(orders_r)
        return cls(pid, os.fdopen(answers_r, "rb"), os.fdopen(orders_w, "wb"))

    def plan(self) -> LaunchPlan:
        """The :class:`~dpfl.runtime.launch_plan.LaunchPlan`, or the child's refusal raised."""
        return LaunchPlan.from_json(self._answer()["plan"])

    def recheck_after_lock(self) -> None:
        """Tell the child the lock is held; raise its refusal, if any."""
        try:
            self._orders.write(LOCKED)
            self._orders.flush()
        except BrokenPipeError:
            pass   # the child is gone: _answer says how
        self._answer()

    def close(self) -> None:
        """Let the child go (it exits when its orders end) and wait for it."""
        try:
            self._orders.close()
        except BrokenPipeError:
            pass
        self._answers.close()
        self._wait()

    def __enter__(self) -> LaunchChecks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait(self) -> int:
        if self._exit is None:
            _, status = os.waitpid(self.pid, 0)
            self._exit = os.waitstatus_to_exitcode(status)
        return self._exit

    def _answer(self) -> dict[str, Any]:
        line = self._answers.readline()
        if not line:
            code = self._wait()
            raise ChecksFailed(f"the launch's checks ended without an answer (exit status "
                               f"{code}{', a signal' if code < 0 else ''})")
        answer = json.loads(line)
        if "refusal" in answer:
            kind = ConfigError if answer["refusal"] == "config" else UserError
            raise kind(answer["message"])
        if "failure" in answer:
            raise ChecksFailed(f"the launch's checks failed: {answer['failure']}")
        return answer


def _send(out: IO[bytes], answer: dict[str, Any]) -> None:
    out.write(json.dumps(answer).encode() + b"\n")
    out.flush()


def _child(answers: IO[bytes], orders: IO[bytes], args: tuple) -> None:
    """The checks' child: plan, wait for the lock, re-check, exit (never returns)."""
    from dpfl.runtime.watchdog import die_with_parent

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent()
    code = 0
    try:
        from dpfl.runtime.preflight import plan_launch, recheck_after_lock

        plan = plan_launch(*args)
        _send(answers, {"plan": plan.to_json()})
        if orders.readline() == LOCKED:
            recheck_after_lock(plan)
            _send(answers, {"rechecked": True})
    except UserError as exc:
        _send(answers, {"refusal": "config" if isinstance(exc, ConfigError) else "user",
                        "message": str(exc)})
    except BrokenPipeError:
        code = 1   # the launcher is gone
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the exit
        traceback.print_exc()
        try:
            _send(answers, {"failure": f"{type(exc).__name__}: {exc}"})
        except OSError:
            pass
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
