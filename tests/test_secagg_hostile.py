"""dpfl's SecAgg+ server half against hostile replies (issues 46.10 and 51.3).

Real Flower ``secaggplus_mod`` clients in process (``dpfl.apps.loopback``); one node's reply
is tampered with at one stage. Before the fix a malformed setup, share-keys or unmask reply
crashed the server, a wrong-shape or offset masked vector went into the model, and a node
whose partition claim was refused stayed in the sum. Now: the node is dropped (its masks
reconstructed like a dropout's) and the sum is exactly the others' shares, or the round is
discarded; never a crash, never a wrong sum."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from flwr.common import bytes_to_ndarray, ndarray_to_bytes
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from dpfl.apps.loopback import LoopbackGrid, share_app
from dpfl.privacy.trust import share_limit
from dpfl.server.secagg import SecAggPlusServer

NODES = range(1, 6)
HOSTILE = 3


class TamperingGrid(LoopbackGrid):
    """Node ``HOSTILE``'s reply carrying ``key`` goes through ``tamper`` first."""

    def __init__(self, apps, key: str, tamper) -> None:
        super().__init__(apps)
        self.key, self.tamper = key, tamper

    def send_and_receive(self, messages, timeout=None):
        replies = super().send_and_receive(messages, timeout)
        for reply in replies:
            if reply.metadata.src_node_id != HOSTILE or reply.has_error():
                continue
            config = reply.content.config_records.get(RECORD_KEY_CONFIGS)
            if config is not None and self.key in config:
                self.tamper(config)
        return replies


def _shares() -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    limit = share_limit(len(NODES))
    return {n: torch.randint(-limit, limit + 1, (97,), generator=gen, dtype=torch.int64)
            for n in NODES}


def _run(grid, admit=None):
    server = SecAggPlusServer(grid, share_limit(len(NODES)), 0, 0.5, 3, None,
                              random.Random(0))
    return server.run({n: RecordDict({"config": ConfigRecord({"server-round": 1})})
                       for n in NODES}, group="1", admit=admit)


def _others(shares):
    return sum(shares[n] for n in NODES if n != HOSTILE)


def _set(key, value):
    def tamper(config):
        config[key] = value
    return tamper


def _masked(change):
    def tamper(config):
        vec = [bytes_to_ndarray(b) for b in config[Key.MASKED_PARAMETERS]]
        config[Key.MASKED_PARAMETERS] = [ndarray_to_bytes(a) for a in change(vec)]
    return tamper


@pytest.mark.usefixtures("server_identity")
@pytest.mark.parametrize("key,tamper", [
    (Key.PUBLIC_KEY_1, _set(Key.PUBLIC_KEY_1, b"not a key")),
    (Key.PUBLIC_KEY_2, _set(Key.PUBLIC_KEY_2, 7)),
    (Key.DESTINATION_LIST, _set(Key.DESTINATION_LIST, ["x", "y"])),
    (Key.CIPHERTEXT_LIST, _set(Key.CIPHERTEXT_LIST, [b"short"])),
    (Key.MASKED_PARAMETERS, _masked(lambda v: [v[0], v[1][:50]])),        # wrong shape
    (Key.MASKED_PARAMETERS, _masked(lambda v: [v[1]])),                   # one array
    (Key.MASKED_PARAMETERS, _set(Key.MASKED_PARAMETERS, [b"garbage", b"!"])),
], ids=["setup-key", "setup-type", "share-keys-dst", "share-keys-ctxt", "vector-shape",
        "vector-count", "vector-bytes"])
def test_a_malformed_reply_drops_its_node_and_the_sum_is_the_others(key, tamper):
    shares = _shares()
    result = _run(TamperingGrid({n: share_app(s, n) for n, s in shares.items()}, key, tamper))
    assert HOSTILE not in result.survivors and result.total is not None
    assert result.survivors == [n for n in NODES if n != HOSTILE]
    assert torch.equal(result.total, _others(shares))


@pytest.mark.usefixtures("server_identity")
def test_an_offset_masked_vector_discards_the_round_instead_of_the_model():
    """A vector masked with an offset cannot be told from an honest one before unmasking;
    the unmasked sum then leaves the range its n shares allow ([0, 2 c n] once shifted)
    and the round is discarded: nothing released, the model untouched."""
    shares = _shares()
    offset = _masked(lambda v: [v[0], (v[1].astype(np.int64) + (1 << 31)) % (1 << 32)])
    result = _run(TamperingGrid({n: share_app(s, n) for n, s in shares.items()},
                                Key.MASKED_PARAMETERS, offset))
    assert result.total is None and "outside the range" in result.reason


@pytest.mark.usefixtures("server_identity")
def test_garbage_unmask_shares_never_give_a_wrong_sum():
    shares = _shares()
    garbage = _set(Key.SHARE_LIST, [b"\x00garbage-share"] * 4)
    result = _run(TamperingGrid({n: share_app(s, n) for n, s in shares.items()},
                                Key.SHARE_LIST, garbage))
    every = sum(shares[n] for n in NODES)
    assert result.total is None or torch.equal(result.total, every)


@pytest.mark.usefixtures("server_identity")
def test_a_refused_claimant_is_kept_out_of_the_sum():
    """Issue 51.3: a node whose partition claim the server refuses was charged but its
    masked vector stayed in the sum. Now it is unmasked as a dropout and recorded refused."""
    shares = _shares()
    grid = LoopbackGrid({n: share_app(s, n) for n, s in shares.items()})

    def admit(msg):
        return "partition-id 0 already belongs to node 1" if \
            msg.metadata.src_node_id == HOSTILE else None

    result = _run(grid, admit)
    assert result.refused == {HOSTILE: "partition-id 0 already belongs to node 1"}
    assert result.survivors == [n for n in NODES if n != HOSTILE]
    assert torch.equal(result.total, _others(shares))
