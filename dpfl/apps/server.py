"""dpfl's ServerApp: builds the configured method's strategy, runs the rounds, evaluates
the global model on the server's test set (after every ``evaluate-every``-th round and the
last), keeps the privacy ledger, writes the run directory and checkpoints every round
(``resume=true`` continues a run from its last checkpoint).

The run is four steps — :func:`setup`, :func:`resume` (or a fresh start), :func:`run_round`
per round, :func:`finish` — over one :class:`Federation` that holds the run's state; the
strategy is talked to through ``start_round`` / ``finish_round`` and their return values.
"""

from __future__ import annotations

import copy
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from dpfl.apps.client import WARM
from dpfl.apps.status import (
    end_of_log_line,
    launcher_prints_summary,
    status_path,
    write_status,
)
from dpfl.config import ConfigError, RunConfig
from dpfl.data import label_counts, load_dataset, splits_for, test_tensors
from dpfl.data.plots import plot_label_counts
from dpfl.errors import UserError
from dpfl.logs import get_logger, quiet_known_warnings, quiet_routine_flower_records
from dpfl.methods import (
    build_strategy,
    configured,
    guarantee,
    method_for,
    parse_run_config,
)
from dpfl.models.evaluation import device_for
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent, history_terms
from dpfl.privacy.accounting.ledger import LEDGER_INDENT_CLIENTS, Ledger, client_key
from dpfl.privacy.trust import (
    check_overflow,
    distributed_noise_multiplier,
    min_survivors,
    noise_shares,
    overflow_note,
    share_limit,
)
from dpfl.privacy.verdict import Guarantee, over_history
from dpfl.server import runregistry
from dpfl.server.central_budget import CentralBudget
from dpfl.server.cohort import CohortGrid
from dpfl.server.evaluation import classification_metrics, divergence, evaluation_copy
from dpfl.server.exchange import ReplyExchange
from dpfl.server.node_index import index_instructions_by_node
from dpfl.server.observer import UpdateObserver
from dpfl.server.phases import PhaseClock
from dpfl.server.plots import plot_accuracy, plot_epsilon
from dpfl.server.report import epsilon_table
from dpfl.server.rundir import CONFIG_FILE, RunDir
from dpfl.server.runidentity import NUM_CLIENTS, check_resume
from dpfl.server.secagg import SecAggPlusServer, SecureSum
from dpfl.server.strategy import DPFLStrategy, RoundRecord, wait_for_nodes
from dpfl.server.trust import server_trust
from dpfl.tensors import flatten

log = get_logger("flwr.dpfl.server")
# the known harmless third-party warnings and Flower's routine records logged as warnings,
# filtered precisely wherever this app runs (a deployment's SuperNode or SuperExec too, and
# the Ray actors of a simulation)
quiet_known_warnings()
quiet_routine_flower_records()
# After the last round, how long the server waits for replies still in flight (each is a
# release that must be charged); only spent when some instruction is still unanswered.
LATE_REPLY_WAIT = 60.0
app = ServerApp()


@dataclass
class Federation:
    """Everything one run holds between rounds."""

    grid: Grid
    cfg: RunConfig
    run_dir: RunDir
    guarantee: Guarantee
    strategy: DPFLStrategy
    model: torch.nn.Module   # the server's copy for central evaluation (evaluation_copy)
    x_test: torch.Tensor
    y_test: torch.Tensor
    device: torch.device
    num_nodes: int
    arrays: ArrayRecord
    ledger: Ledger
    exchange: ReplyExchange
    t_start: float
    observer: UpdateObserver
    start: int = 1                      # first round to run
    rounds: list[dict[str, Any]] = field(default_factory=list)
    initial: dict[str, float] = field(default_factory=dict)
    saved_config: dict[str, Any] | None = None   # config.json of the run a resume continues
    diverged: int | None = None   # the round the run was first seen diverging (logged once)
    label_counts: np.ndarray | None = None   # (clients, classes), for labels.png
    plot_jobs: list[Future[Path]] = field(default_factory=list)   # figures being drawn
    initial_job: Future[dict[str, float]] | None = None   # round 0's evaluation, while it runs
    warm_ids: list[str] = field(default_factory=list)   # the warm-up queries' message ids
    central_budget: CentralBudget | None = None   # trust=central's check, once asked


# one thread for the ServerApp's work beside the rounds (round 0's evaluation, the figures:
# matplotlib is used from this thread only)
_BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpfl-server")


def _federated_evaluation(strategy: DPFLStrategy, grid: Grid, rnd: int, arrays: ArrayRecord,
                          cfg: RunConfig) -> dict[str, Any] | None:
    messages = strategy.configure_evaluate(rnd, arrays, ConfigRecord(), grid)
    if not messages:
        return None
    replies = grid.send_and_receive(messages=messages, timeout=cfg.round_timeout)
    metrics = strategy.aggregate_evaluate(rnd, replies)
    return dict(metrics) if metrics is not None else None


def _epsilon_series(rounds: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rounds[:1]:
        for client in r.get("epsilon", {}):
            series[client] = [(r["round"] - 1, 0.0)]
    for r in rounds:
        for client, eps in r.get("epsilon", {}).items():
            series.setdefault(client, []).append((r["round"], eps))
    return series


def _skip_busy(record: RoundRecord, exchange: ReplyExchange, rnd: int, messages,
               name=str) -> list:
    """Drop instructions to nodes still training on an earlier one (a second concurrent
    training of one node would start from the same privacy history and lose a charge)."""
    busy = exchange.busy_nodes()
    kept = [m for m in messages if m.metadata.dst_node_id not in busy]
    skipped = sorted({int(m.metadata.dst_node_id) for m in messages} & busy)
    if skipped:
        record.sampled = [n for n in record.sampled if n not in skipped]
        log.warning("round %d: %s still busy with an earlier round: not asked", rnd,
                    ", ".join(name(n) for n in skipped))
    return kept


def _charge_late(strategy: DPFLStrategy, record: RoundRecord, late) -> None:
    """Charge replies to earlier rounds that arrived during this one (never aggregated)."""
    for sent, msg in late:
        charge = strategy.charge_late_reply(msg, sent)
        if charge is not None:
            record.late.append(charge)
            log.warning("round %d: late reply to round %d from %s charged", record.server_round,
                        sent, charge.client)


def budgets_exhausted(record, num_nodes: int) -> bool:
    """True when every connected node was asked and every one refused at its budget."""
    return (not record.accepted and len(record.sampled) >= num_nodes > 0
            and len(record.rejected) == len(record.sampled)
            and all(r.kind == "refused" for r in record.rejected))


def in_simulation(grid: Grid) -> bool:
    """Whether ``grid`` is a simulation's (Flower's InMemoryGrid, or a CohortGrid over one:
    they hold the in-memory LinkState), not a deployment's gRPC grid."""
    return getattr(grid, "state", None) is not None


def _speed_up_simulation_engine(grid: Grid) -> None:
    """In a simulation, index Flower's pending instructions by node (dpfl.server.node_index):
    the engine's per-node polling then reads one node's messages, not all of them.
    ``DPFL_FLOWER_NODE_INDEX=0`` keeps Flower's own scan (the bench's A/B)."""
    if os.environ.get("DPFL_FLOWER_NODE_INDEX", "1") == "0":
        return
    if in_simulation(grid) and index_instructions_by_node(grid.state):
        log.debug("Flower's simulation state indexes its instructions by node")  # internal


def warm_nodes(grid: Grid, nodes: list[int]) -> list[str]:
    """In a simulation, a ``query.warm`` message to every node as soon as it is connected
    (:func:`dpfl.apps.client_handlers.warm`): each ClientApp actor imports torch, Opacus and
    dpfl, loads its node's data and computes the first plan's noise multiplier while the
    ServerApp sets up, not when round 1's instruction arrives. The replies carry nothing
    but timings (collected at the end). None in a deployment: a SuperNode may start a fresh
    process per message, where warming would only cost."""
    if not in_simulation(grid) or os.environ.get("DPFL_WARM_NODES", "1") == "0":
        return []
    if isinstance(grid, CohortGrid):   # a host imports once: one client of each host
        nodes = grid.one_client_per_host(nodes)
    messages = [Message(content=RecordDict(), message_type=f"{MessageType.QUERY}.{WARM}",
                        dst_node_id=node) for node in nodes]
    return list(grid.push_messages(messages))


def exchange_poll_seconds(grid: Grid) -> float:
    """How often a round pulls its replies: every 20 ms from a simulation's in-memory state
    (a pull is a dictionary lookup; a 100-client round's replies then wait ~10 ms, not
    ~125 ms, on average), every 250 ms over a deployment's gRPC link."""
    return 0.02 if in_simulation(grid) else 0.25


def cohort_grid(grid: Grid, cfg: RunConfig) -> Grid:
    """``grid`` as the ServerApp uses it: with ``cohort-clients`` = N in a simulation, a
    :class:`~dpfl.server.cohort.CohortGrid` of N client nodes over the simulation's host
    nodes; else ``grid`` itself. Refused where a cohort cannot be: a deployment (a node is
    a device), SecAgg+ (its stages are per node), an operator's node map."""
    if cfg.cohort_clients == 0:
        return grid
    if not in_simulation(grid):
        raise ConfigError("run-config key 'cohort-clients': cohort nodes are for simulations; "
                          "in a deployment every SuperNode is one client (set 0)")
    if server_trust(cfg).secure_sum:
        raise ConfigError("run-config key 'cohort-clients': SecAgg+ (trust=distributed) runs "
                          "its stages per node: one client per node (set 0)")
    if cfg.node_partitions:
        raise ConfigError("run-config key 'cohort-clients': node-partitions maps nodes to "
                          "clients; a cohort simulation maps them itself (set one of them)")
    log.info("cohort simulation: %d clients over the simulation's nodes",
             cfg.cohort_clients)
    return CohortGrid(grid, cfg.cohort_clients)


def await_warm_nodes(fed: Federation) -> None:
    """Before round 1: wait (at most ``round-timeout``) for the warm-up replies, so that
    round 1's instructions find idle, warm nodes and not a queue of warm-ups (a SecAgg+
    stage, which has deadlines, must not wait behind another node's warm-up); log how long
    each took (DEBUG). A node that does not answer in time is not waited for again."""
    pending = set(fed.warm_ids)
    fed.warm_ids = []
    deadline = time.monotonic() + fed.cfg.round_timeout
    while pending:
        for reply in fed.grid.pull_messages(list(pending)):
            pending.discard(reply.metadata.reply_to_message_id)
            if reply.has_error():
                log.debug("warm-up failed on node %s: %s", reply.metadata.src_node_id,
                          reply.error.reason)
            else:
                log.debug("node %s warmed up in %.2f s", reply.metadata.src_node_id,
                          reply.content["metrics"]["warm-seconds"])
        if pending and time.monotonic() > deadline:
            log.debug("%d node(s) did not answer the warm-up in round-timeout", len(pending))
            return
        if pending:
            time.sleep(0.05)


def setup(grid: Grid, cfg: RunConfig) -> Federation:
    """Check the run directory, build the strategy and model, wait for the nodes, bind the
    public partition sizes, check that a fresh run's first round fits the budget, create
    the run directory and a fresh ledger."""
    t_start = time.time()
    cfg = configured(cfg)
    _speed_up_simulation_engine(grid)
    run_dir = RunDir.open(cfg)   # locked: one writer per run folder
    try:
        return _set_up(grid, cfg, run_dir, t_start)
    except BaseException:
        run_dir.close()
        raise


def _set_up(grid: Grid, cfg: RunConfig, run_dir: RunDir, t_start: float) -> Federation:
    grid = cohort_grid(grid, cfg)
    # a resume continues the run's identity, fixed at its start (dpfl.server.runidentity)
    saved = run_dir.saved_config() if cfg.resume else None
    if saved is not None:
        check_resume(saved, cfg.to_dict(), str(run_dir.path))
    ds = load_dataset(cfg.dataset, cfg.data_dir, cfg.download)
    x_test, y_test = test_tensors(cfg.dataset, cfg.data_dir, cfg.download)
    torch.manual_seed(cfg.seed)
    model = method_for(cfg).build_model(cfg, ds.input_shape, ds.num_classes)
    nodes = wait_for_nodes(grid, cfg.min_train_nodes, cfg.node_wait)
    num_nodes = len(nodes)
    warm_ids = warm_nodes(grid, nodes)
    if saved is not None:
        check_resume(saved, {NUM_CLIENTS: num_nodes}, str(run_dir.path))
    splits = list(splits_for(cfg, num_nodes))
    # the run's one ledger (a resume continues it from disk in place: Ledger.continue_from)
    ledger = Ledger(cfg.delta, cfg.accountant,
                    budget=cfg.target_epsilon if cfg.is_private else None)
    # public sizes: the server plans each client's release (and a method may allocate by them)
    strategy = build_strategy(cfg, {i: len(s.train) for i, s in enumerate(splits)}, model,
                              ledger)
    overflow = check_trust(strategy, cfg, num_nodes, strategy.guard.dim)
    limits = [("record-updates", cfg.record_updates)]
    if cfg.trainer != "dpsgd":   # canary clients (DP-SGD canaries are examples, any number)
        limits.append(("audit-canaries", cfg.audit_canaries))
    for key, value in limits:
        if value > num_nodes:
            raise ConfigError(f"run-config key '{key}': {value} clients but the federation "
                              f"has {num_nodes}")
    if num_nodes > len(ds.y_train):
        raise ConfigError(f"{num_nodes} clients but only {len(ds.y_train)} training samples "
                          f"in dataset '{cfg.dataset}'")
    claim = with_overflow(guarantee(cfg), overflow)
    log.info("dpfl run %s: %s, %s, %d clients, %d rounds", run_dir.path, cfg.strategy,
             cfg.dataset, num_nodes, cfg.num_rounds)
    log.info("privacy guarantee: %s (unit=%s, relation=%s, sampling=%s, delta=%g)",
             claim.verdict, claim.unit, claim.relation, claim.sampling, claim.delta)
    check_operator_map(strategy, num_nodes, grid)
    budget = None if cfg.resume else first_round_affordable(strategy, cfg)
    run_dir.create()
    # drawn beside round 1 (matplotlib's import and the render took ~1.1 s on the way to
    # round 1, results/speed/startup-before.txt, and ~0.6 s after the last round at 10,000
    # clients)
    counts = label_counts(ds.y_train, splits, ds.num_classes) if cfg.plots else None
    eval_model, x_test = evaluation_copy(model, x_test)
    return Federation(grid, cfg, run_dir, claim, strategy, eval_model, x_test, y_test,
                      device_for(), num_nodes, ArrayRecord(model.state_dict()), ledger,
                      ReplyExchange(grid, namer=strategy.client_name,
                                    poll_seconds=exchange_poll_seconds(grid)), t_start,
                      UpdateObserver(cfg, run_dir.path), saved_config=saved,
                      label_counts=counts, warm_ids=warm_ids, central_budget=budget)


def check_operator_map(strategy: DPFLStrategy, num_nodes: int, grid: Grid) -> None:
    """``node-partitions`` must name partitions of this federation; a connected node it
    does not name will be refused (a warning now, a rejection per reply later)."""
    mapping = strategy.nodes.operator_map
    if not mapping:
        return
    unknown = sorted(set(mapping.values()) - set(strategy.partition_sizes))
    if unknown:
        raise ConfigError(f"run-config key 'node-partitions': partition(s) {unknown} are not "
                          f"among the {num_nodes} partitions of this federation")
    strangers = sorted(set(grid.get_node_ids()) - set(mapping))
    if strangers:
        log.warning("node(s) %s are connected but not in node-partitions: their replies "
                    "will be refused", ", ".join(map(str, strangers)))


def resume(fed: Federation) -> bool:
    """Continue the run directory's run when ``resume=true`` and it recorded anything
    (:meth:`RunDir.resume_point`: the checkpoint's model and strategy state, the privacy
    history of ``ledger.json``; refusals are one-line errors); True when resumed."""
    point = fed.run_dir.resume_point(
        fed.cfg.resume_without_checkpoint,
        population=[client_key(p) for p in sorted(fed.strategy.partition_sizes)],
        adaptive=fed.strategy.guard.adaptive) if fed.cfg.resume else None
    if point is None:
        return False
    runregistry.claim(fed.run_dir.path)   # refused for a copy of a folder that still exists
    if fed.saved_config is None:
        raise UserError(f"{fed.run_dir.file(CONFIG_FILE)} is missing: cannot check that this "
                        "resume has the run's settings; restore it (refusing to resume)")
    if point.model is not None:
        fed.arrays = ArrayRecord(point.model)
        fed.strategy.load_state_dict(point.strategy)
    fed.ledger.continue_from(point.ledger)   # the guard's ledger: the same object
    fed.start = point.round + 1
    fed.rounds = point.rounds
    fed.initial = point.initial or classification_metrics(
        _with_weights(fed.model, fed.arrays), fed.x_test, fed.y_test, fed.device)
    # clients whose node state was lost get their recorded events back in every
    # instruction (DPGuard.history_record), whichever round they are next sampled in
    log.info("resuming %s after round %d (%d charges on the ledger)", fed.run_dir.path,
             point.round, len(fed.ledger.charges))
    own = fed.guarantee.verdict
    # a verdict never improves over the run's history: its start's, each resume's, this one's
    fed.guarantee = over_history(fed.guarantee, [_started_verdict(fed.saved_config),
                                                 *fed.run_dir.resume_verdicts()])
    if fed.guarantee.verdict != own:
        log.warning("verdict of this run: %s", fed.guarantee.verdict)
    fed.run_dir.record_resume({"resumed-after-round": point.round, "time": time.time(),
                               "num-rounds": fed.cfg.num_rounds,
                               "fresh-model": point.model is None,
                               "pid": os.getpid(), "verdict": own})
    return True


def _started_verdict(saved: dict[str, Any]) -> str | None:
    """The verdict of the run as it started (its config.json); None when that config no
    longer parses (the part is then unknown, never assumed formal)."""
    try:
        return guarantee(parse_run_config({k: v for k, v in saved.items()
                                           if k != NUM_CLIENTS})).verdict
    except (ConfigError, ValueError, TypeError):
        return None


def _with_weights(model: torch.nn.Module, arrays: ArrayRecord) -> torch.nn.Module:
    model.load_state_dict(arrays.to_torch_state_dict())
    return model


def central_budget(strategy: DPFLStrategy, cfg: RunConfig) -> CentralBudget | None:
    """trust=central's budget check before each round (None: not trust=central)."""
    central = strategy.central
    if central is None or not cfg.is_private:
        return None
    return CentralBudget(central.events, cfg.num_rounds, cfg.target_epsilon, cfg.delta,
                         cfg.accountant)


def first_round_affordable(strategy: DPFLStrategy, cfg: RunConfig) -> CentralBudget | None:
    """A fresh run whose first round alone already costs some client more than
    ``target-epsilon`` (with the same accountant and budget check the client uses) stops
    here, before any training, instead of after a round of refusals. Returns trust=central's
    budget check (:func:`central_budget`)."""
    if not cfg.is_private:
        return None
    if strategy.central is not None:
        budget = central_budget(strategy, cfg)
        eps = budget.epsilon(strategy.central.events(1))
        if eps > cfg.target_epsilon:
            raise ConfigError(
                f"run-config key 'target-epsilon': one central round already costs every "
                f"client epsilon {eps:.4g} > {cfg.target_epsilon:g} (sigma "
                f"{strategy.central.sigma:.4g}): raise target-epsilon or the noise")
        return budget
    for pid in sorted(strategy.guard.partition_sizes):
        event = strategy.guard.planned_event(pid, 1)
        history = PrivacyHistory(adaptive=strategy.guard.adaptive)
        refuse, eps = history.would_exceed(event, cfg.target_epsilon, cfg.delta, cfg.accountant)
        if refuse:
            raise ConfigError(
                f"run-config key 'target-epsilon': one round already costs client-{pid} "
                f"epsilon {eps:.4g} > {cfg.target_epsilon:g} (sigma {event.sigma:.4g}, "
                f"{'the Rényi filter' if history.adaptive else cfg.accountant + ' accountant'}"
                "): raise target-epsilon or the noise "
                "(noise-multiplier=0 calibrates it)")


def start_fresh(fed: Federation) -> None:
    """Round 0: the run's identity (``config.json``, written once), an empty ledger and
    rounds file, the initial model's accuracy and a round-0 checkpoint (so that from the
    first charge on, a resume has a model)."""
    fed.run_dir.write_json(CONFIG_FILE, {**fed.cfg.to_dict(), NUM_CLIENTS: fed.num_nodes})
    runregistry.start(fed.run_dir.path)   # one branch per run: a copy cannot also resume
    ledger_text = fed.run_dir.save_ledger(fed.ledger)
    fed.run_dir.file("rounds.jsonl").write_text("")
    # the initial model is evaluated on a copy while round 1 trains (the server only waits
    # for replies then): ~1.2 s off the way to round 1 (results/speed/startup-before.txt).
    # Its metrics join the run's record at round 1's end (the round-0 checkpoint has none:
    # a resume from it evaluates the initial model again)
    model = _with_weights(copy.deepcopy(fed.model), fed.arrays)
    fed.initial_job = _BACKGROUND.submit(classification_metrics, model, fed.x_test, fed.y_test,
                                         fed.device)
    fed.run_dir.save_checkpoint(_checkpoint(fed, 0, ledger_text))


def initial_metrics(fed: Federation) -> dict[str, float]:
    """The initial model's metrics, waiting for round 0's evaluation if it still runs."""
    if fed.initial_job is not None:
        job, fed.initial_job = fed.initial_job, None
        fed.initial = job.result()
        log.info("round 0 (initial model): accuracy %.4f", fed.initial["accuracy"])
    return fed.initial


def _checkpoint(fed: Federation, rnd: int, ledger_text: str) -> dict[str, Any]:
    """Round ``rnd``'s checkpoint. ``ledger_text``: ``ledger.json``'s text as the round saved
    it (nothing is charged between that save and the checkpoint), kept as one JSON text: a
    10,000-client ledger as nested objects took ~0.5 s a round to walk and write, and
    encoding it a second time another ~0.2 s (results/speed/README.md)."""
    return {"round": rnd, "model": fed.arrays.to_torch_state_dict(),
            "strategy": fed.strategy.state_dict(),
            "initial": fed.initial if rnd == 0 else initial_metrics(fed),
            "ledger": ledger_text}


def _central_metrics(fed: Federation) -> dict[str, float]:
    """The global model's metrics on the server's test set."""
    fed.model.load_state_dict(fed.arrays.to_torch_state_dict())
    return classification_metrics(fed.model, fed.x_test, fed.y_test, fed.device)


def _metric(central: dict[str, float] | None, key: str) -> str:
    return f"{central[key]:.4f}" if central else "-"


def run_round(fed: Federation, rnd: int) -> RoundRecord:
    """One round: instructions, replies, aggregation, charges, evaluation, checkpoint."""
    cfg, strategy, ledger = fed.cfg, fed.strategy, fed.ledger
    clock = PhaseClock()
    charged_before = len(ledger.charges)
    messages, record = strategy.start_round(rnd, fed.arrays, fed.grid)
    messages = _skip_busy(record, fed.exchange, rnd, messages, fed.strategy.client_name)
    clock.lap("select")
    if strategy.trust.secure_sum:  # SecAgg+: the server sees only the sum
        late = []
        secure = _secure_sum(fed, messages, rnd)
        clock.lap("exchange")
        outcome = strategy.finish_secure_round(rnd, record, secure)
    else:
        replies, late = fed.exchange.send_and_receive(messages, rnd, cfg.round_timeout,
                                                      on_reply=strategy.reply_arrived)
        clock.lap("exchange")
        if fed.central_budget is not None:   # the next round's epsilon, beside this one's end
            fed.central_budget.prefetch_next(_population_spent(fed), rnd)
        outcome = strategy.finish_round(rnd, record, replies)
    if fed.observer.active:   # the model the round's clients started from
        sent = strategy.sent_arrays or fed.arrays
        fed.observer.observe(rnd, record.accepted, flatten(sent.to_torch_state_dict()))
    if outcome.arrays is not None:
        fed.arrays = outcome.arrays
    _charge_late(strategy, record, late)
    clock.lap("aggregate")
    # every release of the round is charged: on disk before anything else is published
    if fed.central_budget is not None:
        fed.central_budget.settle(rnd)
    ledger_text = fed.run_dir.save_ledger(ledger)
    clock.lap("ledger")
    fed_eval = _federated_evaluation(strategy, fed.grid, rnd, fed.arrays, cfg)
    central = (_central_metrics(fed) if rnd % cfg.evaluation_period == 0 or rnd == cfg.num_rounds
               else None)
    clock.lap("evaluate")
    _report_divergence(fed, rnd, central, record)
    epsilons = ledger.epsilons() if cfg.is_private else {}
    clock.lap("accounting")
    line = {
        "round": rnd, "started": round(clock.start, 3), "seconds": round(clock.total(), 3),
        "phase-seconds": clock.laps, **({"central": central} if central else {}),
        "train": dict(outcome.metrics) if outcome.metrics is not None else {},
        "sampled-nodes": record.sampled,
        "clients": record.client_metrics(),
        "epsilon": epsilons,
    }
    if cfg.is_private:
        line["charges"] = record.charge_lines()
        # the round's ledger entries verbatim: a resume restores any the ledger lacks
        line["ledger-charges"] = ledger.charges[charged_before:]
        line["ledger-mismatches"] = ledger.mismatches_in(rnd)
    if fed_eval is not None:
        line["federated-evaluation"] = fed_eval
    fed.rounds.append(line)
    fed.run_dir.publish_round(line, _checkpoint(fed, rnd, ledger_text))
    fed.observer.keep_global(rnd, fed.arrays.to_torch_state_dict())
    eps = line["epsilon"]
    elapsed = time.time() - fed.t_start
    eta = elapsed / (rnd - fed.start + 1) * (cfg.num_rounds - rnd)
    log.info("[round %d/%d] accuracy %s  macro-F1 %s  | %d accepted, %d dropped | "
             "max epsilon %s | %.1f s (ETA %.0f s)", rnd, cfg.num_rounds,
             _metric(central, "accuracy"), _metric(central, "macro-f1"), len(record.accepted),
             len(record.rejected), f"{max(eps.values()):.3f}" if eps else "-",
             line["seconds"], eta)
    return record


def _report_divergence(fed: Federation, rnd: int, central: dict[str, float] | None,
                       record: RoundRecord) -> None:
    """A run whose loss explodes says so, in one line, the first time (see
    :func:`dpfl.server.evaluation.divergence`)."""
    if fed.diverged is not None:
        return
    why = divergence(initial_metrics(fed).get("loss"), central.get("loss") if central else None,
                     [r.reason for r in record.rejected], fed.cfg.lr)
    if why is not None:
        fed.diverged = rnd
        log.warning("round %d: %s", rnd, why)


def _population_spent(fed: Federation) -> list[PrivacyEvent]:
    """The history charged to every client of the population so far (empty before the
    first population release)."""
    ledger = fed.ledger
    return list(ledger.history(ledger.population[0]).events) if ledger.population else []


def central_budget_spent(fed: Federation, rnd: int) -> bool:
    """trust=central: True when round ``rnd``'s release would take the clients (all
    charged alike) past ``target-epsilon`` — the server keeps the budget for them."""
    if fed.central_budget is None:
        fed.central_budget = central_budget(fed.strategy, fed.cfg)
    if fed.central_budget is None or not fed.ledger.population:
        return False
    spent = _population_spent(fed)
    if fed.central_budget.spent_by(spent, rnd):
        return True
    fed.central_budget.prefetch(spent, rnd)   # the ledger's epsilon after the round
    return False


def _secure_sum(fed: Federation, messages, rnd: int) -> SecureSum:
    """One SecAgg+ round over the round's train instructions (``dpfl.server.secagg``)."""
    cfg = fed.cfg
    server = SecAggPlusServer(fed.grid, share_limit(len(messages)), cfg.secagg_num_shares,
                              cfg.secagg_threshold, min_survivors(cfg, len(messages)),
                              cfg.round_timeout)
    guard = fed.strategy.guard
    # a masked vector joins the sum only from a node whose partition claim holds
    return server.run({int(m.metadata.dst_node_id): m.content for m in messages},
                      group=str(rnd), admit=lambda msg: guard.sender_partition(msg)[1])


def with_overflow(claim: Guarantee, added: float) -> Guarantee:
    """The guarantee with the delta SecAgg+'s share overflow adds (:func:`check_trust`)."""
    if added <= 0:
        return claim
    return replace(claim, delta=claim.delta + added,
                   scope=claim.scope + "; " + overflow_note(added, claim.delta))


def check_trust(strategy: DPFLStrategy, cfg: RunConfig, num_nodes: int, dim: int) -> float:
    """Settings of the trust model that can only be checked against the federation: the
    SecAgg+ round size, n_min and the integer range of a share (ConfigError naming the
    key). Returns the delta the run's share overflow adds to the guarantee (0 unless
    distributed; :func:`dpfl.privacy.trust.check_overflow`)."""
    if not strategy.trust.secure_sum:
        return 0.0
    sampled = max(int(num_nodes * cfg.fraction_train), min(cfg.min_train_nodes, num_nodes))
    if sampled < 2:
        raise ConfigError("run-config key 'fraction-train': SecAgg+ needs at least 2 clients "
                          f"per round, got {sampled}")
    if cfg.secagg_noiseless >= min_survivors(cfg, sampled):
        raise ConfigError(f"run-config key 'secagg-noiseless': {cfg.secagg_noiseless} of a "
                          f"round's {min_survivors(cfg, sampled)} survivors (n_min) would "
                          "leave no honest share to carry the noise: it must be < n_min")
    if cfg.secagg_min_survivors > sampled:
        raise ConfigError(f"run-config key 'secagg-min-survivors': {cfg.secagg_min_survivors}"
                          f" > the {sampled} clients sampled per round")
    try:
        return check_overflow(cfg, distributed_noise_multiplier(cfg, dim, num_nodes), dim,
                              sampled, noise_shares(cfg, sampled))
    except ValueError as exc:
        raise ConfigError(f"run-config key 'secagg-scale': {exc}") from exc


def finish(fed: Federation) -> dict[str, Any]:
    """Charge replies still in flight, write the ledger, summary and plots."""
    cfg, strategy, ledger, rounds = fed.cfg, fed.strategy, fed.ledger, fed.rounds
    # replies still in flight were released to the server too: wait for them (bounded)
    if fed.exchange.outstanding:
        log.info("waiting up to %.0f s for %d replies still in flight", LATE_REPLY_WAIT,
                 len(fed.exchange.outstanding))
    late_at_end = fed.exchange.drain(wait=LATE_REPLY_WAIT)
    for sent, msg in late_at_end:
        strategy.charge_late_reply(msg, sent)
    if late_at_end:
        log.warning("%d late replies charged after the last round", len(late_at_end))
    fed.run_dir.save_ledger(ledger)
    # the last round run is always evaluated (evaluate-every skips others; a run the
    # budget stopped early may have ended on a skipped one)
    final = (rounds[-1].get("central") or _central_metrics(fed)) if rounds else {}
    if cfg.plots:   # drawn in the background thread while the summary is written
        fed.plot_jobs.append(_BACKGROUND.submit(plot_accuracy, rounds,
                                                fed.run_dir.file("accuracy.png"),
                                                f"{cfg.strategy} on {cfg.dataset}"))
        if cfg.is_private:
            fed.plot_jobs.append(_BACKGROUND.submit(plot_epsilon, _epsilon_series(rounds),
                                                    fed.run_dir.file("epsilon.png"),
                                                    cfg.target_epsilon))
    summary = {
        "guarantee": fed.guarantee.to_dict(),
        "strategy": cfg.strategy, "trainer": cfg.trainer, "dataset": cfg.dataset,
        "num-clients": fed.num_nodes, "rounds": cfg.num_rounds,
        "rounds-run": rounds[-1]["round"] if rounds else 0,
        "initial": initial_metrics(fed),
        "final": final,
        "epsilon-budget": cfg.target_epsilon if cfg.is_private else None,
        "clients": _client_summaries(ledger, cfg),
        "late-replies-after-last-round": len(late_at_end),
        "ledger-mismatches": len(ledger.mismatches),
        "over-budget": ledger.over_budget(),
        "mismatches": ledger.mismatches,
        "charges-not-matching-plan": sum(1 for c in ledger.charges
                                         if c.get("source", "client") == "client"
                                         and c["note"] != "reported = plan"),
        "server-releases": len(ledger.server_charges()),
        "population-releases": sum(1 for c in ledger.charges
                                   if c.get("source") == "population"),
        "trust": cfg.trust,
        "resumes": fed.run_dir.resumes(),
        "wall-seconds": round(time.time() - fed.t_start, 2),
        "run-dir": str(fed.run_dir.path),
    }
    # indented for a person up to LEDGER_INDENT_CLIENTS clients, like ledger.json
    fed.run_dir.write_json("summary.json", summary,
                           indent=1 if fed.num_nodes <= LEDGER_INDENT_CLIENTS else None)
    for job in fed.plot_jobs:   # every figure is on disk before the run says it ended
        job.result()
    if launcher_prints_summary():   # dpfl simulate prints the table when the run ends
        log.info("privacy summary: %s (verdict %s)", fed.run_dir.file("summary.json"),
                 summary["guarantee"]["verdict"])
    else:
        for row in epsilon_table(summary).splitlines():
            log.info("%s", row)
    return summary


def _client_summaries(ledger: Ledger, cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """summary.json's ``clients``: each client's epsilon, rounds, relation and sampling.
    Clients charged by population releases alone share one entry
    (:meth:`Ledger.shared_entries`: ~0.3 s after the last round at 10,000 clients)."""
    figures = ledger.epsilons()
    return ledger.shared_entries(figures, lambda c: {
        "epsilon": figures[c], "recomputed-epsilon": ledger.recomputed(c),
        "rounds": ledger.rounds(c), "reported-epsilon": ledger.reported.get(c),
        **_accounted_as(ledger, c), **_adaptive_claim(ledger, c, cfg)})


def _accounted_as(ledger: Ledger, client: str) -> dict[str, str]:
    """The relation and sampling the client's charges were accounted under (from its
    events: the table must never say add-remove/Poisson of a replace-one history)."""
    relation, sampling = history_terms(ledger.history(client).events)
    return {"relation": relation, "sampling": sampling}


def _adaptive_claim(ledger: Ledger, client: str, cfg: RunConfig) -> dict[str, Any]:
    """For a history composed adaptively (parameters chosen from earlier outputs), the
    guarantee is the Rényi filter's budget, not the plain composition of the rounds run
    (which the ``epsilon`` field still shows, as an informative figure)."""
    if not (cfg.is_private and ledger.history(client).adaptive):
        return {}
    return {"adaptive": True, "guaranteed-epsilon": cfg.target_epsilon,
            "epsilon-is": "informative: the plain composition of the rounds run; the "
                          "guarantee of an adaptive history is the filter's budget"}


def run(grid: Grid, cfg: RunConfig) -> dict[str, Any]:
    """The whole federation: returns the summary written to ``summary.json``."""
    fed = setup(grid, cfg)
    try:
        return _run_rounds(fed)
    finally:
        fed.run_dir.close()


STOPPED_FILE = "stopped.json"


def _record_stop(fed: Federation, reason: str) -> None:
    """Say in the run folder that the run stopped before its last round, and why. Nothing
    else is written: the ledger on disk already holds every charge (it is saved before
    anything else of a round), and this process's copy is never written over it here."""
    done = fed.rounds[-1]["round"] if fed.rounds else 0
    fed.run_dir.write_json(STOPPED_FILE, {"stopped-after-round": done,
                                          "num-rounds": fed.cfg.num_rounds,
                                          "reason": reason, "time": time.time()})
    log.error("the run stopped after round %d of %d: %s (%s)", done, fed.cfg.num_rounds,
              reason, fed.run_dir.file(STOPPED_FILE))


class RunStopped(Exception):
    """Raised to Flower when a run ended early without a launcher's status file (a
    deployment's ``flwr run``): Flower then records the run as failed
    (``finished:failed``), which the deployment launchers check."""


def _run_rounds(fed: Federation) -> dict[str, Any]:
    cfg, grid = fed.cfg, fed.grid
    if not resume(fed):
        start_fresh(fed)
    await_warm_nodes(fed)
    if fed.label_counts is not None:   # the partition's figure, while the rounds run
        fed.plot_jobs.append(_BACKGROUND.submit(
            plot_label_counts, fed.label_counts, fed.run_dir.file("labels.png"),
            f"{cfg.dataset}, {cfg.partitioning}, {fed.num_nodes} clients"))
    try:
        for rnd in range(fed.start, cfg.num_rounds + 1):
            if central_budget_spent(fed, rnd):
                log.info("the next central round would take every client past target-epsilon"
                         " %g: stopping before round %d", cfg.target_epsilon, rnd)
                break
            record = run_round(fed, rnd)
            if budgets_exhausted(record, len(grid.get_node_ids())):
                log.info("every client refused at its privacy budget: stopping after round "
                         "%d", rnd)
                break
    except UserError as exc:   # e.g. too few nodes stayed connected: the run stops early
        _record_stop(fed, str(exc))
        raise
    return finish(fed)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for ``flwr run``: parse the run-config once, then run. A user error
    (bad setting, missing or damaged file, a run directory that must not be reused) ends
    the run with one ERROR line, not a traceback; the launcher's status file says how the
    run ended (:mod:`dpfl.apps.status`)."""
    try:
        summary = run(grid, parse_run_config(context.run_config))
    except UserError as exc:
        log.error("error: %s", exc)
        _end_of_log()
        write_status("error", **{"user-error": True, "message": str(exc)})
        if status_path() is None:   # no launcher reads a status: tell Flower it failed
            raise RunStopped(str(exc)) from None
        return
    except BaseException as exc:
        write_status("error", **{"user-error": False, "message": f"{type(exc).__name__}: {exc}"})
        raise
    _end_of_log()
    write_status("ok", **{"run-dir": summary["run-dir"]})


def _end_of_log() -> None:
    """The end-of-log line (:data:`dpfl.apps.status.END_OF_LOG`) for a launcher that reads
    this ServerApp's status; nothing else is logged before the status is written."""
    path = status_path()
    if path is not None:
        log.info("%s", end_of_log_line(path))
