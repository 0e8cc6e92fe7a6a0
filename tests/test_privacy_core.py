"""Privacy core: events vs the libraries' own accountants, the Rényi filter's stopping
point, the ledger's vectorised epsilons and its persistence (the mechanisms: see
test_mechanisms.py).

Tolerances: bit-identical where the code makes the same library call as the reference,
otherwise a small factor above the measured agreement (float rounding) or, for sampled
statistics, a few standard errors; each assertion says which."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant, compute_epsilon
from opacus.accountants import RDPAccountant

from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import (
    PrivacyEvent,
    histories_epsilon,
    history_epsilon,
    orders_for,
)
from dpfl.privacy.accounting.filter import RenyiFilter
from dpfl.privacy.accounting.ledger import Ledger, ledger_config, prior_history

D = 1e-5


def test_dpsgd_history_equals_opacus_accountant():
    events = [PrivacyEvent.dpsgd(1, 1.1, 0.01, 100), PrivacyEvent.dpsgd(2, 0.9, 0.02, 50)]
    acc = RDPAccountant()
    acc.history = [(1.1, 0.01, 100), (0.9, 0.02, 50)]
    # Opacus' compute_rdp summed over the same entries, same conversion: float rounding
    # only (measured 0)
    assert history_epsilon(events, D) == pytest.approx(acc.get_epsilon(D), rel=1e-14)


def test_client_level_history_equals_dp_accounting():
    events = [PrivacyEvent.gaussian(r, 1.5) for r in range(1, 6)] + [PrivacyEvent.pure(6, 0.5)]
    acc = RdpAccountant()
    acc.compose(dp_event.GaussianDpEvent(1.5), 5)
    acc.compose(dp_event.LaplaceDpEvent(2.0))
    # RDP curves add: the per-round sum vs dp-accounting's count-5 composition differs by
    # float rounding only (measured 0)
    assert history_epsilon(events, D) == pytest.approx(acc.get_epsilon(D), rel=1e-14)
    # PLD too: the history's canonical signature composes the Gaussian once with count 5,
    # Laplace after it (sorted), exactly as here, so the values are bit-identical
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    pld = PLDAccountant()
    pld.compose(dp_event.GaussianDpEvent(1.5), 5)
    pld.compose(dp_event.LaplaceDpEvent(2.0))
    assert history_epsilon(events, D, "pld") == pld.get_epsilon(D)


def test_one_laplace_release_is_pure_epsilon():
    # one Laplace release of scale b = Delta / eps is eps-DP: the RDP route alone gives
    # more at delta = 1e-12, and the ledger's basic-composition bound (the smaller of the
    # two valid bounds) gives exactly eps
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant as Rdp

    acc = Rdp()
    acc.compose(dp_event.LaplaceDpEvent(1 / 0.7))
    assert acc.get_epsilon(1e-12) > 0.7
    assert history_epsilon([PrivacyEvent.pure(1, 0.7)], 1e-12) == 0.7


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
    # 0.3 + 0.3 + 0.3 vs 0.9: float rounding (measured 1.2e-16)
    assert history_epsilon(events, D) == pytest.approx(min(expected, 0.9), rel=1e-15)
    many = [PrivacyEvent.pure(r, 0.3, "sparse-vector") for r in range(1, 201)]
    rdp_many, _ = compute_epsilon(orders, 200 * np.minimum(0.3, orders * 0.09 / 2), D)
    # 200 x curve vs the same curve times 200: float rounding (measured 0)
    assert rdp_many < 60.0 and history_epsilon(many, D) == pytest.approx(rdp_many, rel=1e-14)


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
        # a matrix product vs a per-history sum of the same curves: float rounding only
        assert fast[name] == pytest.approx(history_epsilon(h, D), rel=1e-14)


def _hand_budget(eps: float, delta: float, orders: np.ndarray) -> np.ndarray:
    """Balle et al. 2020 Thm 21 solved for the RDP value, typed in by hand:
    eps = rdp + log((a-1)/a) - (log delta + log a)/(a-1)  <=>  rdp = B(a)."""
    return eps + (math.log(delta) + np.log(orders)) / (orders - 1) - np.log((orders - 1) / orders)


def test_renyi_filter_stops_exactly_where_the_budget_would_be_crossed():
    f = RenyiFilter(epsilon=3.0, delta=D, unit="client")
    orders = orders_for("client")
    budget = _hand_budget(3.0, D, orders)
    per_round = RdpAccountant(orders=list(orders))
    per_round.compose(dp_event.GaussianDpEvent(5.0))
    curve = per_round.rdp
    usable = budget > 0
    # by hand: the largest k with k * curve(alpha) <= budget(alpha) for some usable alpha
    k_max = int(np.max(np.floor(budget[usable] / curve[usable])))
    # the same k from dp-accounting's own conversion: the largest k whose composed
    # epsilon is <= 3 (for a fixed sigma the filter is the non-adaptive accountant)
    k_lib = 0
    while True:
        acc = RdpAccountant()
        acc.compose(dp_event.GaussianDpEvent(5.0), k_lib + 1)
        if acc.get_epsilon(D) > 3.0:
            break
        k_lib += 1
    assert k_max == k_lib == 11
    # Mironov's curve (the old one) stopped after 8 rounds
    mironov = 3.0 - math.log(1 / D) / (orders - 1)
    ok = mironov > 0
    assert int(np.max(np.floor(mironov[ok] / curve[ok]))) == 8
    events = []
    for r in range(1, 1000):
        e = PrivacyEvent.gaussian(r, 5.0)
        if f.would_exceed(events, e):
            break
        events.append(e)
    assert len(events) == k_max
    # adaptive choices (sigma changing) are fine: the filter only looks at the running sum
    h = PrivacyHistory(adaptive=True)
    refused = None
    for r, s in enumerate([6.0, 4.0, 5.0, 1.0], start=1):
        refuse, _ = h.would_exceed(PrivacyEvent.gaussian(r, s), 3.0, D)
        if refuse:
            refused = s
            break
        h.charge(PrivacyEvent.gaussian(r, s))
    assert [e.sigma for e in h.events] == [6.0, 4.0, 5.0] and refused == 1.0
    total = np.zeros(len(orders))
    for e in h.events:
        a = RdpAccountant(orders=list(orders))
        a.compose(dp_event.GaussianDpEvent(e.sigma))
        total = total + a.rdp
    assert np.any(total[usable] <= budget[usable])
    a = RdpAccountant(orders=list(orders))
    a.compose(dp_event.GaussianDpEvent(refused))
    assert not np.any((total + a.rdp)[usable] <= budget[usable])


def _rdp_calibrated_sigma(target: float) -> float:
    """sigma of one Gaussian release with dp-accounting RDP epsilon <= target, to 1e-12
    (bisection on dp-accounting directly, independent of dpfl)."""
    def eps(s):
        acc = RdpAccountant()
        acc.compose(dp_event.GaussianDpEvent(s))
        return acc.get_epsilon(D)
    lo, hi = 0.1, 10.0
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if eps(mid) > target else (lo, mid)
    assert eps(hi) <= target < eps(lo)
    return hi


def test_renyi_filter_admits_one_release_calibrated_to_its_epsilon():
    sigma = _rdp_calibrated_sigma(4.0)
    f = RenyiFilter(epsilon=4.0, delta=D, unit="client")
    assert not f.would_exceed([], PrivacyEvent.gaussian(1, sigma))
    assert f.would_exceed([], PrivacyEvent.gaussian(1, 0.99 * sigma))
    # Mironov's B(alpha) = eps - log(1/delta)/(alpha - 1) refused it at every order
    orders = orders_for("client")
    acc = RdpAccountant(orders=list(orders))
    acc.compose(dp_event.GaussianDpEvent(sigma))
    mironov = 4.0 - math.log(1 / D) / (orders - 1)
    assert not np.any(acc.rdp <= mironov)


def test_renyi_filter_budget_is_the_libraries_conversion():
    # for a history of one repeated release (k steps): the filter admits it iff
    # dp-accounting's compute_epsilon (client orders) / Opacus' get_privacy_spent (sample
    # orders) gives epsilon <= the budget (alpha* = argmax B / RDP_1 is then the order the
    # libraries' minimum picks at the budget's edge)
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    client, sample = orders_for("client"), orders_for("sample")
    for eps in (0.5, 2.0, 8.0):
        for k in (1, 2, 3, 5, 8, 13, 21, 34, 55, 89):
            acc = RdpAccountant(orders=list(client))
            acc.compose(dp_event.GaussianDpEvent(4.0), k)
            lib, _ = compute_epsilon(client, acc.rdp, D)
            event = PrivacyEvent(1, "gaussian", 4.0, 1.0, k, 0.0, "add-remove")
            assert RenyiFilter(eps, D, "client").admits([event]) == (lib <= eps), (eps, k)
            rdp = compute_rdp(q=0.01, noise_multiplier=1.0, steps=40 * k, orders=list(sample))
            lib, _ = get_privacy_spent(orders=list(sample), rdp=list(rdp), delta=D)
            event = PrivacyEvent.dpsgd(1, 1.0, 0.01, 40 * k)
            assert RenyiFilter(eps, D, "sample").admits([event]) == (lib <= eps), (eps, k)


def test_renyi_filter_holds_one_order_fixed_by_the_first_event():
    """A mixed history (DP-SGD events of another sampling rate after the first): the old
    rule admitted it because SOME order was still within budget (7.7 here), which is sound
    only for fixed histories or RDP linear in the order; under adaptive choices the filter
    must hold the budget at one order fixed in advance (Feldman & Zrnic 2021). alpha* is
    argmax B(alpha) / RDP_first(alpha), checked by hand on Opacus' RDP."""
    from opacus.accountants.analysis.rdp import compute_rdp

    orders = orders_for("sample")
    budget = _hand_budget(2.0, D, orders)
    first = PrivacyEvent.dpsgd(1, 1.2, 0.05, 10)
    anchor = np.asarray(compute_rdp(q=0.05, noise_multiplier=1.2, steps=10,
                                    orders=list(orders)))
    ok = budget > 0
    alpha = orders[ok][np.argmax(budget[ok] / anchor[ok])]
    f = RenyiFilter(2.0, D, "sample")
    assert f.order([first]) == alpha == pytest.approx(7.3)
    later = [PrivacyEvent.dpsgd(r, 1.0, 0.01, 20) for r in range(2, 34)]   # 32 of them
    total = anchor + np.asarray(compute_rdp(q=0.01, noise_multiplier=1.0, steps=20 * 32,
                                            orders=list(orders)))
    some_order = bool(np.any(total[ok] <= budget[ok]))          # the old rule: admitted
    at_alpha = total[orders == alpha][0] <= budget[orders == alpha][0]
    assert some_order and not at_alpha
    assert not f.admits([first] + later)
    assert f.admits([first] + later[:-1])
    refuse, quoted = PrivacyHistory([first] + later[:-1], adaptive=True).would_exceed(
        later[-1], 2.0, D)
    index = int(np.flatnonzero(orders == alpha)[0])
    hand = total[index] + math.log1p(-1 / alpha) - math.log(D * alpha) / (alpha - 1)
    assert refuse and quoted == pytest.approx(hand, rel=1e-9) and quoted > 2.0


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


def test_an_adaptive_refusal_quotes_the_filters_epsilon():
    """The filter decides on the RDP conversion, so the epsilon a refusal quotes is that
    one — dp-accounting's RdpAccountant on the filter's orders — not the PLD figure, which
    is lower here (it would read 'epsilon would reach 2.9 > 3' for a refused round)."""
    sigmas = [6.0, 4.0, 5.0, 1.2]
    h = PrivacyHistory([PrivacyEvent.gaussian(r, s) for r, s in enumerate(sigmas[:3], 1)],
                       adaptive=True)
    nxt = PrivacyEvent.gaussian(4, sigmas[3])
    acc = RdpAccountant(orders=list(orders_for("client")))
    for s in sigmas:
        acc.compose(dp_event.GaussianDpEvent(s))
    rdp_eps = acc.get_epsilon(D)
    pld_eps = h.epsilon(D, "pld", extra=nxt)
    budget = 0.5 * (pld_eps + rdp_eps)          # PLD says it fits, the filter says no
    assert pld_eps < budget < rdp_eps
    refuse, quoted = h.would_exceed(nxt, budget, D, "pld")
    # the quote is the RDP conversion at the filter's order (Gaussians only: alpha* is
    # where the libraries' minimum lands too, up to the grid), never below RDP's minimum
    assert refuse and quoted == pytest.approx(rdp_eps, rel=1e-3) and quoted >= rdp_eps
    # the filter's measure and its decision agree at the boundary
    f = RenyiFilter(budget, D, "client")
    assert f.epsilon_of(h.events + [nxt]) == pytest.approx(quoted, rel=1e-12)
    assert not f.admits(h.events + [nxt]) and quoted > budget
    assert f.admits(h.events) and f.epsilon_of(h.events) <= budget
    # a non-adaptive history still quotes (and decides on) its own accountant
    plain = PrivacyHistory(list(h.events))
    assert plain.would_exceed(nxt, budget, D, "pld") == (False, pytest.approx(pld_eps))


def test_an_adaptive_history_reports_the_filters_budget_as_its_guarantee():
    from dpfl.server.report import epsilon_table

    g = {"verdict": "formal", "scope": "s", "unit": "client", "relation": "replace-one",
         "sampling": "none", "delta": D, "accountant": "rdp"}
    plain = {"epsilon": 2.4701, "rounds": [1, 2]}
    adaptive = {**plain, "adaptive": True, "guaranteed-epsilon": 4.0}
    text = epsilon_table({"guarantee": g, "clients": {"client-0": adaptive}})
    assert "<= 4 (filter)" in text and "informative" in text and "2.4701" in text
    text = epsilon_table({"guarantee": g, "clients": {"client-0": plain}})
    assert "filter" not in text and "informative" not in text


def test_a_large_federations_table_shows_its_largest_epsilons_and_the_range():
    """Beyond 30 clients the printed table holds the 30 of largest epsilon (the ones the
    guarantee is about) and one line with how many more and their min / median / max;
    --all (max_rows=None) prints every client."""
    from dpfl.server.report import epsilon_table

    g = {"verdict": "formal", "scope": "s", "unit": "client", "relation": "add-remove",
         "sampling": "poisson", "delta": D, "accountant": "pld"}
    clients = {f"client-{i}": {"epsilon": i / 100, "rounds": [1]} for i in range(100)}
    text = epsilon_table({"guarantee": g, "clients": clients})
    shown = [line for line in text.splitlines() if "client-" in line and "│" in line]
    assert len(shown) == 30
    assert "client-99 " in text and "client-70 " in text and "client-69 " not in text
    assert "of 100" in text and "min 0.0000" in text and "max 0.9900" in text
    full = epsilon_table({"guarantee": g, "clients": clients}, max_rows=None)
    assert len([line for line in full.splitlines() if "client-" in line and "│" in line]) == 100
