"""The launcher stops what it started, including children in process groups of their own
(as flower-superlink starts its SuperExec, the simulation and Ray)."""

import os
import subprocess
import time

from dpfl.runtime.launch import run_config_arg, stop_process_group
from dpfl.runtime.watchdog import alive as _alive
from dpfl.runtime.watchdog import descendants


def test_stop_process_group_reaches_children_in_their_own_groups():
    proc = subprocess.Popen(["bash", "-c", "setsid sleep 300 & sleep 300 & wait"],
                            start_new_session=True)
    deadline = time.monotonic() + 10
    while len(descendants(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    kids = descendants(proc.pid)
    assert len(kids) >= 2
    stop_process_group(proc, grace=2.0)
    assert proc.poll() is not None
    time.sleep(0.2)
    assert not any(_alive(k) for k in kids)


def test_run_config_arg_quotes_strings_only():
    assert run_config_arg({"a": 1, "b": 0.5, "c": True, "d": "x y"}) == 'a=1 b=0.5 c=true d="x y"'


def _pids_of(marker: str) -> list[int]:
    """Live processes named ``marker`` (argv[0])."""
    import os
    from pathlib import Path

    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if cmd.split(b"\0")[0] == marker.encode() and _alive(int(entry)):
                out.append(int(entry))
    return out


def test_watchdog_stops_escaped_grandchildren_when_its_launcher_is_sigkilled(tmp_path):
    """A launcher starts the watchdog over a command whose children escape the usual ways
    (a new session, a double fork that orphans the grandchild). SIGKILL the launcher: the
    watchdog, their subreaper, stops all of them."""
    import signal
    import sys
    import uuid

    marker = f"dpfl-watchdog-test-{uuid.uuid4().hex}"
    tree = (f"setsid bash -c 'exec -a {marker} sleep 301' & "
            f"(bash -c 'exec -a {marker} sleep 302' &) ; exec -a {marker} sleep 303")
    launcher_code = ("import subprocess, sys, time\n"
                     "subprocess.Popen([sys.executable, '-m', 'dpfl.runtime.watchdog', '--parent', "
                     "str(__import__('os').getpid()), '--grace', '1', '--', 'bash', '-c', "
                     f"{tree!r}], start_new_session=True)\n"
                     "time.sleep(300)\n")
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code])
    deadline = time.monotonic() + 60
    while len(_pids_of(marker)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_pids_of(marker)) >= 3, _pids_of(marker)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while _pids_of(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pids_of(marker) == []


def test_watchdog_outlives_its_command_while_the_tree_runs_and_stops_it_when_told():
    """``--outlive-command`` (the early simulation zygote's watchdog): the command forks a
    task and exits; the watchdog watches on while the task runs, exits by itself once it
    ended, and a SIGTERM stops a task still running."""
    import signal
    import sys
    import uuid

    def watched(seconds: float, marker: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "dpfl.runtime.watchdog", "--parent", str(os.getpid()),
             "--grace", "1", "--outlive-command", "--", "bash", "-c",
             f"(exec -a {marker} sleep {seconds} &) ; exit 0"], start_new_session=True)

    marker = f"dpfl-watchdog-outlive-{uuid.uuid4().hex}"
    dog = watched(3, marker)
    deadline = time.monotonic() + 30
    while not _pids_of(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pids_of(marker)
    time.sleep(1.0)
    assert dog.poll() is None            # the command exited; its task still runs
    assert dog.wait(timeout=30) == 0     # the task ended: the watchdog with it
    assert _pids_of(marker) == []

    marker = f"dpfl-watchdog-outlive-{uuid.uuid4().hex}"
    dog = watched(300, marker)
    while not _pids_of(marker) and time.monotonic() < deadline + 30:
        time.sleep(0.05)
    assert _pids_of(marker)
    dog.send_signal(signal.SIGTERM)
    assert dog.wait(timeout=30) == 128 + signal.SIGTERM
    assert _pids_of(marker) == []


def test_a_watchdog_told_the_work_ended_gives_its_tree_a_short_grace():
    """SIGUSR1 (the run ended: the launcher's stop of a finished simulation), or its
    launcher's death: a process that ignores SIGTERM is killed after the short grace, not
    the 20 s one; SIGTERM still gives the whole grace."""
    import signal
    import sys
    import uuid

    import pytest

    from dpfl.runtime.watchdog import ENDED_GRACE, ENDED_SIGNAL

    ignoring = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "time.sleep(300)")

    def watched(marker: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "dpfl.runtime.watchdog", "--parent", str(os.getpid()),
             "--grace", "20", "--", "bash", "-c",
             f"exec -a {marker} {sys.executable} -c '{ignoring}'"],
            start_new_session=True)

    for sig, quick in ((ENDED_SIGNAL, True), (signal.SIGTERM, False)):
        marker = f"dpfl-watchdog-ended-{uuid.uuid4().hex}"
        dog = watched(marker)
        deadline = time.monotonic() + 30
        while not _pids_of(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pids_of(marker)
        time.sleep(0.3)   # the watchdog's handlers are installed
        start = time.monotonic()
        dog.send_signal(sig)
        if quick:
            assert dog.wait(timeout=10) == 128 + sig
            assert time.monotonic() - start < ENDED_GRACE + 2.0
            assert _pids_of(marker) == []
        else:
            with pytest.raises(subprocess.TimeoutExpired):
                dog.wait(timeout=3)       # SIGTERM ignored: the grace runs
            assert _pids_of(marker)
            dog.send_signal(ENDED_SIGNAL)   # no effect once stopping: the grace is set
            os.killpg(dog.pid, signal.SIGKILL)
            dog.wait(timeout=10)
            for pid in _pids_of(marker):
                os.kill(pid, signal.SIGKILL)
    # a launcher that dies: nobody will hear how the run ends, its tree gets the short grace
    # (a simulation given the long one on SIGTERM ran rounds of its own meanwhile)
    marker = f"dpfl-watchdog-orphaned-{uuid.uuid4().hex}"
    launcher_code = ("import subprocess, sys, time\n"
                     "subprocess.Popen([sys.executable, '-m', 'dpfl.runtime.watchdog', '--parent', "
                     "str(__import__('os').getpid()), '--grace', '20', '--', 'bash', '-c', "
                     f"{'exec -a ' + marker + ' ' + sys.executable + ' -c ' + repr(ignoring)!r}], "
                     "start_new_session=True)\n"
                     "time.sleep(300)\n")
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code])
    deadline = time.monotonic() + 30
    while not _pids_of(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pids_of(marker)
    time.sleep(0.3)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    start = time.monotonic()
    while _pids_of(marker) and time.monotonic() - start < 15:
        time.sleep(0.05)
    assert _pids_of(marker) == [] and time.monotonic() - start < ENDED_GRACE + 3.0


def test_outcome_trusts_only_this_launchs_status(tmp_path):
    """`dpfl simulate` exits 0 only when the ServerApp of this launch reported success and
    its summary exists; an old summary.json proves nothing."""
    import json

    import pytest

    from dpfl.errors import UserError
    from dpfl.runtime.launch import RunFailed, _outcome

    run, status, log = tmp_path / "run", tmp_path / "status.json", tmp_path / "superlink.log"
    run.mkdir()
    (run / "summary.json").write_text("{}")  # left by an earlier run
    with pytest.raises(RunFailed, match="did not finish"):
        _outcome(status, run, 0, log)
    status.write_text(json.dumps({"status": "error", "user-error": True,
                                  "message": "checkpoint.pt is damaged"}))
    with pytest.raises(UserError, match="checkpoint.pt is damaged"):
        _outcome(status, run, 0, log)
    status.write_text(json.dumps({"status": "error", "user-error": False,
                                  "message": "RuntimeError: boom"}))
    with pytest.raises(RunFailed, match="ServerApp failed: RuntimeError: boom"):
        _outcome(status, run, 0, log)
    status.write_text(json.dumps({"status": "ok", "run-dir": str(run)}))
    assert _outcome(status, run, 0, log) == run
    (run / "summary.json").unlink()
    with pytest.raises(RunFailed, match="wrote no"):
        _outcome(status, run, 0, log)


def test_the_launcher_relays_flwr_runs_stream_without_flowers_misleading_line():
    """Flower 1.39 logs "default simulated SuperNodes changed" at every simulation's start,
    whatever its size, and each Ray actor "Manually terminating ClientAppActor" at a normal
    end: those exact lines (coloured or not) are dropped, everything else kept."""
    import io

    from dpfl.runtime.launch import relay_stream

    noise = "WARNING :   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.\n"
    coloured = noise.replace("WARNING ", "\x1b[93mWARNING \x1b[0m")
    kept = ["\x1b[92mINFO \x1b[0m:      Starting Flower Simulation\n",
            "WARNING :   round 1: no valid update; the global model is unchanged\n",
            noise.replace("to 2.", "to 2. (and more)"), "last line without newline"]
    actor = ("\x1b[36m(ClientAppActor pid=24784)\x1b[0m \x1b[93mWARNING \x1b[0m:   Manually "
             "terminating ClientAppActor\n")
    logstream = ["\x1b[92mINFO \x1b[0m:      Starting logstream for run_id `4270501234210878284`\n",
                 "\x1b[92mINFO \x1b[0m:      Exiting logstream\n"]
    stream = io.BytesIO("".join([logstream[0], kept[0], coloured, kept[1], noise, actor,
                                 kept[2], logstream[1], kept[3]]).encode())
    out = io.BytesIO()
    relay_stream(stream, out)
    assert out.getvalue().decode() == "".join(kept)
    text = io.StringIO()
    relay_stream(io.BytesIO(b"x\n" + noise.encode()), text)
    assert text.getvalue() == "x\n"


def test_the_stream_relay_says_when_the_serverapps_last_line_came(tmp_path):
    """The ServerApp's end-of-log line (for this launch's status file) is not shown: it
    sets the event the launcher waits on; another launch's line is relayed as it is."""
    import io
    import threading

    from dpfl.apps.status import end_of_log_line
    from dpfl.runtime.launch import relay_stream

    ours, other = end_of_log_line(tmp_path / "status-aa.json"), end_of_log_line(
        tmp_path / "status-bb.json")
    lines = ["INFO :      round 3: accuracy 0.9\n", f"INFO :      {other}\n",
             f"\x1b[92mINFO \x1b[0m:      {ours}\n", "INFO :      after\n"]
    out, relayed = io.BytesIO(), threading.Event()
    relay_stream(io.BytesIO("".join(lines[:2]).encode()), out, ours, relayed)
    assert not relayed.is_set()
    relay_stream(io.BytesIO("".join(lines[2:]).encode()), out, ours, relayed)
    assert relayed.is_set()
    assert out.getvalue().decode() == lines[0] + lines[1] + lines[3]


def test_the_launcher_stops_flwr_run_once_the_serverapp_said_ok(tmp_path):
    """After the ServerApp's status file says ok (or a user error), `flwr run` is stopped
    once the stream relayed the ServerApp's last line, or after the linger when that line
    does not come (Flower's own simulation shutdown adds ~4 s and nothing to the run);
    before it, or on a crash's status, the launcher waits for its exit code."""
    import json
    import threading

    import pytest

    from dpfl.runtime.launch import wait_for_run

    status = tmp_path / "status.json"
    proc = subprocess.Popen(["sleep", "60"])
    with pytest.raises(subprocess.TimeoutExpired):
        wait_for_run(proc, status, timeout=0.5)      # no status yet: still waiting
    status.write_text(json.dumps({"status": "error", "user-error": False, "message": "x"}))
    with pytest.raises(subprocess.TimeoutExpired):
        wait_for_run(proc, status, timeout=0.5)      # a crash: flwr run's own exit decides
    status.write_text(json.dumps({"status": "ok", "run-dir": "r"}))
    relayed = threading.Event()
    start = time.monotonic()
    assert wait_for_run(proc, status, timeout=30, log_relayed=relayed, linger=0.3) == 0
    assert 0.3 <= time.monotonic() - start < 5 and proc.poll() is not None
    for said in ({"status": "ok", "run-dir": "r"},
                 {"status": "error", "user-error": True, "message": "bad key"}):
        status.write_text(json.dumps(said))
        proc = subprocess.Popen(["sleep", "60"])
        relayed.set()   # the last line came: no linger
        start = time.monotonic()
        assert wait_for_run(proc, status, timeout=30, log_relayed=relayed, linger=10) == 0
        assert time.monotonic() - start < 2 and proc.poll() is not None
    proc = subprocess.Popen(["sleep", "60"])   # no stream relayed (quiet): no linger
    start = time.monotonic()
    assert wait_for_run(proc, status, timeout=30, linger=10) == 0
    assert time.monotonic() - start < 2
    quick = subprocess.Popen(["sh", "-c", "exit 3"])
    assert wait_for_run(quick, tmp_path / "none.json", timeout=30) == 3
