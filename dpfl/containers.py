"""`dpfl deploy up/run/down`: an N-client containerised federation via the Docker SDK.

docker-compose cannot give N replicas N distinct ``--node-config`` values, so this launcher
creates the same federation as ``docker-compose.yml`` for any N: a bridge network, a
SuperLink (state in a named volume, Control API published on the host's loopback), a
ServerApp SuperExec and N SuperNodes with ``partition-id=i num-partitions=N``, all from the
one dpfl image (deploy/image.sh). Secure by default: TLS everywhere and SuperNode
authentication (keys made by deploy/certs.sh, registered through the Control API before the
SuperNodes start); ``insecure=True`` drops both and warns. Every object carries the label
``dpfl.federation=<name>``; ``down`` removes exactly those objects.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

LABEL = "dpfl.federation"
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Federation:
    """What `up` made, saved as STATE/federation.json for `run` and `down`."""

    name: str
    image: str
    clients: int
    insecure: bool
    control_port: int
    state: str

    @property
    def network(self) -> str:
        return f"{self.name}-net"

    @property
    def volume(self) -> str:
        return f"{self.name}-state"

    def save(self) -> None:
        (Path(self.state) / "federation.json").write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, state: Path) -> "Federation":
        return cls(**json.loads((state / "federation.json").read_text()))


def _tls(fed: Federation, *, server: bool) -> list[str]:
    if fed.insecure:
        return ["--insecure"]
    if server:
        return ["--ssl-ca-certfile=/certs/ca.crt", "--ssl-certfile=/certs/superlink.crt",
                "--ssl-keyfile=/certs/superlink.key", "--enable-supernode-auth"]
    return ["--root-certificates=/certs/ca.crt"]


def superlink_command(fed: Federation) -> list[str]:
    return ["superlink", *_tls(fed, server=True), "--isolation=process",
            "--fleet-api-address=0.0.0.0:9092", "--host=0.0.0.0", "--port=9093",
            "--database=/state/superlink.db", "--disable-runtime-dependency-installation"]


def serverapp_command(fed: Federation) -> list[str]:
    return ["serverapp", "--runtime-api-address=superlink:9093", *_tls(fed, server=False)]


def supernode_command(fed: Federation, index: int) -> list[str]:
    auth = [] if fed.insecure else [f"--auth-supernode-private-key=/certs/keys/supernode-{index}"]
    return ["supernode", "--superlink=superlink:9092", *_tls(fed, server=False), *auth,
            f"--node-config=partition-id={index} num-partitions={fed.clients}",
            "--max-retries=30", "--max-wait-time=300"]


def _flwr_env(fed: Federation) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "FLWR_HOME": str(Path(fed.state) / "flwr-home"),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "PYTHONWARNINGS": "ignore"}


def _write_connection(fed: Federation) -> None:
    home = Path(fed.state) / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    tls = ("insecure = true" if fed.insecure
           else f'root-certificates = "{Path(fed.state) / "certs" / "ca.crt"}"')
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{fed.name}"\n\n[superlink.{fed.name}]\n'
        f'address = "127.0.0.1:{fed.control_port}"\n{tls}\n')


def _wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the SuperLink's Control API never listened on 127.0.0.1:{port}")


def _register(fed: Federation, index: int, attempts: int = 30) -> None:
    key = Path(fed.state) / "certs" / "keys" / f"supernode-{index}.pub"
    out = ""
    for _ in range(attempts):  # the Control API may lag its port by a moment
        proc = subprocess.run(["flwr", "supernode", "register", str(key), fed.name],
                              env=_flwr_env(fed), capture_output=True, text=True, timeout=60)
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 and "registered" in out:
            return
        time.sleep(1.0)
    raise RuntimeError(f"registering supernode-{index} failed: {out[-500:]}")


def up(clients: int, state: Path, *, image: str = "dpfl:0.1.0", name: str = "dpfl-fed",
       insecure: bool = False, control_port: int = 9093) -> Federation:
    """Create and start the federation; returns its description (also saved in ``state``)."""
    import docker

    if clients < 1:
        raise ValueError("--clients must be at least 1")
    state = state.resolve()
    state.mkdir(parents=True, exist_ok=True)
    (state / "runs").mkdir(exist_ok=True)
    fed = Federation(name, image, clients, insecure, control_port, str(state))
    if insecure:
        warnings.warn("insecure federation: no TLS and no SuperNode authentication; anyone on "
                      "the network can read updates and join", stacklevel=2)
        (state / "certs").mkdir(exist_ok=True)
    else:
        subprocess.run([str(REPO / "deploy" / "certs.sh"), str(state / "certs"), "--san",
                        "DNS:superlink", "--nodes", str(clients)], check=True,
                       capture_output=True)
    fed.save()
    _write_connection(fed)
    client = docker.from_env()
    labels = {LABEL: name}
    client.images.get(image)  # fail early, with docker's message, if the image is missing
    client.networks.create(fed.network, driver="bridge", labels=labels)
    client.volumes.create(fed.volume, labels=labels)
    certs = {str(state / "certs"): {"bind": "/certs", "mode": "ro"}}
    common = dict(detach=True, labels=labels, network=fed.network, stop_signal="SIGINT")

    def start(role: str, command: list[str], volumes: dict, aliases: list[str] | None = None,
              **extra) -> None:
        container = client.containers.create(image, command, name=f"{name}-{role}",
                                             volumes=volumes, **common, **extra)
        if aliases:  # the DNS name other containers dial
            client.networks.get(fed.network).disconnect(container)
            client.networks.get(fed.network).connect(container, aliases=aliases)
        container.start()

    start("superlink", superlink_command(fed), {**certs, fed.volume: {"bind": "/state", "mode": "rw"}},
        aliases=["superlink"], ports={"9093/tcp": ("127.0.0.1", control_port)})
    _wait_port(control_port)
    if not insecure:
        for i in range(clients):
            _register(fed, i)
    start("serverapp", serverapp_command(fed),
        {**certs, str(state / "runs"): {"bind": "/var/lib/dpfl/runs", "mode": "rw"}})
    for i in range(clients):
        start(f"supernode-{i}", supernode_command(fed, i), certs)
    return fed


def run(state: Path, flwr_args: list[str]) -> int:
    """``flwr run`` of this repository's app on the federation saved in ``state``."""
    fed = Federation.load(state.resolve())
    return subprocess.run(["flwr", "run", str(REPO), fed.name, "--stream", *flwr_args],
                          env=_flwr_env(fed)).returncode


def logs(state: Path) -> str:
    """Every container's log, for diagnosis."""
    import docker

    fed = Federation.load(state.resolve())
    out = []
    for c in docker.from_env().containers.list(all=True, filters={"label": f"{LABEL}={fed.name}"}):
        out.append(f"===== {c.name} ({c.status})\n{c.logs().decode(errors='replace')}")
    return "\n".join(out)


def down(state: Path, timeout: int = 20) -> list[str]:
    """Stop (SIGINT, then SIGKILL after ``timeout`` s) and remove every container, the
    network and the volume labelled with this federation; returns what was removed."""
    import docker

    fed = Federation.load(state.resolve())
    client = docker.from_env()
    selector = {"label": f"{LABEL}={fed.name}"}
    removed = []
    for c in client.containers.list(all=True, filters=selector):
        if c.status == "running":
            c.stop(timeout=timeout)
        c.remove(force=True)
        removed.append(c.name)
    for net in client.networks.list(filters=selector):
        net.remove()
        removed.append(net.name)
    for vol in client.volumes.list(filters=selector):
        vol.remove(force=True)
        removed.append(vol.name)
    return removed
