"""A run's identity is fixed at its start: what a resume may change, and what it may not.

``config.json`` is written once, when a run starts (every run-config key, the method's
own keys and ``num-clients``). A resume continues THAT run: every key that shapes the
guarantee, the data split or the model must be what the run started with. Only the keys
of :data:`RESUME_MAY_CHANGE` — how long to go on, how long to wait, how often to evaluate,
where the folder is — may differ; any other difference is refused in one line naming the
key (:func:`resume_difference`). ``dpfl simulate resume=true`` loads the saved config
itself (:func:`resume_overrides`), so a plain resume needs no repeated overrides; a raw
``flwr run`` resume must pass the run's keys (it is refused, naming the first one, if not).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from dpfl.config import ConfigError

# Keys a resume may set to other values than the run started with (none of them changes
# the mechanism, the data split, the model or the accounting).
RESUME_MAY_CHANGE = frozenset({
    "num-rounds", "round-timeout", "node-wait", "evaluate-every", "resume", "resume-without-checkpoint",
    "output-dir", "run-name", "report-train-loss",
    # the operator may re-bind a replaced SuperNode; the ledger is keyed by partition
    "node-partitions",
    # how a simulation hosts its clients (node state does not outlive a simulation anyway)
    "cohort-nodes", "cohort-clients", "cohort-batch", "simulation-backend",
})
NUM_CLIENTS = "num-clients"
# correlated noise (central-noise=tree|banded-mf) is built for the run's num-rounds: the
# factorization C, the schema's sensitivity and sigma all depend on it, and the rounds
# already released used that C; a resume continues the same stream, so it keeps them
FIXED_BY_CORRELATED_NOISE = frozenset({"num-rounds"})


def may_change(saved: Mapping[str, Any]) -> frozenset[str]:
    """The keys a resume of the run whose config is ``saved`` may change."""
    if saved.get("central-noise", "gaussian") not in (None, "gaussian"):
        return RESUME_MAY_CHANGE - FIXED_BY_CORRELATED_NOISE
    return RESUME_MAY_CHANGE


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (isinstance(a, float) and isinstance(b, float)
                          and math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0))
    return a == b


def resume_difference(saved: Mapping[str, Any], current: Mapping[str, Any]
                      ) -> tuple[str, Any, Any] | None:
    """The first key whose ``current`` value differs from the run's ``saved`` one and may
    not change on resume: ``(key, saved value, current value)``; None when there is none.
    A key absent from ``saved`` (a key newer than the run) is compared with ``None``."""
    changeable = may_change(saved)
    for key in sorted(set(saved) | set(current)):
        if key in changeable or key not in current:
            continue
        if not _same(saved.get(key), current[key]):
            return key, saved.get(key), current[key]
    return None


def check_resume(saved: Mapping[str, Any], current: Mapping[str, Any], where: str) -> None:
    """:class:`ConfigError` naming the first key a resume may not change (see module)."""
    diff = resume_difference(saved, current)
    if diff is None:
        return
    key, was, now = diff
    if key in FIXED_BY_CORRELATED_NOISE:   # returned only when this run may not change it
        raise ConfigError(f"run-config key '{key}': {now!r} differs from {was!r} of the run in "
                          f"{where}: its central-noise={saved['central-noise']} was built for "
                          f"{was} rounds (C, the schema's sensitivity and sigma depend on "
                          "them) and a resume continues that noise stream")
    if key == NUM_CLIENTS:
        raise ConfigError(f"resume of {where}: the run has {was} clients, this federation "
                          f"{now}: a resume keeps the run's clients and data split")
    raise ConfigError(f"run-config key '{key}': {now!r} differs from {was!r} of the run in "
                      f"{where}: a resume keeps the run's settings (it may change only "
                      f"{', '.join(sorted(may_change(saved) - {'resume', 'run-name'}))})")


def resume_overrides(saved: Mapping[str, Any], explicit: Mapping[str, Any], where: str
                     ) -> dict[str, Any]:
    """The run-config of a resume launched with ``explicit`` overrides: the run's saved
    config, with the explicit values of keys a resume may change; an explicit value of any
    other key must equal the saved one (:class:`ConfigError` naming it)."""
    check_resume(saved, explicit, where)
    out = {**saved, **explicit}
    out.pop(NUM_CLIENTS, None)   # the federation's size, not a run-config key
    return out
