"""``cpsgd``: cpSGD over SecAgg+ (Agarwal, Suresh, Yu, Kumar & McMahan, "cpSGD:
Communication-efficient and differentially-private distributed SGD", NeurIPS 2018).
DP-FedASGP's cpSGD baseline. Runs only under ``trust=distributed`` (the binomial
mechanism's guarantee is for the securely aggregated sum) with ``trainer=update-dp``.

Client (one round): the update Delta (d coordinates) is clipped to L2 norm C; with
``cpsgd-rotate`` (default) it is rotated by the randomised Hadamard transform
H D / sqrt(d') of the paper's Section 4 (d' = d padded to a power of two; the signs D come
from PUBLIC randomness: run-config ``seed`` and round, the same for every client and the
server); each coordinate is clipped to [-X, X], X = ``cpsgd-range`` C / sqrt(d'), and
quantised stochastically to one of k = ``cpsgd-levels`` levels (unbiased randomised
rounding of (w + X) s, s = (k - 1) / (2 X) levels per unit, the paper's stochastic k-level
quantiser); the client adds Bin(m, 1/2) per coordinate and sends the integers, shifted by
h = (k - 1 + m) // 2 into SecAgg+'s signed range, through Flower's SecAgg+ (as the
``secure-noise`` shares). The server sees only the sum over the survivors (at least
n_min), and estimates the mean as -X + (sum + n (h - m / 2)) / (s n), rotated back.

Noise: the total binomial variance N / 4 with N >= ceil(4 (sigma C s)^2) trials (each of
n_min clients adds m = ceil(N / n_min)), i.e. the dequantised noise std of the sum is
sigma C per coordinate, as for DP-FedAvg's Gaussian; sigma is ``noise-multiplier`` or
calibrated to ``target-epsilon``. CHOICE: p = 1/2 (the paper allows any p).

Guarantee. The paper's Theorem 1 gives (epsilon, delta) for the binomial mechanism in
closed form with constants b_p, c_p, d_p and a condition on N p (1 - p); dpfl does NOT
charge it. dpfl charges the exact restricted-support accounting of
:mod:`dpfl.privacy.mechanisms.binomial`: per coordinate the Renyi divergence of Bin(N, 1/2) and its
shift, conditioned on the common support, summed over the pmf at the L-inf sensitivity
k - 1 and composed over coordinates by L2 (D2 = 2 B, B = C s + sqrt(d'), replace-one:
the rounding moves each coordinate by < 1), plus the excluded mass as extra delta, which
the run refuses unless it is <= 10^-3 delta over all rounds, and which the event's curve
pays for by converting at delta (1 - 10^-3) (:func:`dpfl.privacy.mechanisms.binomial.binomial_event`).
Not exact in one respect: Bin(m, 1/2) is drawn with ``torch.binomial`` (floating-point
BTRS rejection, like the Skellam path's ``torch.poisson``), not a bit-exact sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dpfl import memo
from dpfl.config import RunConfig, need
from dpfl.method import Method, MethodParams
from dpfl.privacy.accounting import accountants as accounting
from dpfl.privacy.accounting import calibration_cache, event_types, events
from dpfl.privacy.mechanisms import binomial
from dpfl.privacy.mechanisms.release import l2_clip
from dpfl.privacy.mechanisms.skellam import randomized_round
from dpfl.privacy.plan import UPDATE_DP_RELATION
from dpfl.privacy.verdict import MethodPrivacy
from dpfl.server.strategy import DPFLStrategy

ROTATION_TAG = 0x43505347          # "CPSG": the rotation signs' public stream
DELTA_SHARE = 1e-3                 # the share of delta left for the excluded support mass
CALIBRATION_RATIO = 1.01           # sigma is the smallest to this ratio (bracket_and_bisect)


# -- the math ----------------------------------------------------------------------------

def padded_dim(dim: int, rotate: bool) -> int:
    """d': d, or the next power of two (the Hadamard transform's size)."""
    return 1 << (dim - 1).bit_length() if rotate and dim > 1 else dim


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The unnormalised Walsh-Hadamard transform of a power-of-two-long vector."""
    n, h, y = x.numel(), 1, x
    while h < n:
        y = y.reshape(-1, 2, h)
        y = torch.stack((y[:, 0] + y[:, 1], y[:, 0] - y[:, 1]), dim=1)
        h *= 2
    return y.reshape(n)


def rotation_signs(dim: int, seed: int, server_round: int) -> torch.Tensor:
    """The round's public signs D (+-1, float64) from (run-config seed, round)."""
    state = np.random.SeedSequence([ROTATION_TAG, seed % 2 ** 64, server_round % 2 ** 64])
    gen = torch.Generator().manual_seed(int(state.generate_state(1, np.uint64)[0]) >> 1)
    return torch.randint(0, 2, (dim,), generator=gen).to(torch.float64) * 2.0 - 1.0


def rotate(x: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    """H D x / sqrt(d') (x zero-padded to d'), or x itself when ``signs`` is None."""
    if signs is None:
        return x.double()
    padded = torch.zeros(signs.numel(), dtype=torch.float64)
    padded[:x.numel()] = x.double()
    return hadamard(padded * signs) / math.sqrt(signs.numel())


def unrotate(y: torch.Tensor, signs: torch.Tensor | None, dim: int) -> torch.Tensor:
    """The inverse of :func:`rotate`, truncated to the first ``dim`` coordinates."""
    if signs is None:
        return y.double()[:dim]
    return (signs * hadamard(y.double()) / math.sqrt(signs.numel()))[:dim]


def box(clip: float, range_: float, dim: int) -> float:
    """X = range C / sqrt(d')."""
    return range_ * clip / math.sqrt(dim)


def level_scale(levels: int, x_max: float) -> float:
    """s = (k - 1) / (2 X): quantisation levels per unit."""
    return (levels - 1) / (2.0 * x_max)


def quantise(w: torch.Tensor, x_max: float, levels: int, gen: torch.Generator) -> torch.Tensor:
    """The stochastic k-level quantiser: clip to [-X, X], then round (w + X) s at random to
    an integer level in [0, k - 1] (unbiased)."""
    s = level_scale(levels, x_max)
    return randomized_round((w.clamp(-x_max, x_max) + x_max) * s, gen).clamp_(0, levels - 1)


def total_trials(sigma: float, clip: float, scale: float) -> int:
    """N = ceil(4 (sigma C s)^2): Bin(N, 1/2) has variance >= (sigma C s)^2."""
    return max(1, math.ceil(4.0 * (sigma * clip * scale) ** 2))


def client_trials(total: int, n_min: int) -> int:
    """m = ceil(N / n_min): n_min survivors together add >= N trials."""
    return -(-total // n_min)


def dequantise(total: torch.Tensor, survivors: int, x_max: float, levels: int, trials: int
               ) -> torch.Tensor:
    """The mean estimate from the sum of shares level + Bin(m, 1/2) - h."""
    h = (levels - 1 + trials) // 2
    s = level_scale(levels, x_max)
    return -x_max + (total.double() + survivors * (h - trials / 2.0)) / (s * survivors)


# -- the method --------------------------------------------------------------------------

@dataclass(frozen=True)
class CpsgdParams(MethodParams):
    cpsgd_levels: int = 16
    cpsgd_range: float = 4.0
    cpsgd_rotate: bool = True

    HELP = {
        "cpsgd-levels": "k, the quantisation levels per coordinate (log2 k bits before noise)",
        "cpsgd-range": "the quantiser's box [−X, X], X = range · C / √d′ (d′: the padded "
                       "dimension); coordinates beyond it are clipped",
        "cpsgd-rotate": "rotate the clipped update by a randomised Hadamard transform (public "
                        "signs from `seed` and the round) before quantising",
    }

    def validate(self) -> None:
        need(2 <= self.cpsgd_levels <= 1 << 16, "cpsgd-levels", "must be in [2, 65536]",
             self.cpsgd_levels)
        need(math.isfinite(self.cpsgd_range) and self.cpsgd_range > 0, "cpsgd-range",
             "must be > 0", self.cpsgd_range)

    # the secure-sum protocol of dpfl.privacy.trust (a method with its own integer noise)
    def _geometry(self, cfg: RunConfig, dim: int) -> tuple[int, float, float]:
        dp = padded_dim(dim, self.cpsgd_rotate)
        x_max = box(cfg.clip_norm, self.cpsgd_range, dp)
        return dp, x_max, level_scale(self.cpsgd_levels, x_max)

    def secure_event(self, cfg: RunConfig, server_round: int, dim: int, sigma: float
                     ) -> events.PrivacyEvent:
        dp, _, s = self._geometry(cfg, dim)
        return binomial.binomial_event(
            server_round, total_trials(sigma, cfg.clip_norm, s), self.cpsgd_levels - 1,
            cfg.clip_norm * s + math.sqrt(dp), dp, UPDATE_DP_RELATION, cfg.num_rounds,
            DELTA_SHARE)

    def secure_sigma(self, cfg: RunConfig, dim: int) -> float:
        """``noise-multiplier``, or the smallest sigma (to 1 %) whose ``num-rounds`` events
        meet ``target-epsilon``."""
        if cfg.noise_multiplier > 0:
            return cfg.noise_multiplier
        return _calibrated(self, cfg.clip_norm, cfg.num_rounds, cfg.delta,
                           cfg.target_epsilon, dim)

    def _calibrate(self, cfg: RunConfig, dim: int) -> float:
        """The smallest sigma (to 1 %) whose ``num-rounds`` events meet ``target-epsilon``:
        eps(sigma) <= target < eps(sigma / 1.01). Each eps(sigma) sums the binomial's pmf
        over N ~ 4 (sigma C s)^2 trials (tens of seconds at N ~ 1e10), so the answer is
        memoised on disk (:mod:`dpfl.privacy.accounting.calibration_cache`; a kept sigma is returned
        only once eps(sigma) <= target < eps(sigma / 1.01) is confirmed: two evaluations),
        and the bisection starts from the Gaussian's multiplier for the binomial's
        sensitivity, which it approaches as N grows."""
        def eps(sigma: float) -> float:
            ev = self.secure_event(cfg, 1, dim, sigma)
            return events.history_epsilon([ev] * cfg.num_rounds, cfg.delta, "rdp")

        def search() -> float:
            # from the Gaussian's multiplier, scaled by the rounding's share of the
            # sensitivity (B = C s + sqrt(d') against C s): near the binomial's at large N
            dp, _, s = self._geometry(cfg, dim)
            guess = accounting.calibrate_noise(
                cfg.target_epsilon, cfg.delta, cfg.num_rounds, accountant="rdp",
                relation=UPDATE_DP_RELATION) * (cfg.clip_norm * s + math.sqrt(dp)) / (
                    cfg.clip_norm * s)
            return bracket_and_bisect(eps, cfg.target_epsilon, guess)

        return calibration_cache.memoised(_memo_key(self, cfg, dim), eps,
                                          cfg.target_epsilon, search,
                                          tolerance=1.0 - 1.0 / CALIBRATION_RATIO)

    def secure_share(self, cfg: RunConfig, update: torch.Tensor, clip: float, sigma: float,
                     n_min: int, generator: torch.Generator, server_round: int
                     ) -> torch.Tensor:
        dim = update.numel()
        dp, x_max, s = self._geometry(cfg, dim)
        signs = rotation_signs(dp, cfg.seed, server_round) if self.cpsgd_rotate else None
        level = quantise(rotate(l2_clip(update.double(), clip), signs), x_max,
                         self.cpsgd_levels, generator)
        m = client_trials(total_trials(sigma, cfg.clip_norm, s), n_min)
        noise = torch.binomial(torch.full((dp,), float(m), dtype=torch.float64),
                               torch.full((dp,), 0.5, dtype=torch.float64), generator=generator)
        return level + noise.to(torch.int64) - (self.cpsgd_levels - 1 + m) // 2

    def secure_mean(self, cfg: RunConfig, total: torch.Tensor, survivors: int, n_min: int,
                    dim: int, sigma: float, server_round: int) -> torch.Tensor:
        dp, x_max, s = self._geometry(cfg, dim)
        m = client_trials(total_trials(sigma, cfg.clip_norm, s), n_min)
        signs = rotation_signs(dp, cfg.seed, server_round) if self.cpsgd_rotate else None
        return unrotate(dequantise(total, survivors, x_max, self.cpsgd_levels, m), signs, dim)

    def secure_check(self, cfg: RunConfig, dim: int, sigma: float, sampled: int, n_min: int,
                     limit: int) -> float:
        """The extra delta of the run (ValueError unless <= 10^-3 delta) after checking that
        a share fits SecAgg+'s range [-c, c] (always: levels and trials are bounded)."""
        dp, _, s = self._geometry(cfg, dim)
        n = total_trials(sigma, cfg.clip_norm, s)
        m = client_trials(n, n_min)
        if self.cpsgd_levels - 1 + m - (self.cpsgd_levels - 1 + m) // 2 > limit:
            raise ValueError(f"a cpSGD share (levels {self.cpsgd_levels}, {m} binomial "
                             f"trials) exceeds SecAgg+'s range {limit} for {sampled} clients")
        extra = cfg.num_rounds * binomial.support_delta(
            n, self.cpsgd_levels - 1, 2.0 * (cfg.clip_norm * s + math.sqrt(dp)), dp)
        if extra > DELTA_SHARE * cfg.delta:
            raise ValueError(f"the binomial's support mismatch costs delta {extra:.3g} > "
                             f"{DELTA_SHARE:g} delta: more noise (N = {n} trials) needed")
        return extra

    def secure_scope(self, cfg: RunConfig) -> tuple[str, str]:
        return (f"cpSGD shares ({'rotated, ' if self.cpsgd_rotate else ''}"
                f"{self.cpsgd_levels}-level stochastic quantisation plus Bin(m, 1/2))",
                "binomial noise Bin(N, 1/2) of variance >= (sigma C s)^2, accounted by the "
                "exact restricted-support Renyi divergence of dpfl.privacy.mechanisms.binomial (NOT "
                "the paper's Theorem 1), its support-mismatch mass <= 1e-3 delta paid by "
                "converting at delta (1 - 1e-3),")


def bracket_and_bisect(eps: Callable[[float], float], target: float, guess: float,
                       ratio: float = CALIBRATION_RATIO) -> float:
    """The smallest sigma to ``ratio`` with eps(sigma) <= target, for eps decreasing in
    sigma: a bracket [lo, hi] around ``guess`` (widened by 1.25 per step until eps(lo) >
    target >= eps(hi)), then bisection on log sigma until hi / lo <= ``ratio``."""
    lo, hi = guess / 1.05, guess * 1.1
    lo_above = False            # eps(lo) > target known already (each eps costs a pmf sum)
    while eps(hi) > target:
        lo, hi, lo_above = hi, hi * 1.25, True
        if hi > 1e4:
            raise ValueError("target epsilon unreachable with sigma <= 1e4")
    while not lo_above and lo > 1e-3 and eps(lo) <= target:
        lo, hi = lo / 1.25, lo
    while hi / lo > ratio:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps(mid) <= target else (mid, hi)
    return hi


def _memo_key(params: CpsgdParams, cfg: RunConfig, dim: int) -> str:
    """The calibration's memo key: the code that answers (dp-accounting's version, the
    sources of this module, of the binomial accounting, of the events' RDP and of the
    binomial event's curve) and the question."""
    version = memo.code_version("dp-accounting", Path(__file__), Path(binomial.__file__),
                                Path(accounting.__file__), Path(events.__file__),
                                Path(event_types.__file__))
    return version + "\ncpsgd " + repr((params.cpsgd_levels, params.cpsgd_range,
                                        params.cpsgd_rotate, cfg.clip_norm, cfg.num_rounds,
                                        cfg.delta, cfg.target_epsilon, dim,
                                        UPDATE_DP_RELATION, DELTA_SHARE))


@lru_cache(maxsize=32)
def _calibrated(params: CpsgdParams, clip: float, rounds: int, delta: float, target: float,
                dim: int) -> float:
    """The calibrated sigma, once per setting (the clients and the server ask every round)."""
    cfg = RunConfig(clip_norm=clip, num_rounds=rounds, delta=delta, target_epsilon=target,
                    params=params)
    return params._calibrate(cfg, dim)


def _privacy(cfg: RunConfig) -> MethodPrivacy:
    return MethodPrivacy()


METHOD = Method(
    name="cpsgd",
    own_secure_noise=True,
    citation="Agarwal, Suresh, Yu, Kumar & McMahan, cpSGD: Communication-efficient and "
             "differentially-private distributed SGD, NeurIPS 2018",
    strategy=DPFLStrategy,
    params=CpsgdParams,
    trainers=("update-dp",),
    trainer_reason="its clients quantise and noise the whole update",
    privacy=_privacy,
    trusts=("distributed",),
)
