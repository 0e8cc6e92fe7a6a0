"""AADP-FL over Opacus DP-SGD (sample level): each round's eps_i^t (eqs. 2-3) calibrates
the round's noise multiplier (checked against dp-accounting), client and server plan the
same round, the real ClientApp's reply carries that DP-SGD event, the Rényi filter at
target-epsilon refuses the round that would pass it, and the guarantee says so."""

import math

import dp_accounting
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from flwr.app import ArrayRecord, ConfigRecord
from opacus.accountants import RDPAccountant

from dpfl.errors import UserError
from dpfl.methods import build_strategy, guarantee, parse_run_config, run_config
from dpfl.methods.aadp import DPSGD_ROUND_EXTRA_ORDERS, aadp_plan, dpsgd_round_noise_multiplier
from dpfl.models import build_model
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.filter import RenyiFilter
from dpfl.privacy.plan import PlanInputs, plan_problem, planned_event

D = 1e-5


def _cfg(**kw):
    return run_config(strategy="aadp", trainer="dpsgd", **kw)


def _round_event(sigma: float, n: int, batch: int, epochs: int):
    """One client's DP-SGD round, written out for dp-accounting: E ceil(n / B) steps of a
    Gaussian of multiplier sigma on a Poisson(1 / ceil(n / B)) sample."""
    k = math.ceil(n / batch)
    step = dp_accounting.PoissonSampledDpEvent(1.0 / k, dp_accounting.GaussianDpEvent(sigma))
    return dp_accounting.SelfComposedDpEvent(step, epochs * k)


@pytest.mark.parametrize("eps,n,batch,epochs", [(0.3, 1000, 64, 1), (1.0, 2000, 32, 2),
                                                (4.0, 1700, 256, 1)])
def test_round_sigma_costs_the_round_epsilon_by_dp_accounting(eps, n, batch, epochs):
    """dp-accounting's RDP accountant (at the filter's orders, Opacus') puts the calibrated
    round at eps_i^t (rel. 2e-4), a sigma 0.1 % smaller above it (the smallest sigma), and
    its PLD accountant at or below it (RDP is the looser bound, the filter's)."""
    sigma = dpsgd_round_noise_multiplier(_cfg(batch_size=batch, local_epochs=epochs), eps, n)

    def rdp_eps(s):
        acc = rdp_privacy_accountant.RdpAccountant(orders=list(RDPAccountant.DEFAULT_ALPHAS))
        acc.compose(_round_event(s, n, batch, epochs))
        return acc.get_epsilon(D)

    assert rdp_eps(sigma) == pytest.approx(eps, rel=2e-4)
    assert rdp_eps(sigma * (1 - 1e-3)) > eps
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(_round_event(sigma, n, batch, epochs))
    assert pld.get_epsilon(D) <= eps


def test_a_round_below_the_order_63_floor_still_gets_its_sigma():
    """At delta 1e-5 no sigma brings one round below eps 0.103 at Opacus' orders (they stop
    at 63), and eq. 2 gives small clients less than that at a whole-run eps of 1 (the
    frontier's MNIST eps-1 cell crashed on it). The round's sigma is searched over Opacus'
    orders and higher ones: dp-accounting's RDP accountant at those orders puts the round at
    eps_i^t, while Opacus' orders alone still measure it at their floor or above."""
    cfg = _cfg(batch_size=256)
    n = 200                                # n <= B: q = 1, one step (a plain Gaussian)
    extended = list(RDPAccountant.DEFAULT_ALPHAS) + list(DPSGD_ROUND_EXTRA_ORDERS)
    sigma = dpsgd_round_noise_multiplier(cfg, 0.05, n)

    def rdp_eps(s, orders):
        acc = rdp_privacy_accountant.RdpAccountant(orders=orders)
        acc.compose(_round_event(s, n, 256, 1))
        return acc.get_epsilon(D)

    assert rdp_eps(sigma, extended) == pytest.approx(0.05, rel=2e-4)
    assert rdp_eps(sigma * (1 - 1e-3), extended) > 0.05
    assert rdp_eps(sigma, list(RDPAccountant.DEFAULT_ALPHAS)) >= 0.103


def test_a_per_round_epsilon_no_sigma_reaches_stops_the_run_at_start():
    """eq. 2 at aadp-epsilon 1e-4 gives every client ~1e-4 per round, below the search's
    floor (~3.5e-3 at order 1024): the strategy refuses when it learns the sizes, naming the
    key; eq. 3 only raises eps_i^t later, so round 1 is the one to check."""
    cfg = _cfg(batch_size=256, aadp_epsilon=1e-4)
    with pytest.raises(UserError, match="run-config key 'aadp-epsilon'.*partition 0"):
        build_strategy(cfg, {0: 200, 1: 200})
    # eps_i 0.033 and 0.067: below 0.103, fine
    ok = build_strategy(_cfg(batch_size=256, aadp_epsilon=0.05), {0: 100, 1: 200})
    assert ok.release_plan(0, 1).sigma > ok.release_plan(1, 1).sigma > 0


def test_a_round_at_the_target_is_admitted_alone_and_not_twice():
    """The calibration uses the filter's own RDP: one round at eps_i^t = target-epsilon
    fits the filter, a second one does not."""
    cfg = _cfg(batch_size=64, target_epsilon=2.0)
    n = 700
    sigma = dpsgd_round_noise_multiplier(cfg, 2.0, n)
    round_ = [planned_event(cfg, n, 1, sigma)]
    assert round_[0].mechanism == "dpsgd" and round_[0].sigma == sigma
    filt = RenyiFilter(2.0, D, "sample")
    assert filt.admits(round_)
    assert not filt.admits(round_ + [planned_event(cfg, n, 2, sigma)])


def test_client_and_server_plan_the_same_dpsgd_round_across_rounds_and_sizes():
    """Three partitions of different sizes, three rounds with an eq. 3 raise between the
    second and the third: the client's plan (from the eps_i^t the ConfigRecord carries and
    its own size, the method's plan function over the ConfigRecord as received) equals the
    server's (from the config it sent)."""
    cfg = _cfg(batch_size=64, local_epochs=2, aadp_epsilon=1.0, aadp_eps_max=5.0)
    sizes = {0: 1000, 1: 1700, 2: 333}
    strategy = build_strategy(cfg, sizes)
    model = build_model("mlp", (1, 8, 8), 10)
    params = sum(p.numel() for p in model.parameters())
    sigmas, sent = {}, {}
    for rnd in (1, 2, 3):
        config = ConfigRecord({"server-round": rnd, **strategy.send_config(rnd)})
        sent[rnd] = dict(zip(config["aadp-partition"], config["aadp-epsilon"]))
        for pid, n in sizes.items():
            server = strategy.planned_event(pid, rnd)
            client = aadp_plan(cfg, PlanInputs(rnd, config, pid, n, params)).event_for(
                cfg, n, rnd)
            assert plan_problem(client, server) is None, (rnd, pid)
            assert server.mechanism == "dpsgd" and server.relation == "add-remove"
            assert server.sigma == dpsgd_round_noise_multiplier(cfg, sent[rnd][pid], n)
            sigmas[rnd, pid] = server.sigma
        if rnd < 3:   # the moments are stable after the second step: raise once
            strategy.server_step(torch.zeros(3), torch.full((3,), 1e-2))
    assert strategy.raised_at == [2]
    # more data -> larger eps_i (eq. 2); the raise (x 1/rho) -> less noise in round 3
    assert sent[1][1] > sent[1][0] > sent[1][2]
    assert sigmas[1, 0] == sigmas[2, 0] > sigmas[3, 0]
    assert sent[3][0] == pytest.approx(10 * sent[2][0])


DIGITS = {"dataset": "digits", "model": "mlp", "batch-size": 64, "lr": 0.1, "num-rounds": 2,
          "strategy": "aadp", "trainer": "dpsgd", "target-epsilon": 2.0,
          "aadp-epsilon": 1.8, "fraction-train": 1.0, "min-train-nodes": 2}


def test_client_app_sends_the_planned_dpsgd_round_then_the_filter_refuses(server_identity):
    """The real ClientApp, two digits clients: round 1 at eps_i^1 ~ 1.8 <= 2 is trained
    with DP-SGD at the planned sigma, its event is sample-level DP-SGD, the server accepts
    and charges it in an adaptive history (guarantee: the filter's budget); round 2 would
    take the filter past target-epsilon 2: every client refuses it and spends nothing."""
    from dpfl.apps.client import train
    from dpfl.apps.server import _adaptive_claim
    from dpfl.data import splits_for
    from dpfl.privacy.accounting.budget import BUDGET_REFUSAL
    from dpfl.privacy.accounting.ledger import Ledger

    from flower_helpers import context, message

    cfg = parse_run_config(DIGITS)
    sizes = {i: len(s.train) for i, s in enumerate(splits_for(cfg, 2))}
    ledger = Ledger(cfg.delta, cfg.accountant, budget=cfg.target_epsilon)
    strategy = build_strategy(cfg, sizes, ledger=ledger)

    class Grid:
        def get_node_ids(self):
            return [11, 12]

    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    contexts = {pid: context(DIGITS, pid, 2) for pid in (0, 1)}
    messages, record = strategy.start_round(1, ArrayRecord(model.state_dict()), Grid())
    replies, events = [], {}
    for pid, m in enumerate(messages):
        node = int(m.metadata.dst_node_id)
        reply = train(message(m.content, 0, node), contexts[pid])
        assert "status" not in reply.content.config_records, dict(reply.content["status"])
        eps_round = dict(zip(strategy.sent_configs[1]["aadp-partition"],
                             strategy.sent_configs[1]["aadp-epsilon"]))[pid]
        assert 1.5 < eps_round <= cfg.target_epsilon   # eq. 2 over near-equal sizes
        sigma = dpsgd_round_noise_multiplier(cfg, eps_round, sizes[pid])
        privacy = reply.content["privacy"]
        assert privacy["mechanism"] == ["dpsgd"] and privacy["relation"] == ["add-remove"]
        assert privacy["sigma"] == [sigma] and privacy["adaptive"] is True
        assert privacy["sigma"][0] == strategy.planned_event(pid, 1).sigma
        assert reply.content["metrics"]["noise-multiplier"] == sigma
        events[pid] = PrivacyEvent(1, **{k: privacy[k][0] for k in
                                         ("mechanism", "sigma", "rate", "steps", "epsilon",
                                          "relation")})
        replies.append(message(reply.content, src_node_id=node))
    outcome = strategy.finish_round(1, record, replies)
    assert len(outcome.record.accepted) == 2, [r.reason for r in outcome.record.rejected]
    assert all(c.problem is None for c in outcome.record.charges)
    claim = _adaptive_claim(ledger, "client-0", cfg)
    assert claim["guaranteed-epsilon"] == 2.0 and claim["epsilon-is"].startswith("informative")

    messages, record = strategy.start_round(2, outcome.arrays, Grid())
    replies = []
    for pid, m in enumerate(messages):
        node = int(m.metadata.dst_node_id)
        # the independent check: the filter would not admit a second such round
        second = planned_event(cfg, sizes[pid], 2, strategy.planned_event(pid, 2).sigma)
        assert not RenyiFilter(2.0, D, "sample").admits([events[pid], second])
        reply = train(message(m.content, 0, node), contexts[pid])
        status = reply.content["status"]
        assert status["status"] == "refused"
        assert status["reason"].startswith(BUDGET_REFUSAL) and "Rényi filter" in status["reason"]
        assert "arrays" not in reply.content.array_records
        replies.append(message(reply.content, src_node_id=node))
    outcome = strategy.finish_round(2, record, replies)
    assert not outcome.record.accepted and not outcome.record.charges
    assert {r.kind for r in outcome.record.rejected} == {"refused"}
    assert [len(ledger.history(f"client-{p}").events) for p in (0, 1)] == [1, 1]


def test_guarantee_is_sample_level_with_the_filter_budget():
    g = guarantee(_cfg(target_epsilon=3.0))
    assert g.verdict == "formal"
    assert (g.unit, g.relation, g.sampling, g.delta) == ("sample", "add-remove", "poisson", D)
    assert "Rényi filter at (epsilon 3.0, delta 1e-05)" in g.scope
    assert "informative" in g.scope and "Opacus' L2 clip" in g.scope
    update = guarantee(run_config(strategy="aadp", trainer="update-dp"))
    assert update.unit == "client" and "longitudinal clipping keeps" in update.scope
