"""Privacy mechanisms as small composable objects.

Each mechanism applies itself to a flat tensor (``apply``) and describes the accounting
event of one application (``event``), which :mod:`dpfl.privacy.events` turns into an
epsilon with Opacus or dp-accounting. Clipping has no event of its own: it sets the
sensitivity that the noise mechanisms are calibrated to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dpfl.privacy.events import PrivacyEvent


def l2_clip(x: torch.Tensor, bound: float) -> torch.Tensor:
    """x * min(1, bound / ||x||_2)."""
    norm = float(torch.linalg.vector_norm(x))
    return x * (bound / norm) if norm > bound else x.clone()


@dataclass(frozen=True)
class NormClip:
    """L2 norm clipping to ``bound`` (sensitivity of a single contribution: bound under
    add-remove, 2 * bound under replace-one). Not private on its own."""

    bound: float

    def apply(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return l2_clip(x, self.bound)

    def event(self, round_: int = 0) -> None:
        return None


@dataclass(frozen=True)
class GaussianMechanism:
    """Add N(0, (noise_multiplier * sensitivity)^2) to every coordinate (clip first).

    With ``clip`` set, ``apply`` clips to ``sensitivity`` before adding noise (the
    Gaussian mechanism on a clipped update or on a sum of clipped contributions)."""

    noise_multiplier: float
    sensitivity: float
    clip: bool = True
    sample_rate: float = 1.0
    relation: str = "add-remove"

    def apply(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        base = l2_clip(x, self.sensitivity) if self.clip else x
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype)
        return base + noise.to(x.device) * (self.noise_multiplier * self.sensitivity)

    def event(self, round_: int = 0) -> PrivacyEvent:
        return PrivacyEvent.gaussian(round_, self.noise_multiplier, self.sample_rate,
                                     relation=self.relation)


def _laplace(shape: torch.Size, scale: float, generator: torch.Generator | None) -> torch.Tensor:
    """Laplace(0, scale) samples by inverse CDF from uniforms (generator-seeded)."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64) - 0.5
    return (-scale * torch.sign(u) * torch.log1p(-2.0 * u.abs())).to(torch.float32)


@dataclass(frozen=True)
class LaplaceMechanism:
    """Add Lap(l1_sensitivity / epsilon) to every coordinate: epsilon-DP (pure)."""

    epsilon: float
    l1_sensitivity: float

    def apply(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return x + _laplace(x.shape, self.l1_sensitivity / self.epsilon, generator).to(x.device)

    def event(self, round_: int = 0) -> PrivacyEvent:
        return PrivacyEvent.pure(round_, self.epsilon, "laplace")


@dataclass(frozen=True)
class SparseVector:
    """The sparse-vector technique (Lyu, Su & Li 2017, Alg. 1 with numeric answers):
    a noisy threshold rho = threshold + Lap(Delta / eps1); each coordinate's query
    v_i + Lap(2 c Delta / eps2) is compared with rho; at most ``max_answers`` = c
    coordinates above it are released as v_i + Lap(c Delta / eps3); every other coordinate
    is withheld (zero). Total: (eps1 + eps2 + eps3)-DP, for queries of sensitivity Delta."""

    eps_threshold: float
    eps_queries: float
    eps_answers: float
    sensitivity: float
    threshold: float
    max_answers: int

    def apply(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        c, d = self.max_answers, self.sensitivity
        rho = self.threshold + float(_laplace(torch.Size([1]), d / self.eps_threshold, generator))
        noisy = x + _laplace(x.shape, 2.0 * c * d / self.eps_queries, generator).to(x.device)
        above = torch.nonzero(noisy >= rho).flatten()[:c]  # the first c positives, in order
        out = torch.zeros_like(x)
        answers = x[above] + _laplace(above.shape, c * d / self.eps_answers, generator).to(x.device)
        out[above] = answers
        return out

    @property
    def epsilon(self) -> float:
        return self.eps_threshold + self.eps_queries + self.eps_answers

    def event(self, round_: int = 0) -> PrivacyEvent:
        return PrivacyEvent.pure(round_, self.epsilon, "sparse-vector")


@dataclass
class QuantileClipTracker:
    """Private adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy 2021, Alg. 1).

    Each round the server receives, per client, b_i = 1[||u_i|| <= C] and releases the
    noisy fraction b = (sum_i b_i + N(0, sigma_b^2)) / m; then C <- C * exp(-eta (b - gamma))
    (geometric update towards the ``target_quantile`` gamma). The count has sensitivity 1:
    its cost is a Gaussian event with noise multiplier sigma_b, accounted per round
    beside the update noise. Because C is chosen from earlier outputs, the run's
    accounting must use adaptive composition (:class:`dpfl.privacy.filter.RenyiFilter`)."""

    clip: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_multiplier: float = 10.0
    history: list[float] = field(default_factory=list)

    def update(self, norms: torch.Tensor, generator: torch.Generator | None = None) -> float:
        """One geometric update from the clients' update norms; returns the new C."""
        m = len(norms)
        if m == 0:
            return self.clip
        count = float((norms <= self.clip).sum())
        noise = float(torch.randn(1, generator=generator)) * self.count_noise_multiplier
        fraction = (count + noise) / m
        self.history.append(self.clip)
        self.clip = self.clip * math.exp(-self.learning_rate * (fraction - self.target_quantile))
        return self.clip

    def event(self, round_: int = 0) -> PrivacyEvent:
        return PrivacyEvent.gaussian(round_, self.count_noise_multiplier, 1.0,
                                     mechanism="quantile-count")

    @staticmethod
    def update_noise_multiplier(total_noise_multiplier: float, count_noise_multiplier: float) -> float:
        """sigma_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2): the update noise that, together with
        the count, costs the same as one Gaussian release with multiplier z (Andrew et al.)."""
        rest = total_noise_multiplier ** -2 - (2.0 * count_noise_multiplier) ** -2
        if rest <= 0:
            raise ValueError("count_noise_multiplier too small for this total noise")
        return rest ** -0.5
