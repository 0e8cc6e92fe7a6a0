"""The client half of the central and distributed trust models (``dpfl.privacy.trust``).

- :func:`central_release`: clip the update to C (no noise: the trusted server adds it) and
  say whether it was within C (the bit of Andrew et al. 2021's clipped count).
- :func:`distributed_share`: clip, scale by s, round at random and add a Skellam share
  (``dpfl.privacy.mechanisms.skellam``) or a discrete Gaussian one (``dpfl.privacy.mechanisms.ddgauss``): the
  integer vector SecAgg+ masks.
- :func:`secure_aggregation_mod`: a ClientApp mod that hands every SecAgg+ message to
  Flower 1.39's own ``secaggplus_mod`` (key exchange, masking, unmasking: unmodified) and
  everything else straight to the app. Flower's mod reads the app's reply in the legacy
  ``fitres.*`` layout; :func:`_as_fit_result` converts dpfl's reply (the share as the
  parameters, weight 1) and keeps its ``metrics`` and ``privacy`` records, so the server
  can charge the client, while the update itself leaves only masked.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common.recorddict_compat import parameters_to_arrayrecord

from dpfl.privacy.mechanisms import ddgauss, skellam
from dpfl.privacy.mechanisms.release import l2_clip
from dpfl.privacy.trust import UNCLIPPED_KEY

__all__ = ["UNCLIPPED_KEY", "central_release", "distributed_share", "secure_aggregation_mod"]

SHARE_KEY = "arrays"                 # the share travels as dpfl's update record until masked


def central_release(update: torch.Tensor, clip: float) -> tuple[torch.Tensor, float]:
    """(the update clipped to ``clip``, 1.0 if its norm was <= ``clip`` else 0.0)."""
    within = float(torch.linalg.vector_norm(update.double()) <= clip)
    return l2_clip(update, clip), within


def distributed_share(update: torch.Tensor, clip: float, scale: float, share_variance: float,
                      generator: torch.Generator, noise: str = "skellam") -> torch.Tensor:
    """round(s clip_C(update)) + Sk(share_variance) (``noise`` skellam) or
    N_Z(0, >= share_variance) (ddgauss), int64."""
    module = ddgauss if noise == "ddgauss" else skellam
    return module.quantise_with_noise(l2_clip(update.double(), clip), scale, share_variance,
                                      generator)


def _as_fit_result(reply: Message) -> Message:
    """dpfl's train reply in the ``fitres.*`` layout Flower's SecAgg+ mod reads: the share
    (one flat array) as the parameters, weight 1; dpfl's own records kept."""
    content = reply.content
    if reply.has_error() or SHARE_KEY not in content.array_records:
        status = (dict(content["status"]) if "status" in content.config_records
                  else {"reason": "no share"})
        raise RuntimeError(f"no share to mask this round: {status.get('reason', status)}")
    share = np.concatenate([a.numpy().reshape(-1) for a in
                            content.array_records[SHARE_KEY].values()]).astype(np.float64)
    out = RecordDict({
        "fitres.parameters": parameters_to_arrayrecord(ndarrays_to_parameters([share]), True),
        "fitres.num_examples": MetricRecord({"num_examples": 1}),
        "fitres.metrics": ConfigRecord({}),
        "fitres.status": ConfigRecord({"code": 0, "message": ""}),
    })
    for name, record in content.metric_records.items():
        out[name] = record
    for name, record in content.config_records.items():
        out[name] = record
    reply.content = out
    return reply


def secure_aggregation_mod(msg: Message, ctxt: Context, call_next) -> Message:
    """SecAgg+ messages to Flower's ``secaggplus_mod`` (the app's reply converted by
    :func:`_as_fit_result`); any other message straight to the app."""
    if RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, ctxt)

    def app_then_convert(m: Message, c: Context) -> Message:
        return _as_fit_result(call_next(m, c))

    return secaggplus_mod(msg, ctxt, app_then_convert)
