"""``flower-supernode`` with a configurable ClientApp start window (slow edge devices).

    python -m dpfl.supernode --clientapp-start-window 300 [flower-supernode options...]

A SuperNode hands each instruction to a new ClientApp process. Flower 1.39 gives that
process ``HEARTBEAT_DEFAULT_INTERVAL`` = 30 s from the moment the task is claimed to its
first heartbeat, and a running task ``HEARTBEAT_PATIENCE`` × 30 s = 60 s between heartbeats;
a task that misses either is expired and its reply never sent. On a slow device (an ARM64
board, or qemu emulation: importing flwr there took longer than 30 s on a loaded host,
``results/edge/``) the ClientApp misses the first window and the round gets no reply.

Flower has no option for this: the constant is imported by value into its node-state
modules (``flwr.supercore.corestate.in_memory_corestate`` and ``sql_corestate``), which are
the only places that compute those deadlines. This wrapper sets it there, in this process
only, to the window given, and then runs Flower's own ``flower-supernode`` entry point with
the remaining arguments: nothing else changes (the node's own heartbeats to the SuperLink
use their own interval). A larger window also makes a crashed ClientApp be noticed later
(after 2 × the window instead of 60 s).
"""

from __future__ import annotations

from collections.abc import Sequence

from dpfl.flower_wrap import run_wrapped, split_seconds

OPTION = "--clientapp-start-window"
FLOWER_DEFAULT = 30.0  # flwr.common.constant.HEARTBEAT_DEFAULT_INTERVAL in flwr 1.39
MAX_WINDOW = 3600.0


def split_window(argv: Sequence[str]) -> tuple[float | None, list[str]]:
    """(the window in seconds or None, the other arguments); ValueError on a bad value."""
    return split_seconds(argv, OPTION, FLOWER_DEFAULT, MAX_WINDOW)


def apply_start_window(seconds: float) -> None:
    """Set the ClientApp start window of this process's node state to ``seconds``."""
    from flwr.supercore.corestate import in_memory_corestate, sql_corestate

    for module in (in_memory_corestate, sql_corestate):
        if not hasattr(module, "HEARTBEAT_DEFAULT_INTERVAL"):
            raise RuntimeError(f"{module.__name__} has no HEARTBEAT_DEFAULT_INTERVAL: this "
                               "flwr version computes the window elsewhere")
        module.HEARTBEAT_DEFAULT_INTERVAL = seconds


def _flower_supernode():
    from flwr.supernode.cli import flower_supernode

    return flower_supernode


def main(argv: Sequence[str] | None = None) -> None:
    run_wrapped("dpfl.supernode", OPTION, FLOWER_DEFAULT, MAX_WINDOW, apply_start_window,
                "flower-supernode", _flower_supernode, argv)


if __name__ == "__main__":
    main()
