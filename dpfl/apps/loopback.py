"""A Grid that delivers messages to in-process clients: the real ClientApp mod chain
(``dpfl.client.secure.secure_aggregation_mod`` -> Flower's ``secaggplus_mod`` -> an app
function) without a network, for measuring and testing dpfl's SecAgg+ server half with
Flower's own client half (``bench/secagg.py``, ``tests/test_trust.py``)."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict

from dpfl.client.secure import secure_aggregation_mod

# (node id, the collect-stage message, its context) -> the app's reply
App = Callable[[Message, Context], Message]


def share_app(share: torch.Tensor, partition_id: int) -> App:
    """An app that answers the training instruction with a fixed integer share."""
    def app(msg: Message, ctxt: Context) -> Message:
        return Message(RecordDict({"arrays": ArrayRecord({"share": share}),
                                   "metrics": MetricRecord({"partition-id": partition_id})}),
                       reply_to=msg)
    return app


class LoopbackGrid:
    """``send_and_receive`` runs each message through its node's mod chain in turn; a
    node whose app raises replies with an error (a dropout), as a SuperNode would."""

    def __init__(self, apps: dict[int, App]) -> None:
        self.apps = apps
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(),
                                    run_config={}) for n in apps}
        self.sent = 0

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None
                         ) -> list[Message]:
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            self.sent += 1
            msg.metadata.__dict__["_message_id"] = f"loopback-{self.sent}"
            msg.metadata.__dict__["_src_node_id"] = 0
            try:
                reply = secure_aggregation_mod(msg, self.contexts[node], self.apps[node])
            except Exception as exc:  # noqa: BLE001 - a failing client is a dropout
                reply = Message(Error(0, f"{type(exc).__name__}: {exc}"), reply_to=msg)
            reply.metadata.__dict__["_src_node_id"] = node
            replies.append(reply)
        return replies
