"""The per-node instruction index (dpfl.server.node_index) answers exactly as Flower 1.39's
own InMemoryLinkState: two real states, built as Flower's simulation builds them, get the
same pushes and queries, and must return the same messages in the same order."""

from __future__ import annotations

import random

import pytest

from dpfl.server import node_index

flwr_linkstate = pytest.importorskip("flwr.server.superlink.linkstate.in_memory_linkstate")


def _federation(num_nodes: int, indexed: bool, run_ids: tuple[int, ...] = (7,)):
    state, grids, nodes = node_index.simulation_state(num_nodes, run_ids)
    if indexed:
        assert node_index.index_instructions_by_node(state)
    return state, grids, nodes


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """Flower's Message reads the process's run id from TaskIdentity (set by Flower's
    ServerApp process); each test gets the original back."""
    from flwr.supercore.task_identity import TaskIdentity
    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, getattr(TaskIdentity, name))


_push = node_index.push_instruction


def test_pinned_flower_sources_unchanged():
    """Fails loudly when the installed Flower's InMemoryLinkState methods the index
    replaces or relies on are not the ones it was written against."""
    assert node_index.why_not_patchable() is None, (
        "Flower's InMemoryLinkState changed: re-read it, then update "
        "dpfl/server/node_index.py (PATCHED_SOURCE_SHA256)")


def test_same_answers_as_flower_on_a_random_schedule():
    """Random pushes to 30 nodes and 2 runs, random queries (limit 1, 2, None; with and
    without run_id), a deletion: the indexed state returns the same group ids in the same
    order as Flower's, and marks the same messages delivered."""
    rng = random.Random(3)
    plain, plain_grids, plain_nodes = _federation(30, indexed=False, run_ids=(7, 8))
    fast, fast_grids, fast_nodes = _federation(30, indexed=True, run_ids=(7, 8))
    assert type(fast).__name__ == "NodeIndexedLinkState"
    assert type(plain) is flwr_linkstate.InMemoryLinkState
    ids: dict[str, tuple[str, str]] = {}
    for step in range(600):
        action = rng.random()
        k = rng.randrange(30)
        if action < 0.5:
            run_id = rng.choice((7, 8))
            tag = f"g{step}"
            ids[tag] = (_push(plain_grids[run_id], plain_nodes[k], tag),
                        _push(fast_grids[run_id], fast_nodes[k], tag))
        elif action < 0.95:
            limit = rng.choice((1, 2, None))
            run_id = rng.choice((None, 7, 8))
            a = plain.get_message_ins(plain_nodes[k], limit, run_id=run_id)
            b = fast.get_message_ins(fast_nodes[k], limit, run_id=run_id)
            assert [m.metadata.group_id for m in a] == [m.metadata.group_id for m in b]
            assert all(m.metadata.delivered_at for m in b)
        elif ids:
            tag = rng.choice(sorted(ids))
            plain.delete_messages({ids[tag][0]})
            fast.delete_messages({ids[tag][1]})
    for k in range(30):  # drain: both have the same undelivered rest
        a = plain.get_message_ins(plain_nodes[k], None)
        b = fast.get_message_ins(fast_nodes[k], None)
        assert [m.metadata.group_id for m in a] == [m.metadata.group_id for m in b]
        assert fast.get_message_ins(fast_nodes[k], None) == []


def test_a_query_reads_only_its_own_node():
    """With 200 nodes and one instruction each, a query checks one message, not 200 (the
    O(nodes x instructions) sweep is what the index removes)."""
    state, grids, nodes = _federation(200, indexed=True)
    for i, node in enumerate(nodes):
        _push(grids[7], node, f"m{i}")
    checked: list[set[str]] = []
    original = type(state)._check_stored_messages

    def counting(self, message_ids, run_id=None):
        checked.append(set(message_ids))
        return original(self, message_ids, run_id)

    type(state)._check_stored_messages = counting
    try:
        (msg,) = state.get_message_ins(nodes[123], limit=1)
    finally:
        type(state)._check_stored_messages = original
    assert msg.metadata.group_id == "m123"
    assert len(checked) == 1


def test_expired_instruction_is_dropped_like_flower_does():
    """An instruction past its TTL is deleted on query and never returned, as in Flower."""
    import time
    for indexed in (False, True):
        state, grids, nodes = _federation(2, indexed=indexed)
        _push(grids[7], nodes[0], "short", ttl=0.05)
        _push(grids[7], nodes[0], "long")
        time.sleep(0.1)
        got = state.get_message_ins(nodes[0], None)
        assert [m.metadata.group_id for m in got] == ["long"]
        assert len(state.message_ins_store) == 1


def test_existing_instructions_are_indexed_on_install():
    """Instructions stored before the swap are found after it, in store order."""
    state, grids, nodes = _federation(3, indexed=False)
    for tag in ("a", "b", "c"):
        _push(grids[7], nodes[1], tag)
    state.get_message_ins(nodes[1], 1)  # "a" delivered before the swap
    assert node_index.index_instructions_by_node(state)
    assert node_index.index_instructions_by_node(state)  # idempotent
    got = state.get_message_ins(nodes[1], None)
    assert [m.metadata.group_id for m in got] == ["b", "c"]


def test_other_states_are_left_alone():
    """A state that is not exactly Flower's in-memory one (SQLite, a deployment's) is not
    touched."""
    class Other:
        pass
    other = Other()
    assert node_index.index_instructions_by_node(other) is False
    assert type(other) is Other


def test_the_instruction_poll_wakes_when_an_instruction_is_stored(monkeypatch):
    """dpfl's replacement of Flower's instruction poll (process_backend.add_messages_on_arrival)
    hands the runtime the same instructions as Flower's own sweep, and with the index
    installed it wakes on each stored instruction: with its sleep set to 60 s, an instruction
    pushed while it sleeps still reaches the queue."""
    import queue
    import threading

    from flwr.server.superlink.fleet.vce import vce_api

    from dpfl.runtime import process_backend

    monkeypatch.setattr(process_backend, "POLL_SECONDS", 60.0)
    state, grids, nodes = _federation(5, indexed=True)
    plain, plain_grids, plain_nodes = _federation(5, indexed=False)
    for k in (0, 3, 4):   # one per node, as dpfl sends (a node is never sent a second)
        _push(grids[7], nodes[k], f"early-{k}")
        _push(plain_grids[7], plain_nodes[k], f"early-{k}")
    ours: queue.Queue = queue.Queue()
    stop = threading.Event()
    poll = threading.Thread(target=process_backend.add_messages_on_arrival,
                            args=(state, ours, {n: None for n in nodes}, stop), daemon=True)
    poll.start()
    flowers: queue.Queue = queue.Queue()
    plain_stop = threading.Event()
    reference = threading.Thread(target=vce_api.add_messages_to_queue,
                                 args=(plain, flowers, {n: None for n in plain_nodes},
                                       plain_stop), daemon=True)
    reference.start()
    got = [ours.get(timeout=10).metadata.group_id for _ in range(3)]
    expected = [flowers.get(timeout=10).metadata.group_id for _ in range(3)]
    assert sorted(got) == sorted(expected) == ["early-0", "early-3", "early-4"]
    _push(grids[7], nodes[1], "late")       # the poll sleeps (60 s): the store wakes it
    assert ours.get(timeout=10).metadata.group_id == "late"
    stop.set()
    plain_stop.set()
    state.dpfl_instructions_arrived.set()   # let it see the stop now, not in 60 s
    poll.join(timeout=10)
    reference.join(timeout=10)
    assert not poll.is_alive()


def test_a_sweep_queues_the_largest_cohort_first():
    """Longest processing time first: instructions found in one sweep are queued by their
    bundle's number of clients, largest first; plain instructions keep Flower's node order."""
    import queue
    import threading

    from flwr.app import ConfigRecord, RecordDict

    from dpfl.cohort import bundle_instructions
    from dpfl.runtime import process_backend

    state, grids, nodes = _federation(4, indexed=True)

    def bundle(n: int) -> RecordDict:
        return bundle_instructions({pid: RecordDict({"config": ConfigRecord({"i": pid})})
                                    for pid in range(n)}, "train", 100)

    from flwr.app import Message
    from flwr.supercore.task_identity import TaskIdentity
    grid = grids[7]
    TaskIdentity.run_id = grid.run.run_id
    TaskIdentity.node_id = 1
    TaskIdentity.task_id = grid.run.primary_task_id
    sizes = {nodes[0]: 3, nodes[1]: 9, nodes[2]: 0, nodes[3]: 5}
    grid.push_messages([Message(bundle(n) if n else RecordDict(), node, "train.cohort",
                                group_id=str(n)) for node, n in sizes.items()])
    out: queue.Queue = queue.Queue()
    stop = threading.Event()
    poll = threading.Thread(target=process_backend.add_messages_on_arrival,
                            args=(state, out, {n: None for n in nodes}, stop), daemon=True)
    poll.start()
    order = [out.get(timeout=10).metadata.group_id for _ in range(4)]
    stop.set()
    state.dpfl_instructions_arrived.set()
    poll.join(timeout=10)
    assert order == ["9", "5", "3", "0"]
