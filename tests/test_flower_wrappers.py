"""dpfl.runtime.supernode and dpfl.runtime.superlink: two Flower constants made settings,
checked on Flower's own state classes.

dpfl.runtime.supernode: the ClientApp start window of Flower's real SuperNode state.

A ClientApp task claimed at t0 must send its first heartbeat (activate) before t0 + window;
Flower 1.39 fixes the window at 30 s. The test claims a task in Flower's own
``InMemoryNodeState`` (what ``flower-supernode`` uses), moves Flower's clock 45 s on, and
checks that the task is given back (activation refused) with Flower's window, and still
activates with a 120 s window set by :func:`dpfl.runtime.supernode.apply_start_window`.

dpfl.runtime.superlink: the SQLite lock wait of every connection Flower's SQL state opens."""

import subprocess
import sys
from datetime import timedelta

import pytest
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL
from flwr.supercore.constant import TaskType
from flwr.supercore.corestate import in_memory_corestate, sql_corestate
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

from dpfl.runtime import superlink
from dpfl.runtime.supernode import FLOWER_DEFAULT, apply_start_window, split_window


@pytest.fixture
def restore_window():
    saved = (in_memory_corestate.HEARTBEAT_DEFAULT_INTERVAL,
             sql_corestate.HEARTBEAT_DEFAULT_INTERVAL)
    yield
    in_memory_corestate.HEARTBEAT_DEFAULT_INTERVAL, sql_corestate.HEARTBEAT_DEFAULT_INTERVAL \
        = saved


def _activates_after(seconds: float, monkeypatch) -> bool:
    """Claim a task, let ``seconds`` pass on Flower's clock, try to activate it."""
    state = InMemoryNodeState(ObjectStoreFactory().store())
    task_id = state.create_task(TaskType.CLIENT_APP, run_id=1)
    t0 = in_memory_corestate.now()
    monkeypatch.setattr(in_memory_corestate, "now", lambda: t0)
    assert state.claim_task(task_id) is not None
    monkeypatch.setattr(in_memory_corestate, "now", lambda: t0 + timedelta(seconds=seconds))
    return state.activate_task(task_id)


def test_flowers_window_is_the_one_this_module_assumes():
    assert HEARTBEAT_DEFAULT_INTERVAL == FLOWER_DEFAULT


def test_a_slow_clientapp_misses_flowers_window_and_makes_a_wider_one(monkeypatch,
                                                                      restore_window):
    assert _activates_after(10, monkeypatch)       # within 30 s: fine
    assert not _activates_after(45, monkeypatch)   # 45 s: the task went back to pending
    apply_start_window(120.0)
    assert in_memory_corestate.HEARTBEAT_DEFAULT_INTERVAL == 120.0
    assert sql_corestate.HEARTBEAT_DEFAULT_INTERVAL == 120.0
    assert _activates_after(45, monkeypatch)
    assert _activates_after(115, monkeypatch)
    assert not _activates_after(125, monkeypatch)


@pytest.mark.parametrize("argv,window,rest", [
    (["--superlink", "h:1"], None, ["--superlink", "h:1"]),
    (["--clientapp-start-window", "300", "--insecure"], 300.0, ["--insecure"]),
    (["--insecure", "--clientapp-start-window=90"], 90.0, ["--insecure"]),
])
def test_split_window(argv, window, rest):
    assert split_window(argv) == (window, rest)


@pytest.mark.parametrize("module,argv,message", [
    ("dpfl.runtime.supernode", ["--clientapp-start-window"], "needs a value"),
    ("dpfl.runtime.supernode", ["--clientapp-start-window", "soon"], "'soon': expected seconds"),
    ("dpfl.runtime.supernode", ["--clientapp-start-window", "5"], "'5': expected 30..3600 seconds"),
    ("dpfl.runtime.superlink", ["--sqlite-busy-timeout"], "needs a value"),
    ("dpfl.runtime.superlink", ["--sqlite-busy-timeout", "1"], "'1': expected 5..600 seconds"),
])
def test_bad_value_is_one_line_exit_2(module, argv, message):
    proc = subprocess.run([sys.executable, "-m", module, *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{module}: {argv[0]}")
    assert message in lines[0]


@pytest.fixture
def restore_pragmas():
    from flwr.supercore import sql_mixin

    saved = sql_mixin.SQLITE_PRAGMAS
    yield
    sql_mixin.SQLITE_PRAGMAS = saved


def _busy_timeout_ms(tmp_path, name: str) -> int:
    from flwr.supercore.object_store.sql_object_store import SqlObjectStore

    store = SqlObjectStore(str(tmp_path / name))
    store.initialize()
    with store._engine.connect() as conn:
        return int(conn.exec_driver_sql("PRAGMA busy_timeout").scalar())


# Flower's own schema migration (alembic 1.x) on a file database: not dpfl's configuration
@pytest.mark.filterwarnings("ignore:No path_separator found in configuration:DeprecationWarning")
def test_superlink_lock_wait(tmp_path, restore_pragmas):
    assert _busy_timeout_ms(tmp_path, "flower.db") == superlink.FLOWER_DEFAULT * 1000
    superlink.apply_busy_timeout(60.0)
    assert _busy_timeout_ms(tmp_path, "dpfl.db") == 60_000
