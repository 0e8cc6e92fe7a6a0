"""The privacy record of real `dpfl simulate` federations under careless use: a resume with
other settings, a resume from an older ledger without its checkpoint, two launches on one
run folder, a resume of a live run, and SIGTERM (issue cases 1, 2, 3 and 7).

One client-level DP run (2 clients, digits, explicit sigma so that more rounds stay
affordable) is refused two resumes that change its identity (a run-config key, and the
client count, which the command line carries; every key of the identity is refused in
tests/test_record_integrity.py, on the function the launcher calls) and then resumed once
from an older ledger; the
concurrency test runs its own federation and stops it with SIGTERM (resuming a killed run
is tests/e2e/test_interruptions.py's)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import Ledger

from federation import ONE_ACTOR, ROOT, read_run

BASE = ["dataset=digits", "batch-size=32", "model=mlp", "trainer=update-dp", "clip-norm=0.5",
        "noise-multiplier=2.0", "target-epsilon=50", "lr=0.1", "plots=false"]


def _dpfl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpfl.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _simulate(out: Path, *args: str, clients: int | None = 2) -> subprocess.CompletedProcess:
    extra = ["--clients", str(clients)] if clients is not None else []
    return _dpfl("simulate", *extra, *ONE_ACTOR, "--output-dir", str(out), *args)


def _rounds_per_client(run: Path) -> dict[str, list[int]]:
    ledger = Ledger.load(run / "ledger.json")
    return {c: sorted(e.round for e in h.events) for c, h in ledger.clients.items()}


def test_resume_keeps_the_runs_identity_and_never_falls_behind_its_records(tmp_path):
    run = tmp_path / "r"
    # the run starts releasing its train loss in the clear (verdict none) ...
    first = _simulate(tmp_path, "run-name=r", "num-rounds=2", "report-train-loss=true", *BASE)
    assert first.returncode == 0, first.stderr[-3000:]
    config_bytes = (run / "config.json").read_bytes()
    summary_bytes = (run / "summary.json").read_bytes()

    # case 1: another delta or client count is refused before anything runs
    for change, clients in ((["delta=0.01"], None), ([], 4)):
        proc = _simulate(tmp_path, "run-name=r", "resume=true", *change, clients=clients)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert proc.stderr.count("\n") == 1 and "resume" in proc.stderr, proc.stderr
    assert (run / "config.json").read_bytes() == config_bytes
    assert (run / "summary.json").read_bytes() == summary_bytes

    # case 2 and a plain resume together: an older valid ledger (round 1 only) is put back
    # and the checkpoint deleted; a resume with no overrides but num-rounds continues THE
    # run (update-dp, 2 clients: the saved config) and first repairs the ledger from
    # rounds.jsonl
    current = Ledger.load(run / "ledger.json")
    older = Ledger(current.delta, current.accountant, budget=current.budget)
    older.restore([c for c in current.charges if c["round"] == 1], "the test's backup")
    older.save(run / "ledger.json")
    (run / "checkpoint.pt").unlink()
    # ... and resumes without (a key a resume may change): the verdict stays none
    again = _simulate(tmp_path, "run-name=r", "resume=true", "resume-without-checkpoint=true",
                      "num-rounds=3", "report-train-loss=false", clients=None)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "ledger.json was behind rounds.jsonl" in again.stdout + again.stderr
    rounds, ledger, summary, config = read_run(run)
    assert (run / "config.json").read_bytes() == config_bytes     # never rewritten
    assert config["trainer"] == "update-dp" and config["num-clients"] == 2
    assert summary["trainer"] == "update-dp" and summary["guarantee"]["unit"] == "client"
    assert rounds[-1]["round"] == 3 and rounds[-1]["train"]["accepted"] == 2
    assert [r.get("resumed-after-round") for r in summary["resumes"]
            if "repair" not in r] == [2]
    # issue 46.7: a verdict never improves over the run's history (it became formal)
    assert summary["guarantee"]["verdict"] == (
        "none: train-loss is released in the clear (set report-train-loss=false) (in an "
        "earlier part of this run)"), summary["guarantee"]["verdict"]
    assert [r["verdict"] for r in summary["resumes"] if "repair" not in r] == ["formal"]
    assert _rounds_per_client(run) == {"client-0": [1, 2, 3], "client-1": [1, 2, 3]}
    ledger = Ledger.load(run / "ledger.json")
    three = PrivacyHistory([PrivacyEvent.gaussian(r, 2.0, relation="replace-one")
                            for r in (1, 2, 3)]).epsilon(ledger.delta, ledger.accountant)
    for c in ("client-0", "client-1"):
        assert abs(ledger.recomputed(c) - three) <= 1e-9 * three
    report = _dpfl("privacy-report", str(run))
    assert report.returncode == 0, report.stdout[-3000:]

    # issue 46.6: a copy of the folder is a fork of the record: refused while the run exists
    import shutil

    shutil.copytree(run, tmp_path / "copy", ignore=shutil.ignore_patterns(".lock",
                                                                           ".launch.lock"))
    forked = _simulate(tmp_path, "run-name=copy", "resume=true", "num-rounds=4", clients=None)
    assert forked.returncode == 2, forked.stdout[-2000:] + forked.stderr[-2000:]
    assert f"is a copy of {run}" in forked.stderr.strip().splitlines()[-1], forked.stderr
    assert _rounds_per_client(tmp_path / "copy") == _rounds_per_client(run)


def _descendants_alive(pid_file: Path) -> list[int]:
    """The processes still alive under the federation's watchdog (``federation.pid``: the
    SuperLink's) and the simulation's (``simulation.pid``: the early zygote's, beside it)."""
    from dpfl.runtime.watchdog import alive, descendants

    out = []
    for path in (pid_file, pid_file.with_name("simulation.pid")):
        if path.exists():
            root = int(path.read_text())
            out += [p for p in [root, *descendants(root)] if alive(p)]
    return out


def test_one_writer_per_run_folder_and_sigterm_ends_the_run(tmp_path):
    run = tmp_path / "c"
    # long enough to be mid-run when the SIGTERM comes (30 rounds of this federation once
    # ended while the two refused launches below ran): 300 rounds, at a sigma that affords them
    long_run = [b for b in BASE if not b.startswith("noise-multiplier=")] + [
        "noise-multiplier=20.0"]
    cmd = [sys.executable, "-m", "dpfl.cli", "simulate", "--clients", "2", *ONE_ACTOR,
           "--output-dir", str(tmp_path), "run-name=c", "num-rounds=300", *long_run]
    live = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "rounds.jsonl").exists() or not (run / "rounds.jsonl").read_text():
            assert live.poll() is None, live.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the first round never finished"
            time.sleep(1)
        # case 3: a second launch, and a resume of the live run, are refused naming its PID
        for extra in ([], ["resume=true"]):
            proc = _simulate(tmp_path, "run-name=c", "num-rounds=2", *BASE, *extra)
            assert proc.returncode == 2, proc.stderr[-2000:]
            assert f"in use by process {live.pid}" in proc.stderr, proc.stderr
        assert sorted(p.name for p in run.iterdir() if p.name.startswith("rounds")) == [
            "rounds.jsonl"]
        # case 7: SIGTERM ends the run within a bounded time, with its tree stopped
        pid_file = run / ".flwr" / "federation.pid"
        assert _descendants_alive(pid_file)
        assert not (run / "summary.json").exists(), "the run ended before the SIGTERM"
        t0 = time.monotonic()
        live.send_signal(signal.SIGTERM)
        code = live.wait(timeout=90)
        assert code == 128 + signal.SIGTERM, live.stderr.read()[-3000:]
        assert time.monotonic() - t0 < 60
        deadline = time.monotonic() + 30
        while _descendants_alive(pid_file) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _descendants_alive(pid_file) == []
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()
    # nothing was written twice: one writer held the folder all along
    lines = [json.loads(x) for x in (run / "rounds.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == list(range(1, len(lines) + 1))
    assert not (run / "summary.json").exists()
