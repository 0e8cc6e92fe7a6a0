"""The secret randomness of a one-run privacy audit (Steinke, Nasr & Jagielski, "Privacy
Auditing with One (1) Training Run", 2023).

An audit inserts m canaries, each included independently with probability 1/2; the
auditor later guesses, from the released model (or update), which ones were included.
Everything the guesses are scored against comes from one *secret* seed:

- :func:`canary_bits`: the inclusion bits (True = included);
- :func:`canary_direction`: per canary, a uniformly random unit vector (a gradient-space
  canary: the direction added to an update when the canary is included);
- :func:`canary_score`: the auditor's score of a canary, ``<update, direction>``.

Both streams are derived with numpy's ``SeedSequence`` from ``(secret_seed, domain
constant[, index])`` through its ``spawn_key``, so they never coincide with each other nor
with the project's other seeded streams (torch generators seeded with plain integers). The
seed must stay secret from the audited party until the audit is scored (a known seed lets
an adversarial trainer pass the audit); :func:`draw_secret_seed` draws one from OS entropy.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

# Domain-separation constants (the spawn_key of the SeedSequence): arbitrary fixed 32-bit
# words, one per stream, distinct from each other.
_DOMAIN_BITS = 0x41554231  # "AUB1": inclusion bits
_DOMAIN_DIRECTIONS = 0x41554431  # "AUD1": canary directions


def _check_seed(secret_seed: int) -> None:
    if isinstance(secret_seed, bool) or not isinstance(secret_seed, (int, np.integer)):
        raise TypeError(f"secret_seed must be an int, got {type(secret_seed).__name__}")
    if secret_seed < 0:
        raise ValueError(f"secret_seed must be >= 0, got {secret_seed}")


def draw_secret_seed() -> int:
    """A fresh 128-bit secret seed from the operating system's entropy."""
    return secrets.randbits(128)


def _rng(secret_seed: int, *key: int) -> np.random.Generator:
    _check_seed(secret_seed)
    return np.random.Generator(np.random.PCG64(
        np.random.SeedSequence(int(secret_seed), spawn_key=tuple(int(k) for k in key))))


def canary_bits(secret_seed: int, m: int) -> torch.Tensor:
    """The m inclusion bits of an audit (bool tensor; each True with probability 1/2,
    independently), a deterministic function of ``(secret_seed, m)``; the first k bits
    do not depend on m >= k."""
    if m < 0:
        raise ValueError(f"m must be >= 0, got {m}")
    bits = _rng(secret_seed, _DOMAIN_BITS).integers(0, 2, size=m, dtype=np.uint8)
    return torch.from_numpy(bits.astype(bool))


def canary_direction(secret_seed: int, index: int, dim: int, support: int = 0
                     ) -> torch.Tensor:
    """Canary ``index``'s direction: a uniformly random unit vector of R^dim (float32; a
    normalised standard Gaussian), deterministic per ``(secret_seed, index, dim)`` and
    independent across indices (one SeedSequence child per index). ``support`` = s > 0:
    a sparse canary instead, a normalised Gaussian on s secret uniformly random
    coordinates and 0 elsewhere (its support is what a release that reveals positions,
    e.g. top-k sparsification, gives away)."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    if not 0 <= support <= dim:
        raise ValueError(f"support must be in [0, {dim}], got {support}")
    rng = _rng(secret_seed, _DOMAIN_DIRECTIONS, index)
    g = rng.standard_normal(dim)
    if support:
        keep = rng.choice(dim, size=support, replace=False)
        sparse = np.zeros(dim)
        sparse[keep] = g[keep]
        g = sparse
    norm = float(np.linalg.norm(g))  # > 0 with probability 1
    return torch.from_numpy((g / norm).astype(np.float32))


def canary_score(update: torch.Tensor, direction: torch.Tensor) -> float:
    """The auditor's score ``<update, direction>``, computed in float64 (both flattened;
    they must have the same number of elements)."""
    u = update.detach().reshape(-1).to(torch.float64)
    d = direction.detach().reshape(-1).to(torch.float64)
    if u.numel() != d.numel():
        raise ValueError(f"update has {u.numel()} values, direction {d.numel()}")
    return float(torch.dot(u, d))


def support_overlap(update: torch.Tensor, direction: torch.Tensor) -> float:
    """The fraction of the canary's support (its non-zero coordinates) where ``update`` is
    non-zero: an auditor's statistic for releases whose zero pattern is data-dependent."""
    u = update.detach().reshape(-1)
    d = direction.detach().reshape(-1)
    if u.numel() != d.numel():
        raise ValueError(f"update has {u.numel()} values, direction {d.numel()}")
    mask = d != 0
    return float((u[mask] != 0).double().mean()) if bool(mask.any()) else 0.0
