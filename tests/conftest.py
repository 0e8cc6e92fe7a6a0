import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")


import pytest  # noqa: E402


@pytest.fixture
def server_identity():
    """The ServerApp and configure_train build real Messages, which need the process's task
    identity (as inside a running ServerApp)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


@pytest.fixture(scope="session", autouse=True)
def dpfl_memo(tmp_path_factory):
    """One memo (dpfl.memo: calibrated sigmas, partitions) for the whole test session,
    shared by the xdist workers and every federation they start, and never the user's own:
    each session starts empty, as on a fresh machine."""
    from dpfl.memo import CACHE_ENV

    if CACHE_ENV in os.environ:     # the caller chose one (or "off")
        yield
        return
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent          # pytest-<n>/, the folder all workers share
    os.environ[CACHE_ENV] = str(base / "dpfl-memo")
    yield
    os.environ.pop(CACHE_ENV, None)
