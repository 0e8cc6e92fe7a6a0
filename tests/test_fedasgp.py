"""DP-FedASGP (dpfl/methods/fedasgp.py): eq. 14's threshold by hand, the significance rule
and the sparse vector's selection against Python loops with the same noise draws, eq. 16 by
hand, the strict variant's release (never a non-selected coordinate, at most c) and its
epsilon against a closed form and dp-accounting, the plan shared by client and server,
reply checks, verdicts and config errors."""

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from dpfl.apps.client import train
from dpfl.config import ConfigError, RunConfig
from dpfl.data import client_data
from dpfl.method import TRAIN_LOSS
from dpfl.methods import METHODS, build_strategy, guarantee, run_config
from dpfl.methods.fedasgp import (
    LOSS_KEY,
    MAX_LOSS,
    SIGNIFICANT_KEY,
    FedASGPParams,
    asgp_threshold,
    budget_split,
    gamma_weights,
    gradient_sum,
    laplace_norm_bound,
    paper_release,
    paper_scales,
    round_event,
    round_scales,
    round_svt,
    significant,
    strict_epsilon,
    strict_scales,
    strict_svt,
    threshold_rank,
    update_norm_bound,
)
from dpfl.models import build_model
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent, history_epsilon
from dpfl.privacy.charging import charge_for
from dpfl.privacy.mechanisms.release import l2_clip, laplace_noise
from dpfl.privacy.plan import PlanInputs, plan_to_record
from dpfl.server.validation import ClientUpdate

from flower_helpers import context, message
from rng_helpers import replay

D = 1e-5


def _cfg(**kw):
    return run_config(strategy="fedasgp", trainer="update-dp", **kw)




# -- eq. 14 ----------------------------------------------------------------------------------

HAND = torch.tensor([0.5, -0.1, 0.3, -0.7, 0.05, 0.2, -0.4, 0.6, 0.0, -0.25])
# |HAND| ascending: 0, 0.05, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7 (1-based ranks 1..10)


@pytest.mark.parametrize("t,rank,expected", [
    (1, 2, 0.05),    # ceil(1 * 10 / 5) = 2
    (3, 6, 0.3),     # ceil(3 * 10 / 5) = 6
    (4, 8, 0.5),     # ceil(8) = 8 < ceil(9 * 10 / 10) = 9
    (5, 9, 0.6),     # min(ceil(10), 9) = 9: the 90 % cap
    (9, 9, 0.6),     # past T: still the cap
])
def test_threshold_on_a_hand_worked_vector(t, rank, expected):
    assert threshold_rank(10, t, 5) == rank
    assert asgp_threshold(HAND, t, 5) == pytest.approx(expected)
    # the signed reading would give another value (e.g. t = 1: -0.4): magnitudes are used
    assert asgp_threshold(HAND, t, 5) >= 0


def test_threshold_rank_rounds_up_and_stays_in_range():
    assert threshold_rank(7, 1, 3) == 3          # ceil(7 / 3)
    assert threshold_rank(7, 3, 3) == 7          # min(ceil(21 / 3), ceil(63 / 10)) = 7
    assert threshold_rank(10, 3, 3) == 9         # min(10, ceil(90 / 10))
    assert threshold_rank(1, 1, 200) == 1
    assert threshold_rank(1_199_882, 200, 200) == math.ceil(0.9 * 1_199_882)


def test_threshold_is_the_kth_smallest_magnitude():
    g = torch.randn(10_001, generator=torch.Generator().manual_seed(3))
    for t in (1, 17, 150, 200):
        k = threshold_rank(g.numel(), t, 200)
        assert asgp_threshold(g, t, 200) == float(g.abs().sort().values[k - 1])


# -- the selection rule against loops -----------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_selection_rule_matches_a_loop_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(2_000, generator=gen).abs()
    lam = float(scores.median())
    alpha_vec = laplace_noise((2_000,), 0.5, gen, torch.float64)
    alpha, beta = float(alpha_vec[0]), float(laplace_noise((1,), 0.5, gen, torch.float64))
    per_round = significant(scores, lam, alpha, beta)
    per_coord = significant(scores, lam, alpha_vec, beta)
    ref_round = [float(s) + alpha >= lam + beta for s in scores.tolist()]
    ref_coord = [float(s) + float(a) >= lam + beta for s, a in zip(scores.tolist(),
                                                                    alpha_vec.tolist())]
    assert per_round.tolist() == ref_round
    assert per_coord.tolist() == ref_coord
    assert 0 < sum(ref_coord) < 2_000


@pytest.mark.parametrize("seed", range(3))
def test_paper_release_matches_a_loop_with_the_same_draws(seed):
    """alpha and beta drawn once (Algorithm 1 line 21), then Lap(b_N) on the significant
    coordinates in index order; every other coordinate is g' itself."""
    gen = torch.Generator().manual_seed(seed)
    g = l2_clip(torch.randn(3_000, generator=gen), 1.0)
    scales = paper_scales(1.0, 2.0, budget_split(1.0, 0.9, 2.0))
    twin = replay(gen)
    out, mask = paper_release(g, 3, 10, scales, gen)
    lam = asgp_threshold(g, 3, 10)
    alpha = float(laplace_noise((1,), scales.query, twin, torch.float64))
    beta = float(laplace_noise((1,), scales.threshold, twin, torch.float64))
    chosen = [j for j in range(3_000) if abs(float(g[j])) + alpha >= lam + beta]
    noise = laplace_noise((len(chosen),), scales.value, twin, torch.float32)
    expected = g.clone()
    for i, j in enumerate(chosen):
        expected[j] = g[j] + noise[i]
    assert mask.nonzero().flatten().tolist() == chosen
    assert torch.equal(out, expected)
    assert torch.equal(out[~mask], g[~mask])     # the published leak: raw values


@pytest.mark.parametrize("seed", range(3))
def test_sparse_vector_selection_matches_a_loop_with_the_same_draws(seed):
    """rho = lambda + Lap(b_beta); alpha_j ~ Lap(b_alpha) per coordinate; positives
    |g'_j| + alpha_j >= rho; more than c: a uniform c of them (a randperm of the positives)."""
    gen = torch.Generator().manual_seed(100 + seed)
    g = l2_clip(torch.randn(5_000, generator=gen), 1.0)
    c = 40
    scales = strict_scales(1.0, c, budget_split(2000.0, 0.9, 2.0))
    svt = strict_svt(scales, 1.0, c, threshold=0.012)
    twin = replay(gen)
    picked = svt.select(g.abs(), gen)
    rho = 0.012 + float(laplace_noise((1,), scales.threshold, twin, torch.float64))
    noise = laplace_noise((5_000,), scales.query, twin, torch.float32)
    # float32 sums compared with rho as the tensor comparison does
    positives = [j for j in range(5_000)
                 if bool(torch.tensor(abs(float(g[j])), dtype=torch.float32) + noise[j] >= rho)]
    assert len(positives) > c
    order = torch.randperm(len(positives), generator=twin)[:c]
    assert picked.tolist() == sorted(positives[i] for i in order.tolist())


# -- strict release ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_strict_release_never_a_non_selected_coordinate_and_at_most_c(seed):
    gen = torch.Generator().manual_seed(seed)
    g = l2_clip(torch.randn(4_000, generator=gen) * torch.rand(4_000, generator=gen) ** 4, 1.0)
    c = [1, 5, 50, 400, 4_000, 10_000][seed]
    svt = strict_svt(strict_scales(1.0, c, budget_split(1.0, 0.9, 2.0)), 1.0, c, 0.01)
    selected = set(svt.select(g.abs(), replay(gen)).tolist())
    out = svt.apply(g, gen, queries=g.abs())
    released = set(out.nonzero().flatten().tolist())
    assert released <= selected and len(released) <= c
    assert torch.all(out[[j for j in range(4_000) if j not in selected]] == 0)


def test_strict_release_with_negligible_noise_keeps_only_above_threshold_coordinates():
    g = l2_clip(torch.randn(2_000, generator=torch.Generator().manual_seed(7)), 1.0)
    lam = float(g.abs().quantile(0.99))
    above = set((g.abs() >= lam).nonzero().flatten().tolist())       # 20 coordinates
    for c, expect_all in ((100, True), (5, False)):
        svt = strict_svt(strict_scales(1.0, c, budget_split(1e12, 0.5, 2.0)), 1.0, c, lam)
        out = svt.apply(g, torch.Generator().manual_seed(1), queries=g.abs())
        released = set(out.nonzero().flatten().tolist())
        assert released <= above
        assert len(released) == (len(above) if expect_all else c)
        assert torch.allclose(out[sorted(released)], g[sorted(released)], atol=1e-6)


def test_client_release_is_minus_lr_times_the_released_gradient():
    """Delta = -lr g: the client recovers g = -Delta / lr, clips, releases -lr g_released."""
    cfg = _cfg(lr=0.25, clip_norm=0.5, asgp_max_coords=7)
    half = METHODS["fedasgp"].client
    g = torch.randn(1_000, generator=torch.Generator().manual_seed(2))
    update = -0.25 * g
    assert torch.allclose(gradient_sum(update, 0.25), g)
    gen = torch.Generator().manual_seed(5)
    expected = round_svt(cfg).apply(l2_clip(g, 0.5), replay(gen), queries=l2_clip(g, 0.5).abs())
    out, event, metrics = half.release_update(cfg, {}, update, 0.0, 0.5, gen, 4,
                                              {TRAIN_LOSS: 1.3})
    assert torch.equal(out, expected * -0.25)
    assert int(torch.count_nonzero(out)) <= 7 and metrics == {}
    assert event == round_event(cfg, 4) == METHODS["fedasgp"].plan(
        cfg, PlanInputs(4, {}, 0, 123, 0)).event
    # a diverged update is released as g = 0 (plus the mechanism's noise), never NaN
    out, _, _ = half.release_update(cfg, {}, torch.full((1_000,), float("nan")), 0.0, 0.5,
                                    torch.Generator().manual_seed(0), 4, {TRAIN_LOSS: 1.0})
    assert torch.isfinite(out).all()


def test_paper_client_reports_its_loss_and_significant_fraction():
    cfg = _cfg(asgp_variant="paper", num_rounds=10)
    half = METHODS["fedasgp"].client
    g = torch.randn(500, generator=torch.Generator().manual_seed(2))
    out, event, metrics = half.release_update(cfg, {}, -cfg.lr * g, 0.0, 1.0,
                                              torch.Generator().manual_seed(5), 2,
                                              {TRAIN_LOSS: 0.8})
    assert metrics[LOSS_KEY] == 0.8 and 0.0 <= metrics[SIGNIFICANT_KEY] <= 1.0
    assert int(torch.count_nonzero(out)) == 500       # nothing withheld
    assert event.epsilon == 1.0 and event.mechanism == "sparse-vector"


def test_selection_and_perturbation_of_1_2m_coordinates_has_no_python_loop():
    """bench/fedasgp.py times it (goal < 50 ms on an idle core); here only a loose guard."""
    import time

    g = l2_clip(torch.randn(1_200_000, generator=torch.Generator().manual_seed(0)), 1.0)
    for variant in ("paper", "strict"):
        cfg = _cfg(asgp_variant=variant, num_rounds=200)
        half = METHODS["fedasgp"].client
        start = time.perf_counter()
        half.release_update(cfg, {}, g * -cfg.lr, 0.0, 1.0, torch.Generator().manual_seed(1),
                            50, {TRAIN_LOSS: 1.0})
        assert time.perf_counter() - start < 2.0, variant


# -- eq. 16 ----------------------------------------------------------------------------------

def test_gamma_matches_eq_16_by_hand_and_sums_to_one():
    # n = 400, L = 3: gamma = (100*3 + 400*2) / 2400, (300*3 + 400*1) / 2400
    w = gamma_weights([100, 300], [2.0, 1.0])
    assert w.tolist() == pytest.approx([1100 / 2400, 1300 / 2400], rel=1e-15)
    rng = np.random.default_rng(0)
    for _ in range(20):
        k = int(rng.integers(1, 30))
        w = gamma_weights(rng.integers(1, 1000, k).tolist(), rng.random(k).tolist())
        assert float(w.sum()) == pytest.approx(1.0, rel=1e-12) and bool((w >= 0).all())


def test_gamma_reduces_to_size_shares_when_losses_follow_sizes():
    """gamma_i = (n_i / n + L_i / L) / 2: n_i / n exactly when L_i / L = n_i / n (e.g. equal
    sizes and equal losses); equal losses with unequal sizes give (n_i / n + 1 / k) / 2."""
    assert gamma_weights([100, 300], [1.0, 3.0]).tolist() == pytest.approx([0.25, 0.75])
    assert gamma_weights([50, 50, 50], [0.7] * 3).tolist() == pytest.approx([1 / 3] * 3)
    assert gamma_weights([100, 300], [0.7, 0.7]).tolist() == pytest.approx([0.375, 0.625])
    assert gamma_weights([100, 300], [0.0, 0.0]).tolist() == pytest.approx([0.25, 0.75])


# -- epsilon ----------------------------------------------------------------------------------

def test_budget_split_follows_the_paper():
    e1, e2, e3 = budget_split(2.0, 0.9, 8.0)        # q^(2/3) = 4
    assert (e1, e2, e3) == pytest.approx((0.16, 0.04, 1.8))


@pytest.mark.parametrize("c", [1, 10, 100])
def test_strict_epsilon_closed_form_and_dp_accounting(c):
    """eps = C / b_beta + 2 c C / b_alpha + 2 C sqrt(c) / b_N. dp-accounting's Laplace PLDs
    give each term's pure epsilon (delta = 0): the threshold (sensitivity C), c positive
    answers of sensitivity 2C at b_alpha (Lyu et al.'s proof charges each e^(eps_2 / c)),
    and one L1 release of sensitivity 2 C sqrt(c); pure epsilons add."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    clip = 0.7
    split = budget_split(1.5, 0.8, 3.0)
    scales = strict_scales(clip, c, split)
    assert strict_epsilon(scales, clip, c) == pytest.approx(1.5, rel=1e-12)   # calibrated
    svt = strict_svt(scales, clip, c, 0.01)
    assert svt.epsilon == pytest.approx(strict_epsilon(scales, clip, c), rel=1e-12)
    assert (svt.threshold_scale, svt.query_scale, svt.answer_scale) == pytest.approx(
        (scales.threshold, scales.query, scales.value), rel=1e-12)

    def pure(b, sensitivity):
        return pld.from_laplace_mechanism(b, sensitivity=sensitivity,
                                          value_discretization_interval=1e-6
                                          ).get_epsilon_for_delta(0.0)

    by_dp_accounting = (pure(scales.threshold, clip) + c * pure(scales.query, 2 * clip)
                        + pure(scales.value, 2 * clip * math.sqrt(c)))
    assert by_dp_accounting == pytest.approx(1.5, abs=1e-4 * (c + 2))


def test_strict_epsilon_at_the_papers_noise_scales():
    """asgp-noise=paper keeps b = q C / eps_k and charges eps_2 / q + 2 c eps_1 / q +
    2 sqrt(c) eps_3 / q: at eps = 1, share 0.9, q = 2, c = 100 that is 15.15 per round."""
    e1, e2, e3 = budget_split(1.0, 0.9, 2.0)
    cfg = _cfg(asgp_noise="paper", asgp_max_coords=100)
    expected = e2 / 2 + 2 * 100 * e1 / 2 + 2 * 10 * e3 / 2
    assert round_svt(cfg).epsilon == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(15.154, abs=1e-3)
    assert round_event(cfg, 1).epsilon == pytest.approx(expected, rel=1e-12)
    one = _cfg(asgp_noise="paper", asgp_max_coords=1)
    assert round_svt(one).epsilon == pytest.approx(e2 / 2 + e1 + e3, rel=1e-12)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_ledger_composes_the_rounds_pure_events(accountant):
    """R rounds of one pure event: the smaller of R eps and the pure-DP RDP bound, with
    either accountant (the PLD accountant has no generic pure-DP event)."""
    from dp_accounting.rdp.rdp_privacy_accountant import (
        DEFAULT_RDP_ORDERS,
        compute_epsilon,
    )

    cfg = _cfg(asgp_epsilon=0.05)
    events = [round_event(cfg, r) for r in range(1, 201)]
    orders = np.asarray(DEFAULT_RDP_ORDERS)
    eps = events[0].epsilon
    rdp, _ = compute_epsilon(orders, 200 * np.minimum(eps, orders * eps ** 2 / 2), D)
    assert history_epsilon(events, D, accountant) == pytest.approx(min(rdp, 200 * eps),
                                                                   rel=1e-12)
    assert history_epsilon(events[:2], D, accountant) == pytest.approx(2 * eps, rel=1e-12)


# -- plan, guard and client app -------------------------------------------------------------

DIGITS = {"dataset": "digits", "model": "mlp", "batch-size": 64, "num-rounds": 2, "lr": 0.1,
          "strategy": "fedasgp", "trainer": "update-dp", "target-epsilon": 4.0}


@pytest.mark.parametrize("variant", ["strict", "paper"])
def test_client_app_release_equals_the_servers_plan_and_is_accepted(variant, server_identity):
    raw = {**DIGITS, "asgp-variant": variant, "asgp-max-coords": 25}
    cfg = run_config(**{k.replace("-", "_"): v for k, v in raw.items()})
    sizes = {pid: len(client_data(cfg, pid, 2).y_train) for pid in (0, 1)}
    strategy = build_strategy(cfg, sizes)
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    arrays = ArrayRecord(model.state_dict())

    class Grid:
        def get_node_ids(self):
            return [1, 2]

    _, record = strategy.start_round(1, arrays, Grid())
    replies = []
    for pid in (0, 1):
        plan = strategy.planned_event(pid, 1)
        assert plan == round_event(cfg, 1) == METHODS["fedasgp"].plan(
            cfg, PlanInputs(1, {}, pid, sizes[pid], 0)).event
        config = ConfigRecord({"server-round": 1, **plan_to_record(plan)})
        reply = train(message(RecordDict({"arrays": arrays, "config": config})),
                      context(raw, pid, 2))
        assert "status" not in reply.content.config_records, dict(reply.content["status"])
        privacy = dict(reply.content["privacy"])
        charge = charge_for(f"client-{pid}", 1, privacy, plan, cfg.clip_norm,
                            PrivacyHistory(), cfg.delta, cfg.accountant)
        assert charge.problem is None and charge.events == [plan]
        m = reply.content["metrics"]
        assert m["epsilon"] == pytest.approx(plan.epsilon, rel=1e-12)
        assert (LOSS_KEY in m) is (variant == "paper")
        replies.append(message(reply.content, src_node_id=pid + 1))
    outcome = strategy.finish_round(1, record, replies)
    assert [u.partition_id for u in outcome.record.accepted] == [0, 1]
    t = dict(outcome.metrics)
    assert t["asgp-gamma-client-0"] + t["asgp-gamma-client-1"] == pytest.approx(1.0)
    if variant == "strict":
        n = sizes[0] + sizes[1]
        assert t["asgp-gamma-client-0"] == pytest.approx(sizes[0] / n)
        assert t["asgp-significant-fraction"] <= 25 / outcome.record.accepted[0].flat.numel()
    else:
        losses = [float(u.metrics[LOSS_KEY]) for u in outcome.record.accepted]
        assert t["asgp-gamma-client-0"] == pytest.approx(
            float(gamma_weights([sizes[0], sizes[1]], losses)[0]), rel=1e-6)


def test_first_round_budget_check_and_a_misreported_event():
    """The server's plan is the method's pure event; a reply reporting a Gaussian (or
    another epsilon) is rejected and charged the costlier."""
    cfg = _cfg(asgp_epsilon=0.5)
    strategy = build_strategy(cfg, {0: 100})
    plan = strategy.planned_event(0, 2)
    assert plan == PrivacyEvent.pure(2, round_svt(cfg).epsilon, "sparse-vector",
                                     relation="replace-one")
    for wrong in (PrivacyEvent.gaussian(2, 1.0, relation="replace-one"),
                  PrivacyEvent.pure(2, 0.1, "sparse-vector", relation="replace-one")):
        rec = dict(PrivacyHistory([wrong]).to_record())
        rec["clip"] = cfg.clip_norm
        charge = charge_for("client-0", 2, rec, plan, cfg.clip_norm, PrivacyHistory(),
                            cfg.delta, cfg.accountant)
        assert charge.problem is not None


def test_norm_bound_is_the_methods_and_holds_for_honest_replies():
    for variant, count in (("paper", 20_000), ("strict", 100)):
        cfg = _cfg(asgp_variant=variant, lr=0.5)
        strategy = build_strategy(cfg)
        b = round_scales(cfg).value
        expected = 0.5 * (1.0 + laplace_norm_bound(count, b))
        assert strategy.guard.norm_bound(20_000, 1) == pytest.approx(expected)
        assert update_norm_bound(cfg, 20_000) == pytest.approx(expected)
        noise = laplace_noise((count,), b, torch.Generator().manual_seed(0), torch.float64)
        assert 0.5 * (1.0 + float(noise.norm())) < expected
    # user's max-update-norm still caps it
    strategy = build_strategy(_cfg(max_update_norm=3.0))
    assert strategy.guard.norm_bound(20_000, 1) == 3.0


def test_laplace_norm_bound_is_loose_but_not_absurd():
    for count in (1, 10, 1_000, 1_200_000):
        typical = math.sqrt(2 * count)             # E ||L||^2 = 2 b^2 count
        bound = laplace_norm_bound(count, 1.0)
        assert bound > 3 * typical
        assert count < 1_000 or bound < 12 * typical


# -- reply checks and round metrics -----------------------------------------------------------

def _update(pid, flat, **metrics):
    return ClientUpdate(node_id=pid + 1, partition_id=pid, flat=flat, num_examples=1,
                        metrics=metrics)


def test_reply_problems():
    strict = build_strategy(_cfg(asgp_max_coords=3), {0: 10, 1: 30})
    flat = torch.zeros(50)
    flat[:3] = 1.0
    assert strict.reply_problem(_update(0, flat)) is None
    flat[10] = -1.0
    assert "non-zero coordinates" in strict.reply_problem(_update(0, flat))
    assert "unknown" in strict.reply_problem(_update(7, torch.zeros(50)))
    paper = build_strategy(_cfg(asgp_variant="paper"), {0: 10})
    dense = torch.ones(50)
    assert paper.reply_problem(_update(0, dense, **{LOSS_KEY: 0.3, SIGNIFICANT_KEY: 0.5})) is None
    for bad in (None, float("nan"), float("inf"), -0.1, True, "1.0"):
        metrics = {SIGNIFICANT_KEY: 0.5} | ({} if bad is None else {LOSS_KEY: bad})
        assert LOSS_KEY in paper.reply_problem(_update(0, dense, **metrics)), bad
    assert SIGNIFICANT_KEY in paper.reply_problem(
        _update(0, dense, **{LOSS_KEY: 0.3, SIGNIFICANT_KEY: 1.5}))


def test_strict_weights_and_round_metrics():
    from dpfl.server.strategy import RoundRecord

    strategy = build_strategy(_cfg(), {0: 10, 1: 30})
    a, b = torch.zeros(100), torch.zeros(100)
    a[:4], b[:2] = 1.0, 1.0
    updates = [_update(0, a), _update(1, b)]
    assert strategy.aggregation_weights(updates).tolist() == pytest.approx([0.25, 0.75])
    record = RoundRecord(1, accepted=updates)
    m = strategy.round_metrics(record)
    assert m["asgp-significant-fraction"] == pytest.approx(0.03)
    assert m["asgp-gamma-spread"] == pytest.approx(0.5)
    assert m["asgp-round-epsilon"] == pytest.approx(1.0)


# -- verdicts and configuration -------------------------------------------------------------------

def test_verdicts():
    strict = guarantee(_cfg())
    assert strict.verdict == "formal" and strict.unit == "client"
    assert "Gaussian noise" not in strict.scope and "sparse vector" in strict.scope
    paper = guarantee(_cfg(asgp_variant="paper"))
    assert paper.verdict.startswith("none: non-significant coordinates released without "
                                    "noise; training loss released in the clear")
    assert "NOT a bound" in paper.scope
    assert guarantee(_cfg(report_train_loss=True)).verdict.startswith("none: ")


@pytest.mark.parametrize("key,value", [
    ("asgp-variant", "published"), ("asgp-epsilon", 0.0), ("asgp-epsilon", -1.0),
    ("asgp-epsilon", float("inf")), ("asgp-eps3-share", 0.0), ("asgp-eps3-share", 1.0),
    ("asgp-q", 0.0), ("asgp-max-coords", 0), ("asgp-threshold", -0.1),
    ("asgp-threshold", float("nan")), ("asgp-noise", "loud"),
])
def test_bad_keys_are_config_errors_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        _cfg(**{key.replace("-", "_"): value})


def test_global_rules():
    with pytest.raises(ConfigError, match="'momentum'"):
        _cfg(momentum=0.9)
    with pytest.raises(ConfigError, match="'trainer'"):
        run_config(strategy="fedasgp", trainer="plain")
    with pytest.raises(ConfigError, match="'server-holdout'"):   # dpsgd: tests/test_fedasgp_dpsgd.py
        run_config(strategy="fedasgp", trainer="dpsgd")
    assert isinstance(_cfg().params, FedASGPParams)
    assert RunConfig().momentum == 0.0


# -- a client's reported loss is bounded before it weighs anything ----------------------------

def _cap(n_i, n, odds=3.0):
    """The largest share capped_shares allows a client of size share n_i / n."""
    b = n_i / n
    return odds * b / (1 + (odds - 1) * b)


@pytest.mark.parametrize("hostile", [1e308, float("inf"), MAX_LOSS, 1e6])
def test_gamma_with_a_hostile_loss_stays_finite_and_bounded(hostile):
    """Eq. 16 gives L_i -> infinity the weight (n_i / n + 1) / 2, and 1e308 made every
    gamma NaN (n L_i overflows): the loss is clipped to [0, MAX_LOSS] and each gamma_i
    capped at 3 n_i / (n + 2 n_i) (odds 3 x its size share's)."""
    sizes, losses = [100] * 5, [hostile, 0.5, 0.6, 0.7, 0.8]
    w = gamma_weights(sizes, losses)
    assert bool(torch.isfinite(w).all()) and float(w.sum()) == pytest.approx(1.0, rel=1e-12)
    assert float(w[0]) == pytest.approx(_cap(100, 500), rel=1e-12)     # 3 / 7, not ~0.6
    assert bool((w[1:] > 0).all())
    # the others keep eq. 16's proportions among themselves
    rest = w[1:] / w[1:].sum()
    raw = gamma_weights(sizes, [MAX_LOSS, 0.5, 0.6, 0.7, 0.8], odds=math.inf)[1:]
    assert torch.allclose(rest, raw / raw.sum(), rtol=1e-12)
    # unequal sizes: the cap follows the size share
    w = gamma_weights([100, 300, 600], [hostile, 1.0, 1.0])
    assert float(w[0]) <= _cap(100, 1000) * (1 + 1e-12)
    with pytest.raises(ValueError, match="numbers"):
        gamma_weights(sizes, [float("nan"), 0.5, 0.6, 0.7, 0.8])


def test_honest_loss_spreads_keep_eq_16():
    """The cap binds only on a loss share far above the size share: honest spreads (up to 4
    times the round's mean loss with 10 equal clients; 2 clients always) are eq. 16 as
    published."""
    rng = np.random.default_rng(1)
    for _ in range(50):
        losses = rng.uniform(0.2, 2.3, 10)
        assert losses.max() <= 4 * losses.mean()
        sizes = [100] * 10
        assert torch.allclose(gamma_weights(sizes, losses),
                              gamma_weights(sizes, losses, odds=math.inf), rtol=1e-12)
    assert gamma_weights([100, 100], [MAX_LOSS, 0.0]).tolist() == pytest.approx([0.75, 0.25])


def _paper_round(losses, caplog):
    """One paper-variant round through the real strategy (no federation): 5 clients of
    100 examples, client i reporting losses[i]; returns (outcome, train metrics)."""
    from flower_helpers import FakeGrid

    cfg = _cfg(asgp_variant="paper", dataset="digits", model="mlp")
    strategy = build_strategy(cfg, {pid: 100 for pid in range(len(losses))})
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    arrays = ArrayRecord(model.state_dict())
    _, record = strategy.start_round(1, arrays, FakeGrid(range(1, len(losses) + 1)))
    gen = torch.Generator().manual_seed(1)
    replies = []
    for pid, loss in enumerate(losses):
        update = {k: 0.001 * torch.randn(v.shape, generator=gen)
                  for k, v in model.state_dict().items()}
        metrics = MetricRecord({"num-examples": 1, "partition-id": pid, "server-round": 1,
                                LOSS_KEY: loss, SIGNIFICANT_KEY: 0.4})
        replies.append(message(RecordDict({"arrays": ArrayRecord(update), "metrics": metrics}),
                               src_node_id=pid + 1))
    caplog.set_level("WARNING", logger="flwr.dpfl.strategy")
    outcome = strategy.finish_round(1, record, replies)
    flat = torch.cat([torch.from_numpy(a.numpy()).reshape(-1)
                      for a in outcome.arrays.values()])
    assert bool(torch.isfinite(flat).all())
    return outcome, dict(outcome.metrics)


def test_a_reported_loss_of_1e308_is_rejected_and_the_model_stays_finite(server_identity,
                                                                          caplog):
    """The red team's reproduction: asgp-variant=paper, one client reporting 1e308 made
    the global model NaN. Now the reply is rejected with its reason (logged, recorded) and
    the round goes on with the others."""
    outcome, train = _paper_round([1e308, 0.5, 0.6, 0.7, 0.8], caplog)
    [rejected] = outcome.record.rejected
    assert rejected.partition_id == 0 and LOSS_KEY in rejected.reason
    assert f"[0, {MAX_LOSS:g}]" in rejected.reason
    assert any("client-0 dropped" in r.getMessage() and LOSS_KEY in r.getMessage()
               for r in caplog.records)
    assert [u.partition_id for u in outcome.record.accepted] == [1, 2, 3, 4]
    assert train["accepted"] == 4 and train["rejected"] == 1


def test_the_largest_accepted_loss_cannot_dominate_the_aggregate(server_identity, caplog):
    """A loss at the top of the range is accepted, but its client's gamma is capped at
    3 / 7 of the aggregate (5 equal clients; eq. 16 alone would give it 0.6) and the
    aggregate is the capped weights' mean."""
    outcome, train = _paper_round([MAX_LOSS, 0.5, 0.6, 0.7, 0.8], caplog)
    assert not outcome.record.rejected
    gammas = [train[f"asgp-gamma-client-{pid}"] for pid in range(5)]
    assert gammas[0] == pytest.approx(3 / 7, rel=1e-6)
    assert sum(gammas) == pytest.approx(1.0, rel=1e-6)
    assert train["asgp-gamma-max"] <= 3 / 7 + 1e-6
