"""FedCompDP's reconstructed equations on hand-worked cases, its ADPC readings and their
verdicts, the joint update+scalar release against dp-accounting, the private-quantile rule
against Flower's adaptive-clipping wrappers, and reply validation."""

import inspect
import math

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

from dpfl.config import ConfigError
from dpfl.methods import build_strategy, guarantee, run_config
from dpfl.methods.fedcompdp import (
    BIT_KEY,
    F1_KEY,
    NORM_KEY,
    Constraints,
    FedCompDPClient,
    cra_weights,
    ema,
    joint_update_noise,
    linearised_direction,
    median_clip,
    primal_dual_step,
    reliability_scores,
    sparsify,
    sparsify_and_clip,
    sparsify_threshold,
)
from dpfl.models.evaluation import macro_f1
from dpfl.privacy.mechanisms.release import geometric_clip_update
from dpfl.server.validation import ClientUpdate

BASE = dict(strategy="fedcompdp", trainer="update-dp", dataset="digits", model="mnist-cnn",
            noise_multiplier=1.0, server_holdout=100, llcm_ratio=0.0)


def cfg(**changes):
    return run_config(**{**BASE, **changes})


def update(pid, flat, **metrics):
    return ClientUpdate(node_id=10 + pid, partition_id=pid, flat=torch.as_tensor(flat,
                        dtype=torch.float32), num_examples=1, metrics=metrics)


# -- eq. 2: sparsification -------------------------------------------------------------------

def test_sparsify_readings_on_a_hand_case():
    g = torch.tensor([0.5, -0.05, 0.2, -2.0, 0.0])
    assert torch.equal(sparsify(g, 0.1, "small"), torch.tensor([0.5, 0.0, 0.2, -2.0, 0.0]))
    assert torch.equal(sparsify(g, 0.3, "large"), torch.tensor([0.0, -0.05, 0.2, 0.0, 0.0]))
    assert torch.equal(sparsify(g, 0.3, "none"), g)


def test_threshold_decays_geometrically_from_round_one():
    assert sparsify_threshold(1e-2, 0.5, 1) == 1e-2
    assert sparsify_threshold(1e-2, 0.5, 3) == pytest.approx(2.5e-3)


def test_pre_step_sparsifies_then_clips_the_global_gradient_norm():
    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.tensor([[3.0, 0.01]])
    sparsify_and_clip("small", 0.1, clip=1.0)(model)        # [3, 0] then norm 3 -> 1
    assert torch.allclose(model.weight.grad, torch.tensor([[1.0, 0.0]]))
    model.weight.grad = torch.tensor([[0.3, 0.4]])
    sparsify_and_clip("none", 0.1, clip=1.0)(model)         # norm 0.5 <= 1: unchanged
    assert torch.allclose(model.weight.grad, torch.tensor([[0.3, 0.4]]))


# -- the joint release (eq. 8 with the ADPC bit) ------------------------------------------------

def _rdp_epsilon(events, delta=1e-5):
    acc = RdpAccountant()
    for e in events:
        acc.compose(e)
    return acc.get_epsilon(delta)


def test_joint_release_costs_one_gaussian_of_the_run_sigma():
    """Update at sigma_Delta (replace-one: sensitivity 2C) composed with a bit of
    sensitivity 1 at noise s_b = one Gaussian of multiplier sigma (sensitivity 2C):
    dp-accounting's RDP accountant agrees with the closed form."""
    sigma, s_b = 1.3, 0.9
    sigma_delta = joint_update_noise(sigma, [s_b])
    assert sigma_delta == pytest.approx((sigma ** -2 - (2 * s_b) ** -2) ** -0.5)
    # noise / sensitivity ratios: sigma/2 for the replace-one releases, s_b for the bit
    joint = [dp_event.GaussianDpEvent(sigma_delta / 2), dp_event.GaussianDpEvent(s_b)]
    single = [dp_event.GaussianDpEvent(sigma / 2)]
    assert _rdp_epsilon(joint) == pytest.approx(_rdp_epsilon(single), rel=1e-6)
    with pytest.raises(ValueError, match="too small"):
        joint_update_noise(1.0, [0.5])   # (2 s)^-2 = sigma^-2: nothing left for the update


def test_client_release_private_quantile_noise_bit_and_event():
    c = cfg(adpc="private-quantile", adpc_count_stddev=2.0)
    half = FedCompDPClient()
    gen = torch.Generator().manual_seed(0)
    zero = torch.zeros(200_000)
    noisy, event, metrics = half.release_update(c, {"fedcompdp-clip": 0.5}, zero, 1.0, 0.5,
                                                gen, 3, {})
    expected_std = joint_update_noise(1.0, [2.0]) * 0.5
    assert float(noisy.std()) == pytest.approx(expected_std, rel=0.01)
    assert event.sigma == 1.0 and event.relation == "replace-one" and event.round == 3
    assert BIT_KEY in metrics and NORM_KEY not in metrics
    bits = [half.release_update(c, {}, torch.zeros(3), 1.0, 0.5, gen, 1, {})[2][BIT_KEY]
            for _ in range(4000)]
    # an unclipped (zero) update has bit 1; the released value is 1 + N(0, 2^2)
    assert sum(bits) / len(bits) == pytest.approx(1.0, abs=0.15)
    assert torch.tensor(bits).std().item() == pytest.approx(2.0, rel=0.05)


def test_client_release_raw_norm_reports_the_pre_noise_norm():
    c = cfg(adpc="raw-norm")
    _, _, metrics = FedCompDPClient().release_update(
        c, {}, torch.tensor([3.0, 4.0]), 1.0, 1.0, torch.Generator().manual_seed(0), 1, {})
    assert metrics == {NORM_KEY: 5.0}


# -- ADPC (eqs. 5-7) and the private quantile -------------------------------------------------

def test_median_clip_odd_and_even():
    assert median_clip([3.0, 1.0, 2.0]) == 2.0
    assert median_clip([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_geometric_update_hand_case_and_direction():
    # b = 0.75 unclipped, gamma = 0.5, eta = 0.2: C = exp(-0.05)
    assert geometric_clip_update(1.0, 0.75, 0.5, 0.2) == pytest.approx(math.exp(-0.05))
    assert geometric_clip_update(1.0, 0.0, 0.5, 0.2) > 1.0   # all clipped: C grows


def test_private_quantile_matches_flowers_defaults_and_reverses_its_sign():
    """Flower's DifferentialPrivacy*AdaptiveClipping wrappers use Andrew et al.'s defaults
    (gamma = 0.5, eta = 0.2) but count the *clipped* updates (their norm bit is
    ``scaling_factor < 1``) in the formula that expects the *unclipped* fraction, so their
    C moves the wrong way: every factor is the inverse of ours at gamma = 0.5."""
    from flwr.serverapp.strategy import (
        DifferentialPrivacyServerSideAdaptiveClipping as W,
    )
    from flwr.serverapp.strategy.dp_adaptive_clipping import (
        adaptive_clip_inputs_inplace,
    )

    defaults = inspect.signature(W.__init__).parameters
    assert defaults["target_clipped_quantile"].default == 0.5
    assert defaults["clip_norm_lr"].default == 0.2
    c = cfg()
    assert (c.params.adpc_target_quantile, c.params.adpc_lr) == (0.5, 0.2)
    import numpy as np
    # Flower's norm bit on an update of norm 5 at C = 1: True = clipped
    assert adaptive_clip_inputs_inplace([np.array([3.0, 4.0])], 1.0) is True
    flower = object.__new__(W)
    flower.clipping_norm, flower.clip_norm_lr, flower.target_clipped_quantile = 1.0, 0.2, 0.5
    flower._geometric_update(1.0)          # every update clipped (clipped fraction 1)
    ours = geometric_clip_update(1.0, 0.0, 0.5, 0.2)   # unclipped fraction 0
    assert flower.clipping_norm < 1.0 < ours
    assert flower.clipping_norm * ours == pytest.approx(1.0)


@pytest.mark.parametrize("reading", ["noisy-norm", "raw-norm", "private-quantile", "off"])
def test_next_clip_per_reading(reading):
    s = build_strategy(cfg(adpc=reading, clip_norm=1.0))
    ups = [update(0, [3.0, 4.0], **{NORM_KEY: 1.0, BIT_KEY: 1.0}),
           update(1, [0.0, 2.0], **{NORM_KEY: 3.0, BIT_KEY: 1.0}),
           update(2, [6.0, 8.0], **{NORM_KEY: 2.0, BIT_KEY: 0.0}),
           update(3, [1.0, 0.0], **{NORM_KEY: 9.0, BIT_KEY: 1.0})]
    expected = {"noisy-norm": 3.5, "raw-norm": 2.5, "off": 1.0,
                "private-quantile": math.exp(-0.2 * (0.75 - 0.5))}[reading]
    assert s.next_clip(ups) == pytest.approx(expected)


def test_noisy_norm_grows_like_sigma_sqrt_d():
    """The prediction for adpc=noisy-norm: a noised update's norm is ~ sigma C sqrt(d),
    so the median of the norms, the next C, is ~ sigma sqrt(d) times C."""
    s = build_strategy(cfg(adpc="noisy-norm", clip_norm=0.1, adpc_max_clip=1e9))
    gen = torch.Generator().manual_seed(1)
    d, sigma = 10_000, 1.0
    ups = [update(i, 0.1 * sigma * torch.randn(d, generator=gen)) for i in range(5)]
    assert s.next_clip(ups) == pytest.approx(0.1 * sigma * math.sqrt(d), rel=0.05)


def test_clip_stays_within_bounds():
    s = build_strategy(cfg(adpc="noisy-norm", adpc_max_clip=10.0))
    assert s.next_clip([update(0, [300.0, 400.0])]) == 10.0


# -- CRA (eqs. 11-15) ------------------------------------------------------------------------

def test_ema_hand_case():
    assert ema(None, 0.8, 0.5) == 0.8
    assert ema(0.8, 0.4, 0.5) == pytest.approx(0.6)
    assert ema(0.6, 1.0, 0.9) == pytest.approx(0.64)


def test_scores_and_weights_favour_stable_high_f1_clients():
    f1 = torch.tensor([0.9, 0.9, 0.5])
    norms = torch.tensor([1.0, 3.0, 1.0])        # mean 5/3
    scores = reliability_scores(f1, norms, 0.1)
    assert torch.allclose(scores, torch.tensor([0.9 - 0.06, 0.9 - 0.18, 0.5 - 0.06]))
    w = cra_weights(scores, 0.1)
    assert float(w.sum()) == pytest.approx(1.0)
    assert w[0] > w[1] > w[2]
    e = torch.exp(scores / 0.1)
    assert torch.allclose(w, e / e.sum())


def test_macro_f1_matches_scikit_learn():
    from sklearn.metrics import f1_score
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 5, (300,), generator=gen)
    p = torch.where(torch.rand(300, generator=gen) < 0.6, y, torch.randint(0, 7, (300,),
                                                                        generator=gen))
    assert macro_f1(p, y, 7) == pytest.approx(
        f1_score(y.numpy(), p.numpy(), average="macro", zero_division=0))


# -- CD-norm constraint, primal-dual (eqs. 16-19) -----------------------------------------------

def test_primal_dual_on_a_2d_toy():
    """w_prev = 0, w~ = (3, 4): a = (0.6, 0.8), violation 5 - 1 = 4, eta = 0.5 -> lambda = 2,
    w = (3, 4) - 2 (0.6, 0.8) = (1.8, 2.4). Next round a step (0, 0.5) satisfies the kept
    constraint (0.4 - 1 < 0): lambda decays to 2 - 0.3 = 1.7 and still pulls; a new step
    along a of length 0.2 adds its own constraint with lambda [0 + 0.5 (0.2 - 1)]_+ = 0,
    which leaves the active set at once."""
    w_prev, w_tilde = torch.zeros(2), torch.tensor([3.0, 4.0])
    a = linearised_direction(w_tilde, w_prev)
    assert torch.allclose(a, torch.tensor([0.6, 0.8]))
    kept = Constraints.empty(2, keep=10)
    slot = kept.add(a, 1)
    w = primal_dual_step(w_tilde, w_prev, kept, rho=1.0, dual_lr=0.5, new=slot)
    assert torch.allclose(w, torch.tensor([1.8, 2.4])) and len(kept) == 1
    assert float(kept.multipliers[slot]) == 2.0
    w2_tilde = w + torch.tensor([0.0, 0.5])
    w2 = primal_dual_step(w2_tilde, w, kept, rho=1.0, dual_lr=0.5)
    assert float(kept.multipliers[slot]) == pytest.approx(1.7)
    assert torch.allclose(w2, w2_tilde - 1.7 * torch.tensor([0.6, 0.8]))
    small = Constraints.empty(2, keep=10)
    s2 = small.add(torch.tensor([0.6, 0.8]), 1)
    w3 = primal_dual_step(w + 0.2 * torch.tensor([0.6, 0.8]), w, small, 1.0, 0.5, new=s2)
    assert len(small) == 0 and torch.allclose(w3, w + 0.2 * torch.tensor([0.6, 0.8]))


def test_constraint_slots_are_reused_and_the_oldest_is_replaced():
    c = Constraints.empty(2, keep=3)
    for k in range(3):
        c.multipliers[c.add(torch.tensor([float(k), 0.0]), k)] = 1.0   # all active
    slot = c.add(torch.tensor([9.0, 0.0]), 3)                       # full: the oldest goes
    assert slot == 0 and c.directions[:, 0].tolist() == [9.0, 1.0, 2.0]
    c.multipliers[slot] = 1.0
    c.multipliers[1] = 0.0                                            # left the active set
    assert c.add(torch.tensor([7.0, 0.0]), 4) == 1


def test_zero_step_adds_no_constraint():
    assert linearised_direction(torch.ones(3), torch.ones(3)) is None


# -- verdicts and configuration ----------------------------------------------------------------

@pytest.mark.parametrize("changes,formal", [
    (dict(adpc="private-quantile"), True),
    (dict(adpc="noisy-norm"), True),
    (dict(adpc="off"), True),
    (dict(adpc="raw-norm"), False),
    (dict(cra_score="client-f1"), False),
    (dict(cra_score="client-f1", client_f1_noise=1.0), True),   # 0.5: no joint release
])
def test_verdict_per_reading(changes, formal):
    g = guarantee(cfg(**changes))
    assert g.formal is formal, g.verdict
    assert g.unit == "client" and g.relation == "replace-one"
    if changes.get("adpc") == "raw-norm":
        assert "raw update norms released" in g.verdict


def test_config_rules():
    with pytest.raises(ConfigError, match="trainer"):
        cfg(trainer="plain")   # dpsgd: tests/test_fedcompdp_dpsgd.py
    with pytest.raises(ConfigError, match="adpc"):
        cfg(adpc="mean")
    with pytest.raises(ConfigError, match="server-holdout"):
        build_strategy(cfg(server_holdout=0))
    with pytest.raises(ConfigError, match="adpc-count-stddev"):
        build_strategy(cfg(adpc_count_stddev=0.4))          # (2 s_b)^-2 > sigma^-2 = 1
    build_strategy(cfg(server_holdout=0, cra_score="client-f1"))  # no server split needed


def test_replies_missing_or_out_of_range_values_are_rejected():
    s = build_strategy(cfg(adpc="private-quantile", cra_score="client-f1",
                           client_f1_noise=0.0, adpc_count_stddev=1.0))
    ok = update(0, [1.0], **{BIT_KEY: 0.7, F1_KEY: 0.8})
    assert s.reply_problem(ok) is None
    assert "missing" in s.reply_problem(update(0, [1.0], **{F1_KEY: 0.8}))
    assert "outside" in s.reply_problem(update(0, [1.0], **{BIT_KEY: 1e6, F1_KEY: 0.8}))
    assert "outside" in s.reply_problem(update(0, [1.0], **{BIT_KEY: 0.5, F1_KEY: 1.5}))
    assert "outside" in s.reply_problem(update(0, [1.0], **{BIT_KEY: math.nan, F1_KEY: 0.5}))


def test_llcm_on_a_model_without_convolutions_is_a_config_error():
    from dpfl.methods import method_for
    c = cfg(model="mlp", llcm_ratio=0.5)
    with pytest.raises(ConfigError, match="llcm-ratio"):
        method_for(c).build_model(c, (1, 8, 8), 10)
    assert method_for(cfg(model="mlp")).build_model(cfg(model="mlp"), (1, 8, 8), 10)


def test_norm_bound_and_round_clip_follow_the_method():
    """The guard bounds a reply of round t by C_t + sigma_Delta C_t (sqrt(d) + 10), with
    sigma_Delta the raised update noise of private-quantile (s_b = sigma: 2 / sqrt(3)), and
    expects the reply's privacy record to state C_t."""
    s = build_strategy(cfg(adpc="private-quantile", clip_norm=2.0), {0: 10, 1: 10})
    s.send_config(1)
    s.clip = 0.5
    s.send_config(2)
    sigma_delta = 1.0 / math.sqrt(1 - 0.25)
    assert s.guard.norm_bound(100, 1) == pytest.approx(2.0 + sigma_delta * 2.0 * 20)
    assert s.guard.norm_bound(100, 2) == pytest.approx(0.5 + sigma_delta * 0.5 * 20)
    assert s.guard.planned_clip(1) == 2.0 and s.guard.planned_clip(2) == 0.5


def test_strategy_state_survives_a_checkpoint_round_trip(tmp_path):
    """C_t, its history, the CRA EMAs and the kept constraints are checkpointed (a resumed
    run continues them instead of restarting C at clip-norm)."""
    s = build_strategy(cfg(clip_norm=1.0))
    s.send_config(1)
    s.clip = 0.42
    s.cra_state.f1[3], s.cra_state.norm[3] = 0.7, 2.5
    w_prev = torch.zeros(4)
    s.server_step(w_prev, torch.tensor([3.0, 4.0, 0.0, 0.0]))
    path = tmp_path / "state.pt"
    torch.save(s.state_dict(), path)
    t = build_strategy(cfg(clip_norm=1.0))
    t.load_state_dict(torch.load(path, weights_only=False))
    assert (t.clip, t.clips, t.cra_state.f1, t.cra_state.norm) == (0.42, {1: 1.0}, {3: 0.7},
                                                                   {3: 2.5})
    assert torch.equal(t.constraints.directions, s.constraints.directions)
    assert torch.equal(t.constraints.multipliers, s.constraints.multipliers)


# -- a client's reported F1 is bounded before it weighs anything ------------------------------

def _cra_strategy(sizes=None, **changes):
    return build_strategy(cfg(**{"adpc": "off", "cra_score": "client-f1",
                                 "client_f1_noise": 0.0, "cd_correction": False, **changes}),
                          sizes)


def test_a_claimed_f1_of_one_cannot_take_the_aggregate():
    """The red team's reproduction: cra-score=client-f1, a client claiming F1 = 1.0 against
    peers at 0.3 took 99.94 % of eq. 14's weights (T = 0.1: e^7 times theirs). Its share is
    now capped at 3 / (M + 2) (odds 3 x those of 1 / M), the rest in eq. 14's proportions."""
    s = _cra_strategy()
    ups = [update(0, [1.0, 0.0], **{F1_KEY: 1.0})] + [
        update(i, [0.0, 1.0], **{F1_KEY: 0.3 + 0.01 * i}) for i in range(1, 5)]
    raw = cra_weights(reliability_scores(torch.tensor([1.0, 0.31, 0.32, 0.33, 0.34]),
                                         torch.ones(5), 0.1), 0.1)
    assert float(raw[0]) > 0.99                    # eq. 14 alone: one reply is the aggregate
    w = s.aggregation_weights(ups)
    assert bool(torch.isfinite(w).all()) and float(w.sum()) == pytest.approx(1.0, rel=1e-6)
    assert float(w[0]) == pytest.approx(3 / 7, rel=1e-6)
    assert torch.allclose(w[1:] / w[1:].sum(), raw[1:] / raw[1:].sum(), rtol=1e-5)
    assert s.last_weights[0] == pytest.approx(3 / 7, rel=1e-6)


def test_a_noisy_f1_is_clipped_to_0_1_and_an_impossible_one_rejected():
    """With client-f1-noise s_f, an honest noisy F1 lies in [-10 s_f, 1 + 10 s_f]: outside,
    the reply is rejected; inside, the value is clipped to [0, 1] before eq. 11's EMA."""
    s = _cra_strategy(client_f1_noise=1.0)      # honest range [-10, 11]
    assert "outside" in s.reply_problem(update(0, [1.0], **{F1_KEY: 12.0}))
    assert "outside" in s.reply_problem(update(0, [1.0], **{F1_KEY: float("inf")}))
    assert "not a number" in s.reply_problem(update(0, [1.0], **{F1_KEY: [1.0]}))
    assert s.reply_problem(update(0, [1.0], **{F1_KEY: 1.8})) is None
    ups = [update(0, [1.0], **{F1_KEY: 1.8}), update(1, [1.0], **{F1_KEY: -0.7})]
    assert s.client_scores(ups) == [1.0, 0.0]
    s.aggregation_weights(ups)
    assert s.cra_state.f1 == {0: 1.0, 1: 0.0}


def test_server_val_scores_keep_eq_14():
    """The cap is for clients' claims: the server's own scores (server-val) keep eq. 14."""
    from dpfl.methods.fedcompdp import bounded_cra_weights

    raw = cra_weights(torch.tensor([1.0, 0.3, 0.3, 0.3, 0.3]), 0.1)
    capped = bounded_cra_weights(raw)
    assert float(capped[0]) == pytest.approx(3 / 7, rel=1e-6)
    s = build_strategy(cfg(adpc="off", cra_score="server-val", cd_correction=False))
    s.client_scores = lambda accepted: [1.0, 0.3, 0.3, 0.3, 0.3]
    w = s.aggregation_weights([update(i, [1.0, float(i)]) for i in range(5)])
    assert float(w[0]) > 0.99


def test_reported_raw_norms_are_clipped_to_the_largest_clip():
    s = build_strategy(cfg(adpc="raw-norm", adpc_max_clip=10.0))
    ups = [update(0, [1.0], **{NORM_KEY: 1e308}), update(1, [1.0], **{NORM_KEY: 1e308}),
           update(2, [1.0], **{NORM_KEY: 2.0}), update(3, [1.0], **{NORM_KEY: 3.0})]
    assert s.next_clip(ups) == pytest.approx((3.0 + 10.0) / 2)
    assert "outside" in s.reply_problem(update(0, [1.0], **{NORM_KEY: float("inf")}))
    assert "outside" in s.reply_problem(update(0, [1.0], **{NORM_KEY: -1.0}))


def test_a_claimed_f1_through_the_strategys_round(server_identity, caplog):
    """One round through the real strategy (no federation): 5 clients; client 4 claims
    F1 = 5.0 and is rejected with its reason (logged and recorded); client 0 claims 1.0 and
    is held to 3 / (M + 2) = 1 / 2 of the M = 4 accepted replies' aggregate; the model
    stays finite."""
    from flwr.app import ArrayRecord, MetricRecord, RecordDict

    from dpfl.models import build_model

    from flower_helpers import FakeGrid, message

    s = _cra_strategy({pid: 100 for pid in range(5)}, model="mlp")
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    _, record = s.start_round(1, ArrayRecord(model.state_dict()), FakeGrid(range(1, 6)))
    gen = torch.Generator().manual_seed(1)
    replies = []
    for pid, f1 in enumerate([1.0, 0.3, 0.31, 0.32, 5.0]):
        arrays = ArrayRecord({k: 0.01 * torch.randn(v.shape, generator=gen)
                              for k, v in model.state_dict().items()})
        metrics = MetricRecord({"num-examples": 1, "partition-id": pid, "server-round": 1,
                                F1_KEY: f1})
        replies.append(message(RecordDict({"arrays": arrays, "metrics": metrics}),
                               src_node_id=pid + 1))
    caplog.set_level("WARNING", logger="flwr.dpfl.strategy")
    outcome = s.finish_round(1, record, replies)
    [rejected] = outcome.record.rejected
    assert rejected.partition_id == 4 and F1_KEY in rejected.reason
    assert any("client-4 dropped" in r.getMessage() for r in caplog.records)
    train = dict(outcome.metrics)
    weights = [train[f"cra-weight-client-{pid}"] for pid in range(4)]
    assert weights[0] == pytest.approx(3 / 6, rel=1e-5)     # M = 4 accepted: 3 / (4 + 2)
    assert sum(weights) == pytest.approx(1.0, rel=1e-6)
    flat = torch.cat([torch.from_numpy(a.numpy()).reshape(-1)
                      for a in outcome.arrays.values()])
    assert bool(torch.isfinite(flat).all())
