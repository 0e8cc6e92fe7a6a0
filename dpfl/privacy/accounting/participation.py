"""Participation schemas without sampling: at most k participations per client, any two at
least b rounds apart (b-min-separation), over n rounds.

This is the participation model of Choquette-Choo, McMahan, Rush & Thakurta, "Multi-Epoch
Matrix Factorization Mechanisms for Private Machine Learning" (ICML 2023), Sec. 2, in the
b-min-separation form of Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu,
"(Amplified) Banded Matrix Factorization: A unified approach to private training" (NeurIPS
2023), Def. 2: a client that takes part in rounds i < j has j - i >= b. ``b = 1`` allows
consecutive rounds (k alone bounds the client); with ``k = 1`` the separation is moot (the
single-participation setting of Kairouz et al., ICML 2021, DP-FTRL with one pass).

Rounds are numbered as the server numbers them (Flower's first server round is 1:
``first_round``); the *index* of a round, ``round - first_round`` in ``0..n-1``, is the
column of the matrices in :mod:`dpfl.privacy.mechanisms.tree_aggregation` and
:mod:`dpfl.privacy.mechanisms.banded_mf`. Nothing here samples: the schema is what a server ledger
enforces (:meth:`ParticipationSchema.check`) and what the accountants maximise over
(:meth:`ParticipationSchema.patterns`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from typing import Iterator, Sequence


@dataclass(frozen=True)
class ParticipationSchema:
    """k participations (``max_participations``) per client, any two at least b rounds
    apart (``min_separation``), over n ``rounds`` numbered from ``first_round``."""

    rounds: int
    max_participations: int
    min_separation: int = 1
    first_round: int = 1

    def __post_init__(self) -> None:
        for name in ("rounds", "max_participations", "min_separation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.first_round, bool) or not isinstance(self.first_round, int):
            raise ValueError(f"first_round must be an integer, got {self.first_round!r}")

    @property
    def last_round(self) -> int:
        """The last round the schema covers (``first_round + rounds - 1``)."""
        return self.first_round + self.rounds - 1

    @property
    def effective_participations(self) -> int:
        """The most participations a client can really have: min(k, ceil(n / b)) (rounds
        0, b, 2b, ... fit ceil(n / b) times)."""
        return min(self.max_participations, -(-self.rounds // self.min_separation))

    def check(self, past: Sequence[int], proposed: int) -> str | None:
        """Why a client whose participations so far are the rounds ``past`` may not take
        part in round ``proposed`` (one line), or None when it may.

        Refused: a round outside ``first_round..last_round``, a round the client already
        had, a client that already has k participations, or one whose nearest
        participation (before or after ``proposed``) is fewer than b rounds away."""
        if not self.first_round <= proposed <= self.last_round:
            return (f"round {proposed} is outside the schema's rounds "
                    f"{self.first_round}..{self.last_round}")
        done = sorted(set(past))
        if proposed in done:
            return f"the client already took part in round {proposed}"
        if len(done) >= self.max_participations:
            return (f"the client already took part {len(done)} times (rounds "
                    f"{_rounds_text(done)}), the schema's maximum is "
                    f"{self.max_participations}")
        near = [r for r in done if abs(r - proposed) < self.min_separation]
        if near:
            r = min(near, key=lambda r: abs(r - proposed))
            return (f"round {proposed} is {abs(r - proposed)} round(s) from the client's "
                    f"participation in round {r}; the schema needs at least "
                    f"{self.min_separation} between any two")
        return None

    def allows(self, past: Sequence[int], proposed: int) -> bool:
        """True when :meth:`check` finds nothing against round ``proposed``."""
        return self.check(past, proposed) is None

    def is_feasible(self, indices: Sequence[int]) -> bool:
        """Whether round *indices* (0-based, any order) form a pattern the schema allows."""
        idx = sorted(indices)
        return (len(set(idx)) == len(idx) <= self.max_participations
                and all(0 <= i < self.rounds for i in idx)
                and all(b - a >= self.min_separation for a, b in zip(idx, idx[1:])))

    def patterns(self, maximal_only: bool = False) -> Iterator[tuple[int, ...]]:
        """Every nonempty feasible participation pattern as sorted 0-based round indices
        (for brute force on small cases: their number grows like C(n, k)).

        ``maximal_only``: only patterns to which no round can be added (enough for any
        objective that grows with the pattern, e.g. ||C u||^2 when C^T C >= 0)."""
        n, b = self.rounds, self.min_separation
        for size in range(1, self.effective_participations + 1):
            # indices i_0 < ... with gaps >= b  <=>  j_m = i_m - m (b - 1) strictly increasing
            # in 0..n - 1 - (size - 1)(b - 1)
            span = n - (size - 1) * (b - 1)
            for base in combinations(range(span), size):
                pattern = tuple(j + m * (b - 1) for m, j in enumerate(base))
                if not maximal_only or self._is_maximal(pattern):
                    yield pattern

    def count_patterns(self) -> int:
        """The number of nonempty feasible patterns (what :meth:`patterns` yields)."""
        n, b = self.rounds, self.min_separation
        return sum(math.comb(n - (s - 1) * (b - 1), s)
                   for s in range(1, self.effective_participations + 1))

    def _is_maximal(self, pattern: tuple[int, ...]) -> bool:
        if len(pattern) >= self.max_participations:
            return True
        return not any(self.is_feasible(pattern + (i,)) for i in range(self.rounds)
                       if i not in pattern)

    def statement(self) -> str:
        """The schema in one line, for a run's verdict (in place of "Poisson sampling")."""
        k, b, n = self.max_participations, self.min_separation, self.rounds
        times = "at most once" if k == 1 else f"at most {k} times"
        sep = "" if k == 1 or b == 1 else f", any two participations at least {b} rounds apart"
        return (f"no sampling assumed: each client takes part {times} in the {n} rounds "
                f"{self.first_round}..{self.last_round}{sep} (enforced by the server; "
                f"{k}-participation, {b}-min-separation schema)")


def _rounds_text(rounds: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in rounds[:limit])
    return shown + (", ..." if len(rounds) > limit else "")
