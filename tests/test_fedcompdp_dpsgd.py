"""FedCompDP over DP-SGD (sample level): the server's per-sample clip update from noisy
unclipped fractions, eq. 2 on each step's noised gradient against a per-sample loop, the
real ClientApp's reply (a DP-SGD event at the planned sigma, the fraction, nothing in the
clear) accepted by the guard under the round's C_t and the raised gradient noise, and the
refused readings."""

import math
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord
from scipy.stats import binom

from dpfl.apps.client import train
from dpfl.client.trainers import train_dpsgd
from dpfl.config import ConfigError
from dpfl.data import ClientData, splits_for
from dpfl.methods import build_strategy, guarantee, method_for, parse_run_config, run_config
from dpfl.methods.fedcompdp import (
    CLIP_KEY,
    FedCompDPClient,
    dpsgd_update_scale,
    fedcompdp_plan,
    pooled_fraction,
    sparsify_threshold,
    unclipped_fraction_range,
)
from dpfl.models import build_model
from dpfl.privacy.accounting.ledger import Ledger
from dpfl.privacy.plan import (
    UNCLIPPED_FRACTION,
    PlanInputs,
    dpsgd_norm_bound,
    planned_dpsgd_steps,
    planned_event,
)
from dpfl.server.validation import PUBLIC_REPLY_METRICS, ClientUpdate
from dpfl.tensors import flatten

from flower_helpers import context, message

BASE = dict(strategy="fedcompdp", trainer="dpsgd", dataset="digits", model="mlp",
            server_holdout=20, llcm_ratio=0.0, target_epsilon=4.0, num_rounds=3,
            batch_size=32)


def cfg(**changes):
    return run_config(**{**BASE, **changes})


def update(pid, n, flat=(0.0,), **metrics):
    return ClientUpdate(node_id=10 + pid, partition_id=pid,
                        flat=torch.as_tensor(flat, dtype=torch.float32), num_examples=n,
                        metrics=metrics)


# -- ADPC at sample level: C_{t+1} = C_t exp(-eta (b~ - gamma)) --------------------------------

def test_server_clip_update_from_hand_worked_fractions():
    """Round 1 at C_0 = max-grad-norm 2: fractions 0.9 (n = 100) and 0.3 (n = 300) pool to
    (90 + 90) / 400 = 0.45 < gamma 0.5, so C_1 = 2 exp(0.2 x 0.05) = 2 e^0.01 (grows);
    round 2: 1.0 and 0.8 at equal sizes pool to 0.9, C_2 = C_1 e^(-0.08); the plan and the
    guard's planned clip follow the round's C_t."""
    s = build_strategy(cfg(max_grad_norm=2.0), {0: 100, 1: 300})
    assert s.send_config(1) == {CLIP_KEY: 2.0} and s.guard.planned_clip(1) == 2.0
    s.after_aggregation([update(0, 100, **{UNCLIPPED_FRACTION: 0.9}),
                         update(1, 300, **{UNCLIPPED_FRACTION: 0.3})])
    assert s.last_fraction == pytest.approx(0.45)
    assert s.clip == pytest.approx(2.0 * math.exp(0.01))
    assert s.send_config(2) == {CLIP_KEY: pytest.approx(2.0 * math.exp(0.01))}
    assert s.guard.planned_clip(2) == pytest.approx(2.0 * math.exp(0.01))
    assert s.guard.planned_clip(1) == 2.0
    s.after_aggregation([update(0, 200, **{UNCLIPPED_FRACTION: 1.0}),
                         update(1, 200, **{UNCLIPPED_FRACTION: 0.8})])
    assert s.clip == pytest.approx(2.0 * math.exp(0.01) * math.exp(-0.08))
    assert pooled_fraction([0.2, 0.6], [1, 3]) == pytest.approx(0.5)


def test_clip_is_bounded_and_fixed_without_adpc():
    s = build_strategy(cfg(adpc_max_clip=2.5, adpc_lr=10.0), {0: 10})
    s.after_aggregation([update(0, 10, **{UNCLIPPED_FRACTION: -0.5})])   # all clipped
    assert s.clip == 2.5
    off = build_strategy(cfg(adpc="off", max_grad_norm=0.7))
    off.after_aggregation([update(0, 10)])
    assert off.clip == 0.7 and off.released_metrics() == frozenset()


# -- eq. 2 on the noised gradient --------------------------------------------------------------

def _tiny_data(n=16):
    g = torch.Generator().manual_seed(0)
    return ClientData(torch.randn(n, 1, 8, 8, generator=g),
                      torch.randint(0, 10, (n,), generator=g),
                      torch.empty(0, 1, 8, 8), torch.empty(0, dtype=torch.long), 10)


@pytest.mark.parametrize("reading", ["small", "large"])
def test_sparsification_of_the_noised_step_against_a_per_sample_loop(reading):
    """sigma = 0, q = 1 (batch = n = 16), one step at lr 1, the round's per-sample clip C_t
    = 0.05 sent in the config: the update is exactly -sparsify((1/n) sum_i clip(g_i, C_t),
    tau) (eq. 2 after DP-SGD's mean; here computed with a plain per-sample loop), through the
    client half's own hook and ``train_dpsgd(..., noisy_grad=...)``."""
    data = _tiny_data(16)
    config = {"server-round": 1, CLIP_KEY: 0.05}
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    ref = build_model("mlp", (1, 8, 8), 10)
    ref.load_state_dict(model.state_dict())
    clipped = []
    for i in range(16):
        ref.zero_grad()
        torch.nn.functional.cross_entropy(ref(data.x_train[i:i + 1]),
                                          data.y_train[i:i + 1]).backward()
        g = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        clipped.append(g * min(1.0, 0.05 / (float(g.norm()) + 1e-6)))
    mean = torch.stack(clipped).mean(0)
    # tau in the widest gap between the middle half's sorted magnitudes: no entry sits near
    # it, so float rounding between the two computations cannot flip one
    v = mean.abs().sort().values
    lo, hi = len(v) // 4, 3 * len(v) // 4
    i = lo + int((v[lo + 1:hi + 1] - v[lo:hi]).argmax())
    tau = float(v[i] + v[i + 1]) / 2
    keep = mean.abs() >= tau if reading == "small" else mean.abs() <= tau
    expected = -(mean * keep)
    half = FedCompDPClient()
    c = cfg(batch_size=16, lr=1.0, sparsify=reading, sparsify_tau=tau, sparsify_decay=1.0)
    assert sparsify_threshold(tau, 1.0, 1) == tau
    hooks = half.hooks(c, SimpleNamespace(content={"config": config}), None, model)
    assert hooks.pre_step is None and hooks.step is None and hooks.noisy_grad is not None
    before = flatten(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    train_dpsgd(model, data, c, 0.0, gen, gen, torch.device("cpu"),
                clip=fedcompdp_plan(c, PlanInputs(1, config, 0, None, 0)).round_clip(c), noisy_grad=hooks.noisy_grad)
    step = flatten(model.state_dict()) - before
    assert 0 < int((step != 0).sum()) < step.numel()
    assert torch.allclose(step, expected, atol=1e-6)


def test_no_sparsification_no_hook():
    hooks = FedCompDPClient().hooks(cfg(sparsify="none"),
                                    SimpleNamespace(content={"config": {}}), None, None)
    assert hooks.noisy_grad is None and hooks.pre_step is None


# -- the honest range of the fraction and the guard ------------------------------------------

def test_fraction_range_on_a_hand_case():
    """q = 1 (batch 16 = n), T = 4: at most 4 x 16 + 1 over the round (the 1e-12 quantile
    of Binomial(64, 1) is 64), divided by T n q = 64; noise N(0, T s^2) / (T n q) with
    s = 2: 10 stds = 10 x 2 x 2 / 64."""
    low, high = unclipped_fraction_range(16, 0, 1.0, 4, 2.0)
    assert low == pytest.approx(-0.625)
    assert high == pytest.approx(65 / 64 + 0.625)
    low, high = unclipped_fraction_range(1000, 5, 0.1, 10, 5.0)
    total_max = binom.isf(1e-12, 10 * 1005, 0.1) + 1
    assert high == pytest.approx(total_max / 1000 + 10 * 5.0 / (math.sqrt(10) * 100))
    assert 1.0 < total_max / 1000 < 1.25


def test_replies_missing_or_outside_the_honest_fraction_range_are_rejected():
    s = build_strategy(cfg(), {0: 500})
    low, high = s.fraction_range(0)
    assert low < 0 < 1 < high < 2.5
    assert s.reply_problem(update(0, 500, **{UNCLIPPED_FRACTION: 0.4})) is None
    assert "missing" in s.reply_problem(update(0, 500))
    for bad in (high + 0.01, low - 0.01, math.nan, math.inf):
        assert "outside" in s.reply_problem(update(0, 500, **{UNCLIPPED_FRACTION: bad}))
    assert "no public size" in s.reply_problem(update(7, 500, **{UNCLIPPED_FRACTION: 0.4}))


def test_norm_bound_uses_the_rounds_clip_and_the_raised_gradient_noise():
    """The guard's DP-SGD bound at C_t and sigma_g = sigma (1 - 1/25)^(-1/2) (count std
    5 sigma), the loosest over partitions; adpc=off: the planned sigma and max-grad-norm."""
    c = cfg(max_grad_norm=1.0)
    sizes = {0: 120, 1: 400}
    s = build_strategy(c, sizes)
    s.send_config(1)
    s.clip = 0.3
    s.send_config(2)
    scale = (1 - 1 / 25) ** -0.5
    assert s.guard.noise_scale(2) == pytest.approx(scale)

    def hand(clip, factor):
        return max(dpsgd_norm_bound(c, n, planned_event(c, n, 2).sigma * factor,
                                    planned_dpsgd_steps(n, c), 1000, clip=clip)
                   for n in sizes.values())
    assert s.guard.norm_bound(1000, 2) == pytest.approx(hand(0.3, scale))
    assert s.guard.norm_bound(1000, 1) == pytest.approx(hand(1.0, scale))
    off = build_strategy(cfg(max_grad_norm=1.0, adpc="off"), sizes)
    off.send_config(1)
    assert off.guard.norm_bound(1000, 1) == pytest.approx(hand(1.0, 1.0))


def test_an_absolute_count_std_must_exceed_every_planned_sigma():
    s = build_strategy(cfg(adpc_count_stddev=1e3), {0: 120, 1: 400})
    sigma = planned_event(s.cfg, 120, 1).sigma            # the smaller partition: noisier
    assert s.guard.noise_scale(1) == pytest.approx((1 - (sigma / 1e3) ** 2) ** -0.5)
    with pytest.raises(ConfigError, match="adpc-count-stddev"):
        build_strategy(cfg(adpc_count_stddev=0.5), {0: 120, 1: 400})


def test_primal_dual_rho_is_in_units_of_the_noise_free_update():
    c = cfg(lr=0.05, momentum=0.5, cd_rho=2.0, max_grad_norm=0.8)
    s = build_strategy(c, {0: 100, 1: 640})
    steps = planned_dpsgd_steps(640, c)                    # the larger partition: 20 steps
    assert steps == 20
    assert s.rho() == pytest.approx(2.0 * 0.05 * 20 * 0.8 / 0.5)
    assert dpsgd_update_scale(0.05, 20, 0.8, 0.5) == pytest.approx(1.6)


def test_without_cra_the_weights_are_the_public_sizes():
    s = build_strategy(cfg(cra=False))
    weights = s.aggregation_weights([update(0, 100), update(1, 300)])
    assert weights.tolist() == [100.0, 300.0]


# -- configuration and the guarantee -----------------------------------------------------------

@pytest.mark.parametrize("changes,key", [
    (dict(adpc="raw-norm"), "adpc"),
    (dict(adpc="noisy-norm"), "adpc"),
    (dict(cra_score="client-f1", client_f1_noise=1.0), "cra-score"),
    (dict(local_grad_clip=False), "local-grad-clip"),
    (dict(opacus_mode="ghost"), "opacus-mode"),
])
def test_refused_readings_under_dpsgd(changes, key):
    for check in (build_strategy, guarantee):
        with pytest.raises(ConfigError, match=f"'{key}'"):
            check(cfg(**changes))


@pytest.mark.parametrize("changes", [
    {}, dict(adpc="off"), dict(cra=False), dict(sparsify="none"),
    dict(adpc="off", opacus_mode="ghost"), dict(cra_score="client-f1", cra=False),
])
def test_the_ablations_run_under_dpsgd_with_a_formal_sample_level_guarantee(changes):
    c = cfg(**changes)
    build_strategy(c)
    g = guarantee(c)
    assert g.verdict == "formal"
    assert (g.unit, g.relation, g.sampling) == ("sample", "add-remove", "poisson")
    assert ("unclipped per-sample" in g.scope) == (c.params.adpc == "private-quantile")


def test_llcm_channel_reduction_trains_under_book_keeping_dpsgd():
    """LLCM (a) is a bias-free 1x1 conv inside the model: DP-SGD (opacus-mode=bk) clips
    its per-sample gradients with the rest, and its weight moves."""
    c = cfg(model="mnist-cnn", llcm_ratio=0.5, batch_size=8, lr=0.5)
    model = method_for(c).build_model(c, (1, 28, 28), 10)
    gen = torch.Generator().manual_seed(0)
    data = ClientData(torch.randn(8, 1, 28, 28, generator=gen),
                      torch.randint(0, 10, (8,), generator=gen),
                      torch.empty(0, 1, 28, 28), torch.empty(0, dtype=torch.long), 10)
    w = model.features[3].weight
    assert w.shape[:2] == (8, 16)
    before = w.detach().clone()
    train_dpsgd(model, data, c, 0.0, gen, gen, torch.device("cpu"), clip=1.0)
    assert not torch.equal(model.features[3].weight, before)


# -- the real ClientApp --------------------------------------------------------------------------

def test_client_app_reply_is_dpsgd_at_the_plan_with_the_fraction_and_accepted(server_identity):
    """Two digits clients train one round through dpfl's ClientApp at C_1 = 0.6 (not
    max-grad-norm): each reply states one sample-level DP-SGD event at the PLANNED sigma
    (the raised gradient noise is not what is charged), the clip C_1, the noisy unclipped
    fraction (a noised count: not a ratio of integers over T n q) and only public metrics
    besides; the server accepts both under its bound and moves C by the pooled fraction."""
    raw = {k.replace("_", "-"): v for k, v in BASE.items()}
    raw.update({"lr": 0.1, "num-rounds": 2, "target-epsilon": 8.0, "batch-size": 64})
    c = parse_run_config(raw)
    sizes = {i: len(sp.train) for i, sp in enumerate(splits_for(c, 2))}
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    s = build_strategy(c, sizes, model=model,
                       ledger=Ledger(c.delta, c.accountant, budget=8.0))
    s.clip = 0.6

    class Grid:
        def get_node_ids(self):
            return [11, 12]

    messages, record = s.start_round(1, ArrayRecord(model.state_dict()), Grid())
    replies, fractions = [], []
    for pid, m in enumerate(messages):
        node = int(m.metadata.dst_node_id)
        reply = train(message(m.content, 0, node), context(raw, pid, 2))
        assert "status" not in reply.content.config_records
        plan = planned_event(c, sizes[pid], 1)
        privacy = reply.content["privacy"]
        assert privacy["mechanism"] == ["dpsgd"] and privacy["clip"] == 0.6
        assert privacy["sigma"] == [pytest.approx(plan.sigma)]
        assert privacy["rate"] == [pytest.approx(plan.rate)]
        assert privacy["steps"] == [plan.steps]
        metrics = dict(reply.content["metrics"])
        assert metrics["noise-multiplier"] == pytest.approx(plan.sigma)
        assert set(metrics) - PUBLIC_REPLY_METRICS == {UNCLIPPED_FRACTION}
        assert set(metrics) <= s.reply_metric_keys()
        fraction = metrics[UNCLIPPED_FRACTION]
        expected_per_step = sizes[pid] * plan.rate
        assert fraction * plan.steps * expected_per_step != round(
            fraction * plan.steps * expected_per_step)
        low, high = s.fraction_range(pid)
        assert low <= fraction <= high
        fractions.append(fraction)
        assert metrics["num-examples"] == sizes[pid]
        replies.append(message(reply.content, src_node_id=node))
    outcome = s.finish_round(1, record, replies)
    assert len(outcome.record.accepted) == 2, [r.reason for r in outcome.record.rejected]
    assert all(ch.problem is None for ch in outcome.record.charges)
    b = pooled_fraction(fractions, [sizes[0], sizes[1]])
    assert s.clip == pytest.approx(0.6 * math.exp(-0.2 * (b - 0.5)))
    metrics = dict(outcome.metrics)
    assert metrics["clip-norm"] == 0.6 and metrics["unclipped-fraction"] == pytest.approx(b)
