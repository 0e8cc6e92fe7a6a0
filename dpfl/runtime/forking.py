"""What a process forked from a preloaded parent does first (the warm ClientApps'
and simulations' zygote children, :mod:`.warm_clientapps`; the simulation's ClientApp
workers, :mod:`.process_backend`), and how it ends (also the ``dpfl`` command's end)."""

from __future__ import annotations

import os
import sys


def forget_dpfl_modules() -> list[str]:
    """Drop every ``dpfl`` module from ``sys.modules`` (Flower's app loader reuses a module
    already imported): the FAB's copy of dpfl is the one that runs. Returns the names."""
    names = [m for m in sys.modules if m == "dpfl" or m.startswith("dpfl.")]
    for name in names:
        del sys.modules[name]
    return names


def reseed_global_generators() -> None:
    """A fork's NumPy and torch global generators differ from its siblings' (a new process
    would have its own). dpfl's DP noise never uses them: it draws fresh OS entropy."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(int.from_bytes(os.urandom(4), "little"))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


def exit_fork(code: int) -> None:
    """End this process at once (never returns): its log handlers and streams flushed (a
    stream that cannot be flushed, e.g. a closed pipe, is skipped), then ``os._exit``. A
    forked child so runs no atexit handler or finaliser of its parent's objects a second
    time; the ``dpfl`` command (:func:`dpfl.cli.entry`) so skips the interpreter's teardown
    of torch and Flower."""
    import logging

    try:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):   # closed or broken: nothing more to say
                pass
    finally:
        os._exit(code)
