"""Helpers of the end-to-end tests: a real `dpfl simulate` on digits and its run records."""

import ast
import json
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# One ClientApp actor per federation: the clients train one after the other in one process.
# On digits a client's round takes well under a second, while each actor costs ~9 s of CPU
# to start (torch, Opacus, Flower, a Ray worker): two tests in parallel on two cores finish
# sooner this way. test_simulation's end-to-end run and the README examples keep Ray's
# default (one actor per CPU).
ONE_ACTOR = ("--parallel-clients", "1")


def simulate_digits(tmp_path: Path, name: str, *overrides: str, clients: int = 2) -> Path:
    """`dpfl simulate` on digits (batch 32), one ClientApp actor; returns the run
    directory."""
    proc = subprocess.run(
        [sys.executable, "-m", "dpfl.cli", "simulate", "--clients", str(clients), *ONE_ACTOR,
         "--output-dir", str(tmp_path), "dataset=digits", "batch-size=32", f"run-name={name}",
         *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / name


def read_run(run: Path) -> tuple[list[dict], dict, dict, dict]:
    """rounds.jsonl, ledger.json, summary.json, config.json of a run."""
    rounds = [json.loads(l) for l in (run / "rounds.jsonl").read_text().splitlines()]
    return (rounds, *(json.loads((run / f).read_text())
                      for f in ("ledger.json", "summary.json", "config.json")))


# -- dpfl's own warnings and everyone else's ---------------------------------------------------

_PRINTF = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdifrgeExX%]")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# a WARNING log line (Flower's "WARNING :   ...", Ray's "... WARNING file.py:12 -- ...") or a
# Python warning ("path.py:12: UserWarning: ...")
_WARNING_LINE = re.compile(r"\bWARNING\b|\b[A-Z]\w*Warning: ")
_FLOWER_WARNING = re.compile(r"\s*WARNING\s*:\s+(?P<message>.*?)\s*")


@lru_cache(maxsize=1)
def dpfl_warning_messages() -> tuple[re.Pattern[str], ...]:
    """dpfl's own WARNING messages: the format string of every ``<logger>.warning(fmt, ...)``
    and ``<logger>.log(<level>, fmt, ...)`` call in dpfl's sources (all of dpfl's loggers are
    ``flwr.dpfl.*``, printed by Flower's handler as ``WARNING :   <message>``), each as a
    regex whose ``%`` fields match anything."""
    patterns = []
    for path in sorted((ROOT / "dpfl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            position = {"warning": 0, "log": 1}.get(node.func.attr)
            if position is None or len(node.args) <= position:
                continue
            fmt = node.args[position]
            if isinstance(fmt, ast.Constant) and isinstance(fmt.value, str):
                parts = _PRINTF.split(fmt.value)
                patterns.append(re.compile(".*?".join(map(re.escape, parts)), re.S))
    return tuple(patterns)


def foreign_warnings(output: str) -> list[str]:
    """The lines of a `dpfl simulate` output that are a warning and not one of dpfl's own
    (:func:`dpfl_warning_messages`): Flower's, Ray's, Python warnings of any library."""
    foreign = []
    for line in _ANSI.sub("", output).splitlines():
        if not _WARNING_LINE.search(line):
            continue
        own = _FLOWER_WARNING.fullmatch(line)
        if own and any(p.fullmatch(own["message"]) for p in dpfl_warning_messages()):
            continue
        foreign.append(line)
    return foreign
