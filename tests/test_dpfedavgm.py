"""DP-FedAvgM (McMahan et al. 2018, DP-FedAvg with server momentum): the step by hand,
through the strategy, its parameter check, its guarantee and its resume state."""

import pytest
import torch

from dpfl.config import ConfigError
from dpfl.methods import METHODS, build_strategy, guarantee, run_config
from dpfl.methods.dpfedavgm import momentum_step

from flower_helpers import FakeGrid, one_weight_arrays, one_weight_reply

_reply = one_weight_reply
_arrays = one_weight_arrays


def _round(strategy, rnd, arrays, updates):
    _, record = strategy.start_round(rnd, arrays, FakeGrid(list(range(1, len(updates) + 1))))
    replies = [_reply(i + 1, i, u) for i, u in enumerate(updates)]
    return strategy.finish_round(rnd, record, replies)


def test_momentum_step_by_hand():
    """w = 0, beta 0.5, lr 1: u1 = (1, 0) -> v = (1, 0), w = (1, 0);
    u2 = (0, 1) -> v = (0.5, 1), w = (1.5, 1)."""
    w, v = momentum_step(torch.zeros(2), None, torch.tensor([1.0, 0.0]), 0.5, 1.0)
    assert w.tolist() == [1.0, 0.0] and v.tolist() == [1.0, 0.0]
    w, v = momentum_step(w, v, torch.tensor([0.0, 1.0]), 0.5, 1.0)
    assert w.tolist() == [1.5, 1.0] and v.tolist() == [0.5, 1.0]


def test_strategy_steps_with_momentum_and_beta_zero_is_dpfedavg(server_identity):
    """Two rounds of two clients, sample-count weights (equal here), server-lr 0.5, beta 0.9:
    mean u1 = (1, 1) -> v = (1, 1), w = (0.5, 0.5); mean u2 = (2, 0) -> v = (2.9, 0.9),
    w = (0.5 + 1.45, 0.5 + 0.45). With beta 0 the same replies give DP-FedAvg's model."""
    m = build_strategy(run_config(strategy="dpfedavgm", server_momentum=0.9, server_lr=0.5))
    out = _round(m, 1, _arrays([0.0, 0.0]), [[2.0, 0.0], [0.0, 2.0]])
    assert out.arrays.to_torch_state_dict()["weight"].view(-1).tolist() == pytest.approx([0.5, 0.5])
    out = _round(m, 2, out.arrays, [[3.0, 1.0], [1.0, -1.0]])
    assert out.arrays.to_torch_state_dict()["weight"].view(-1).tolist() == pytest.approx([1.95, 0.95])
    assert out.metrics["server-velocity-norm"] == pytest.approx((2.9 ** 2 + 0.9 ** 2) ** 0.5)

    plain = build_strategy(run_config(strategy="dpfedavg", server_lr=0.5))
    zero = build_strategy(run_config(strategy="dpfedavgm", server_momentum=0.0, server_lr=0.5))
    a, b = _arrays([0.0, 0.0]), _arrays([0.0, 0.0])
    for rnd, updates in ((1, [[2.0, 0.0], [0.0, 2.0]]), (2, [[3.0, 1.0], [1.0, -1.0]])):
        a, b = _round(plain, rnd, a, updates).arrays, _round(zero, rnd, b, updates).arrays
    assert torch.equal(a.to_torch_state_dict()["weight"], b.to_torch_state_dict()["weight"])


def test_velocity_survives_a_resume(server_identity):
    m = build_strategy(run_config(strategy="dpfedavgm", server_momentum=0.9))
    out = _round(m, 1, _arrays([0.0, 0.0]), [[2.0, 0.0], [0.0, 2.0]])
    resumed = build_strategy(run_config(strategy="dpfedavgm", server_momentum=0.9))
    resumed.load_state_dict(m.state_dict())
    a = _round(m, 2, out.arrays, [[1.0, 1.0], [1.0, 1.0]]).arrays
    b = _round(resumed, 2, out.arrays, [[1.0, 1.0], [1.0, 1.0]]).arrays
    assert torch.equal(a.to_torch_state_dict()["weight"], b.to_torch_state_dict()["weight"])


def test_parameter_check_and_guarantee():
    with pytest.raises(ConfigError, match="'server-momentum'"):
        run_config(strategy="dpfedavgm", server_momentum=1.0)
    with pytest.raises(ConfigError, match="'trainer'"):
        run_config(strategy="dpfedavgm", trainer="plain")
    for trainer in ("dpsgd", "update-dp"):
        cfg = run_config(strategy="dpfedavgm", trainer=trainer)
        assert guarantee(cfg).verdict == "formal"
        assert guarantee(cfg).unit == guarantee(run_config(strategy="dpfedavg",
                                                           trainer=trainer)).unit
    assert METHODS["dpfedavgm"].presets == "dpfedavgm"


def test_update_dp_replies_get_the_dp_guard(server_identity):
    """Client-level DP through the guard: equal weights and the Gaussian norm bound,
    though the method never mentions either."""
    m = build_strategy(run_config(strategy="dpfedavgm", trainer="update-dp",
                                  noise_multiplier=1.0, clip_norm=1.0, server_momentum=0.0))
    assert m.guard.norm_bound(100, 1) == pytest.approx(1 + 1 * (10 + 10))
    _, record = m.start_round(1, _arrays([0.0, 0.0]), FakeGrid([1, 2]))
    big = _reply(1, 0, [100.0, 0.0])          # norm 100 > the bound for d = 2 (~12.4)
    ok = _reply(2, 1, [1.0, 1.0])
    out = m.finish_round(1, record, [big, ok])
    assert [r.partition_id for r in out.record.rejected] == [0]
    assert out.arrays.to_torch_state_dict()["weight"].view(-1).tolist() == pytest.approx([1.0, 1.0])
