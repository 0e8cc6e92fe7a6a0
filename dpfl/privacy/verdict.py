"""What a run, as configured, guarantees: unit, neighbouring relation, sampling, delta, and
the verdict ``formal`` or ``none: <reason>``."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dpfl.config import RunConfig
from dpfl.privacy.plan import UPDATE_DP_RELATION
from dpfl.privacy.randomness import REPRODUCIBLE_VERDICT
from dpfl.privacy.randomness import SCOPE as RANDOMNESS_SCOPE


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

    def to_dict(self) -> dict:
        return asdict(self)


def guarantee_for(cfg: RunConfig) -> Guarantee:
    """The guarantee of ``cfg``'s trainer and reporting settings."""
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
    if cfg.trainer == "dpsgd":
        unit, relation, sampling = "sample", "add-remove", "poisson"
        scope = ("every model update a client sends (Opacus DP-SGD: per-sample clipping to "
                 f"{cfg.max_grad_norm}, Poisson sampling, accountant {cfg.accountant}); each "
                 "client's dataset size is treated as public, as in Opacus")
    else:
        unit, relation, sampling = "client", UPDATE_DP_RELATION, "none"
        scope = (f"every model update a client sends (whole update clipped to {cfg.clip_norm} "
                 "plus client-side Gaussian noise; no amplification by client sampling is "
                 "claimed); replace-one = any local dataset of the client vs any other (the "
                 "server sees who sends what, so presence is not hidden: sensitivity 2C)")
    if cfg.strategy == "aadp":
        scope += ("; per-round budgets are chosen adaptively (AADP-FL), so the bound is a "
                  f"Rényi filter at epsilon {cfg.target_epsilon} over all rounds (Lécuyer "
                  "2021); longitudinal clipping keeps the update norm <= clip-norm; training-"
                  "set sizes are treated as public (the allocation uses them)")
        if cfg.aadp_noise == "paper":
            clear.append("aadp-noise=paper: AADP-FL's published noise variance "
                         "S^4 l/(|w| eps^2) is not calibrated to the per-round (eps, delta); "
                         "the ledger charges the noise actually added, whose epsilon is "
                         "orders of magnitude above the nominal one")
    scope += ("; the server charges every update it receives (accepted, rejected or late) "
              "at no less than the planned cost; randomness: "
              + ("seeded from public values (run-config seed, partition, round)"
                 if cfg.reproducible else RANDOMNESS_SCOPE))
    verdict = "formal" if not clear else "none: " + "; ".join(clear)
    return Guarantee(verdict, unit, relation, sampling, cfg.delta, cfg.accountant, scope)
