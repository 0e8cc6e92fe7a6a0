"""The server half of Flower 1.39's SecAgg+ protocol, driven from dpfl's round loop.

Flower's ``SecAggPlusWorkflow`` runs the protocol for the legacy ``Strategy`` API
(``LegacyContext``, ``configure_fit``/``aggregate_fit``) and dequantises the sum in floating
point. dpfl's strategies use the Message API and need the EXACT integer sum (the Skellam
noise of ``dpfl.privacy.mechanisms.skellam`` is only exact in the integers), so this module sends the
same four stages with the same records — the clients run Flower's own, unmodified
``secaggplus_mod`` (``dpfl.client.secure``) — and reconstructs the sum with Flower's own
primitives (Shamir ``combine_shares``, ``generate_shared_key``, ``pseudo_rand_gen``) in
int64 arithmetic modulo 2^32:

0. setup: protocol parameters to the sampled nodes; they answer with two public keys;
1. share keys: each node gets its neighbours' keys and returns encrypted Shamir shares of
   its mask seed and its first secret key;
2. collect masked vectors: each node gets the shares addressed to it and the round's train
   instruction; it trains, quantises and masks its share and returns it (with dpfl's
   ``metrics`` and ``privacy`` records, never the update);
3. unmask: the survivors return shares of every survivor's mask seed and of every dropped
   neighbour's key; the server removes the masks.

Each share coordinate is an integer k in [-c, c], sent by Flower's quantiser as k + c
(``clipping_range`` c, ``target_range`` 2c: one integer per unit, no rounding), so the
survivors' sum of k + c lies in [0, 2 c m] < 2^32 and is recovered exactly; dpfl subtracts
m c. A round whose survivors fall below n_min, or whose masks cannot be removed, releases
nothing (``SecureSum.total`` is None).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, cast

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    generate_shared_key,
)
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    Key,
    Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.serverapp import Grid
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
)

from dpfl.logs import get_logger
from dpfl.server.reply import ParsedReply
from dpfl.server.validation import ClientUpdate

log = get_logger("flwr.dpfl.secagg")
MODULUS = 1 << 32


def masked_reply(reply: ParsedReply) -> ClientUpdate:
    """A stage-2 reply as the guard's charging sees it: who sent it (no update visible)."""
    pid = reply.partition_id
    return ClientUpdate(reply.node_id, pid if pid is not None else -1, torch.empty(0), 1,
                        reply.metrics)


@dataclass
class SecureSum:
    """What one SecAgg+ round gave the server."""

    total: torch.Tensor | None          # int64 sum of the survivors' shares; None: discarded
    survivors: list[int] = field(default_factory=list)      # nodes whose vector is in it
    replies: list[Message] = field(default_factory=list)    # stage-2 replies (no update)
    dropped: list[int] = field(default_factory=list)        # sampled, not in the sum
    reason: str = ""                                        # why discarded
    # nodes whose masked vector arrived but was kept out of the sum, and why (a refused
    # partition claim, a malformed vector): unmasked as dropouts, never summed
    refused: dict[int, str] = field(default_factory=dict)


@dataclass
class _State:
    sampled: list[int]
    active: set[int]
    neighbours: dict[int, set[int]]
    threshold: int
    keyed: set[int] = field(default_factory=set)    # nodes that shared their keys
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    forward: dict[int, tuple[list[int], list[bytes]]] = field(default_factory=dict)


def neighbourhoods(nodes: list[int], num_shares: int, rng: random.Random
                   ) -> dict[int, set[int]]:
    """Flower's SecAgg+ graph: a shuffled ring, each node with the num_shares // 2 nodes on
    either side (itself included)."""
    order = list(nodes)
    rng.shuffle(order)
    half = num_shares >> 1
    n = len(order)
    return {nid: {order[(i + off) % n] for off in range(-half, half + 1)}
            for i, nid in enumerate(order)}


def protocol_sizes(sampled: int, num_shares: int, threshold: float) -> tuple[int, int]:
    """(shares per node, reconstruction threshold) as Flower's workflow computes them: all
    nodes when ``num_shares`` is 0, an odd count otherwise; threshold = max(2, round(t k))."""
    shares = sampled if num_shares <= 0 or num_shares >= sampled else num_shares
    if shares < sampled and shares % 2 == 0:
        shares += 1
    return shares, max(2, round(threshold * shares))


class SecAggPlusServer:
    """Runs one SecAgg+ round over a Grid (see module docstring)."""

    def __init__(self, grid: Grid, limit: int, num_shares: int, threshold: float,
                 min_survivors: int, timeout: float | None,
                 rng: random.Random | None = None) -> None:
        self.grid = grid
        self.limit = int(limit)                 # c: shares lie in [-c, c]
        self.num_shares = num_shares
        self.threshold = threshold
        self.min_survivors = min_survivors
        self.timeout = timeout
        self.rng = rng or random.SystemRandom()

    # -- messaging -------------------------------------------------------------------
    def _send(self, contents: dict[int, RecordDict], group: str) -> list[Message]:
        msgs = [Message(content=c, dst_node_id=nid, message_type=MessageType.TRAIN,
                        group_id=group) for nid, c in contents.items()]
        return list(self.grid.send_and_receive(msgs, timeout=self.timeout))

    @staticmethod
    def _config(values: dict) -> RecordDict:
        return RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(values)})

    def _keep_ok(self, state: _State, replies: list[Message], stage: str) -> list[Message]:
        ok = [m for m in replies if not m.has_error()]
        for m in replies:
            if m.has_error():
                log.warning("SecAgg+ %s: node %d dropped out (%s)", stage, m.metadata.src_node_id,
                            m.error.reason)
        state.active = {m.metadata.src_node_id for m in ok} & state.active
        return ok

    def _enough(self, state: _State) -> bool:
        return all(len(state.neighbours[n] & state.active) >= state.threshold
                   for n in state.sampled)

    def _drop(self, state: _State, node: int, stage: str, why: str) -> None:
        """A node whose reply cannot be used: out of the round from here on (its pairwise
        masks, if it shared keys, are reconstructed like a dropout's)."""
        log.warning("SecAgg+ %s: node %d dropped (%s)", stage, node, why)
        state.active.discard(node)

    # -- the protocol ------------------------------------------------------------------
    def run(self, instructions: dict[int, RecordDict], group: str,
            admit: Callable[[Message], str | None] | None = None) -> SecureSum:
        """The secure sum of the shares the nodes of ``instructions`` compute from them.

        ``admit``: why a stage-2 reply's sender may not be in the sum (e.g. a refused
        partition claim), or None; such a node is unmasked as a dropout and its vector
        never summed, like a vector of another shape than most replies'. A malformed reply
        at any stage drops its node, never the server; an unmasked sum outside the range
        its shares allow (a vector masked with an offset) discards the round."""
        sampled = sorted(instructions)
        if len(sampled) < 2:
            return SecureSum(None, dropped=sampled, reason="fewer than 2 sampled clients")
        shares, threshold = protocol_sizes(len(sampled), self.num_shares, self.threshold)
        state = _State(sampled, set(sampled), neighbourhoods(sampled, shares, self.rng),
                       threshold)
        # stage 0: setup
        setup = {Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: len(sampled),
                 Key.SHARE_NUMBER: shares, Key.THRESHOLD: threshold,
                 Key.CLIPPING_RANGE: float(self.limit), Key.TARGET_RANGE: 2 * self.limit,
                 Key.MOD_RANGE: MODULUS, Key.MAX_WEIGHT: 1.0}
        for m in self._keep_ok(state, self._send({n: self._config(setup) for n in sampled},
                                                 group), "setup"):
            node = m.metadata.src_node_id
            try:
                keys = m.content.config_records[RECORD_KEY_CONFIGS]
                pair = (keys[Key.PUBLIC_KEY_1], keys[Key.PUBLIC_KEY_2])
                for key in pair:
                    bytes_to_public_key(key)          # a usable public key, or drop
                state.public_keys[node] = cast(tuple[bytes, bytes], pair)
            except Exception as exc:  # noqa: BLE001 - any malformed reply drops its node
                self._drop(state, node, "setup", f"malformed keys: {type(exc).__name__}")
        if not self._enough(state):
            return self._discard(state, [], "too few nodes after setup")
        # stage 1: share keys
        contents = {}
        for n in state.active:
            record = {str(o): list(state.public_keys[o])
                      for o in state.neighbours[n] & state.active}
            record[Key.STAGE] = Stage.SHARE_KEYS
            contents[n] = self._config(record)
        state.forward = {n: ([], []) for n in state.active}
        for m in self._keep_ok(state, self._send(contents, group), "share-keys"):
            node = m.metadata.src_node_id
            try:
                res = m.content.config_records[RECORD_KEY_CONFIGS]
                pairs = list(zip(cast(list[int], res[Key.DESTINATION_LIST]),
                                 cast(list[bytes], res[Key.CIPHERTEXT_LIST]), strict=True))
                if not all(isinstance(d, int) and isinstance(c, bytes) for d, c in pairs):
                    raise TypeError("destinations and ciphertexts")
            except Exception as exc:  # noqa: BLE001 - any malformed reply drops its node
                self._drop(state, node, "share-keys", f"malformed shares: {type(exc).__name__}")
                continue
            for dst, ctxt in pairs:
                if dst in state.forward:
                    state.forward[dst][0].append(node)
                    state.forward[dst][1].append(ctxt)
        if not self._enough(state):
            return self._discard(state, [], "too few nodes after key sharing")
        state.keyed = set(state.active)
        # stage 2: train, quantise, mask
        contents = {}
        for n in state.active:
            content = instructions[n]
            srcs, ctxts = state.forward[n]
            content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(
                {Key.STAGE: Stage.COLLECT_MASKED_VECTORS, Key.CIPHERTEXT_LIST: ctxts,
                 Key.SOURCE_LIST: srcs})
            contents[n] = content
        replies = self._keep_ok(state, self._send(contents, group), "masked-vector")
        refused: dict[int, str] = {}
        vectors: dict[int, list[np.ndarray]] = {}
        for m in replies:
            node = m.metadata.src_node_id
            why = admit(m) if admit is not None else None
            if why is None:
                try:
                    vec = [np.asarray(bytes_to_ndarray(b), dtype=np.int64) for b in cast(
                        list[bytes],
                        m.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS])]
                    if len(vec) != 2 or vec[0].size != 1:
                        why = "not a weight factor and a vector"
                    elif any(np.any((a < 0) | (a >= MODULUS)) for a in vec):
                        why = "masked values outside the modulus"
                    else:
                        vectors[node] = vec
                except Exception as exc:  # noqa: BLE001 - any malformed vector
                    why = f"a malformed masked vector ({type(exc).__name__})"
            if why is not None:
                refused[node] = why
        # the share's shape: the one most replies have (honest majority, SecAgg+'s own
        # assumption; ties to the smaller): a lone odd vector cannot set it
        shapes = {n: tuple(a.shape for a in v) for n, v in vectors.items()}
        if shapes:
            counts = Counter(shapes.values())
            want = max(counts, key=lambda k: (counts[k], [-x for s in k for x in s]))
            for node, shape in shapes.items():
                if shape != want:
                    refused[node] = f"a masked vector of shape {shape}, not {want}"
        masked = None
        for node in sorted(refused):
            self._drop(state, node, "masked-vector", f"kept out of the sum: {refused[node]}")
        for node, vec in vectors.items():
            if node in refused:
                continue
            masked = vec if masked is None else [a + b for a, b in zip(masked, vec, strict=True)]
        survivors = sorted(state.active)
        if masked is None or len(survivors) < self.min_survivors:
            return self._discard(state, replies, f"{len(survivors)} survivors < n_min "
                                 f"{self.min_survivors}", refused=refused)
        if not self._enough(state):
            return self._discard(state, replies, "too few nodes to unmask", refused=refused)
        masked = [np.asarray(a, dtype=np.int64) & (MODULUS - 1) for a in masked]
        # stage 3: unmask
        dead = state.keyed - state.active
        contents = {n: self._config({Key.STAGE: Stage.UNMASK,
                                     Key.ACTIVE_NODE_ID_LIST: list(state.neighbours[n] & state.active),
                                     Key.DEAD_NODE_ID_LIST: list(state.neighbours[n] & dead)})
                    for n in state.active}
        in_sum = set(survivors)
        collected: dict[int, list[bytes]] = {n: [] for n in sorted(state.keyed)}
        for m in self._keep_ok(state, self._send(contents, group), "unmask"):
            try:
                res = m.content.config_records[RECORD_KEY_CONFIGS]
                pairs = list(zip(cast(list[int], res[Key.NODE_ID_LIST]),
                                 cast(list[bytes], res[Key.SHARE_LIST]), strict=True))
            except Exception as exc:  # noqa: BLE001 - its shares are not used
                log.warning("SecAgg+ unmask: node %d sent malformed shares (%s); not used",
                            m.metadata.src_node_id, type(exc).__name__)
                continue
            for owner, share in pairs:
                if owner in collected and isinstance(share, bytes):
                    collected[owner].append(share)
        try:
            masked = self._unmask(state, masked, collected, in_sum, threshold)
        except _Unusable as exc:
            return self._discard(state, replies, str(exc), in_sum, refused)
        total = [a & (MODULUS - 1) for a in masked]
        factor, vector = int(total[0].reshape(-1)[0]), total[1]
        expected = (len(survivors) * 2 * self.limit) % MODULUS
        if factor != expected:
            return self._discard(state, replies, f"weight factor {factor} != {expected}",
                                 in_sum, refused)
        shifted = torch.from_numpy(vector.astype(np.int64).reshape(-1))
        # each share lies in [0, 2c] once shifted: a sum outside [0, 2 c n] was not made of
        # honest shares (a vector masked with an offset, garbage unmask shares)
        if shifted.numel() and (int(shifted.min()) < 0
                                or int(shifted.max()) > len(survivors) * 2 * self.limit):
            return self._discard(state, replies, "the unmasked sum lies outside the range "
                                 "its shares allow (a malformed masked vector or unmask "
                                 "share)", in_sum, refused)
        return SecureSum(shifted - len(survivors) * self.limit, survivors, replies,
                         sorted(set(sampled) - in_sum), refused=refused)

    def _unmask(self, state: _State, masked: list[np.ndarray],
                collected: dict[int, list[bytes]], in_sum: set[int],
                threshold: int) -> list[np.ndarray]:
        """Remove every mask: the survivors' private ones and the pairwise ones of nodes
        that shared keys but are not in the sum (:class:`_Unusable` when the shares do not
        reconstruct a usable secret)."""
        shapes = [a.shape for a in masked]
        for nid, shares_of in collected.items():
            if len(shares_of) < threshold:
                raise _Unusable(f"not enough shares to unmask node {nid}")
            try:
                secret = combine_shares(shares_of)
                if nid in in_sum:  # its private mask
                    mask = pseudo_rand_gen(secret, MODULUS, shapes)
                    masked = [a - b for a, b in zip(masked, mask, strict=True)]
                    continue
                # a node that dropped after sharing its keys: its pairwise masks
                private = bytes_to_private_key(secret)
                for other in (state.neighbours[nid] & in_sum) - {nid}:
                    key = generate_shared_key(private,
                                              bytes_to_public_key(state.public_keys[other][0]))
                    mask = pseudo_rand_gen(key, MODULUS, shapes)
                    sign = 1 if nid > other else -1
                    masked = [a + sign * b for a, b in zip(masked, mask, strict=True)]
            except Exception as exc:  # noqa: BLE001 - garbage shares: nothing usable
                raise _Unusable(f"the shares of node {nid} do not reconstruct its secret "
                                f"({type(exc).__name__})") from None
        return masked

    def _discard(self, state: _State, replies: list[Message], reason: str,
                 survivors: set[int] | None = None,
                 refused: dict[int, str] | None = None) -> SecureSum:
        log.warning("SecAgg+ round discarded, nothing released: %s", reason)
        sent = sorted(survivors if survivors is not None else
                      {m.metadata.src_node_id for m in replies} - set(refused or {}))
        return SecureSum(None, sent, replies, sorted(set(state.sampled) - set(sent)), reason,
                         refused=dict(refused or {}))


class _Unusable(Exception):
    """The round's unmask shares cannot remove the masks."""
