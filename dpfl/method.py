"""The method API: what one DP-FL method is, in one object.

A method module (``dpfl/methods/<name>.py``) exports one :class:`Method`: its server
strategy, its client half (:class:`ClientHalf`: the round's privacy plan, local-training
hooks, the update transform), its own typed run-config parameters (:class:`MethodParams`),
the trainers it supports, its guarantee notes and its reproduction presets. The registry
(``dpfl.methods``) is the only list of methods; nothing below it names one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping

import torch
from flwr.app import Context, Message

from dpfl.client.hooks import MethodHooks
from dpfl.client.job import TRAIN_LOSS as TRAIN_LOSS  # re-exported for the methods
from dpfl.config import RunConfig, coerce_field, need
from dpfl.models import build_model
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.mechanisms.release import GaussianMechanism
from dpfl.privacy.plan import UPDATE_DP_RELATION, PlanFn, UpdateClip, shared_plan
from dpfl.privacy.verdict import MethodPrivacy
from dpfl.server.strategy import DPFLStrategy

# (cfg, input shape, number of classes) -> the model a method trains (both apps build it)
ModelFor = Callable[[RunConfig, tuple[int, int, int], int], torch.nn.Module]


@dataclass(frozen=True)
class MethodParams:
    """Base of a method's own run-config keys: a frozen dataclass whose field names are the
    keys with dashes as underscores (e.g. ``gcfl_references`` <-> ``gcfl-references``).
    ``HELP`` describes every key in one line and ``CHOICES`` lists the allowed values of its
    string keys (both keyed by run-config name): the generated run-config reference
    (``docs/run-config.md``) reads them."""

    HELP: ClassVar[Mapping[str, str]] = {}
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name.replace("_", "-") for f in fields(cls))

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> "MethodParams":
        """The parameters from the run-config keys present in ``raw`` (others default)."""
        values = {f.name: coerce_field(key, raw[key], f) for f in fields(cls)
                  if (key := f.name.replace("_", "-")) in raw}
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key (override per method)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}


# TRAIN_LOSS (dpfl.client.job): the private mean training loss of the round, always among
# the ``local`` values passed to :meth:`ClientHalf.release_update` (released only if a method
# releases it); re-exported here for the methods.


class ClientHalf:
    """What a method adds on the client (default: nothing)."""

    def hooks(self, cfg: RunConfig, msg: Message, context: Context,
              model: torch.nn.Module) -> MethodHooks:
        """Local-training hooks and extra reply records for this round."""
        return MethodHooks()

    def post_process(self, cfg: RunConfig, update: torch.Tensor,
                     server_round: int) -> torch.Tensor:
        """Sample-level DP-SGD: the method's transform of the round's flat update before it
        is sent (default: none). It sees only the DP-SGD output (and public values), so it is
        post-processing and costs nothing (e.g. Fed-SMP's sparsification)."""
        return update

    def release_update(self, cfg: RunConfig, config: Mapping[str, Any],
                       update: torch.Tensor, sigma: float, clip: float,
                       generator: torch.Generator, server_round: int,
                       local: Mapping[str, float], clip_fn: UpdateClip | None = None
                       ) -> tuple[torch.Tensor, PrivacyEvent, dict[str, float]]:
        """Client-level update DP: (the released update, its privacy event, extra reply
        metrics). Default: clip to ``clip`` (with the plan's ``clip_fn``, else L2 norm
        clipping) and add N(0, sigma^2 clip^2), one Gaussian event under replace-one;
        ``local`` (the hooks' ``local_values``, plus :data:`TRAIN_LOSS`) is not released.
        ``sigma`` is the planned event's (0 for a method's own pure-epsilon plan)."""
        mechanism = GaussianMechanism(sigma, clip, relation=UPDATE_DP_RELATION,
                                      clip_fn=clip_fn)
        noisy, event = mechanism.release(update, generator, server_round)
        return noisy, event, {}


def no_notes(cfg: RunConfig) -> MethodPrivacy:
    return MethodPrivacy()


@dataclass(frozen=True)
class Method:
    """One DP-FL method: everything the apps need to run it."""

    name: str
    citation: str                                   # authors, title, year
    strategy: Callable[..., DPFLStrategy]   # the server half: (cfg, adaptive=...)
    client: ClientHalf = field(default_factory=ClientHalf)
    params: type[MethodParams] | None = None
    trainers: tuple[str, ...] = ("dpsgd", "update-dp")
    trainer_reason: str = "it is a DP method"
    privacy: Callable[[RunConfig], MethodPrivacy] = no_notes
    presets: str | None = None                      # conf/<folder> of its reproduction
    # per-round parameters chosen from earlier outputs: budgets are a Rényi filter
    adaptive: bool = False
    model: ModelFor | None = None                   # None: the registry's ``model``
    # further rules on the global keys and the method's own (raise ConfigError naming the
    # key), e.g. a method that reads the update as plain SGD's sum of gradients needs
    # momentum = 0
    rules: Callable[[RunConfig], None] | None = None
    # the trust models (dpfl.privacy.trust) under which the method is sound: central and
    # distributed noise cover only a server that uses the MEAN of the clipped updates
    # (then post-processes it); a method that reads individual updates (their norms,
    # directions, losses) or releases anything else stays local
    trusts: tuple[str, ...] = ("local",)
    # the round's release plan (sigma, clip, own event, noise scale, count noise) from public
    # values (dpfl.privacy.plan.ReleasePlan): the client plans its release with it, the
    # guard the release it checks and charges; one function, so the halves cannot disagree
    plan: PlanFn = shared_plan
    # its own integer noise under trust=distributed: the method's params implement
    # dpfl.privacy.trust.OwnSecureNoise (checked at registration), replacing the shared
    # share, event, calibration, dequantisation and range check
    own_secure_noise: bool = False

    def build_model(self, cfg: RunConfig, input_shape: tuple[int, int, int],
                    num_classes: int) -> torch.nn.Module:
        """The network this method trains (server and clients build the same one)."""
        if self.model is not None:
            return self.model(cfg, input_shape, num_classes)
        return build_model(cfg.model, input_shape, num_classes)

    def check(self, cfg: RunConfig) -> None:
        """Method rules on the global keys (the trainers it supports, then :attr:`rules`)."""
        need(cfg.trainer in self.trainers, "trainer",
             f"strategy '{self.name}' needs trainer {' or '.join(map(repr, self.trainers))} "
             f"({self.trainer_reason})", cfg.trainer)
        need(cfg.trust in self.trusts, "trust",
             f"strategy '{self.name}' runs under trust {' or '.join(map(repr, self.trusts))} "
             "(central and distributed noise need a server that only uses the mean of the "
             "clipped updates)", cfg.trust)
        if self.rules is not None:
            self.rules(cfg)

    def with_params(self, cfg: RunConfig, raw: Mapping[str, Any]) -> RunConfig:
        """``cfg`` carrying this method's parameters parsed from ``raw``."""
        params = self.params.parse(raw) if self.params is not None else None
        return dataclasses.replace(cfg, params=params)
