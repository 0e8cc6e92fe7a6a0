"""Did a deployment's run finish? ``flwr run --stream`` exits 0 whether or not the ServerApp
finished (Flower 1.39); the run's status (``flwr ls --run-id ID --format json``) says
``finished:completed`` only for a ServerApp that returned. dpfl's ServerApp raises when a
run stops early without a launcher's status file (:class:`dpfl.apps.server.RunStopped`), so
Flower records ``finished:failed``; the deployment launchers (``deploy/netns.sh run``,
``dpfl deploy run``) read the status after the stream ends and exit non-zero with one line:
the run id, its status and dpfl's own error line from the stream.

``python -m dpfl.runstatus STREAM_LOG LS_JSON``: exit 0 when the run completed, else print
``error: ...`` and exit 1 (2 when the files cannot tell: no run id, unreadable status).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

COMPLETED = "finished:completed"
RUN_ID = re.compile(r"Successfully started run (\d+)")
# dpfl's own error lines in Flower's log stream ("ERROR :   error: ..."), the stop first
_STOPPED = re.compile(r"ERROR\s*:\s+(the run stopped after round .*)")
_ERROR = re.compile(r"ERROR\s*:\s+error: (.*)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_id_of(stream: str) -> str | None:
    """The run id ``flwr run`` printed (None when it never started one)."""
    found = RUN_ID.findall(_ANSI.sub("", stream))
    return found[-1] if found else None


def status_of(ls_json: str, run_id: str) -> tuple[str, str]:
    """(status, details) of ``run_id`` in ``flwr ls --format json`` output; ValueError when
    the output does not list it."""
    data = json.loads(ls_json)
    for run in data.get("runs", []) if isinstance(data, dict) else []:
        if str(run.get("run-id")) == str(run_id):
            return str(run.get("status", "")), str(run.get("status-details", "") or "")
    raise ValueError(f"run {run_id} is not in the status output")


def why_not_finished(stream: str, status: str, details: str) -> str | None:
    """None for a completed run; else one line: what dpfl's ServerApp said (the stop, or
    its error), else Flower's status details."""
    if status == COMPLETED:
        return None
    text = _ANSI.sub("", stream)
    said = _STOPPED.findall(text) or _ERROR.findall(text)
    reason = said[-1].strip() if said else (details or "no reason in the log")
    return f"the run did not finish ({status}): {reason}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m dpfl.runstatus STREAM_LOG LS_JSON", file=sys.stderr)
        return 2
    stream = Path(args[0]).read_text(errors="replace") if Path(args[0]).exists() else ""
    run_id = run_id_of(stream)
    if run_id is None:
        print("error: flwr run started no run (see its output above)", file=sys.stderr)
        return 2
    try:
        status, details = status_of(Path(args[1]).read_text(errors="replace"), run_id)
    except (OSError, ValueError) as exc:   # json.JSONDecodeError is a ValueError
        print(f"error: run {run_id}: its status could not be read ({exc})", file=sys.stderr)
        return 2
    why = why_not_finished(stream, status, details)
    if why is not None:
        print(f"error: run {run_id}: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
