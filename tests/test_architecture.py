"""The architecture as a test: import-linter's layering and no-cycle contracts
(``[tool.importlinter]`` in pyproject.toml), and no method name in the shared layers."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dpfl.methods import METHODS

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"
# Layers below the registry, and the apps: none may branch on a method's name.
SHARED = ["dpfl/config.py", "dpfl/method.py", "dpfl/apps", "dpfl/server", "dpfl/client",
          "dpfl/privacy", "dpfl/data", "dpfl/models", "dpfl/tensors.py"]


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml")], cwd=root,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": str(LINT.parent)})


def test_import_contracts_are_kept():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "5 kept, 0 broken" in result.stdout


def test_every_module_of_the_package_is_in_a_layer_and_on_the_map():
    """Issue 50: no module outside the layering contract (import-linter only checks the
    modules its layers name) or missing from docs/architecture.md's layout."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    layers = config["tool"]["importlinter"]["contracts"][0]["layers"]
    named = {m.strip() for layer in layers for m in layer.split("|")}
    top = {f"dpfl.{p.stem}" for p in (ROOT / "dpfl").glob("*.py")
           if p.stem not in ("__init__", "__main__")}
    top |= {f"dpfl.{p.parent.name}" for p in (ROOT / "dpfl").glob("*/__init__.py")}
    assert not sorted(top - named), "modules outside the layers contract"
    layout = (ROOT / "docs" / "architecture.md").read_text().split("## Layout", 1)[1]
    layout = layout.split("##", 1)[0]
    missing = sorted(m for m in top if m.replace(".", "/") not in layout
                     and f" {m.split('.')[1]}.py" not in layout)
    assert not missing, f"not on docs/architecture.md's layout: {missing}"


@pytest.mark.parametrize("module, back_edge", [
    ("dpfl/privacy/accounting/events.py", "import dpfl.methods.gcfl"),     # privacy -> a method
    ("dpfl/server/guard.py", "import dpfl.apps.server"),        # shared server -> app
    ("dpfl/config.py", "import dpfl.privacy.plan"),             # a cycle config <-> privacy
    ("dpfl/runtime/watchdog.py", "import dpfl.runtime.supernode"),  # runtime helper -> wrapper
    ("dpfl/runtime/fab.py", "import dpfl.config"),              # runtime helper -> config
])
def test_contracts_fail_on_a_back_edge(tmp_path, module, back_edge):
    """The same contracts on a copy of the package with one added back-edge: broken."""
    shutil.copytree(ROOT / "dpfl", tmp_path / "dpfl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{back_edge}  # injected by the test\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout


def _string_literals(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docstrings}


def test_shared_layers_never_name_a_method():
    """A branch on a method needs its name as a string: no shared module has one."""
    files = [p for s in SHARED for p in ((ROOT / s).rglob("*.py") if (ROOT / s).is_dir()
                                         else [ROOT / s])]
    assert len(files) > 20
    found = {(str(f.relative_to(ROOT)), name) for f in files
             for name in METHODS if name in _string_literals(f)}
    assert not found, f"method names in shared layers: {sorted(found)}"


def test_the_flower_app_bundle_carries_the_package_and_fits_flowers_limit():
    """`flwr run` packs the repository with Flower's own FAB builder, and the SuperLink refuses
    a FAB over 10 MB. Committed run records (results/) once pushed it past that and every
    federation failed before round 1. The bundle must hold every module of the package, no
    result file, and stay well under the limit."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk
    from flwr.common.constant import FAB_MAX_SIZE

    fab = build_fab_from_disk(ROOT)
    names = set(zipfile.ZipFile(io.BytesIO(fab)).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "dpfl").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules <= names
    assert not [n for n in names if n.startswith(("results/", "tests/", "bench/"))]
    assert len(fab) < FAB_MAX_SIZE / 4


RUFF = Path(sys.executable).parent / "ruff"
LINTED = ["dpfl", "tests", "bench", "deploy"]


def _ruff(root: Path, paths: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), "check", "--no-cache", "--select", "F,I", *paths],
                          cwd=root, capture_output=True, text=True, timeout=120)


def test_no_unused_or_undefined_names_and_sorted_imports():
    """pyflakes (F: unused imports and variables, undefined names) and isort (I), with the
    settings in pyproject.toml's [tool.ruff]."""
    result = _ruff(ROOT, LINTED)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_ruff_fails_on_an_undefined_name(tmp_path):
    """The same check on a copy with one undefined name: it fails and names the file."""
    shutil.copytree(ROOT / "dpfl", tmp_path / "dpfl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "dpfl" / "tensors.py"
    assert _ruff(tmp_path, ["dpfl"]).returncode == 0     # the copy itself is clean
    target.write_text(target.read_text() + "\n\ndef broken():\n    return undefined_name\n")
    result = _ruff(tmp_path, ["dpfl"])
    assert result.returncode == 1
    assert "F821" in result.stdout and "tensors.py" in result.stdout
