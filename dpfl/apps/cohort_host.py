"""A cohort host: the simulated SuperNode that answers for several clients per Message.

A bundle (:mod:`dpfl.cohort`) lists the clients of this node that the round sampled; each
is run through the ordinary handler of its message type (:mod:`dpfl.apps.client_handlers`:
``train``, ``evaluate``, ``query.warm``), one after another, exactly as a node of its own
would run it: its own instruction, its own Context (``partition-id`` = the client,
``num-partitions`` = the federation's clients) and its own node state, kept in the host's
state under ``<pid>/``. A client whose handler raises gets an error reply (as Flower gives
a ClientApp that raised); the others go on. Only a simulation sends bundles: a host holds
several clients' data, which a real device never does (docs/privacy.md, "Cohort nodes").
"""

from __future__ import annotations

import traceback
from typing import Callable

from flwr.app import Context, Message, Metadata, RecordDict

from dpfl.apps import client_handlers
from dpfl.cohort import (
    bundle_replies,
    client_state,
    store_client_state,
    unbundle_instructions,
)
from dpfl.logs import get_logger

log = get_logger("flwr.dpfl.cohort")

Handler = Callable[[Message, Context], Message]
HANDLERS: dict[str, Handler] = {
    "train": client_handlers.train,
    "evaluate": client_handlers.evaluate,
    "query.warm": client_handlers.warm,
}


def client_instruction(bundle: Message, pid: int, inner_type: str,
                       content: RecordDict) -> Message:
    """Client ``pid``'s instruction out of ``bundle``: its records and the bundle's
    metadata with the inner message type (built without Flower's process identity, which a
    ClientApp process need not have)."""
    meta = bundle.metadata
    return Message(metadata=Metadata(
        run_id=meta.run_id, message_id=f"{meta.message_id}/{pid}",
        src_node_id=meta.src_node_id, dst_node_id=meta.dst_node_id,
        reply_to_message_id="", group_id=meta.group_id, created_at=meta.created_at,
        ttl=meta.ttl, message_type=inner_type), content=content)


def client_context(host: Context, pid: int, num_clients: int) -> Context:
    """Client ``pid``'s Context on ``host``: its partition and its own node state."""
    return Context(run_id=host.run_id, node_id=host.node_id,
                   node_config={**host.node_config, "partition-id": pid,
                                "num-partitions": num_clients},
                   state=client_state(host.state, pid), run_config=host.run_config)


def run_cohort(msg: Message, context: Context) -> Message:
    """Answer a bundle: each listed client's handler in turn, one reply bundle."""
    inner_type, num_clients, contents = unbundle_instructions(msg.content)
    handler = HANDLERS.get(inner_type)
    if handler is None:
        raise ValueError(f"a cohort of '{inner_type}' messages: no such handler")
    replies: dict[int, RecordDict | str] = {}
    for pid, content in contents.items():
        own = client_context(context, pid, num_clients)
        try:
            reply = handler(client_instruction(msg, pid, inner_type, content), own)
            replies[pid] = (f"{reply.error.reason}" if reply.has_error() else reply.content)
        except Exception as exc:  # noqa: BLE001 - one client's failure, as Flower reports it
            log.error("client %d of a cohort: %s", pid, traceback.format_exc())
            replies[pid] = f"{type(exc)}:<'{exc}'>"
        # kept whatever happened: a charge recorded before a failure stays recorded
        store_client_state(context.state, pid, own.state)
    return Message(bundle_replies(replies), reply_to=msg)
