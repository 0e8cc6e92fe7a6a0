"""Privacy mechanisms as objects: each applies itself and returns the event it caused.

``release(x, generator, round_) -> (output, PrivacyEvent)``: the output is what may be
published, the event is what to charge for it (turned into an epsilon by
:mod:`dpfl.privacy.accounting.events` with Opacus or dp-accounting). The ``generator`` is required:
DP noise is drawn only from an explicit generator, secret unless the run is reproducible
(:func:`dpfl.privacy.mechanisms.randomness.mechanism_generator`). Clipping has no event of its own: it
sets the sensitivity the noise is calibrated to (:func:`l2_clip`).

- :class:`GaussianMechanism`: clip, then add N(0, (sigma C)^2 I) (client-level update DP,
  or central noise on a sum of clipped contributions).
- :class:`DpsgdRelease`: the event of a DP-SGD run (the noise is added by Opacus).
- :class:`LaplaceMechanism`: pure epsilon-DP noise.
- :class:`SparseVector`: the sparse-vector technique (Lyu, Su & Li 2017).
- :class:`QuantileClipTracker`: the noisy clipped count of adaptive clipping (Andrew,
  Thakkar, McMahan & Ramaswamy 2021).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from dpfl.privacy.accounting.events import PrivacyEvent

# A clipping function (x, bound) -> y with ||y||_2 <= bound (e.g. AADP-FL's longitudinal
# clipping, dpfl.privacy.mechanisms.longitudinal).
ClipFn = Callable[[torch.Tensor, float], torch.Tensor]


def l2_clip(x: torch.Tensor, bound: float) -> torch.Tensor:
    """x * min(1, bound / ||x||_2) (a copy when nothing is clipped)."""
    norm = float(torch.linalg.vector_norm(x))
    return x * min(1.0, bound / norm) if norm > 0 else x.clone()


@dataclass(frozen=True)
class GaussianMechanism:
    """The Gaussian mechanism on a clipped vector: clip(x, C) + N(0, (sigma C)^2 I).

    ``noise_multiplier`` sigma is the noise std over ``sensitivity`` C, the L2 bound every
    contribution is clipped to (the add-remove sensitivity; replace-one's is 2C, which the
    event's ``relation`` accounts for as sigma / 2). ``clip=False`` adds noise to ``x`` as
    it is (its norm must already be <= C, e.g. a sum of clipped contributions); ``clip_fn``
    replaces the L2 clipping by another one whose output norm is <= C (AADP-FL's
    longitudinal clipping). ``sample_rate`` < 1: the contribution was Poisson-sampled
    (add-remove). For the same generator state the output is bit-identical to the
    client's ``clip_and_noise`` (same clipping arithmetic, same ``torch.randn`` draw)."""

    noise_multiplier: float
    sensitivity: float
    relation: str = "add-remove"
    clip: bool = True
    clip_fn: ClipFn | None = None
    sample_rate: float = 1.0
    mechanism: str = "gaussian"

    def __post_init__(self) -> None:
        if not self.sensitivity > 0:
            raise ValueError("sensitivity (the clipping bound) must be > 0")
        self.event(0)  # validates sigma, rate, relation, mechanism

    def apply(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The noisy clipped vector. A non-finite input (local training diverged) is
        released as the zero vector plus noise: any map of the data to norm <= C keeps the
        sensitivity, and the release — already charged — stays usable instead of being
        rejected by the server."""
        if self.clip and not bool(torch.isfinite(x).all()):
            x = torch.zeros_like(x)
        if self.clip_fn is not None:
            base = self.clip_fn(x, self.sensitivity)
        else:
            base = l2_clip(x, self.sensitivity) if self.clip else x
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype)
        return base + noise.to(x.device) * (self.noise_multiplier * self.sensitivity)

    def event(self, round_: int) -> PrivacyEvent:
        return PrivacyEvent.gaussian(round_, self.noise_multiplier, self.sample_rate,
                                     relation=self.relation, mechanism=self.mechanism)

    def release(self, x: torch.Tensor, generator: torch.Generator,
                round_: int) -> tuple[torch.Tensor, PrivacyEvent]:
        return self.apply(x, generator), self.event(round_)


@dataclass(frozen=True)
class DpsgdRelease:
    """A DP-SGD run of ``steps`` Poisson-sampled (rate q) Gaussian steps with noise
    multiplier sigma (Abadi et al. 2016; Opacus adds the noise). Sample-level, add-remove."""

    noise_multiplier: float
    sample_rate: float
    steps: int

    def event(self, round_: int) -> PrivacyEvent:
        return PrivacyEvent.dpsgd(round_, self.noise_multiplier, self.sample_rate, self.steps)


def laplace_noise(shape: torch.Size | tuple[int, ...], scale: float,
                  generator: torch.Generator, dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
    """Laplace(0, scale) samples by inverse CDF of float64 uniforms from ``generator``:
    -scale sign(u) log(1 - 2|u|), u uniform on (-1/2, 1/2)."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64).sub_(0.5)
    # torch.rand is in [0, 1): u = -1/2 (log 0) is moved to the next float64 inside
    u.clamp_(min=math.nextafter(-0.5, 0.0))
    sign = torch.sign(u)
    # in place, one temporary: (log1p(-2|u|) sign) (-scale), bit-identical to
    # -scale sign(u) log1p(-2|u|) (the sign is exact, one rounding either way)
    return u.abs_().mul_(-2.0).log1p_().mul_(sign).mul_(-scale).to(dtype)


@dataclass(frozen=True)
class LaplaceMechanism:
    """Add Lap(l1_sensitivity / epsilon) to every coordinate: epsilon-DP (pure; Dwork,
    McSherry, Nissim & Smith 2006)."""

    epsilon: float
    l1_sensitivity: float

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and self.l1_sensitivity > 0):
            raise ValueError("epsilon and l1_sensitivity must be > 0")

    @property
    def scale(self) -> float:
        return self.l1_sensitivity / self.epsilon

    def apply(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return x + laplace_noise(x.shape, self.scale, generator, x.dtype).to(x.device)

    def event(self, round_: int) -> PrivacyEvent:
        return PrivacyEvent.pure(round_, self.epsilon, "laplace")

    def release(self, x: torch.Tensor, generator: torch.Generator,
                round_: int) -> tuple[torch.Tensor, PrivacyEvent]:
        return self.apply(x, generator), self.event(round_)


@dataclass(frozen=True)
class SparseVector:
    """The sparse-vector technique with numeric answers (Lyu, Su & Li 2017, "Understanding
    the Sparse Vector Technique for Differential Privacy", Alg. 1, with numeric answers
    paid for by a third budget eps3, as in their general form): a noisy threshold
    rho = T + Lap(Delta / eps1); query i is positive when q_i + Lap(2 c Delta / eps2) >= rho;
    the first c positives (the algorithm stops after c) are released as
    x_i + Lap(Delta_A / eps3), every other coordinate is withheld (0).
    (eps1 + eps2 + eps3)-DP for queries of sensitivity Delta (``sensitivity``).

    - ``answer_sensitivity`` Delta_A: the L1 sensitivity of the (at most c) released
      answers together; 0 (default) means c Delta, i.e. each answer has the queries'
      sensitivity and the c answers compose (Lyu et al.'s Lap(c Delta / eps3)). A caller
      whose answers have a tighter joint bound passes it (e.g. c coordinates of a vector
      of L2 sensitivity s: Delta_A = s sqrt(c)). For a fixed answer set the answers are a
      Laplace mechanism of L1 sensitivity Delta_A, so they cost eps3 on top of the
      selection (adaptive composition).
    - ``random_order``: the queries are asked in a uniformly random order drawn from the
      generator (independent of the data), so the c answers are a uniform sample of the
      positives instead of the first c by index; a mixture over data-independent orders of
      the same eps-DP algorithm is eps-DP.
    - ``apply(x, generator, queries)``: the queries q (default x itself) are compared, x is
      released (e.g. q = |x|, sensitivity C when every |x_i| <= C)."""

    eps_threshold: float
    eps_queries: float
    eps_answers: float
    sensitivity: float
    threshold: float
    max_answers: int
    answer_sensitivity: float = 0.0
    random_order: bool = False

    def __post_init__(self) -> None:
        if min(self.eps_threshold, self.eps_queries, self.eps_answers, self.sensitivity) <= 0:
            raise ValueError("the three epsilons and the sensitivity must be > 0")
        if int(self.max_answers) != self.max_answers or self.max_answers < 1:
            raise ValueError("max_answers must be an integer >= 1")
        if not self.answer_sensitivity >= 0:
            raise ValueError("answer_sensitivity must be >= 0 (0: c x sensitivity)")

    @property
    def epsilon(self) -> float:
        return self.eps_threshold + self.eps_queries + self.eps_answers

    @property
    def threshold_scale(self) -> float:
        """b of the threshold's noise Lap(Delta / eps1)."""
        return self.sensitivity / self.eps_threshold

    @property
    def query_scale(self) -> float:
        """b of each query's noise Lap(2 c Delta / eps2)."""
        return 2.0 * int(self.max_answers) * self.sensitivity / self.eps_queries

    @property
    def answer_scale(self) -> float:
        """b of each answer's noise Lap(Delta_A / eps3)."""
        joint = self.answer_sensitivity or int(self.max_answers) * self.sensitivity
        return joint / self.eps_answers

    def select(self, queries: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The indices (into the flattened queries) of the at most c positives."""
        c = int(self.max_answers)
        rho = self.threshold + float(laplace_noise((1,), self.threshold_scale, generator,
                                                   torch.float64))
        flat = queries.reshape(-1)
        noisy = flat + laplace_noise(flat.shape, self.query_scale, generator,
                                     flat.dtype).to(flat.device)
        above = torch.nonzero(noisy >= rho).flatten()
        if len(above) <= c:
            return above
        if self.random_order:
            order = torch.randperm(len(above), generator=generator)[:c].to(above.device)
            return above[order].sort().values
        return above[:c]

    def apply(self, x: torch.Tensor, generator: torch.Generator,
              queries: torch.Tensor | None = None) -> torch.Tensor:
        above = self.select(x if queries is None else queries, generator)
        out = torch.zeros_like(x).reshape(-1)
        out[above] = x.reshape(-1)[above] + laplace_noise(above.shape, self.answer_scale,
                                                          generator, x.dtype).to(x.device)
        return out.reshape(x.shape)

    def event(self, round_: int, relation: str = "add-remove") -> PrivacyEvent:
        return PrivacyEvent.pure(round_, self.epsilon, "sparse-vector", relation=relation)

    def release(self, x: torch.Tensor, generator: torch.Generator,
                round_: int) -> tuple[torch.Tensor, PrivacyEvent]:
        return self.apply(x, generator), self.event(round_)


def geometric_clip_update(clip: float, unclipped_fraction: float, target_quantile: float,
                          learning_rate: float) -> float:
    """C <- C exp(-eta (b - gamma)), b the (noisy) fraction of updates with norm <= C
    (Andrew, Thakkar, McMahan & Ramaswamy 2021, Alg. 1): too many unclipped updates
    (b > gamma) shrink C, too many clipped ones grow it, towards the gamma-quantile of the
    norms."""
    return clip * math.exp(-learning_rate * (unclipped_fraction - target_quantile))


@dataclass
class QuantileClipTracker:
    """Private adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy 2021, "Differentially
    Private Learning with Adaptive Clipping", Alg. 1).

    Each round the server gets, per participating client, b_i = 1[||u_i|| <= C] and
    releases the noisy fraction b = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / m + 1/2, then
    sets C <- C exp(-eta (b - gamma)) (geometric update towards the ``target_quantile``
    gamma). Centring b_i on 1/2 (their Sec. 3.1) gives the sum sensitivity 1/2 under
    add-remove, so one count is a Gaussian release of noise multiplier 2 sigma_b
    (:meth:`event`); under replace-one its sensitivity is 1, which the event's relation
    accounts for (sigma / 2). m is the public participant count (``expected_clients``;
    by default the number of norms given, as when every selected client replied); with
    m clients replying b = (sum_i b_i + noise) / m. The count involves every
    participating client: charge its event to each of them
    (:meth:`dpfl.privacy.accounting.ledger.Ledger.charge_server_release`). C is chosen from earlier
    outputs, so a run that uses it needs adaptive composition
    (:class:`dpfl.privacy.accounting.filter.RenyiFilter`)."""

    clip: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_multiplier: float = 10.0
    relation: str = "add-remove"
    history: list[float] = field(default_factory=list)

    def event(self, round_: int) -> PrivacyEvent:
        """The event of one noisy count: Gaussian, multiplier 2 sigma_b (sensitivity 1/2)."""
        return PrivacyEvent.gaussian(round_, 2.0 * self.count_noise_multiplier,
                                     relation=self.relation, mechanism="quantile-count")

    def release(self, norms: torch.Tensor, generator: torch.Generator, round_: int,
                expected_clients: int | None = None) -> tuple[float, PrivacyEvent]:
        """One geometric update from the clients' update norms: (new C, the count's event).
        ``expected_clients`` is the public denominator m (TensorFlow Privacy's
        ``expected_num_records``); ValueError without norms (nothing to release)."""
        if len(norms) == 0:
            raise ValueError("a clipped count needs at least one client")
        return self.release_bits(norms <= self.clip, generator, round_, expected_clients)

    def release_bits(self, within: torch.Tensor, generator: torch.Generator, round_: int,
                     expected_clients: float | None = None) -> tuple[float, PrivacyEvent]:
        """:meth:`release` from the bits b_i = 1[||u_i|| <= C] themselves (e.g. sent by
        clients that clipped their own update); with ``expected_clients`` an empty round
        still releases a noisy count (central DP with Poisson sampling)."""
        m = len(within) if expected_clients is None else float(expected_clients)
        if m <= 0:
            raise ValueError("a clipped count needs at least one client")
        centred = float(within.double().sum()) - 0.5 * len(within)
        noise = float(torch.randn(1, generator=generator, dtype=torch.float64))
        fraction = (centred + noise * self.count_noise_multiplier) / m + 0.5
        self.history.append(self.clip)
        self.clip = geometric_clip_update(self.clip, fraction, self.target_quantile,
                                          self.learning_rate)
        return self.clip, self.event(round_)

    @staticmethod
    def update_noise_multiplier(total_noise_multiplier: float,
                                count_noise_multiplier: float) -> float:
        """sigma_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2): the update noise that, composed
        with the count, costs the same as one Gaussian release of multiplier z (Andrew et
        al. 2021)."""
        rest = total_noise_multiplier ** -2 - (2.0 * count_noise_multiplier) ** -2
        if rest <= 0:
            raise ValueError("count_noise_multiplier too small for this total noise")
        sigma: float = rest ** -0.5
        return sigma
