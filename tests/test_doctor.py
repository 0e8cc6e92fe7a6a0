"""`dpfl --version` names the installed versions without importing the stack; `dpfl doctor`
says what is installed and usable here, item by item, and what a missing item disables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from importlib import metadata
from pathlib import Path

import pytest

import dpfl
from dpfl import doctor

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "opacus", "flwr", "numpy", "ray")

VERSION_PROBE = """
import sys
from dpfl.cli import main
try:
    main(["--version"])
except SystemExit as exc:
    code = exc.code
print("HEAVY", sorted(m for m in {heavy!r} if m in sys.modules), "EXIT", code, file=sys.stderr)
"""


def test_version_names_the_installed_versions_without_importing_them():
    proc = subprocess.run([sys.executable, "-c", VERSION_PROBE.format(heavy=HEAVY)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stderr.strip().splitlines()[-1] == "HEAVY [] EXIT 0", proc.stderr
    python = ".".join(map(str, sys.version_info[:3]))
    expected = (f"dpfl {dpfl.__version__} (flwr {metadata.version('flwr')}, opacus "
                f"{metadata.version('opacus')}, torch {metadata.version('torch')}, "
                f"python {python})")
    assert proc.stdout == expected + "\n"
    module = subprocess.run([sys.executable, "-m", "dpfl", "--version"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (module.returncode, module.stdout) == (0, expected + "\n"), module.stderr


def test_version_says_not_installed(monkeypatch):
    real = metadata.version

    def version(name: str) -> str:
        if name == "opacus":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    assert "opacus not installed" in doctor.version_line()


def test_doctor_with_tools_hidden_from_path_says_missing(tmp_path):
    """`dpfl doctor` (the real command) with PATH holding a stand-in docker-compose and
    nothing else: docker-compose ok there; debootstrap, dockerd and ip missing, each naming
    what it disables; the default demo still can run (exit 0)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker-compose").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "docker-compose").chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir), "PYTHONPATH": str(ROOT),
           "DOCKER_HOST": f"unix://{tmp_path / 'no-engine.sock'}"}
    proc = subprocess.run([sys.executable, "-m", "dpfl", "doctor"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {line[:16].strip(): line for line in proc.stdout.splitlines()[1:-1]}
    assert lines["docker-compose"].split()[1:] == ["ok", str(bin_dir / "docker-compose")]
    assert lines["debootstrap"].split()[1] == "missing"
    assert "not on PATH" in lines["debootstrap"] and "disables deploy/base-image.sh" in \
        lines["debootstrap"]
    assert lines["docker engine"].split()[2] == "missing"
    assert "no-engine.sock: no socket there; dockerd not on PATH, docker CLI not on PATH" in \
        lines["docker engine"]
    assert lines["netns"].split()[1] == "missing" and "disables deploy/netns.sh" in \
        lines["netns"]
    for needed in ("python", "flwr", "flower-superlink", "opacus", "torch", "mnist"):
        assert lines[needed].split()[1] == "ok", lines[needed]
    assert proc.stdout.splitlines()[0].startswith(f"dpfl {dpfl.__version__} (flwr ")
    assert proc.stdout.splitlines()[-1].startswith("verdict: the default demo (dpfl simulate) "
                                                   "can run here; optional, missing: ")
    assert proc.stderr == ""


def test_doctor_exits_1_when_the_demo_needs_what_is_missing(monkeypatch):
    real = doctor.installed_version
    monkeypatch.setattr(doctor, "installed_version",
                        lambda dist: None if dist == "opacus" else real(dist))
    monkeypatch.setattr(doctor, "CHECKS", (doctor.check_python, doctor.check_opacus,
                                           doctor.check_compose))
    lines: list[str] = []
    assert doctor.doctor(lines.append) == 1
    assert lines[2] == ("opacus           missing  opacus not installed: disables DP-SGD "
                        "(trainer=dpsgd, the default)")
    assert lines[-1] == "verdict: the default demo cannot run here: missing opacus"


def test_a_check_that_raises_is_reported_not_raised(monkeypatch):
    def check_broken() -> doctor.Check:
        raise OSError("boom")

    [result] = doctor.run_checks((check_broken,))
    assert not result.ok and result.name == "broken" and "OSError: boom" in result.detail


def test_doctor_reads_the_datasets_where_the_loaders_do():
    from dpfl.data import loaders

    assert doctor.MNIST_ZARR_SHA256 == loaders.MNIST_ZARR_SHA256
    assert doctor.FASHION_MNIST_DIR == loaders.FASHION_MNIST_DEBIAN_DIR
    assert doctor.IDX_STEMS == loaders.IDX_STEMS
    path = loaders._mnist_zarr_path()
    mnist = doctor.check_mnist()
    assert mnist.ok == (path is not None)
    if path is not None:
        assert str(path).endswith(doctor.MNIST_ZARR) and str(path) in mnist.detail
    fashion = doctor.check_fashion_mnist()
    try:
        loaders.check_dataset("fashion-mnist")
        assert fashion.ok
    except loaders.DatasetUnavailable:
        assert not fashion.ok


@pytest.fixture
def fake_engine(tmp_path):
    """A unix socket answering Docker's GET /_ping."""
    path = tmp_path / "docker.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield f"unix://{path}"
    server.close()


def test_docker_engine_running_or_not(monkeypatch, tmp_path, fake_engine):
    monkeypatch.setenv("DOCKER_HOST", fake_engine)
    running = doctor.check_docker_engine()
    assert running.ok and running.detail.startswith(f"running at {fake_engine} (")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'none.sock'}")
    stopped = doctor.check_docker_engine()
    assert not stopped.ok and "no socket there" in stopped.detail
    assert "disables dpfl deploy" in stopped.line()


def test_cuda_check_imports_torch_only_where_a_gpu_driver_exists(monkeypatch, tmp_path):
    monkeypatch.setattr(doctor, "GPU_DRIVERS", (tmp_path / "nvidia" / "version",))
    monkeypatch.setitem(sys.modules, "torch", None)   # an import would raise
    cuda = doctor.check_cuda()
    assert not cuda.ok and cuda.detail.startswith("no GPU driver here")
    assert "disables GPU training (runs use the CPU)" in cuda.line()
