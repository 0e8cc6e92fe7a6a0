"""GCFL's projection against hand-worked and naive references; FedExP's step size;
SCAFFOLD's control variates on a tiny quadratic; FedProx's proximal step."""

from collections import OrderedDict

import pytest
import torch

from dpfl.client.methods import scaffold_control_update
from dpfl.client.trainers import proximal_step, scaffold_step
from dpfl.config import RunConfig
from dpfl.strategies import build_strategy
from dpfl.strategies.dpfedexp import fedexp_step_size
from dpfl.strategies.dpscaffold import scaffold_server_control
from dpfl.strategies.gcfl import gcfl_aggregate, gcfl_correct


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
    a = build_strategy(RunConfig(strategy="gcfl", gcfl_references=2))
    b = build_strategy(RunConfig(strategy="gcfl", gcfl_references=2))
    assert [a.draw_references(10) for _ in range(3)] == [b.draw_references(10) for _ in range(3)]
    assert build_strategy(RunConfig(strategy="gcfl", gcfl_references=5)).draw_references(2) == [0] \
        or build_strategy(RunConfig(strategy="gcfl", gcfl_references=5)).draw_references(2) == [1]


def test_fedexp_step_size_closed_form():
    opposed = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert fedexp_step_size(opposed, 1e-3) == pytest.approx(2.0 / (2 * 2 * 1e-3))
    same = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert fedexp_step_size(same, 1e-3) == 1.0  # 2 / (4 (1 + eps)) < 1 -> clipped to 1
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert fedexp_step_size(torch.randn(5, 30, generator=g), 1e-3) >= 1.0
    u = torch.tensor([[3.0, 0.0], [0.0, 4.0]])  # sum ||.||^2 = 25, mean (1.5, 2) -> 6.25
    assert fedexp_step_size(u, 0.0 + 1e-12) == pytest.approx(25 / (2 * 2 * 6.25), rel=1e-9)


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
