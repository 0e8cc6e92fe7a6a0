"""The container tests' network-bound image steps, started when the test session starts.

``tests/e2e/test_containers.py`` builds its images from a Debian root filesystem
(``deploy/base-image.sh --rootfs-only``: debootstrap) and a wheelhouse (``deploy/image.sh
--wheels-only``: pip wheel). Both wait on the network most of their time: at the start of the
container file's fixture they held its worker for most of the fixture's 164 s (idle 2-core
machine, 2026-11-28) while the other core worked alone. The session's controller starts them
instead (``tests/conftest.py``), in the background beside the first test files, and the
fixture finds them done or waits for the rest (:func:`wait`); it then only imports the root
filesystem and builds. Nothing starts when the session does not select the container file or
lacks what it needs (root, the tools of :data:`NEEDED`); the controller stops whatever is
still running, by process group, and removes the folder when the session ends (:func:`stop`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from requirements import missing_requirements

ROOT = Path(__file__).resolve().parents[1]
CONTAINER_TESTS = ROOT / "tests" / "e2e" / "test_containers.py"
NEEDED = ("dockerd", "docker", "docker-compose", "debootstrap", "openssl", "ssh-keygen")
ENV = "DPFL_TEST_IMAGE_PREBUILD"     # the prebuild's folder, for the workers
STEPS = ("base", "wheels")


def selects_container_tests(args: list[str]) -> bool:
    """Whether the session's path arguments (or testpaths) include the container file."""
    for arg in args:
        path = Path(arg.split("::", 1)[0]).resolve()
        if path == CONTAINER_TESTS or path in CONTAINER_TESTS.parents:
            return True
    return False


def commands(folder: Path) -> dict[str, list[str]]:
    return {"base": [str(ROOT / "deploy" / "base-image.sh"), "--rootfs-only",
                     str(folder / "base")],
            "wheels": [str(ROOT / "deploy" / "image.sh"), "--wheels-only"]}


def start(args: list[str]) -> Path | None:
    """Start both steps in the background when the container tests will need them; export
    their folder in :data:`ENV` (inherited by the xdist workers started after this)."""
    if not selects_container_tests(args) or missing_requirements(NEEDED, root=True):
        return None
    folder = launch()
    os.environ[ENV] = str(folder)
    return folder


def launch() -> Path:
    """Start both steps in the background in a new folder, and return it."""
    folder = Path(tempfile.mkdtemp(prefix="dpfl-prebuild-"))
    env = {**os.environ, "PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for name, cmd in commands(folder).items():
        # the exit code lands in <name>.rc (written whole, by rename) when the step ends
        wrapper = ['sh', '-c', '"$@" > "$0.log" 2>&1; echo $? > "$0.rc.tmp"; '
                   'mv "$0.rc.tmp" "$0.rc"', str(folder / name), *cmd]
        proc = subprocess.Popen(wrapper, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        (folder / f"{name}.pid").write_text(str(proc.pid))
    return folder


def wait(folder: Path, timeout: float = 900.0) -> dict[str, str]:
    """Wait for both steps; {step: its log's tail} for each that failed (empty: both done)."""
    deadline = time.monotonic() + timeout
    failed = {}
    for name in STEPS:
        rc = folder / f"{name}.rc"
        while not rc.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        log = folder / f"{name}.log"
        tail = log.read_text()[-2000:] if log.exists() else ""
        code = rc.read_text().strip() if rc.exists() else None
        if code is None:
            failed[name] = f"not done after {timeout:.0f} s: {tail}"
        elif code != "0":
            failed[name] = f"exit {code}: {tail}"
    return failed


def stop(folder: Path) -> None:
    """Stop any step still running (its whole process group: SIGTERM, SIGKILL after 10 s),
    unmount what debootstrap left mounted inside the folder, and remove it."""
    groups = []
    for name in STEPS:
        try:
            if not (folder / f"{name}.rc").exists():
                groups.append(int((folder / f"{name}.pid").read_text()))
        except (OSError, ValueError):
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        while groups and time.monotonic() < deadline and any(_alive(g) for g in groups):
            time.sleep(0.2)
    with open("/proc/mounts") as mounts:
        inside = [line.split()[1] for line in mounts if line.split()[1].startswith(f"{folder}/")]
    for point in sorted(inside, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True)
    shutil.rmtree(folder, ignore_errors=True)


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except OSError:
        return False
