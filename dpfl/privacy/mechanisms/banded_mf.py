"""Banded lower-triangular Toeplitz matrix factorizations of the prefix-sum workload, their
optimisation, exact sensitivity under b-min-separation, a memo, and streaming noise.

Workload: A, the n x n lower-triangular matrix of ones (prefix sums of the per-round clipped
sums). Factorization A = B C with C lower-triangular Toeplitz and *banded*: coefficients
c_0..c_(b-1) (C[i, j] = c_(i-j) for 0 <= i - j < b), so B = A C^-1 (Choquette-Choo,
McMahan, Rush & Thakurta, "Multi-Epoch Matrix Factorization Mechanisms for Private Machine
Learning", ICML 2023 [MMRT23]; banded: Choquette-Choo, Ganesh, McKenna, McMahan, Rush,
Thakurta & Xu, "(Amplified) Banded Matrix Factorization", NeurIPS 2023 [CGMMRTX23];
Toeplitz coefficients optimised directly as in McMahan, Xu & Zhang 2024 and Dvijotham, McMahan,
Pillutla, Steinke & Thakurta 2024, "Efficient and Near-Optimal Noise Generation for
Streaming Differential Privacy").

- C^-1 is lower-triangular Toeplitz; its first column r solves the linear recurrence
  c_0 r_t = [t = 0] - sum_(j=1)^(b-1) c_j r_(t-j) (an IIR filter, scipy.signal.lfilter), and
  B's first column is beta = cumsum(r). Errors (MMRT23, Sec. 2, per unit noise):
  ``total`` ||B||_F^2 = sum_t (n - t) beta_t^2, ``max`` max_t ||B[t]||^2 = sum_t beta_t^2
  (the last row: B's rows are nested prefixes of beta).
- Sensitivity (CGMMRTX23, banded theorem; :mod:`dpfl.privacy.accounting.correlated_accounting`): with
  band b <= the schema's separation, columns >= b apart are orthogonal and
  sens^2 = max_pi sum_(i in pi) ||C[:, i]||^2. The column norms of a banded Toeplitz C are
  non-increasing in i (the last b - 1 columns are cut off), so rounds 0, sep, 2 sep, ... are
  worst: sens^2 = sum_(j < k') ||C[:, j sep]||^2, k' = min(k, ceil(n / sep)) — exactly
  ||c|| sqrt(k') when those columns are whole, the "max column norm x sqrt(k)" form.
- Optimisation: minimise sens(c)^2 x error(c) (scale-free, so equivalent to minimising the
  error at sens = 1) over c_1..c_(b-1) with c_0 = 1, by L-BFGS with the exact gradient
  (adjoint of the recurrence), from the truncated Toeplitz square root of A
  (c_j = binom(2j, j) / 4^j, Fichtenberger, Henzinger & Upadhyay 2023), then scaled to
  ||c|| = 1 (max column norm 1). For the optimisation the separation is taken as b (the
  worst schema the band allows); the run's own schema is accounted with
  :func:`toeplitz_sensitivity`.
- Streaming (MMRT23, Sec. 4; CGMMRTX23, Alg. 9-style): the noise added to round t's sum is
  y_t = (C^-1 z)_t, y_t = (z_t - sum_(j=1)^(b-1) c_j y_(t-j)) / c_0: b - 1 past noises,
  memory O(b x model size); the released prefix sum's noise is (B z)_t = sum_(s<=t) y_s.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray
from scipy import optimize, signal

from dpfl.privacy.accounting.participation import ParticipationSchema
from dpfl.privacy.mechanisms.tree_aggregation import NoiseStep, stream_generator

Objective = Literal["total", "max"]
OBJECTIVES: tuple[Objective, ...] = ("total", "max")
FloatArray = NDArray[np.float64]
# the memo's format: bump when the optimiser's answer for a key changes
MEMO_FORMAT = "dpfl-banded-mf 1"
MAX_ITERATIONS = 2000


def _coefficients(coefficients: ArrayLike) -> FloatArray:
    c = np.asarray(coefficients, dtype=np.float64).reshape(-1)
    if c.size < 1 or not np.all(np.isfinite(c)) or c[0] == 0:
        raise ValueError("coefficients must be finite, at least one, with c_0 != 0")
    return c


def _check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")


def sqrt_coefficients(count: int) -> FloatArray:
    """The first ``count`` Toeplitz coefficients of the square root of A,
    binom(2j, j) / 4^j (Fichtenberger, Henzinger & Upadhyay, ICML 2023): the optimiser's
    starting point (truncated to the band, the "banded square root")."""
    j = np.arange(1, count, dtype=np.float64)
    return np.concatenate([[1.0], np.cumprod((2.0 * j - 1.0) / (2.0 * j))])[:count]


def toeplitz_matrix(coefficients: ArrayLike, rounds: int) -> FloatArray:
    """The dense n x n lower-triangular Toeplitz C (C[i, j] = c_(i-j), 0 <= i - j < b)."""
    c = _coefficients(coefficients)[:rounds]
    out = np.zeros((rounds, rounds))
    for j, value in enumerate(c):
        out += value * np.eye(rounds, k=-j)
    return out


def inverse_coefficients(coefficients: ArrayLike, rounds: int) -> FloatArray:
    """First column of C^-1 (lower-triangular Toeplitz), length n, by the recurrence
    c_0 r_t = [t = 0] - sum_j c_j r_(t-j)."""
    c = _coefficients(coefficients)[:rounds]
    impulse = np.zeros(rounds)
    impulse[0] = 1.0
    return np.asarray(signal.lfilter([1.0], c, impulse), dtype=np.float64)


def decoder_coefficients(coefficients: ArrayLike, rounds: int) -> FloatArray:
    """First column beta of B = A C^-1 (lower-triangular Toeplitz): cumsum of C^-1's."""
    return np.cumsum(inverse_coefficients(coefficients, rounds))


def decoder_matrix(coefficients: ArrayLike, rounds: int) -> FloatArray:
    """The dense B = A C^-1."""
    return toeplitz_matrix(decoder_coefficients(coefficients, rounds), rounds)


def _error_weights(rounds: int, objective: Objective) -> FloatArray:
    _check_objective(objective)
    if objective == "total":
        return np.arange(rounds, 0, -1, dtype=np.float64)
    return np.ones(rounds)


def banded_error(coefficients: ArrayLike, rounds: int, objective: Objective = "total") -> float:
    """Per unit noise: ||B||_F^2 (``total``) or max_t ||B[t]||^2 (``max``)."""
    beta = decoder_coefficients(coefficients, rounds)
    return float(np.dot(_error_weights(rounds, objective), beta * beta))


def sensitivity_weights(band: int, rounds: int, participations: int,
                        min_separation: int) -> FloatArray:
    """w with sens(c)^2 = sum_l w_l c_l^2 for band <= separation (or one participation):
    w_l = #{j < k' : l < n - j sep}, the worst pattern being rounds 0, sep, 2 sep, ..."""
    if band > min_separation and participations > 1 and min_separation < rounds:
        raise ValueError(f"band {band} exceeds the separation {min_separation}: the banded "
                         "closed form needs band <= separation")
    k_eff = min(participations, -(-rounds // min_separation))
    starts = np.arange(k_eff) * min_separation
    lags = np.arange(band)
    counts = (lags[:, None] < (rounds - starts)[None, :]).sum(axis=1)
    return np.asarray(counts, dtype=np.float64)


def toeplitz_sensitivity(coefficients: ArrayLike, schema: ParticipationSchema) -> float:
    """Exact sensitivity of the Toeplitz C with these coefficients under ``schema`` (units
    of the clipping bound). Closed form when band <= separation or a single participation
    (any signs; CGMMRTX23's banded theorem and the non-increasing column norms), or when the
    coefficients are >= 0 and non-increasing (any band: then C^T C >= 0 and rounds 0, sep,
    2 sep, ... are worst; attributed to Kalinin & Lampert 2024, arXiv:2405.13763, Thm. 2,
    not checked against the paper's text; checked by brute force in the tests). ValueError
    otherwise (use correlated_accounting.sensitivity_upper_bound on the dense C)."""
    c = _coefficients(coefficients)[:schema.rounds]
    n, k, sep = schema.rounds, schema.max_participations, schema.min_separation
    if schema.effective_participations == 1:
        return float(np.linalg.norm(c))
    if c.size <= sep:
        return math.sqrt(float(np.dot(sensitivity_weights(c.size, n, k, sep), c * c)))
    if np.all(c >= 0) and np.all(np.diff(c) <= 0):
        k_eff = schema.effective_participations
        v = np.zeros(n)
        for j in range(k_eff):
            seg = c[:n - j * sep]
            v[j * sep:j * sep + seg.size] += seg
        return float(np.linalg.norm(v))
    raise ValueError(f"band {c.size} > separation {sep} with coefficients that are not "
                     "non-negative and non-increasing: no closed form; use "
                     "correlated_accounting.sensitivity_upper_bound on the dense C")


def banded_loss(coefficients: ArrayLike, rounds: int, participations: int,
                objective: Objective = "total") -> float:
    """sens^2 x error (scale-free) with separation = band, the optimiser's objective."""
    c = _coefficients(coefficients)
    w = sensitivity_weights(c.size, rounds, participations, c.size)
    return float(np.dot(w, c * c)) * banded_error(c, rounds, objective)


def _log_loss_and_grad(tail: FloatArray, rounds: int, sens_w: FloatArray,
                       err_w: FloatArray) -> tuple[float, FloatArray]:
    """log(sens^2) + log(err) and its gradient in c_1..c_(b-1) (c_0 = 1). The error's
    gradient by the adjoint of r = C^-1 e_0: d err / d c_j = -sum_t lam_t r_(t-j),
    lam = C^-T (reverse cumsum of 2 W beta)."""
    c = np.concatenate([[1.0], tail])
    n = rounds
    with np.errstate(all="ignore"):
        r = signal.lfilter([1.0], c, np.eye(1, n).ravel())
        beta = np.cumsum(r)
        err = float(np.dot(err_w, beta * beta))
        if not math.isfinite(err) or err <= 0:
            return math.inf, np.zeros_like(tail)
        h = np.cumsum((2.0 * err_w * beta)[::-1])[::-1]
        lam = signal.lfilter([1.0], c, h[::-1])[::-1]
        full = signal.fftconvolve(lam, r[::-1])
        grad_err = -full[n - 1:n - 1 + c.size]
    sens2 = float(np.dot(sens_w, c * c))
    grad = 2.0 * sens_w * c / sens2 + grad_err / err
    if not np.all(np.isfinite(grad)):
        return math.inf, np.zeros_like(tail)
    return math.log(sens2) + math.log(err), np.asarray(grad[1:], dtype=np.float64)


@lru_cache(maxsize=64)
def _optimise(rounds: int, band: int, participations: int,
              objective: Objective) -> tuple[float, ...]:
    """Optimal coefficients (||c|| = 1) for the key, by L-BFGS-B (see module docstring)."""
    if band == 1:
        return (1.0,)
    sens_w = sensitivity_weights(band, rounds, participations, band)
    err_w = _error_weights(rounds, objective)
    x0 = sqrt_coefficients(band)[1:]
    best: dict[str, FloatArray] = {"x": x0}
    best_value = [_log_loss_and_grad(x0, rounds, sens_w, err_w)[0]]

    def fun(x: FloatArray) -> tuple[float, FloatArray]:
        value, grad = _log_loss_and_grad(x, rounds, sens_w, err_w)
        if value < best_value[0]:
            best_value[0], best["x"] = value, np.array(x, dtype=np.float64)
        return value, grad

    optimize.minimize(fun, x0, jac=True, method="L-BFGS-B",
                      options={"maxiter": MAX_ITERATIONS, "gtol": 1e-10, "ftol": 1e-15})
    tail = best["x"]
    c = np.concatenate([[1.0], tail])
    return tuple(float(v) for v in c / np.linalg.norm(c))


@dataclass(frozen=True)
class BandedFactorization:
    """An optimised banded Toeplitz C for (rounds, band, participations, objective), with
    its sensitivity and error at separation = band (units of the clipping bound)."""

    rounds: int
    band: int
    participations: int
    objective: Objective
    coefficients: FloatArray
    sensitivity: float
    error: float

    @property
    def rmse(self) -> float:
        """RMSE of the prefix sums at noise multiplier 1 (sigma = sensitivity):
        sens x sqrt(||B||_F^2 / n) (``total``) or sens x max_t ||B[t]|| (``max``)."""
        per = self.error / self.rounds if self.objective == "total" else self.error
        return self.sensitivity * math.sqrt(per)


def default_band(schema: ParticipationSchema) -> int:
    """The largest band the closed form allows: the separation, or n for one participation."""
    if schema.effective_participations == 1:
        return schema.rounds
    return min(schema.min_separation, schema.rounds)


def optimal_banded(rounds: int, band: int, participations: int,
                   objective: Objective = "total",
                   cache_dir: str | os.PathLike[str] | None = None) -> BandedFactorization:
    """The optimised banded factorization for the key (rounds, band, participations,
    objective), memoised in this process (functools.lru_cache) and, when ``cache_dir`` is
    given, on disk as JSON (``banded-n{n}-b{b}-k{k}-{objective}.json``; floats in hex, no
    pickle). A disk entry is used only if it names the same key and format and its
    coefficients reproduce its recorded loss; otherwise it is recomputed and rewritten."""
    _check_objective(objective)
    for name, value in (("rounds", rounds), ("band", band), ("participations", participations)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    band = min(band, rounds)
    coefficients: tuple[float, ...] | None = None
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"banded-n{rounds}-b{band}-k{participations}-{objective}.json"
        coefficients = _read_memo(path, rounds, band, participations, objective)
    if coefficients is None:
        coefficients = _optimise(rounds, band, participations, objective)
        if path is not None:
            _write_memo(path, rounds, band, participations, objective, coefficients)
    c = np.array(coefficients, dtype=np.float64)
    sens = math.sqrt(float(np.dot(sensitivity_weights(band, rounds, participations, band),
                                  c * c)))
    return BandedFactorization(rounds, band, participations, objective, c, sens,
                               banded_error(c, rounds, objective))


def _memo_entry(rounds: int, band: int, participations: int, objective: Objective,
                coefficients: Sequence[float]) -> dict[str, object]:
    return {"format": MEMO_FORMAT, "rounds": rounds, "band": band,
            "participations": participations, "objective": objective,
            "coefficients": [float(v).hex() for v in coefficients],
            "loss": float(banded_loss(coefficients, rounds, participations,
                                      objective)).hex()}


def _read_memo(path: Path, rounds: int, band: int, participations: int,
               objective: Objective) -> tuple[float, ...] | None:
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        key = (entry["format"], entry["rounds"], entry["band"], entry["participations"],
               entry["objective"])
        if key != (MEMO_FORMAT, rounds, band, participations, objective):
            return None
        coefficients = tuple(float.fromhex(v) for v in entry["coefficients"])
        loss = float.fromhex(entry["loss"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if len(coefficients) != band or not all(math.isfinite(v) for v in coefficients):
        return None
    try:
        again = banded_loss(coefficients, rounds, participations, objective)
    except ValueError:
        return None
    if not math.isclose(again, loss, rel_tol=1e-9):
        return None
    return coefficients


def _write_memo(path: Path, rounds: int, band: int, participations: int,
                objective: Objective, coefficients: Sequence[float]) -> None:
    """Atomic write (temporary file + rename); a folder that cannot be written only
    loses the memo."""
    text = json.dumps(_memo_entry(rounds, band, participations, objective, coefficients))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".banded-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except OSError:
        return


class BandedNoise:
    """Streaming banded-MF noise: round t adds y_t = (C^-1 z)_t to its clipped sum, so the
    released prefix sum carries (B z)_t = sum_(s<=t) y_s. Memory: the last b - 1 values of
    y and the running prefix, O(b x model size). z_t ~ N(0, noise_std^2) is drawn from
    ``generator`` (or a fresh one seeded with ``seed``), one tensor of ``shape`` per round."""

    def __init__(self, coefficients: ArrayLike, shape: Sequence[int] | torch.Size,
                 noise_std: float, generator: torch.Generator | None = None,
                 seed: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        c = _coefficients(coefficients)
        generator = stream_generator(noise_std, generator, seed, device)
        self.coefficients = c
        self.shape = torch.Size(shape)
        self.noise_std = float(noise_std)
        self.generator = generator
        self.dtype = dtype
        self.device = device
        self.round = 0
        self._past: deque[torch.Tensor] = deque(maxlen=max(c.size - 1, 1))
        self._prefix = torch.zeros(self.shape, dtype=dtype, device=device)

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs to continue the same noise stream: the generator's state,
        the round, the last b - 1 increments and the running prefix."""
        return {"round": self.round, "generator": self.generator.get_state(),
                "past": [y.clone() for y in self._past], "prefix": self._prefix.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream :meth:`state_dict` saved (same coefficients and shape)."""
        self.round = int(state["round"])
        self.generator.set_state(state["generator"])
        self._past.clear()
        self._past.extend(y.to(self.dtype) for y in state["past"])
        self._prefix = state["prefix"].to(self.dtype)

    def next(self) -> NoiseStep:
        """The noise of the next round (0-based ``self.round`` before the call)."""
        z = torch.randn(self.shape, generator=self.generator, dtype=self.dtype,
                        device=self.device) * self.noise_std
        acc = z
        for j, past in enumerate(self._past, start=1):
            if j >= self.coefficients.size:
                break
            acc = acc - float(self.coefficients[j]) * past
        y = acc / float(self.coefficients[0])
        if self.coefficients.size > 1:
            self._past.appendleft(y)
        self._prefix = self._prefix + y
        self.round += 1
        return NoiseStep(y, self._prefix.clone())
