"""Typed privacy events (issue 50): one class per mechanism in dpfl.privacy.accounting.event_types'
registry, each with its unit, the parameters it takes, its one-step RDP curve and its
dp-accounting event.

Every registered mechanism round-trips through the record codec and refuses the parameters
its accounting would ignore; a curve equals dp-accounting's ``RdpAccountant`` on the
``DpEvent`` written out by hand here (the independent reference), or its paper's closed
form where dp-accounting has no event; and a toy mechanism registered in this file is
accounted (rdp, pld, ledger, codec, Rényi filter) without editing any other module."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant, compute_epsilon

from dpfl.privacy.accounting import events as E
from dpfl.privacy.accounting.accountants import MECHANISMS, check_event_key, dp_event_of
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.event_types import (
    BINOMIAL_ORDERS,
    RELATIONS,
    EventKey,
    EventType,
    event_type,
    mechanisms,
    register,
    register_event_type,
    unregister_event_type,
)
from dpfl.privacy.accounting.events import (
    PrivacyEvent,
    history_epsilon,
    history_epsilon_detail,
    orders_for,
    rdp_curve,
)
from dpfl.privacy.accounting.filter import RenyiFilter
from dpfl.privacy.accounting.ledger import Ledger
from dpfl.privacy.accounting.record import decode_event, decode_events, encode_event, encode_events

D = 1e-5
BUILTIN = ("dpsgd", "gaussian", "quantile-count", "laplace", "sparse-vector", "skellam",
           "ddgauss", "binomial")

# what each built-in declares: (unit, epsilon's role, takes a rate < 1, relations,
# has a dp-accounting event)
DECLARED = {
    "dpsgd": ("sample", "none", True, ("add-remove",), True),
    "gaussian": ("client", "none", True, RELATIONS, True),
    "quantile-count": ("client", "none", True, RELATIONS, True),
    "laplace": ("client", "cost", False, RELATIONS, True),
    "sparse-vector": ("client", "cost", False, RELATIONS, False),
    "skellam": ("client", "surcharge", False, RELATIONS, False),
    "ddgauss": ("client", "surcharge", False, RELATIONS, False),
    "binomial": ("client", "surcharge", False, RELATIONS, False),
}


def example(name: str, relation: str | None = None, rate: float | None = None,
            round_: int = 3, steps: int = 2) -> PrivacyEvent:
    """A valid event of a registered mechanism, from what its type declares only."""
    kind = event_type(name)
    return PrivacyEvent(round_, name, sigma=0.0 if kind.pure else 1.7,
                        rate=(0.25 if kind.sampled else 1.0) if rate is None else rate,
                        steps=steps, epsilon=0.0 if kind.epsilon_role == "none" else 0.4,
                        relation=relation or kind.relations[0])


def test_the_registry_holds_the_builtins_in_order():
    assert mechanisms()[:len(BUILTIN)] == BUILTIN == MECHANISMS
    assert E.MECHANISMS == MECHANISMS
    for name in BUILTIN:
        kind = event_type(name)
        assert kind.name == name and isinstance(kind, EventType)
        unit, role, sampled, relations, has_event = DECLARED[name]
        assert (kind.unit, kind.epsilon_role, kind.sampled, kind.relations) == (
            unit, role, sampled, relations)
        assert kind.pure == (role == "cost")
        assert (kind.dp_event(example(name).key) is not None) == has_event
        assert example(name).kind is kind and example(name).unit == unit
    with pytest.raises(ValueError, match=r"unknown mechanism 'nope'; known: \('dpsgd'"):
        event_type("nope")
    with pytest.raises(ValueError, match="unknown mechanism 'nope'"):
        PrivacyEvent(1, "nope", sigma=1.0)
    with pytest.raises(ValueError, match="already registered"):
        register_event_type(type(event_type("gaussian")))


@pytest.mark.parametrize("name", mechanisms())
def test_every_mechanism_round_trips_through_the_codec(name):
    events = [example(name, round_=r, steps=r) for r in (1, 2)]
    events += [example(name, relation=rel, rate=1.0, round_=4) for rel in event_type(
        name).relations]
    for prefix in ("", "ledger-", "server-event-"):
        assert decode_events(encode_events(events, prefix), prefix) == events
    for e in events:
        back = decode_event(encode_event(e, "plan-"), "plan-", e.round)
        assert back == e and hash(back) == hash(e) and back.key == e.key
        assert PrivacyEvent(**json.loads(json.dumps(e.to_dict()))) == e   # JSON ledgers
        assert list(e.to_dict()) == ["round", "mechanism", "sigma", "rate", "steps",
                                     "epsilon", "relation"]
    history = PrivacyHistory(events)
    assert PrivacyHistory.from_record(history.to_record()) == history


def _ignored(name: str) -> list[tuple[dict[str, object], str]]:
    """Parameters the mechanism's accounting would ignore, with the refusal's message."""
    kind = event_type(name)
    base = example(name).to_dict()
    out: list[tuple[dict[str, object], str]] = []
    if not kind.sampled:
        out.append(({"rate": 0.5}, r"rate=0\.5 < 1 on a"))
    if kind.epsilon_role == "cost":
        out.append(({"sigma": 2.0}, r"sigma=2\.0 on a pure"))
    if kind.epsilon_role == "none":
        out.append(({"epsilon": 0.3}, r"epsilon=0\.3 on a Gaussian"))
    if kind.epsilon_role == "surcharge":
        out.append(({"epsilon": -0.1}, r"epsilon=-0\.1 < 0"))
    for relation in RELATIONS:
        if relation not in kind.relations:
            out.append(({"relation": relation, "rate": base["rate"]},
                        f"relation='{relation}' on a '{name}' event"))
    if kind.sampled and "replace-one" in kind.relations:
        out.append(({"rate": 0.5, "relation": "replace-one"},
                    r"rate=0\.5 < 1 with relation='replace-one'"))
    return out


@pytest.mark.parametrize("name", mechanisms())
def test_every_mechanism_refuses_the_parameters_it_ignores(name):
    cases = _ignored(name)
    assert cases   # every built-in ignores something
    for change, message in cases:
        fields = {**example(name).to_dict(), **change}
        with pytest.raises(ValueError, match=message):
            PrivacyEvent(**fields)
        key: EventKey = (name, float(fields["sigma"]), float(fields["rate"]),
                         float(fields["epsilon"]), str(fields["relation"]))
        for refuses in (check_event_key, rdp_curve, dp_event_of):
            with pytest.raises(ValueError, match=message):
                refuses(key)
    # and the cost parameter itself is required
    kind = event_type(name)
    with pytest.raises(ValueError, match="needs epsilon > 0" if kind.pure else "needs sigma > 0"):
        PrivacyEvent(**{**example(name).to_dict(),
                        ("epsilon" if kind.pure else "sigma"): 0.0})


# dp-accounting's event for a few keys of each mechanism, written out by hand
G, P, L = dp_event.GaussianDpEvent, dp_event.PoissonSampledDpEvent, dp_event.LaplaceDpEvent
BY_HAND = {
    "dpsgd": [(("dpsgd", 1.1, 0.05, 0.0, "add-remove"), P(0.05, G(1.1))),
              (("dpsgd", 0.8, 1.0, 0.0, "add-remove"), G(0.8))],
    "gaussian": [(("gaussian", 2.0, 1.0, 0.0, "add-remove"), G(2.0)),
                 (("gaussian", 2.0, 1.0, 0.0, "replace-one"), G(1.0)),
                 (("gaussian", 3.0, 0.1, 0.0, "add-remove"), P(0.1, G(3.0)))],
    "quantile-count": [(("quantile-count", 10.0, 1.0, 0.0, "replace-one"), G(5.0)),
                       (("quantile-count", 20.0, 0.2, 0.0, "add-remove"), P(0.2, G(20.0)))],
    "laplace": [(("laplace", 0.0, 1.0, 0.5, "add-remove"), L(2.0)),
                (("laplace", 0.0, 1.0, 0.05, "replace-one"), L(20.0))],
}


def _closed_form(key: EventKey, orders: np.ndarray) -> np.ndarray:
    """The papers' curves of the mechanisms dp-accounting has no event for."""
    name, sigma, _, eps, relation = key
    s = sigma / 2 if relation == "replace-one" else sigma
    if name == "sparse-vector":   # Bun & Steinke 2016: eps-DP => (a, min(eps, a eps^2 / 2))
        return np.minimum(eps, orders * eps ** 2 / 2)
    covered = {"skellam": (orders == np.floor(orders)) & (orders > 1),
               "ddgauss": orders >= 1,
               "binomial": np.isin(orders, BINOMIAL_ORDERS)}[name]
    return np.where(covered, orders / (2 * s * s) + eps, np.inf)


NO_EVENT = [("sparse-vector", 0.0, 1.0, 0.3, "add-remove"),
            ("skellam", 4.0, 1.0, 1e-4, "replace-one"),
            ("ddgauss", 2.5, 1.0, 0.0, "add-remove"),
            ("binomial", 3.0, 1.0, 2e-3, "replace-one")]


def test_the_references_cover_every_builtin():
    assert set(BY_HAND) | {k[0] for k in NO_EVENT} == set(BUILTIN)


@pytest.mark.parametrize("name", sorted(BY_HAND))
def test_a_curve_is_rdp_accountants_on_its_dp_event(name, caplog):
    for key, by_hand in BY_HAND[name]:
        kind = event_type(name)
        assert kind.dp_event(key) == by_hand == dp_event_of(key)
        orders = orders_for(kind.unit)
        acc = RdpAccountant(orders=list(orders))
        with caplog.at_level(logging.ERROR):
            acc.compose(by_hand, 1)
        reference = np.asarray(acc.rdp)
        if name != "dpsgd":
            np.testing.assert_array_equal(rdp_curve(key), reference)
            continue
        # DP-SGD's curve is Opacus' compute_rdp (what Opacus' RDPAccountant sums). At
        # integer orders both libraries sum the same finite series; at fractional ones
        # dp-accounting adds the series' terms in absolute value (an upper bound), so
        # Opacus' signed sum is never above it
        integer = orders == np.round(orders)
        np.testing.assert_allclose(rdp_curve(key)[integer], reference[integer], rtol=1e-11)
        assert np.all(rdp_curve(key)[~integer] <= reference[~integer] * (1 + 1e-12))


@pytest.mark.parametrize("key", NO_EVENT, ids=[k[0] for k in NO_EVENT])
def test_a_mechanism_without_a_dp_event_has_its_papers_curve(key):
    kind = event_type(key[0])
    assert kind.dp_event(key) is None
    with pytest.raises(ValueError, match="no dp-accounting event"):
        dp_event_of(key)
    orders = orders_for("client")
    np.testing.assert_allclose(rdp_curve(key), _closed_form(key, orders), rtol=1e-15)
    event = PrivacyEvent(1, *key[:2], rate=key[2], epsilon=key[3], relation=key[4])
    eps, method = history_epsilon_detail([event], D, "pld")   # no pld event: falls back
    assert method.startswith(("rdp", "pld + basic")) and key[0] in method
    assert eps <= float(compute_epsilon(orders, rdp_curve(key), D)[0])


# ---------------------------------------------------------------------------------------
# a mechanism registered here, accounted without editing any other module


@pytest.fixture
def toys():
    """Two toy mechanisms: a Gaussian of sensitivity 2 (a dp-accounting event) and a
    rho-zCDP release given by its curve alone (none). Unregistered afterwards, with the
    caches keyed by mechanism name cleared."""

    @register
    class DoubleSensitivityGaussian(EventType):
        name = "toy-gaussian-x2"

        def dp_event(self, key: EventKey) -> dp_event.DpEvent:
            return dp_event.GaussianDpEvent(float(key[1]) / 2.0)

    @register
    class ZcdpRelease(EventType):
        name = "toy-zcdp"
        relations = ("add-remove",)

        def curve(self, orders: np.ndarray, key: EventKey) -> np.ndarray:
            return orders / (2.0 * key[1] ** 2)   # rho = 1 / (2 sigma^2)

    yield DoubleSensitivityGaussian, ZcdpRelease
    for name in ("toy-gaussian-x2", "toy-zcdp"):
        unregister_event_type(name)
    E.rdp_curve.cache_clear()
    E._signature_epsilon.cache_clear()


def test_a_toy_mechanism_is_accounted_without_editing_any_module(toys):
    assert mechanisms()[-2:] == ("toy-gaussian-x2", "toy-zcdp")
    toy = PrivacyEvent(1, "toy-gaussian-x2", sigma=3.0, steps=4)
    assert toy.unit == "client" and toy.to_dp_event() == dp_event.GaussianDpEvent(1.5)
    # refuses what it does not take (declared by the base class' defaults)
    for bad in ({"rate": 0.5}, {"epsilon": 0.1}):
        with pytest.raises(ValueError):
            PrivacyEvent(1, "toy-gaussian-x2", sigma=3.0, **bad)
    # rdp and pld: dp-accounting's accountants on GaussianDpEvent(1.5) x 4
    rdp = RdpAccountant()
    rdp.compose(dp_event.GaussianDpEvent(1.5), 4)
    assert history_epsilon([toy], D, "rdp") == rdp.get_epsilon(D)
    pld = PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_event.GaussianDpEvent(1.5), 4)
    assert history_epsilon([toy], D, "pld") == pytest.approx(pld.get_epsilon(D), rel=1e-12)
    # composed with a built-in (RDP curves add)
    gauss = PrivacyEvent.gaussian(2, 2.0)
    rdp.compose(dp_event.GaussianDpEvent(2.0), 1)
    assert history_epsilon([toy, gauss], D, "rdp") == pytest.approx(rdp.get_epsilon(D),
                                                                    rel=1e-12)

    # a curve only: rho-zCDP with rho = 1 / (2 sigma^2) is a Gaussian's RDP
    zcdp = PrivacyEvent(1, "toy-zcdp", sigma=2.0, steps=3)
    assert zcdp.to_dict()["mechanism"] == "toy-zcdp"
    with pytest.raises(ValueError, match="no dp-accounting event"):
        zcdp.to_dp_event()
    with pytest.raises(ValueError, match="relation='replace-one' on a 'toy-zcdp' event"):
        PrivacyEvent(1, "toy-zcdp", sigma=2.0, relation="replace-one")
    same = RdpAccountant()
    same.compose(dp_event.GaussianDpEvent(2.0), 3)
    assert history_epsilon([zcdp], D, "rdp") == pytest.approx(same.get_epsilon(D), rel=1e-12)
    eps, method = history_epsilon_detail([zcdp, gauss], D, "pld")
    assert method == "rdp (toy-zcdp events have no pld event)"
    same.compose(dp_event.GaussianDpEvent(2.0), 1)
    assert eps == pytest.approx(same.get_epsilon(D), rel=1e-12)

    # the codec, the server's ledger (JSON) and the Rényi filter take them as they are
    events = [toy, zcdp]
    assert decode_events(encode_events(events, "ledger-"), "ledger-") == events
    ledger = Ledger(D)
    ledger.record("client-0", 1, events)
    again = Ledger.from_json(json.loads(json.dumps(ledger.to_json())))
    assert again.clients["client-0"].events == events
    assert again.epsilon("client-0") == ledger.epsilon("client-0") > 0
    filt = RenyiFilter(10.0, D, "client")
    assert filt.admits(events) and 0 < filt.epsilon_of(events) <= 10.0
    assert not filt.admits(events * 400)
    assert math.isfinite(history_epsilon(events, D))
