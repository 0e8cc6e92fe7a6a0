"""The participation schema without sampling (dpfl.privacy.accounting.participation): k participations
per client, any two at least b rounds apart, over n rounds; its validator, its patterns and
its one-line statement."""

from __future__ import annotations

import itertools

import pytest

from dpfl.privacy.accounting.participation import ParticipationSchema


def _all_patterns(n: int, k: int, b: int) -> set[tuple[int, ...]]:
    """Every nonempty subset of 0..n-1 with at most k elements, gaps >= b (reference)."""
    out = set()
    for size in range(1, k + 1):
        for combo in itertools.combinations(range(n), size):
            if all(y - x >= b for x, y in zip(combo, combo[1:])):
                out.add(combo)
    return out


def test_validator_accepts_what_the_schema_allows():
    s = ParticipationSchema(rounds=10, max_participations=3, min_separation=3)
    assert s.check([], 1) is None
    assert s.check([1], 4) is None
    assert s.check([1, 4], 10) is None
    assert s.allows([4], 1)         # before an earlier-recorded round, still 3 apart
    assert s.last_round == 10


@pytest.mark.parametrize("past, proposed, words", [
    ([1], 3, "2 round(s) from the client's participation in round 1"),
    ([5], 3, "2 round(s) from the client's participation in round 5"),   # a later round
    ([1, 4, 7], 10, "already took part 3 times"),
    ([1], 1, "already took part in round 1"),
    ([], 0, "outside the schema's rounds 1..10"),
    ([], 11, "outside the schema's rounds 1..10"),
])
def test_validator_refuses_with_the_reason(past, proposed, words):
    s = ParticipationSchema(rounds=10, max_participations=3, min_separation=3)
    why = s.check(past, proposed)
    assert why is not None and words in why, why
    assert "\n" not in why
    assert not s.allows(past, proposed)


def test_separation_one_allows_consecutive_rounds_and_k_still_binds():
    s = ParticipationSchema(rounds=5, max_participations=2, min_separation=1)
    assert s.check([2], 3) is None
    assert "already took part 2 times" in s.check([2, 3], 4)


def test_first_round_zero_indexing():
    s = ParticipationSchema(rounds=4, max_participations=2, min_separation=2, first_round=0)
    assert s.check([], 0) is None and s.check([0], 2) is None
    assert s.check([], 4) is not None


@pytest.mark.parametrize("n, k, b", [(1, 1, 1), (6, 2, 2), (7, 3, 2), (8, 4, 1), (9, 2, 4),
                                     (10, 3, 3), (5, 9, 2)])
def test_patterns_are_exactly_the_feasible_sets(n, k, b):
    s = ParticipationSchema(n, k, b)
    got = list(s.patterns())
    assert len(got) == len(set(got)) == s.count_patterns()
    assert set(got) == _all_patterns(n, k, b)
    assert all(s.is_feasible(p) for p in got)
    maximal = set(s.patterns(maximal_only=True))
    for p in _all_patterns(n, k, b):
        extendable = any(s.is_feasible(p + (i,)) for i in range(n) if i not in p)
        assert (p in maximal) == (not extendable)


def test_validator_agrees_with_the_patterns():
    """Adding round r (1-based) to a feasible pattern is allowed iff the result is one."""
    s = ParticipationSchema(rounds=8, max_participations=3, min_separation=2)
    for pattern in list(s.patterns()) + [()]:
        past = [i + 1 for i in pattern]
        for r in range(0, 10):
            allowed = s.check(past, r) is None
            feasible = 1 <= r <= 8 and r not in past and s.is_feasible(
                tuple(i - 1 for i in past) + (r - 1,))
            assert allowed == feasible, (past, r)


def test_a_ledger_built_on_the_validator_keeps_every_client_in_the_schema():
    s = ParticipationSchema(rounds=30, max_participations=4, min_separation=5)
    ledger: dict[int, list[int]] = {c: [] for c in range(7)}
    for rnd in range(1, 31):
        for client in range(7):     # every available client asks every round
            if s.allows(ledger[client], rnd):
                ledger[client].append(rnd)
    for rounds in ledger.values():
        assert s.is_feasible([r - 1 for r in rounds])
        assert len(rounds) == 4


def test_effective_participations():
    assert ParticipationSchema(10, 5, 3).effective_participations == 4   # rounds 0,3,6,9
    assert ParticipationSchema(9, 5, 3).effective_participations == 3
    assert ParticipationSchema(10, 2, 1).effective_participations == 2


def test_statement_names_the_schema_and_no_sampling():
    text = ParticipationSchema(100, 4, 25).statement()
    assert "\n" not in text
    for words in ("no sampling", "at most 4 times", "100 rounds", "at least 25 rounds apart",
                  "4-participation", "25-min-separation"):
        assert words in text, text
    assert "at most once" in ParticipationSchema(50, 1, 50).statement()


@pytest.mark.parametrize("kwargs", [dict(rounds=0, max_participations=1),
                                    dict(rounds=5, max_participations=0),
                                    dict(rounds=5, max_participations=1, min_separation=0),
                                    dict(rounds=True, max_participations=1),
                                    dict(rounds=5, max_participations=1.5)])
def test_bad_schema_is_refused(kwargs):
    with pytest.raises(ValueError):
        ParticipationSchema(**kwargs)
