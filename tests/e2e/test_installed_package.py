"""An installed dpfl runs without its source checkout (issue 48.7): dpfl's wheel, built from
a copy of this checkout's sources and installed (not editable) into a fresh venv, runs
`dpfl simulate` from an unrelated folder, writes its run there, and stages the FAB the
checkout stages, file for file (its pyproject.toml, the run-config defaults, and conf/ are
package data: dpfl.runtime.fab.app_folder, hatch_build.py).

The fresh venv reuses this environment's dependencies instead of downloading them: after
the install, a ``.pth`` file names this environment's site-packages, and each of their
console scripts (flwr, flower-superlink, flwr-simulation, ray, ...) gets a wrapper in the
venv's ``bin/``, as pip would have made, so every process of the run is the venv's Python
importing the installed dpfl. Nothing is written in the checkout: the wheel is built from a
copy in tmp_path."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from requirements import require

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
# what the wheel is built from (pyproject's [project] readme, the build hook, hatchling's
# .gitignore exclusions, the package, the presets the build hook copies)
SOURCES = ("pyproject.toml", "hatch_build.py", "README.md", ".gitignore", "dpfl", "conf")
# a console script for each entry point of the reused distributions (pip's own template)
WRAPPERS = r'''
import sys
from importlib.metadata import entry_points
from pathlib import Path

bin_dir = Path(sys.executable).parent
for ep in entry_points(group="console_scripts"):
    target = bin_dir / ep.name
    if target.exists() or not ep.attr or ep.dist is None or ep.dist.name == "dpfl":
        continue
    target.write_text(f"#!{sys.executable}\nimport re\nimport sys\n"
                      f"from {ep.module} import {ep.attr.split('.')[0]}\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      f"    sys.exit({ep.attr}())\n")
    target.chmod(0o755)
'''
# what the installed dpfl reports about itself: where it runs from, its app folder, the
# files of the FAB it stages (sha256) and of its app folder (pyproject.toml, conf/)
INSPECT = r'''
import hashlib, json, sys
from pathlib import Path
import dpfl
from dpfl.cli import app_dir
from dpfl.runtime.fab import fab_files
app = app_dir()
digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
print(json.dumps({
    "package": str(Path(dpfl.__file__).resolve().parent), "app": str(app),
    "fab": {rel: digest(path) for rel, path in fab_files(app).items()},
    "app-files": {p.relative_to(app).as_posix(): digest(p)
                  for p in sorted(app.rglob("*")) if p.is_file()},
}))
'''


def _copy_sources(dest: Path) -> Path:
    dest.mkdir()
    for name in (*SOURCES, *(p.name for p in ROOT.glob("LICENSE*"))):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}" \
                                 f"\n{proc.stderr[-3000:]}"
    return proc


def _digests(files: dict[str, Path]) -> dict[str, str]:
    return {rel: hashlib.sha256(path.read_bytes()).hexdigest() for rel, path in files.items()}


def _processes_of(folder: Path) -> list[str]:
    """Command lines of live processes that run from ``folder`` (the venv)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(folder) in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


def test_installed_wheel_runs_a_simulation_from_any_folder(tmp_path):
    require(probes={"hatchling (the build backend: pip install -e '.[test]')":
                    lambda: importlib.util.find_spec("hatchling") is not None},
            what="building dpfl's wheel offline")
    t0 = time.monotonic()
    leftovers_before = {p.name for p in ROOT.iterdir()
                        if p.name in ("build", "dist") or p.name.endswith(".egg-info")}
    src = _copy_sources(tmp_path / "src")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp_path / "dist"), str(src)])
    wheel, = (tmp_path / "dist").glob("dpfl-*.whl")

    venv = tmp_path / "venv"
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip",
          str(venv)])
    python = venv / "bin" / "python"
    # a real install into the fresh venv (before it can see this environment's dpfl)
    _run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)])
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                         "['purelib'])"]).stdout.strip())
    reused = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_reused_dependencies.pth").write_text("".join(f"{p}\n" for p in reused))
    _run([str(python), "-c", WRAPPERS])

    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RAY_ADDRESS")}
    # this environment's bin/ off PATH: every command is the venv's
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *(
        d for d in env.get("PATH", "").split(os.pathsep)
        if d and not Path(d).resolve().is_relative_to(Path(sys.prefix).resolve()))])
    env["VIRTUAL_ENV"] = str(venv)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()

    info = json.loads(_run([str(python), "-c", INSPECT], cwd=cwd, env=env).stdout)
    assert Path(info["package"]) == site / "dpfl", info["package"]   # not the checkout's
    assert Path(info["app"]) == site / "dpfl" / "_flower_app"
    from dpfl.runtime.fab import fab_files

    # one source of truth: the installed app stages the checkout's FAB, byte for byte, and
    # carries its pyproject.toml and presets unchanged
    assert info["fab"] == _digests(fab_files(src))
    expected = {"pyproject.toml": src / "pyproject.toml",
                **{p.relative_to(src).as_posix(): p
                   for p in sorted((src / "conf").rglob("*")) if p.is_file()}}
    assert info["app-files"] == _digests(expected)

    doctor = subprocess.run([str(venv / "bin" / "dpfl"), "doctor"], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=120)
    assert f"code at {site / 'dpfl'}" in doctor.stdout, doctor.stdout + doctor.stderr
    assert "verdict: the default demo (dpfl simulate) can run here" in doctor.stdout

    t_run = time.monotonic()
    proc = subprocess.run(
        [str(venv / "bin" / "dpfl"), "simulate", "--clients", "2", "--parallel-clients", "1",
         "num-rounds=1", "train-subset=600", "plots=false"],   # the MNIST default, offline
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    run_seconds = time.monotonic() - t_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary, = (cwd / "runs").glob("*/summary.json")
    assert json.loads(summary.read_text())["guarantee"]["verdict"] == "formal"
    assert "privacy per client — verdict: formal" in proc.stdout
    assert f"run directory: {summary.parent}" in proc.stdout
    assert (summary.parent / "ledger.json").is_file()

    deadline = time.monotonic() + 15   # the launcher stopped its SuperLink and Ray
    while _processes_of(venv) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_of(venv) == []
    assert {p.name for p in ROOT.iterdir()
            if p.name in ("build", "dist") or p.name.endswith(".egg-info")} <= leftovers_before
    print(f"installed-package test: {time.monotonic() - t0:.1f} s "
          f"(dpfl simulate {run_seconds:.1f} s)")
