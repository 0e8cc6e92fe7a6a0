"""Build real Flower Messages and Contexts outside a running federation (for unit tests)."""

from __future__ import annotations

import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.message.message import make_message
from flwr.app.metadata import Metadata

_counter = [0]


def message(content: RecordDict, src_node_id: int = 1, dst_node_id: int = 0,
            message_type: str = "train") -> Message:
    """A Message as if it had travelled from ``src_node_id`` to ``dst_node_id``."""
    _counter[0] += 1
    meta = Metadata(run_id=1, message_id=f"m{_counter[0]}", src_node_id=src_node_id,
                    dst_node_id=dst_node_id, reply_to_message_id="", group_id="",
                    created_at=time.time(), ttl=3600.0, message_type=message_type)
    return make_message(meta, content)


def context(run_config: dict, partition_id: int, num_partitions: int) -> Context:
    """A node Context with its own (persistent) state RecordDict."""
    return Context(run_id=1, node_id=100 + partition_id,
                   node_config={"partition-id": partition_id, "num-partitions": num_partitions},
                   state=RecordDict(), run_config=dict(run_config))


class FakeGrid:
    """A Grid that only lists its nodes (strategies' node sampling)."""

    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def one_weight_reply(node: int, pid: int, update: list[float]) -> Message:
    """A train reply of a one-tensor model ``weight`` (shape 1 x len(update))."""
    content = {"arrays": ArrayRecord({"weight": torch.tensor([update])}),
               "metrics": MetricRecord({"num-examples": 10, "partition-id": pid})}
    return message(RecordDict(content), src_node_id=node)


def one_weight_arrays(w: list[float]) -> ArrayRecord:
    return ArrayRecord({"weight": torch.tensor([w])})
