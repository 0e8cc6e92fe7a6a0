"""GCFL's projection against hand-worked and naive references; FedExP's step size on
hand-worked numbers and applied by the strategy; SCAFFOLD's control variates on a tiny
quadratic and the server's c through the strategy; FedProx's proximal step; what each
strategy reports in its round metrics."""

import math
import random
from collections import OrderedDict

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from dpfl.config import RunConfig
from dpfl.methods import build_strategy, run_config
from dpfl.methods.dpfedexp import fedexp_step_size
from dpfl.methods.dpfedprox import proximal_step
from dpfl.methods.dpscaffold import scaffold_control_update, scaffold_server_control, scaffold_step
from dpfl.methods.gcfl import gcfl_aggregate, gcfl_correct
from dpfl.server.aggregation import weighted_mean
from dpfl.server.strategy import RoundRecord

from flower_helpers import message


def naive_gcfl(updates, references):
    """Alg. 1 lines 22-30 with explicit loops (squared norm in the denominator)."""
    g = [u.clone().double() for u in updates]
    refs = sorted(references)
    for i in range(len(g)):
        if i in refs:
            continue
        for j in refs:
            ref = updates[j].double()
            dot = float(g[i] @ ref)
            cos = dot / (float(g[i].norm()) * float(ref.norm()) + 1e-300)
            if cos < 0:
                g[i] = g[i] - dot / float(ref @ ref) * ref
    return torch.stack(g)


def test_hand_worked_three_clients_three_dims():
    # reference g0 = (1, 0, 0); g1 = (-1, 1, 0) conflicts (dot -1): -> (0, 1, 0);
    # g2 = (2, 0, 1) agrees (dot 2): unchanged
    u = torch.tensor([[1.0, 0, 0], [-1.0, 1, 0], [2.0, 0, 1]])
    out = gcfl_correct(u, [0])
    assert torch.allclose(out, torch.tensor([[1.0, 0, 0], [0.0, 1, 0], [2.0, 0, 1]]))
    # two references, in ascending order: g2 = (-1, -1, 1) against g0 = (1, 0, 0)
    # -> (0, -1, 1), then against g1 = (0, 2, 0): dot -2 -> (0, 0, 1)
    u = torch.tensor([[1.0, 0, 0], [0.0, 2, 0], [-1.0, -1, 1]])
    assert torch.allclose(gcfl_correct(u, [0, 1])[2], torch.tensor([0.0, 0, 1]))
    # weighted mean of corrected rows, weights 1:1:2
    agg = gcfl_aggregate(u, torch.tensor([1.0, 1.0, 2.0]), [0, 1])
    assert torch.allclose(agg, torch.tensor([0.25, 0.5, 0.5]))


@pytest.mark.parametrize("m,refs", [(2, [0]), (5, [3]), (8, [1, 4, 6]), (12, [0, 2, 5, 7, 11])])
def test_against_naive_reference_on_random_inputs(m, refs):
    g = torch.Generator().manual_seed(m)
    u = torch.randn(m, 257, generator=g) + 0.3 * torch.randn(1, 257, generator=g)
    fast = gcfl_correct(u.double(), refs)
    assert torch.allclose(fast, naive_gcfl(u, refs), atol=1e-9)
    w = torch.rand(m, generator=g) + 0.5
    expected = (w.double() / w.sum()) @ naive_gcfl(u, refs)
    assert torch.allclose(gcfl_aggregate(u.double(), w, refs), expected, atol=1e-9)


@pytest.mark.parametrize("chunk", [None, 64, 1000])
def test_blocked_single_pass_matches_naive(chunk):
    """M > 16 takes the blocked pass (mean and cross products per column block, the last
    block ragged): same result as the naive sequential projection."""
    g = torch.Generator().manual_seed(3)
    u = torch.randn(24, 1000, generator=g) + 0.2 * torch.randn(1, 1000, generator=g)
    w = torch.rand(24, generator=g) + 0.5
    refs = [2, 9, 17]
    expected = (w.double() / w.sum()) @ naive_gcfl(u, refs)
    got = gcfl_aggregate(u.double(), w, refs, chunk=chunk)
    assert torch.allclose(got, expected, atol=1e-9)
    got32 = gcfl_aggregate(u, w, refs, chunk=chunk)
    assert torch.allclose(got32.double(), expected, atol=1e-4)


def test_no_correction_when_no_conflict():
    u = torch.rand(6, 50)  # non-negative entries: every cosine >= 0
    assert torch.equal(gcfl_correct(u, [0, 2]), u)


def test_corrected_updates_do_not_conflict_with_their_reference():
    g = torch.Generator().manual_seed(7)
    u = torch.randn(20, 64, generator=g)
    out = gcfl_correct(u.double(), [5])
    dots = out @ u[5].double()
    assert float(dots.min()) >= -1e-9  # orthogonal (corrected) or positively aligned
    corrected = (u.double() @ u[5].double()) < 0
    assert torch.allclose(dots[corrected], torch.zeros(int(corrected.sum()), dtype=torch.float64),
                          atol=1e-9)
    # several references: after the last one, no corrected row conflicts with it
    # (references themselves are never corrected)
    out = gcfl_correct(u.double(), [2, 9, 15])
    others = [i for i in range(20) if i not in (2, 9, 15)]
    assert float((out[others] @ u[15].double()).min()) >= -1e-9


def test_strategy_draws_seeded_references():
    a = build_strategy(run_config(strategy="gcfl", gcfl_references=2))
    b = build_strategy(run_config(strategy="gcfl", gcfl_references=2))
    assert [a.draw_references(10) for _ in range(3)] == [b.draw_references(10) for _ in range(3)]
    # size min(R, max(m - 1, 1)): at least one update is left to correct when m >= 2
    for r in (1, 3, 5):
        s = build_strategy(run_config(strategy="gcfl", gcfl_references=r))
        for m in range(1, 12):
            refs = s.draw_references(m)
            assert refs == sorted(set(refs)) and set(refs) <= set(range(m)), (r, m, refs)
            assert len(refs) == min(r, max(m - 1, 1)), (r, m, refs)
    # the draw is random, not a fixed subset: over 60 draws every row is a reference
    # sometimes and the subsets differ
    s = build_strategy(run_config(strategy="gcfl", gcfl_references=2))
    draws = [tuple(s.draw_references(6)) for _ in range(60)]
    assert {i for d in draws for i in d} == set(range(6))
    assert len(set(draws)) > 1


def test_fedexp_step_size_closed_form():
    """eta_g = max(1, sum_i ||Delta_i||^2 / (2 M (||mean Delta||^2 + eps))), worked by hand."""
    # M = 3: ||(1, 2)||^2 + ||(3, 0)||^2 + ||(-1, 1)||^2 = 5 + 9 + 2 = 16; mean (1, 1) -> 2;
    # eps = 1/3: 16 / (2 * 3 * (2 + 1/3)) = 16 / 14 = 8/7 > 1: extrapolation
    u = torch.tensor([[1.0, 2.0], [3.0, 0.0], [-1.0, 1.0]])
    assert fedexp_step_size(u, 1 / 3) == pytest.approx(8 / 7, rel=1e-12)
    assert fedexp_step_size(-u, 1 / 3) == pytest.approx(8 / 7, rel=1e-12)  # Delta = -u
    # M = 2: (3, 0), (-1, 0): 9 + 1 = 10; mean (1, 0) -> 1; eps = 1/4: 10 / (4 * 5/4) = 2
    assert fedexp_step_size(torch.tensor([[3.0, 0.0], [-1.0, 0.0]]), 0.25) == pytest.approx(2.0)
    # opposed updates: mean 0, only eps in the denominator: 2 / (2 * 2 * 1e-3) = 500
    opposed = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert fedexp_step_size(opposed, 1e-3) == pytest.approx(500.0)
    # clamps to 1: (3, 1), (1, 3): 10 + 10 = 20; mean (2, 2) -> 8; eps = 2:
    # 20 / (2 * 2 * (8 + 2)) = 0.5 < 1 -> 1
    assert fedexp_step_size(torch.tensor([[3.0, 1.0], [1.0, 3.0]]), 2.0) == 1.0
    # identical updates: 2 / (2 * 2 * (1 + eps)) < 1/2 -> 1
    assert fedexp_step_size(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), 1e-3) == 1.0
    # one client: ||u||^2 / (2 (||u||^2 + eps)) < 1/2 -> 1 (no extrapolation from one update)
    assert fedexp_step_size(torch.tensor([[5.0, -7.0]]), 1e-3) == 1.0


# -- the strategies, driven through configure_train / aggregate_train ----------------------


class FakeGrid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)




def _two_param_model(w):
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([w]))
    return model


def _reply(node, pid, update, control_delta=None):
    content = {"arrays": ArrayRecord({"weight": torch.tensor([update])}),
               "metrics": MetricRecord({"num-examples": 10, "partition-id": pid})}
    if control_delta is not None:
        content["control-delta"] = ArrayRecord({"weight": torch.tensor([control_delta])})
    return message(RecordDict(content), src_node_id=node)


def _weight(arrays):
    return arrays.to_torch_state_dict()["weight"].view(-1)


def test_fedexp_strategy_applies_the_step(server_identity):
    """w <- w + server-lr eta_g mean(u), with eta_g from eq. 9, and the round metrics
    carry eta_g and the quantities it is computed from."""
    cfg = run_config(strategy="dpfedexp", fedexp_epsilon=1 / 3, server_lr=0.5)
    strategy = build_strategy(cfg)
    arrays = ArrayRecord(_two_param_model([1.0, 1.0]).state_dict())
    list(strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid([1, 2, 3])))
    new, metrics = strategy.aggregate_train(1, [
        _reply(1, 0, [1.0, 2.0]), _reply(2, 1, [3.0, 0.0]), _reply(3, 2, [-1.0, 1.0])])
    # eta = 8/7 (worked above); mean u = (1, 1): w = (1, 1) + 0.5 * 8/7 * (1, 1)
    assert torch.allclose(_weight(new), torch.full((2,), 1 + 4 / 7), atol=1e-6)
    assert metrics["server-step-size"] == pytest.approx(8 / 7)
    assert metrics["fedexp-sum-sq-norm"] == pytest.approx(16.0)
    assert metrics["fedexp-mean-sq-norm"] == pytest.approx(2.0)
    assert metrics["fedexp-clients"] == 3
    # clamped round: (3, 1), (1, 3) with eps = 1/3: 20 / (4 (8 + 1/3)) < 1 -> plain mean
    list(strategy.configure_train(2, new, ConfigRecord(), FakeGrid([1, 2])))
    newer, metrics = strategy.aggregate_train(2, [_reply(1, 0, [3.0, 1.0]),
                                                  _reply(2, 1, [1.0, 3.0])])
    assert metrics["server-step-size"] == 1.0
    assert torch.allclose(_weight(newer), _weight(new) + 0.5 * torch.tensor([2.0, 2.0]))


def test_scaffold_strategy_moves_its_control_variate(server_identity):
    """c <- c + (|S|/N) mean Delta c_i through aggregate_train, sent to the clients with the
    next round, and reported in the round metrics."""
    model = _two_param_model([0.0, 0.0])
    strategy = build_strategy(RunConfig(strategy="dpscaffold"), model=model)
    arrays = ArrayRecord(model.state_dict())
    grid = FakeGrid([1, 2, 3, 4])  # N = 4, two of them reply: |S|/N = 1/2
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    assert torch.equal(_weight(msgs[0].content["control"]), torch.zeros(2))
    _, metrics = strategy.aggregate_train(1, [_reply(1, 0, [0.1, 0.1], [1.0, 0.0]),
                                              _reply(2, 1, [0.1, 0.1], [0.0, 2.0])])
    # mean Delta c = (0.5, 1); c = 0 + 1/2 (0.5, 1) = (0.25, 0.5)
    assert torch.allclose(strategy.control, torch.tensor([0.25, 0.5]))
    assert metrics["scaffold-control-norm"] == pytest.approx(math.sqrt(0.3125))
    assert metrics["scaffold-control-step-norm"] == pytest.approx(math.sqrt(0.3125))
    assert metrics["scaffold-delta-norm"] == pytest.approx(math.sqrt(1.25))
    assert metrics["scaffold-participation"] == 0.5
    msgs = list(strategy.configure_train(2, arrays, ConfigRecord(), grid))
    assert all(torch.allclose(_weight(m.content["control"]), torch.tensor([0.25, 0.5]))
               for m in msgs)
    _, metrics = strategy.aggregate_train(2, [_reply(3, 2, [0.0, 0.0], [-0.5, -1.0])])
    # one of four: c = (0.25, 0.5) + 1/4 (-0.5, -1) = (0.125, 0.25)
    assert torch.allclose(strategy.control, torch.tensor([0.125, 0.25]))
    assert metrics["scaffold-control-step-norm"] == pytest.approx(math.sqrt(0.125 ** 2 + 0.25 ** 2))
    assert metrics["scaffold-control-norm"] == pytest.approx(math.sqrt(0.125 ** 2 + 0.25 ** 2))
    assert metrics["scaffold-participation"] == 0.25


def test_gcfl_round_metrics_report_the_projection():
    strategy = build_strategy(RunConfig(strategy="gcfl"))
    strategy.draw_references = lambda m: [0]
    # the hand-worked case above: g1 = (-1, 1, 0) conflicts with g0 = (1, 0, 0) -> (0, 1, 0)
    u = torch.tensor([[1.0, 0, 0], [-1.0, 1, 0], [2.0, 0, 1]])
    w = torch.ones(3)
    out = strategy.aggregate_updates(u, w)
    assert torch.allclose(out, torch.tensor([1.0, 1 / 3, 1 / 3]))  # (3, 1, 1) / 3
    plain = weighted_mean(u, w)  # (2, 1, 1) / 3: the projection moved it by (1/3, 0, 0)
    metrics = strategy.round_metrics(RoundRecord(1))
    assert metrics["gcfl-references"] == 1
    assert metrics["gcfl-conflicts"] == 1 and metrics["gcfl-corrected"] == 1
    assert metrics["gcfl-min-cosine"] == pytest.approx(-1 / math.sqrt(2))
    assert metrics["gcfl-correction-norm"] == pytest.approx(float((out - plain).norm()))
    assert metrics["gcfl-correction-norm"] == pytest.approx(1 / 3)
    # random rows, three references: the reported norm is the distance to the plain mean
    strategy = build_strategy(run_config(strategy="gcfl", gcfl_references=3))
    g = torch.Generator().manual_seed(11)
    u = torch.randn(9, 40, generator=g).double()
    w = (torch.rand(9, generator=g) + 0.5).double()
    replay = random.Random()
    replay.setstate(strategy.rng.getstate())   # the references the strategy will draw
    out = strategy.aggregate_updates(u, w)
    metrics = strategy.round_metrics(RoundRecord(1))
    assert metrics["gcfl-references"] == 3
    assert metrics["gcfl-correction-norm"] == pytest.approx(
        float((out - weighted_mean(u, w)).norm()), rel=1e-9)
    refs = sorted(replay.sample(range(9), 3))
    changed = (gcfl_correct(u, refs) - u).abs().sum(dim=1) > 0
    assert metrics["gcfl-corrected"] == int(changed.sum()) > 0
    # no conflict (non-negative rows): nothing corrected, the aggregate is the plain mean,
    # and nothing of the previous round is carried over
    u = torch.rand(4, 5, generator=g)
    out = strategy.aggregate_updates(u, torch.ones(4))
    metrics = strategy.round_metrics(RoundRecord(2))
    assert torch.allclose(out, u.mean(0))
    assert (metrics["gcfl-conflicts"], metrics["gcfl-corrected"]) == (0, 0)
    assert metrics["gcfl-correction-norm"] == 0.0 and metrics["gcfl-min-cosine"] >= 0.0
    strategy.aggregate_updates(torch.tensor([[1.0, -1.0]]), torch.ones(1))  # one update
    metrics = strategy.round_metrics(RoundRecord(3))
    assert (metrics["gcfl-conflicts"], metrics["gcfl-correction-norm"]) == (0, 0.0)


def test_scaffold_control_variates_on_a_quadratic():
    """f_i(w) = 1/2 ||w - a||^2, gradient w - a. K corrected SGD steps, then option II:
    c_i+ = c_i - c + (x - y)/(K lr), which must equal the mean local gradient."""
    a = torch.tensor([1.0, -2.0])
    x = torch.tensor([0.5, 0.5])
    c, ci = torch.tensor([0.2, 0.1]), torch.tensor([-0.1, 0.3])
    lr, k = 0.1, 5
    model = torch.nn.Linear(2, 1, bias=False)  # stand-in holder for one parameter vector
    with torch.no_grad():
        model.weight.copy_(x.view(1, 2))
    correct = scaffold_step([c.view(1, 2)], [ci.view(1, 2)])
    grads = []
    for _ in range(k):
        w = model.weight.detach().view(2)
        grad = w - a
        grads.append(grad)
        with torch.no_grad():
            model.weight.sub_(lr * grad.view(1, 2))  # the plain (here noiseless) step
        correct(model, lr)
    y = model.weight.detach().view(2)
    # by hand: y_{k+1} = y_k - lr (g_k - c_i + c)
    yk = x.clone()
    for _ in range(k):
        yk = yk - lr * ((yk - a) - ci + c)
    assert torch.allclose(y, yk, atol=1e-6)
    new = scaffold_control_update(OrderedDict(w=ci), OrderedDict(w=c), OrderedDict(w=x),
                                  OrderedDict(w=y), k, lr)
    assert torch.allclose(new["w"], torch.stack(grads).mean(0), atol=1e-5)
    # server: c + (|S|/N) mean Delta c_i
    deltas = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    assert torch.allclose(scaffold_server_control(torch.zeros(2), deltas, 4),
                          torch.tensor([0.25, 0.5]))


def test_proximal_step_pulls_towards_the_global_model():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 3.0]]))
    proximal_step([torch.tensor([[0.0, 1.0]])], mu=0.5)(model, 0.1)
    # w - lr mu (w - w_g) = (1, 3) - 0.05 (1, 2)
    assert torch.allclose(model.weight, torch.tensor([[0.95, 2.9]]))
