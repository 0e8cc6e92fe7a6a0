"""Fed-SMP (dpfl/methods/fedsmp.py): the mask (k coordinates; top-k = the largest
magnitudes; rand-k = a function of the public seed and round only, never of the data), the
noise on the kept coordinates only (statistically), the release's event against the shared
plan and dp-accounting, the server's reply checks, rescale and norm bound, the client app's
reply accepted by the server, the verdict of each mask and config errors."""

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from scipy import stats

from dpfl.apps.client import train
from dpfl.config import ConfigError
from dpfl.data import client_data
from dpfl.method import TRAIN_LOSS
from dpfl.methods import METHODS, build_strategy, guarantee, run_config
from dpfl.methods.fedsmp import (
    FedSMPParams,
    kept_count,
    kept_indices,
    mask_seed,
    randk_indices,
    sparsified_release,
    topk_indices,
)
from dpfl.models import build_model
from dpfl.privacy.accounting.events import PrivacyEvent, history_epsilon
from dpfl.privacy.mechanisms.release import l2_clip
from dpfl.privacy.plan import (
    PlanInputs,
    gaussian_norm_bound,
    noise_multiplier_for,
    plan_to_record,
    planned_event,
)
from dpfl.server.strategy import RoundContext, RoundRecord
from dpfl.server.validation import ClientUpdate

from flower_helpers import context, message
from rng_helpers import replay

D = 1e-5


def _cfg(**kw):
    return run_config(strategy="fedsmp", trainer="update-dp", **kw)




# -- the mask ------------------------------------------------------------------------------

@pytest.mark.parametrize("dim,ratio,k", [(1000, 0.1, 100), (80_202, 0.1, 8_020), (10, 0.3, 3),
                                         (10, 0.01, 1), (7, 1.0, 7), (3, 0.999, 3)])
def test_kept_count_is_the_rounded_share_at_least_one(dim, ratio, k):
    assert kept_count(dim, ratio) == k


def test_randk_mask_has_k_distinct_sorted_indices_and_depends_on_seed_and_round_only():
    idx = randk_indices(5_000, 400, 42, 3)
    assert len(idx) == 400 and len(set(idx.tolist())) == 400
    assert torch.equal(idx, idx.sort().values) and 0 <= int(idx[0]) and int(idx[-1]) < 5_000
    assert torch.equal(idx, randk_indices(5_000, 400, 42, 3))          # recomputable
    assert not torch.equal(idx, randk_indices(5_000, 400, 42, 4))      # a new mask per round
    assert not torch.equal(idx, randk_indices(5_000, 400, 43, 3))      # and per run seed
    assert mask_seed(42, 3) == mask_seed(42, 3) != mask_seed(3, 42)


def test_randk_kept_set_is_independent_of_the_data_and_the_client():
    """Given the round's public seed, every client keeps the same coordinates whatever its
    update (even a huge, a zero or a non-finite one) and whatever its noise generator."""
    cfg = _cfg(fedsmp_ratio=0.05, seed=7)
    gen = torch.Generator().manual_seed(0)
    updates = [torch.randn(3_000, generator=gen), torch.zeros(3_000),
               1e6 * torch.randn(3_000, generator=gen), torch.full((3_000,), float("nan"))]
    expected = randk_indices(3_000, 150, 7, 5)
    half = METHODS["fedsmp"].client
    for i, u in enumerate(updates):
        assert torch.equal(kept_indices(cfg, u, 5), expected)
        out, _, _ = half.release_update(cfg, {}, u, 0.5, 1.0,
                                        torch.Generator().manual_seed(100 + i), 5, {})
        assert set(out.nonzero().flatten().tolist()) == set(expected.tolist())


def test_randk_mask_is_uniform_over_rounds():
    """Each coordinate is kept in a share k/d of the rounds (chi-square over 400 rounds)."""
    dim, k, rounds = 200, 20, 400
    counts = torch.zeros(dim)
    for r in range(1, rounds + 1):
        counts[randk_indices(dim, k, 0, r)] += 1
    expected = rounds * k / dim
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert stats.chi2.sf(chi2, dim - 1) > 1e-4, chi2


@pytest.mark.parametrize("seed", range(4))
def test_topk_picks_the_largest_magnitudes(seed):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(2_000, generator=gen) * torch.rand(2_000, generator=gen) ** 3
    k = [1, 10, 200, 2_000][seed]
    idx = topk_indices(u, k)
    reference = sorted(range(2_000), key=lambda j: -abs(float(u[j])))[:k]
    assert idx.tolist() == sorted(reference)
    smallest_kept = u.abs()[idx].min()
    dropped = torch.ones(2_000, dtype=torch.bool)
    dropped[idx] = False
    assert k == 2_000 or bool(u.abs()[dropped].max() <= smallest_kept)


def test_topk_follows_the_data_and_sees_negative_coordinates():
    u = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.05, 0.0])
    assert topk_indices(u, 2).tolist() == [1, 3]
    assert topk_indices(-u.flip(0), 2).tolist() == [2, 4]
    cfg = _cfg(fedsmp_mask="topk", fedsmp_ratio=0.5)
    assert kept_indices(cfg, u, 1).tolist() == [1, 2, 3]


# -- the release ---------------------------------------------------------------------------

def test_kept_values_are_clipped_together_and_the_rest_is_zero():
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(1_000, generator=gen)
    kept = randk_indices(1_000, 100, 0, 1)
    out = sparsified_release(u, kept, 0.0, 0.5, torch.Generator().manual_seed(0))
    assert torch.allclose(out[kept], l2_clip(u[kept], 0.5))
    assert float(out.norm()) == pytest.approx(0.5, rel=1e-6)
    rest = torch.ones(1_000, dtype=torch.bool)
    rest[kept] = False
    assert bool((out[rest] == 0).all())
    small = 1e-3 * u                                   # under the clip: kept as they are
    assert torch.equal(sparsified_release(small, kept, 0.0, 0.5,
                                          torch.Generator())[kept], small[kept])


@pytest.mark.parametrize("mask", ["randk", "topk"])
def test_noise_is_gaussian_sigma_c_on_the_kept_coordinates_only(mask):
    """A zero update: the reply is pure noise, non-zero exactly on the k kept coordinates,
    N(0, (sigma C)^2) there (Kolmogorov-Smirnov, mean and std), exactly 0 elsewhere. A
    non-zero update: reply - clipped kept values is the same noise; the others stay 0."""
    sigma, clip, dim = 0.7, 1.5, 40_000
    cfg = _cfg(fedsmp_mask=mask, fedsmp_ratio=0.1, seed=3)
    half = METHODS["fedsmp"].client
    k = kept_count(dim, 0.1)
    for update in (torch.zeros(dim), torch.randn(dim, generator=torch.Generator().manual_seed(9))):
        kept = kept_indices(cfg, update, 2)
        out, _, _ = half.release_update(cfg, {}, update, sigma, clip,
                                        torch.Generator().manual_seed(5), 2, {})
        assert int(torch.count_nonzero(out)) == k
        rest = torch.ones(dim, dtype=torch.bool)
        rest[kept] = False
        assert bool((out[rest] == 0).all())
        noise = (out[kept] - l2_clip(update[kept], clip)).double() / (sigma * clip)
        assert abs(float(noise.mean())) < 5 / math.sqrt(k)
        assert float(noise.std()) == pytest.approx(1.0, abs=5 / math.sqrt(2 * k))
        assert stats.kstest(noise.numpy(), "norm").pvalue > 1e-3


def test_release_draws_its_noise_from_the_generator_only():
    """Same generator state -> bit-identical reply; the rand-k mask does not consume it: the
    reply is the clipped kept values plus the generator's first k standard normals."""
    cfg = _cfg(fedsmp_ratio=0.2)
    half = METHODS["fedsmp"].client
    u = torch.randn(500, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(11)
    twin = replay(gen)
    out, _, _ = half.release_update(cfg, {}, u, 0.3, 1.0, gen, 6, {})
    again, _, _ = half.release_update(cfg, {}, u, 0.3, 1.0, replay(twin), 6, {})
    assert torch.equal(out, again)
    kept = randk_indices(500, 100, cfg.seed, 6)
    expected = torch.zeros(500)
    expected[kept] = l2_clip(u[kept], 1.0) + 0.3 * torch.randn(100, generator=twin)
    assert torch.equal(out, expected)


# -- the event and its accounting ------------------------------------------------------------

@pytest.mark.parametrize("mask", ["randk", "topk"])
def test_event_is_the_shared_gaussian_plan(mask):
    """One Gaussian event per round, sigma = the run's calibrated multiplier, replace-one:
    the shared plan the server computes too (no method plan of its own)."""
    cfg = _cfg(fedsmp_mask=mask, target_epsilon=3.0, num_rounds=7, accountant="rdp")
    half = METHODS["fedsmp"].client
    sigma = noise_multiplier_for(cfg, 1)
    _, event, metrics = half.release_update(cfg, {}, torch.randn(300), sigma, 1.0,
                                            torch.Generator().manual_seed(0), 4,
                                            {TRAIN_LOSS: 0.5})
    assert metrics == {}
    assert METHODS["fedsmp"].plan(cfg, PlanInputs(4, {}, 0, 120, 0)).event is None
    assert event == planned_event(cfg, 120, 4) == PrivacyEvent.gaussian(
        4, sigma, relation="replace-one")
    strategy = build_strategy(cfg, {0: 120})
    assert strategy.planned_event(0, 4) == event
    # a client taking part in every round ends at the target (calibrated for 7 rounds)
    history = [PrivacyEvent.gaussian(r, sigma, relation="replace-one") for r in range(1, 8)]
    assert history_epsilon(history, D, "rdp") == pytest.approx(3.0, rel=1e-3)


def test_accounting_is_dp_accountings_gaussian_at_sensitivity_2c():
    """Replace-one: two clipped vectors differ by <= 2C in L2, noise sigma C: a Gaussian of
    multiplier sigma / 2 at sensitivity 1, composed over the rounds a client takes part in
    (no amplification by client sampling)."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    sigma, rounds = 3.0, 12
    events = [PrivacyEvent.gaussian(r, sigma, relation="replace-one") for r in range(rounds)]
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(dp_event.GaussianDpEvent(sigma / 2), rounds)
    assert history_epsilon(events, D, "rdp") == pytest.approx(rdp.get_epsilon(D), rel=1e-9)
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(dp_event.GaussianDpEvent(sigma / 2), rounds)
    assert history_epsilon(events, D, "pld") == pytest.approx(pld.get_epsilon(D), rel=1e-3)


# -- verdicts and configuration --------------------------------------------------------------

def test_verdict_per_mask():
    randk = guarantee(_cfg())
    assert randk.verdict == "formal" and randk.unit == "client"
    assert "public random mask" in randk.scope and "no amplification" in randk.scope
    topk = guarantee(_cfg(fedsmp_mask="topk"))
    assert topk.verdict.startswith("none: top-k positions released")
    assert "NOT a bound" in topk.scope
    assert guarantee(_cfg(reproducible=True)).verdict.startswith("none: ")


@pytest.mark.parametrize("key,value", [
    ("fedsmp-mask", "bottomk"), ("fedsmp-ratio", 0.0), ("fedsmp-ratio", -0.1),
    ("fedsmp-ratio", 1.5), ("fedsmp-ratio", float("nan")), ("fedsmp-rescale", "maybe"),
])
def test_bad_keys_are_config_errors_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        _cfg(**{key.replace("-", "_"): value})


def test_trainer_rule_and_defaults():
    with pytest.raises(ConfigError, match="'trainer'"):
        run_config(strategy="fedsmp", trainer="plain")
    params = _cfg().params
    assert isinstance(params, FedSMPParams)
    assert (params.fedsmp_mask, params.fedsmp_ratio, params.fedsmp_rescale) == ("randk", 0.1,
                                                                              True)


# -- server half ---------------------------------------------------------------------------

def _update(pid, flat):
    return ClientUpdate(node_id=pid + 1, partition_id=pid, flat=flat, num_examples=1,
                        metrics={})


def test_randk_replies_outside_the_rounds_mask_are_rejected():
    strategy = build_strategy(_cfg(fedsmp_ratio=0.1, seed=5))
    strategy.round = RoundContext(3, {})
    kept = randk_indices(1_000, 100, 5, 3)
    inside = torch.zeros(1_000)
    inside[kept] = 1.0
    assert strategy.reply_problem(_update(0, inside)) is None
    assert strategy.reply_problem(_update(0, torch.zeros(1_000))) is None
    outside = inside.clone()
    outside[[j for j in range(1_000) if j not in set(kept.tolist())][:2]] = 0.5
    assert "2 non-zero coordinates outside" in strategy.reply_problem(_update(0, outside))
    strategy.round = RoundContext(4, {})                      # last round's mask is not this round's
    assert "outside" in strategy.reply_problem(_update(0, inside))


def test_topk_replies_with_more_than_k_nonzeros_are_rejected():
    strategy = build_strategy(_cfg(fedsmp_mask="topk", fedsmp_ratio=0.1))
    flat = torch.zeros(1_000)
    flat[:100] = 1.0
    assert strategy.reply_problem(_update(0, flat)) is None
    flat[500] = -1.0
    assert "101 non-zero coordinates > k = 100" in strategy.reply_problem(_update(0, flat))


@pytest.mark.parametrize("mask,rescale,factor", [("randk", True, 10.0), ("randk", False, 1.0),
                                                 ("topk", True, 1.0)])
def test_aggregate_is_the_mean_times_d_over_k_for_rescaled_randk(mask, rescale, factor):
    strategy = build_strategy(_cfg(fedsmp_mask=mask, fedsmp_rescale=rescale,
                                   fedsmp_ratio=0.1))
    updates = torch.zeros(2, 50)
    updates[0, :5], updates[1, 5:9] = 1.0, 3.0
    out = strategy.aggregate_updates(updates, torch.ones(2))
    assert torch.allclose(out, factor * updates.mean(0))
    metrics = strategy.round_metrics(RoundRecord(1, accepted=[_update(0, updates[0]),
                                                              _update(1, updates[1])]))
    assert metrics["fedsmp-kept-fraction"] == pytest.approx(0.09)


def test_norm_bound_counts_the_kept_coordinates_only():
    cfg = _cfg(fedsmp_ratio=0.01, target_epsilon=2.0)
    strategy = build_strategy(cfg)
    sigma = noise_multiplier_for(cfg, 1)
    assert strategy.guard.norm_bound(20_000, 1) == pytest.approx(
        gaussian_norm_bound(1.0, sigma, 200))
    honest = sparsified_release(torch.randn(20_000), randk_indices(20_000, 200, cfg.seed, 1),
                                sigma, 1.0, torch.Generator().manual_seed(0))
    assert float(honest.norm()) < strategy.guard.norm_bound(20_000, 1)
    assert build_strategy(_cfg(max_update_norm=3.0)).guard.norm_bound(20_000, 1) == 3.0


# -- the client app's reply, planned and accepted -----------------------------------------------

DIGITS = {"dataset": "digits", "model": "mlp", "batch-size": 64, "num-rounds": 2, "lr": 0.1,
          "strategy": "fedsmp", "trainer": "update-dp", "target-epsilon": 4.0,
          "fedsmp-ratio": 0.05}


@pytest.mark.parametrize("mask", ["randk", "topk"])
def test_client_app_reply_is_planned_charged_and_accepted(mask, server_identity):
    raw = {**DIGITS, "fedsmp-mask": mask}
    cfg = run_config(**{k.replace("-", "_"): v for k, v in raw.items()})
    sizes = {pid: len(client_data(cfg, pid, 2).y_train) for pid in (0, 1)}
    strategy = build_strategy(cfg, sizes)
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    arrays = ArrayRecord(model.state_dict())
    dim = sum(v.numel() for v in model.state_dict().values())
    k = kept_count(dim, 0.05)

    class Grid:
        def get_node_ids(self):
            return [1, 2]

    _, record = strategy.start_round(1, arrays, Grid())
    replies, supports = [], []
    for pid in (0, 1):
        plan = strategy.planned_event(pid, 1)
        config = ConfigRecord({"server-round": 1, **plan_to_record(plan)})
        reply = train(message(RecordDict({"arrays": arrays, "config": config})),
                      context(raw, pid, 2))
        assert "status" not in reply.content.config_records, dict(reply.content["status"])
        flat = torch.cat([torch.from_numpy(a.numpy()).reshape(-1)
                          for a in reply.content["arrays"].values()])
        supports.append(set(flat.nonzero().flatten().tolist()))
        assert len(supports[-1]) == k
        assert reply.content["metrics"]["noise-multiplier"] == pytest.approx(plan.sigma)
        replies.append(message(reply.content, src_node_id=pid + 1))
    if mask == "randk":  # the same public mask for both clients
        assert supports[0] == supports[1] == set(randk_indices(dim, k, cfg.seed, 1).tolist())
    outcome = strategy.finish_round(1, record, replies)
    assert [u.partition_id for u in outcome.record.accepted] == [0, 1]
    assert dict(outcome.metrics)["fedsmp-kept-fraction"] == pytest.approx(k / dim)
    assert all(c.problem is None for c in outcome.record.charges)


@pytest.mark.parametrize("mask", ["randk", "topk"])
def test_fedsmp_over_dpsgd_sparsifies_the_dpsgd_update(mask, server_identity):
    """Sample-level Fed-SMP: the real ClientApp trains with DP-SGD, then keeps k = round(r d)
    coordinates — the round's public rand-k mask, or the top-k of the already-noised update
    (post-processing either way: verdict formal, the ledger's events are DP-SGD's); the
    server accepts the sparse replies under its DP-SGD norm bound."""
    from flwr.app import ArrayRecord

    from dpfl.apps.client import train
    from dpfl.data import splits_for
    from dpfl.methods import build_strategy, guarantee, parse_run_config
    from dpfl.methods.fedsmp import kept_count, randk_indices
    from dpfl.models import build_model
    from dpfl.privacy.accounting.ledger import Ledger
    from dpfl.tensors import flatten

    from flower_helpers import context, message

    run_config = {"dataset": "digits", "model": "mlp", "batch-size": 64, "lr": 0.1,
                  "num-rounds": 2, "target-epsilon": 8.0, "strategy": "fedsmp",
                  "trainer": "dpsgd", "fedsmp-mask": mask, "fedsmp-ratio": 0.1}
    cfg = parse_run_config(run_config)
    assert guarantee(cfg).verdict == "formal"
    strategy = build_strategy(cfg, {i: len(s.train) for i, s in enumerate(splits_for(cfg, 2))},
                              ledger=Ledger(cfg.delta, cfg.accountant, budget=8.0))

    class Grid:
        def get_node_ids(self):
            return [11, 12]

    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    messages, record = strategy.start_round(1, ArrayRecord(model.state_dict()), Grid())
    replies = []
    for pid, m in enumerate(messages):
        node = int(m.metadata.dst_node_id)
        reply = train(message(m.content, 0, node), context(run_config, pid, 2))
        flat = flatten(reply.content["arrays"].to_torch_state_dict())
        k = kept_count(flat.numel(), 0.1)
        nonzero = torch.nonzero(flat).reshape(-1)
        assert 0 < nonzero.numel() <= k
        if mask == "randk":
            assert set(nonzero.tolist()) <= set(randk_indices(flat.numel(), k, cfg.seed,
                                                              1).tolist())
        assert reply.content["privacy"]["mechanism"] == ["dpsgd"]
        replies.append(message(reply.content, src_node_id=node))
    outcome = strategy.finish_round(1, record, replies)
    assert len(outcome.record.accepted) == 2, [r.reason for r in outcome.record.rejected]
