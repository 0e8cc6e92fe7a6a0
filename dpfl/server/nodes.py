"""Who each node is: one registry the guard, the strategy, the exchange and the methods read.

A reply comes from a node; the privacy ledger charges a partition (``client-<id>``). The
registry holds what links them: the public training-set size of every partition, the
operator's node → partition map (``node-partitions``, fixed for the launch), the pins of
nodes that first claimed a partition (without an operator's map), the nodes connected this
round, and the client each node last replied as (for messages and PEGASUS' selection).
Pins and last clients are checkpointed; the operator's map always comes from the launch.
"""

from __future__ import annotations

from typing import Any, Mapping

from dpfl.config import parse_node_partitions
from dpfl.logs import get_logger
from dpfl.privacy.accounting.ledger import client_key
from dpfl.server.validation import client_label

log = get_logger("flwr.dpfl.nodes")


class NodeRegistry:
    """Node ids ↔ partitions of one run (see the module docstring)."""

    def __init__(self, node_partitions: str = "",
                 sizes: Mapping[int, int] | None = None) -> None:
        # partition id -> training-set size (public: derived from the run-config)
        self.sizes: dict[int, int] = dict(sizes or {})
        self.operator_map = parse_node_partitions(node_partitions)
        self.node_partition: dict[int, int] = dict(self.operator_map)   # + first-claim pins
        self.node_client: dict[int, str] = {}      # node id -> client it last replied as
        self.connected: set[int] | None = None     # nodes of the current round (None: unknown)

    def known_partition(self, partition_id: int | None) -> bool:
        """A partition id this run has (any id >= 0 before the sizes are bound)."""
        return (partition_id is not None and partition_id >= 0
                and (not self.sizes or partition_id in self.sizes))

    def pinned(self, node: int) -> int | None:
        """The partition ``node`` is bound to (operator's map or first claim), if any."""
        return self.node_partition.get(node)

    def client_of(self, node: int) -> str | None:
        """The ledger key of the client ``node`` last replied as (None: not yet)."""
        return self.node_client.get(node)

    def note_reply(self, node: int, partition_id: int | None) -> None:
        """``node`` replied as ``partition_id`` (what was charged, if known)."""
        if self.known_partition(partition_id):
            self.node_client[node] = client_key(partition_id)   # type: ignore[arg-type]

    def name(self, node: int, claimed: int | None = None) -> str:
        """How messages name a node: ``client-<partition-id>`` from its pin, else from its
        earlier replies, else from a known ``claimed`` id; ``node <id> (partition
        unknown)`` otherwise."""
        pinned = self.pinned(node)
        if pinned is not None:
            return client_label(node, pinned)
        known = claimed if self.known_partition(claimed) else None
        return self.node_client.get(node) or client_label(node, known)

    def partition_of(self, node: int, claimed: int) -> tuple[int | None, str | None]:
        """The partition a reply of ``node`` is charged to, and why the reply is not
        acceptable as it stands (None: fine).

        - The operator's map (``node-partitions``) decides: a node outside it is unknown,
          a claim other than its partition is refused (charged to the mapped partition).
        - Without one, a node is pinned to the first partition it claims, if no other
          connected node holds it; a later different claim is refused (charged to the pinned
          partition); a claim of a partition another connected node holds is refused and
          charged to this node. A holder that is gone (a restarted simulation or an
          unauthenticated SuperNode that re-registered: new node ids) leaves the partition
          to the next node that claims it: without an operator's map, identity is only as
          good as the first claim of a connected node (see docs/privacy.md, "The privacy
          record").
        """
        pinned = self.node_partition.get(node)
        if pinned is not None:
            if claimed != pinned:
                return pinned, (f"partition-id {claimed} differs from this node's {pinned}"
                                + (" (node-partitions)" if self.operator_map else ""))
            return pinned, None
        if self.operator_map:
            return None, f"node {node} is not in node-partitions (claims partition {claimed})"
        if claimed not in self.sizes:
            return None, f"unknown partition-id {claimed}"
        holder = next((n for n, p in self.node_partition.items() if p == claimed), None)
        if holder is not None and (self.connected is None or holder in self.connected):
            return None, f"partition-id {claimed} already belongs to node {holder}"
        if holder is not None:
            log.info("partition %d: node %d is gone; node %d now holds it", claimed, holder,
                     node)
            del self.node_partition[holder]
        self.node_partition[node] = claimed
        return claimed, None

    # -- persistence -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"node-partition": dict(self.node_partition),
                "node-client": dict(self.node_client)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Pins and last clients of the checkpoint (an older checkpoint has no
        ``node-client``); the operator's map (this launch's) always wins."""
        self.node_partition.update({int(k): int(v) for k, v in
                                    state.get("node-partition", {}).items()})
        self.node_client.update({int(k): str(v) for k, v in
                                 state.get("node-client", {}).items()})
        if self.operator_map:
            self.node_partition = dict(self.operator_map)
