"""Run configuration: Flower run-config keys parsed once into a typed, validated object.

Every key of ``[tool.flwr.app.config]`` in ``pyproject.toml`` maps to one field of
:class:`RunConfig` (dashes become underscores). A bad value raises :class:`ConfigError`
naming the key, so a run stops at start instead of failing mid-way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Mapping

DATASETS = ("mnist", "fashion-mnist", "digits", "cifar10", "cifar100", "svhn")
# AADP-FL noise: "calibrated" = Gaussian for sensitivity S and the round's (eps_i, delta);
# "paper" = the published variance S^4 l / (|w| eps^2), kept for the ablation (not DP at eps).
AADP_NOISE = ("calibrated", "paper")
PARTITIONINGS = ("iid", "dirichlet", "shards", "size", "gcfl-contiguous", "noniid-fraction")
TRAINERS = ("plain", "dpsgd", "update-dp")
# pld: dp-accounting PLD (tightest, the default); rdp: Opacus / dp-accounting RDP;
# prv: Opacus PRV (DP-SGD only)
ACCOUNTANTS = ("pld", "rdp", "prv")
OPACUS_MODES = ("ghost", "hooks", "functorch", "ew")


class ConfigError(ValueError):
    """An invalid run-config value; the message names the key."""


@dataclass(frozen=True)
class RunConfig:
    """Typed view of the run-config (see ``pyproject.toml`` for the demo defaults)."""

    strategy: str = "dpfedavg"
    trainer: str = "dpsgd"
    dataset: str = "mnist"
    data_dir: str = ""
    download: bool = False
    partitioning: str = "iid"
    dirichlet_alpha: float = 0.5
    labels_per_client: int = 2
    noniid_fraction: float = 0.5
    val_fraction: float = 0.1
    model: str = "mnist-cnn"
    num_rounds: int = 5
    local_epochs: int = 1
    batch_size: int = 256
    lr: float = 2.0
    momentum: float = 0.0
    max_grad_norm: float = 1.0
    clip_norm: float = 1.0
    noise_multiplier: float = 0.0
    target_epsilon: float = 4.0
    delta: float = 1e-5
    accountant: str = "pld"
    opacus_mode: str = "ghost"
    fraction_train: float = 1.0
    min_train_nodes: int = 2
    fraction_evaluate: float = 0.0
    server_lr: float = 1.0
    max_update_norm: float = 0.0
    round_timeout: float = 900.0
    seed: int = 42
    # true = DP noise and Poisson sampling seeded from public values (bit-identical reruns,
    # verdict none); false = secret OS entropy per client and round (dpfl.privacy.randomness)
    reproducible: bool = False
    output_dir: str = "runs"
    run_name: str = ""
    resume: bool = False
    report_train_loss: bool = False
    gcfl_references: int = 1
    prox_mu: float = 0.01
    fedexp_epsilon: float = 1e-3
    aadp_epsilon: float = 4.0
    aadp_rho: float = 0.1
    aadp_eps_max: float = 20.0
    aadp_threshold: float = 1e-3
    aadp_gamma: float = 1e-8
    aadp_noise: str = "calibrated"

    @property
    def is_private(self) -> bool:
        """True when clients apply a DP mechanism (DP-SGD or update-level DP)."""
        return self.trainer != "plain"

    def to_dict(self) -> dict[str, Any]:
        """The config as run-config keys (dashes), e.g. for ``config.json``."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}

    def replace(self, **changes: Any) -> "RunConfig":
        """A validated copy with some fields changed (underscored names)."""
        return validate(dataclasses.replace(self, **changes))


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"run-config key '{key}': expected true/false, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(f"run-config key '{key}': expected an integer, got {value!r}")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"run-config key '{key}': expected a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"run-config key '{key}': expected a string, got {value!r}")
    return value


def parse_run_config(raw: Mapping[str, Any], strict: bool = True) -> RunConfig:
    """Parse Flower's run-config mapping into a validated :class:`RunConfig`.

    With ``strict`` an unknown key is an error (a typo would otherwise be ignored).
    """
    types = {"bool": bool, "int": int, "float": float, "str": str}
    by_key = {f.name.replace("_", "-"): f for f in fields(RunConfig)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        field = by_key.get(key)
        if field is None:
            if strict:
                known = ", ".join(sorted(by_key))
                raise ConfigError(f"unknown run-config key '{key}' (known keys: {known})")
            continue
        values[field.name] = _coerce(key, value, types[str(field.type)])
    return validate(RunConfig(**values))


def _need(cond: bool, key: str, message: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"run-config key '{key}': {message}, got {value!r}")


def validate(cfg: RunConfig) -> RunConfig:
    """Check every value's range; raise :class:`ConfigError` naming the first bad key."""
    from dpfl.models import MODELS  # local import: models import torch

    _need(cfg.dataset in DATASETS, "dataset", f"must be one of {DATASETS}", cfg.dataset)
    _need(cfg.partitioning in PARTITIONINGS, "partitioning",
          f"must be one of {PARTITIONINGS}", cfg.partitioning)
    _need(cfg.trainer in TRAINERS, "trainer", f"must be one of {TRAINERS}", cfg.trainer)
    _need(cfg.accountant in ACCOUNTANTS, "accountant", f"must be one of {ACCOUNTANTS}",
          cfg.accountant)
    if cfg.accountant == "prv":
        _need(cfg.trainer == "dpsgd", "accountant",
              "'prv' is Opacus' DP-SGD accountant; use 'pld' or 'rdp' for client-level DP",
              cfg.accountant)
    _need(cfg.opacus_mode in OPACUS_MODES, "opacus-mode", f"must be one of {OPACUS_MODES}",
          cfg.opacus_mode)
    _need(cfg.model in MODELS, "model", f"must be one of {tuple(MODELS)}", cfg.model)
    _need(cfg.dirichlet_alpha > 0, "dirichlet-alpha", "must be > 0", cfg.dirichlet_alpha)
    _need(cfg.labels_per_client >= 1, "labels-per-client", "must be >= 1",
          cfg.labels_per_client)
    _need(0.0 <= cfg.noniid_fraction <= 1.0, "noniid-fraction", "must be in [0, 1]",
          cfg.noniid_fraction)
    _need(0.0 <= cfg.val_fraction < 1.0, "val-fraction", "must be in [0, 1)", cfg.val_fraction)
    _need(cfg.num_rounds >= 1, "num-rounds", "must be >= 1", cfg.num_rounds)
    _need(cfg.local_epochs >= 1, "local-epochs", "must be >= 1", cfg.local_epochs)
    _need(cfg.batch_size >= 1, "batch-size", "must be >= 1", cfg.batch_size)
    _need(cfg.lr > 0, "lr", "must be > 0", cfg.lr)
    _need(0.0 <= cfg.momentum < 1.0, "momentum", "must be in [0, 1)", cfg.momentum)
    _need(cfg.max_grad_norm > 0, "max-grad-norm", "must be > 0", cfg.max_grad_norm)
    _need(cfg.clip_norm > 0, "clip-norm", "must be > 0", cfg.clip_norm)
    _need(cfg.noise_multiplier >= 0, "noise-multiplier",
          "must be >= 0 (0 = calibrate to target-epsilon)", cfg.noise_multiplier)
    _need(cfg.target_epsilon > 0, "target-epsilon", "must be > 0", cfg.target_epsilon)
    _need(0.0 < cfg.delta < 1.0, "delta", "must be in (0, 1)", cfg.delta)
    _need(0.0 < cfg.fraction_train <= 1.0, "fraction-train", "must be in (0, 1]",
          cfg.fraction_train)
    _need(cfg.min_train_nodes >= 1, "min-train-nodes", "must be >= 1", cfg.min_train_nodes)
    _need(0.0 <= cfg.fraction_evaluate <= 1.0, "fraction-evaluate", "must be in [0, 1]",
          cfg.fraction_evaluate)
    _need(cfg.server_lr > 0, "server-lr", "must be > 0", cfg.server_lr)
    _need(cfg.max_update_norm >= 0, "max-update-norm", "must be >= 0 (0 = off)",
          cfg.max_update_norm)
    _need(cfg.round_timeout > 0, "round-timeout", "must be > 0", cfg.round_timeout)
    _need(bool(cfg.output_dir), "output-dir", "must not be empty", cfg.output_dir)
    _need(cfg.gcfl_references >= 1, "gcfl-references", "must be >= 1", cfg.gcfl_references)
    _need(cfg.prox_mu >= 0, "prox-mu", "must be >= 0", cfg.prox_mu)
    _need(cfg.fedexp_epsilon > 0, "fedexp-epsilon", "must be > 0", cfg.fedexp_epsilon)
    _need(cfg.aadp_epsilon > 0, "aadp-epsilon", "must be > 0", cfg.aadp_epsilon)
    _need(0 < cfg.aadp_rho < 1, "aadp-rho", "must be in (0, 1)", cfg.aadp_rho)
    _need(cfg.aadp_eps_max > 0, "aadp-eps-max", "must be > 0", cfg.aadp_eps_max)
    _need(cfg.aadp_threshold > 0, "aadp-threshold", "must be > 0", cfg.aadp_threshold)
    _need(cfg.aadp_gamma > 0, "aadp-gamma", "must be > 0", cfg.aadp_gamma)
    _need(cfg.aadp_noise in AADP_NOISE, "aadp-noise", f"must be one of {AADP_NOISE}",
          cfg.aadp_noise)
    if cfg.strategy == "aadp":
        _need(cfg.trainer == "update-dp", "trainer",
              "aadp is client-level DP: use trainer 'update-dp'", cfg.trainer)
    if cfg.strategy == "dpscaffold":
        _need(cfg.trainer == "dpsgd", "trainer",
              "dpscaffold needs trainer 'dpsgd' (its control variates are post-processing of "
              "DP-SGD outputs only)", cfg.trainer)
    if cfg.strategy in ("gcfl", "dpfedprox", "dpfedexp", "dpfedavg", "pegasus"):
        _need(cfg.trainer != "plain", "trainer",
              f"strategy '{cfg.strategy}' is a DP method; use trainer 'dpsgd' or 'update-dp'",
              cfg.trainer)
    if cfg.trainer == "plain":
        _need(cfg.strategy in ("fedavg",), "strategy",
              "trainer 'plain' is non-private; use strategy 'fedavg' with it", cfg.strategy)
    if cfg.strategy == "fedavg":
        _need(cfg.trainer == "plain", "trainer",
              "strategy 'fedavg' is the non-private reference; it needs trainer 'plain'",
              cfg.trainer)
    from dpfl.strategies import STRATEGIES  # local import: avoids a cycle

    _need(cfg.strategy in STRATEGIES, "strategy", f"must be one of {tuple(STRATEGIES)}",
          cfg.strategy)
    return cfg
