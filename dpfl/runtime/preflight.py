"""What a simulation launch will run, and every check before it starts anything.

:func:`plan_launch` turns ``dpfl simulate``'s arguments into a :class:`LaunchPlan`: the
run-config parsed by the method registry (a resume's saved config applied), the run folder,
the simulation's nodes and worker processes, and the preflight (:func:`preflight`: settings
that cannot work, each a one-line :class:`~dpfl.errors.UserError`). It needs the method
registry, the dataset catalogue and the run folder's ledger reader: torch, Flower and
dp-accounting. The launcher never imports this module itself: it runs it in a forked child
(:mod:`dpfl.runtime.launch_checks`) whose memory is returned when the checks end, so that the
process which waits for the whole run holds only the light modules it needs (0.66 GiB less
proportional memory for the run's length, results/speed/).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import socket
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from dpfl.apps.server import first_round_affordable
from dpfl.config import (
    MAX_CANARY_EXAMPLES_PER_CLIENT,
    MIN_EXAMPLES_PER_CLIENT,
    ConfigError,
    RunConfig,
)
from dpfl.data import check_dataset, splits_for
from dpfl.errors import UserError, writable_dir_problem
from dpfl.methods import DEFAULT_METHOD, build_strategy, configured, parse_run_config
from dpfl.runlock import LAUNCHER_LOCK, WRITER_LOCK, check_unlocked
from dpfl.runtime.launch_plan import LaunchPlan
from dpfl.server.rundir import (
    RunDir,
    check_run_dir,
    resolve_output_dir,
    run_dir_path,
    unique_run_name,
)
from dpfl.server.runidentity import NUM_CLIENTS, resume_overrides
from dpfl.server.trust import server_trust

DEFAULT_CLIENTS = 4


def plan_launch(app_dir: Path, num_clients: int | None, overrides: dict[str, object],
                output_root: Path, num_cpus: float = 1.0, ray_address: str | None = None,
                parallel: int | None = None) -> LaunchPlan:
    """The launch of ``dpfl simulate`` (:func:`dpfl.runtime.launch.simulate`'s arguments),
    checked: every check that does not need the run folder's lock, so that a refused launch
    writes nothing (not even the lock file). ``num_clients`` None: the resumed run's, else
    :data:`DEFAULT_CLIENTS`. A resume loads the run's saved config (``config.json``) and
    applies only the overrides a resume may change
    (:func:`dpfl.server.runidentity.resume_overrides`)."""
    output_root = resolved(output_root, "--output-dir")
    overrides = dict(overrides)
    overrides.setdefault("run-name", unique_run_name(str(overrides.get("strategy") or
                                                         DEFAULT_METHOD)))
    output_key = "run-config key 'output-dir'" if "output-dir" in overrides else "--output-dir"
    overrides.setdefault("output-dir", str(output_root))
    defaults = tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    cfg = parse_run_config({**defaults["config"], **overrides})
    resolved(resolve_output_dir(cfg, output_root), output_key)
    run_dir = run_dir_path(cfg, output_root)  # where the ServerApp will put it
    why = writable_dir_problem(run_dir)   # before the lock creates the folder
    if why is not None:
        raise UserError(f"{output_key} {resolve_output_dir(cfg, output_root)}: {why}")
    for name in (LAUNCHER_LOCK, WRITER_LOCK):   # a live run first: name its process
        check_unlocked(run_dir, name)
    check_run_dir(run_dir, cfg.resume)
    saved = RunDir(run_dir).saved_config() if cfg.resume else None
    if saved is not None:
        explicit = dict(overrides)
        if num_clients is not None:
            explicit[NUM_CLIENTS] = num_clients
        overrides = resume_overrides(saved, explicit, str(run_dir))
        num_clients = int(saved[NUM_CLIENTS]) if NUM_CLIENTS in saved else num_clients
        cfg = parse_run_config({**defaults["config"], **overrides})
    num_clients = DEFAULT_CLIENTS if num_clients is None else num_clients
    layout = node_layout(cfg, num_clients, num_cpus, parallel, ray_address is not None)
    workers = process_workers(cfg, num_cpus, parallel, ray_address is not None)
    overrides["cohort-clients"] = layout.cohort_clients
    preflight(cfg, num_clients, run_dir, num_cpus, ray_address, parallel)
    return LaunchPlan(output_root, run_dir, overrides, layout.supernodes, workers, cfg.resume)


def recheck_after_lock(plan: LaunchPlan) -> None:
    """Once the launcher holds the run folder's lock: what another launch may have changed
    since :func:`plan_launch` looked (a writer's lock, a run created meanwhile, a resumed
    run's ledger or round log)."""
    check_unlocked(plan.run_dir, WRITER_LOCK)
    check_run_dir(plan.run_dir, plan.resume)
    if plan.resume:
        RunDir(plan.run_dir).check_resumable()


def check_ray_address(address: str, timeout: float = 5.0) -> str:
    """``--ray-address``: ``HOST:PORT`` of a running Ray cluster's head (the GCS port given to
    ``ray start --head --port``) that accepts a TCP connection from here within ``timeout``
    seconds; else a one-line :class:`UserError` (Ray itself would retry for minutes, then
    fail in a traceback). Returns the address as Ray will read it."""
    text = address.strip()
    host, sep, port = text.rpartition(":")
    if "://" in text:
        raise UserError(f"--ray-address {address!r}: give the head's HOST:PORT (the GCS "
                        "address of `ray start --head --port`), not a URL (Ray Client "
                        "ray:// addresses are not supported)")
    if not (sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536):
        raise UserError(f"--ray-address {address!r}: expected HOST:PORT of the Ray head, "
                        "e.g. 10.0.0.1:6379")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise UserError(f"--ray-address {text}: no Ray head answers there "
                        f"({exc.strerror or type(exc).__name__}); start one with `ray start "
                        f"--head --port {port}` on that host") from None
    return text


def check_cpus_per_client(num_cpus: float, cluster: bool = False) -> None:
    """``--cpus-per-client``: a finite number in (0, the machine's CPUs] (Ray would wait
    forever for a client it cannot place, and refuses 0 or less in a traceback). On a Ray
    cluster (``cluster``) another node may have more CPUs than this machine: only > 0."""
    if cluster:
        if not (math.isfinite(num_cpus) and num_cpus > 0):
            raise UserError(f"--cpus-per-client must be a number > 0, got {num_cpus:g}")
        return
    available = os.cpu_count() or 1
    if not (math.isfinite(num_cpus) and 0 < num_cpus <= available):
        raise UserError(f"--cpus-per-client must be in (0, {available}] (the CPUs of this "
                        f"machine), got {num_cpus:g}")


def check_parallel_clients(parallel: int | None, num_cpus: float,
                           cluster: bool = False) -> None:
    """``--parallel-clients``: a whole number >= 1 whose CPUs (times ``--cpus-per-client``)
    are whole, on a private Ray only (a cluster's size is its own). None: Ray's default, as
    many ClientApp actors as the machine's CPUs hold."""
    if parallel is None:
        return
    if cluster:
        raise UserError("--parallel-clients sizes the private Ray; with --ray-address the "
                        "cluster's CPUs decide (start its nodes with `ray start --num-cpus`)")
    if parallel < 1:
        raise UserError(f"--parallel-clients must be at least 1, got {parallel}")
    if not float(parallel * num_cpus).is_integer():
        raise UserError(f"--parallel-clients {parallel} x --cpus-per-client {num_cpus:g} must "
                        "be a whole number of CPUs")


def check_data_size(cfg: RunConfig, num_clients: int, n_train: int) -> None:
    """``--clients``, ``server-holdout`` and ``train-subset`` against the dataset's
    ``n_train`` training examples (one-line :class:`UserError` each): every client gets at
    least :data:`MIN_EXAMPLES_PER_CLIENT` examples of what the server's holdout leaves, and a
    ``train-subset`` is 0 (all) or between that and what is left."""
    least = MIN_EXAMPLES_PER_CLIENT * num_clients
    most_clients = n_train // MIN_EXAMPLES_PER_CLIENT
    if num_clients > most_clients:
        raise UserError(f"--clients {num_clients}: {cfg.dataset} has {n_train} training "
                        f"examples, enough for at most {most_clients} clients "
                        f"({MIN_EXAMPLES_PER_CLIENT} examples each)")
    if cfg.server_holdout > n_train - least:
        raise ConfigError(f"run-config key 'server-holdout': must be at most {n_train - least} "
                          f"({cfg.dataset} has {n_train} training examples and each of the "
                          f"{num_clients} clients needs {MIN_EXAMPLES_PER_CLIENT}), got "
                          f"{cfg.server_holdout}")
    left = n_train - cfg.server_holdout
    if cfg.train_subset and not least <= cfg.train_subset <= left:
        raise ConfigError(f"run-config key 'train-subset': must be 0 (all) or in [{least}, "
                          f"{left}] ({MIN_EXAMPLES_PER_CLIENT} examples for each of the "
                          f"{num_clients} clients; {cfg.dataset}'s {n_train} training examples "
                          f"less server-holdout {cfg.server_holdout}), got {cfg.train_subset}")


def check_audit_canaries(cfg: RunConfig, num_clients: int) -> None:
    """``audit-canaries``: client-level canaries are clients (at most ``num_clients``);
    DP-SGD's are examples, at most :data:`MAX_CANARY_EXAMPLES_PER_CLIENT` per client."""
    if cfg.trainer == "dpsgd":
        most, what = MAX_CANARY_EXAMPLES_PER_CLIENT * num_clients, (
            f"{MAX_CANARY_EXAMPLES_PER_CLIENT} canary examples per client, {num_clients} "
            "clients")
    else:
        most, what = num_clients, "canaries are clients under client-level DP"
    if cfg.audit_canaries > most:
        raise ConfigError(f"run-config key 'audit-canaries': must be at most {most} ({what}), "
                          f"got {cfg.audit_canaries}")


def preflight(cfg: RunConfig, num_clients: int, run_dir: Path, num_cpus: float = 1.0,
              ray_address: str | None = None, parallel: int | None = None) -> None:
    """Settings that cannot work stop here, before any process starts (one-line
    :class:`UserError` each): no clients, no Ray installed, more ``min-train-nodes`` than
    clients (the server would wait for nodes that never come), a new run on an existing run
    directory, a resume of a directory that is not there or whose ledger or round log is
    damaged, a dataset or data-dir that is not there, a budget that one round at an explicit
    ``noise-multiplier`` already exceeds, a ``ray_address`` that is malformed or where
    nothing answers, more clients, ``server-holdout`` or ``train-subset`` than the dataset's
    training examples hold (:func:`check_data_size`), more ``audit-canaries`` than the
    clients can host. Nothing here writes a file: :func:`simulate` runs it before taking the
    run folder's lock."""
    if num_clients < 1:
        raise UserError(f"--clients must be at least 1, got {num_clients}")
    if importlib.util.find_spec("ray") is None:   # else flwr-simulation fails in the log
        raise UserError("dpfl simulate needs Flower's simulation engine (Ray), which is not "
                        "installed here: pip install 'dpfl[simulation]'")
    check_cpus_per_client(num_cpus, cluster=ray_address is not None)
    check_parallel_clients(parallel, num_cpus, cluster=ray_address is not None)
    if ray_address is not None:
        check_ray_address(ray_address)
    if cfg.min_train_nodes > num_clients:
        raise UserError(f"run-config key 'min-train-nodes': {cfg.min_train_nodes} nodes "
                        f"needed but --clients is {num_clients}: the server would wait for "
                        "nodes that never come")
    check_run_dir(run_dir, cfg.resume)
    if cfg.resume:   # its ledger and round log, as the ServerApp would read them
        RunDir(run_dir).check_resumable()
    check_data_size(cfg, num_clients, check_dataset(cfg.dataset, cfg.data_dir, cfg.download))
    check_audit_canaries(cfg, num_clients)
    if (cfg.is_private and cfg.noise_multiplier > 0 and not cfg.resume
            and not server_trust(cfg).secure_sum):
        # an explicit sigma: is one round affordable? (calibrated sigmas are by construction;
        # the ServerApp checks every case again, in deployments too; a distributed round's
        # charge depends on the model's size, which only the ServerApp has built)
        with _errors_only("flwr"):  # no strategy warnings here
            strategy = build_strategy(configured(cfg), {
                i: len(s.train) for i, s in enumerate(splits_for(cfg, num_clients))})
        if not round_one_fits_by_rdp(strategy, cfg):
            first_round_affordable(strategy, cfg)   # the run's own accountant decides


@contextmanager
def _errors_only(logger: str) -> Iterator[None]:
    """The named logger shows only errors inside the block (its level restored after)."""
    log_ = logging.getLogger(logger)
    level = log_.level
    log_.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log_.setLevel(level)


def round_one_fits_by_rdp(strategy: Any, cfg: RunConfig) -> bool:
    """Whether the RDP accountant already shows one round within ``target-epsilon``: RDP's
    epsilon bounds the true epsilon from above, so the round fits, and the launcher skips its
    own accountant's check (a PLD evaluation: 0.6 s at q = 0.1, 0.9 s at q = 0.01, on the
    way to round 1; the ServerApp checks again with the run's accountant before any
    training). False: ask the run's accountant."""
    if cfg.accountant == "rdp":
        return False
    try:
        with _errors_only("absl"):   # dp-accounting's notes on fractional RDP orders
            first_round_affordable(strategy, replace(cfg, accountant="rdp"))
    except ConfigError:
        return False
    return True


def resolved(path: Path, option: str) -> Path:
    """``path`` made absolute with its symbolic links resolved, or a :class:`UserError`
    naming ``option`` (a symbolic link loop, a component that cannot be read)."""
    try:
        return path.resolve()
    except RuntimeError as exc:   # Python < 3.13: "Symlink loop from '...'"
        raise UserError(f"{option} {path}: a symbolic link loop ({exc})") from None
    except OSError as exc:
        raise UserError(f"{option} {path}: cannot resolve it "
                        f"({exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''})"
                        ) from None


@dataclass(frozen=True)
class NodeLayout:
    """How a simulation hosts its clients: ``supernodes`` simulated SuperNodes, and
    ``cohort_clients`` clients between them (0: one client per node)."""

    supernodes: int
    cohort_clients: int


# cohort nodes per ClientApp running at once (cohort-nodes = -1): a round's sampled clients
# fall on the nodes by id, so the nodes' cohorts differ in size; with 4 per ClientApp and the
# largest dispatched first (process_backend.add_messages_on_arrival) the two workers of this
# machine ended a 1,000-client round 0.02 s apart on average, 0.12 s with 2 per ClientApp
# in arrival order
COHORTS_PER_CLIENTAPP = 4


def node_layout(cfg: RunConfig, num_clients: int, num_cpus: float, parallel: int | None,
                cluster: bool = False) -> NodeLayout:
    """The simulation's nodes for ``num_clients`` clients under ``cohort-nodes``: K > 0
    nodes when K < clients; automatic (-1): :data:`COHORTS_PER_CLIENTAPP` times the
    ClientApps that run at once (so that a round's cohorts balance over them), when there
    are more clients than that, on a
    private Ray and not under SecAgg+ (whose stages are per node); else one node per
    client."""
    one_each = NodeLayout(num_clients, 0)
    k = cfg.cohort_nodes
    if k == 0:
        return one_each
    if server_trust(cfg).secure_sum:
        if k > 0:
            raise UserError("run-config key 'cohort-nodes': SecAgg+ (trust=distributed) runs "
                            "its stages per node: one client per node (set 0 or -1)")
        return one_each
    if k < 0:
        if cluster:   # the cluster's size is its own: keep Flower's one node per client
            return one_each
        k = COHORTS_PER_CLIENTAPP * parallel_clientapps(num_cpus, parallel)
    return one_each if k >= num_clients else NodeLayout(k, num_clients)


def parallel_clientapps(num_cpus: float, parallel: int | None) -> int:
    """How many ClientApps run at once on this machine: ``parallel``, else one per
    ``num_cpus`` of its CPUs (as Flower sizes its Ray actor pool)."""
    return parallel if parallel is not None else max(1, int((os.cpu_count() or 1) // num_cpus))


def process_workers(cfg: RunConfig, num_cpus: float, parallel: int | None,
                    cluster: bool) -> int:
    """The worker processes the simulation forks for its ClientApps
    (:mod:`dpfl.runtime.process_backend`); 0 = Flower's Ray actors (``simulation-backend =
    "ray"``, or a Ray cluster)."""
    if cluster or cfg.simulation_backend != "process":
        return 0
    return parallel_clientapps(num_cpus, parallel)


