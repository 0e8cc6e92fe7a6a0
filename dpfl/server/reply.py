"""A client's train reply, read once.

A reply reaches the server as a Flower ``Message``. The server reads it once, here, into
a :class:`ParsedReply`: who sent it, the Flower error or the client's refusal, the metrics,
the partition the client claims, its privacy record with the events it reports (parsed
once: :func:`dpfl.privacy.charging.reported_events`), and whether it released anything to
the server (an update, or a SecAgg+ masked vector). Validation
(:func:`dpfl.server.validation.validate_train_reply`) and the DP guard's charge
(:meth:`dpfl.server.guard.DPGuard.charge_reply`) both consume that object; neither reads
the raw message again. A node that answers for several clients would give one
``ParsedReply`` per client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from dpfl.numbers import is_finite_number, is_number
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.charging import reported_events


def _partition_id(metrics: dict[str, Any]) -> int | None:
    value = metrics.get("partition-id")
    return int(value) if is_finite_number(value) else None


def claimed_partition(msg: Message) -> int | None:
    """The partition id a reply claims in its metrics (None: an error or no claim)."""
    if msg.has_error() or "metrics" not in msg.content.metric_records:
        return None
    return _partition_id(dict(msg.content["metrics"]))


def carries_masked_vector(msg: Message) -> bool:
    """A SecAgg+ stage-2 reply: the client's masked share (a release, once unmasked)."""
    return (not msg.has_error() and RECORD_KEY_CONFIGS in msg.content.config_records
            and Key.MASKED_PARAMETERS in msg.content.config_records[RECORD_KEY_CONFIGS])


@dataclass(frozen=True)
class ParsedReply:
    """One train reply's records (see the module docstring). ``content`` is the reply's
    RecordDict (its arrays are decoded only by validation); None for a Flower error."""

    node_id: int
    error: str | None = None                      # Flower's error reason
    metrics: dict[str, Any] = field(default_factory=dict)
    partition_id: int | None = None               # the partition the client claims
    refused: str | None = None                    # the client's reason, when it refused
    privacy: dict[str, Any] | None = None         # the privacy record (None: absent)
    # reported_events(privacy): (events, None), or (None, why they cannot be charged)
    reported: tuple[list[PrivacyEvent] | None, str | None] = (None, "reply has no privacy "
                                                              "record")
    released: bool = False       # an update or a masked vector reached the server
    content: RecordDict | None = None

    @property
    def reported_epsilon(self) -> float | None:
        """The epsilon the client says it has spent (None: no number)."""
        value = self.metrics.get("epsilon")
        return float(value) if is_number(value) else None


def parse_reply(msg: Message) -> ParsedReply:
    """Read ``msg`` once into a :class:`ParsedReply`."""
    node = int(msg.metadata.src_node_id)
    if msg.has_error():
        return ParsedReply(node, error=str(msg.error.reason))
    content = msg.content
    metrics = dict(content["metrics"]) if "metrics" in content.metric_records else {}
    refused = None
    if "status" in content.config_records and content["status"].get("status") == "refused":
        refused = str(content["status"].get("reason", ""))
    privacy = dict(content["privacy"]) if "privacy" in content.config_records else None
    return ParsedReply(
        node, None, metrics, _partition_id(metrics), refused, privacy,
        reported_events(privacy),
        "arrays" in content.array_records or carries_masked_vector(msg), content)
