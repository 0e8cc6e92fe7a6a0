"""The ServerApp's view of a cohort simulation: one node per client, over K host nodes.

With ``cohort-clients`` = N, a simulation runs K SuperNodes (hosts) for N clients.
:class:`CohortGrid` wraps the run's Grid and shows everything above it (the strategy, the
guard, the exchange, the run loop) N nodes, one per client, with stable ids
(:func:`client_node`): client ``pid`` lives on host ``pid mod K`` of the hosts in id order,
fixed when the first message goes out, so its node state stays on one host for the run.
Each push bundles the instructions of one host into one Message (:mod:`dpfl.cohort`);
each pull splits a host's reply into one reply per client, as if each client's own node
had answered: the same records, the same errors, the ids the push returned. A host that
still owes a reply gets its next bundle only once that reply is in (two bundles of one
host at once would race on its node state: one client's charge could be lost).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from uuid import uuid4

from flwr.app import Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from dpfl.cohort import bundle_instructions, bundle_type, unbundle_replies
from dpfl.logs import get_logger

log = get_logger("flwr.dpfl.cohort")

# the ids the strategy sees: far above a partition id, never 0 (the SuperLink's own id)
CLIENT_NODE_BASE = 1 << 40


def client_node(pid: int) -> int:
    """The node id the ServerApp sees for client ``pid`` in a cohort simulation."""
    return CLIENT_NODE_BASE + int(pid)


def client_of(node_id: int) -> int:
    """The client (partition id) of a node id :func:`client_node` made."""
    return int(node_id) - CLIENT_NODE_BASE


@dataclass
class _Bundle:
    host: int
    message_type: str
    clients: dict[int, Message] = field(default_factory=dict)   # pid -> instruction
    bundle_id: str | None = None                                # once pushed


class CohortGrid(Grid):
    """A Grid of ``num_clients`` client nodes over the wrapped Grid's host nodes (module
    docstring)."""

    def __init__(self, grid: Grid, num_clients: int) -> None:
        if num_clients < 1:
            raise ValueError("a cohort simulation needs at least one client")
        self.inner = grid
        self.num_clients = int(num_clients)
        self.hosts: list[int] | None = None     # fixed once a message went out
        self.frozen = False
        self._queued: dict[int, list[_Bundle]] = {}    # host -> bundles waiting for it
        self._busy: dict[int, _Bundle] = {}            # host -> its unanswered bundle
        self._by_bundle: dict[str, _Bundle] = {}       # pushed bundle id -> bundle
        self._owner: dict[str, _Bundle] = {}           # client message id -> its bundle
        self._ready: dict[str, Message] = {}           # client message id -> its reply

    # -- what Flower's Grid offers, delegated --------------------------------------------
    @property
    def state(self):   # noqa: ANN201 - a simulation's LinkState (dpfl.apps.server reads it)
        return getattr(self.inner, "state", None)

    def set_run(self, run) -> None:  # noqa: ANN001
        self.inner.set_run(run)

    @property
    def run(self):  # noqa: ANN201
        return self.inner.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    # -- clients over hosts --------------------------------------------------------------
    def _current_hosts(self) -> list[int]:
        connected = sorted(int(n) for n in self.inner.get_node_ids())
        if not self.frozen:
            self.hosts = connected
        return connected

    def host_of(self, pid: int) -> int:
        """The host node of client ``pid`` (once the hosts are known)."""
        if not self.hosts:
            raise RuntimeError("no host node is connected")
        return self.hosts[pid % len(self.hosts)]

    def one_client_per_host(self, nodes: Iterable[int]) -> list[int]:
        """The first of ``nodes`` (client nodes) on each host."""
        seen: dict[int, int] = {}
        for node in sorted(nodes):
            seen.setdefault(self.host_of(client_of(node)), node)
        return sorted(seen.values())

    def get_node_ids(self) -> Iterable[int]:
        """One node per client whose host is connected."""
        connected = set(self._current_hosts())
        if not self.hosts:
            return []
        return [client_node(pid) for pid in range(self.num_clients)
                if self.host_of(pid) in connected]

    # -- push: one bundle per host -------------------------------------------------------
    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Bundle ``messages`` (addressed to client nodes) per host and message type; the
        ids returned are the clients' (in message order), each answered by its own reply
        in :meth:`pull_messages`."""
        messages = list(messages)
        if not messages:
            return []
        if self.hosts is None:
            self._current_hosts()
        self.frozen = True
        groups: dict[tuple[int, str], _Bundle] = {}
        ids = []
        for msg in messages:
            pid = client_of(msg.metadata.dst_node_id)
            if not 0 <= pid < self.num_clients:
                raise ValueError(f"node {msg.metadata.dst_node_id} is not a client node "
                                 f"of this cohort simulation")
            host = self.host_of(pid)
            key = (host, msg.metadata.message_type)
            bundle = groups.get(key)
            if bundle is None:
                bundle = groups[key] = _Bundle(host, msg.metadata.message_type)
            if pid in bundle.clients:
                raise ValueError(f"two messages for client {pid} in one push")
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            bundle.clients[pid] = msg
            ids.append(msg.metadata.message_id)
        for bundle in groups.values():
            for msg in bundle.clients.values():
                self._owner[msg.metadata.message_id] = bundle
            self._queued.setdefault(bundle.host, []).append(bundle)
        self._dispatch()
        return ids

    def _dispatch(self) -> None:
        """Push the next queued bundle of every host that owes nothing."""
        for host, queue in self._queued.items():
            if queue and host not in self._busy:
                self._push(queue.pop(0))

    def _push(self, bundle: _Bundle) -> None:
        first = next(iter(bundle.clients.values()))
        content = bundle_instructions({p: m.content for p, m in bundle.clients.items()},
                                      bundle.message_type, self.num_clients)
        out = Message(content, bundle.host, bundle_type(bundle.message_type),
                      ttl=min(m.metadata.ttl for m in bundle.clients.values()),
                      group_id=first.metadata.group_id)
        pushed = list(self.inner.push_messages([out]))
        if not pushed:   # refused by the link: every client's instruction fails
            self._fail(bundle, "the SuperLink did not accept the cohort message")
            return
        bundle.bundle_id = str(pushed[0])
        self._busy[bundle.host] = bundle
        self._by_bundle[bundle.bundle_id] = bundle

    # -- pull: one reply per client ------------------------------------------------------
    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to the clients' instructions ``message_ids`` that have arrived."""
        wanted = [str(m) for m in message_ids]
        pending = {self._owner[m].bundle_id for m in wanted
                   if m in self._owner and m not in self._ready}
        pending.discard(None)
        if pending:
            for reply in self.inner.pull_messages(pending):   # type: ignore[arg-type]
                bundle = self._by_bundle.pop(reply.metadata.reply_to_message_id, None)
                if bundle is not None:
                    self._settle(bundle, reply)
            self._dispatch()
        out = []
        for mid in wanted:
            reply = self._ready.pop(mid, None)
            if reply is not None:
                self._owner.pop(mid, None)
                out.append(reply)
        return out

    def _settle(self, bundle: _Bundle, reply: Message) -> None:
        if self._busy.get(bundle.host) is bundle:
            del self._busy[bundle.host]
        if reply.has_error():
            self._fail(bundle, str(reply.error.reason), int(reply.error.code))
            return
        try:
            parts = unbundle_replies(reply.content)
        except ValueError as exc:
            self._fail(bundle, f"a malformed cohort reply: {exc}")
            return
        for pid, msg in bundle.clients.items():
            part = parts.get(pid)
            if part is None:
                self._ready[msg.metadata.message_id] = Message(
                    Error(ErrorCode.UNKNOWN, "the cohort reply has no reply for this client"),
                    reply_to=msg)
            elif isinstance(part, str):
                self._ready[msg.metadata.message_id] = Message(
                    Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, part), reply_to=msg)
            else:
                self._ready[msg.metadata.message_id] = Message(part, reply_to=msg)

    def _fail(self, bundle: _Bundle, reason: str, code: int = ErrorCode.UNKNOWN) -> None:
        for msg in bundle.clients.values():
            self._ready[msg.metadata.message_id] = Message(Error(code, reason), reply_to=msg)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push, then pull until every reply is in or ``timeout`` seconds passed."""
        ids = set(self.push_messages(messages))
        end = time.time() + (timeout if timeout is not None else 0.0)
        out: list[Message] = []
        while ids and (timeout is None or time.time() < end):
            got = list(self.pull_messages(ids))
            out += got
            ids -= {m.metadata.reply_to_message_id for m in got}
            if ids:
                time.sleep(0.1)
        return out
