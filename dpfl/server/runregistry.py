"""One branch per run: a copied run folder cannot be resumed beside its original.

A run folder holds the privacy record of the clients' data. Copy it and resume both copies
and each ledger shows its own spend while the data's owners paid for both branches (a
review resumed two copies to three releases per partition, each ledger showing 3.996 of
4.2). So a run gets an identity when it starts (``identity.json`` in its folder: a random
UUID, copied with the folder) and this machine keeps, outside every run folder, which
folder holds each identity (``$DPFL_STATE_HOME``, else ``$XDG_STATE_HOME/dpfl``, else
``~/.local/state/dpfl``; one small JSON file per run). A resume claims its identity:

- the registered folder (the same directory: same device and inode, wherever it was
  moved or renamed to) resumes;
- another folder with the same identity while the registered one still exists is a copy:
  refused in one line naming the original (resume it, or start a new run);
- a registered folder that no longer exists (moved to another file system, deleted) hands
  the identity to the folder that claims it, with a warning.

What it does not cover: a copy resumed on another machine (each machine has its own
registry; in deployments the SuperNodes' own records, node-config ``privacy-dir``, are what
carries a client's spend across servers), or a registry deleted by hand.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from dpfl.durable import atomic_write_text
from dpfl.errors import UserError
from dpfl.logs import get_logger

log = get_logger("flwr.dpfl.runregistry")
IDENTITY_FILE = "identity.json"
STATE_ENV = "DPFL_STATE_HOME"


def registry_dir() -> Path:
    """Where this machine records which folder holds each run identity."""
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV]) / "runs"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "dpfl" / "runs"


def _where(folder: Path) -> dict[str, object]:
    st = os.stat(folder)
    return {"folder": str(Path(folder).resolve()), "dev": st.st_dev, "ino": st.st_ino}


def _same_directory(entry: dict, folder: Path) -> bool:
    try:
        st = os.stat(folder)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (entry.get("dev"), entry.get("ino"))


def _entry_path(identity: str) -> Path:
    return registry_dir() / f"{identity}.json"


def _register(identity: str, folder: Path) -> None:
    path = _entry_path(identity)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"run-identity": identity, **_where(folder)}))


def start(folder: Path) -> str:
    """A new run's identity: written into its folder and registered (returns it)."""
    identity = uuid.uuid4().hex
    atomic_write_text(Path(folder) / IDENTITY_FILE, json.dumps({"run-identity": identity}))
    _register(identity, folder)
    return identity


def _identity_of(folder: Path) -> str | None:
    path = Path(folder) / IDENTITY_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        identity = data["run-identity"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{path}: damaged run identity; restore it from a backup of this run "
                        "folder (refusing to resume: it could be a copy)") from None
    if not (isinstance(identity, str) and len(identity) == 32
            and all(c in "0123456789abcdef" for c in identity)):
        raise UserError(f"{path}: not a dpfl run identity (refusing to resume)")
    return identity


def claim(folder: Path) -> str:
    """The identity a resume of ``folder`` continues, after checking this folder is the
    run's one branch (:class:`UserError` for a copy of a folder that still exists). A
    folder from before identities were kept gets one now."""
    folder = Path(folder)
    identity = _identity_of(folder)
    if identity is None:
        return start(folder)
    path = _entry_path(identity)
    try:
        entry = json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):
        entry = None
    if not isinstance(entry, dict):
        _register(identity, folder)
        return identity
    if _same_directory(entry, folder):
        if entry.get("folder") != str(folder.resolve()):
            _register(identity, folder)          # moved or renamed: follow it
        return identity
    original = Path(str(entry.get("folder", "")))
    if original.exists() and _same_directory(entry, original):
        raise UserError(f"run directory {folder} is a copy of {original} (run identity "
                        f"{identity}): resuming both would spend the clients' privacy budget "
                        f"twice; resume {original}, or start a new run")
    log.warning("run %s: its folder %s is gone; %s continues it", identity, original, folder)
    _register(identity, folder)
    return identity
