"""Server-side checks of client train replies: a bad reply is dropped with a logged reason.

Checks: an error or refusal; the records present; the round the reply says it answers
(``server-round``) is the round of the instruction it replies to; the update's keys, shapes
and dtypes equal the global model's; every value finite; ``num-examples`` a positive
integer; the update's L2 norm under the bound the mechanism promises (when it promises one).

A reply is bound to its instruction by Flower: the SuperLink stores a reply only for an
instruction that exists, is addressed to the sending node and has no reply yet, and the
server reads each reply by the id of the instruction it sent (``ReplyExchange`` knows that
instruction's round). The ``server-round`` check refuses a reply whose content answers
another round (an old reply's content pushed again); the DP guard refuses an update whose
bytes repeat one the client sent before (``DPGuard.replayed``).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message
from flwr.common.constant import SType

from dpfl.numbers import is_finite_number, is_number
from dpfl.privacy.accounting.ledger import client_key
from dpfl.server.reply import ParsedReply


@dataclass
class ClientUpdate:
    """A validated reply: the flat update and what the client reported."""

    node_id: int
    partition_id: int
    flat: torch.Tensor
    num_examples: int
    metrics: dict[str, Any]
    privacy: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    norm: float = math.nan    # ||flat||_2, computed once at validation


@dataclass
class Rejection:
    """A reply that was not aggregated, and why."""

    node_id: int
    partition_id: int | None
    kind: str            # "error" | "refused" | "invalid"
    reason: str
    metrics: dict[str, Any] = field(default_factory=dict)


Template = list[tuple[str, tuple[int, ...], np.dtype]]
# Metrics every train reply may carry in a private run: each is public (the partition id,
# the round, delta, the public partition size, the size of the node's own state record)
# or a function of the public plan the server sent (epsilon, sigma, rate, steps). Anything
# else a client sends must be a method's released value (covered by a charged release, or
# named by the verdict as sent in the clear): ``DPFLStrategy.reply_metric_keys``.
PUBLIC_REPLY_METRICS = frozenset({
    "partition-id", "server-round", "delta", "num-examples", "epsilon", "noise-multiplier",
    "sample-rate", "steps", "node-state-bytes",
})
# the train loss, sent only with report-train-loss=true (the verdict is then none)
TRAIN_LOSS_METRIC = "train-loss"
# No client holds more samples than this; a larger claim would let one reply dominate the
# sample-weighted mean.
MAX_NUM_EXAMPLES = 10 ** 9
# The largest mean training loss (cross-entropy) the server takes from a reply: 1e4 puts
# probability e^-10000 on the true class, which only a diverged model reports. A loss that
# weighs an aggregate (DP-FedASGP's eq. 16) must lie in [0, MAX_REPORTED_LOSS]; the round's
# ``train-loss`` metric averages only such values.
MAX_REPORTED_LOSS = 1e4


def array_template(arrays: ArrayRecord) -> Template:
    """(key, shape, dtype) of every array of the global model, in order."""
    return [(k, tuple(a.shape), np.dtype(a.dtype)) for k, a in arrays.items()]


def client_label(node_id: int, partition_id: int | None) -> str:
    """How server messages name a node: ``client-<partition-id>`` (the privacy ledger's
    key) when the partition is known, else ``node <id> (partition unknown)``."""
    if partition_id is None or partition_id < 0:
        return f"node {node_id} (partition unknown)"
    return client_key(partition_id)


def validate_train_reply(reply: ParsedReply, template: Template,
                         norm_bound: float | None = None,
                         extra_arrays: dict[str, Template] | None = None,
                         server_round: int | None = None,
                         arrivals: ArrivalDecoder | None = None) -> ClientUpdate | Rejection:
    """Turn one train reply (read once: :func:`dpfl.server.reply.parse_reply`) into a
    :class:`ClientUpdate`, or a :class:`Rejection`.

    ``server_round``: the round of the instruction the reply answers; a reply whose
    ``server-round`` metric names another round is rejected (a reply without one is left
    to the other checks). ``arrivals``: updates already decoded as their replies arrived
    (the same decoding, done earlier)."""
    node, metrics, pid = reply.node_id, reply.metrics, reply.partition_id
    if reply.error is not None or reply.content is None:
        return Rejection(node, None, "error", f"client error: {reply.error}")
    content = reply.content
    if reply.refused is not None:
        return Rejection(node, pid, "refused", reply.refused, metrics)
    if "arrays" not in content.array_records:
        return Rejection(node, pid, "invalid", "reply has no 'arrays' record", metrics)
    answered = metrics.get("server-round")
    if server_round is not None and answered is not None and (
            not is_number(answered) or answered != server_round):
        return Rejection(node, pid, "invalid", f"reply answers round {answered!r}, but the "
                         f"instruction it replies to is of round {server_round} (a replayed "
                         "reply)", metrics)
    if not metrics:
        return Rejection(node, pid, "invalid", "reply has no 'metrics' record", metrics)
    n = metrics.get("num-examples")
    if (not is_finite_number(n) or n != int(n) or not 0 < n <= MAX_NUM_EXAMPLES):
        return Rejection(node, pid, "invalid", f"num-examples must be an integer in "
                         f"[1, {MAX_NUM_EXAMPLES:.0e}], got {n!r}", metrics)
    eps = metrics.get("epsilon")
    if eps is not None and (not is_number(eps) or math.isnan(eps) or eps < 0):
        return Rejection(node, pid, "invalid", f"epsilon must be a number >= 0, got {eps!r}",
                         metrics)
    privacy_problem = _privacy_record_problem(reply)
    if privacy_problem:
        return Rejection(node, pid, "invalid", privacy_problem, metrics)
    decode = arrivals.flat_checked if arrivals is not None else _flat_checked
    flat = decode(content["arrays"], template, "update")
    if isinstance(flat, str):
        return Rejection(node, pid, "invalid", flat, metrics)
    norm = float(torch.linalg.vector_norm(flat))   # one pass; kept for the methods
    if norm_bound is not None and math.isfinite(norm_bound):
        if norm > norm_bound:
            return Rejection(node, pid, "invalid", f"update norm {norm:.4g} exceeds the "
                             f"mechanism's bound {norm_bound:.4g}", metrics)
    extras: dict[str, torch.Tensor] = {}
    for name, extra_template in (extra_arrays or {}).items():
        if name not in content.array_records:
            return Rejection(node, pid, "invalid", f"reply has no '{name}' record", metrics)
        checked = _flat_checked(content[name], extra_template, name)
        if isinstance(checked, str):
            return Rejection(node, pid, "invalid", checked, metrics)
        extras[name] = checked
    return ClientUpdate(node, pid if pid is not None else -1, flat, int(n), metrics,
                        dict(reply.privacy or {}), extras, norm)


def _privacy_record_problem(reply: ParsedReply) -> str | None:
    """Why the reply's ``privacy`` record cannot be charged to the ledger (None if fine).

    No record and mechanism ``none`` are fine here: whether a private run needs one is
    the charging rule's decision (:func:`dpfl.privacy.charging.charge_for`)."""
    if reply.privacy is None or reply.privacy.get("mechanism") == "none":
        return None
    return reply.reported[1]


@lru_cache(maxsize=256)
def npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The bytes ``np.save`` writes before the data of a C-ordered array of this shape and
    dtype (Flower's Array serialisation)."""
    buf = io.BytesIO()
    np.save(buf, np.zeros(shape, dtype=dtype), allow_pickle=False)
    return buf.getvalue()[:-int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                          or None]


def array_values(arr: Array, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``arr.numpy()`` without parsing its header when it is byte for byte the header of
    ``shape`` and ``dtype`` and the data is exactly that long (a writable copy, as
    ``np.load`` gives); any other Array goes through ``np.load`` (Flower's
    ``Array.numpy``)."""
    header = npy_header(shape, dtype)
    data = arr.data
    if (arr.stype == SType.NUMPY and data[:len(header)] == header
            and len(data) == len(header) + int(np.prod(shape, dtype=np.int64))
            * np.dtype(dtype).itemsize):
        return np.frombuffer(data, dtype=dtype, offset=len(header)).reshape(shape).copy()
    return arr.numpy()


class ArrivalDecoder:
    """Each reply's update decoded and checked finite as the reply arrives, while the round
    still waits for slower nodes (at 1,000 clients a round's 100 updates took ~40 ms of the
    server's time after the last reply): validation then takes the result instead of
    decoding again. An entry is served only for the very ArrayRecord object it was made
    from (held here) and the same template; anything else is decoded afresh, and every
    other check of :func:`validate_train_reply` runs as before."""

    def __init__(self) -> None:
        self._decoded: dict[int, tuple[ArrayRecord, Template, torch.Tensor | str]] = {}

    def arrived(self, msg: Message, template: Template) -> None:
        """Decode ``msg``'s update now (nothing for an error, or a reply without arrays;
        a reply that cannot be read is left to validation)."""
        try:
            if msg.has_error() or "arrays" not in msg.content.array_records:
                return
            arrays = msg.content["arrays"]
        except Exception:  # noqa: BLE001 - validation reads it again and says why
            return
        self._decoded[id(arrays)] = (arrays, template,
                                     _flat_checked(arrays, template, "update"))

    def flat_checked(self, arrays: ArrayRecord, template: Template,
                     what: str) -> torch.Tensor | str:
        """:func:`_flat_checked`, from the arrival's decoding when it was of this record."""
        entry = self._decoded.pop(id(arrays), None)
        if entry is not None and entry[0] is arrays and entry[1] == template:
            return entry[2]
        return _flat_checked(arrays, template, what)

    def clear(self) -> None:
        self._decoded.clear()


def _flat_checked(arrays: ArrayRecord, template: Template, what: str) -> torch.Tensor | str:
    """The arrays as one float32 vector in template order, or the reason they are bad."""
    expected = [k for k, _, _ in template]
    if list(arrays.keys()) != expected:
        missing = sorted(set(expected) - set(arrays.keys()))
        extra = sorted(set(arrays.keys()) - set(expected))
        return (f"{what}: array keys differ from the global model (missing {missing[:3]}, "
                f"unexpected {extra[:3]})")
    parts = []
    for key, shape, dtype in template:
        arr = arrays[key]
        if tuple(arr.shape) != shape:
            return f"{what}: '{key}' has shape {tuple(arr.shape)}, expected {shape}"
        if np.dtype(arr.dtype) != dtype:
            return f"{what}: '{key}' has dtype {arr.dtype}, expected {dtype}"
        try:
            values = array_values(arr, shape, dtype)
        except Exception as exc:  # malformed bytes
            return f"{what}: '{key}' cannot be decoded: {exc}"
        parts.append(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(-1))
    flat = torch.cat(parts) if parts else torch.empty(0)
    if not bool(torch.isfinite(flat).all()):
        bad = int((~torch.isfinite(flat)).sum())
        return f"{what} has {bad} non-finite values"
    return flat
