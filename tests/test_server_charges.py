"""Releases the server makes itself, charged in the ledger to every client they cover.

Adaptive clipping's noisy clipped count (Andrew et al. 2021; sigma_b = 10, centred so its
event is a Gaussian of multiplier 2 sigma_b) is released in rounds 1 and 2 over the clients
that replied. Each client's epsilon must be dp-accounting's composition of its own update
releases and the server's counts, built by hand here with dp-accounting's RdpAccountant /
PLDAccountant; a client the count did not cover is charged nothing for it; the charges
survive ledger.json and show in ``dpfl privacy-report``.

Tolerances: RDP curves summed per event vs dp-accounting's count-k composition differ by
float rounding at most (measured 0); the PLD of the ledger merges plain Gaussians exactly
into one (GDP composition) while the hand composition discretises each: both are upper
bounds within 5e-8 of the exact epsilon (measured below)."""

import json
import math

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant
from scipy.stats import norm

from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import Ledger, ledger_config, prior_history
from dpfl.privacy.mechanisms.release import GaussianMechanism, QuantileClipTracker
from dpfl.privacy_report import privacy_report

from rundir_helpers import lines_from_ledger, summary_of

D = 1e-5
SIGMA_UPDATE = 1.2        # each client's own update noise (replace-one: GaussianDpEvent(0.6))
SIGMA_B = 10.0            # the clipped count's noise std (centred: multiplier 20, i.e. 10 under
                          # replace-one)
COVERED = {1: ["client-0", "client-1", "client-2"], 2: ["client-0", "client-1"]}
ALL = ["client-0", "client-1", "client-2", "client-3"]


def _run(accountant: str) -> tuple[Ledger, dict[str, float]]:
    """Two rounds: every client in ALL releases its update; the server releases the count
    over COVERED[r]. Returns the ledger and each client's own (reported) epsilon."""
    ledger = Ledger(D, accountant)
    mech = GaussianMechanism(SIGMA_UPDATE, sensitivity=1.0, relation="replace-one")
    tracker = QuantileClipTracker(clip=1.0, count_noise_multiplier=SIGMA_B,
                                  relation="replace-one")
    generator = torch.Generator().manual_seed(0)
    reported = {}
    for r in (1, 2):
        norms = []
        for client in ALL:
            update, event = mech.release(torch.randn(50, generator=generator), generator, r)
            own = [PrivacyEvent.gaussian(q, SIGMA_UPDATE, relation="replace-one")
                   for q in range(1, r + 1)]
            reported[client] = _hand([(dp_event.GaussianDpEvent(0.6), r)], accountant)
            ledger.record(client, r, [event], reported[client], "reported = plan")
            assert own == ledger.clients[client].events
            if client in COVERED[r]:
                norms.append(float(update.norm()))
        _, count_event = tracker.release(torch.tensor(norms), generator, r)
        ledger.charge_server_release(r, [count_event], COVERED[r], "adaptive-clipping count")
    return ledger, reported


def _hand(pairs, accountant: str) -> float:
    acc = RdpAccountant() if accountant == "rdp" else PLDAccountant()
    for event, count in pairs:
        acc.compose(event, count)
    return acc.get_epsilon(D)


def _exact_gaussian(mu: float, delta: float) -> float:
    """Exact epsilon of a Gaussian with mu = sensitivity / std (Balle & Wang 2018)."""
    def d(eps):
        return norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu)
    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_each_client_composes_its_own_and_the_servers_releases(accountant):
    ledger, reported = _run(accountant)
    # the clients reported their own events' epsilon: no mismatch, although the ledger's
    # figure also composes the server's counts
    assert ledger.mismatches == []
    counts = {c: sum(c in COVERED[r] for r in (1, 2)) for c in ALL}
    assert counts == {"client-0": 2, "client-1": 2, "client-2": 1, "client-3": 0}
    eps = ledger.epsilons()
    for client in ALL:
        pairs = [(dp_event.GaussianDpEvent(0.6), 2)]
        if counts[client]:
            pairs.append((dp_event.GaussianDpEvent(SIGMA_B), counts[client]))
        hand = _hand(pairs, accountant)
        if accountant == "rdp" or not counts[client]:
            # RDP: float rounding at most (measured 0); an uncovered client's PLD is the
            # same single composition (bit-identical)
            assert eps[client] == pytest.approx(hand, rel=1e-13)
        else:
            # PLD: merged Gaussian vs two discretised ones; both upper bounds of the exact
            # epsilon of mu^2 = 2 / 0.6^2 + k / 10^2 (measured: merged 2.6e-9 above exact,
            # hand 5.0e-9 above, 2e-10 apart relative)
            exact = _exact_gaussian(math.sqrt(2 / 0.36 + counts[client] / 100), D)
            assert exact - 1e-12 <= eps[client] <= exact + 5e-8
            assert exact - 1e-12 <= hand and abs(eps[client] - hand) <= 1e-7
        assert eps[client] == ledger.epsilon(client) == ledger.recomputed(client)
        if counts[client]:  # the server's counts cost something
            assert eps[client] > reported[client]
    # client-3 was never covered: charged its own releases only, i.e. its report
    assert eps["client-3"] == reported["client-3"]
    assert ledger.server.get("client-3") is None
    assert ledger.rounds("client-2") == [1, 2] and ledger.server["client-2"][0].round == 1
    assert ledger.epsilon_by_round("client-0")[-1][1] == pytest.approx(eps["client-0"],
                                                                        rel=1e-12)


def test_server_charges_survive_ledger_json_and_stay_marked(tmp_path):
    ledger, _ = _run("rdp")
    before = ledger.epsilons()
    ledger.save(tmp_path / "ledger.json")
    data = json.loads((tmp_path / "ledger.json").read_text())
    server = [c for c in data["charges"] if c["source"] == "server"]
    assert sorted((c["round"], c["client"]) for c in server) == [
        (1, "client-0"), (1, "client-1"), (1, "client-2"), (2, "client-0"), (2, "client-1")]
    assert all(c["note"] == "adaptive-clipping count" for c in server)
    assert all(c["source"] == "client" for c in data["charges"] if c not in server)
    assert data["clients"]["client-0"]["server-events"][0]["mechanism"] == "quantile-count"
    assert data["clients"]["client-3"]["server-events"] == []
    restored = Ledger.load(tmp_path / "ledger.json")
    assert restored.epsilons() == before
    assert restored.server == ledger.server and restored.clients == ledger.clients
    # the hand-back to clients after a restart carries only their own events
    assert prior_history(ledger_config(restored), 0).events == ledger.clients["client-0"].events


def test_server_events_must_match_the_clients_unit():
    ledger = Ledger(D)
    ledger.record("client-0", 1, [PrivacyEvent.gaussian(1, 1.0)])
    ledger.record("client-1", 1, [PrivacyEvent.dpsgd(1, 1.0, 0.02, 40)])
    count = QuantileClipTracker(1.0, count_noise_multiplier=SIGMA_B).event(1)
    with pytest.raises(ValueError, match="mixes sample-level and client-level"):
        ledger.charge_server_release(1, [count], ["client-0", "client-1"], "count")
    # nothing was charged, not even to the client whose unit matched
    assert ledger.server == {} and all(c["source"] == "client" for c in ledger.charges)
    # and a client-level history refuses a later DP-SGD event because of the server's
    ledger.charge_server_release(1, [count], ["client-0"], "count")
    with pytest.raises(ValueError, match="mixes"):
        ledger.record("client-0", 2, [PrivacyEvent.dpsgd(2, 1.0, 0.02, 40)])


def test_budget_checks_and_adaptive_marking_see_the_servers_releases():
    own = Ledger(D)
    own.record("client-0", 1, [PrivacyEvent.gaussian(1, 2.0)])
    both = Ledger(D)
    both.record("client-0", 1, [PrivacyEvent.gaussian(1, 2.0)])
    both.charge_server_release(1, [PrivacyEvent.gaussian(1, 20.0, mechanism="quantile-count")],
                               ["client-0"], "count")
    nxt = PrivacyEvent.gaussian(2, 2.0)
    budget = own.history("client-0").epsilon(D, "rdp", extra=nxt) * (1 + 1e-6)
    # the client's own releases fit the budget; with the server's count they do not
    assert not own.would_exceed("client-0", nxt, budget)
    assert both.would_exceed("client-0", nxt, budget)
    assert not both.history("client-0").adaptive
    both.charge_server_release(2, [PrivacyEvent.gaussian(2, 20.0, mechanism="quantile-count")],
                               ["client-0", "client-9"], "count", adaptive=True)
    assert both.history("client-0").adaptive and both.clients["client-9"].events == []
    assert both.epsilons()["client-9"] > 0.0  # covered before it ever replied


def test_privacy_report_shows_the_server_releases(tmp_path):
    ledger, _ = _run("rdp")
    ledger.save(tmp_path / "ledger.json")
    guarantee = {"verdict": "client-level (epsilon, delta)-DP", "scope": "test",
                 "relation": "replace-one", "sampling": "none"}
    (tmp_path / "summary.json").write_text(json.dumps(summary_of(ledger, guarantee)))
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(line) + "\n"
                                                   for line in lines_from_ledger(ledger)))
    drawn = {}

    def plot(series, path, budget, title):
        drawn.update(series=series, path=path)
        return path

    text = privacy_report(tmp_path, plot)
    # the plot gets each client's epsilon by round, the server's counts included
    assert drawn["path"] == tmp_path / "privacy-report.png"
    assert drawn["series"]["client-2"][-1][1] == pytest.approx(ledger.epsilon("client-2"),
                                                                rel=1e-12)
    assert "2 server release(s) composed into the clients' epsilon" in text
    assert "0 charge(s) not matching the plan" in text
    lines = [line for line in text.splitlines() if line.startswith("SERVER")]
    released = "adaptive-clipping count [quantile-count sigma=20 x1 (replace-one)] charged to"
    assert lines == [f"SERVER round 1: {released} client-0, client-1, client-2",
                     f"SERVER round 2: {released} client-0, client-1"]
    assert "server releases" in text
    # the ledger agrees with summary.json and rounds.jsonl: the recorded verdict stands
    assert text.startswith("verdict: client-level (epsilon, delta)-DP\nchecked: ")
    assert "DIFFERENCE" not in text


def test_the_guard_sends_each_client_the_releases_charged_to_it():
    """After a server release covering client-0, the next instruction to client-0's node
    carries it (``server-event-*``, read back with the client's parser); client-1, not
    covered, gets none."""
    from dpfl.methods import run_config
    from dpfl.privacy.accounting.ledger import server_events_from
    from dpfl.server.guard import DPGuard
    from dpfl.server.nodes import NodeRegistry

    cfg = run_config(trainer="update-dp", noise_multiplier=1.0)
    guard = DPGuard(cfg, nodes=NodeRegistry(cfg.node_partitions, {0: 100, 1: 100}),
                    ledger=Ledger(D, "rdp"))
    guard.nodes.node_partition.update({7: 0, 8: 1})
    count = PrivacyEvent.gaussian(1, 2 * SIGMA_B, relation="replace-one")
    guard.charge_server_release(1, [count], [0], "adaptive-clipping count")
    sent = guard.plan_record(7, 2)
    assert any(k.startswith("plan-") for k in sent)
    assert server_events_from(sent) == [count]
    assert server_events_from(guard.plan_record(8, 2)) == []
