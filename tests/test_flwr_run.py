"""dpfl.runtime.flwr_run: Flower's own `flwr`, run only on the launcher's go."""

from __future__ import annotations

import subprocess
import sys

import flwr
import pytest

from dpfl.runtime.flwr_run import GO


def _flwr_run(stdin: bytes, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpfl.runtime.flwr_run", *args], input=stdin,
                          capture_output=True, timeout=120)


def test_on_go_it_runs_flowers_flwr_with_the_arguments_given():
    done = _flwr_run(GO, "--version")
    assert done.returncode == 0, done.stderr
    assert flwr.__version__ in done.stdout.decode()


@pytest.mark.parametrize("stdin", [b"", b"no\n", b"go"])   # EOF, another line, no newline
def test_without_its_go_it_runs_nothing(stdin):
    done = _flwr_run(stdin, "--version")
    assert done.returncode == 0 and done.stdout == b"", done.stderr
