"""Send a round's instructions and collect the replies, including late ones.

Flower's ``Grid.send_and_receive`` returns what arrived before the timeout and forgets the
rest (and polls every 3 s). An update that arrives after its round closed was still
released to the server, so it must be charged: :class:`ReplyExchange` keeps the ids of
unanswered instructions and pulls them again with every later round (and once more at the
end of the run), handing late replies back with the round they answer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid


class ReplyExchange:
    """Push/pull over a Grid that remembers unanswered instructions across rounds."""

    def __init__(self, grid: Grid, poll_seconds: float = 0.25) -> None:
        self.grid = grid
        self.poll_seconds = poll_seconds
        self.outstanding: dict[str, int] = {}   # instruction id -> round it was sent in
        self.busy: dict[str, int] = {}          # instruction id -> destination node

    def busy_nodes(self) -> set[int]:
        """Nodes that still hold an unanswered instruction."""
        return set(self.busy.values())

    def _settle(self, msg: Message) -> int | None:
        mid = msg.metadata.reply_to_message_id
        self.busy.pop(mid, None)
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
                         timeout: float) -> tuple[list[Message], list[tuple[int, Message]]]:
        """(this round's replies, [(round, late reply), ...]) within ``timeout`` seconds.

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
        deadline = time.monotonic() + timeout
        while True:
            for sent, msg in self._collect():
                if sent == server_round:
                    replies.append(msg)
                else:
                    late.append((sent, msg))
            if not current & set(self.outstanding) or time.monotonic() >= deadline:
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
