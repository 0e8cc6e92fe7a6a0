"""Interruptions and impossible settings, end to end through `dpfl simulate` (digits, MLP,
2 clients): a SIGKILL of the launcher leaves no process behind and the resumed run keeps
every charge; a resume whose checkpoint is damaged fails in one line with a non-zero exit
and rewrites nothing (settings that cannot work stop before any process starts:
tests/test_cli_errors.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpfl.runtime.watchdog import alive, descendants

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
COMMON = ["dataset=digits", "model=mlp", "batch-size=32", "lr=0.5", "target-epsilon=8.0",
          "accountant=rdp"]


def _dpfl(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "dpfl.cli", *args], cwd=ROOT, timeout=timeout,
                          capture_output=True, text=True)


def _error_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a failed command printed last on stderr."""
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines, proc.stdout[-2000:]
    assert lines[-1].startswith("error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]


def _processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line mentions ``text`` (e.g. the run's FLWR_HOME)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if text.encode() in cmdline or text.encode() in environ:
                if alive(int(entry)):
                    found.append(int(entry))
    return found


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _epsilons(run: Path) -> dict[str, float]:
    return {c: d["epsilon"] for c, d in
            json.loads((run / "ledger.json").read_text())["clients"].items()}


def test_sigkill_leaves_no_orphans_and_a_resume_keeps_every_charge(tmp_path):
    """SIGKILL `dpfl simulate` after round 1: the SuperLink, SuperExec, simulation and Ray
    processes all die with it (the watchdog), the ledger still holds round 1. The resume
    (asking for 40 rounds; node state is lost, the server hands the recorded events back)
    composes the events exactly like an uninterrupted run, every epsilon stays above what
    was recorded, and the budget (epsilon 3) still binds: the server stops once every
    client refuses. Then the checkpoint is damaged: a further resume is refused in one
    line, exits 2 and rewrites nothing."""
    from opacus.accountants import RDPAccountant

    run = tmp_path / "k"
    args = ["simulate", "--clients", "2", "--parallel-clients", "1", "--output-dir",
            str(tmp_path), "run-name=k",
            "num-rounds=40", "noise-multiplier=1.0", "target-epsilon=3.0",
            *[a for a in COMMON if not a.startswith("target-epsilon")]]
    launcher = subprocess.Popen([sys.executable, "-m", "dpfl.cli", *args], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        rounds = run / "rounds.jsonl"
        _wait_for(lambda: rounds.exists() and rounds.read_text().strip(), 300, "round 1")
        tree = descendants(launcher.pid)
        assert len(tree) >= 4, tree  # watchdog, SuperLink, flwr run, SuperExec, ...
        eps_before = _epsilons(run)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        flwr_home = str(run / ".flwr")
        _wait_for(lambda: not any(alive(p) for p in tree) and
                  not _processes_mentioning(flwr_home), 60, "the federation to stop")
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert eps_before and all(e > 0 for e in eps_before.values())
    resumed = _dpfl(*args, "resume=true")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    lines = [json.loads(l) for l in (run / "rounds.jsonl").read_text().splitlines()]
    done = [l["round"] for l in lines]
    assert done == list(range(1, len(done) + 1)) and 2 < len(done) < 40
    assert all(c["status"] == "refused" for c in lines[-1]["clients"].values())
    eps_after = _epsilons(run)
    assert all(eps_after[c] >= e for c, e in eps_before.items())
    ledger = json.loads((run / "ledger.json").read_text())
    assert ledger["mismatches"] == []
    for client, info in ledger["clients"].items():
        acc = RDPAccountant()
        acc.history = [(e["sigma"], e["rate"], e["steps"]) for e in info["events"]]
        assert info["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
        assert info["reported-epsilon"] == pytest.approx(info["epsilon"], rel=1e-9)
        assert info["epsilon"] <= 3.0  # never overspent, although 40 rounds were asked
        acc.history.append(acc.history[-1])  # the next round would have crossed the budget
        assert acc.get_epsilon(1e-5) > 3.0

    # the model is lost: a resume is refused in one line, exits 2 and rewrites nothing
    (run / "checkpoint.pt").write_bytes((run / "checkpoint.pt").read_bytes()[:100])
    kept = {f: (run / f).read_bytes() for f in ("config.json", "ledger.json", "rounds.jsonl",
                                                   "summary.json")}
    refused = _dpfl(*args, "resume=true")
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    line = _error_line(refused)
    assert "checkpoint.pt is damaged" in line and "resume-without-checkpoint=true" in line
    last_charged = max(c["round"] for c in ledger["charges"])
    assert f"2 clients up to round {last_charged}" in line
    assert {f: (run / f).read_bytes() for f in kept} == kept
