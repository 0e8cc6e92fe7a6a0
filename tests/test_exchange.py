"""What the server says about replies: one progress line per reply as it arrives, and every
node named ``client-<partition-id>`` (or ``node <id> (partition unknown)``)."""

from __future__ import annotations

import itertools
import logging

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.error import Error
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid

from dpfl.config import RunConfig
from dpfl.methods import build_strategy
from dpfl.server.exchange import ReplyExchange
from dpfl.server.strategy import RoundRecord
from dpfl.server.validation import array_template, client_label


class ScriptedGrid(Grid):
    """A Grid whose nodes answer from a script: ``script[(round, node)] = (pulls, answer)``,
    the reply appearing after that many pulls (answer: a partition id, ``"refuse"``,
    ``"error"``; a node missing from the script never answers)."""

    def __init__(self, script: dict[tuple[int, int], tuple[int, object]]) -> None:
        self.script = script
        self.ids = itertools.count(1)
        self.pending: dict[str, tuple[int, Message]] = {}   # id -> (pulls left, reply)

    @property
    def run(self):
        return None

    def set_run(self, run) -> None:
        pass

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id)

    def get_node_ids(self):
        return sorted({node for _, node in self.script})

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            mid = f"m{next(self.ids)}"
            msg.metadata.__dict__["_message_id"] = mid  # as Flower's grids do on push
            rnd = int(msg.content["config"]["server-round"])
            if (rnd, msg.metadata.dst_node_id) in self.script:
                pulls, answer = self.script[(rnd, msg.metadata.dst_node_id)]
                self.pending[mid] = (pulls, _answer(msg, answer))
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        out = []
        for mid in message_ids:
            if mid in self.pending:
                pulls, reply = self.pending[mid]
                if pulls <= 1:
                    out.append(self.pending.pop(mid)[1])
                else:
                    self.pending[mid] = (pulls - 1, reply)
        return out

    def send_and_receive(self, messages, *, timeout=None):
        raise NotImplementedError


def _answer(msg: Message, answer: object) -> Message:
    if answer == "unavailable":   # what Flower's SuperLink sends for a node that left
        reply = Message(Error(code=3, reason="Node Unavailable"), reply_to=msg)
        reply.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
        reply.metadata.__dict__["_dst_node_id"] = SUPERLINK_NODE_ID
        return reply
    if answer == "error":
        return Message(Error(code=0, reason="ValueError: boom\nTraceback ..."), reply_to=msg)
    if answer == "refuse":
        return Message(RecordDict({
            "metrics": MetricRecord({"partition-id": 1}),
            "status": ConfigRecord({"status": "refused", "reason": "budget 4.0 exhausted"})}),
            reply_to=msg)
    return Message(RecordDict({"metrics": MetricRecord({"partition-id": int(answer),
                                                         "num-examples": 5})}), reply_to=msg)


def _instructions(rnd: int, nodes: list[int]) -> list[Message]:
    return [Message(content=RecordDict({"config": ConfigRecord({"server-round": rnd})}),
                    message_type="train", dst_node_id=n) for n in nodes]


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flwr.dpfl.exchange"]


def test_one_progress_line_per_reply_named_by_client(caplog, server_identity):
    script = {(1, 11): (1, 0), (1, 12): (2, "refuse"), (1, 13): (3, "error"),   # 14: silent
              (2, 11): (1, "error"), (2, 12): (2, 1), (2, 13): (3, 2)}
    exchange = ReplyExchange(ScriptedGrid(script), poll_seconds=0.01)
    caplog.set_level(logging.INFO, logger="flwr.dpfl.exchange")
    replies, late = exchange.send_and_receive(_instructions(1, [11, 12, 13, 14]), 1, 0.3)
    assert len(replies) == 3 and late == []
    assert _lines(caplog) == [
        "round 1: client-0 replied (1/4, 0 s)",
        "round 1: client-1 refused (2/4, 0 s)",
        "round 1: node 13 (partition unknown) error (3/4, 0 s): ValueError: boom",
        "round 1: no reply within 0 s from node 14 (partition unknown) (charged if it "
        "arrives later)",
    ]
    caplog.clear()
    replies, _ = exchange.send_and_receive(_instructions(2, [11, 12, 13]), 2, 5.0)
    assert len(replies) == 3
    assert _lines(caplog) == [  # node 11's error is named by its earlier claim
        "round 2: client-0 error (1/3, 0 s): ValueError: boom",
        "round 2: client-1 replied (2/3, 0 s)",
        "round 2: client-2 replied (3/3, 0 s)",
    ]


def test_the_superlinks_error_for_a_departed_node_is_named_by_that_node(caplog,
                                                                       server_identity):
    """Flower's SuperLink answers an instruction to a node that left with its own id (1) as
    the sender: the line and the reply name the node the instruction was for."""
    script = {(1, 11): (1, 0), (2, 11): (1, "unavailable"), (2, 12): (1, 1)}
    exchange = ReplyExchange(ScriptedGrid(script), poll_seconds=0.01)
    caplog.set_level(logging.INFO, logger="flwr.dpfl.exchange")
    exchange.send_and_receive(_instructions(1, [11]), 1, 5.0)
    caplog.clear()
    replies, _ = exchange.send_and_receive(_instructions(2, [11, 12]), 2, 5.0)
    assert sorted(r.metadata.src_node_id for r in replies) == [11, 12]
    errors = [line for line in _lines(caplog) if " error " in line]
    assert [e.split(" (")[0] for e in errors] == ["round 2: client-0 error"]
    assert errors[0].endswith("s): Node Unavailable")


def test_client_label():
    assert client_label(98, 3) == "client-3"
    assert client_label(98, None) == "node 98 (partition unknown)"
    assert client_label(98, -1) == "node 98 (partition unknown)"


def _update(node: int, pid: int) -> Message:
    content = RecordDict({"arrays": ArrayRecord({"w": torch.ones(2)}),
                          "metrics": MetricRecord({"num-examples": 5, "partition-id": pid})})
    return Message(content, reply_to=_instructions(1, [node])[0])


def _error(node: int) -> Message:
    return Message(Error(code=0, reason="boom"), reply_to=_instructions(1, [node])[0])


def test_a_dropped_reply_names_the_client_the_node_is_known_as(caplog, server_identity):
    strategy = build_strategy(RunConfig(dataset="digits", model="mlp", strategy="fedavg",
                                        trainer="plain"))
    strategy._global = ArrayRecord({"w": torch.zeros(2)})
    strategy._template = array_template(strategy._global)
    caplog.set_level(logging.INFO, logger="flwr.dpfl.strategy")
    strategy.finish_round(1, RoundRecord(1), [_update(7, 3), _error(8)])
    strategy.finish_round(2, RoundRecord(2), [_error(7)])
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert dropped == ["round 1: error from node 8 (partition unknown) dropped: client error: boom",
                       "round 2: error from client-3 dropped: client error: boom"]


def test_an_unknown_sender_is_named_by_node_and_ledger_key(caplog, server_identity):
    from dpfl.privacy.accounting.ledger import Ledger

    strategy = build_strategy(RunConfig(dataset="digits", model="mlp"), {0: 100},
                              ledger=Ledger(1e-5, "rdp"))
    strategy._global = ArrayRecord({"w": torch.zeros(2)})
    strategy._template = array_template(strategy._global)
    caplog.set_level(logging.INFO, logger="flwr.dpfl.guard")
    strategy.finish_round(1, RoundRecord(1), [_update(5, 9)])
    [line] = [r.getMessage() for r in caplog.records if r.name == "flwr.dpfl.guard"]
    assert line.startswith("round 1: node 5 (partition unknown) charged [")
    assert "(ledger key node-5): " in line and "unknown partition-id 9" in line
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1
    assert dropped[0].startswith("round 1: invalid from node 5 (partition unknown) dropped: "
                                 "unknown partition-id 9")


def test_a_long_error_reason_is_cut_to_its_first_line(server_identity):
    from dpfl.server.exchange import REASON_CHARS, reply_outcome

    instruction = _instructions(1, [3])[0]
    long = Message(Error(code=0, reason="x" * 300 + "\nsecond line"), reply_to=instruction)
    kind, reason = reply_outcome(long)
    assert kind == "error" and len(reason) == REASON_CHARS and reason.endswith("…")
    assert reply_outcome(Message(Error(code=0, reason="short\nmore"), reply_to=instruction)) == (
        "error", "short")
