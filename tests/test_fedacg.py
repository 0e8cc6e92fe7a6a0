"""FedACG (Kim, Kim & Han, CVPR 2024): the lookahead broadcast and the momentum server step
against a hand-worked two-client, two-round case, the client's regulariser around the
received model, the parameter checks, the guarantee and the resume state."""

import pytest
import torch
from flwr.app import ArrayRecord

from dpfl.config import ConfigError
from dpfl.methods import METHODS, build_strategy, guarantee, run_config
from dpfl.methods.fedacg import acg_server_step, lookahead

from flower_helpers import FakeGrid, one_weight_arrays, one_weight_reply

_reply = one_weight_reply
_arrays = one_weight_arrays


def _flat(arrays: ArrayRecord) -> list[float]:
    return arrays.to_torch_state_dict()["weight"].view(-1).tolist()


def _round(strategy, rnd, arrays, updates):
    """One round; returns (what the clients received, the outcome)."""
    messages, record = strategy.start_round(rnd, arrays, FakeGrid(list(range(1, 3))))
    sent = [_flat(m.content["arrays"]) for m in messages]
    assert sent[0] == sent[1]          # every client gets the same lookahead model
    replies = [_reply(i + 1, i, u) for i, u in enumerate(updates)]
    return sent[0], strategy.finish_round(rnd, record, replies)


def test_two_clients_two_rounds_by_hand(server_identity):
    """λ = 0.5, η = 1, x0 = (1, 2), equal weights (10 examples each).
    Round 1: m0 = 0, so the clients receive x0 = (1, 2); Δ = (0.2, -0.4), (0.4, 0):
    mean (0.3, -0.2), m1 = (0.3, -0.2), x1 = x0 + m1 = (1.3, 1.8).
    Round 2: the clients receive x1 + 0.5 m1 = (1.45, 1.7); Δ = (0.1, 0.1), (-0.1, 0.3):
    mean (0, 0.2), m2 = 0.5 (0.3, -0.2) + (0, 0.2) = (0.15, 0.1),
    x2 = x1 + m2 = (1.45, 1.9) (= the lookahead + mean Δ, the authors' code)."""
    s = build_strategy(run_config(strategy="fedacg", trainer="update-dp", acg_lambda=0.5,
                                  noise_multiplier=1.0, clip_norm=10.0))
    sent, out = _round(s, 1, _arrays([1.0, 2.0]), [[0.2, -0.4], [0.4, 0.0]])
    assert sent == pytest.approx([1.0, 2.0])
    assert _flat(out.arrays) == pytest.approx([1.3, 1.8])
    sent, out = _round(s, 2, out.arrays, [[0.1, 0.1], [-0.1, 0.3]])
    assert sent == pytest.approx([1.45, 1.7])
    assert _flat(out.arrays) == pytest.approx([1.45, 1.9])
    assert out.metrics["acg-momentum-norm"] == pytest.approx((0.15 ** 2 + 0.1 ** 2) ** 0.5)
    assert s.sent_arrays is not None and _flat(s.sent_arrays) == pytest.approx([1.45, 1.7])


def test_math_by_hand_with_a_server_lr():
    """η = 0.5, λ = 0.9: m1 = (2, 0), x1 = (1, 0); lookahead (1, 0) + 0.9 (2, 0) = (2.8, 0);
    m2 = 0.9 (2, 0) + (0, 1) = (1.8, 1), x2 = (1, 0) + 0.5 (1.8, 1) = (1.9, 0.5)."""
    x1, m1 = acg_server_step(torch.zeros(2), None, torch.tensor([2.0, 0.0]), 0.9, 0.5)
    assert x1.tolist() == [1.0, 0.0] and m1.tolist() == [2.0, 0.0]
    assert lookahead(x1, m1, 0.9).tolist() == pytest.approx([2.8, 0.0])
    assert lookahead(x1, None, 0.9).tolist() == [1.0, 0.0]
    x2, m2 = acg_server_step(x1, m1, torch.tensor([0.0, 1.0]), 0.9, 0.5)
    assert m2.tolist() == pytest.approx([1.8, 1.0]) and x2.tolist() == pytest.approx([1.9, 0.5])


def test_lambda_zero_is_dpfedavg(server_identity):
    acg = build_strategy(run_config(strategy="fedacg", acg_lambda=0.0, server_lr=0.5))
    plain = build_strategy(run_config(strategy="dpfedavg", server_lr=0.5))
    a, b = _arrays([0.0, 0.0]), _arrays([0.0, 0.0])
    for rnd, updates in ((1, [[2.0, 0.0], [0.0, 2.0]]), (2, [[3.0, 1.0], [1.0, -1.0]])):
        a = _round(acg, rnd, a, updates)[1].arrays
        b = _round(plain, rnd, b, updates)[1].arrays
    assert _flat(a) == pytest.approx(_flat(b))


def test_momentum_survives_a_resume(server_identity):
    s = build_strategy(run_config(strategy="fedacg"))
    _, out = _round(s, 1, _arrays([0.0, 0.0]), [[2.0, 0.0], [0.0, 2.0]])
    resumed = build_strategy(run_config(strategy="fedacg"))
    resumed.load_state_dict(s.state_dict())
    a = _round(s, 2, out.arrays, [[1.0, 1.0], [1.0, 1.0]])
    b = _round(resumed, 2, out.arrays, [[1.0, 1.0], [1.0, 1.0]])
    assert a[0] == b[0] and _flat(a[1].arrays) == _flat(b[1].arrays)


def test_client_regulariser_pulls_towards_the_received_model():
    """The hook's step after a local step: y <- y - lr β (y - x~), x~ = the model as
    received (the lookahead). β = 0.2, lr 0.5: (3, -1) -> (3, -1) - 0.1 ((3, -1) - (1, 1))
    = (2.8, -0.8)."""
    cfg = run_config(strategy="fedacg", acg_beta=0.2)
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1.0]]))
    hooks = METHODS["fedacg"].client.hooks(cfg, None, None, model)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, -1.0]]))     # after a local step
    hooks.post_step(model, 0.5)
    assert model.weight.view(-1).tolist() == pytest.approx([2.8, -0.8])
    none = METHODS["fedacg"].client.hooks(run_config(strategy="fedacg", acg_beta=0.0), None,
                                          None, model)
    assert none.post_step is None


def test_parameter_checks_and_guarantee():
    with pytest.raises(ConfigError, match="'acg-lambda'"):
        run_config(strategy="fedacg", acg_lambda=1.0)
    with pytest.raises(ConfigError, match="'acg-beta'"):
        run_config(strategy="fedacg", acg_beta=-0.1)
    with pytest.raises(ConfigError, match="'trainer'"):
        run_config(strategy="fedacg", trainer="plain")
    for trainer in ("dpsgd", "update-dp"):
        cfg = run_config(strategy="fedacg", trainer=trainer)
        assert guarantee(cfg).verdict == "formal"
        assert guarantee(cfg).unit == guarantee(run_config(strategy="dpfedavg",
                                                           trainer=trainer)).unit
    assert "central" in METHODS["fedacg"].trusts and "distributed" in METHODS["fedacg"].trusts
