"""`dpfl deploy up/run/down`: an N-client containerised federation via the Docker SDK.

docker-compose cannot give N replicas N distinct ``--node-config`` values, so this launcher
creates the same federation as ``docker-compose.yml`` for any N: a bridge network, a
SuperLink (state in a named volume), a ServerApp SuperExec and N SuperNodes with
``partition-id=i num-partitions=N``, all from the one dpfl image (deploy/image.sh). Secure
by default: TLS everywhere and SuperNode authentication (keys made by deploy/certs.sh,
registered through the Control API before the SuperNodes start); ``insecure=True`` drops
both and warns. Every object carries the label ``dpfl.federation=<name>``; ``down`` removes
exactly those objects.

Closed by default: the network carries the Fleet API (9092) only. Flower 1.39 serves the
Control API (submit runs, register keys, list/stop runs) and the Runtime API over HTTP on
``--host``/``--port`` with no account authentication, so the SuperLink binds them to
127.0.0.1:9093 of its own network namespace; the ServerApp SuperExec shares that namespace,
and the operator's ``flwr`` (key registration, ``run``) runs in one-off containers that share
it too (the image's ``operator`` role). Nothing is published on the host: a published port
forwards to the container's network address, which the SuperNodes reach as well.

Everything a user can fix is checked before anything is written and reported as one
:class:`~dpfl.errors.UserError` line: the Docker SDK missing, no engine answering at the
socket/URL tried, a missing image, a name or port already taken, a state folder that is not
a federation's.
"""

from __future__ import annotations

import codecs
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from dpfl import runstatus
from dpfl.errors import UserError, one_line, read_json_file

LABEL = "dpfl.federation"
REPO = Path(__file__).resolve().parents[2]  # the checkout: dpfl/runtime/ is two below it
STATE_FILE = "federation.json"
DEFAULT_ENGINE = "unix:///var/run/docker.sock"  # the SDK's (and the CLI's) default socket
PROBE_TIMEOUT = 10  # seconds to wait for the engine's first answer
# each SuperNode's own durable privacy history (dpfl.client.node_history), in its container
NODE_PRIVACY_DIR = "/var/lib/dpfl/privacy"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # container names and a TOML key


class DeployFailed(RuntimeError):
    """``up`` failed after its checks (one line; what it had made is removed): exit 1."""


@dataclass(frozen=True)
class Federation:
    """What `up` made, saved as STATE/federation.json for `run` and `down`."""

    name: str
    image: str
    clients: int
    insecure: bool
    state: str
    # "<node-id>:<partition>,...": the node ids Flower fixed when `up` registered each
    # SuperNode's key (empty when insecure); `run` passes it as node-partitions
    node_partitions: str = ""

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
        """The federation saved in ``state`` by `up`, or a :class:`UserError` naming the
        folder (missing, not a folder, no federation.json) or the damaged file."""
        if not state.exists():
            raise UserError(f"{state}: no such directory (the --state folder of a "
                            "`dpfl deploy up`)")
        if not state.is_dir():
            raise UserError(f"{state}: not a directory (the --state folder of a "
                            "`dpfl deploy up`)")
        path = state / STATE_FILE
        if not path.exists():
            raise UserError(f"{state}: not a federation's state (no {STATE_FILE}; "
                            "`dpfl deploy up --state DIR` makes one)")
        data = read_json_file(path, "federation state")
        if isinstance(data, dict):
            data.pop("control_port", None)  # a federation made before the Control API closed
            data.setdefault("node_partitions", "")   # ... or before identities were bound
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise UserError(f"{path}: federation state is damaged (expected the keys "
                            f"{sorted(names)})")
        return cls(**data)


# -- prerequisites: checked before anything is written ---------------------------------------


def docker_sdk() -> ModuleType:
    """The ``docker`` package, or a :class:`UserError` saying how to install it."""
    try:
        import docker
    except ImportError as exc:
        raise UserError("the Docker SDK for Python (package 'docker') is not installed: "
                        "pip install 'dpfl[deploy]'") from exc
    return docker


def engine_address(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The engine URL the SDK dials and where it comes from, as ``docker.from_env`` picks
    it: DOCKER_HOST, else the current Docker CLI context, else the default socket."""
    env = os.environ if environ is None else environ
    if env.get("DOCKER_HOST"):
        return env["DOCKER_HOST"], "DOCKER_HOST"
    try:
        from docker.context import ContextAPI

        host = ContextAPI.kwargs_from_context(environment=env).get("base_url")
    except Exception:  # an unreadable CLI config: the SDK falls back to the default too
        host = None
    if host and host.replace("http+unix://", "unix://") != DEFAULT_ENGINE:
        return host, "the current Docker context"
    return DEFAULT_ENGINE, "the default; DOCKER_HOST is not set"


def _root_cause(exc: BaseException) -> str:
    """The most specific one-line reason inside a Docker SDK/requests exception chain (the
    OS error, e.g. "No such file or directory"), else the exception's own text."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        err = todo.pop(0)
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.strerror:
            return str(err.strerror)
        todo += [*err.args, getattr(err, "reason", None), err.__cause__, err.__context__]
    text = " ".join(str(exc).split()).removeprefix("Error while fetching server API version: ")
    return text[:200]


def connect(environ: Mapping[str, str] | None = None) -> Any:
    """A Docker client whose engine has answered, or a :class:`UserError` naming the
    socket/URL tried and how to get an engine there."""
    docker = docker_sdk()
    url, source = engine_address(environ)
    try:
        docker.utils.parse_host(url, docker.constants.IS_WINDOWS_PLATFORM)
    except docker.errors.DockerException as exc:
        raise UserError(f"{url} ({source}) is not a Docker engine address: {exc}; use "
                        "unix:///PATH/docker.sock or tcp://HOST:PORT") from exc
    try:
        client = docker.DockerClient.from_env(timeout=PROBE_TIMEOUT, environment=environ)
        client.ping()
    except Exception as exc:  # DockerException, requests' errors, a bad DOCKER_HOST
        reason = _root_cause(exc)
        if "permission denied" in reason.lower():
            hint = "run as root or as a member of the 'docker' group"
        else:
            hint = ("start one (as root: `dockerd &` or `systemctl start docker`) or set "
                    "DOCKER_HOST to a running engine's socket, e.g. unix:///path/docker.sock")
        raise UserError(f"no Docker engine at {url} ({source}): {reason}; {hint}") from exc
    client.api.timeout = docker.constants.DEFAULT_TIMEOUT_SECONDS  # long calls (stop) after
    return client


def _check_up_arguments(clients: int, name: str) -> None:
    """--clients and --name, or a :class:`UserError` naming the bad one."""
    if clients < 1:
        raise UserError(f"--clients must be at least 1 (got {clients})")
    if not NAME_PATTERN.fullmatch(name):
        raise UserError(f"--name {name!r}: use letters, digits, '-' and '_' (it prefixes "
                        "container names)")


def _check_tools(*tools: str) -> None:
    """Each tool is on PATH, or a :class:`UserError` naming the first one missing."""
    for tool in tools:
        if shutil.which(tool) is None:
            raise UserError(f"'{tool}' not found on PATH (deploy/certs.sh needs it for the "
                            "TLS certificates and SuperNode keys); install it or use --insecure")


def _check_engine_side(client: Any, image: str, name: str, url: str) -> None:
    """The image exists in the engine and no object of federation ``name`` does."""
    docker = docker_sdk()
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound as exc:
        raise UserError(f"image {image!r} is not in the Docker engine at {url}; build it "
                        f"with deploy/image.sh --tag {image} (or pass --image)") from exc
    selector = {"label": f"{LABEL}={name}"}
    taken = [c.name for c in client.containers.list(all=True, filters=selector)]
    taken += [n.name for n in client.networks.list(filters=selector)]
    if taken:
        raise UserError(f"federation {name!r} already exists in the engine ({', '.join(taken)}); "
                        "`dpfl deploy down --state DIR` with its state folder first, or pick "
                        "another --name")


def _check_state_target(state: Path) -> None:
    """``state`` is a folder or does not exist yet."""
    if state.exists() and not state.is_dir():
        raise UserError(f"--state {state}: exists and is not a directory")


def _make_certs(state: Path, clients: int) -> None:
    """deploy/certs.sh into STATE/certs (it validates first and moves its output into place
    only when complete); its one-line error becomes a :class:`UserError` or a RuntimeError."""
    proc = subprocess.run([str(REPO / "deploy" / "certs.sh"), str(state / "certs"), "--san",
                           "DNS:superlink", "--nodes", str(clients)], capture_output=True,
                          text=True)
    if proc.returncode == 0:
        return
    message = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    if proc.returncode == 2:
        raise UserError(message)
    raise DeployFailed(f"deploy/certs.sh failed: {message}")


def _tls(fed: Federation, *, server: bool) -> list[str]:
    if fed.insecure:
        return ["--insecure"]
    if server:
        return ["--ssl-ca-certfile=/certs/ca.crt", "--ssl-certfile=/certs/superlink.crt",
                "--ssl-keyfile=/certs/superlink.key", "--enable-supernode-auth"]
    return ["--root-certificates=/certs/ca.crt"]


CONTROL_ADDRESS = "127.0.0.1:9093"  # Control + Runtime HTTP API: the SuperLink's loopback


def superlink_command(fed: Federation) -> list[str]:
    host, port = CONTROL_ADDRESS.rsplit(":", 1)
    return ["superlink", *_tls(fed, server=True), "--isolation=process",
            "--fleet-api-address=0.0.0.0:9092", f"--host={host}", f"--port={port}",
            "--database=/state/superlink.db", "--disable-runtime-dependency-installation"]


def serverapp_command(fed: Federation) -> list[str]:
    """In the SuperLink's network namespace: its Runtime API is on that loopback."""
    return ["serverapp", f"--runtime-api-address={CONTROL_ADDRESS}", *_tls(fed, server=False)]


def supernode_command(fed: Federation, index: int) -> list[str]:
    auth = [] if fed.insecure else [f"--auth-supernode-private-key=/certs/keys/supernode-{index}"]
    return ["supernode", "--superlink=superlink:9092", *_tls(fed, server=False), *auth,
            f"--node-config=partition-id={index} num-partitions={fed.clients} "
            f'privacy-dir="{NODE_PRIVACY_DIR}"',
            "--max-retries=30", "--max-wait-time=300"]


def operator(client: Any, fed: Federation, flwr_args: list[str], out: Any = None) -> int:
    """``flwr FLWR_ARGS`` (connection "superlink") in a one-off container that shares the
    SuperLink's network namespace (the only place its Control API listens), with the CA
    certificate and keys at /certs and this checkout read-only at /app; its output is
    written to ``out`` (a text stream) as it comes. Returns flwr's exit code."""
    container = client.containers.create(
        fed.image, ["operator", *flwr_args], labels={LABEL: fed.name},
        network_mode=f"container:{fed.name}-superlink",
        environment={"DPFL_INSECURE": "1"} if fed.insecure else {},
        volumes={str(Path(fed.state) / "certs"): {"bind": "/certs", "mode": "ro"},
                 str(REPO): {"bind": "/app", "mode": "ro"}})
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # chunks split chars
    try:
        container.start()
        for chunk in container.logs(stream=True, follow=True):
            if out is not None:
                out.write(decoder.decode(chunk))
                out.flush()
        return int(container.wait()["StatusCode"])
    finally:
        container.remove(force=True)


def _wait_superlink(client: Any, fed: Federation, timeout: float = 60.0) -> None:
    """Until the SuperLink's HTTP API (Control + Runtime) has started."""
    container = client.containers.get(f"{fed.name}-superlink")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if b"Application startup complete" in container.logs():
            return
        container.reload()
        if container.status not in ("created", "running"):
            break
        time.sleep(0.5)
    raise RuntimeError(f"the SuperLink's Control API did not start (container "
                       f"{container.name} is {container.status}); see `dpfl deploy logs`")


REGISTERED = re.compile(r"SuperNode (\d+) registered")


def _register(client: Any, fed: Federation, index: int, attempts: int = 10) -> int:
    """Register supernode-``index``'s key; the node id Flower fixed for it."""
    log = Path(fed.state) / "register.log"
    for _ in range(attempts):  # the Control API may lag its log line by a moment
        start = log.stat().st_size if log.exists() else 0
        with open(log, "a") as out:
            code = operator(client, fed, ["supernode", "register",
                                          f"/certs/keys/supernode-{index}.pub", "superlink"], out)
        found = REGISTERED.findall(log.read_text()[start:])
        if code == 0 and found:
            return int(found[-1])
        time.sleep(1.0)
    raise RuntimeError(f"registering supernode-{index} failed: {log.read_text()[-500:]}")


def up(clients: int, state: Path, *, image: str = "dpfl:0.1.0", name: str = "dpfl-fed",
       insecure: bool = False) -> Federation:
    """Create and start the federation; returns its description (also saved in ``state``).

    Arguments, tools, the engine, the image and the name are checked first: a
    :class:`UserError` from those leaves nothing written."""
    _check_up_arguments(clients, name)
    state = state.resolve()
    _check_state_target(state)
    if not insecure:
        _check_tools("openssl", "ssh-keygen")
    client = connect()
    _check_engine_side(client, image, name, engine_address()[0])
    fed = Federation(name, image, clients, insecure, str(state))
    if insecure:
        warnings.warn("insecure federation: no TLS and no SuperNode authentication; anyone on "
                      "the network can read updates and join", stacklevel=2)
        (state / "certs").mkdir(parents=True, exist_ok=True)
    else:
        _make_certs(state, clients)  # makes STATE/ and STATE/certs/ only when it succeeds
    (state / "runs").mkdir(exist_ok=True)
    fed.save()
    try:
        return _create(client, fed)
    except Exception as exc:   # after the checks: the engine, the SuperLink, registration
        try:
            removed = down(state, timeout=5)
        except Exception as cleanup:   # the engine itself may be what failed
            removed = [f"(cleanup failed too: {one_line(cleanup)})"]
        raise DeployFailed(f"dpfl deploy up failed after its checks: {one_line(exc)}; removed "
                           f"what it had made: {', '.join(removed) or 'nothing'}") from exc


def _create(client: Any, fed: Federation) -> Federation:
    """The network, volume and containers of ``fed``, and its keys registered."""
    name, image, clients, insecure = fed.name, fed.image, fed.clients, fed.insecure
    state = Path(fed.state)
    labels = {LABEL: name}
    client.networks.create(fed.network, driver="bridge", labels=labels)
    client.volumes.create(fed.volume, labels=labels)
    certs = {str(state / "certs"): {"bind": "/certs", "mode": "ro"}}
    common = dict(detach=True, labels=labels, stop_signal="SIGINT")

    def start(role: str, command: list[str], volumes: dict, aliases: list[str] | None = None,
              **extra) -> None:
        network = {} if "network_mode" in extra else {"network": fed.network}
        container = client.containers.create(image, command, name=f"{name}-{role}",
                                             volumes=volumes, **common, **network, **extra)
        if aliases:  # the DNS name other containers dial
            client.networks.get(fed.network).disconnect(container)
            client.networks.get(fed.network).connect(container, aliases=aliases)
        container.start()

    # no published port: the Fleet API is for the SuperNodes on the network, the Control API
    # for the SuperLink's own network namespace
    start("superlink", superlink_command(fed),
          {**certs, fed.volume: {"bind": "/state", "mode": "rw"}}, aliases=["superlink"])
    _wait_superlink(client, fed)
    if not insecure:   # each key's node id is bound to its partition (node-partitions)
        ids = [_register(client, fed, i) for i in range(clients)]
        fed = replace(fed, node_partitions=",".join(f"{n}:{i}" for i, n in enumerate(ids)))
        fed.save()
    start("serverapp", serverapp_command(fed),
        {**certs, str(state / "runs"): {"bind": "/var/lib/dpfl/runs", "mode": "rw"}},
        network_mode=f"container:{name}-superlink")
    for i in range(clients):
        start(f"supernode-{i}", supernode_command(fed, i), certs)
    return fed


def _check_running(client: Any, fed: Federation) -> None:
    """The federation's SuperLink container exists and runs, or a :class:`UserError`."""
    docker = docker_sdk()
    container = f"{fed.name}-superlink"
    try:
        status = client.containers.get(container).status
    except docker.errors.NotFound as exc:
        raise UserError(f"federation {fed.name!r} of {fed.state} is not up (no container "
                        f"{container}); `dpfl deploy up --state {fed.state}` first") from exc
    if status != "running":
        raise UserError(f"federation {fed.name!r} of {fed.state} is not running (container "
                        f"{container} is {status}); see `dpfl deploy logs --state {fed.state}`")


def run(state: Path, flwr_args: list[str]) -> int:
    """``flwr run`` of this repository's app on the federation saved in ``state`` (which
    must be up: its SuperLink container running), from an operator container."""
    fed = Federation.load(state.resolve())
    client = connect()
    _check_running(client, fed)
    bound = ["--run-config", f"node-partitions='{fed.node_partitions}'"] \
        if fed.node_partitions else []   # a later --run-config may override it
    stream = _Tee(sys.stdout)
    code = operator(client, fed, ["run", "/app", "superlink", "--stream", *bound, *flwr_args],
                    stream)
    if code != 0 or "--help" in flwr_args:
        return code
    # flwr run exits 0 whether or not the ServerApp finished: the run's status says
    run_id = runstatus.run_id_of(stream.text())
    if run_id is None:
        print("error: flwr run started no run (see its output above)", file=sys.stderr)
        return 1
    listing = io.StringIO()
    operator(client, fed, ["ls", "superlink", "--run-id", run_id, "--format", "json"], listing)
    try:
        status, details = runstatus.status_of(_json_part(listing.getvalue()), run_id)
    except ValueError as exc:
        print(f"error: run {run_id}: its status could not be read ({exc})", file=sys.stderr)
        return 1
    why = runstatus.why_not_finished(stream.text(), status, details)
    if why is not None:
        print(f"error: run {run_id}: {why}", file=sys.stderr)
        return 1
    return 0


class _Tee:
    """A text stream that writes through to ``out`` and keeps what it wrote."""

    def __init__(self, out: Any) -> None:
        self.out, self.parts = out, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def text(self) -> str:
        return "".join(self.parts)


def _json_part(text: str) -> str:
    """The JSON document in a container's output (the operator may print lines before)."""
    start = text.find("{")
    return text[start:] if start >= 0 else text


def logs(state: Path) -> str:
    """Every container's log, for diagnosis."""
    fed = Federation.load(state.resolve())
    out = []
    for c in connect().containers.list(all=True, filters={"label": f"{LABEL}={fed.name}"}):
        out.append(f"===== {c.name} ({c.status})\n{c.logs().decode(errors='replace')}")
    return "\n".join(out) or f"no containers of federation {fed.name!r} (state {fed.state})"


def down(state: Path, timeout: int = 20) -> list[str]:
    """Stop (SIGINT, then SIGKILL after ``timeout`` s) and remove every container, the
    network and the volume labelled with this federation; returns what was removed."""
    fed = Federation.load(state.resolve())
    client = connect()
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
