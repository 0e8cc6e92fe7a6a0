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

:func:`app_folder` is dpfl's own app folder: the source checkout, or in an installed dpfl (a
wheel, no checkout) the package's copy of the checkout's ``pyproject.toml`` and ``conf/``,
``dpfl/_flower_app/``, which the wheel build makes (``hatch_build.py``). Its
``fab-include`` patterns (``dpfl/**/*.py``) name the installed package itself, found
beside it (site-packages): staged, it gives the FAB the checkout gives, file for file.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

PYPROJECT = "pyproject.toml"
_GLOB_CHARS = set("*?[]!")
# An installed dpfl's app folder, in the package: the checkout's pyproject.toml (the Flower
# app: components, fab-include, every run-config default) and conf/ (the papers' presets),
# copied unchanged by the wheel build (hatch_build.py)
INSTALLED_APP = "_flower_app"
PROJECT = "dpfl"


def package_dir() -> Path:
    """The folder of the imported ``dpfl`` package (this module's is ``dpfl/runtime``)."""
    return Path(__file__).resolve().parent.parent


def is_installed_app(app: Path) -> bool:
    """Is ``app`` the installed package's app folder (:data:`INSTALLED_APP`)?"""
    return app.resolve() == package_dir() / INSTALLED_APP


def _is_checkout(pyproject: Path) -> bool:
    """Is ``pyproject`` (beside the package) dpfl's own, the source checkout's? A file that
    does not parse is taken as the checkout's (its reader then names the error)."""
    try:
        config = tomllib.loads(pyproject.read_text())
    except tomllib.TOMLDecodeError:
        return True
    return (config.get("project", {}).get("name") == PROJECT
            and "app" in config.get("tool", {}).get("flwr", {}))


def app_folder() -> Path:
    """dpfl's Flower app folder, whose ``pyproject.toml`` holds the run-config defaults: the
    source checkout when dpfl is imported from one (an editable install too), else the
    installed package's copy (:data:`INSTALLED_APP`). FileNotFoundError naming both places
    when neither is there."""
    package = package_dir()
    checkout = package.parent / PYPROJECT
    if checkout.is_file() and _is_checkout(checkout):
        return package.parent
    installed = package / INSTALLED_APP
    if (installed / PYPROJECT).is_file():
        return installed
    raise FileNotFoundError(f"dpfl's Flower app config is missing: neither {checkout} (a source "
                            f"checkout) nor {installed / PYPROJECT} (an installed dpfl) exists; "
                            "reinstall dpfl from its wheel or checkout")


def files_root(app: Path) -> Path:
    """The folder ``app``'s ``fab-include`` patterns are relative to: ``app`` itself, or for
    the installed app folder the one holding the installed package (its patterns name
    ``dpfl/...``)."""
    return package_dir().parent if is_installed_app(app) else app.resolve()


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
    root = files_root(app)
    if root != app and roots is None:   # never walk all of site-packages
        raise ValueError(f"{app / PYPROJECT}: an installed app's fab-include must start with "
                         f"its package's folder (e.g. dpfl/**/*.py), got a pattern that "
                         f"matches at the top of {root}")
    if roots is None:
        files = collect_files(app)
    else:   # the app folder's own top-level files: not site-packages'
        files = ({p.name: p for p in app.iterdir() if p.is_file() and not p.is_symlink()}
                 if root == app else {})
        for top in sorted(roots):
            if (root / top).is_dir() and not (root / top).is_symlink():
                files.update({f"{top}/{rel}": path
                              for rel, path in collect_files(root / top).items()})
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
    """``python -m dpfl.runtime.fab APP DEST``: stage APP's FAB files in DEST and print DEST."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m dpfl.runtime.fab APP DEST", file=sys.stderr)
        return 2
    app = Path(args[0])
    if not (app / PYPROJECT).is_file():
        print(f"APP {app}: no {PYPROJECT} there (not a Flower app folder)", file=sys.stderr)
        return 2
    print(stage_app(app, Path(args[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
