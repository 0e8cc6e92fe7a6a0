"""Static types as a test: mypy over the privacy layer and the method API.

``[tool.mypy]`` in pyproject.toml names the files (``dpfl/privacy``, ``dpfl/method.py``) and
makes them strict; the modules they import are analysed for their types only. mypy keeps its
incremental cache in the checkout's ``.mypy_cache/`` (git-ignored): the first run analyses
torch, numpy and Flower (about 40 s), later runs only what changed (a few seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STRICT_MODULES = ("dpfl.privacy.*", "dpfl.method", "dpfl.privacy_report")


def _mypy_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def test_privacy_and_method_api_type_check():
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}   # the config decides
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--no-error-summary", "--no-color-output", "--show-error-codes"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        f"mypy failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")


def test_the_checked_modules_are_strict():
    """The override of dpfl.privacy.* and dpfl.method sets every per-module flag that mypy's
    ``--strict`` sets (``strict = true`` itself is global-only), the global ones are set
    globally, and the checked files are those modules."""
    from mypy.main import define_options
    from mypy.options import PER_MODULE_OPTIONS

    config = _mypy_config()
    assert set(config["files"]) == {"dpfl/privacy", "dpfl/method.py", "dpfl/privacy_report.py"}
    overrides = [o for o in config.get("overrides", []) if set(STRICT_MODULES) <= set(
        [o["module"]] if isinstance(o["module"], str) else o["module"])]
    assert len(overrides) == 1, "one override must name " + ", ".join(STRICT_MODULES)
    _, _, strict_flags = define_options()
    missing = [(flag, value) for flag, value in strict_flags
               if (overrides[0] if flag in PER_MODULE_OPTIONS else config).get(flag) != value]
    assert not missing, f"flags of --strict not set for {STRICT_MODULES}: {missing}"


def test_the_wheel_carries_py_typed():
    """PEP 561: the installed package says it is typed."""
    from hatchling.builders.wheel import WheelBuilder

    assert (ROOT / "dpfl" / "py.typed").is_file()
    included = {f.distribution_path for f in WheelBuilder(str(ROOT)).recurse_included_files()}
    assert "dpfl/py.typed" in included
