"""The method registry: the only list of dpfl's methods.

Each entry is the :class:`~dpfl.method.Method` exported by ``dpfl/methods/<name>.py``. The
registry parses the run-config (global keys plus every method's own keys), checks the
method's rules, builds its strategy and states its guarantee.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from dpfl.config import (
    KEY_CHOICES,
    KEY_HELP,
    MAX_SECAGG_UNITS,
    ConfigError,
    RunConfig,
    need,
    parse_global,
)
from dpfl.method import Method
from dpfl.methods import (
    aadp,
    cpsgd,
    dpfedavg,
    dpfedavgm,
    dpfedexp,
    dpfedprox,
    dpfedsam,
    dpscaffold,
    fedacg,
    fedasgp,
    fedavg,
    fedcompdp,
    fedsmp,
    gcfl,
    pegasus,
)
from dpfl.models import MODELS
from dpfl.privacy.accounting.filter import holds_anything
from dpfl.privacy.accounting.ledger import Ledger
from dpfl.privacy.trust import OwnSecureNoise, own_noise
from dpfl.privacy.verdict import Guarantee, guarantee_for
from dpfl.server.strategy import DPFLStrategy, StrategyInputs
from dpfl.server.trust import server_trust

METHODS: dict[str, Method] = {m.name: m for m in (
    fedavg.METHOD, dpfedavg.METHOD, gcfl.METHOD, dpfedprox.METHOD, dpscaffold.METHOD,
    dpfedexp.METHOD, pegasus.METHOD, aadp.METHOD, dpfedavgm.METHOD, fedcompdp.METHOD,
    dpfedsam.METHOD, fedasgp.METHOD, fedsmp.METHOD, cpsgd.METHOD, fedacg.METHOD,
)}



def _declared_secure_noise(method: Method) -> None:
    """A method declares its own SecAgg+ noise (``own_secure_noise``) exactly when its
    parameters implement :class:`OwnSecureNoise` (the trust layer finds it there)."""
    implements = method.params is not None and issubclass(method.params, OwnSecureNoise)
    if implements != method.own_secure_noise:
        raise TypeError(f"method {method.name!r}: own_secure_noise={method.own_secure_noise} "
                        f"but its params {'do' if implements else 'do not'} implement "
                        "OwnSecureNoise")


for _method in METHODS.values():
    _declared_secure_noise(_method)


# The method of a RunConfig whose ``strategy`` is "" (the pyproject demo names it too).
DEFAULT_METHOD = "dpfedavg"


def method_keys() -> frozenset[str]:
    """Every registered method's own run-config keys."""
    return frozenset(k for m in METHODS.values() if m.params is not None for k in m.params.keys())


def method_for(cfg: RunConfig) -> Method:
    return METHODS[configured(cfg).strategy]


def parse_run_config(raw: Mapping[str, Any]) -> RunConfig:
    """Flower's run-config mapping as a validated :class:`RunConfig` carrying the
    configured method's parameters. Every method's keys are type- and range-checked (the
    pyproject lists them all), so a bad value stops the run whichever method it belongs to."""
    cfg = _with_default_method(parse_global(raw, method_keys()))
    for method in METHODS.values():
        if method.params is not None and method.name != cfg.strategy:
            method.params.parse(raw)
    method = METHODS[cfg.strategy]
    cfg = method.with_params(cfg, raw)
    method.check(cfg)   # its rules may read its own parameters too
    if method.adaptive and cfg.is_private:
        _check_filter_budget(cfg)
    if server_trust(cfg).secure_sum and own_noise(cfg) is None:
        # the shared secure-noise path quantises C-clipped updates at scale s (a method
        # with its own secure noise, cpSGD, quantises by its own rule)
        need(cfg.clip_norm * cfg.secagg_scale <= MAX_SECAGG_UNITS, "secagg-scale",
             f"a clipped update's coordinate, up to clip-norm x secagg-scale = "
             f"{cfg.clip_norm * cfg.secagg_scale:g} integer units, must fit SecAgg+'s share "
             f"range (at most {MAX_SECAGG_UNITS}, with a single client): lower secagg-scale "
             "or clip-norm", cfg.secagg_scale)
    return cfg


def _check_filter_budget(cfg: RunConfig) -> None:
    """An adaptive method's budgets are a Rényi filter at (target-epsilon, delta): a target
    so small that the filter's budget curve is <= 0 at every RDP order of the accountant
    would refuse every round; stop the run at start instead of training nothing."""
    unit = "sample" if cfg.trainer == "dpsgd" else "client"
    need(holds_anything(cfg.target_epsilon, cfg.delta, unit), "target-epsilon",
         f"a Rényi filter at delta {cfg.delta:g} holds no {unit}-level event at this "
         f"target (its budget is <= 0 at every RDP order): raise it", cfg.target_epsilon)


def _with_default_method(cfg: RunConfig) -> RunConfig:
    return cfg if cfg.strategy else dataclasses.replace(cfg, strategy=DEFAULT_METHOD)


def configured(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the default method when it names none, and its method's default
    parameters when it carries none (e.g. a RunConfig built directly in code)."""
    cfg = _with_default_method(cfg)
    if cfg.params is None and METHODS[cfg.strategy].params is not None:
        return METHODS[cfg.strategy].with_params(cfg, {})
    return cfg


def build_strategy(cfg: RunConfig, partition_sizes: Mapping[int, int] | None = None,
                   model: torch.nn.Module | None = None,
                   ledger: Ledger | None = None) -> DPFLStrategy:
    """Instantiate the strategy of ``cfg``'s method with what it is built from
    (:class:`~dpfl.server.strategy.StrategyInputs`)."""
    cfg = configured(cfg)
    method = METHODS[cfg.strategy]
    inputs = StrategyInputs(dict(partition_sizes or {}), model, ledger)
    return method.strategy(cfg, adaptive=method.adaptive, plan=method.plan, inputs=inputs)


def guarantee(cfg: RunConfig) -> Guarantee:
    """What ``cfg``'s method, as configured, guarantees."""
    cfg = configured(cfg)
    return guarantee_for(cfg, METHODS[cfg.strategy].privacy(cfg))


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One run-config key as the reference documents it."""

    key: str
    default: Any
    type: str                       # bool | int | float | str
    choices: tuple[str, ...]        # allowed values of a string key (empty: free text)
    methods: tuple[str, ...]        # the methods that read it (empty: global, every method)
    help: str


def key_reference() -> list[KeyDoc]:
    """Every run-config key: the global ones (``RunConfig``, described by
    ``dpfl.config.KEY_HELP``), then each method's own (its ``MethodParams``, described by its
    ``HELP``), with default, type and allowed values. Raises ValueError when a key has no
    description or a description names no key, so the generated reference cannot drift."""
    out: list[KeyDoc] = []
    problems: list[str] = []
    registries = {"strategy": tuple(METHODS), "model": tuple(MODELS)}
    globals_ = [f for f in dataclasses.fields(RunConfig) if f.name != "params"]
    problems += [f"'{k}' is described but is no global key" for k in
                 set(KEY_HELP) - {f.name.replace("_", "-") for f in globals_}]
    for f in globals_:
        key = f.name.replace("_", "-")
        default = DEFAULT_METHOD if key == "strategy" and not f.default else f.default
        if key not in KEY_HELP:
            problems.append(f"global key '{key}' has no description in dpfl.config.KEY_HELP")
        choices = KEY_CHOICES.get(key, registries.get(key, ()))
        out.append(KeyDoc(key, default, str(f.type), choices, (), KEY_HELP.get(key, "")))
    for method in METHODS.values():
        if method.params is None:
            continue
        params = method.params
        problems += [f"{params.__name__}.HELP describes '{k}', which is not its key"
                     for k in set(params.HELP) - set(params.keys())]
        for f in dataclasses.fields(params):
            key = f.name.replace("_", "-")
            if key not in params.HELP:
                problems.append(f"method key '{key}' has no description in "
                                f"{params.__name__}.HELP")
            out.append(KeyDoc(key, f.default, str(f.type), tuple(params.CHOICES.get(key, ())),
                              (method.name,), params.HELP.get(key, "")))
    if problems:
        raise ValueError("run-config reference: " + "; ".join(sorted(problems)))
    return out


__all__ = ["METHODS", "ConfigError", "KeyDoc", "build_strategy", "configured", "guarantee",
           "key_reference", "method_for", "parse_run_config", "run_config"]


def run_config(**fields: Any) -> RunConfig:
    """A validated RunConfig from underscored field names, method keys included (for code
    and tests: ``run_config(strategy="gcfl", gcfl_references=2)``)."""
    return parse_run_config({k.replace("_", "-"): v for k, v in fields.items()})
