"""The launch's checks run in a forked child (dpfl.runtime.launch_checks): the launcher never
imports torch, Flower's server or dp-accounting, a refusal crosses as the same error and
message, a failure or a killed child is named, and the lock's re-check sees what changed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dpfl.config import ConfigError
from dpfl.errors import UserError
from dpfl.runtime import preflight
from dpfl.runtime.launch_checks import ChecksFailed, LaunchChecks

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "dp_accounting", "opacus", "scipy", "dpfl.methods", "dpfl.data",
         "dpfl.runtime.preflight",
         "dpfl.apps.server")


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_the_launcher_imports_nothing_heavy_up_to_the_run(tmp_path):
    """What `dpfl simulate` runs in its own process (the CLI, the launch's checks up to the
    lock and its re-check, the end's table) imports none of the heavy libraries: only the
    checks' child loads them. A fresh interpreter, with the federation itself replaced."""
    code = f"""
import json, sys
from pathlib import Path
from dpfl.runtime import launch
import dpfl.cli

seen = []
launch._launch = lambda *args, **kwargs: seen.append(sorted(sys.modules)) or Path("/")
launch.simulate(Path({str(ROOT)!r}), 3, {{"dataset": "digits", "model": "mlp"}},
                Path({str(tmp_path)!r}))
from dpfl.server.report import epsilon_table
print(json.dumps([m for m in {HEAVY!r} if m in seen[0] or m in sys.modules]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_a_plan_crosses_whole_and_the_child_is_reaped(tmp_path):
    with LaunchChecks.start(ROOT, 3, {"dataset": "digits", "model": "mlp", "run-name": "r"},
                            tmp_path) as checks:
        plan = checks.plan()
        pid = checks.pid
    assert plan == preflight.plan_launch(ROOT, 3, {"dataset": "digits", "model": "mlp",
                                                     "run-name": "r"}, tmp_path)
    assert plan.run_dir == tmp_path.resolve() / "r" and plan.overrides["run-name"] == "r"
    assert plan.supernodes == 3 and not plan.resume
    assert _reaped(pid)
    assert not any(tmp_path.iterdir())   # the checks write nothing


@pytest.mark.parametrize("overrides,kind,message", [
    ({"fraction-train": 2.0}, ConfigError, "run-config key 'fraction-train'"),
    ({"min-train-nodes": 9}, UserError, "9 nodes needed but --clients is 3"),
])
def test_a_refusal_crosses_as_the_same_error(tmp_path, overrides, kind, message):
    with LaunchChecks.start(ROOT, 3, {"dataset": "digits", "model": "mlp", **overrides},
                            tmp_path) as checks:
        with pytest.raises(UserError, match=message) as caught:
            checks.plan()
    assert type(caught.value) is kind
    assert str(caught.value).count("\n") == 0


def test_a_failure_of_the_checks_is_named_not_taken_for_a_refusal(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(preflight, "plan_launch", broken)   # the fork inherits it
    with LaunchChecks.start(ROOT, 3, {}, tmp_path) as checks:
        with pytest.raises(ChecksFailed, match="^the launch's checks failed: RuntimeError: boom$"):
            checks.plan()


def test_a_killed_child_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "plan_launch",
                        lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
    with LaunchChecks.start(ROOT, 3, {}, tmp_path) as checks:
        with pytest.raises(ChecksFailed, match=r"ended without an answer \(exit status -9, a "
                                               r"signal\)"):
            checks.plan()
    assert _reaped(checks.pid)


def test_the_recheck_after_the_lock_sees_a_run_created_meanwhile(tmp_path):
    with LaunchChecks.start(ROOT, 3, {"dataset": "digits", "model": "mlp", "run-name": "r"},
                            tmp_path) as checks:
        plan = checks.plan()
        plan.run_dir.mkdir()
        (plan.run_dir / "ledger.json").write_text("{}")   # another launch got there first
        with pytest.raises(UserError, match="run directory .* already exists"):
            checks.recheck_after_lock()


def test_the_recheck_passes_when_nothing_changed(tmp_path):
    with LaunchChecks.start(ROOT, 3, {"dataset": "digits", "model": "mlp"}, tmp_path) as checks:
        checks.plan()
        checks.recheck_after_lock()
