"""The one number check every reply, record and config parse goes through."""

import math

import pytest

from dpfl.numbers import is_finite_number, is_number


@pytest.mark.parametrize("value", [0, -3, 2.5, 1e300, math.inf, -math.inf, math.nan])
def test_ints_and_floats_are_numbers(value):
    assert is_number(value)


@pytest.mark.parametrize("value", [True, False, "1", None, [1], {"a": 1}, b"1"])
def test_bools_strings_and_containers_are_not(value):
    assert not is_number(value)
    assert not is_finite_number(value)


@pytest.mark.parametrize("value,finite", [(0, True), (1.5, True), (math.inf, False),
                                          (-math.inf, False), (math.nan, False)])
def test_finite_excludes_nan_and_infinities(value, finite):
    assert is_finite_number(value) is finite


def test_a_true_partition_id_or_infinite_one_claims_nothing():
    from dpfl.server.reply import _partition_id

    assert _partition_id({"partition-id": True}) is None
    assert _partition_id({"partition-id": math.inf}) is None   # int(inf) used to raise
    assert _partition_id({"partition-id": 3.0}) == 3
