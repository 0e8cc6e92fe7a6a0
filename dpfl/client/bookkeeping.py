"""Book-keeping (BK) per-sample clipping: DP-SGD's per-sample gradient norms and clipped sum
from ONE backward pass (Bu, Wang, Zha & Karypis, "Differentially Private Optimization on
Large Model at Small Cost", ICML 2023).

For a layer with input a_i and output s_i = W a_i (+ b) on sample i, the loss' gradient is
dL_i/dW = g_i^T a_i with g_i = dL/ds_i (the output gradient; samples are independent, so
g_i of the summed loss is sample i's own). BK stores a_i (forward) and g_i (one backward
that asks autograd for the output gradients only: no parameter gradient is formed), then

    (1) ||dL_i/dW||^2 = ||a_i||^2 ||g_i||^2           (Linear on one vector per sample)
    (2)               = sum_{t,s} (a_it . a_is)(g_it . g_is)   (ghost norm: T positions)
    (3)               = ||g_i^T a_i||_F^2              (per-sample gradient instantiated)
    (4) C_i = min(1, R / (||dL_i/dtheta|| + 1e-6)),  ||.||^2 summed over all layers
    (5) sum_i C_i dL_i/dW = (C . g)^T a               (BK: the clipped sum, no 2nd backward)

(1)-(2) are the ghost norm (Goodfellow 2015; Li, Tramer, Liang & Hashimoto 2022), (3) the
per-sample instantiation, chosen layer by layer by memory as in Bu et al.'s mixed ghost norm;
(5) is the book-keeping step that replaces the second backward pass of ghost clipping
(Opacus' ``ghost`` mode) by one matrix product per layer; (4) is Opacus' clip factor.
Convolutions unfold their input (a_i: T x D with T output positions, D = C_in k_h k_w) and
use (3) when the B x C_out x D per-sample gradients fit ``INSTANTIATE_MAX`` floats (the
same flops as the weight gradient of a plain backward), else (2). GroupNorm's per-sample
gradients are B x C and always instantiated. Any other layer with trainable parameters is
refused by name.

Noise and accounting are not here: the trainer keeps Opacus' optimizer (it adds N(0,
sigma^2 R^2) to the clipped sum and divides by the expected batch size), Poisson loader and
accountant, exactly as in Opacus' ``ghost`` mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = (nn.Linear, nn.Conv2d, nn.GroupNorm)
INSTANTIATE_MAX = 1 << 24  # floats of per-sample conv gradients (64 MiB) before ghost norms
CLIP_EPS = 1e-6            # Opacus' clip factor R / (norm + 1e-6)


class UnsupportedLayer(ValueError):
    """A layer with trainable parameters that book-keeping clipping cannot handle."""


def check_model(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's trainable layers, all of a supported type, or :class:`UnsupportedLayer`
    naming the first one that is not (or a Conv2d with groups, non-zero padding mode or
    string padding)."""
    layers = []
    for name, module in model.named_modules():
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        label = f"layer {name!r} ({type(module).__name__})"
        if not all(p.requires_grad for p in module.parameters(recurse=False)):
            raise UnsupportedLayer(f"opacus-mode=bk: {label} is partly frozen; freeze all "
                                   "of its parameters or none")
        if type(module) not in SUPPORTED:
            raise UnsupportedLayer(
                f"opacus-mode=bk: {label} is not supported (book-keeping clipping handles "
                f"{', '.join(t.__name__ for t in SUPPORTED)}); use opacus-mode=ghost or hooks")
        if isinstance(module, nn.Conv2d) and (module.groups != 1 or isinstance(
                module.padding, str) or module.padding_mode != "zeros"):
            raise UnsupportedLayer(f"opacus-mode=bk: {label} has groups, string padding or "
                                   "a non-zero padding mode; use opacus-mode=ghost or hooks")
        layers.append((name, module))
    return layers


def conv_unfold(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """The conv's input as B x D x T patches (D = C_in k_h k_w, T output positions), equal
    to ``F.unfold`` but built as a strided view and one copy (F.unfold's im2col measured
    20-100x slower on CPU here, the bulk of a step)."""
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = (conv.kernel_size, conv.stride, conv.dilation,
                                              conv.padding)
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    p = x.unfold(2, (kh - 1) * dh + 1, sh).unfold(3, (kw - 1) * dw + 1, sw)
    p = p[..., ::dh, ::dw]                                  # B x C x oh x ow x kh x kw
    b, c, oh, ow = p.shape[:4]
    return p.permute(0, 1, 4, 5, 2, 3).reshape(b, c * kh * kw, oh * ow)


def _sq_norms(t: torch.Tensor) -> torch.Tensor:
    """Per-sample squared L2 norms of a B x ... tensor (one fused reduction)."""
    return torch.linalg.vector_norm(t.flatten(1), dim=1).square()


def linear_norms_sq(a: torch.Tensor, g: torch.Tensor, bias: bool) -> torch.Tensor:
    """Per-sample ||dL_i/dW||^2 (+ ||dL_i/db||^2) of a Linear on B x d_in inputs a and B x
    d_out output gradients g: ||a_i||^2 ||g_i||^2 (1); inputs with extra middle
    dimensions are flattened to B x T x d and use the ghost norm (2)."""
    if a.ndim == 2:
        g2 = _sq_norms(g)
        out = _sq_norms(a) * g2
        return out + g2 if bias else out
    a, g = a.flatten(1, -2), g.flatten(1, -2)
    out = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
    return out + g.sum(1).pow(2).sum(1) if bias else out


def linear_clipped_sum(a: torch.Tensor, g: torch.Tensor, c: torch.Tensor, bias: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(5) for a Linear: sum_i c_i dL_i/dW = (c . g)^T a, and sum_i c_i dL_i/db."""
    cg = g * c.view(-1, *([1] * (g.ndim - 1)))
    cg2, a2 = cg.reshape(-1, cg.shape[-1]), a.reshape(-1, a.shape[-1])
    return cg2.T @ a2, (cg2.sum(0) if bias else None)


def conv_per_sample(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Instantiated per-sample weight gradients g_i a_i^T: B x C_out x D (3), from
    B x D x T patches and B x C_out x T output gradients."""
    return torch.bmm(g, a.transpose(1, 2))


def conv_ghost_norms_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-sample ||g_i a_i^T||_F^2 = sum_{t,s} (a_it . a_is)(g_it . g_is) without forming
    the gradients (2): two B x T x T Gram matrices."""
    return (torch.bmm(a.transpose(1, 2), a) * torch.bmm(g.transpose(1, 2), g)).sum((1, 2))


def conv_clipped_sum(a: torch.Tensor, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """(5) for a conv: sum_i c_i g_i a_i^T as one (C_out x B T) by (B T x D) product."""
    cg = (g * c.view(-1, 1, 1)).transpose(0, 1).reshape(g.shape[1], -1)
    return cg @ a.transpose(1, 2).reshape(-1, a.shape[1])


def group_norm_per_sample(x: torch.Tensor, g: torch.Tensor, norm: nn.GroupNorm
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """GroupNorm's per-sample weight and bias gradients (B x C each): sum over positions
    of x_hat * g and of g, x_hat the normalised input (no affine)."""
    x_hat = F.group_norm(x, norm.num_groups, eps=norm.eps)
    dims = tuple(range(2, x.ndim))
    return (x_hat * g).sum(dims), g.sum(dims)


@dataclass
class _Record:
    module: nn.Module
    input: torch.Tensor
    output: torch.Tensor
    version: int


class BookKeeper:
    """Forward hooks on a model's trainable layers that keep each layer's input and output
    for :meth:`clip_and_sum` (one forward, one output-gradient backward per step)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = check_model(model)
        self.records: list[_Record] = []
        self.clone_outputs: set[nn.Module] = set()
        self.handles = [m.register_forward_hook(self._keep) for _, m in self.layers]

    def _keep(self, module: nn.Module, inputs: tuple[torch.Tensor, ...],
              output: torch.Tensor) -> torch.Tensor | None:
        if not torch.is_grad_enabled() or not module.training:
            return None
        if any(r.module is module for r in self.records):
            raise UnsupportedLayer(f"opacus-mode=bk: layer {type(module).__name__} ran twice "
                                   "in one forward pass (parameter tying is not supported)")
        self.records.append(_Record(module, inputs[0].detach(), output, output._version))
        # a later in-place op (ReLU(inplace=True), out += identity) would change the
        # tensor the output gradient is asked for: hand the rest of the network a copy
        return output.clone() if module in self.clone_outputs else None

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``model(x)`` with the layers' inputs and outputs kept; a layer whose output was
        later modified in place is marked for copying and the forward pass is redone."""
        for _ in range(2):
            self.records = []
            out = model(x)
            changed = {r.module for r in self.records if r.output._version != r.version}
            if not changed:
                return out
            self.clone_outputs |= changed
        raise RuntimeError("opacus-mode=bk: layer outputs still modified in place")

    def clip_and_sum(self, losses: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Set every trainable parameter's ``.grad`` to sum_i C_i dL_i/dtheta for the B
        per-sample ``losses`` of the last :meth:`forward`; returns the B per-sample
        gradient norms ||dL_i/dtheta|| (before clipping)."""
        outs = [r.output for r in self.records]
        grads = torch.autograd.grad(losses.sum(), outs)
        b = losses.shape[0]
        norms_sq = torch.zeros(b, dtype=losses.dtype, device=losses.device)
        pending = []
        for r, g in zip(self.records, grads):
            m, a = r.module, r.input
            if isinstance(m, nn.Linear):
                norms_sq += linear_norms_sq(a, g, m.bias is not None)
                pending.append((r, a, g, None))
            elif isinstance(m, nn.Conv2d):
                patches, gt = conv_unfold(a, m), g.flatten(2)
                per_sample = None
                if b * gt.shape[1] * patches.shape[1] <= INSTANTIATE_MAX:
                    per_sample = conv_per_sample(patches, gt)
                    norms_sq += _sq_norms(per_sample)
                else:
                    norms_sq += conv_ghost_norms_sq(patches, gt)
                if m.bias is not None:
                    norms_sq += _sq_norms(gt.sum(2))
                pending.append((r, patches, gt, per_sample))
            else:  # GroupNorm
                gw, gb = group_norm_per_sample(a, g, m)
                norms_sq += _sq_norms(gw) + _sq_norms(gb)
                pending.append((r, gw, gb, None))
        norms = norms_sq.sqrt()
        c = (max_norm / (norms + CLIP_EPS)).clamp(max=1.0)
        for r, a, g, per_sample in pending:
            m = r.module
            if isinstance(m, nn.Linear):
                w, bias = linear_clipped_sum(a, g, c, m.bias is not None)
            elif isinstance(m, nn.Conv2d):
                w = (torch.einsum("b,bod->od", c, per_sample) if per_sample is not None
                     else conv_clipped_sum(a, g, c)).view_as(m.weight)
                bias = g.sum(2).T @ c if m.bias is not None else None
            else:
                w, bias = a.T @ c, g.T @ c
            if m.weight is not None and m.weight.requires_grad:
                m.weight.grad = w.view_as(m.weight)
            if m.bias is not None and m.bias.requires_grad:
                m.bias.grad = bias
        self.records = []
        return norms
