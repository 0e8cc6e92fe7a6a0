"""dpfl.runtime.fab: the staged app builds Flower's own FAB, byte for byte, without the rest of the
app folder (flwr 1.39's build_fab_from_disk on the original folder is the reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from dpfl.runtime.fab import fab_files, main, stage_app

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "myapp"
version = "1.0.0"
dependencies = []

[tool.flwr.app]
publisher = "me"
{include}

[tool.flwr.app.components]
serverapp = "pkg.server:app"
clientapp = "pkg.client:app"

[tool.flwr.app.config]
num-rounds = 2
"""


def _app(root: Path, include: str) -> Path:
    files = {
        "pyproject.toml": PYPROJECT.format(include=include),
        ".gitignore": "__pycache__/\n*.log\n",
        "README.md": "# app\n",
        "pkg/__init__.py": "",
        "pkg/server.py": "app = None\n",
        "pkg/client.py": "app = None\n",
        "pkg/sub/deep.py": "X = 1\n",
        "pkg/notes.md": "not python\n",
        "pkg/__pycache__/server.cpython-311.pyc": "junk",
        "pkg/run.log": "ignored\n",
        "results/table.md": "| a |\n",
        "tests/test_x.py": "def test(): pass\n",
        ".venv/lib/site.py": "import os\n",
        "other/mod.py": "Y = 2\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "pkg" / "link.py").symlink_to(root / "other" / "mod.py")
    return root


@pytest.mark.parametrize("include", ['fab-include = ["pkg/**/*.py"]', ""])
def test_staged_app_builds_flowers_fab_byte_for_byte(tmp_path: Path, include: str) -> None:
    app = _app(tmp_path / "app", include)
    staged = stage_app(app, tmp_path / "staged")
    assert build_fab_from_disk(staged) == build_fab_from_disk(app)


def test_only_the_included_tree_is_walked_and_copied(tmp_path: Path) -> None:
    app = _app(tmp_path / "app", 'fab-include = ["pkg/**/*.py"]')
    assert set(fab_files(app)) == {"pyproject.toml", "pkg/__init__.py", "pkg/server.py",
                                   "pkg/client.py", "pkg/sub/deep.py"}
    staged = stage_app(app, tmp_path / "staged")
    (staged / "stale.py").write_text("left from an earlier run\n")
    stage_app(app, staged)   # a second staging starts from an empty folder
    assert not (staged / "stale.py").exists()


def test_a_glob_at_the_top_falls_back_to_every_file(tmp_path: Path) -> None:
    app = _app(tmp_path / "app", 'fab-include = ["**/*.py"]')
    assert "other/mod.py" in fab_files(app)
    assert build_fab_from_disk(stage_app(app, tmp_path / "s")) == build_fab_from_disk(app)


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    app = _app(tmp_path / "app", 'fab-include = ["pkg/**/*.py"]')
    assert main([str(app), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert main([str(tmp_path), str(tmp_path / "out2")]) == 2
    assert "no pyproject.toml there" in capsys.readouterr().err
