"""Privacy core: events vs the libraries' own accountants, the Rényi filter's stopping
point, the ledger's vectorised epsilons and its persistence, the mechanisms' behaviour."""

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant, compute_epsilon
from opacus.accountants import RDPAccountant

from dpfl.privacy.budget import PrivacyHistory
from dpfl.privacy.events import PrivacyEvent, histories_epsilon, history_epsilon, orders_for
from dpfl.privacy.filter import RenyiFilter
from dpfl.privacy.ledger import Ledger, ledger_config, prior_history
from dpfl.privacy.mechanisms import (
    GaussianMechanism,
    LaplaceMechanism,
    NormClip,
    QuantileClipTracker,
    SparseVector,
)

D = 1e-5


def test_dpsgd_history_equals_opacus_accountant():
    events = [PrivacyEvent.dpsgd(1, 1.1, 0.01, 100), PrivacyEvent.dpsgd(2, 0.9, 0.02, 50)]
    acc = RDPAccountant()
    acc.history = [(1.1, 0.01, 100), (0.9, 0.02, 50)]
    assert history_epsilon(events, D) == pytest.approx(acc.get_epsilon(D), rel=1e-12)


def test_client_level_history_equals_dp_accounting():
    events = [PrivacyEvent.gaussian(r, 1.5) for r in range(1, 6)] + [PrivacyEvent.pure(6, 0.5)]
    acc = RdpAccountant()
    acc.compose(dp_event.GaussianDpEvent(1.5), 5)
    acc.compose(dp_event.LaplaceDpEvent(2.0))
    assert history_epsilon(events, D) == pytest.approx(acc.get_epsilon(D), rel=1e-9)
    # PLD too
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    pld = PLDAccountant()
    pld.compose(dp_event.GaussianDpEvent(1.5), 5)
    pld.compose(dp_event.LaplaceDpEvent(2.0))
    assert history_epsilon(events, D, "pld") == pytest.approx(pld.get_epsilon(D), rel=1e-6)


def test_one_laplace_release_is_pure_epsilon():
    # one Laplace release of scale b = Delta / eps: eps-DP, so the RDP bound at delta -> 0
    # must approach eps from above and never undercut it
    eps = history_epsilon([PrivacyEvent.pure(1, 0.7)], 1e-12)
    assert 0.7 <= eps < 0.7 + 0.05


def test_sparse_vector_pure_rdp_bound():
    # eps-DP => (alpha, min(eps, alpha eps^2 / 2))-RDP: compose by hand and convert with
    # dp-accounting's own conversion
    orders = orders_for("client")
    rdp = 3 * np.minimum(0.3, orders * 0.09 / 2)
    expected, _ = compute_epsilon(orders, rdp, D)
    events = [PrivacyEvent.pure(r, 0.3, "sparse-vector") for r in (1, 2, 3)]
    # the RDP route alone gives slightly more than basic composition here (0.9035 > 0.9):
    # the ledger takes the better of the two valid bounds
    assert expected > 0.9
    assert history_epsilon(events, D) == pytest.approx(min(expected, 0.9), rel=1e-12)
    many = [PrivacyEvent.pure(r, 0.3, "sparse-vector") for r in range(1, 201)]
    rdp_many, _ = compute_epsilon(orders, 200 * np.minimum(0.3, orders * 0.09 / 2), D)
    assert rdp_many < 60.0 and history_epsilon(many, D) == pytest.approx(rdp_many, rel=1e-12)


def test_mixed_units_are_refused():
    with pytest.raises(ValueError, match="mixes"):
        history_epsilon([PrivacyEvent.dpsgd(1, 1.0, 0.1, 1), PrivacyEvent.gaussian(1, 1.0)], D)


def test_histories_epsilon_matches_one_by_one():
    rng = np.random.default_rng(0)
    histories = {}
    for c in range(30):
        rounds = sorted(rng.choice(20, size=rng.integers(1, 10), replace=False) + 1)
        histories[f"client-{c}"] = [PrivacyEvent.dpsgd(int(r), 1.0, 0.01, 50) for r in rounds]
    histories["client-30"] = []
    histories["client-31"] = [PrivacyEvent.gaussian(1, 2.0), PrivacyEvent.gaussian(2, 2.0)]
    fast = histories_epsilon(histories, D)
    for name, h in histories.items():
        assert fast[name] == pytest.approx(history_epsilon(h, D), rel=1e-12)


def test_renyi_filter_stops_exactly_where_the_budget_would_be_crossed():
    f = RenyiFilter(epsilon=3.0, delta=D, unit="client")
    orders = orders_for("client")
    budget = 3.0 - math.log(1 / D) / (orders - 1)
    per_round = RdpAccountant(orders=list(orders))
    per_round.compose(dp_event.GaussianDpEvent(2.0))
    curve = per_round.rdp
    usable = budget > 0
    # by hand: the largest k with k * curve(alpha) <= budget(alpha) for some usable alpha
    k_max = int(np.max(np.floor(budget[usable] / curve[usable])))
    events = []
    for r in range(1, 1000):
        e = PrivacyEvent.gaussian(r, 2.0)
        if f.would_exceed(events, e):
            break
        events.append(e)
    assert len(events) == k_max
    # adaptive choices (sigma changing) are fine: the filter only looks at the running sum
    h = PrivacyHistory(adaptive=True)
    for r, s in enumerate([3.0, 1.0, 2.0, 0.7], start=1):
        refuse, _ = h.would_exceed(PrivacyEvent.gaussian(r, s), 3.0, D)
        if refuse:
            break
        h.charge(PrivacyEvent.gaussian(r, s))
    total = sum(RdpAccountant(orders=list(orders)).rdp for _ in [0])  # zeros
    for e in h.events:
        a = RdpAccountant(orders=list(orders))
        a.compose(dp_event.GaussianDpEvent(e.sigma))
        total = total + a.rdp
    assert np.any(total[usable] <= budget[usable])


def test_ledger_vectorised_persisted_and_restored(tmp_path):
    ledger = Ledger(D)
    for c in range(3):
        for r in range(1, 4 + c):
            e = PrivacyEvent.dpsgd(r, 1.0, 0.02, 40)
            acc = RDPAccountant()
            acc.history = [(1.0, 0.02, 40 * r)]
            ledger.record(f"client-{c}", r, [e], acc.get_epsilon(D))
    assert ledger.mismatches == []
    ledger.record("client-0", 9, [PrivacyEvent.dpsgd(9, 1.0, 0.02, 40)],
                  0.1)  # a client that under-reports is flagged
    assert len(ledger.mismatches) == 1
    before = ledger.epsilons()
    ledger.save(tmp_path / "ledger.json")
    restored = Ledger.load(tmp_path / "ledger.json")
    assert restored.epsilons() == before
    assert [r for r, _ in restored.epsilon_by_round("client-2")] == [1, 2, 3, 4, 5]
    assert restored.would_exceed("client-2", PrivacyEvent.dpsgd(6, 1.0, 0.02, 40), before["client-2"])
    assert not restored.would_exceed("client-2", PrivacyEvent.dpsgd(6, 1.0, 0.02, 40), 100.0)
    # the server can hand the events back to a client that lost its state
    cfg = ledger_config(restored)
    back = prior_history(cfg, 1)
    assert back.events == restored.clients["client-1"].events
    assert prior_history({}, 1) is None


def test_history_state_round_trip():
    h = PrivacyHistory([PrivacyEvent.gaussian(1, 1.0), PrivacyEvent.pure(2, 0.5, "sparse-vector")])
    again = PrivacyHistory.from_record(h.to_record())
    assert again.events == h.events
    mine = PrivacyHistory([PrivacyEvent.gaussian(2, 1.0)])
    assert mine.merge(h) and mine.rounds == [1, 2] and len(mine.events) == 2


def test_mechanisms_apply_and_describe_themselves():
    g = torch.Generator().manual_seed(0)
    x = torch.full((50_000,), 0.01)
    assert float(NormClip(1.0).apply(x).norm()) == pytest.approx(1.0, rel=1e-4)
    gm = GaussianMechanism(noise_multiplier=2.0, sensitivity=1.0)
    noisy = gm.apply(torch.zeros(50_000), g)
    assert float(noisy.std()) == pytest.approx(2.0, rel=0.02)
    assert gm.event(3) == PrivacyEvent.gaussian(3, 2.0)
    lap = LaplaceMechanism(epsilon=0.5, l1_sensitivity=1.0).apply(torch.zeros(100_000), g)
    assert float(lap.abs().mean()) == pytest.approx(2.0, rel=0.03)  # E|Lap(b)| = b = 2
    assert LaplaceMechanism(0.5, 1.0).event(1).epsilon == 0.5


def test_sparse_vector_releases_at_most_c_above_threshold():
    g = torch.Generator().manual_seed(1)
    x = torch.zeros(1000)
    x[[10, 20, 30, 40]] = 100.0
    svt = SparseVector(eps_threshold=1.0, eps_queries=1.0, eps_answers=8.0, sensitivity=0.01,
                       threshold=50.0, max_answers=3)
    out = svt.apply(x, g)
    assert torch.count_nonzero(out) == 3
    assert set(torch.nonzero(out).flatten().tolist()) == {10, 20, 30}
    assert svt.event(1).epsilon == pytest.approx(10.0)


def test_quantile_tracker_geometric_update_and_noise_split():
    t = QuantileClipTracker(clip=1.0, target_quantile=0.5, learning_rate=0.2,
                            count_noise_multiplier=1e-9)
    new = t.update(torch.tensor([0.1, 0.2, 0.3, 5.0]))  # 3 of 4 under C: b = 0.75
    assert new == pytest.approx(math.exp(-0.2 * 0.25))
    z, sb = 1.0, 10.0
    s_delta = QuantileClipTracker.update_noise_multiplier(z, sb)
    assert s_delta ** -2 + (2 * sb) ** -2 == pytest.approx(z ** -2)
    assert t.event(2).mechanism == "quantile-count"
