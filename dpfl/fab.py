"""The Flower app staged as exactly the files its FAB carries, for ``flwr run``.

flwr 1.39's ``flwr run APP`` (``flwr.cli.build.build_fab_from_disk``) first lists every
file under APP (``os.walk`` with a ``resolve()`` per file), and only then applies the app's
``fab-include``. dpfl's app folder is the checkout, which also holds ``.venv`` (~67,000
files), ``runs/``, ``results/`` and ``.git``: that walk took 22 s of a 26 s FAB build here
(measured under load), before every simulation and every deployed run. None of those
files is in the FAB (``fab-include = ["dpfl/**/*.py"]``).

:func:`stage_app` copies ``pyproject.toml`` and the files Flower's own rules select into a
small folder, walking only the top-level folders that the include patterns name; ``flwr
run`` of that folder builds the same FAB, byte for byte (same files, same FAB_DATE), so
its hash, and everything a SuperNode verifies, is unchanged.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

PYPROJECT = "pyproject.toml"
_GLOB_CHARS = set("*?[]!")


def _include_roots(config: dict) -> set[str] | None:
    """The literal first path components of the app's ``fab-include`` patterns, or None
    when a pattern could match at the top level (no include, or a glob in its first
    component): then every file must be listed, as Flower does."""
    patterns = config.get("tool", {}).get("flwr", {}).get("app", {}).get("fab-include")
    if not patterns:
        return None
    roots = set()
    for pattern in patterns:
        first = pattern.lstrip("/").split("/", 1)
        if len(first) < 2 or not first[0] or _GLOB_CHARS & set(first[0]):
            return None
        roots.add(first[0])
    return roots


def fab_files(app: Path) -> dict[str, Path]:
    """The files of ``app`` that flwr 1.39 puts in its FAB, ``pyproject.toml`` included,
    as relative POSIX path -> file."""
    from flwr.cli.build import get_filtered_fab_paths
    from flwr.cli.utils import collect_files, filter_paths_for_publish

    app = app.resolve()
    config = tomllib.loads((app / PYPROJECT).read_text())
    roots = _include_roots(config)
    if roots is None:
        files = collect_files(app)
    else:
        files = {p.name: p for p in app.iterdir() if p.is_file() and not p.is_symlink()}
        for top in sorted(roots):
            if (app / top).is_dir() and not (app / top).is_symlink():
                files.update({f"{top}/{rel}": path
                              for rel, path in collect_files(app / top).items()})
    files = filter_paths_for_publish(files)
    chosen = get_filtered_fab_paths(files, config)
    return {PYPROJECT: app / PYPROJECT, **{p: files[p] for p in chosen}}


def stage_app(app: Path, dest: Path) -> Path:
    """Copy the FAB's files of ``app`` into ``dest`` (emptied first) and return ``dest``:
    ``flwr run dest`` builds the FAB that ``flwr run app`` would, without walking the rest
    of ``app``."""
    files = fab_files(app)
    if dest.exists():
        shutil.rmtree(dest)
    for rel, src in files.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    return dest


def main(argv: list[str] | None = None) -> int:
    """``python -m dpfl.fab APP DEST``: stage APP's FAB files in DEST and print DEST."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m dpfl.fab APP DEST", file=sys.stderr)
        return 2
    app = Path(args[0])
    if not (app / PYPROJECT).is_file():
        print(f"APP {app}: no {PYPROJECT} there (not a Flower app folder)", file=sys.stderr)
        return 2
    print(stage_app(app, Path(args[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
