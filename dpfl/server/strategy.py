"""The thin Flower layer shared by dpfl strategies.

:class:`DPFLStrategy` subclasses Flower's message-based ``FedAvg`` and replaces its train
path: seeded client sampling, one ``ConfigRecord`` per client (the method's :meth:`round_config`
and the guard's plan), validation of every reply (bad ones dropped with a logged reason),
the method's aggregation on an M x d update matrix (:meth:`aggregate_updates`) and a server
step (:meth:`server_step`). Privacy — plans, norm bounds, weights, ledger charges — comes
from one :class:`~dpfl.server.guard.DPGuard`, whatever the method.

The run loop talks to it through :meth:`start_round` (messages and the round's record) and
:meth:`finish_round` (the new model, metrics and the completed record); Flower's
``configure_train`` / ``aggregate_train`` are kept as thin adapters over the two.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from dpfl.config import RunConfig
from dpfl.errors import UserError
from dpfl.logs import get_logger
from dpfl.numbers import is_finite_number
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import Ledger, client_key
from dpfl.privacy.charging import Charge
from dpfl.privacy.plan import (
    EQUAL_WEIGHTS_CLAIM,
    PlanFn,
    PlanInputs,
    ReleasePlan,
    shared_plan,
)
from dpfl.privacy.trust import (
    UNCLIPPED_KEY,
    distributed_noise_multiplier,
    noise_shares,
    own_noise,
)
from dpfl.server.aggregation import server_sgd_step, weighted_mean
from dpfl.server.central import FlowerCentralAggregator
from dpfl.server.correlated import CorrelatedAggregator
from dpfl.server.guard import DPGuard
from dpfl.server.nodes import NodeRegistry
from dpfl.server.reply import parse_reply
from dpfl.server.secagg import SecureSum, masked_reply
from dpfl.server.trust import Aggregator
from dpfl.server.validation import (
    MAX_REPORTED_LOSS,
    PUBLIC_REPLY_METRICS,
    TRAIN_LOSS_METRIC,
    ArrivalDecoder,
    ClientUpdate,
    Rejection,
    Template,
    array_template,
    validate_train_reply,
)
from dpfl.tensors import flatten, unflatten

log = get_logger("flwr.dpfl.strategy")


class NodesMissing(UserError):
    """Fewer nodes than the run needs stayed connected for ``node-wait`` seconds."""


def wait_for_nodes(grid: Grid, minimum: int, timeout: float) -> list[int]:
    """The connected nodes once at least ``minimum`` are; :class:`NodesMissing` (a run that
    cannot go on: the run stops, saying so) after ``timeout`` (``node-wait``) seconds."""
    deadline = time.monotonic() + timeout
    while len(nodes := sorted(grid.get_node_ids())) < minimum:
        if time.monotonic() > deadline:
            raise NodesMissing(f"waited {timeout:g} s (node-wait) for {minimum} connected "
                               f"nodes (min-train-nodes), {len(nodes)} connected")
        log.info("waiting for nodes: %d connected, %d required", len(nodes), minimum)
        time.sleep(1.0)
    return nodes


@dataclass(frozen=True)
class RoundContext:
    """The round a strategy's hooks work in (:attr:`DPFLStrategy.round`): its number and the
    method's shared config sent in it. Set when the round's instructions are made, so that
    no method keeps its own copy of the round number."""

    server_round: int
    config: Mapping[str, Any]


@dataclass(frozen=True)
class StrategyInputs:
    """What a strategy is built with, besides its config: the public training-set size of
    every partition (the plans of each client's release, a method's allocation), the
    global model (its sizes, a method's per-parameter state) and the server's privacy
    ledger. Each may be absent where a strategy is built only to plan (the launcher's
    check that one round is affordable) or in a unit test."""

    partition_sizes: Mapping[int, int] = field(default_factory=dict)
    model: torch.nn.Module | None = None
    ledger: Ledger | None = None


@dataclass
class RoundRecord:
    """What one training round saw: sampled nodes, accepted updates, rejections."""

    server_round: int
    sampled: list[int] = field(default_factory=list)
    accepted: list[ClientUpdate] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    charges: list[Charge] = field(default_factory=list)   # every received update's charge
    late: list[Charge] = field(default_factory=list)      # replies of earlier rounds

    def client_metrics(self) -> dict[str, dict[str, Any]]:
        """Reported metrics keyed by client name (``client-<partition-id>``)."""
        out: dict[str, dict[str, Any]] = {}
        for u in self.accepted:
            out[client_key(u.partition_id)] = {**u.metrics, "status": "accepted"}
        for r in self.rejected:
            name = client_key(r.partition_id) if r.partition_id is not None else f"node-{r.node_id}"
            out[name] = {**r.metrics, "status": r.kind, "reason": r.reason}
        return out

    def charge_lines(self) -> list[dict[str, Any]]:
        """The round's charges (this round's replies and late ones) for ``rounds.jsonl``."""
        return [{"client": c.client, "round": c.round, "note": c.note,
                 "late": c in self.late, "events": [e.to_dict() for e in c.events]}
                for c in self.charges + self.late]


@dataclass
class RoundOutcome:
    """What :meth:`DPFLStrategy.finish_round` returns: the new global arrays (None when no
    update was accepted), the round's train metrics and its completed record."""

    arrays: ArrayRecord | None
    metrics: MetricRecord | None
    record: RoundRecord


class DPFLStrategy(FedAvg):
    """Base of every dpfl strategy (weighted FedAvg of updates + server SGD step)."""

    def __init__(self, cfg: RunConfig, adaptive: bool = False,
                 plan: PlanFn = shared_plan, inputs: StrategyInputs | None = None) -> None:
        # Flower's FedAvg logs "fraction_evaluate is set to 0.0. Federated evaluation will be
        # skipped." whenever it is built with 0.0 (flwr/serverapp/strategy/fedavg.py): in
        # dpfl that is the default, not news (the model is evaluated centrally, and federated
        # evaluation is outside the DP guarantee). So it is built with 1.0 and given the real
        # value after, with what Flower's constructor would have set for it.
        super().__init__(
            fraction_train=cfg.fraction_train,
            fraction_evaluate=cfg.fraction_evaluate or 1.0,
            min_train_nodes=cfg.min_train_nodes,
            min_evaluate_nodes=1,
            min_available_nodes=cfg.min_train_nodes,
        )
        self.fraction_evaluate = cfg.fraction_evaluate
        if cfg.fraction_evaluate == 0.0:
            self.min_evaluate_nodes = 0   # as FedAvg.__init__ sets it for 0.0
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        inputs = inputs if inputs is not None else StrategyInputs()
        # who each node is, with the public partition sizes (shared with the guard)
        self.nodes = NodeRegistry(cfg.node_partitions, inputs.partition_sizes)
        self.plan_fn = plan                   # the method's (dpfl.method.Method.plan)
        model = inputs.model
        # trainable parameters (the plans' num_params); a flat update holds every tensor
        # of the state (the guard's d)
        self.num_params = (sum(int(p.numel()) for p in model.parameters())
                           if model is not None else 0)
        dim = (sum(int(v.numel()) for v in model.state_dict().values())
               if model is not None else 0)
        self.guard = DPGuard(cfg, self.release_plan, adaptive, self.update_norm_bound,
                             nodes=self.nodes, ledger=inputs.ledger, dim=dim)
        # the shared config of every round sent (the plans of its replies read it) and the
        # round the hooks work in
        self.sent_configs: dict[int, dict[str, Any]] = {}
        self.round = RoundContext(0, {})
        self._global: ArrayRecord | None = None
        self._template: Template = []
        # this round's updates decoded as their replies arrived (reply_arrived)
        self.arrivals = ArrivalDecoder()
        self._pending: RoundRecord | None = None   # for the Flower adapters only
        self.num_nodes = 0
        # the trust model's server half, and a trusted server's aggregator (trust=central,
        # built with the partition sizes)
        self.trust = self.guard.trust
        self.central: Aggregator | None = (
            self.trust.aggregator(cfg, len(inputs.partition_sizes))
            if inputs.partition_sizes else None)

    @property
    def partition_sizes(self) -> dict[int, int]:
        """Training-set sizes per partition id (public: derived from the run-config)."""
        return self.nodes.sizes

    @property
    def ledger(self) -> Ledger | None:
        """The server's privacy ledger (the guard charges it; selection reads it)."""
        return self.guard.ledger

    # -- the release plan -------------------------------------------------------------
    def send_config(self, server_round: int) -> dict[str, Any]:
        """The method's shared config of ``server_round`` (:meth:`round_config`), recorded as
        sent: the plans of that round's replies read it."""
        config = self.round_config(server_round)
        self.sent_configs[server_round] = config
        return config

    def plan_config(self, server_round: int) -> Mapping[str, Any]:
        """The shared config of ``server_round`` as sent (before it is sent: as it would
        be now)."""
        sent = self.sent_configs.get(server_round)
        return sent if sent is not None else self.round_config(server_round)

    def release_plan(self, partition_id: int | None, server_round: int) -> ReleasePlan:
        """The method's plan of ``partition_id``'s release in ``server_round``, from the
        public values its client plans from (:class:`~dpfl.privacy.plan.PlanInputs`)."""
        inputs = PlanInputs(server_round, self.plan_config(server_round), partition_id,
                            self.partition_sizes.get(partition_id)
                            if partition_id is not None else None, self.num_params)
        return self.plan_fn(self.cfg, inputs)

    # -- method hooks --------------------------------------------------------------------
    def update_norm_bound(self, dim: int, server_round: int) -> float | None:
        """The method's own bound on an honest reply's update L2 norm (d = ``dim``
        parameters) when its noise is not the guard's Gaussian; None: the guard's."""
        return None

    def round_config(self, server_round: int) -> dict[str, Any]:
        """Keys every client's ConfigRecord carries this round, from the method's state
        (override in methods; :meth:`send_config` records what was sent, and the release
        plans of the round read it)."""
        return {}

    @property
    def sent_arrays(self) -> ArrayRecord | None:
        """The model the current round's clients received (the global model, or what a
        method sends instead, e.g. FedACG's lookahead); None before the first round."""
        return self._global

    def released_metrics(self) -> frozenset[str]:
        """Reply metrics the method's client half releases beyond the shared public ones
        (each covered by a charged release, or named by the method's verdict as sent in the
        clear); default none."""
        return frozenset()

    def reply_metric_keys(self) -> frozenset[str]:
        """Every metric a private train reply may carry; another key is a value sent in
        the clear without a charge, and the reply is rejected."""
        keys = PUBLIC_REPLY_METRICS | self.released_metrics()
        if self.cfg.report_train_loss:
            keys |= {TRAIN_LOSS_METRIC}
        return keys | self.trust.reply_keys

    def extra_records(self, server_round: int) -> dict[str, ArrayRecord]:
        """Records besides the global arrays sent to every client (e.g. SCAFFOLD's c)."""
        return {}

    def extra_reply_arrays(self) -> dict[str, Template]:
        """Array records every reply must carry besides the update, with their template."""
        return {}

    def after_aggregation(self, accepted: list[ClientUpdate]) -> None:
        """Update method state from the accepted replies (e.g. SCAFFOLD's c)."""

    def known_partition(self, partition_id: int | None) -> bool:
        """A partition id this run has (any id >= 0 before the sizes are bound)."""
        return self.nodes.known_partition(partition_id)

    def client_name(self, node_id: int, claimed: int | None = None) -> str:
        """The name messages give a node (:meth:`NodeRegistry.name`)."""
        return self.nodes.name(node_id, claimed)

    # -- selection and configuration -------------------------------------------------
    def available_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes, once ``min-train-nodes`` are (:func:`wait_for_nodes`)."""
        return wait_for_nodes(grid, self.min_available_nodes, self.cfg.node_wait)

    def select_nodes(self, server_round: int, grid: Grid) -> list[int]:
        """Seeded uniform sample of ``fraction-train`` of the connected nodes."""
        nodes = self.available_nodes(grid)
        if isinstance(self.central, CorrelatedAggregator):   # a cohort the schema allows
            return self.central.select(server_round, nodes, self.nodes)
        if self.central is not None:  # Poisson sampling: amplification is accounted
            return self.central.sample(nodes)
        k = max(int(len(nodes) * self.fraction_train), min(self.min_train_nodes, len(nodes)))
        return sorted(self.rng.sample(nodes, k))

    def start_round(self, server_round: int, arrays: ArrayRecord, grid: Grid,
                    extra_config: Mapping[str, Any] | None = None
                    ) -> tuple[list[Message], RoundRecord]:
        """The round's train instructions and its (open) record. ``extra_config`` goes
        into every ConfigRecord of this round only (e.g. the ledger after a resume)."""
        self._global = arrays
        self._template = array_template(arrays)
        self.arrivals.clear()
        connected = list(grid.get_node_ids())
        self.num_nodes = len(connected)
        self.nodes.connected = set(connected)
        node_ids = self.select_nodes(server_round, grid)
        record = RoundRecord(server_round, sampled=list(node_ids))
        log.info("round %d: training on %d nodes", server_round, len(node_ids))
        method_config = self.send_config(server_round)
        self.round = RoundContext(server_round, method_config)
        shared = {**(extra_config or {}), **method_config,
                  **self.trust_round_config(len(node_ids)), "server-round": server_round}
        extra = self.extra_records(server_round)  # built once, shared by every message
        messages = []
        for node_id in node_ids:
            cfg = ConfigRecord({**shared, **self.guard.plan_record(node_id, server_round)})
            content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg,
                                  **extra})
            messages.append(Message(content=content, message_type=MessageType.TRAIN,
                                    dst_node_id=node_id))
        return messages, record

    def trust_round_config(self, sampled: int) -> dict[str, Any]:
        """Public per-round keys of the trust model: the central C, SecAgg+'s n_min."""
        if self.central is not None:
            return self.central.round_config()
        return self.trust.round_config(self.cfg, sampled)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Flower's API over :meth:`start_round` (``config`` joins every ConfigRecord)."""
        messages, self._pending = self.start_round(server_round, arrays, grid, dict(config))
        return messages

    # -- aggregation ---------------------------------------------------------------
    def aggregation_weights(self, accepted: list[ClientUpdate]) -> torch.Tensor:
        """FedAvg weights: the clients' sample counts (the guard equalises them under
        client-level DP, where sizes are private). A method's own weights must use only
        public or released values."""
        return self.guard.weights(torch.tensor([float(u.num_examples) for u in accepted]))

    def reply_problem(self, update: ClientUpdate) -> str | None:
        """Why a validated reply is unusable by the method (e.g. a value it needs is
        missing or out of range); None when fine. The reply is then rejected (and, like
        every received update, charged)."""
        return None

    def aggregate_updates(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The method's aggregation of an M x d update matrix (here: weighted mean)."""
        return weighted_mean(updates, weights)

    def server_step(self, global_flat: torch.Tensor, aggregated: torch.Tensor) -> torch.Tensor:
        """The server optimizer (here: SGD with ``server-lr``)."""
        return server_sgd_step(global_flat, aggregated, self.cfg.server_lr)

    def finish_round(self, server_round: int, record: RoundRecord,
                     replies: Iterable[Message]) -> RoundOutcome:
        """Validate and charge every reply, aggregate the accepted ones, step the model."""
        if self._global is None:
            raise RuntimeError("finish_round called before start_round")
        dim = sum(int(torch.Size(s).numel()) for _, s, _ in self._template)
        # central: a clipped update (float32 rounding aside); the server clips again
        if isinstance(self.central, FlowerCentralAggregator):
            bound = self.cfg.max_update_norm or None   # raw updates: Flower clips them
        elif self.central is not None:
            bound = self.central.clip * (1 + 1e-4)
        else:
            bound = self.guard.norm_bound(dim, server_round)
        extra = self.extra_reply_arrays()
        for msg in replies:
            reply = parse_reply(msg)   # read once: validation and the charge share it
            checked = validate_train_reply(reply, self._template, bound, extra, server_round,
                                           self.arrivals)
            charge = self.guard.charge_reply(reply, checked, server_round)
            if charge is not None:
                record.charges.append(charge)
                held = self.nodes.pinned(checked.node_id)
                if held is not None:   # the partition charged, not the one claimed
                    checked.partition_id = held
                if charge.problem is not None and isinstance(checked, ClientUpdate):
                    checked = Rejection(checked.node_id, checked.partition_id, "invalid",
                                        charge.problem, checked.metrics)
            if isinstance(checked, ClientUpdate) and self.cfg.is_private and (
                    clear := sorted(set(checked.metrics) - self.reply_metric_keys())):
                checked = Rejection(checked.node_id, checked.partition_id, "invalid",
                                    f"reply carries {clear}, which the method does not "
                                    "release: values in the clear without a charge",
                                    checked.metrics)
            if isinstance(checked, ClientUpdate):
                checked = self._trusted(checked, server_round)
            if isinstance(checked, ClientUpdate) and (why := self._shared_value_problem(
                    checked)):
                checked = Rejection(checked.node_id, checked.partition_id, "invalid", why,
                                    checked.metrics)
            if isinstance(checked, ClientUpdate) and (why := self.reply_problem(checked)):
                checked = Rejection(checked.node_id, checked.partition_id, "invalid", why,
                                    checked.metrics)
            self.nodes.note_reply(checked.node_id, checked.partition_id)
            if isinstance(checked, Rejection):
                record.rejected.append(checked)
                level = logging.INFO if checked.kind == "refused" else logging.WARNING
                log.log(level, "round %d: %s from %s dropped: %s", server_round, checked.kind,
                        self.client_name(checked.node_id, checked.partition_id),
                        checked.reason)
            else:
                record.accepted.append(checked)
        self.arrivals.clear()
        if self.central is not None:
            return self._central_outcome(server_round, record, dim)
        if not record.accepted:
            log.warning("round %d: no valid update; the global model is unchanged", server_round)
            return RoundOutcome(None, None, record)
        record.accepted.sort(key=lambda u: u.partition_id)
        updates = torch.stack([u.flat for u in record.accepted])
        weights = self.aggregation_weights(record.accepted)
        # every input was checked finite and every reported value bounded: a last net, so
        # that nothing a reply carries makes the global model (or a server optimizer's
        # state) non-finite
        if not (bool(torch.isfinite(weights).all()) and bool((weights >= 0).all())
                and float(weights.sum()) > 0):
            log.warning("round %d: aggregation weights %s are not finite and >= 0 with a "
                        "positive sum; the global model is unchanged", server_round,
                        weights.tolist()[:10])
            return RoundOutcome(None, None, record)
        aggregated = self.aggregate_updates(updates, weights)
        if not bool(torch.isfinite(aggregated).all()):
            log.warning("round %d: the aggregate of %d updates is not finite; the global "
                        "model is unchanged", server_round, len(record.accepted))
            return RoundOutcome(None, None, record)
        return self._stepped(aggregated, record)

    def _trusted(self, update: ClientUpdate, server_round: int) -> ClientUpdate | Rejection:
        """What the server does not take on a client's word: a replayed update is refused;
        the aggregation weight is the partition's public size, not the claimed count."""
        if self.cfg.is_private:
            why = self.guard.replayed(update.flat, client_key(update.partition_id),
                                      server_round)
            if why is not None:
                return Rejection(update.node_id, update.partition_id, "invalid", why,
                                 update.metrics)
        if self.partition_sizes and update.partition_id not in self.partition_sizes:
            # (a private run refuses it when charging; a plain one would weigh the claim)
            return Rejection(update.node_id, update.partition_id, "invalid",
                             f"partition-id {update.partition_id} is not one of the run's "
                             f"{len(self.partition_sizes)} partitions: its size (the "
                             "aggregation weight) is not public", update.metrics)
        public = self.guard.public_examples(update.partition_id, update.num_examples)
        # the claim an honest client makes: its public size, or under client-level DP the
        # protocol's equal-weights constant (its size is private there)
        honest = EQUAL_WEIGHTS_CLAIM if self.cfg.trainer == "update-dp" else public
        if update.num_examples != honest:
            log.info("round %d: client-%d claims %d examples where an honest client sends %d;"
                     " weighted by its public size %d", server_round, update.partition_id,
                     update.num_examples, honest, public)
        update.num_examples = public
        return update

    def _shared_value_problem(self, update: ClientUpdate) -> str | None:
        """Why a value every method's server reads from a reply is unusable (None: fine).
        trust=central: the client's within-C bit (``clip-unclipped``, the adaptive clip's
        count; missing = clipped) must be a number in [0, 1]. (``num-examples`` is checked
        by :func:`validate_train_reply` and replaced by the public size in
        :meth:`_trusted`; ``train-loss`` only enters the round's metrics, where
        :meth:`round_metrics` leaves out a value outside [0, MAX_REPORTED_LOSS]; a
        method's own values are its :meth:`reply_problem`.)"""
        if self.central is not None and UNCLIPPED_KEY in update.metrics:
            bit = update.metrics[UNCLIPPED_KEY]
            if not is_finite_number(bit) or not 0 <= bit <= 1:
                return f"metric '{UNCLIPPED_KEY}' must be a number in [0, 1], got {bit!r}"
        return None

    def _stepped(self, aggregated: torch.Tensor, record: RoundRecord) -> RoundOutcome:
        """The server step from the round's aggregate, and the round's outcome."""
        state = self._global.to_torch_state_dict()
        new_flat = self.server_step(flatten(state), aggregated)
        self.after_aggregation(record.accepted)
        return RoundOutcome(ArrayRecord(unflatten(new_flat, state)),
                            MetricRecord(self.round_metrics(record)), record)

    def _central_outcome(self, server_round: int, record: RoundRecord, dim: int
                         ) -> RoundOutcome:
        """trust=central: the noisy clipped mean over q N (noise alone when nobody was
        sampled or accepted), then every client is charged the round."""
        record.accepted.sort(key=lambda u: u.partition_id)
        if isinstance(self.central, CorrelatedAggregator):
            return self._correlated_outcome(server_round, record, dim)
        updates = (torch.stack([u.flat for u in record.accepted]) if record.accepted
                   else torch.zeros((0, dim)))
        within = [float(u.metrics.get(UNCLIPPED_KEY, 0.0)) for u in record.accepted]
        if isinstance(self.central, FlowerCentralAggregator):
            self.central.global_arrays = self._global
            aggregated = self.central.aggregate(updates, within, server_round)
        else:
            aggregated = self.central.aggregate(updates, within)
        self.guard.charge_population(server_round, self.central.events(server_round))
        return self._stepped(aggregated, record)

    def _correlated_outcome(self, server_round: int, record: RoundRecord, dim: int
                            ) -> RoundOutcome:
        """trust=central with correlated noise: an update of a client outside the schema
        is refused (never aggregated, never charged); the others enter the noisy sum over
        the fixed cohort size, and only they are charged their participation."""
        assert isinstance(self.central, CorrelatedAggregator)
        taken, refused = self.central.admit([u.partition_id for u in record.accepted],
                                            server_round)
        for i, why in sorted(refused.items()):
            u = record.accepted[i]
            record.rejected.append(Rejection(u.node_id, u.partition_id, "refused", why,
                                             u.metrics))
            log.warning("round %d: update from %s refused: %s", server_round,
                        self.client_name(u.node_id, u.partition_id), why)
        record.accepted = [record.accepted[i] for i in taken]
        updates = (torch.stack([u.flat for u in record.accepted]) if record.accepted
                   else torch.zeros((0, dim)))
        aggregated = self.central.release(server_round, updates)
        for events, pids in self.central.participation_charges(
                server_round, [u.partition_id for u in record.accepted]):
            self.guard.charge_server_release(
                server_round, events, pids,
                f"correlated central release ({self.cfg.central_noise}): a participation")
        return self._stepped(aggregated, record)

    def finish_secure_round(self, server_round: int, record: RoundRecord,
                            secure: SecureSum) -> RoundOutcome:
        """trust=distributed: charge every client whose masked vector arrived, then (if
        the round was not discarded) the mean = dequantised sum / survivors."""
        if self._global is None:
            raise RuntimeError("finish_secure_round called before start_round")
        for msg in secure.replies:
            reply = parse_reply(msg)
            charge = self.guard.charge_reply(reply, masked_reply(reply), server_round)
            if charge is not None:
                record.charges.append(charge)
        if secure.total is None:
            log.warning("round %d: SecAgg+ round discarded (%s); the global model is "
                        "unchanged", server_round, secure.reason)
            self._record_secure_replies(record, secure)
            return RoundOutcome(None, None, record)
        own = own_noise(self.cfg)
        if own is not None:   # the method's own dequantisation
            sampled = len(secure.survivors) + len(secure.dropped)
            sigma = distributed_noise_multiplier(self.cfg, self.guard.dim,
                                                 len(self.guard.partition_sizes))
            mean = own.secure_mean(self.cfg, secure.total, len(secure.survivors),
                                   noise_shares(self.cfg, sampled), self.guard.dim, sigma,
                                   server_round)
        else:
            mean = secure.total.double() / (self.cfg.secagg_scale * len(secure.survivors))
        self._record_secure_replies(record, secure)
        return self._stepped(mean.to(torch.float32), record)

    def _record_secure_replies(self, record: RoundRecord, secure: SecureSum) -> None:
        """The round's record of a SecAgg+ round: survivors accepted (under the partition
        their node is charged to), the vectors kept out of the sum refused with why."""
        for msg in secure.replies:
            node = int(msg.metadata.src_node_id)
            metrics = (dict(msg.content["metrics"]) if "metrics" in msg.content.metric_records
                       else {})
            pid = self.guard.sender_partition(msg)[0]
            if node in secure.refused:
                record.rejected.append(Rejection(node, pid, "refused", secure.refused[node],
                                                 metrics))
            elif node in secure.survivors and pid is not None and secure.total is not None:
                record.accepted.append(ClientUpdate(node, pid, torch.empty(0), 1, metrics))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's API over :meth:`finish_round` (after :meth:`configure_train`)."""
        if self._pending is None:
            raise RuntimeError("aggregate_train called before configure_train")
        outcome = self.finish_round(server_round, self._pending, replies)
        return outcome.arrays, outcome.metrics

    def reply_arrived(self, msg: Message) -> None:
        """A reply of the current round arrived while the round still waits: decode its
        update now (:class:`~dpfl.server.validation.ArrivalDecoder`)."""
        self.arrivals.arrived(msg, self._template)

    def charge_late_reply(self, msg: Message, sent_round: int) -> Charge | None:
        """A reply to an earlier round's instruction: charged now, never aggregated."""
        reply = parse_reply(msg)
        checked = validate_train_reply(reply, self._template, None, self.extra_reply_arrays(),
                                       sent_round)
        return self.guard.charge_reply(reply, checked, sent_round, late=True)

    def planned_event(self, partition_id: int, server_round: int) -> PrivacyEvent:
        """The release the server asks of ``partition_id`` in ``server_round``."""
        return self.guard.planned_event(partition_id, server_round)

    def round_metrics(self, record: RoundRecord) -> dict[str, float]:
        """Weighted train loss and counts of the round. The mean takes the clients'
        reported ``train-loss`` values that are numbers in [0, MAX_REPORTED_LOSS] (another
        is left out of it; the client's own record keeps what it sent)."""
        out: dict[str, float] = {"accepted": len(record.accepted),
                                 "rejected": len(record.rejected)}
        losses = [(loss, u.num_examples) for u in record.accepted
                  if is_finite_number(loss := u.metrics.get(TRAIN_LOSS_METRIC))
                  and 0 <= loss <= MAX_REPORTED_LOSS]
        if losses:
            out["train-loss"] = sum(l * n for l, n in losses) / sum(n for _, n in losses)
        return out

    # -- persistence across restarts -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Strategy state to checkpoint (the sampling RNG; methods add theirs)."""
        central = self.central.state_dict() if self.central is not None else {}
        return {"rng": self.rng.getstate(), **self.nodes.state_dict(), **central}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "rng" in state:
            self.rng.setstate(state["rng"])
        self.nodes.load_state_dict(state)
        if self.central is not None:
            self.central.load_state_dict(state)
