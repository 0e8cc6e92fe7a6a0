"""When a formal epsilon protects nobody in practice (docs/privacy.md, "When a formal
epsilon protects nobody"): plain words, no imports, so that a report can say it without
loading the accountants."""

from __future__ import annotations

# Above this epsilon a formal guarantee protects nobody in practice: e^10 ~ 22,000, the
# factor by which an attacker's odds of telling whether one record (or client) took part
# may grow.
MEANINGFUL_EPSILON = 10.0


def weak_epsilon_note(verdict: str, epsilon: float | None) -> str:
    """Words to print beside a ``formal`` verdict whose epsilon is above
    :data:`MEANINGFUL_EPSILON` ("" otherwise)."""
    if verdict != "formal" or epsilon is None or epsilon <= MEANINGFUL_EPSILON:
        return ""
    return (f" (but at epsilon {epsilon:.4g} > {MEANINGFUL_EPSILON:g} it protects nobody in "
            "practice: an attacker's odds may grow by e^epsilon)")
