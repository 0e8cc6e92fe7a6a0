"""DP-FedASGP over DP-SGD (dpfl/methods/fedasgp.py, sample level): eq. 14's selection on a
hand-worked noisy update and against a numpy sort on random ones, eq. 16's weights with the
server's validation-loss proxy for L_i worked by hand, the shared DP-SGD plan and norm
bound, the reply checks, the guarantee, config errors, and one round through the real
ClientApp: the reply carries a DP-SGD event (sample level) and no clear loss or count."""

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from torch import nn

from dpfl.apps.client import train
from dpfl.config import ConfigError
from dpfl.data import splits_for
from dpfl.methods import METHODS, build_strategy, guarantee, parse_run_config, run_config
from dpfl.methods.fedasgp import (
    LOSS_KEY,
    SIGNIFICANT_KEY,
    dpsgd_release,
    kept_count,
    significant_indices,
)
from dpfl.models import build_model
from dpfl.privacy.accounting.ledger import Ledger
from dpfl.privacy.plan import PlanInputs, planned_event
from dpfl.server.strategy import RoundContext, RoundRecord
from dpfl.server.validation import PUBLIC_REPLY_METRICS, TRAIN_LOSS_METRIC, ClientUpdate
from dpfl.tensors import flatten

from flower_helpers import context, message


def _cfg(**kw):
    return run_config(strategy="fedasgp", trainer="dpsgd", dataset="digits", model="mlp",
                      server_holdout=kw.pop("server_holdout", 20), **kw)


# -- eq. 14 on the noisy DP-SGD update ---------------------------------------------------------

# a noisy g = -Delta / lr; |g| ascending: 0, 0.05, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7
G = torch.tensor([0.5, -0.1, 0.3, -0.7, 0.05, 0.2, -0.4, 0.6, 0.0, -0.25])


@pytest.mark.parametrize("t,m,kept", [
    (1, 9, [0, 1, 2, 3, 4, 5, 6, 7, 9]),   # k = ceil(10/5) = 2, lambda = 0.05: all but 0.0
    (3, 5, [0, 2, 3, 6, 7]),               # k = 6, lambda = 0.3: 0.5, 0.3, -0.7, -0.4, 0.6
    (4, 3, [0, 3, 7]),                     # k = 8, lambda = 0.5: 0.5, -0.7, 0.6
    (5, 2, [3, 7]),                        # k = min(10, 9) = 9, lambda = 0.6: -0.7, 0.6
])
def test_selection_on_a_hand_worked_noisy_update(t, m, kept):
    lr = 0.5
    update = -lr * G                       # the DP-SGD update Delta = -lr g
    assert kept_count(10, t, 5) == m
    assert significant_indices(G, t, 5).tolist() == kept
    released = dpsgd_release(update, lr, t, 5)
    expected = torch.zeros(10)
    expected[kept] = update[kept]
    assert torch.allclose(released, expected, rtol=1e-6, atol=0)
    assert int(torch.count_nonzero(released)) == m


@pytest.mark.parametrize("seed", range(3))
def test_selection_is_the_threshold_rule_against_a_numpy_sort(seed):
    """On tie-free vectors the kept set is {j : |g_j| >= lambda_t}, lambda_t the
    min(ceil(t d / T), ceil(9 d / 10))-th smallest |g_j| (1-based), from numpy."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(5_003).astype(np.float32)
    for t, T in ((1, 20), (7, 20), (20, 20), (3, 3)):
        k = min(math.ceil(t * g.size / T), math.ceil(9 * g.size / 10))
        lam = np.sort(np.abs(g))[k - 1]
        expected = np.flatnonzero(np.abs(g) >= lam)
        assert significant_indices(torch.from_numpy(g), t, T).tolist() == expected.tolist()


def test_release_keeps_exactly_m_under_ties_and_zeroes_a_diverged_update():
    tied = torch.ones(10)                   # every |g_j| equals lambda_t
    assert int(torch.count_nonzero(dpsgd_release(tied, 0.1, 3, 5))) == kept_count(10, 3, 5)
    diverged = torch.tensor([1.0, float("nan"), 2.0, 3.0])
    assert torch.equal(dpsgd_release(diverged, 0.1, 1, 2), torch.zeros(4))


# -- eq. 16 with the server's proxy losses, by hand ----------------------------------------------

def _tiny_strategy(x, y, sizes):
    model = nn.Sequential(nn.Flatten(), nn.Linear(2, 2, bias=False))
    nn.init.zeros_(model[1].weight)
    strategy = build_strategy(_cfg(num_rounds=2), sizes, model=model)
    strategy.val = (x, y)                       # the server's validation split
    strategy._global = ArrayRecord(model.state_dict())   # w_t = 0
    strategy.round = RoundContext(1, {})
    return strategy


def _update(pid, flat):
    return ClientUpdate(node_id=pid + 1, partition_id=pid, flat=flat, num_examples=1,
                        metrics={})


def test_eq16_weights_with_the_validation_loss_proxy_by_hand():
    """w_t = 0 (a 2 x 2 linear layer, no bias), server split x = I, y = (0, 1).
    Delta_0 = I: logits (1, 0) and (0, 1), both right: L_0 = log(1 + e^-1).
    Delta_1 = [[-1, 0], [0, 0]]: logits (-1, 0) with y = 0 gives log(1 + e); (0, 0) gives
    log 2: L_1 = (log(1 + e) + log 2) / 2. Sizes n = (100, 300): gamma_i =
    (n_i L + n L_i) / (2 n L) with L = L_0 + L_1, n = 400."""
    strategy = _tiny_strategy(torch.eye(2), torch.tensor([0, 1]), {0: 100, 1: 300})
    updates = [_update(0, torch.tensor([1.0, 0.0, 0.0, 1.0])),
               _update(1, torch.tensor([-1.0, 0.0, 0.0, 0.0]))]
    assert [strategy.reply_problem(u) for u in updates] == [None, None]
    l0 = math.log(1 + math.exp(-1))
    l1 = (math.log(1 + math.e) + math.log(2)) / 2
    total = l0 + l1
    gamma = [(100 * total + 400 * l0) / (800 * total), (300 * total + 400 * l1) / (800 * total)]
    assert gamma == pytest.approx([0.243978, 0.756022], abs=1e-6)
    assert strategy.aggregation_weights(updates).tolist() == pytest.approx(gamma, rel=1e-6)
    metrics = strategy.round_metrics(RoundRecord(1, accepted=updates))
    assert metrics["asgp-proxy-loss-mean"] == pytest.approx((l0 + l1) / 2, rel=1e-6)
    assert metrics["asgp-gamma-client-1"] == pytest.approx(gamma[1], rel=1e-6)
    assert metrics["asgp-significant-fraction"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert "asgp-round-epsilon" not in metrics       # no pure event under dpsgd


def test_reply_checks_under_dpsgd():
    """At most m_t non-zero coordinates (d = 4, T = 2, t = 1: k = 2, m = 3); a reply whose
    proxy loss is not finite (logit 6e38 overflows float32) is rejected; n_i must be known."""
    strategy = _tiny_strategy(torch.ones(1, 2), torch.tensor([1]), {0: 100})
    assert "non-zero coordinates > m_t = 3" in strategy.reply_problem(
        _update(0, torch.ones(4)))
    assert "L_i's proxy" in strategy.reply_problem(
        _update(0, torch.tensor([3e38, 3e38, 0.0, 0.0])))
    assert "unknown" in strategy.reply_problem(_update(5, torch.zeros(4)))
    assert strategy.reply_problem(_update(0, torch.tensor([0.5, 0.0, 0.0, -0.5]))) is None


# -- plan, bound, guarantee, configuration --------------------------------------------------------

def test_the_plan_and_norm_bound_are_the_shared_dpsgd_ones():
    cfg = _cfg(target_epsilon=4.0)
    method = METHODS["fedasgp"]
    assert method.plan(cfg, PlanInputs(1, {}, 0, 500, 0)).event is None
    strategy = build_strategy(cfg, {0: 500, 1: 700})
    assert strategy.release_plan(0, 1).event is None
    assert strategy.planned_event(1, 2) == planned_event(cfg, 700, 2)
    assert strategy.planned_event(1, 2).mechanism == "dpsgd"
    assert strategy.update_norm_bound(1000, 1) is None
    assert strategy.guard.norm_bound(1000, 1) == strategy.guard.dpsgd_bound(1000, 1)
    assert strategy.released_metrics() == frozenset()


def test_guarantee_under_dpsgd_is_sample_level_and_formal():
    g = guarantee(_cfg())
    assert (g.verdict, g.unit, g.relation, g.sampling) == ("formal", "sample", "add-remove",
                                                           "poisson")
    assert "DP-SGD events are the whole release" in g.scope and "eq. 14" in g.scope
    assert "Laplace" not in g.scope and "sparse vector" not in g.scope
    assert guarantee(_cfg(report_train_loss=True)).verdict.startswith("none: train-loss")


@pytest.mark.parametrize("key,value", [
    ("asgp-variant", "paper"), ("asgp-epsilon", 2.0), ("asgp-eps3-share", 0.5),
    ("asgp-q", 1.0), ("asgp-max-coords", 10), ("asgp-threshold", 0.1), ("asgp-noise", "paper"),
])
def test_update_dp_keys_are_refused_under_dpsgd(key, value):
    with pytest.raises(ConfigError, match=f"^run-config key '{key}': .*trainer=dpsgd"):
        _cfg(**{key.replace("-", "_"): value})
    run_config(strategy="fedasgp", trainer="update-dp", **{key.replace("-", "_"): value})


def test_dpsgd_needs_the_servers_split_and_plain_sgd():
    with pytest.raises(ConfigError, match="^run-config key 'server-holdout'"):
        _cfg(server_holdout=0)
    with pytest.raises(ConfigError, match="^run-config key 'momentum'"):
        _cfg(momentum=0.9)
    assert _cfg().server_holdout == 20


# -- one round through the real ClientApp -------------------------------------------------------

def test_client_app_reply_carries_a_dpsgd_event_and_no_clear_loss_or_count(server_identity):
    raw = {"dataset": "digits", "model": "mlp", "batch-size": 64, "lr": 0.1,
           "num-rounds": 2, "target-epsilon": 8.0, "strategy": "fedasgp",
           "trainer": "dpsgd", "server-holdout": 50}
    cfg = parse_run_config(raw)
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    strategy = build_strategy(cfg, {i: len(s.train) for i, s in enumerate(splits_for(cfg, 2))},
                              model=model, ledger=Ledger(cfg.delta, cfg.accountant, budget=8.0))

    class Grid:
        def get_node_ids(self):
            return [11, 12]

    messages, record = strategy.start_round(1, ArrayRecord(model.state_dict()), Grid())
    replies = []
    for pid, m in enumerate(messages):
        node = int(m.metadata.dst_node_id)
        reply = train(message(m.content, 0, node), context(raw, pid, 2))
        assert "status" not in reply.content.config_records, dict(reply.content["status"])
        privacy = reply.content["privacy"]
        assert privacy["mechanism"] == ["dpsgd"] and privacy["relation"] == ["add-remove"]
        assert 0 < privacy["rate"][0] < 1 and privacy["steps"][0] >= 1
        metrics = set(reply.content["metrics"].keys())
        assert metrics <= PUBLIC_REPLY_METRICS, metrics - PUBLIC_REPLY_METRICS
        assert not metrics & {TRAIN_LOSS_METRIC, LOSS_KEY, SIGNIFICANT_KEY}
        flat = flatten(reply.content["arrays"].to_torch_state_dict())
        assert 0 < int(torch.count_nonzero(flat)) <= kept_count(flat.numel(), 1, 2)
        replies.append(message(reply.content, src_node_id=node))
    outcome = strategy.finish_round(1, record, replies)
    assert len(outcome.record.accepted) == 2, [r.reason for r in outcome.record.rejected]
    charged = [e for c in outcome.record.charges for e in c.events]
    assert len(charged) == 2 and all(c.problem is None for c in outcome.record.charges)
    assert {(e.mechanism, e.relation) for e in charged} == {("dpsgd", "add-remove")}
    out = dict(outcome.metrics)
    assert out["asgp-gamma-client-0"] + out["asgp-gamma-client-1"] == pytest.approx(1.0)
    assert math.isfinite(out["asgp-proxy-loss-mean"]) and out["asgp-proxy-loss-mean"] > 0
    assert out["asgp-significant-fraction"] <= kept_count(flat.numel(), 1, 2) / flat.numel()
