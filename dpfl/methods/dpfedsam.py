"""``dpfedsam``: DP-FedSAM (Shi, Liu, Wei, Shen, Wang & Tao, "Make Landscape Flatter in
Differentially Private Federated Learning", CVPR 2023).

Client-level DP FedAvg whose local optimiser is sharpness-aware minimisation (SAM; Foret,
Kleiner, Mobahi & Neyshabur, "Sharpness-Aware Minimization for Efficiently Improving
Generalization", ICLR 2021). Each local step on a batch computes g = grad L(w), perturbs
the weights to w + e with e = rho g / ||g||_2 (one global norm over all parameters), takes
the gradient there on the same batch and steps from the unperturbed w with it
(:func:`sam_step`). After the local epochs the whole update is clipped to C and released
with N(0, sigma^2 C^2) noise (``trainer=update-dp``, :meth:`ClientHalf.release_update`);
the server averages the released updates with equal weights and steps (the shared
:class:`DPFLStrategy`).

Privacy: SAM only changes how the client computes the update that the update-DP mechanism
then clips and noises; the released value is still the clipped-and-noised update, so the
guarantee is client-level update DP's (verdict ``formal`` under the usual settings).

Record-level variant (``trainer=dpsgd``, sample-level DP). SAM's ascent direction g is
the private batch gradient: perturbing along it and then clipping per sample at w + e
would spend privacy twice per step. dpfl follows DP-SAT (Park, Kim, Choi & Lee,
"Differentially Private Sharpness-Aware Training", ICML 2023): the perturbation of step t
is built from the previous step's *noised* gradient, already released by DP-SGD,

    e_t = rho g~_{t-1} / ||g~_{t-1}||_2,

the per-sample gradients of step t are taken at w + e_t, clipped and noised by Opacus,
and the optimizer steps from w (:class:`NoisyGradientSAM`, a
:class:`~dpfl.client.trainers.WeightPerturbation`). e_t is post-processing of released
values, so each step is exactly one DP-SGD step: the guarantee, plan and ledger are DP-SGD's
(sample unit, add/remove, Poisson). The first step of a round has no released gradient yet
and is a plain DP-SGD step (CHOICE: a fresh start per round, as DP-SAT starts each run; the
previous round's aggregate would also be public but belongs to other clients' data too).
One forward/backward pass per step, as DP-SGD (DP-SAT's point): SAM's second pass is saved.

Noise scale: the authors' code adds N(0, sigma^2 C^2 / m) per client (m clients per
round), so only the sum over the round's clients carries sigma C; dpfl's update DP noises
every release with sigma C, so each reply is DP on its own (the same sigma means sqrt(m)
times their per-client noise).

Departures of the authors' code (github.com/YMJS-Irfan/DP-FedSAM) from the paper's text,
not reproduced here: its ``--adaptive`` flag is a ``type=bool`` argument defaulting to
True, so it runs *adaptive* SAM (ASAM, Kwon, Kim, Park & Choi, "ASAM: Adaptive
Sharpness-Aware Minimization for Scale-Invariant Learning of Deep Neural Networks", ICML
2021: e = rho |w|^2 g / || |w| g ||) whatever the command line says; it clips each tensor
of the update to C separately (not the whole update); it weights the mean by sample
counts; and it uses weight decay 5e-4 and a per-round learning-rate decay 0.998. dpfl
implements the SAM the paper describes (e = rho g / ||g||) with dpfl's local optimiser
(``lr``, ``momentum``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from dpfl.client.hooks import MethodHooks
from dpfl.config import TRUSTS as ALL_TRUSTS
from dpfl.config import RunConfig, need
from dpfl.method import ClientHalf, Method, MethodParams
from dpfl.privacy.verdict import MethodPrivacy
from dpfl.server.strategy import DPFLStrategy


@dataclass(frozen=True)
class DPFedSAMParams(MethodParams):
    """``sam-rho``: SAM's perturbation radius rho (> 0, finite).

    Default 0.5: the radius of the authors' launch commands for client-level DP on
    CIFAR-10 and CIFAR-100 (ResNet-18) and EMNIST (``--rho 0.5``, also their argparse
    default). Caveat: their code applies it as ASAM's radius (module docstring), whose
    perturbation is scaled elementwise by |w| (its norm is about rho times the weights'
    size), typically far smaller than plain SAM's at the same rho; plain SAM is usually
    run near rho = 0.05 (Foret et al.). Here 0.5 is a strong perturbation: lower
    ``sam-rho`` (e.g. 0.05-0.1) if local training stalls."""

    sam_rho: float = 0.5

    HELP = {"sam-rho": "SAM perturbation radius ρ (> 0; the authors' runs use 0.5, as ASAM's "
                       "radius: with plain SAM try 0.05-0.1 if local training stalls)"}

    def validate(self) -> None:
        need(math.isfinite(self.sam_rho) and self.sam_rho > 0, "sam-rho",
             "must be a finite number > 0", self.sam_rho)


def sam_perturbation(grads: list[torch.Tensor], rho: float) -> list[torch.Tensor] | None:
    """e = rho g / ||g||_2 with one norm over all tensors of g (None when ||g|| is 0 or
    not finite: no perturbation)."""
    if not grads:
        return None
    norm = float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g) for g in grads])))
    if not (math.isfinite(norm) and norm > 0.0):
        return None
    return [g * (rho / norm) for g in grads]


def sam_step(model: nn.Module, opt: torch.optim.Optimizer, criterion: nn.Module,
             x: torch.Tensor, y: torch.Tensor, rho: float) -> torch.Tensor:
    """One SAM step on the batch (x, y) (a :data:`~dpfl.client.trainers.LocalStep`):

        e   = rho g / ||g||_2,          g = grad L(w)   (one norm over all parameters)
        w  <- w - eta grad L(w + e)                      (``opt``'s step from w itself)

    The second gradient is taken on the same batch at w + e; the weights are restored to
    w exactly (a saved copy, not w + e - e) before ``opt`` steps with it, so momentum, if
    any, accumulates grad L(w + e). Parameters whose gradient is None are neither counted
    in the norm nor perturbed. When ||g|| is 0 (or not finite) there is no perturbation:
    the step is exactly the plain step with g (no second pass). Returns the loss at w (the
    first pass), detached."""
    opt.zero_grad(set_to_none=True)
    loss = criterion(model(x), y)
    loss.backward()
    with torch.no_grad():
        params = [p for p in model.parameters() if p.grad is not None]
        e = sam_perturbation([p.grad for p in params], rho)
        if e is None:
            opt.step()
            return loss.detach()
        saved = [p.detach().clone() for p in params]
        for p, step in zip(params, e):
            p.add_(step)
    opt.zero_grad(set_to_none=True)
    criterion(model(x), y).backward()
    with torch.no_grad():
        for p, w in zip(params, saved):
            p.copy_(w)
    opt.step()
    return loss.detach()


class NoisyGradientSAM:
    """DP-SAT's perturbation (Park, Kim, Choi & Lee, ICML 2023) for DP-SGD: the weights at
    which step t's per-sample gradients are taken are w + rho g~_{t-1} / ||g~_{t-1}||, g~
    the previous step's noised gradient (``p.grad`` after the step: released, so free)."""

    def __init__(self, rho: float) -> None:
        self.rho = rho
        self.previous: list[torch.Tensor] | None = None
        self.saved: list[torch.Tensor] | None = None

    @staticmethod
    def _params(model: nn.Module) -> list[torch.Tensor]:
        return [p for p in model.parameters() if p.requires_grad]

    @torch.no_grad()
    def apply(self, model: nn.Module) -> None:
        params = self._params(model)
        e = None if self.previous is None else sam_perturbation(self.previous, self.rho)
        if e is None:
            return
        self.saved = [p.detach().clone() for p in params]
        for p, step in zip(params, e):
            p.add_(step)

    @torch.no_grad()
    def restore(self, model: nn.Module) -> None:
        if self.saved is not None:
            for p, w in zip(self._params(model), self.saved):
                p.copy_(w)
            self.saved = None

    @torch.no_grad()
    def observe(self, model: nn.Module) -> None:
        self.previous = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                         for p in self._params(model)]


class DPFedSAMClient(ClientHalf):
    """Update DP: the local step is SAM with the configured radius, the release update DP's.
    DP-SGD: DP-SAT's perturbation from the previous noised gradient."""

    def hooks(self, cfg, msg, context, model) -> MethodHooks:
        if cfg.trainer == "dpsgd":
            return MethodHooks(perturb=NoisyGradientSAM(cfg.params.sam_rho))
        return MethodHooks(step=partial(sam_step, rho=cfg.params.sam_rho))


def dpfedsam_privacy(cfg: RunConfig) -> MethodPrivacy:
    if cfg.trainer == "dpsgd":
        return MethodPrivacy(scope=(
            f"sharpness-aware DP-SGD (DP-SAT, Park et al. 2023; rho {cfg.params.sam_rho}): "
            "each step's per-sample gradients are taken at weights perturbed along the "
            "previous step's noised gradient (post-processing), then clipped and noised as "
            "DP-SGD; the guarantee is DP-SGD's"))
    return MethodPrivacy(scope=(
        f"local optimiser SAM (rho {cfg.params.sam_rho}): two gradient passes per local "
        "step on the client's own data, inside the mechanism's input; the release is the "
        "clipped-and-noised update, so the guarantee is client-level update DP's"))


METHOD = Method(
    name="dpfedsam",
    citation="Shi, Liu, Wei, Shen, Wang & Tao, Make Landscape Flatter in Differentially "
             "Private Federated Learning, CVPR 2023",
    strategy=DPFLStrategy,
    client=DPFedSAMClient(),
    params=DPFedSAMParams,
    trainers=("update-dp", "dpsgd"),
    trainer_reason="DP-FedSAM runs client-level update DP or DP-SAT's sample-level DP-SGD",
    privacy=dpfedsam_privacy,
    trusts=ALL_TRUSTS,
)
