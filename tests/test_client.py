"""Client side: DP-SGD clipping against a hand-written reference, cumulative epsilon equal
to an independently built Opacus accountant, refusal at the budget edge, update-level DP."""

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from dpfl.apps.client import train
from dpfl.client.trainers import train_dpsgd
from dpfl.config import RunConfig
from dpfl.data import ClientData, client_data
from dpfl.models import build_model
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.mechanisms.release import GaussianMechanism, l2_clip
from dpfl.privacy.plan import gaussian_norm_bound
from dpfl.tensors import flatten

from flower_helpers import context, message

DIGITS = {"dataset": "digits", "model": "mlp", "batch-size": 64, "num-rounds": 2,
          "target-epsilon": 2.0, "lr": 0.1}


def _tiny_data(n=16):
    g = torch.Generator().manual_seed(0)
    return ClientData(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g),
                      torch.empty(0, 1, 8, 8), torch.empty(0, dtype=torch.long), 10)


@pytest.mark.parametrize("mode", ["ghost", "hooks", "bk"])
def test_dpsgd_step_equals_mean_of_clipped_per_sample_gradients(mode):
    """sigma = 0, q = 1 (batch = n), one step at lr 1: the update is exactly
    -(1/n) sum_i clip(g_i, C), computed here with a plain per-sample loop."""
    data = _tiny_data(16)
    cfg = RunConfig(dataset="digits", model="mlp", batch_size=16, lr=1.0, max_grad_norm=0.05,
                    opacus_mode=mode)
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    ref_model = build_model("mlp", (1, 8, 8), 10)
    ref_model.load_state_dict(model.state_dict())
    before = flatten(model.state_dict())
    clipped = []
    for i in range(16):
        ref_model.zero_grad()
        torch.nn.functional.cross_entropy(ref_model(data.x_train[i:i + 1]), data.y_train[i:i + 1]).backward()
        g = torch.cat([p.grad.reshape(-1) for p in ref_model.parameters()])
        clipped.append(g * min(1.0, 0.05 / float(g.norm())))
    expected = -torch.stack(clipped).mean(0)
    gen = torch.Generator().manual_seed(0)
    result = train_dpsgd(model, data, cfg, 0.0, gen, gen, torch.device("cpu"))
    assert result.steps == 1 and result.sample_rate == 1.0
    update = flatten(model.state_dict()) - before
    assert float(update.norm()) <= 0.05 + 1e-6
    assert torch.allclose(update, expected, atol=1e-6)


def clip_and_noise(u, clip, sigma, gen):
    """The client's update-DP mechanism (what dpfl.apps.client applies)."""
    return GaussianMechanism(sigma, clip, relation="replace-one").apply(u, gen)


def test_clip_and_noise_bound_and_noise_scale():
    u = torch.full((10_000,), 1.0)
    assert float(l2_clip(u, 2.0).norm()) == pytest.approx(2.0, rel=1e-5)
    small = torch.full((4,), 0.1)
    assert torch.equal(l2_clip(small, 2.0), small)
    with pytest.raises(ValueError):      # no noise is no mechanism
        GaussianMechanism(0.0, 2.0)
    noisy = clip_and_noise(torch.zeros(100_000), 1.5, 0.8, torch.Generator().manual_seed(0))
    assert float(noisy.std()) == pytest.approx(1.2, rel=0.02)
    assert float(noisy.norm()) < gaussian_norm_bound(1.5, 0.8, 100_000)


def _train_round(run_config, ctx, arrays, rnd):
    msg = message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": rnd})}))
    return train(msg, ctx)


def test_reported_epsilon_equals_independent_opacus_accountant_and_refusal():
    run_config = {**DIGITS, "accountant": "rdp"}
    ctx = context(run_config, 0, 2)
    cfg = RunConfig(**{k.replace("-", "_"): v for k, v in DIGITS.items()})
    data = client_data(cfg, 0, 2)
    n = len(data.y_train)
    batches = math.ceil(n / 64)
    q = 1.0 / batches
    # independent reference: Opacus' own calibration and accountant
    sigma = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=q,
                                 steps=2 * batches, accountant="rdp", epsilon_tolerance=0.01)
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    for rnd in (1, 2):
        reply = _train_round(run_config, ctx, arrays, rnd)
        m = reply.content["metrics"]
        acc = RDPAccountant()
        acc.history = [(sigma, q, rnd * batches)]
        assert m["noise-multiplier"] == pytest.approx(sigma, rel=1e-9)
        assert m["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
        assert m["num-examples"] == n and m["steps"] == batches
        assert list(reply.content["arrays"].keys()) == list(arrays.keys())
    assert m["epsilon"] <= 2.0
    # a third round would overspend: the client refuses and spends nothing
    state_before = dict(ctx.state["dpfl.privacy"])
    reply = _train_round(run_config, ctx, arrays, 3)
    assert reply.content["status"]["status"] == "refused"
    assert "arrays" not in reply.content.array_records
    assert reply.content["metrics"]["epsilon"] == pytest.approx(m["epsilon"])
    assert dict(ctx.state["dpfl.privacy"]) == state_before


def test_budget_edge_is_inclusive():
    h = PrivacyHistory()
    e = PrivacyEvent.dpsgd(1, 1.0, 0.05, 100)
    exact = h.epsilon(1e-5, extra=e)
    assert h.would_exceed(e, exact, 1e-5) == (False, pytest.approx(exact))
    assert h.would_exceed(e, exact * 0.999, 1e-5)[0] is True


def _client_level_epsilon(sigma: float, rounds: int, delta: float = 1e-5) -> float:
    """Independent reference: dp-accounting, replace-one = sensitivity 2C = sigma / 2,
    with the accountant the default run-config names for client-level events."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    acc = (rdp_privacy_accountant.RdpAccountant() if RunConfig().accountant == "rdp"
           else pld_privacy_accountant.PLDAccountant())
    acc.compose(dp_accounting.GaussianDpEvent(sigma / 2.0), rounds)
    return acc.get_epsilon(delta)


def test_update_dp_client_clips_noises_and_accounts_with_dp_accounting():
    run_config = {**DIGITS, "trainer": "update-dp", "clip-norm": 0.5, "noise-multiplier": 2.0,
                  "target-epsilon": 40.0}
    ctx = context(run_config, 1, 2)
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    reply = _train_round(run_config, ctx, arrays, 1)
    m = reply.content["metrics"]
    assert m["num-examples"] == 1  # dataset size stays private
    assert reply.content["privacy"]["relation"] == ["replace-one"]
    assert m["epsilon"] == pytest.approx(_client_level_epsilon(2.0, 1), rel=1e-9)
    flat = torch.cat([torch.from_numpy(a.numpy()).reshape(-1)
                      for a in reply.content["arrays"].values()])
    d = flat.numel()
    # noise std sigma*C = 1.0 per coordinate dominates: the norm is about sqrt(d)
    assert float(flat.norm()) / math.sqrt(d) == pytest.approx(1.0, rel=0.05)
    reply = _train_round(run_config, ctx, arrays, 2)
    assert reply.content["metrics"]["epsilon"] == pytest.approx(_client_level_epsilon(2.0, 2),
                                                                rel=1e-9)


def test_dpsgd_noise_has_std_sigma_c_over_expected_batch():
    """One DP-SGD step at lr 1 with q = 1 (batch = n = 16): the update is
    -(sum of clipped gradients + N(0, sigma^2 C^2 I)) / 16. With sigma = 50, C = 0.05 the
    clipped part has norm <= C, the noise per coordinate std sigma C / 16 = 0.15625."""
    data = _tiny_data(16)
    cfg = RunConfig(dataset="digits", model="mlp", batch_size=16, lr=1.0, max_grad_norm=0.05)
    model = build_model("mlp", (1, 8, 8), 10)
    before = flatten(model.state_dict())
    gen = torch.Generator().manual_seed(3)
    train_dpsgd(model, data, cfg, 50.0, gen, gen, torch.device("cpu"))
    update = flatten(model.state_dict()) - before
    d = update.numel()
    expected = 50.0 * 0.05 / 16
    # std of a sample std of d normals: expected / sqrt(2d); allow 5 of those + the signal
    tol = 5 * expected / math.sqrt(2 * d) + 0.05 / math.sqrt(d)
    assert abs(float(update.std()) - expected) < tol, (float(update.std()), expected, tol)


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_empty_poisson_batches_are_noise_only_steps(mode):
    """n = 20, batch 1: q = 0.05, so about a third of the 20 steps get an empty batch
    (which crashed Opacus' optimizer). Every step, empty or not, is taken and counted."""
    data = _tiny_data(20)
    cfg = RunConfig(dataset="digits", model="mlp", batch_size=1, lr=0.1, opacus_mode=mode)
    model = build_model("mlp", (1, 8, 8), 10)
    before = flatten(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    result = train_dpsgd(model, data, cfg, 1.0, gen, gen, torch.device("cpu"))
    after = flatten(model.state_dict())
    assert result.steps == 20 and result.sample_rate == pytest.approx(0.05)
    assert bool(torch.isfinite(after).all()) and not torch.equal(after, before)


def test_the_budget_check_counts_the_servers_releases():
    """The server sends the releases it made itself on this client's behalf (e.g. adaptive
    clipping's noisy count; ``server-event-*``): a round that fits the client's own history
    is refused once they are counted, and the epsilon the client reports stays its own."""
    from dpfl.privacy.accounting.ledger import Ledger, server_events_config

    run_config = {**DIGITS, "accountant": "rdp", "trainer": "update-dp"}
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    ctx = context(run_config, 0, 2)
    first = _train_round(run_config, ctx, arrays, 1).content["metrics"]["epsilon"]
    assert 0 < first <= 2.0
    own = PrivacyHistory.load(ctx.state).events
    assert own[0].unit == "client"
    ledger = Ledger(1e-5, "rdp")
    count = PrivacyEvent.gaussian(1, 0.5, relation=own[0].relation)
    ledger.charge_server_release(1, [count], ["client-0"], "count")
    released = server_events_config(ledger, "client-0")
    assert set(released) == {f"server-event-{f}" for f in
                             ("round", "mechanism", "sigma", "rate", "steps", "epsilon",
                              "relation")}
    msg = message(RecordDict({"arrays": arrays, "config": ConfigRecord(
        {"server-round": 2, **released})}))
    state_before = dict(ctx.state["dpfl.privacy"])
    reply = train(msg, ctx)
    status = reply.content["status"]
    assert status["status"] == "refused" and "server releases included" in status["reason"]
    assert reply.content["metrics"]["epsilon"] == pytest.approx(first)  # its own events
    assert dict(ctx.state["dpfl.privacy"]) == state_before
    # without them the same round trains
    reply = _train_round(run_config, ctx, arrays, 2)
    assert "arrays" in reply.content.array_records
    # a DP-SGD (sample-level) client given a client-level release cannot compose them:
    # it refuses rather than guess, and spends nothing
    ctx = context({**DIGITS, "accountant": "rdp"}, 0, 2)
    ledger2 = Ledger(1e-5, "rdp")
    ledger2.charge_server_release(1, [count], ["client-0"], "count")
    msg = message(RecordDict({"arrays": arrays, "config": ConfigRecord(
        {"server-round": 1, **server_events_config(ledger2, "client-0")})}))
    reply = train(msg, ctx)
    assert reply.content["status"]["status"] == "refused"
    assert "unusable server-event record" in reply.content["status"]["reason"]
    assert "dpfl.privacy" not in ctx.state


def test_a_malformed_ledger_or_plan_record_is_a_refusal_not_a_crash():
    """Issue 50's one record codec: an instruction whose ``ledger-*`` or ``plan-*`` keys do
    not decode (a missing column, lists of different lengths) gets a refusal naming the
    record; the client trains nothing and spends nothing (before: an IndexError/KeyError
    inside the ClientApp)."""
    from dpfl.privacy.accounting.ledger import Ledger, ledger_config
    from dpfl.privacy.plan import plan_to_record

    run_config = {**DIGITS, "accountant": "rdp", "trainer": "update-dp"}
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    ledger = Ledger(1e-5, "rdp")
    ledger.clients["client-0"] = PrivacyHistory([PrivacyEvent.gaussian(
        1, 1.0, relation="replace-one")])
    broken_ledger = ledger_config(ledger)
    broken_ledger["ledger-client"] = [0, 0]
    broken_plan = plan_to_record(PrivacyEvent.gaussian(1, 1.0, relation="replace-one"))
    del broken_plan["plan-sigma"]
    for extra, says in ((broken_ledger, "unusable ledger record"),
                        (broken_plan, "unusable plan record")):
        ctx = context(run_config, 0, 2)
        msg = message(RecordDict({"arrays": arrays, "config": ConfigRecord(
            {"server-round": 1, **extra})}))
        reply = train(msg, ctx)
        assert reply.content["status"]["status"] == "refused", extra
        assert says in reply.content["status"]["reason"]
        assert "arrays" not in reply.content.array_records
        assert "dpfl.privacy" not in ctx.state


# -- DP-SGD extensions: per-round clip, noised-gradient transform, joint unclipped count ---

def test_joint_gradient_noise_closed_form():
    """sigma_g^-2 + s^-2 = sigma^-2 (Andrew et al. 2021, Sec. 3, at add/remove sensitivity
    C for the sum and 1 for the count); a count noise at or below sigma cannot fit."""
    from dpfl.client.trainers import joint_gradient_noise

    assert joint_gradient_noise(1.0, 2.0) == pytest.approx(1 / math.sqrt(1 - 0.25))
    sigma_g = joint_gradient_noise(0.8, 5 * 0.8)
    assert sigma_g ** -2 + 4.0 ** -2 == pytest.approx(0.8 ** -2)
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="must exceed sigma"):
            joint_gradient_noise(1.0, bad)


@pytest.mark.parametrize("clip,expected", [(1e6, 16.0), (1e-9, 0.0)])
def test_unclipped_count_counts_per_sample_norms_within_the_clip(clip, expected):
    """q = 1 (batch = n = 16), one step: every per-sample gradient is within a clip of
    1e6 and none within 1e-9, so the noisy count is 16 or 0 up to its noise (std 1e-3
    here: sigma = 1e-4)."""
    data = _tiny_data(16)
    cfg = RunConfig(dataset="digits", model="mlp", batch_size=16, lr=0.1, opacus_mode="bk")
    model = build_model("mlp", (1, 8, 8), 10)
    gen = torch.Generator().manual_seed(0)
    result = train_dpsgd(model, data, cfg, 1e-4, gen, gen, torch.device("cpu"), clip=clip,
                         count_std=1e-3)
    assert result.noisy_unclipped == pytest.approx(expected, abs=1e-2)
    assert result.unclipped_fraction == pytest.approx(expected / 16, abs=1e-3)
    with pytest.raises(ValueError, match="opacus-mode=bk"):
        train_dpsgd(model, data, RunConfig(dataset="digits", model="mlp", batch_size=16,
                                           opacus_mode="ghost"),
                    1e-4, gen, gen, torch.device("cpu"), count_std=1e-3)


def test_clip_override_and_noised_gradient_transform():
    """The per-round clip replaces max-grad-norm (sigma 0, q 1, lr 1: the update's norm is
    at most the clip), and a transform that zeroes the noised gradient leaves the model
    where it was (it runs between Opacus' noise and the optimizer step)."""
    data = _tiny_data(16)
    cfg = RunConfig(dataset="digits", model="mlp", batch_size=16, lr=1.0, max_grad_norm=5.0,
                    opacus_mode="bk")
    model = build_model("mlp", (1, 8, 8), 10)
    before = flatten(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    train_dpsgd(model, data, cfg, 0.0, gen, gen, torch.device("cpu"), clip=0.01)
    assert 0 < float((flatten(model.state_dict()) - before).norm()) <= 0.01 + 1e-6
    before = flatten(model.state_dict())

    def zero(m):
        for p in m.parameters():
            p.grad.zero_()
    train_dpsgd(model, data, cfg, 1.0, gen, gen, torch.device("cpu"), noisy_grad=zero)
    assert torch.equal(flatten(model.state_dict()), before)
