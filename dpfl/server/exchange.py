"""Send a round's instructions and collect the replies, including late ones.

Flower's ``Grid.send_and_receive`` returns what arrived before the timeout and forgets the
rest (and polls every 3 s). An update that arrives after its round closed was still
released to the server, so it must be charged: :class:`ReplyExchange` keeps the ids of
unanswered instructions and pulls them again with every later round (and once more at the
end of the run), handing late replies back with the round they answer.

While a round waits, each reply is logged as it arrives (``round 2: client-3 replied (2/4,
31 s)``, ``refused``, ``error`` with its reason), and the nodes that did not answer in time
are named when the round closes.

A node that leaves the federation while the round waits (its key unregistered by the
operator, or offline past Flower's heartbeat window) is no longer waited for: every
``membership_seconds`` the connected nodes are read again, and once every node still owing a
reply of this round is gone, the round closes at once (the instructions stay outstanding: a
reply that still arrives is charged).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from flwr.app import Message
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid

from dpfl.logs import get_logger
from dpfl.privacy.accounting.ledger import CLIENT_PREFIX
from dpfl.server.reply import claimed_partition
from dpfl.server.validation import client_label

log = get_logger("flwr.dpfl.exchange")
REASON_CHARS = 100  # a progress line shows this much of an error's reason


def reply_outcome(msg: Message) -> tuple[str, str]:
    """(``replied`` | ``refused`` | ``error``, an error's first line, shortened). A refusal's
    reason is left to the round's drop line; an error's is shown at once, since the round
    may wait long for the others."""
    if msg.has_error():
        first = (str(msg.error.reason).strip().splitlines() or [""])[0]
        return "error", first if len(first) <= REASON_CHARS else first[:REASON_CHARS - 1] + "…"
    if ("status" in msg.content.config_records
            and msg.content["status"].get("status") == "refused"):
        return "refused", ""
    return "replied", ""


class ReplyExchange:
    """Push/pull over a Grid that remembers unanswered instructions across rounds, and
    logs one progress line per reply of the current round as it arrives."""

    def __init__(self, grid: Grid, poll_seconds: float = 0.25,
                 namer: Callable[[int], str] | None = None,
                 membership_seconds: float = 5.0) -> None:
        self.grid = grid
        self.membership_seconds = membership_seconds
        self.namer = namer                      # the strategy's naming (guard pins), if any
        self.poll_seconds = poll_seconds
        self.outstanding: dict[str, int] = {}   # instruction id -> round it was sent in
        self.busy: dict[str, int] = {}          # instruction id -> destination node
        self.partitions: dict[int, int] = {}    # node id -> first partition id it claimed

    def busy_nodes(self) -> set[int]:
        """Nodes that still hold an unanswered instruction."""
        return set(self.busy.values())

    def client_name(self, node_id: int) -> str:
        """``client-<partition-id>`` once the node has claimed one, else ``node <id>
        (partition unknown)`` (the first claim sticks, as the DP guard pins it); the
        strategy's name first when it knows the node (e.g. pins restored by a resume)."""
        if self.namer is not None:
            name = self.namer(node_id)
            if name.startswith(CLIENT_PREFIX):
                return name
        return client_label(node_id, self.partitions.get(node_id))

    def _learn(self, msg: Message) -> None:
        claimed = claimed_partition(msg)
        if claimed is not None and claimed >= 0:
            self.partitions.setdefault(int(msg.metadata.src_node_id), claimed)

    def _progress(self, server_round: int, msg: Message, count: int, total: int,
                  seconds: float) -> None:
        """``round 2: client-3 replied (2/4, 31 s)`` (``refused``; ``error`` with its reason)."""
        self._learn(msg)
        kind, reason = reply_outcome(msg)
        log.log(logging.WARNING if kind == "error" else logging.INFO,
                "round %d: %s %s (%d/%d, %.0f s)%s", server_round,
                self.client_name(int(msg.metadata.src_node_id)), kind, count, total, seconds,
                f": {reason}" if reason else "")

    def _report_missing(self, server_round: int, current: set[str], timeout: float) -> None:
        missing = sorted(self.busy[mid] for mid in current & set(self.outstanding))
        if missing:
            log.warning("round %d: no reply within %.0f s from %s (charged if it arrives "
                        "later)", server_round, timeout,
                        ", ".join(self.client_name(n) for n in missing))

    def _settle(self, msg: Message) -> int | None:
        mid = msg.metadata.reply_to_message_id
        destination = self.busy.pop(mid, None)
        if (destination is not None and msg.has_error()
                and msg.metadata.src_node_id == SUPERLINK_NODE_ID):
            # The SuperLink answers for a node that left ("Node Unavailable") with itself as
            # the sender: the error is the destination's, so name it by that node.
            msg.metadata.__dict__["_src_node_id"] = destination
        return self.outstanding.pop(mid, None)

    def _collect(self) -> list[tuple[int, Message]]:
        """Pull every outstanding instruction's reply that has arrived, with its round."""
        if not self.outstanding:
            return []
        out = []
        for msg in self.grid.pull_messages(set(self.outstanding)):
            sent = self._settle(msg)
            if sent is not None:
                out.append((sent, msg))
        return out

    def send_and_receive(self, messages: Iterable[Message], server_round: int,
                         timeout: float, on_reply: Callable[[Message], None] | None = None
                         ) -> tuple[list[Message], list[tuple[int, Message]]]:
        """(this round's replies, [(round, late reply), ...]) within ``timeout`` seconds;
        ``on_reply(msg)`` is called with each of this round's replies as it arrives (the
        strategy's early decoding).

        A node still busy with an earlier instruction must not get a second one: two
        concurrent trainings of one node both start from the same privacy history in its
        state, and one charge is lost. The caller drops those messages first
        (:meth:`busy_nodes`)."""
        messages = list(messages)
        busy = self.busy_nodes()
        if any(m.metadata.dst_node_id in busy for m in messages):
            raise ValueError("a message is addressed to a node that is still busy")
        ids = list(self.grid.push_messages(messages))  # in message order (None = not pushed)
        current = set()
        for msg, mid in zip(messages, ids):
            if mid:
                current.add(str(mid))
                self.outstanding[str(mid)] = server_round
                self.busy[str(mid)] = int(msg.metadata.dst_node_id)
        replies: list[Message] = []
        late: list[tuple[int, Message]] = []
        start = time.monotonic()
        deadline = start + timeout
        next_check = start + self.membership_seconds
        gone: set[int] = set()
        while True:
            for sent, msg in self._collect():
                if sent == server_round:
                    replies.append(msg)
                    self._progress(server_round, msg, len(replies), len(current),
                                   time.monotonic() - start)
                    if on_reply is not None:
                        on_reply(msg)
                else:
                    self._learn(msg)
                    late.append((sent, msg))
            if not current & set(self.outstanding):
                return replies, late
            if time.monotonic() >= deadline:
                self._report_missing(server_round, current, timeout)
                return replies, late
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.membership_seconds
                owing = {self.busy[m] for m in current & set(self.outstanding)}
                left = owing - set(self.grid.get_node_ids()) - gone
                if left:
                    gone |= left
                    log.warning("round %d: %s left the federation (unregistered or offline): "
                                "not waiting for its reply (charged if it arrives later)",
                                server_round, ", ".join(self.client_name(n) for n in sorted(left)))
                if owing and owing <= gone:
                    return replies, late
            time.sleep(self.poll_seconds)

    def drain(self, wait: float = 0.0) -> list[tuple[int, Message]]:
        """Late replies that arrive within ``wait`` seconds (e.g. at the end of the run)."""
        late: list[tuple[int, Message]] = []
        deadline = time.monotonic() + wait
        while self.outstanding:
            late += self._collect()
            if time.monotonic() >= deadline:
                break
            time.sleep(self.poll_seconds)
        return late
