"""Flat-vector views of model state: one 1-D float32 tensor in ``state_dict`` key order."""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping

import torch

StateDict = Mapping[str, torch.Tensor]


def flatten(state: StateDict) -> torch.Tensor:
    """Concatenate every tensor of a state dict (key order) into one float32 vector."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in state.values()])


def unflatten(flat: torch.Tensor, template: StateDict) -> "OrderedDict[str, torch.Tensor]":
    """Inverse of :func:`flatten`, shaped and typed like ``template``."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    offset = 0
    for key, ref in template.items():
        n = ref.numel()
        out[key] = flat[offset:offset + n].view(ref.shape).to(ref.dtype).clone()
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} values, template needs {offset}")
    return out


def largest_magnitude_indices(t: torch.Tensor, k: int) -> torch.Tensor:
    """The flat indices of the k largest |t_j|, sorted (one ``torch.topk``; ties broken by
    it)."""
    return torch.topk(t.reshape(-1).abs(), k, sorted=False).indices.sort().values


def state_difference(new: StateDict, old: StateDict) -> "OrderedDict[str, torch.Tensor]":
    """new - old, key by key (the client's update)."""
    return OrderedDict((k, (new[k].detach().float() - old[k].detach().float())) for k in old)
