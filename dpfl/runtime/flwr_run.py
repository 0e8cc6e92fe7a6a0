"""``flwr run``, its imports done ahead: the launcher starts it beside the SuperLink.

    python -m dpfl.runtime.flwr_run run APP CONNECTION [flwr run options...]

Flower's ``flwr`` command imports its CLI (typer, Flower's CLI modules, gRPC, protobuf:
~1 s here) before it reads its arguments, and the launcher could only start it once the
SuperLink it talks to answered. This module imports the same CLI at once, then waits for
one line on standard input: ``go`` runs Flower's own ``flwr`` with the arguments given (the
launcher writes it when the SuperLink answers and the Flower config names it); anything
else, or the end of standard input (the launcher gave up), exits without running. The
launcher starts it when it starts the SuperLink, so the two start side by side
(results/speed/).
"""

from __future__ import annotations

import os
import sys

GO = b"go\n"


def main() -> int:
    # what Flower's `flwr` console script runs
    from flwr.cli.app import app

    if sys.stdin.buffer.readline() != GO:
        return 0
    devnull = os.open(os.devnull, os.O_RDONLY)   # nothing more comes on standard input
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv = ["flwr", *sys.argv[1:]]
    result = app()
    return 0 if result is None else int(result)


if __name__ == "__main__":
    sys.exit(main())
