"""The launcher stops what it started, including children in process groups of their own
(as flower-superlink starts its SuperExec, the simulation and Ray)."""

import subprocess
import time

from dpfl.launch import run_config_arg, stop_process_group
from dpfl.watchdog import alive as _alive, descendants


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
