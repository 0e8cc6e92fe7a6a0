"""Typed privacy events: one class per mechanism, in a registry (name -> class).

Built like Opacus' ``opacus.accountants`` registry (``register_accountant`` /
``create_accountant``: a name maps to a class) and dp-accounting's ``DpEvent`` classes (each
documents the mechanism it stands for): every mechanism dpfl charges has ONE subclass of
:class:`EventType` here, registered under the name a
:class:`~dpfl.privacy.accounting.events.PrivacyEvent` carries in its ``mechanism`` field. The class
says everything the accounting needs to know about its events:

- ``unit``: ``"sample"`` (DP-SGD steps, Opacus' accountants and orders) or ``"client"``
  (dp-accounting's);
- the parameters it takes, and refuses the others (:meth:`EventType.check`): ``sampled``
  (a Poisson ``rate`` below 1), ``relations`` (the neighbouring relations it is analysed
  under), ``epsilon_role``: what the event's ``epsilon`` field means, ``"none"`` (must be
  0: the cost follows from ``sigma``), ``"cost"`` (a pure epsilon-DP release: ``epsilon`` is
  its whole cost, ``sigma`` must be 0) or ``"surcharge"`` (integer noise under secure
  aggregation: ``sigma`` is the Gaussian-equivalent multiplier and ``epsilon`` the additive
  slack of its RDP curve);
- :meth:`EventType.dp_event`: ONE step as a dp-accounting ``DpEvent``, or None where
  dp-accounting has none (the PLD accountant then falls back, see
  :func:`dpfl.privacy.accounting.events.history_epsilon_detail`);
- :meth:`EventType.curve`: the RDP of one step at given orders (by default dp-accounting's
  ``RdpAccountant`` on :meth:`EventType.dp_event`).

Design: :class:`~dpfl.privacy.accounting.events.PrivacyEvent` stays ONE frozen value type with its
seven fields (the wire format of :mod:`dpfl.privacy.accounting.record` and the JSON ledgers, its
equality, hashing, ``key`` and ``to_dict`` unchanged); it delegates to the registered type
through ``event.kind`` (``event_type(event.mechanism)``). The types are stateless: they work
on an event's key ``(mechanism, sigma, rate, epsilon, relation)``, the hashable value the
RDP-curve and signature caches of :mod:`dpfl.privacy.accounting.events` are keyed by. Typed
subclasses of the value would need a dispatching constructor for the codec and pickling;
a registry of types keeps the value plain.

Adding a mechanism: one subclass of :class:`EventType` decorated with :func:`register`
(here for a built-in, or anywhere before its events are built) and its tests; the
constructor's validation, the codec, every accountant (``rdp``, ``pld`` with its fallbacks)
and the reports find it through the registry. The caches of :mod:`dpfl.privacy.accounting.events` are
keyed by mechanism name: a name is registered once (:func:`unregister_event_type` is for
tests, which then clear those caches).
"""

from __future__ import annotations

from typing import ClassVar, Literal, TypeAlias, TypeVar

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

__all__ = ["BINOMIAL_ORDERS", "RELATIONS", "Binomial", "DDGauss", "Dpsgd", "EpsilonRole",
           "EventKey", "EventType", "Gaussian", "Laplace", "QuantileCount", "Skellam",
           "SparseVector", "Unit", "event_type", "mechanisms", "register",
           "register_event_type", "unregister_event_type"]

RELATIONS = ("add-remove", "replace-one")
# A dpfl event's key, PrivacyEvent.key: (mechanism, sigma, rate, epsilon, relation)
EventKey: TypeAlias = tuple[str, float, float, float, str]
Unit: TypeAlias = Literal["sample", "client"]
EpsilonRole: TypeAlias = Literal["none", "cost", "surcharge"]
# the orders at which the binomial mechanism's curve is computed (dpfl.privacy.mechanisms.binomial);
# its curve is infinite at the others
BINOMIAL_ORDERS = (2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 63)


class EventType:
    """The type of a privacy event: one subclass per mechanism (see the module docstring).
    Subclasses set the class attributes and override :meth:`dp_event` and/or
    :meth:`curve`; :meth:`check` follows from the attributes."""

    name: ClassVar[str]
    unit: ClassVar[Unit] = "client"
    epsilon_role: ClassVar[EpsilonRole] = "none"
    sampled: ClassVar[bool] = False   # may carry a Poisson rate < 1 (add-remove only)
    relations: ClassVar[tuple[str, ...]] = RELATIONS

    @property
    def pure(self) -> bool:
        """A pure epsilon-DP release: its ``epsilon`` field is its whole cost (basic
        composition applies to it)."""
        return self.epsilon_role == "cost"

    def check(self, key: EventKey) -> None:
        """ValueError when ``key`` carries a parameter this mechanism's accounting would
        ignore: a ``rate`` below 1 on an unsampled mechanism, a ``sigma`` on a pure one, an
        ``epsilon`` where it has no role (or a negative surcharge), a relation the
        mechanism is not analysed under, and a Poisson rate below 1 under ``replace-one``
        (Poisson subsampling is analysed under add-remove)."""
        _, sigma, rate, epsilon, relation = key
        name = self.name
        if float(rate) < 1.0 and not self.sampled:
            if self.pure:
                raise ValueError(f"rate={rate} < 1 on a pure {name!r} event: the sampling "
                                 "would be ignored (no subsampled analysis of pure events); "
                                 "pass rate=1.0")
            raise ValueError(f"rate={rate} < 1 on a {name!r} event: no subsampled analysis "
                             "of this mechanism here; pass rate=1.0")
        if self.epsilon_role == "cost" and float(sigma) != 0.0:
            raise ValueError(f"sigma={sigma} on a pure {name!r} event would be ignored "
                             "(its cost is epsilon); pass sigma=0.0")
        if self.epsilon_role == "surcharge" and float(epsilon) < 0.0:
            raise ValueError(f"epsilon={epsilon} < 0 on a {name!r} event (its "
                             "discreteness surcharge)")
        if self.epsilon_role == "none" and float(epsilon) != 0.0:
            raise ValueError(f"epsilon={epsilon} on a Gaussian {name!r} event would be "
                             "ignored (its cost follows from sigma); pass epsilon=0.0")
        if relation not in self.relations:
            raise ValueError(f"relation={relation!r} on a {name!r} event would be ignored "
                             f"({name} is accounted under {' or '.join(self.relations)}); "
                             f"pass relation={self.relations[0]!r}")
        if float(rate) < 1.0 and relation != "add-remove":
            raise ValueError(f"rate={rate} < 1 with relation={relation!r}: Poisson-sampled "
                             "Gaussian events are accounted under add-remove")

    def dp_event(self, key: EventKey) -> dp_event.DpEvent | None:
        """ONE step as a dp-accounting ``DpEvent``; None when dp-accounting has no event
        for this mechanism (the default). ``key`` is assumed checked."""
        return None

    def curve(self, orders: np.ndarray, key: EventKey) -> np.ndarray:
        """RDP of ONE step at ``orders`` (``key`` assumed checked): by default
        dp-accounting's ``RdpAccountant`` on :meth:`dp_event`."""
        event = self.dp_event(key)
        if event is None:
            raise NotImplementedError(f"{type(self).__name__} has no dp-accounting event: "
                                      "it must define its curve")
        acc = rdp_privacy_accountant.RdpAccountant(orders=list(orders))
        acc.compose(event, 1)
        return np.asarray(acc.rdp, dtype=float)


# ---------------------------------------------------------------------------------------
# the registry

_REGISTRY: dict[str, EventType] = {}
T = TypeVar("T", bound=type[EventType])


def register_event_type(cls: type[EventType]) -> None:
    """Register ``cls`` under ``cls.name`` (ValueError when the name is taken: the
    accounting caches are keyed by name)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a class attribute 'name'")
    if name in _REGISTRY:
        raise ValueError(f"mechanism {name!r} is already registered "
                         f"({type(_REGISTRY[name]).__name__})")
    _REGISTRY[name] = cls()


def register(cls: T) -> T:
    """Class decorator: :func:`register_event_type`."""
    register_event_type(cls)
    return cls


def unregister_event_type(name: str) -> None:
    """Remove a registered type (for tests; clear :mod:`dpfl.privacy.accounting.events`' caches too)."""
    _REGISTRY.pop(name, None)


def mechanisms() -> tuple[str, ...]:
    """The registered mechanism names, in registration order."""
    return tuple(_REGISTRY)


def event_type(name: str) -> EventType:
    """The registered type of mechanism ``name`` (ValueError naming the known ones)."""
    kind = _REGISTRY.get(name)
    if kind is None:
        raise ValueError(f"unknown mechanism {name!r}; known: {mechanisms()}")
    return kind


# ---------------------------------------------------------------------------------------
# the Gaussian family: sigma is the noise multiplier


def _effective_sigma(sigma: float, relation: str) -> float:
    """replace-one doubles the sensitivity of the released sum: sigma_eff = sigma / 2."""
    return sigma / 2.0 if relation == "replace-one" else sigma


class _SampledGaussian(EventType):
    """``GaussianDpEvent(sigma)`` under add-remove, ``sigma / 2`` under replace-one, in
    ``PoissonSampledDpEvent(rate, .)`` when the rate is below 1 (add-remove only)."""

    sampled = True

    def dp_event(self, key: EventKey) -> dp_event.DpEvent:
        _, sigma, rate, _, relation = key
        sigma, rate = float(sigma), float(rate)
        base = dp_event.GaussianDpEvent(_effective_sigma(sigma, relation))
        if rate >= 1.0:
            return base
        return dp_event.PoissonSampledDpEvent(rate, base)


@register
class Dpsgd(_SampledGaussian):
    """DP-SGD steps (sample level): a Gaussian of multiplier sigma on a Poisson(rate)
    sample, add-remove (the Opacus model). Its curve is Opacus' ``compute_rdp`` (what
    ``opacus.accountants.RDPAccountant`` sums), at Opacus' orders."""

    name = "dpsgd"
    unit = "sample"
    relations = ("add-remove",)

    def curve(self, orders: np.ndarray, key: EventKey) -> np.ndarray:
        from opacus.accountants.analysis.rdp import compute_rdp

        _, sigma, rate, _, _ = key
        return np.asarray(compute_rdp(q=rate, noise_multiplier=sigma, steps=1,
                                      orders=list(orders)), dtype=float)


@register
class Gaussian(_SampledGaussian):
    """A client-level Gaussian release (update DP, the central noisy sum)."""

    name = "gaussian"


@register
class QuantileCount(_SampledGaussian):
    """The noisy clipped count of adaptive clipping (a Gaussian release of a count)."""

    name = "quantile-count"


# ---------------------------------------------------------------------------------------
# pure epsilon-DP releases: epsilon is the cost


@register
class Laplace(EventType):
    """A Laplace release of sensitivity 1 and scale 1 / epsilon: dp-accounting's
    ``LaplaceDpEvent`` (exact RDP and PLD)."""

    name = "laplace"
    epsilon_role = "cost"

    def dp_event(self, key: EventKey) -> dp_event.DpEvent:
        return dp_event.LaplaceDpEvent(1.0 / float(key[3]))


@register
class SparseVector(EventType):
    """A generic pure epsilon-DP release (the sparse-vector technique): no dp-accounting
    event; its RDP is eps-DP => (alpha, min(eps, alpha eps^2 / 2))-RDP (Bun & Steinke
    2016); under ``pld`` a history holding it also tries basic composition."""

    name = "sparse-vector"
    epsilon_role = "cost"

    def curve(self, orders: np.ndarray, key: EventKey) -> np.ndarray:
        epsilon = key[3]
        return np.minimum(epsilon, orders * epsilon ** 2 / 2.0)


# ---------------------------------------------------------------------------------------
# integer noise under secure aggregation: a Gaussian-equivalent sigma plus a surcharge


class _GaussianPlusSurcharge(EventType):
    """alpha / (2 sigma_eff^2) + epsilon at the orders the mechanism's theorem covers
    (:meth:`covered`), inf at the others (sigma_eff = sigma / 2 under replace-one, as for
    Gaussian events); no dp-accounting event (under ``pld`` the history takes the RDP
    bound)."""

    epsilon_role = "surcharge"

    def covered(self, orders: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def curve(self, orders: np.ndarray, key: EventKey) -> np.ndarray:
        _, sigma, _, surcharge, relation = key
        sigma_eff = _effective_sigma(sigma, relation)
        return np.where(self.covered(orders), orders / (2.0 * sigma_eff ** 2) + surcharge,
                        np.inf)


@register
class Skellam(_GaussianPlusSurcharge):
    """The distributed Skellam mechanism (:mod:`dpfl.privacy.mechanisms.skellam`; Agarwal, Kairouz &
    Liu 2021, Thm 3.5): integer orders > 1, epsilon the discreteness surcharge."""

    name = "skellam"

    def covered(self, orders: np.ndarray) -> np.ndarray:
        covered: np.ndarray = (orders == np.round(orders)) & (orders > 1)
        return covered


@register
class DDGauss(_GaussianPlusSurcharge):
    """The distributed discrete Gaussian (:mod:`dpfl.privacy.mechanisms.ddgauss`; Kairouz, Liu &
    Steinke 2021, Proposition 14): every order alpha >= 1, epsilon the slack tau d."""

    name = "ddgauss"

    def covered(self, orders: np.ndarray) -> np.ndarray:
        covered: np.ndarray = orders >= 1
        return covered


@register
class Binomial(_GaussianPlusSurcharge):
    """The binomial mechanism of cpSGD (:mod:`dpfl.privacy.mechanisms.binomial`): the orders of
    :data:`BINOMIAL_ORDERS`, epsilon the slack over the Gaussian-equivalent curve."""

    name = "binomial"

    def covered(self, orders: np.ndarray) -> np.ndarray:
        return np.isin(orders, np.asarray(BINOMIAL_ORDERS, dtype=float))
