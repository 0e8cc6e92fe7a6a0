"""A per-node index of undelivered instructions for Flower's in-memory LinkState.

Flower 1.39's simulation engine (``flwr/server/superlink/fleet/vce/vce_api.py``,
``add_messages_to_queue``) asks the LinkState for each node's next instruction every 0.1 s,
and ``InMemoryLinkState.get_message_ins`` answers by scanning every stored instruction
(and re-checking each one's expiry). A sweep over N nodes with M stored instructions costs
O(N x M): at 1,000 simulated clients it was the largest single cost of a round
(``results/trust/README.md``).

:class:`NodeIndexedLinkState` keeps, per destination node, the ids of its undelivered
instructions in arrival order, so a node's query reads only its own; and it sets an event
(:data:`dpfl.flower_pin.INSTRUCTIONS_ARRIVED`) when one is stored, on which the process
backend's instruction poll wakes. It answers every query
exactly as the original does (same messages, same order, same limit, same ``run_id``
filter, same expiry checks on the messages it returns, same ``delivered_at`` marking):
``tests/test_node_index.py`` drives both with the same operations and compares them.

The patch is scoped to the pinned Flower: :func:`index_instructions_by_node` swaps the
class of the simulation's state object only when the installed ``flwr`` is the pinned
version and the two methods it replaces still have the source it was written against
(:data:`PATCHED_SOURCE_SHA256`); otherwise it leaves Flower untouched and says why.
"""

from __future__ import annotations

import threading
from typing import Any

from dpfl.flower_pin import INSTRUCTIONS_ARRIVED, pin_problem
from dpfl.logs import get_logger

LOG = get_logger("flwr.dpfl.server.node_index")

# sha256 of inspect.getsource of the InMemoryLinkState methods the subclass replaces or
# relies on, as shipped in flwr 1.39.0 (tests/test_node_index.py fails when they change)
PATCHED_SOURCE_SHA256 = {
    "store_message_ins": "a2b78afac51dc4a23d236ccf8d02958c8d0532aac179cd9ad9b1a0d939eecbea",
    "get_message_ins": "6547c8dcbc62e12f5b2aa5c69f4de8c7c7072c10d6c0876512cf37197d941056",
    "_check_stored_messages": "2be47567d2478a58b766c116f1f0cd0ae3aa791d4e7e3ee85cb20d31f15a8082",
}


def _in_memory_link_state() -> type:
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    return InMemoryLinkState


def why_not_patchable() -> str | None:
    """None when the installed Flower is the one the index was written against, else why
    not (a version or a source change)."""
    return pin_problem(_in_memory_link_state(), "InMemoryLinkState", PATCHED_SOURCE_SHA256)


def _make_class() -> type:
    from flwr.server.superlink.linkstate.utils import now

    base = _in_memory_link_state()

    class NodeIndexedLinkState(base):  # type: ignore[misc, valid-type]
        """InMemoryLinkState with ``pending_by_node``: node id -> {undelivered message id:
        None} in arrival order (a dict as an ordered set)."""

        pending_by_node: dict[int, dict[str, None]]

        def store_message_ins(self, message: Any) -> str | None:
            with self.lock:
                message_id = super().store_message_ins(message)
                stored = self.message_ins_store.get(message_id) if message_id else None
                if stored is not None and stored.metadata.delivered_at == "":
                    self.pending_by_node.setdefault(
                        stored.metadata.dst_node_id, {})[message_id] = None
                    getattr(self, INSTRUCTIONS_ARRIVED).set()
            return message_id

        def get_message_ins(self, node_id: int, limit: int | None, *,
                            run_id: int | None = None) -> list[Any]:
            if limit is not None and limit < 1:
                raise AssertionError("`limit` must be >= 1")
            found: list[Any] = []
            with self.lock:
                pending = self.pending_by_node.get(node_id, {})
                for msg_id in list(pending):
                    self._check_stored_messages({msg_id})
                    msg = self.message_ins_store.get(msg_id)
                    if (msg is None or msg.metadata.delivered_at != ""
                            or msg.metadata.dst_node_id != node_id):
                        del pending[msg_id]  # gone (expired, deleted) or delivered
                        continue
                    if run_id is None or msg.metadata.run_id == run_id:
                        found.append(msg)
                    if limit and len(found) == limit:
                        break
                delivered_at = now().isoformat()
                for msg in found:
                    msg.metadata.delivered_at = delivered_at
                    pending.pop(msg.metadata.message_id, None)
            return found

    return NodeIndexedLinkState


_CLASS: type | None = None


def node_indexed_class() -> type:
    """The subclass (built once, on first use: Flower is imported lazily)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _make_class()
    return _CLASS


def build_index(state: Any) -> dict[int, dict[str, None]]:
    """The undelivered instructions already in ``state``, by destination, in store order."""
    pending: dict[int, dict[str, None]] = {}
    for msg_id, msg in state.message_ins_store.items():
        if msg.metadata.delivered_at == "":
            pending.setdefault(msg.metadata.dst_node_id, {})[msg_id] = None
    return pending


def index_instructions_by_node(state: Any) -> bool:
    """Turn Flower's in-memory ``state`` (the simulation's LinkState, shared by the engine
    and the ServerApp's grid) into a :class:`NodeIndexedLinkState` in place. True if done;
    False, with one INFO line saying why, when ``state`` is not exactly the pinned
    InMemoryLinkState (a deployment's state, another Flower)."""
    if type(state) is node_indexed_class():
        return True
    if type(state) is not _in_memory_link_state():
        return False
    reason = why_not_patchable()
    if reason is not None:
        LOG.info("Flower's instruction scan left as is (%s)", reason)
        return False
    with state.lock:
        state.pending_by_node = build_index(state)
        setattr(state, INSTRUCTIONS_ARRIVED, threading.Event())
        state.__class__ = node_indexed_class()
    return True


def simulation_state(num_nodes: int, run_ids: tuple[int, ...] = (7,)) -> tuple[Any, dict, list]:
    """A real in-memory LinkState with ``num_nodes`` registered nodes and the given runs,
    set up as ``flwr.simulation.run_simulation._main_loop`` does, and an InMemoryGrid per
    run: (state, {run id: grid}, node ids). For the tests and the engine bench."""
    from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
    from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run
    from flwr.superlink.federation import NoOpFederationManager
    from flwr.superlink.grid import InMemoryGrid

    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(),
                               ObjectStoreFactory())
    state = factory.state()
    grids = {}
    for run_id in run_ids:
        run = Run.create_empty(run_id=run_id)
        run.primary_task_id = 100 + run_id
        run.federation_id = NOOP_FEDERATION_ID
        state.run_ids[run_id] = RunRecord(run=run)
        state.task_store[100 + run_id] = Task(task_id=100 + run_id, run_id=run_id)
        grid = InMemoryGrid(state_factory=factory)
        grid.set_run(run)
        grids[run_id] = grid
    return state, grids, sorted(_register_nodes(num_nodes, factory))


def push_instruction(grid: Any, dst: int, group_id: str, ttl: float | None = None) -> str:
    """Push one empty "train" instruction to ``dst`` through ``grid``, as the ServerApp's
    process would (Flower's Message reads the run and sender from TaskIdentity)."""
    from flwr.app import Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity
    TaskIdentity.run_id = grid.run.run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    TaskIdentity.task_id = grid.run.primary_task_id
    (msg_id,) = grid.push_messages([Message(RecordDict(), dst, "train", ttl=ttl,
                                            group_id=group_id)])
    return msg_id
