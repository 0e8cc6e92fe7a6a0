"""What a run, as configured, guarantees: unit, neighbouring relation, sampling, delta, and
the verdict ``formal`` or ``none: <reason>``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

from dpfl.config import RunConfig
from dpfl.privacy.mechanisms.randomness import REPRODUCIBLE_VERDICT
from dpfl.privacy.mechanisms.randomness import scope as randomness_scope
from dpfl.privacy.plan import UPDATE_DP_RELATION
from dpfl.privacy.trust import (
    CENTRAL_RELATION,
    DISTRIBUTED_RELATION,
    FLOWER_RELATION,
    trust_scope,
)


@dataclass(frozen=True)
class MethodPrivacy:
    """What a method adds to the guarantee: ``scope`` text, values it releases in the
    clear (each one makes the verdict ``none``), whether its per-round parameters are
    chosen adaptively (then a Rényi filter bounds the run), and its client's release when
    it replaces the shared Gaussian one (``release``)."""

    scope: str = ""
    clear: tuple[str, ...] = ()
    adaptive: bool = False
    # what a client-level (update-dp) client releases when it is not the shared "update
    # clipped to C plus Gaussian noise" (e.g. a sparse vector with Laplace noise)
    release: str = ""


@dataclass(frozen=True)
class Guarantee:
    """The privacy claim of a configured method."""

    verdict: str       # "formal" or "none: <reason>"
    unit: str          # "sample" | "client" | "-"
    relation: str      # "add-remove" | "replace-one" | "-"
    sampling: str      # "poisson" | "none" | ...
    delta: float
    accountant: str
    scope: str         # what the guarantee covers and what it assumes

    @property
    def formal(self) -> bool:
        return self.verdict == "formal"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def guarantee_for(cfg: RunConfig, method: MethodPrivacy = MethodPrivacy()) -> Guarantee:
    """The guarantee of ``cfg``'s trainer and reporting settings with the method's notes
    (``dpfl.methods.guarantee`` passes the configured method's)."""
    if cfg.trainer == "plain":
        return Guarantee("none: no DP mechanism (trainer=plain)", "-", "-", "-", cfg.delta,
                         "-", "nothing is protected")
    clear = []
    if cfg.reproducible:
        clear.append(REPRODUCIBLE_VERDICT)
    if cfg.report_train_loss:
        clear.append("train-loss is released in the clear (set report-train-loss=false)")
    if cfg.fraction_evaluate > 0:
        clear.append("client evaluation releases validation metrics in the clear "
                     "(set fraction-evaluate=0)")
    if cfg.trust == "central" and cfg.central_impl == "flower":
        # Flower's fixed-size sample is accounted without amplification, under replace-one
        unit, relation, sampling = "client", FLOWER_RELATION, "none"
        scope = trust_scope(cfg)
    elif cfg.trust == "central" and cfg.central_noise != "gaussian":
        # correlated noise: a participation schema, no sampling claimed (trust_scope)
        unit, relation, sampling = "client", CENTRAL_RELATION, "none"
        scope = trust_scope(cfg)
    elif cfg.trust == "central":
        unit, relation, sampling = "client", CENTRAL_RELATION, "poisson"
        scope = trust_scope(cfg)
    elif cfg.trust == "distributed":
        unit, relation, sampling = "client", DISTRIBUTED_RELATION, "none"
        scope = trust_scope(cfg)
    elif cfg.trainer == "dpsgd":
        unit, relation, sampling = "sample", "add-remove", "poisson"
        scope = ("every model update a client sends (Opacus DP-SGD: per-sample clipping to "
                 f"{cfg.max_grad_norm}, Poisson sampling, accountant {cfg.accountant}); each "
                 "client's dataset size is treated as public, as in Opacus")
    else:
        unit, relation, sampling = "client", UPDATE_DP_RELATION, "none"
        release = method.release or (f"whole update clipped to {cfg.clip_norm} plus "
                                     "client-side Gaussian noise")
        scope = (f"every model update a client sends ({release}; no amplification by client "
                 "sampling is claimed); replace-one = any local dataset of the client vs any "
                 "other (the server sees who sends what, so presence is not hidden: "
                 "sensitivity 2C)")
    if method.scope:
        scope += "; " + method.scope
    clear.extend(method.clear)
    correlated = cfg.trust == "central" and cfg.central_noise != "gaussian"
    charging = ("each client is charged each round it takes part in, and only then"
                if correlated else
                "every client is charged every round's release, sampled or not"
                if cfg.trust == "central" else
                "the server charges every update it receives (accepted, rejected or late) "
                "at no less than the planned cost")
    # what the mechanism draws: update-level DP samples nothing (every client's whole
    # update, every round), so its guarantee must not speak of Poisson sampling
    draws = {"central": "the server's noise and cohort draws come" if correlated else
             "the server's noise and Poisson client sampling come",
             "distributed": "the clients' noise shares come"}.get(
                 cfg.trust, "noise and Poisson sampling come" if cfg.trainer == "dpsgd"
                 else "noise comes")
    scope += ("; " + charging + "; randomness: "
              + ("seeded from public values (run-config seed, partition, round)"
                 if cfg.reproducible else randomness_scope(draws)))
    verdict = "formal" if not clear else "none: " + "; ".join(clear)
    return Guarantee(verdict, unit, relation, sampling, cfg.delta, cfg.accountant, scope)


UNKNOWN_PART = ("a part of this run whose settings were not recorded (a damaged resume record, "
                "or one written by an older dpfl) may have released values in the clear")


def reasons_of(verdict: str) -> list[str]:
    """The reasons of a ``none: r1; r2`` verdict (empty for ``formal``)."""
    if verdict == "formal":
        return []
    body = verdict[len("none: "):] if verdict.startswith("none: ") else verdict
    return [r.strip() for r in body.split("; ") if r.strip()]


def over_history(current: Guarantee, earlier: Sequence[str | None]) -> Guarantee:
    """The guarantee of a run whose earlier launches (its start, then each resume) had the
    verdicts ``earlier`` (None: not recorded): a verdict never improves over a run's
    history. A value released in the clear in one part of the run stays released, so every
    earlier reason is kept (marked as an earlier part's) beside the current ones; an
    unrecorded part counts as :data:`UNKNOWN_PART`."""
    reasons = reasons_of(current.verdict)
    for verdict in earlier:
        found = [UNKNOWN_PART] if verdict is None else [
            f"{r} (in an earlier part of this run)" for r in reasons_of(verdict)]
        for r in found:
            if r not in reasons and r.removesuffix(" (in an earlier part of this run)") \
                    not in reasons:
                reasons.append(r)
    if not reasons:
        return current
    return replace(current, verdict="none: " + "; ".join(reasons))

