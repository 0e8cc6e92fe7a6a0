"""`dpfl --help`, each command's --help and the commands' argument errors start in a blink:
the CLI imports torch, Opacus and Flower only once a command really runs (issue 28)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "opacus", "flwr", "numpy", "dpfl.attacks", "dpfl.runtime.launch")

PROBE = """
import sys
from dpfl.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:   # argparse's --help
    code = exc.code
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
print("HEAVY", heavy, "EXIT", code, file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [
    ["--help"], ["simulate", "--help"], ["reproduce", "--help"], ["deploy", "--help"],
    ["audit", "--help"], ["summary", "/no/such/run"], ["privacy-report", "/no/such/run"],
    ["attack", "/no/such/run"], ["audit", "/no/such/run"],
    ["simulate", "seed=1", "seed=2"],
    # issue 48: a misspelled key, a bad global value, an abbreviated option: refused before
    # torch, Opacus or Flower is imported (~0.1 s, not ~3 s)
    ["simulate", "num-round=3"], ["simulate", "num-rounds=0"], ["simulate", "lr=nan"],
    ["simulate", "trust=central"], ["simulate", "--client", "4"],
])
def test_help_and_argument_errors_import_nothing_heavy(argv):
    proc = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    last = proc.stderr.strip().splitlines()[-1]
    assert last.endswith(" EXIT 0" if "--help" in argv else " EXIT 2"), proc.stderr
    if argv == ["reproduce", "--help"]:   # its epilog lists every paper's cells: imports them
        assert "papers, their cells and methods" in proc.stdout and "gcfl" in proc.stdout
    else:
        assert last.startswith("HEAVY [] EXIT "), proc.stderr
