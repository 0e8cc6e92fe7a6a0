"""`dpfl simulate --config FILE` (issue 48, item 7): a preset file under conf/ runs as
`flwr run . --run-config FILE` would, the command line's key=value pairs over it."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from federation import client_runtime_args

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "conf" / "gcfl" / "mnist_eps2.toml"


def test_a_preset_file_runs_with_overrides_over_it(tmp_path):
    preset = tomllib.loads(PRESET.read_text())
    small = ["dataset=digits", "batch-size=32", "num-rounds=1", "val-fraction=0"]
    proc = subprocess.run(
        [sys.executable, "-m", "dpfl.cli", "simulate", "--clients", "2", *client_runtime_args(),
         "--output-dir", str(tmp_path), "--config", str(PRESET.relative_to(ROOT)),
         "strategy=gcfl", *small, "run-name=preset"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    config = json.loads((tmp_path / "preset" / "config.json").read_text())
    for key in ("lr", "max-grad-norm", "target-epsilon", "gcfl-references", "local-epochs"):
        assert config[key] == preset[key], key          # from the file
    assert (config["strategy"], config["dataset"], config["num-rounds"]) == ("gcfl", "digits", 1)
    summary = json.loads((tmp_path / "preset" / "summary.json").read_text())
    assert summary["guarantee"]["verdict"].startswith("formal")
    assert "privacy per client" in proc.stdout
