"""The thin Flower layer shared by dpfl strategies.

:class:`DPFLStrategy` subclasses Flower's message-based ``FedAvg`` and replaces its train
path: seeded client sampling, one ``ConfigRecord`` per client (hook :meth:`client_config`),
validation of every reply (bad ones dropped with a logged reason), the method's
aggregation on an M x d update matrix (:meth:`aggregate_updates`) and a server step
(:meth:`server_step`). What happened in the round is kept in :attr:`last_round` for the
run writer.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from dpfl.config import RunConfig
from dpfl.privacy.budget import PrivacyHistory
from dpfl.privacy.charging import Charge, charge_for
from dpfl.privacy.events import PrivacyEvent
from dpfl.privacy.plan import plan_to_record, planned_event
from dpfl.strategies.aggregation import server_sgd_step, weighted_mean
from dpfl.strategies.validation import (
    ClientUpdate,
    Rejection,
    Template,
    array_template,
    validate_train_reply,
)
from dpfl.tensors import flatten, unflatten

log = logging.getLogger("flwr.dpfl.strategy")


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
            out[f"client-{u.partition_id}"] = {**u.metrics, "status": "accepted"}
        for r in self.rejected:
            name = f"client-{r.partition_id}" if r.partition_id is not None else f"node-{r.node_id}"
            out[name] = {**r.metrics, "status": r.kind, "reason": r.reason}
        return out

    def charge_lines(self) -> list[dict[str, Any]]:
        """The round's charges (this round's replies and late ones) for ``rounds.jsonl``."""
        return [{"client": c.client, "round": c.round, "note": c.note,
                 "late": c in self.late, "events": [e.to_dict() for e in c.events]}
                for c in self.charges + self.late]


class DPFLStrategy(FedAvg):
    """Base of every dpfl strategy (weighted FedAvg of updates + server SGD step)."""

    name = "base"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(
            fraction_train=cfg.fraction_train,
            fraction_evaluate=cfg.fraction_evaluate,
            min_train_nodes=cfg.min_train_nodes,
            min_evaluate_nodes=1,
            min_available_nodes=cfg.min_train_nodes,
        )
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.last_round: RoundRecord | None = None
        self._global: ArrayRecord | None = None
        self._template: Template = []
        # extra keys for the next round's ConfigRecords only (e.g. the ledger after resume)
        self.next_round_config: dict[str, Any] = {}
        self.num_nodes = 0
        self.ledger = None                      # the server's privacy ledger (bind_ledger)
        self.node_client: dict[int, str] = {}   # node id -> client-<partition-id>
        self.node_partition: dict[int, int] = {}  # node id -> partition id, pinned on 1st reply
        self.partition_sizes: dict[int, int] = {}  # partition id -> training-set size

    def bind_partition_sizes(self, sizes: Mapping[int, int]) -> None:
        """Training-set sizes per partition id (public: derived from the run-config), so
        the server can compute each client's planned privacy release."""
        self.partition_sizes = dict(sizes)

    def planned_event(self, partition_id: int, server_round: int) -> PrivacyEvent:
        """The release the server asks of ``partition_id`` in ``server_round``."""
        return planned_event(self.cfg, self.partition_sizes[partition_id], server_round)

    def planned_clip(self) -> float:
        return self.cfg.max_grad_norm if self.cfg.trainer == "dpsgd" else self.cfg.clip_norm

    def bind_ledger(self, ledger) -> None:
        """Give the strategy read access to the server's privacy ledger (for selection)."""
        self.ledger = ledger

    def bind_model(self, model: torch.nn.Module) -> None:
        """Learn what a method needs of the model (e.g. SCAFFOLD's per-parameter state)."""

    def extra_records(self, server_round: int) -> dict[str, ArrayRecord]:
        """Records besides the global arrays sent to every client (e.g. SCAFFOLD's c)."""
        return {}

    def extra_reply_arrays(self) -> dict[str, Template]:
        """Array records every reply must carry besides the update, with their template."""
        return {}

    def after_aggregation(self, accepted: list[ClientUpdate]) -> None:
        """Update method state from the accepted replies (e.g. SCAFFOLD's c)."""

    # -- selection and configuration -------------------------------------------------
    def wait_for_nodes(self, grid: Grid, minimum: int, timeout: float = 600.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while len(nodes := sorted(grid.get_node_ids())) < minimum:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(nodes)} of {minimum} nodes connected")
            log.info("waiting for nodes: %d connected, %d required", len(nodes), minimum)
            time.sleep(1.0)
        return nodes

    def select_nodes(self, server_round: int, grid: Grid) -> list[int]:
        """Seeded uniform sample of ``fraction-train`` of the connected nodes."""
        nodes = self.wait_for_nodes(grid, self.min_available_nodes)
        k = max(int(len(nodes) * self.fraction_train), min(self.min_train_nodes, len(nodes)))
        return sorted(self.rng.sample(nodes, k))

    def client_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        """Per-client additions to the round's ConfigRecord (override in methods)."""
        return {}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._global = arrays
        self._template = array_template(arrays)
        self.num_nodes = len(list(grid.get_node_ids()))
        node_ids = self.select_nodes(server_round, grid)
        self.last_round = RoundRecord(server_round, sampled=list(node_ids))
        log.info("round %d: training on %d nodes", server_round, len(node_ids))
        messages = []
        once, self.next_round_config = self.next_round_config, {}
        extra = self.extra_records(server_round)  # built once, shared by every message
        for node_id in node_ids:
            plan = {}
            pid = self.node_partition.get(node_id)
            if self.cfg.is_private and pid in self.partition_sizes:
                plan = plan_to_record(self.planned_event(pid, server_round))
            cfg = ConfigRecord({**dict(config), **once, "server-round": server_round, **plan,
                                **self.client_config(server_round, node_id)})
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg,
                                 **extra})
            messages.append(Message(content=record, message_type=MessageType.TRAIN,
                                    dst_node_id=node_id))
        return messages

    # -- aggregation ---------------------------------------------------------------
    def update_norm_bound(self, dim: int) -> float | None:
        """The L2 bound the mechanism promises for a client's update (None = no bound)."""
        return self.cfg.max_update_norm if self.cfg.max_update_norm > 0 else None

    def aggregation_weights(self, accepted: list[ClientUpdate]) -> torch.Tensor:
        """FedAvg weights: the clients' sample counts."""
        return torch.tensor([float(u.num_examples) for u in accepted])

    def aggregate_updates(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The method's aggregation of an M x d update matrix (here: weighted mean)."""
        return weighted_mean(updates, weights)

    def server_step(self, global_flat: torch.Tensor, aggregated: torch.Tensor) -> torch.Tensor:
        """The server optimizer (here: SGD with ``server-lr``)."""
        return server_sgd_step(global_flat, aggregated, self.cfg.server_lr)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self._global is None or self.last_round is None:
            raise RuntimeError("aggregate_train called before configure_train")
        record = self.last_round
        dim = sum(int(torch.Size(s).numel()) for _, s, _ in self._template)
        bound = self.update_norm_bound(dim)
        extra = self.extra_reply_arrays()
        for msg in replies:
            checked = validate_train_reply(msg, self._template, bound, extra)
            charge = self.charge_reply(msg, checked, server_round)
            if charge is not None:
                record.charges.append(charge)
                if charge.problem is not None and isinstance(checked, ClientUpdate):
                    checked = Rejection(checked.node_id, checked.partition_id, "invalid",
                                        charge.problem, checked.metrics)
            if checked.partition_id is not None and checked.partition_id >= 0:
                self.node_client[checked.node_id] = f"client-{checked.partition_id}"
            if isinstance(checked, Rejection):
                record.rejected.append(checked)
                level = logging.INFO if checked.kind == "refused" else logging.WARNING
                log.log(level, "round %d: %s from node %d (partition %s) dropped: %s",
                        server_round, checked.kind, checked.node_id, checked.partition_id,
                        checked.reason)
            else:
                record.accepted.append(checked)
        if not record.accepted:
            log.warning("round %d: no valid update; the global model is unchanged", server_round)
            return None, None
        record.accepted.sort(key=lambda u: u.partition_id)
        updates = torch.stack([u.flat for u in record.accepted])
        aggregated = self.aggregate_updates(updates, self.aggregation_weights(record.accepted))
        state = self._global.to_torch_state_dict()
        new_flat = self.server_step(flatten(state), aggregated)
        new_arrays = ArrayRecord(unflatten(new_flat, state))
        self.after_aggregation(record.accepted)
        return new_arrays, MetricRecord(self.round_metrics(record))

    # -- privacy charging ------------------------------------------------------------
    def charge_reply(self, msg: Message, checked: ClientUpdate | Rejection,
                     sent_round: int, late: bool = False) -> Charge | None:
        """Charge the ledger for a reply that carries an update (accepted or not, on time
        or late); None when nothing was released (error, refusal without arrays) or the
        run is not private. A node's partition id is pinned on its first update: a reply
        claiming another one is charged to the pinned client and rejected."""
        if (not self.cfg.is_private or self.ledger is None or msg.has_error()
                or "arrays" not in msg.content.array_records):
            return None
        node = checked.node_id
        claimed = checked.partition_id if checked.partition_id is not None else -1
        pinned = self.node_partition.get(node)
        pid = pinned if pinned is not None else claimed
        identity_problem = None
        if pinned is not None and claimed != pinned:
            identity_problem = f"partition-id {claimed} differs from this node's {pinned}"
        if pid in self.partition_sizes:
            client, plan = f"client-{pid}", self.planned_event(pid, sent_round)
            self.node_partition.setdefault(node, pid)
        else:  # unknown sender: charge the node at the costliest plan of any partition
            client = f"node-{node}"
            plan = self._costliest_plan(client, sent_round)
            identity_problem = identity_problem or f"unknown partition-id {claimed}"
        content = msg.content
        privacy = dict(content["privacy"]) if "privacy" in content.config_records else None
        metrics = dict(content["metrics"]) if "metrics" in content.metric_records else {}
        reported = metrics.get("epsilon")
        reported = (float(reported) if isinstance(reported, (int, float))
                    and not isinstance(reported, bool) else None)
        history = self.ledger.clients.get(client, PrivacyHistory())
        charge = charge_for(client, sent_round, privacy, plan, self.planned_clip(), history,
                            self.ledger.delta, self.ledger.accountant, reported)
        if identity_problem is not None:
            charge.problem = identity_problem if charge.problem is None else (
                f"{identity_problem}; {charge.problem}")
            charge.note = f"{charge.note} ({identity_problem})"
        if late:
            charge.note = f"late reply to round {sent_round}: {charge.note}"
        adaptive = charge.adaptive or self.cfg.strategy == "aadp"
        self.ledger.record(client, sent_round, charge.events, charge.reported_epsilon,
                           charge.note, adaptive=adaptive)
        if charge.problem is not None:
            log.warning("round %d: %s charged %s: %s", sent_round, client,
                        [e.to_dict() for e in charge.events], charge.note)
        return charge

    def charge_late_reply(self, msg: Message, sent_round: int) -> Charge | None:
        """A reply to an earlier round's instruction: charged now, never aggregated."""
        extra = self.extra_reply_arrays()
        checked = validate_train_reply(msg, self._template, None, extra)
        return self.charge_reply(msg, checked, sent_round, late=True)

    def _costliest_plan(self, client: str, server_round: int) -> PrivacyEvent:
        history = self.ledger.clients.get(client, PrivacyHistory())
        plans = [self.planned_event(p, server_round) for p in sorted(self.partition_sizes)]
        if not plans:
            raise RuntimeError("no partition sizes bound: the server cannot plan charges")
        return max(plans, key=lambda e: PrivacyHistory(history.events + [e]).epsilon(
            self.ledger.delta, self.ledger.accountant))

    def round_metrics(self, record: RoundRecord) -> dict[str, float]:
        """Weighted train loss and counts of the round."""
        out: dict[str, float] = {"accepted": len(record.accepted),
                                 "rejected": len(record.rejected)}
        losses = [(u.metrics["train-loss"], u.num_examples) for u in record.accepted
                  if "train-loss" in u.metrics]
        if losses:
            out["train-loss"] = sum(l * n for l, n in losses) / sum(n for _, n in losses)
        return out

    # -- persistence across restarts -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Strategy state to checkpoint (the sampling RNG; methods add theirs)."""
        return {"rng": self.rng.getstate(), "node-partition": dict(self.node_partition)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "rng" in state:
            self.rng.setstate(state["rng"])
        self.node_partition.update({int(k): int(v) for k, v in
                                    state.get("node-partition", {}).items()})
