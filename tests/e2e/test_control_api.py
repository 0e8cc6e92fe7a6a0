"""The SuperLink's Control API is closed to every host but the operator's.

Flower 1.39 serves its Control API (submit a run, register a SuperNode key, list and stop
runs) and its Runtime API (what a ServerApp pulls and pushes) over HTTP on the SuperLink's
``--host``/``--port``, with no account authentication unless an authentication plugin is
configured; TLS only proves the server to the caller. ``deploy/netns.sh up`` therefore binds
them to the loopback of the SuperLink's host (its namespace): only the operator, on that
host, reaches them; the SuperNodes reach only the Fleet API (gRPC, 9092).

One federation (one SuperNode, TLS + SuperNode auth) is brought up for the whole module.
From the SuperNode's namespace, holding the public ``ca.crt`` and nothing else, an intruder
tries ``flwr supernode register``, ``flwr list``/``ls``, ``flwr supernode list``/
``unregister`` and ``flwr run`` against every port the SuperLink listens on beyond loopback
and against 9093: each must exit non-zero, and the operator then sees no new key, no lost
node and no new run. From the SuperLink's namespace the operator's ``flwr list``,
``flwr supernode list`` and ``flwr run`` (a no-op app: no training round) succeed.

They need root, iproute2 with network namespaces, openssl and ssh-keygen: without them a
test skips, or fails under CI=true (see ``tests/requirements.py``)."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from requirements import command_works, missing_requirements, require

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "netns.sh"
VENV_BIN = Path(os.environ.get("DPFL_VENV_BIN", ROOT / ".venv" / "bin"))
PREFIX = "dpflc"  # test namespaces: dpflc-*
LINK_IP = "10.77.0.1"  # deploy/netns.sh's SuperLink address
TOOLS = ("ip", "ss", "openssl", "ssh-keygen")
PROBES = {"ip netns": command_works("ip", "netns", "list")}

NOOP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "noopapp"
version = "1.0.0"
description = "A Flower app that does nothing: stands in for submitted code"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "{publisher}"

[tool.flwr.app.components]
serverapp = "noopapp.app:server"
clientapp = "noopapp.app:client"
"""
NOOP_APP = """\
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

server = ServerApp()
client = ClientApp()


@server.main()
def main(grid, context):
    pass
"""


def _require() -> None:
    require(tools=TOOLS, root=True, probes=PROBES, what="the Control API closure test")


def _noop_app(folder: Path, publisher: str) -> Path:
    """A minimal Flower app (its ServerApp returns at once, no ClientApp is called)."""
    (folder / "noopapp").mkdir(parents=True)
    (folder / "pyproject.toml").write_text(NOOP_PYPROJECT.format(publisher=publisher))
    (folder / "noopapp" / "__init__.py").write_text("")
    (folder / "noopapp" / "app.py").write_text(NOOP_APP)
    return folder


def _flwr(ns: str, home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`flwr ARGS` inside namespace ``ns`` with FLWR_HOME ``home``."""
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PYTHONWARNINGS": "ignore", "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["ip", "netns", "exec", ns, str(VENV_BIN / "flwr"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=home)


class Federation:
    """The module's federation: its state folder and the operator's view of it."""

    def __init__(self, state: Path, work: Path):
        self.state, self.work = state, work
        self.operator_home = state / "flwr-home"  # written by `netns.sh up`

    def operator(self, *args: str) -> subprocess.CompletedProcess:
        return _flwr(f"{PREFIX}-link", self.operator_home, *args)

    def operator_json(self, *args: str) -> dict:
        proc = self.operator(*args, "--format", "json")
        assert proc.returncode == 0, f"operator's flwr {args}: {proc.stdout}{proc.stderr}"
        return json.loads(proc.stdout)

    def node_ids(self) -> set[str]:
        return {n["node-id"] for n in self.operator_json("supernode", "list", "netns")["nodes"]}

    def run_ids(self) -> set[str]:
        return {r["run-id"] for r in self.operator_json("list", "netns")["runs"]}

    def public_listeners(self) -> list[str]:
        """Local addresses of the TCP sockets listening in the SuperLink's namespace on
        anything but loopback (a wildcard address counts: it includes the public one)."""
        out = subprocess.run(["ip", "netns", "exec", f"{PREFIX}-link", "ss", "-ltnH"],
                             capture_output=True, text=True, check=True).stdout
        local = [line.split()[3] for line in out.splitlines() if line.strip()]
        loopback = re.compile(r"^(127\.|\[::1\]|\[::ffff:127\.)")
        return [a for a in local if not loopback.match(a)]


def _sh(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=check)


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    """One `deploy/netns.sh up` (1 SuperNode, TLS + auth) for the module; None when a
    requirement is missing (each test then skips, or fails under CI, on its own)."""
    if missing_requirements(TOOLS, root=True, probes=PROBES):
        yield None
        return
    work = tmp_path_factory.mktemp("control-api")
    state = work / "fed"
    try:
        # no training round here: nothing for a warm node's zygote to preload for
        up = _sh("up", str(state), "--nodes", "1", "--prefix", PREFIX, "--cold-clientapps",
                 check=False)
        assert up.returncode == 0 and "federation up" in up.stdout, up.stdout + up.stderr
        yield Federation(state, work)
    finally:
        _sh("down", str(state), check=False)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{PREFIX}-" not in listed


@pytest.mark.e2e
def test_only_the_fleet_api_listens_beyond_loopback(fed):
    """The SuperLink's public address serves the Fleet API (9092) and nothing else: the
    Control/Runtime HTTP API (9093) listens on the loopback of the SuperLink's host."""
    _require()
    public = fed.public_listeners()
    assert sorted(int(a.rsplit(":", 1)[1]) for a in public) == [9092], public
    assert "127.0.0.1:9093" in subprocess.run(
        ["ip", "netns", "exec", f"{PREFIX}-link", "ss", "-ltnH"], capture_output=True,
        text=True).stdout


@pytest.mark.e2e
def test_control_operations_from_a_supernode_host_are_refused(fed):
    """From the SuperNode's namespace, with the public CA certificate, every Control
    operation against every port the SuperLink exposes (and 9093) fails, and the operator
    sees no new key, no lost node and no new run."""
    _require()
    nodes_before, runs_before = fed.node_ids(), fed.run_ids()
    assert len(nodes_before) == 1
    home = fed.work / "intruder-home"
    home.mkdir(exist_ok=True)
    ports = {int(a.rsplit(":", 1)[1]) for a in fed.public_listeners()} | {9093}
    ca = fed.state / "certs" / "ca.crt"
    conns = "".join(f'[superlink.p{p}]\naddress = "{LINK_IP}:{p}"\nroot-certificates = "{ca}"\n\n'
                    for p in sorted(ports))
    (home / "config.toml").write_text(f'[superlink]\ndefault = "p9093"\n\n{conns}')
    key = fed.work / "rogue"
    if not key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f",
                        str(key)], check=True)
    app = _noop_app(fed.work / "rogue-app", "rogue")
    victim = sorted(nodes_before)[0]
    ns = f"{PREFIX}-n0"
    for port in sorted(ports):
        conn = f"p{port}"
        for args in (("supernode", "register", f"{key}.pub", conn),
                     ("list", conn), ("ls", conn), ("supernode", "list", conn),
                     ("supernode", "unregister", victim, conn),
                     ("run", str(app), conn)):
            proc = _flwr(ns, home, *args)
            out = proc.stdout + proc.stderr
            assert proc.returncode != 0, f"intruder's `flwr {' '.join(args)}` succeeded:\n{out}"
            assert "registered successfully" not in out and "Successfully started" not in out
    assert fed.node_ids() == nodes_before  # no rogue key, the real node still registered
    assert fed.run_ids() == runs_before  # no run submitted


@pytest.mark.e2e
def test_operator_path_on_the_superlink_host_works(fed):
    """The operator, in the SuperLink's namespace, lists runs and nodes and runs an app
    (a no-op ServerApp: the run is submitted, launched and completed; no training)."""
    _require()
    listed = fed.operator("list", "netns")
    assert listed.returncode == 0 and "Listing all runs" in listed.stdout, listed.stderr
    assert "registered successfully" in (fed.state / "register.log").read_text()
    runs_before = fed.run_ids()
    app = _noop_app(fed.work / "operator-app", "operator")
    proc = fed.operator("run", str(app), "netns", "--stream")
    assert proc.returncode == 0 and "Successfully started run" in proc.stdout, \
        proc.stdout + proc.stderr
    runs = fed.operator_json("list", "netns")["runs"]
    new = [r for r in runs if r["run-id"] not in runs_before]
    assert len(new) == 1 and new[0]["fab-id"] == "operator/noopapp", runs
    assert new[0]["status"] == "finished:completed", new[0]
