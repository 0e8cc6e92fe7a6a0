"""Containers on a real Docker engine started by this test session: the docker-compose
federation (TLS + SuperNode auth) runs DP rounds, and `dpfl deploy up --clients 4` (Docker SDK)
completes a DP round with four distinct partitions. In both, the SuperLink's Control API is
closed to the SuperNodes: only the Fleet API listens beyond the SuperLink's loopback, and the
operator's path (in the SuperLink's namespace) works. The compose federation also tries the
intruder's operations: from a SuperNode container, `flwr supernode register`, `flwr list` and
`flwr run` against the SuperLink fail (both deployments bind the same way, which the
listening-port check proves; the attempts cost ~25 s of CPU, so they run once).

The module starts its own ``dockerd`` (own data-root, exec-root and socket on a tmpfs, no
iptables rules, no default bridge), builds the base image locally with debootstrap (no
registry is reachable) and the dpfl image once (deploy/image.sh), and stops the daemon by PID
after its last test.

Without root and the tools below a test skips, or fails under CI=true naming what is
missing (see ``tests/requirements.py``; .ci/run installs them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import image_prebuild
from requirements import missing_requirements, require

ROOT = Path(__file__).resolve().parents[2]
NEEDED = image_prebuild.NEEDED
IMAGE = "dpfl:test"
BASE = "dpfl-local/python:3.11"
RUN_CONFIG = 'dataset="digits" batch-size=32 lr=0.5 target-epsilon=8.0 '


def _assert_bound_by_key(run: Path, clients: int) -> None:
    """The run charged replies by the node ids registered for each key (node-partitions)."""
    mapping = json.loads((run / "config.json").read_text())["node-partitions"]
    assert sorted(int(p.split(":")[1]) for p in mapping.split(",")) == list(range(clients))


def _require_engine(environ=None) -> None:
    """Root and every tool the private Docker engine, the images and the federations need."""
    require(tools=NEEDED, root=True, what="the container test", environ=environ)


def test_missing_engine_tools_fail_under_ci_and_skip_outside(monkeypatch):
    """The check these tests start with (quick: no engine is started)."""
    monkeypatch.setenv("PATH", "")
    names = ", ".join(f"'{t}' on PATH" for t in NEEDED)
    with pytest.raises(pytest.fail.Exception, match=f"container test needs {names}.*CI=true"):
        _require_engine({"CI": "true"})
    with pytest.raises(pytest.skip.Exception, match="'dockerd' on PATH"):
        _require_engine({})
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.fail.Exception, match="root"):
        _require_engine({"CI": "true"})


def test_the_image_prebuild_starts_only_for_a_session_that_selects_this_file(tmp_path):
    """tests/image_prebuild.py: the session's path arguments decide (no steps are run)."""
    here = Path(__file__)
    for args in (["tests"], [str(here.parent)], [f"{here}::test_compose_files_validate"],
                 ["tests/test_cpsgd.py", str(here)]):
        assert image_prebuild.selects_container_tests(args), args
    for args in (["tests/test_cpsgd.py"], [str(here.parent / "test_netns.py")], []):
        assert not image_prebuild.selects_container_tests(args), args
    (tmp_path / "base.rc").write_text("0\n")
    (tmp_path / "wheels.rc").write_text("1\n")
    (tmp_path / "wheels.log").write_text("pip wheel failed: no network\n")
    assert image_prebuild.wait(tmp_path, timeout=1) == {
        "wheels": "exit 1: pip wheel failed: no network\n"}
    image_prebuild.stop(tmp_path)
    assert not tmp_path.exists()


NOOP_APP = {
    "pyproject.toml": '[build-system]\nrequires = ["hatchling"]\nbuild-backend = '
                      '"hatchling.build"\n\n[project]\nname = "noopapp"\nversion = "1.0.0"\n'
                      'description = "x"\nlicense = "Apache-2.0"\ndependencies = []\n\n'
                      '[tool.flwr.app]\npublisher = "rogue"\n\n[tool.flwr.app.components]\n'
                      'serverapp = "noopapp.app:server"\nclientapp = "noopapp.app:client"\n',
    "noopapp/__init__.py": "",
    "noopapp/app.py": "from flwr.clientapp import ClientApp\nfrom flwr.serverapp import "
                      "ServerApp\n\nserver = ServerApp()\nclient = ClientApp()\n\n\n"
                      "@server.main()\ndef main(grid, context):\n    pass\n",
}


def _listening_ports(env: dict[str, str], container: str) -> dict[int, set[str]]:
    """TCP ports listening in a container's network namespace -> their local addresses (hex,
    as /proc/net/tcp{,6} writes them); read from /proc: the image has no ss/netstat."""
    out = _run(["docker", "exec", container, "cat", "/proc/net/tcp", "/proc/net/tcp6"], env)
    ports: dict[int, set[str]] = {}
    for line in out.splitlines():
        cols = line.split()
        if len(cols) > 3 and cols[3] == "0A":  # LISTEN
            addr, port = cols[1].rsplit(":", 1)
            ports.setdefault(int(port, 16), set()).add(addr)
    return ports


def _is_loopback(hex_addr: str) -> bool:
    if len(hex_addr) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return hex_addr.endswith("7F")
    return hex_addr in ("00000000000000000000000001000000",  # ::1
                        ) or (hex_addr.startswith("0000000000000000FFFF0000")
                              and hex_addr.endswith("7F"))  # ::ffff:127.x.x.x


def _assert_control_api_closed(env: dict[str, str], superlink: str, node: str,
                               certs: Path, work: Path, intruder: bool = True) -> None:
    """Only the Fleet API (9092) listens beyond the SuperLink's loopback and the operator, in
    the SuperLink's network namespace, can list nodes and runs; with ``intruder``, from the
    SuperNode container `node` (which holds /certs/ca.crt), `flwr supernode register`,
    `flwr list` and `flwr run` against superlink:9092 and superlink:9093 fail, and the
    operator then sees no new key and no run."""
    ports = _listening_ports(env, superlink)
    public = {p for p, addrs in ports.items() if not all(_is_loopback(a) for a in addrs)}
    assert public == {9092}, ports
    assert 9093 in ports, ports
    operator = ["docker", "exec", superlink, "dpfl-role", "operator"]
    nodes = json.loads(_run([*operator, "supernode", "list", "superlink", "--format", "json"],
                            env))["nodes"]
    runs = json.loads(_run([*operator, "list", "superlink", "--format", "json"], env))["runs"]
    if not intruder:
        return
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f",
                    str(certs / "rogue")], check=True)  # certs/ is mounted at /certs
    app = work / "rogue-app"
    for rel, text in NOOP_APP.items():
        (app / rel).parent.mkdir(parents=True, exist_ok=True)
        (app / rel).write_text(text)
    _run(["docker", "cp", str(app), f"{node}:/tmp/rogue-app"], env)
    for port in (9092, 9093):
        intruder = ["docker", "exec", "-e", f"DPFL_CONTROL_ADDRESS=superlink:{port}", node,
                    "dpfl-role", "operator"]
        for args in (["supernode", "register", "/certs/rogue.pub", "superlink"],
                     ["list", "superlink"], ["run", "/tmp/rogue-app", "superlink"]):
            proc = subprocess.run([*intruder, *args], env=env, capture_output=True, text=True,
                                  timeout=180)
            out = proc.stdout + proc.stderr
            assert proc.returncode != 0, f"from {node}: flwr {' '.join(args)} (:{port}): {out}"
            assert "registered successfully" not in out and "Successfully started" not in out
    after = json.loads(_run([*operator, "supernode", "list", "superlink", "--format", "json"],
                            env))["nodes"]
    assert sorted(n["node-id"] for n in after) == sorted(n["node-id"] for n in nodes)
    assert json.loads(_run([*operator, "list", "superlink", "--format", "json"],
                           env))["runs"] == runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cmd: list[str], env: dict[str, str], timeout: float = 900) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd[:3]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _build_images(env: dict[str, str]) -> None:
    """The base image and the dpfl image, from the root filesystem (debootstrap) and the
    wheelhouse (pip wheel) that the session started at its start (``tests/image_prebuild.py``),
    or, without that prebuild or when it failed, started here the same way (both wait on
    the network most of their time); then the build stage's layers dropped."""
    prebuilt = os.environ.get(image_prebuild.ENV)
    folder = Path(prebuilt) if prebuilt and Path(prebuilt).is_dir() else None
    failed = image_prebuild.wait(folder) if folder else None
    try:
        if failed != {}:
            if folder:
                print(f"image prebuild failed, building here: {failed}")
                image_prebuild.stop(folder)
            folder = image_prebuild.launch()
            failed = image_prebuild.wait(folder)
            assert not failed, failed
        _run([str(ROOT / "deploy" / "base-image.sh"), "--from-rootfs", str(folder / "base"),
              BASE], env)
    finally:
        if folder is not None:
            image_prebuild.stop(folder)
    _run([str(ROOT / "deploy" / "image.sh"), "--from-wheelhouse", "--base", BASE, "--tag",
          IMAGE], env, timeout=1500)
    _run(["docker", "image", "prune", "--force"], env)


@pytest.fixture(scope="module")
def docker_env(tmp_path_factory):
    """A private Docker engine with the base and dpfl images built; yields the environment
    (None when a requirement is missing: each test then skips or fails on its own).

    Its folder is a tmpfs (8 GiB at most; ~4.3 GB during the build, ~2.1 GB once the build
    stage is pruned): on this machine's disk (ext4, mounted with ``discard``) removing the
    engine's layers afterwards took 152 s, unmounting a tmpfs takes none. Module scope: the
    engine stops after this file's last test (in session scope it lived, idle, until the
    worker's last test, and its teardown was charged to whatever test that was)."""
    if missing_requirements(NEEDED, root=True):
        yield None
        return
    home = Path("/tmp") / f"dpfl-docker-{os.getpid()}"  # short: the socket path is limited
    home.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8g,mode=0700", "dpfl-docker",
                              str(home)], capture_output=True).returncode == 0
    sock = home / "docker.sock"
    log = open(home / "dockerd.log", "w")
    daemon = subprocess.Popen(
        ["dockerd", "--data-root", str(home / "data"), "--exec-root", str(home / "exec"),
         "-H", f"unix://{sock}", "--pidfile", str(home / "dockerd.pid"),
         "--iptables=false", "--ip6tables=false", "--bridge=none"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    env = {**os.environ, "DOCKER_HOST": f"unix://{sock}", "DOCKER_BUILDKIT": "0",
           "PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "info"], env=env, capture_output=True).returncode != 0:
            assert daemon.poll() is None and time.monotonic() < deadline, \
                (home / "dockerd.log").read_text()[-2000:]
            time.sleep(0.5)
        _build_images(env)
        yield env
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        log.close()
        subprocess.run(["umount", "-R", str(home / "exec")], capture_output=True)
        if mounted:
            subprocess.run(["umount", "--lazy", str(home)], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.e2e
def test_compose_files_validate():
    """The compose file and its overrides are valid for Debian's docker-compose."""
    require(tools=("docker-compose",), what="the compose file check")
    for extra in ([], ["-f", "deploy/compose.insecure.yml"], ["-f", "deploy/compose.gpu.yml"]):
        proc = subprocess.run(["docker-compose", "-f", "docker-compose.yml", *extra, "config",
                               "-q"], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    gpu = subprocess.run(["docker-compose", "-f", "docker-compose.yml", "-f",
                          "deploy/compose.gpu.yml", "config"], cwd=ROOT, capture_output=True,
                         text=True).stdout
    assert gpu.count("driver: nvidia") == 2  # both SuperNodes, not the SuperLink


@pytest.mark.e2e
def test_image_has_every_role(docker_env):
    """One image: each role name maps to its Flower binary (the version proves it runs)."""
    _require_engine()
    for role in ("superlink", "supernode"):
        out = _run(["docker", "run", "--rm", IMAGE, role, "--version"], docker_env)
        assert "1.39.0" in out
    out = _run(["docker", "run", "--rm", IMAGE, "python", "-c",
                "import torch, opacus, dpfl; print(torch.__version__, torch.cuda.is_available())"],
               docker_env)
    assert out.split()[0].endswith("+cpu")
    out = _run(["docker", "run", "--rm", IMAGE, "python", "-c",
                "import importlib.util as u; print(u.find_spec('torchvision'), u.find_spec('ray'))"],
               docker_env)
    assert out.split() == ["None", "None"]  # optional: the image stays small


@pytest.mark.e2e
def test_compose_federation_tls_auth(docker_env, tmp_path):
    """`deploy/compose.sh up/run/down` (docker-compose.yml, TLS + SuperNode auth): a
    SuperLink, a ServerApp SuperExec and two SuperNodes in containers run two DP rounds."""
    _require_engine()
    state = tmp_path / "compose"
    script = str(ROOT / "deploy" / "compose.sh")
    try:
        out = _run([script, "up", str(state), "--project", "dpflt", "--image", IMAGE,
                    "--fleet-port", str(_free_port())], docker_env)
        assert "federation up" in out
        assert (state / "register.log").read_text().count("registered successfully") == 2
        names = _run(["docker", "ps", "--filter", "label=com.docker.compose.project=dpflt",
                      "--format", "{{.Names}}"], docker_env).split()
        superlink, = [n for n in names if "_superlink_" in n or n.endswith("-superlink-1")]
        node, = [n for n in names if "_supernode-0_" in n or n.endswith("-supernode-0-1")]
        _assert_control_api_closed(docker_env, superlink, node, state / "certs", tmp_path)
        _run([script, "run", str(state), "--run-config",
              RUN_CONFIG + 'num-rounds=2 run-name="compose"'], docker_env)
        logs = _run([script, "logs", str(state)], docker_env)
        assert "Uvicorn running on https://" in logs  # Control/Runtime API over TLS
        summary = json.loads((state / "runs" / "compose" / "summary.json").read_text())
        assert summary["guarantee"]["verdict"] == "formal"
        _assert_bound_by_key(state / "runs" / "compose", 2)
        assert summary["rounds-run"] == 2 and summary["num-clients"] == 2
        assert summary["final"]["accuracy"] > summary["initial"]["accuracy"]
        eps = [c["epsilon"] for c in summary["clients"].values()]
        assert len(eps) == 2 and all(0 < e <= 8.0 for e in eps)
    finally:
        subprocess.run([script, "down", str(state)], cwd=ROOT, env=docker_env,
                       capture_output=True, timeout=120)
    left = _run(["docker", "ps", "-a", "--filter", "label=com.docker.compose.project=dpflt",
                 "-q"], docker_env)
    assert left.strip() == ""


@pytest.mark.e2e
def test_launcher_four_clients(docker_env, tmp_path):
    """`dpfl deploy up --clients 4` (Docker SDK) creates four SuperNodes with partitions
    0..3 of 4; one DP round completes with all four; `down` removes everything it made."""
    _require_engine()
    state = tmp_path / "n4"
    dpfl = [sys.executable, "-m", "dpfl.cli", "deploy"]
    try:
        out = _run([*dpfl, "up", "--clients", "4", "--state", str(state), "--image", IMAGE,
                    "--name", "dpflt4"], docker_env)
        assert "4 SuperNodes" in out and "auth on" in out
        _assert_control_api_closed(docker_env, "dpflt4-superlink", "dpflt4-supernode-0",
                                   state / "certs", tmp_path, intruder=False)
        cmds = _run(["docker", "ps", "--filter", "label=dpfl.federation=dpflt4", "--format",
                     "{{.Names}} {{.Command}}", "--no-trunc"], docker_env)
        for i in range(4):
            assert f"partition-id={i} num-partitions=4" in cmds
        _run([*dpfl, "run", "--state", str(state), "--", "--run-config",
              RUN_CONFIG + 'num-rounds=1 run-name="n4"'], docker_env)
        summary = json.loads((state / "runs" / "n4" / "summary.json").read_text())
        assert summary["rounds-run"] == 1 and summary["num-clients"] == 4
        _assert_bound_by_key(state / "runs" / "n4", 4)
        assert sorted(summary["clients"]) == [f"client-{i}" for i in range(4)]
        assert summary["guarantee"]["verdict"] == "formal"
    finally:
        removed = subprocess.run([*dpfl, "down", "--state", str(state)], cwd=ROOT,
                                 env=docker_env, capture_output=True, text=True, timeout=180)
    assert "dpflt4-superlink" in removed.stdout and "dpflt4-net" in removed.stdout
    left = _run(["docker", "ps", "-a", "--filter", "label=dpfl.federation=dpflt4", "-q"],
                docker_env)
    assert left.strip() == ""


@pytest.mark.e2e
def test_launcher_failure_after_its_checks_is_one_line_and_leaves_nothing(docker_env,
                                                                          tmp_path):
    """A failure after `dpfl deploy up`'s checks (here: an unlabelled container already holds
    the SuperLink's name, which the checks cannot see) is one line on stderr, exit 1, and
    removes what `up` had made (network, volume, containers)."""
    _require_engine()
    squatter = _run(["docker", "create", "--name", "dpfltx-superlink", IMAGE], docker_env)
    try:
        proc = subprocess.run([sys.executable, "-m", "dpfl.cli", "deploy", "up", "--clients",
                               "1", "--state", str(tmp_path / "tx"), "--image", IMAGE,
                               "--name", "dpfltx"], cwd=ROOT, env=docker_env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(
            "error: dpfl deploy up failed after its checks: "), proc.stderr
        assert "Traceback" not in proc.stderr and "dpfltx-net" in lines[0]
        left = _run(["docker", "ps", "-a", "--filter", "label=dpfl.federation=dpfltx", "-q"],
                    docker_env)
        assert left.strip() == ""
        nets = _run(["docker", "network", "ls", "--filter", "label=dpfl.federation=dpfltx",
                     "-q"], docker_env)
        assert nets.strip() == ""
    finally:
        subprocess.run(["docker", "rm", "-f", squatter.strip()], env=docker_env,
                       capture_output=True, timeout=60)
