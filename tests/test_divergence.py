"""A run whose loss explodes says so in one line (issue 28, item 7): the global model's
loss non-finite or far above the initial model's, or every rejected update non-finite."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest

from dpfl.server.evaluation import EXPLOSION_FACTOR, divergence
from dpfl.server.validation import Rejection

NON_FINITE = "update has 80202 non-finite values"


@pytest.mark.parametrize("initial,loss,reasons,expected", [
    (2.30, 0.3, [], None),                                  # learning
    (2.30, 2.9, [], None),                                  # noisy, not exploding
    (2.30, 15777.0, [], "the global model's loss exploded to 1.578e+04 (the initial "
                        "model's: 2.3)"),
    (2.30, math.nan, [], "the global model's loss is nan"),
    (2.30, math.inf, [], "the global model's loss is inf"),
    (0.05, 5.0, [], None),                   # a good initial model: compared with 1.0
    (0.05, 10.5, [], "exploded to 10.5"),
    (2.30, None, [NON_FINITE] * 4, "every rejected update (4) has non-finite values"),
    (2.30, 2.0, [NON_FINITE, "refused at its budget"], None),   # not all non-finite
    (2.30, None, [], None),                  # a round not evaluated, nothing rejected
])
def test_divergence(initial, loss, reasons, expected):
    why = divergence(initial, loss, reasons, lr=2.0)
    if expected is None:
        assert why is None
    else:
        assert expected in why and "lower lr (now 2;" in why and "\n" not in why
    assert EXPLOSION_FACTOR == 10.0


def test_the_server_logs_it_once(caplog):
    from dpfl.apps.server import _report_divergence

    fed = SimpleNamespace(diverged=None, initial={"loss": 2.3}, initial_job=None,
                          cfg=SimpleNamespace(lr=2.0))
    bad = SimpleNamespace(rejected=[Rejection(1, 0, "invalid", NON_FINITE)])
    with caplog.at_level(logging.WARNING, logger="flwr.dpfl.server"):
        _report_divergence(fed, 1, {"loss": 2.0}, SimpleNamespace(rejected=[]))
        _report_divergence(fed, 2, {"loss": 2.0}, bad)
        _report_divergence(fed, 3, {"loss": math.nan}, bad)
    lines = [r.getMessage() for r in caplog.records if r.name == "flwr.dpfl.server"]
    assert len(lines) == 1 and lines[0].startswith("round 2: every rejected update (1) has "
                                                   "non-finite values: local training diverged")
    assert fed.diverged == 2
