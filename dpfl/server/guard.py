"""DP as a guard around any strategy: plans, norm bounds, weights, charges.

One object owned by every dpfl strategy, as Flower's ``DifferentialPrivacy*`` wrappers
compose around an inner strategy: whatever a method aggregates, the guard

- computes each client's planned release from public values (``dpfl.privacy.plan``; a
  method may set the round's sigma, e.g. AADP-FL's per-round budget, or plan its own
  release, e.g. a pure-epsilon Laplace one) and sends it;
- bounds every update's L2 norm by what the mechanism promises (client-level update DP:
  C + sigma_max C (sqrt(d) + 10), exceeded by an honest update w.p. < exp(-50); a method
  with another noise gives its own bound);
- bounds every DP-SGD update by what its plan allows (:func:`dpsgd_norm_bound`);
- gives client-level DP updates equal aggregation weights (dataset sizes stay private) and
  sample-level ones the server's public partition sizes, never a client's claim;
- charges the ledger for every received update — accepted, rejected or late — at no less
  than the plan (``dpfl.privacy.charging``), to the partition the deployment binds the
  sending node to (``node-partitions``, the operator's map), or else to the partition the
  node first claimed, never held by two nodes;
- refuses a replayed update (bytes identical to one the same client sent before: honest
  DP updates carry fresh noise and never repeat).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable

import torch
from flwr.app import Message

from dpfl.config import RunConfig
from dpfl.logs import get_logger
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import (
    CLIENT_PREFIX,
    Ledger,
    client_key,
    ledger_config,
    server_events_config,
)
from dpfl.privacy.charging import Charge, charge_for
from dpfl.privacy.plan import (
    SHARED_PLAN,
    ReleasePlan,
    dpsgd_norm_bound,
    gaussian_norm_bound,
    noise_multiplier_for,
    plan_to_record,
)
from dpfl.server.nodes import NodeRegistry
from dpfl.server.reply import ParsedReply, claimed_partition
from dpfl.server.trust import server_trust
from dpfl.server.validation import ClientUpdate, Rejection, client_label

log = get_logger("flwr.dpfl.guard")
# The method's release plan of a partition (None: unknown) in a round
# (dpfl.privacy.plan.ReleasePlan, the same function the client plans with), and its own
# bound on an update's L2 norm for a model of d parameters in a round (None: the guard's).
PlanOf = Callable[[int | None, int], ReleasePlan]
NormBound = Callable[[int, int], float | None]


def _shared(partition_id: int | None, server_round: int) -> ReleasePlan:
    return SHARED_PLAN


def _gaussian_bound(dim: int, server_round: int) -> None:
    return None


class DPGuard:
    """The privacy side of a strategy (see module docstring)."""

    def __init__(self, cfg: RunConfig, plan: PlanOf = _shared, adaptive: bool = False,
                 method_bound: NormBound = _gaussian_bound,
                 nodes: NodeRegistry | None = None, ledger: Ledger | None = None,
                 dim: int = 0) -> None:
        self.cfg = cfg
        # who each node is (partition sizes, the operator's map, pins, the connected set):
        # the strategy's registry, shared
        self.nodes = nodes if nodes is not None else NodeRegistry(cfg.node_partitions)
        self.plan = plan
        self.trust = server_trust(cfg)
        self.method_bound = method_bound
        self.adaptive = adaptive
        self.ledger = ledger                        # the server's (None: not private)
        # every partition's ledger-* record, built once per ledger state (history_record)
        self._all_history: tuple[Any, int, dict[str, list]] | None = None
        self.dim = dim                              # size of a flat update (the model's state)
        self.seen_updates: dict[str, dict[bytes, int]] = {}   # client -> digest -> round

    # -- planning --------------------------------------------------------------------
    @property
    def partition_sizes(self) -> dict[int, int]:
        """Training-set sizes per partition id (public; the registry's)."""
        return self.nodes.sizes

    def planned_event(self, partition_id: int, server_round: int,
                      plan: ReleasePlan | None = None) -> PrivacyEvent:
        """The release the server asks of ``partition_id`` in ``server_round``: under the
        run's trust model, from the method's plan (``plan``, when already computed)."""
        if plan is None:
            plan = self.plan(partition_id, server_round)
        return self.trust.planned_event(self.cfg, plan,
                                        self.partition_sizes[partition_id], server_round,
                                        self.dim, len(self.partition_sizes))

    def planned_clip(self, server_round: int) -> float:
        """The clip norm a reply of ``server_round`` must report: the method's C of the
        round when it adapts it, else max-grad-norm (DP-SGD's per-sample clip) or
        clip-norm (update DP)."""
        return self.plan(None, server_round).round_clip(self.cfg)

    def round_plans(self, server_round: int) -> dict[int | None, ReleasePlan]:
        """Every partition's plan of ``server_round`` (an unknown partition's before the
        sizes are bound), each computed once for the round's bounds."""
        return {p: self.plan(p, server_round) for p in sorted(self.partition_sizes) or [None]}

    def noise_scale(self, server_round: int,
                    plans: dict[int | None, ReleasePlan] | None = None) -> float:
        """How much more noise than sigma C the method's clients add to the update (the
        largest over partitions' ``plans``, by default the round's; 1: none)."""
        plans = self.round_plans(server_round) if plans is None else plans
        return max(plan.noise_scale for plan in plans.values())

    def plan_record(self, node_id: int, server_round: int) -> dict[str, Any]:
        """``plan-*`` keys for a node whose partition is known (else none), and the
        server's own releases charged to it so far (``server-event-*``: the client's budget
        check counts them)."""
        pid = self.nodes.pinned(node_id)
        if not self.cfg.is_private:
            return {}
        history = self.history_record(pid)
        if pid not in self.partition_sizes:
            return history
        released = (server_events_config(self.ledger, client_key(pid))
                    if self.ledger is not None else {})
        return {**plan_to_record(self.planned_event(pid, server_round)), **released,
                **history}

    def history_record(self, pid: int | None) -> dict[str, list]:
        """The ledger's events a node's client must count (``ledger-*`` keys), in every
        instruction: a node whose state was lost (a restart, a resume in a new simulation)
        adopts them before its budget check, whenever it is next sampled. A node pinned to
        a partition gets that partition's; a node not pinned yet (its partition unknown
        until it replies) gets every partition's and picks its own. Under trust=central
        the server charges and checks the budget itself: none."""
        if self.ledger is None or not self.trust.clients_charge:
            return {}
        if pid is not None:
            return ledger_config(self.ledger, client_key(pid))
        # the same for every unpinned node of a round: built once, not once per node
        cached = self._all_history
        if cached is None or cached[0] is not self.ledger or cached[1] != len(
                self.ledger.charges):     # charges only grow: their count dates the record
            cached = self._all_history = (self.ledger, len(self.ledger.charges),
                                          ledger_config(self.ledger))
        return cached[2]

    # -- what the mechanism promises ---------------------------------------------------
    def norm_bound(self, dim: int, server_round: int) -> float | None:
        """The L2 bound a client's update must meet (None = no bound): the user's
        ``max-update-norm`` and the method's own bound when it gives one, else, for
        client-level update DP, the Gaussian tail bound at the noisiest planned sigma of
        the round."""
        user = self.cfg.max_update_norm if self.cfg.max_update_norm > 0 else None
        own = self.method_bound(dim, server_round)
        if own is not None:
            return min(own, user) if user else own
        if self.cfg.trainer == "dpsgd":
            bound = self.dpsgd_bound(dim, server_round)
            return min(bound, user) if user else bound
        if self.cfg.trainer != "update-dp":
            return user
        plans = self.round_plans(server_round)
        sigmas = {plan.sigma for plan in plans.values()}
        if None in sigmas:  # the run's sigma (for update-dp it does not depend on n)
            sigmas = (sigmas - {None}) | {noise_multiplier_for(self.cfg, 1)}
        sigma = max(sigmas) * self.noise_scale(server_round, plans)
        bound = gaussian_norm_bound(self.planned_clip(server_round), sigma, dim)
        return min(bound, user) if user else bound

    def dpsgd_bound(self, dim: int, server_round: int) -> float:
        """The largest update norm an honest DP-SGD client of any partition can send this
        round (:func:`dpfl.privacy.plan.dpsgd_norm_bound` at its planned sigma, scaled by
        the method's noise scale, its steps, the round's clip and the public size; the
        loosest over partitions)."""
        if not self.partition_sizes:
            return math.inf
        plans = self.round_plans(server_round)
        bounds, clip = [], self.planned_clip(server_round)
        scale = self.noise_scale(server_round, plans)
        for pid in sorted(self.partition_sizes):
            event = self.planned_event(pid, server_round, plans[pid])
            bounds.append(dpsgd_norm_bound(self.cfg, self.partition_sizes[pid],
                                           event.sigma * scale, int(event.steps), dim,
                                           clip=clip))
        return max(bounds)

    def weights(self, weights: torch.Tensor) -> torch.Tensor:
        """Client-level update DP: equal weights (sizes are private); else the method's."""
        return torch.ones_like(weights) if self.cfg.trainer == "update-dp" else weights

    def public_examples(self, partition_id: int, claimed: int) -> int:
        """The aggregation weight of a partition's update: its public size when the server
        knows it (a client's larger claim would let its reply dominate the mean)."""
        return self.partition_sizes.get(partition_id, claimed)

    def replayed(self, update: torch.Tensor, client: str, server_round: int) -> str | None:
        """Why ``update`` is a replay (bytes identical to an update ``client`` sent before),
        or None after remembering it. Kept in memory for the run (a 32-byte digest per
        update)."""
        digest = hashlib.sha256(update.contiguous().numpy()).digest()   # no copy of the bytes
        seen = self.seen_updates.setdefault(client, {})
        if digest in seen:
            return (f"a replay: identical to {client}'s update of round {seen[digest]} (an "
                    "honest DP update carries fresh noise)")
        seen[digest] = server_round
        return None

    # -- charging --------------------------------------------------------------------
    def charge_reply(self, reply: ParsedReply, checked: ClientUpdate | Rejection,
                     sent_round: int, late: bool = False) -> Charge | None:
        """Charge the ledger for a reply that carries an update (accepted or not, on time
        or late); None when nothing was released (error, refusal without arrays) or the
        run is not private. A node's partition id is pinned on its first update: a reply
        claiming another one is charged to the pinned client and rejected."""
        if (not self.cfg.is_private or self.ledger is None or reply.error is not None
                or not self.trust.clients_charge   # a trusted server charges centrally
                or not reply.released):
            return None
        node = checked.node_id
        claimed = checked.partition_id if checked.partition_id is not None else -1
        pid, identity_problem = self.nodes.partition_of(node, claimed)
        if pid is not None:
            client, plan = client_key(pid), self.planned_event(pid, sent_round)
        else:  # unknown sender: charge the node at the costliest plan of any partition
            client = f"node-{node}"
            plan = self._costliest_plan(client, sent_round)
        history = self.ledger.clients.get(client, PrivacyHistory())
        charge = charge_for(client, sent_round, reply.privacy, plan,
                            self.planned_clip(sent_round), history, self.ledger.delta,
                            self.ledger.accountant, reply.reported_epsilon,
                            reported=reply.reported)
        if identity_problem is not None:
            charge.problem = identity_problem if charge.problem is None else (
                f"{identity_problem}; {charge.problem}")
            charge.note = f"{charge.note} ({identity_problem})"
        if late:
            charge.note = f"late reply to round {sent_round}: {charge.note}"
        self.ledger.record(client, sent_round, charge.events, charge.reported_epsilon,
                           charge.note, adaptive=charge.adaptive or self.adaptive,
                           claimed=claimed if pid is None and claimed in self.partition_sizes
                           else None)
        if charge.problem is not None:
            known = client.startswith(CLIENT_PREFIX)
            log.warning("round %d: %s charged %s%s: %s", sent_round,
                        client if known else client_label(node, None),
                        [e.to_dict() for e in charge.events],
                        "" if known else f" (ledger key {client})", charge.note)
        return charge

    def sender_partition(self, msg: Message) -> tuple[int | None, str | None]:
        """The registry's ``partition_of`` a reply's sender with the partition it claims
        (-1: none)."""
        claimed = claimed_partition(msg)
        return self.nodes.partition_of(int(msg.metadata.src_node_id),
                                       claimed if claimed is not None else -1)

    def charge_server_release(self, server_round: int, events: list[PrivacyEvent],
                              partition_ids: list[int], note: str) -> None:
        """Charge a release the server made itself (e.g. adaptive clipping's noisy count,
        central noise) to every client it covers, beside the clients' own events."""
        if not self.cfg.is_private or self.ledger is None:
            return
        clients = [client_key(p) for p in partition_ids]
        self.ledger.charge_server_release(server_round, events, clients, note,
                                          adaptive=self.adaptive)
        log.info("round %d: server release %s charged to %d clients (%s)", server_round,
                 [e.to_dict() for e in events], len(clients), note)

    def charge_population(self, server_round: int, events: list[PrivacyEvent]) -> None:
        """Charge a release covering every client (central DP: each round's noisy sum,
        amplified by Poisson sampling, costs every client, sampled or not)."""
        if not self.cfg.is_private or self.ledger is None:
            return
        clients = [client_key(p) for p in sorted(self.partition_sizes)]
        self.ledger.charge_population_release(server_round, events, clients,
                                              "central release (every client, every round)")

    def _costliest_plan(self, client: str, server_round: int) -> PrivacyEvent:
        history = self.ledger.clients.get(client, PrivacyHistory())
        plans = [self.planned_event(p, server_round) for p in sorted(self.partition_sizes)]
        if not plans:
            raise RuntimeError("no partition sizes bound: the server cannot plan charges")
        return max(plans, key=lambda e: PrivacyHistory(history.events + [e]).epsilon(
            self.ledger.delta, self.ledger.accountant))
