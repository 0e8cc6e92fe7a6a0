"""Keep a process tree from outliving the command that started it, even on SIGKILL.

``python -m dpfl.runtime.watchdog --parent PID -- CMD ...`` starts CMD as its child and
becomes a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): every process below it
that loses its parent — the SuperLink's SuperExec, the simulation, Ray's raylet, GCS and
workers, whatever process groups or sessions they make — is re-parented to the watchdog
rather than to init, so the whole tree stays visible under it in ``/proc``. The watchdog
then waits for the first of:

- the launcher (``--parent``) dying, however (SIGKILL included: its PID leaves, our ppid
  changes);
- SIGTERM/SIGINT (the launcher's normal cleanup); SIGUSR1: the same, for a tree whose work
  is over (a simulation whose ServerApp said how its run ended), which gets
  :data:`ENDED_GRACE` seconds instead of the grace period; a launcher that died gets its
  tree stopped with the same short grace (nobody is left to hear how the run ends, and a
  simulation given the grace period on SIGTERM kept running rounds of its own, every
  client's reply an error once the SIGTERM had ended its ClientApp workers);
- CMD exiting by itself (with ``--outlive-command``: CMD and every process below it, so a
  zygote may fork a task and exit while the task runs on, still watched);

and stops everything below it: SIGTERM, a grace period, SIGKILL, reaping as it goes. It
exits with CMD's code (or 128+signal). Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
POLL_SECONDS = 0.2        # between checks while the tree runs (each reads /proc)
STOP_POLL_SECONDS = 0.02  # between checks while it stops (a stop is over in ~0.1-0.3 s)
ENDED_GRACE = 0.1         # seconds to exit on SIGTERM for a tree whose work is over (SIGUSR1)
ENDED_SIGNAL = signal.SIGUSR1


def prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """For ``preexec_fn``: the kernel sends ``sig`` to this process when its parent dies."""
    prctl(PR_SET_PDEATHSIG, sig)


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
    """Every process below ``pid`` (whatever its process group or session)."""
    children, out, todo = _children_map(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _reap(keep: int | None = None) -> None:
    """Collect every exited child (orphans re-parented to us included), except ``keep``
    (the command, whose exit code ``Popen`` collects)."""
    for pid in _children_map().get(os.getpid(), []):
        if pid != keep and not alive(pid):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _signal_wakeups() -> int:
    """A pipe's read end that receives a byte whenever this process gets a signal with a
    Python handler (``signal.set_wakeup_fd``): a wait on it ends at once on SIGTERM or a
    child's exit, not at the next poll."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    return read_end


def _pause(wakeups: int, seconds: float) -> None:
    """Sleep up to ``seconds``, less when a signal arrives."""
    select.select([wakeups], [], [], seconds)
    try:
        while os.read(wakeups, 512):
            pass
    except BlockingIOError:
        pass


def stop_tree(grace: float) -> None:
    """SIGTERM everything below us, wait up to ``grace`` s, SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _reap()
            if not any(alive(p) for p in descendants(os.getpid())):
                return
            time.sleep(STOP_POLL_SECONDS)


def watch(parent: int, cmd: list[str], grace: float, outlive_command: bool = False) -> int:
    """Run ``cmd`` under this watchdog until it ends (``outlive_command``: until it and
    everything below it ended), the parent dies or we are told to stop; return the exit
    code to use."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    stop = {"signal": 0}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(ENDED_SIGNAL, on_signal)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)   # wakes the wait below
    wakeups = _signal_wakeups()
    child = subprocess.Popen(cmd)
    code, orphaned = None, False
    while code is None:
        if stop["signal"]:
            code = 128 + stop["signal"]
        elif os.getppid() != parent or not alive(parent):
            code, orphaned = 128 + signal.SIGKILL, True  # the launcher is gone
        else:
            code = child.poll()
            if code is not None and outlive_command and any(
                    alive(p) for p in descendants(os.getpid()) if p != child.pid):
                code = None   # the command ended; what it started runs on, watched
            if code is None:
                _reap(keep=child.pid)
                _pause(wakeups, POLL_SECONDS)
    stop_tree(ENDED_GRACE if stop["signal"] == ENDED_SIGNAL or orphaned else grace)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpfl.runtime.watchdog", description=__doc__,
                                     allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parent", type=int, required=True, help="PID of the launcher")
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--outlive-command", action="store_true",
                        help="keep watching after CMD exits while processes below it run")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given")
    return watch(args.parent, cmd, args.grace, args.outlive_command)


if __name__ == "__main__":
    sys.exit(main())
