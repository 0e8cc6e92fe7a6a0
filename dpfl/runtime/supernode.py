"""``flower-supernode`` with a configurable ClientApp start window (slow edge devices) and,
optionally, warm ClientApps.

    python -m dpfl.runtime.supernode [--warm-clientapps] [--clientapp-start-window 300]
                                     [flower-supernode options...]

``--warm-clientapps``: the node's SuperExec forks each ClientApp from a process that has
already imported torch, Opacus, dp-accounting and Flower (:mod:`dpfl.runtime.warm_clientapps`)
instead of starting a new interpreter per instruction. Only with Flower's default
``--isolation subprocess``.

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

from dpfl.runtime.flower_wrap import run_wrapped, split_seconds

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


WARM_OPTION = "--warm-clientapps"


class _SuperExecLauncher:
    """Stands in for the ``subprocess`` module of Flower's ``start_client_internal``, whose
    only use of it is ``subprocess.Popen(["flower-superexec", ...])``: that command runs
    :mod:`dpfl.runtime.warm_clientapps` (Flower's SuperExec with a forking ClientApp executor)."""

    def __getattr__(self, name: str):  # noqa: ANN204 - the real module's other names
        import subprocess

        return getattr(subprocess, name)

    @staticmethod
    def Popen(command, *args, **kwargs):  # noqa: ANN001, ANN205, N802 - subprocess's name
        import subprocess
        import sys

        if list(command[:1]) == ["flower-superexec"]:
            command = [sys.executable, "-m", "dpfl.runtime.warm_clientapps", *command[1:]]
        return subprocess.Popen(command, *args, **kwargs)


def use_warm_clientapps() -> None:
    """Make this process's SuperNode start :mod:`dpfl.runtime.warm_clientapps` as its SuperExec."""
    from flwr.supernode import start_client_internal

    if not hasattr(start_client_internal, "subprocess"):
        raise RuntimeError("flwr.supernode.start_client_internal does not start its "
                           "SuperExec with subprocess in this flwr version")
    start_client_internal.subprocess = _SuperExecLauncher()


def _isolation(argv: Sequence[str]) -> str:
    """The ``--isolation`` value among Flower's arguments (Flower's default: subprocess)."""
    value = "subprocess"
    for i, arg in enumerate(argv):
        if arg == "--isolation" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--isolation="):
            value = arg.split("=", 1)[1]
    return value


def split_warm(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """(whether ``--warm-clientapps`` was given, the other arguments)."""
    rest = [a for a in argv if a != WARM_OPTION]
    if any(a.startswith(WARM_OPTION + "=") for a in rest):
        raise ValueError(f"{WARM_OPTION} takes no value")
    return len(rest) != len(argv), rest


def main(argv: Sequence[str] | None = None) -> None:
    import sys

    try:
        warm, argv = split_warm(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"dpfl.runtime.supernode: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if warm:
        if _isolation(argv) != "subprocess":
            print(f"dpfl.runtime.supernode: {WARM_OPTION} needs --isolation subprocess (the node "
                  "starts its own SuperExec)", file=sys.stderr)
            raise SystemExit(2)
        use_warm_clientapps()
    run_wrapped("dpfl.runtime.supernode", OPTION, FLOWER_DEFAULT, MAX_WINDOW, apply_start_window,
                "flower-supernode", _flower_supernode, argv)


if __name__ == "__main__":
    main()
