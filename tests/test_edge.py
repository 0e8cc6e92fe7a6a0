"""The edge SuperNode install: the rendered systemd unit is valid and starts the SuperNode
with TLS, authentication, the node's partition and unlimited reconnects."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _render(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "ca.crt").write_text("-")
    (tmp_path / "key").write_text("-")
    out = subprocess.run(
        [str(ROOT / "deploy" / "edge" / "install.sh"), "--superlink", "10.0.0.1:9092", "--ca",
         str(tmp_path / "ca.crt"), "--key", str(tmp_path / "key"), "--partition-id", "3",
         "--num-partitions", "8", "--threads", "1", "--prefix", str(Path(sys.executable).parents[1]),
         "--etc", str(tmp_path), "--dry-run"], capture_output=True, text=True, check=True).stdout
    env, unit = out.split("== /etc/systemd/system/dpfl-supernode.service\n")
    return env, unit


def test_edge_unit_renders_secure_settings(tmp_path):
    env, unit = _render(tmp_path)
    assert "DPFL_NODE_CONFIG=partition-id=3 num-partitions=8" in env
    assert "DPFL_PRIVACY_DIR=/var/lib/dpfl/privacy" in env
    assert "OMP_NUM_THREADS=1" in env and "DPFL_NUM_THREADS=1" in env
    assert "--root-certificates" in unit and "--auth-supernode-private-key" in unit
    assert "--insecure" not in unit
    exec_start = unit.split("ExecStart=", 1)[1].split("\n# ", 1)[0]
    assert "--max-retries" not in exec_start  # reconnect forever (Flower backs off)
    assert "--node-config" in exec_start
    # a slow device gets a ClientApp start window beyond Flower's fixed 30 s
    assert "-m dpfl.runtime.supernode --clientapp-start-window ${DPFL_CLIENTAPP_START_WINDOW}" \
        in " ".join(exec_start.replace("\\\n", " ").split())
    assert "DPFL_CLIENTAPP_START_WINDOW=300" in env
    # and its ClientApps start warm (dpfl/runtime/warm_clientapps.py)
    assert "--warm-clientapps" in exec_start
    assert "Restart=always" in unit and "KillSignal=SIGINT" in unit
    assert "@" not in unit.split("[Unit]", 1)[1]  # every placeholder filled


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_edge_unit_verifies(tmp_path):
    _, unit = _render(tmp_path)
    (tmp_path / "supernode.env").write_text("DPFL_SUPERLINK=10.0.0.1:9092\n")
    path = tmp_path / "dpfl-supernode.service"
    path.write_text(unit)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("window", ["10", "abc", "4000"])
def test_edge_install_refuses_a_bad_start_window(tmp_path, window):
    (tmp_path / "ca.crt").write_text("-")
    (tmp_path / "key").write_text("-")
    proc = subprocess.run(
        [str(ROOT / "deploy" / "edge" / "install.sh"), "--superlink", "10.0.0.1:9092", "--ca",
         str(tmp_path / "ca.crt"), "--key", str(tmp_path / "key"), "--partition-id", "0",
         "--num-partitions", "2", "--start-window", window, "--dry-run"],
        capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert f"--start-window '{window}': expected whole seconds 30..3600" in proc.stderr


def test_edge_install_refuses_missing_settings(tmp_path):
    proc = subprocess.run([str(ROOT / "deploy" / "edge" / "install.sh"), "--superlink", "x:1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "missing --ca" in proc.stderr


def test_edge_install_refuses_dry_run_with_no_service(tmp_path):
    (tmp_path / "ca.crt").write_text("-")
    (tmp_path / "key").write_text("-")
    proc = subprocess.run(
        [str(ROOT / "deploy" / "edge" / "install.sh"), "--superlink", "10.0.0.1:9092", "--ca",
         str(tmp_path / "ca.crt"), "--key", str(tmp_path / "key"), "--partition-id", "0",
         "--num-partitions", "2", "--dry-run", "--no-service"], capture_output=True, text=True)
    assert proc.returncode == 2 and "exclude each other" in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_edge_env_puts_the_venv_first_on_path(tmp_path):
    # flower-supernode starts flower-superexec by name: systemd's default PATH lacks the venv
    env, _ = _render(tmp_path)
    path = next(line for line in env.splitlines() if line.startswith("PATH="))
    assert path.startswith(f"PATH={Path(sys.executable).parents[1]}/bin:")


@pytest.mark.parametrize("args, message", [
    (["--rounds", "0"], "--rounds '0'"),
    (["--train-subset", "60001"], "--train-subset '60001'"),
    (["--threads", "x"], "--threads 'x'"),
    (["--cache", "relative/dir"], "--cache 'relative/dir'"),
    (["--torch", "numpy==2"], "--torch 'numpy==2'"),
    (["--rounds"], "--rounds needs a value"),
    (["--nodes", "3"], "unknown argument '--nodes'"),
])
def test_arm64_demo_refuses_bad_arguments_before_doing_anything(tmp_path, args, message):
    # the argument checks come first: no root, rootfs, qemu or namespace needed to reach them
    cache = tmp_path / "cache"
    proc = subprocess.run([str(ROOT / "deploy" / "edge" / "arm64-demo.sh"), *args],
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "DPFL_ARM64_ROOT": str(cache)})
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and proc.stderr.count("\n") == 1
    assert proc.stdout == "" and not cache.exists()
