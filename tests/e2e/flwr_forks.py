"""Flower's `flwr` CLI, imported once and forked per command (the tests' run submissions).

    python flwr_forks.py     # then one JSON request per line on stdin

Each `flwr run` the method tests submit (tests/e2e/federation.py: SharedSimulation) would
start a new interpreter that imports Flower's CLI (typer, rich, gRPC, Flower's protos): ~1.7 s
of CPU before it sends anything, ~30 times a suite. This process imports it once; for each
request ``{"argv": [...], "out": PATH}`` it forks a child that runs Flower's own entry point
(``flwr.cli.app:app``, what the `flwr` script calls) with ``argv``, its stdout and stderr
going to ``PATH``, and answers with two lines: the child's PID when it starts, its exit code
when it ends. The parent only imports: it opens no gRPC channel and starts no thread, so
each child starts as a new process would (as dpfl.runtime.warm_clientapps forks ClientApps).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from flwr.cli.app import app


def run_child(argv: list[str], out: str) -> int:
    """In the forked child: Flower's CLI with ``argv``, output to ``out``; its exit code."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdin.close()
    sys.argv = ["flwr", *argv]
    try:
        app()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the output, as the CLI would crash
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run_child(request["argv"], request["out"])
            finally:
                os._exit(code)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
