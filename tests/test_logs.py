"""Each dpfl log line is printed once, even after Opacus configured the root logger."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A fresh interpreter, as the ServerApp process: Flower's logger, then Opacus imported
# (its module_utils calls logging.basicConfig), then one dpfl line and one library warning.
SCRIPT = """
import logging
import flwr.common.logger
{setup}
import opacus.utils.module_utils
logging.getLogger("flwr.dpfl.test").info("dpfl line %d", 7)
logging.getLogger("flwr").info("flower line")
logging.getLogger("some.library").warning("library warning")
"""


def _run(setup: str) -> str:
    code = textwrap.dedent(SCRIPT.format(setup=setup))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_without_the_guard_opacus_makes_every_line_print_twice():
    """The bug itself, so the test below can fail: Flower's handler plus Opacus's."""
    out = _run("")
    assert out.count("dpfl line 7") == 2
    assert out.count("flower line") == 2


def test_each_line_is_printed_once_and_library_warnings_still_show():
    out = _run("from dpfl.logs import get_logger\nget_logger('flwr.dpfl.server')")
    assert out.count("dpfl line 7") == 1
    assert out.count("flower line") == 1
    assert out.count("library warning") == 1
    assert "WARNING some.library: library warning" in out


def test_a_configured_root_logger_is_left_alone():
    import logging

    from dpfl.logs import guard_root

    root = logging.getLogger()
    before = list(root.handlers)
    probe = logging.NullHandler()
    root.addHandler(probe)
    try:
        guard_root()
        assert root.handlers == before + [probe]
    finally:
        root.removeHandler(probe)


def test_only_flwr_dpfl_names():
    from dpfl.logs import get_logger

    with pytest.raises(ValueError):
        get_logger("dpfl.server")
