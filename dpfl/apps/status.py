"""How a ServerApp tells the command that launched it how the run ended.

``flwr run`` exits 0 whether or not the ServerApp failed, and a run directory may hold a
``summary.json`` from an earlier run. A launcher (``dpfl simulate``) therefore names a fresh
status file in ``$DPFL_STATUS_FILE`` for each launch; the ServerApp writes it once, at the
end: ``{"status": "ok", "run-dir": ...}`` or ``{"status": "error", "user-error": bool,
"message": ...}``. No file means the ServerApp never finished (crashed or was killed).
Without the variable (e.g. a deployment's ``flwr run``) nothing is written.

``$DPFL_LAUNCHER_PRINTS_SUMMARY=1``: the launcher prints the privacy summary itself when the
run ends (``dpfl simulate``), so the ServerApp does not log it as well (it would appear
twice); without it (a deployment, ``dpfl audit``) the ServerApp's log is where it appears.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dpfl.durable import atomic_write_text

STATUS_ENV = "DPFL_STATUS_FILE"
SUMMARY_ENV = "DPFL_LAUNCHER_PRINTS_SUMMARY"
# the ServerApp's last log line before its "ok" status, when a launcher reads its status: a
# launcher relaying `flwr run --stream` knows from it that every earlier line was relayed
# (Flower uploads a run's log every 0.2 s and streams it every 0.5 s), and never shows it
END_OF_LOG = "dpfl: end of the ServerApp's log"


def end_of_log_line(path: Path) -> str:
    """The end-of-log line for the launch whose status file is ``path``."""
    return f"{END_OF_LOG} ({path.name})"


def launcher_prints_summary() -> bool:
    """True when the command that launched this ServerApp prints the privacy summary."""
    return os.environ.get(SUMMARY_ENV, "") == "1"


def status_path() -> Path | None:
    value = os.environ.get(STATUS_ENV, "")
    return Path(value) if value else None


def write_status(status: str, **fields: Any) -> None:
    """Record how this ServerApp ended, if a launcher asked for it."""
    path = status_path()
    if path is not None:
        atomic_write_text(path, json.dumps({"status": status, **fields}))


def read_status(path: Path) -> dict[str, Any] | None:
    """The status a ServerApp wrote to ``path`` (None when it wrote none)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and "status" in data else None
