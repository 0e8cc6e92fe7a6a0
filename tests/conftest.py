import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
# One OpenMP thread for torch in every process the tests start (inherited: ServerApps, the
# launcher, SuperNodes' ClientApps, attacks; Ray's actors already get one): `make test`'s
# xdist workers keep both cores busy, and a second thread per process only spins and waits.
# Measured on test_methods.py's dpfedprox, gcfl and dpfedexp runs (-n 0, all processes'
# CPU): 135 s with torch's default two threads, 117 s with one. Over the whole suite the
# gain is smaller: the ServerApps' CPU went from 434 s to 411 s (two CI-like runs).
os.environ.setdefault("OMP_NUM_THREADS", "1")


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


@pytest.fixture(scope="session", autouse=True)
def dpfl_state_home(tmp_path_factory):
    """The run-identity registry (dpfl.server.runregistry) of the whole test session, never
    the user's own (~/.local/state/dpfl): federations the tests start inherit it."""
    from dpfl.server.runregistry import STATE_ENV

    if STATE_ENV in os.environ:
        yield
        return
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    os.environ[STATE_ENV] = str(base / "dpfl-state")
    yield
    os.environ.pop(STATE_ENV, None)


# The order `make test`'s two xdist workers take the test files in (`--dist loadfile
# --no-loadscope-reorder`): the end-to-end files first, longest first, so that the short
# unit-test files fill the end and neither worker waits on the other's last long file.
# (xdist's default reorder starts the files with the MOST tests, the unit files, and left
# the whole e2e suite, and the image build, for the end.) Rough cost in seconds of each
# file's tests on this 2-core machine (a clean-clone CI's junit); files not listed follow,
# in collection order.
# test_containers.py (its own cost ~550) comes third, after the two longest files, which need
# no image: its image's network-bound steps run from the session's start
# (pytest_sessionstart) and are done by the time a worker takes it.
E2E_FILE_COST = {
    "test_netns.py": 400, "test_methods.py": 370, "test_containers.py": 360,
    "test_methods_sparse_adaptive.py": 280, "test_attack_audit.py": 260,
    "test_trust_federation.py": 200, "test_hostile_nodes.py": 175,
    "test_record_integrity_federation.py": 170, "test_interruptions.py": 110,
    "test_simulation.py": 110, "test_readme_examples.py": 85, "test_ray_cluster.py": 70,
    "test_control_api.py": 50,
}


def _stop_shared_ray() -> None:
    federation = sys.modules.get("federation")
    if federation is not None:
        federation.stop_shared_ray()


def pytest_runtest_teardown(item, nextitem):
    """After a test file's last test, stop the Ray head its federations shared
    (tests/e2e/federation.py; the next file that needs one starts it again): an idle head
    costs ~1.4 s of CPU a minute (raylet, log monitor, GCS), measured here."""
    if nextitem is None or nextitem.path != item.path:
        _stop_shared_ray()


_PREBUILD = pytest.StashKey()


def pytest_sessionstart(session):
    """The container tests' network-bound image steps start now, in the background
    (``tests/image_prebuild.py``): in the controller of an xdist session (before it starts
    the workers, which inherit the folder's name), or in a session without workers."""
    if hasattr(session.config, "workerinput"):
        return
    import image_prebuild

    folder = image_prebuild.start(list(session.config.args))
    if folder is not None:
        session.config.stash[_PREBUILD] = folder


def pytest_sessionfinish(session, exitstatus):
    """Stop the Ray head of this process, if one is still up, and the image prebuild."""
    _stop_shared_ray()
    folder = session.config.stash.get(_PREBUILD, None)
    if folder is not None:
        import image_prebuild

        image_prebuild.stop(folder)


def pytest_collection_modifyitems(session, config, items):
    """Longest files first (see :data:`E2E_FILE_COST`); a stable sort keeps each file's own
    order."""
    items.sort(key=lambda item: -E2E_FILE_COST.get(item.path.name, 0))
