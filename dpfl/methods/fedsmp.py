"""``fedsmp``: Fed-SMP, federated learning with sparsified model perturbation (Hu, Gong &
Guo, "Federated Learning with Sparsified Model Perturbation: Improving Accuracy under
Client-Level Differential Privacy", IEEE Transactions on Mobile Computing, 2024, arXiv
2202.07178). DP-FedASGP's "FedSMP-top_k" baseline. Every choice the method leaves open here
is marked CHOICE.

Client (``trainer=update-dp``: client-level DP, noise added on the client): after the shared
local training, the update Delta (d coordinates) is sparsified to k = round(r d)
coordinates (``fedsmp-ratio`` r = k / d, at least 1), the k kept coordinates are clipped
together to L2 norm C (``clip-norm``) and get N(0, sigma^2 C^2) each; the d - k others are
sent as 0. The mask (``fedsmp-mask``):

- ``randk``: k coordinates drawn uniformly without replacement from PUBLIC randomness
  shared by every client of the round: a generator seeded from (run-config ``seed``, round)
  only (:func:`mask_seed`; the server, which draws the mask in the paper, computes the same
  one). The mask is independent of every client's data, so given the mask the release is
  the Gaussian mechanism on the k kept coordinates: replace-one L2 sensitivity 2C (two
  vectors clipped to C), noise sigma C -> one Gaussian event of multiplier sigma per round
  under replace-one (sigma / 2 at sensitivity 1), accounted with dp-accounting (RDP or PLD)
  exactly as DP-FedAvg's client-level release — the shared plan
  (:func:`dpfl.privacy.plan.planned_event`), calibrated from ``target-epsilon``.
  Verdict ``formal``.
- ``topk``: the client's own k largest-magnitude coordinates of Delta (one ``torch.topk``).
  The values are clipped and noised as above, but the POSITIONS of the kept coordinates — a
  deterministic function of the client's data — are released without noise: the output's
  support alone distinguishes two local datasets whose top-k supports differ (the zero
  pattern of the reply is exact), so no finite epsilon bounds the release. The Gaussian on
  the values is still charged to the ledger (the same event as rand-k) so that runs line up;
  it is NOT a bound. Verdict ``none: top-k positions released``. CHOICE (the decision the
  brief asked for): the verdict, not a charge. A formal top-k would have to choose the k
  positions privately (e.g. k-fold peeling with the exponential mechanism, each pick
  paying for utility |Delta_j| of sensitivity C); with k in the thousands (r = 0.1 of
  80,202 parameters for mnist-cnn) that budget is thousands of selections per round, and at
  any epsilon the grid uses the selection noise would make it rand-k. No formal top-k
  variant is offered; the Fed-SMP analysis is for the Gaussian on the kept values (its
  rand-k mask is public), which is what the ledger charges.

Accounting. The paper's RDP analysis composes the SUBSAMPLED Gaussian (client sampling
with rate q amplifies each round). dpfl claims no amplification by client sampling for
noise a client adds itself: the server sees who sends what, so a client that is selected
is not hidden (and dpfl's selection is a fixed-size seeded sample,
:meth:`dpfl.server.strategy.DPFLStrategy.select_nodes`, not Poisson); each round a client
takes part in costs one plain Gaussian event (rate 1), and rounds it skips cost nothing.

Server: equal weights (client-level DP: sizes are private), the mean of the sparse replies,
then the shared server step. CHOICE: for ``randk`` with ``fedsmp-rescale`` (default) the
mean is multiplied by d / k, the paper's unbiased rand_k (E[(d/k) m (.) x] = x for a fixed
x); it is done by the server on released values (post-processing; a client-side rescale
before the clip would only act as a smaller clip norm C k / d). ``topk`` is the paper's
biased compressor: never rescaled. A reply is rejected when it has a non-zero coordinate
outside the round's public rand-k mask, or (top-k) more than k non-zero coordinates; the
norm bound is the Gaussian tail bound on k coordinates, C + sigma C (sqrt(k) + 10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dpfl.config import RunConfig, need
from dpfl.method import ClientHalf, Method, MethodParams
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.mechanisms.release import l2_clip
from dpfl.privacy.plan import (
    UPDATE_DP_RELATION,
    PlanFn,
    gaussian_norm_bound,
    noise_multiplier_for,
    shared_plan,
)
from dpfl.privacy.verdict import MethodPrivacy
from dpfl.server.aggregation import weighted_mean
from dpfl.server.strategy import DPFLStrategy, RoundRecord, StrategyInputs
from dpfl.server.validation import ClientUpdate
from dpfl.tensors import largest_magnitude_indices

MASKS = ("randk", "topk")
MASK_TAG = 0x46534D50             # "FSMP": separates the mask's stream from any other seed
TOPK_CLEAR = ("top-k positions released (the support of the client's k largest-magnitude "
              "update coordinates, a function of its data, is sent without noise)")


@dataclass(frozen=True)
class FedSMPParams(MethodParams):
    fedsmp_mask: str = "randk"         # one of MASKS
    fedsmp_ratio: float = 0.1          # k / d
    fedsmp_rescale: bool = True        # randk: the server scales the mean by d / k

    HELP = {
        "fedsmp-mask": "which k = round(ratio·d) update coordinates are kept: `randk` (a mask "
                       "from public randomness, run-config `seed` and round, shared by the "
                       "round's clients: formal) or `topk` (the client's own largest |Δ_j|: "
                       "their positions are released, verdict none); they are clipped to C "
                       "and get N(0, σ²C²). Under `trainer=dpsgd` the DP-SGD update is "
                       "sparsified instead (post-processing: both masks formal)",
        "fedsmp-ratio": "the kept share k/d",
        "fedsmp-rescale": "`randk`: the server scales the mean by d/k (the paper's unbiased "
                          "rand_k)",
    }
    CHOICES = {"fedsmp-mask": MASKS}

    def validate(self) -> None:
        need(self.fedsmp_mask in MASKS, "fedsmp-mask", f"must be one of {MASKS}",
             self.fedsmp_mask)
        need(math.isfinite(self.fedsmp_ratio) and 0 < self.fedsmp_ratio <= 1, "fedsmp-ratio",
             "must be in (0, 1] (the kept share k / d)", self.fedsmp_ratio)


def _p(cfg: RunConfig) -> FedSMPParams:
    return cfg.params


# -- the mask ------------------------------------------------------------------------------

def kept_count(dim: int, ratio: float) -> int:
    """k = round(ratio d), kept in [1, d]."""
    return max(1, min(dim, round(ratio * dim)))


def mask_seed(seed: int, server_round: int) -> int:
    """The rand-k mask's seed: a function of the run-config seed and the round only
    (public; the same for every client of the round), mixed by numpy's SeedSequence."""
    state = np.random.SeedSequence([MASK_TAG, seed % 2 ** 64, server_round % 2 ** 64])
    return int(state.generate_state(1, np.uint64)[0]) >> 1


def randk_indices(dim: int, k: int, seed: int, server_round: int) -> torch.Tensor:
    """The round's public rand-k mask: k of ``dim`` indices uniformly without replacement,
    sorted (one ``randperm`` from the generator of :func:`mask_seed`)."""
    gen = torch.Generator().manual_seed(mask_seed(seed, server_round))
    return torch.randperm(dim, generator=gen)[:k].sort().values


def topk_indices(update: torch.Tensor, k: int) -> torch.Tensor:
    """Fed-SMP-top_k's mask: the indices of the k largest |update_j| (flattened), sorted."""
    return largest_magnitude_indices(update, k)


def kept_indices(cfg: RunConfig, update: torch.Tensor, server_round: int) -> torch.Tensor:
    """The coordinates a client keeps this round under the configured mask."""
    p, dim = _p(cfg), update.numel()
    k = kept_count(dim, p.fedsmp_ratio)
    if p.fedsmp_mask == "randk":
        return randk_indices(dim, k, cfg.seed, server_round)
    return topk_indices(update, k)


# -- the release ---------------------------------------------------------------------------

def sparsified_release(update: torch.Tensor, kept: torch.Tensor, sigma: float, clip: float,
                       generator: torch.Generator) -> torch.Tensor:
    """Sparsified model perturbation: the ``kept`` coordinates clipped together to L2 norm
    ``clip`` plus N(0, sigma^2 clip^2) each (drawn from ``generator``), every other
    coordinate 0. A non-finite update (training diverged) is released as 0 plus the noise:
    any map of the data into the clip ball keeps the sensitivity."""
    flat = update.reshape(-1)
    if not bool(torch.isfinite(flat).all()):
        flat = torch.zeros_like(flat)
    values = l2_clip(flat[kept], clip)
    noise = torch.randn(values.shape, generator=generator, dtype=values.dtype)
    out = torch.zeros_like(flat)
    out[kept] = values + noise.to(values.device) * (sigma * clip)
    return out.reshape(update.shape)


class FedSMPClient(ClientHalf):
    """Mask, clip the kept coordinates, add Gaussian noise on them only (the shared plan);
    under DP-SGD, mask the DP-SGD update (post-processing)."""

    def post_process(self, cfg, update, server_round) -> torch.Tensor:
        """Sample-level reading: the k kept coordinates of the DP-SGD update, the others 0.
        Either mask is post-processing here — rand-k is public and top-k is chosen from the
        already-noised update — so the release is DP-SGD's, with no extra clip or noise."""
        kept = kept_indices(cfg, update, server_round)
        out = torch.zeros_like(update)
        out[kept] = update[kept]
        return out

    def release_update(self, cfg, config, update, sigma, clip, generator, server_round,
                       local, clip_fn=None) -> tuple[torch.Tensor, PrivacyEvent,
                                                     dict[str, float]]:
        kept = kept_indices(cfg, update, server_round)
        noisy = sparsified_release(update, kept, sigma, clip, generator)
        return noisy, PrivacyEvent.gaussian(server_round, sigma,
                                            relation=UPDATE_DP_RELATION), {}


# -- server half ---------------------------------------------------------------------------

class FedSMPStrategy(DPFLStrategy):
    """The shared base with the sparse replies' checks, the k-coordinate norm bound and the
    rand-k rescale."""

    def __init__(self, cfg: RunConfig, adaptive: bool = False,
                 plan: PlanFn = shared_plan, inputs: StrategyInputs | None = None) -> None:
        super().__init__(cfg, adaptive, plan, inputs)
        self._mask: tuple[tuple[int, int], torch.Tensor] | None = None
        # each checked reply's count of non-zero coordinates (the reply check counts them
        # anyway), for the round's kept-fraction metric without another pass over the updates
        self._nonzero: dict[tuple[int, int], int] = {}

    def round_mask(self, dim: int, server_round: int) -> torch.Tensor:
        """The round's public rand-k mask as a boolean vector (cached per round)."""
        if self._mask is None or self._mask[0] != (dim, server_round):
            keep = torch.zeros(dim, dtype=torch.bool)
            keep[randk_indices(dim, kept_count(dim, _p(self.cfg).fedsmp_ratio), self.cfg.seed,
                               server_round)] = True
            self._mask = ((dim, server_round), keep)
        return self._mask[1]

    def update_norm_bound(self, dim: int, server_round: int) -> float | None:
        """C + sigma C (sqrt(k) + 10): Gaussian noise on k coordinates only (DP-SGD: the
        guard's DP-SGD bound; masking only shortens the update)."""
        if self.cfg.trainer == "dpsgd":
            return None
        k = kept_count(dim, _p(self.cfg).fedsmp_ratio)
        return gaussian_norm_bound(self.cfg.clip_norm, noise_multiplier_for(self.cfg, 1), k)

    def finish_round(self, server_round, record, replies):
        self._nonzero.clear()
        return super().finish_round(server_round, record, replies)

    def reply_problem(self, update: ClientUpdate) -> str | None:
        """rand-k: no non-zero coordinate outside the round's mask; top-k: at most k
        non-zero coordinates."""
        p, flat = _p(self.cfg), update.flat
        k = kept_count(flat.numel(), p.fedsmp_ratio)
        nonzero = flat != 0
        self._nonzero[(update.node_id, id(flat))] = int(nonzero.sum())
        if p.fedsmp_mask == "randk":
            outside = int((nonzero & ~self.round_mask(flat.numel(), self.round.server_round)).sum())
            if outside:
                return (f"{outside} non-zero coordinates outside the round's public rand-k "
                        f"mask (k = {k})")
            return None
        released = self._nonzero[(update.node_id, id(flat))]
        if released > k:
            return f"{released} non-zero coordinates > k = {k} (fedsmp-mask=topk)"
        return None

    def aggregate_updates(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The weighted mean (equal weights), times d / k for rescaled rand-k."""
        p = _p(self.cfg)
        if not (p.fedsmp_mask == "randk" and p.fedsmp_rescale):
            return weighted_mean(updates, weights)
        weighted_mean(updates[:, :0], weights)   # its shape and weight checks, no arithmetic
        dim = updates.shape[1]
        w = weights.to(updates.dtype)
        # d / k folded into the normalised weights: one M x d product, as FedAvg's mean
        return (w * (dim / kept_count(dim, p.fedsmp_ratio) / float(w.sum()))) @ updates

    def round_metrics(self, record: RoundRecord) -> dict[str, float]:
        """The mean share of non-zero coordinates of the accepted replies."""
        out = super().round_metrics(record)
        kept = [self._nonzero.get((u.node_id, id(u.flat)), None) for u in record.accepted]
        kept = [int(torch.count_nonzero(u.flat)) if c is None else c
                for u, c in zip(record.accepted, kept)]
        if kept:
            dim = max(record.accepted[0].flat.numel(), 1)
            out["fedsmp-kept-fraction"] = sum(kept) / (len(kept) * dim)
        return out


# -- method --------------------------------------------------------------------------------

def fedsmp_privacy(cfg: RunConfig) -> MethodPrivacy:
    p = _p(cfg)
    if cfg.trainer == "dpsgd":   # the record-level reading: DP-SGD, then the mask
        how = ("a public random mask" if p.fedsmp_mask == "randk" else
               "the top-k coordinates of the already-noised update")
        return MethodPrivacy(
            scope=f"Fed-SMP over DP-SGD (sample level): the DP-SGD update sparsified to k = "
                  f"round({p.fedsmp_ratio:g} d) coordinates by {how} — post-processing of "
                  "the DP-SGD output, so the ledger's DP-SGD events are the whole release",
            release=f"the DP-SGD update sparsified by {how}")
    values = (f"the kept coordinates clipped to {cfg.clip_norm} plus Gaussian noise on them "
              "only, the others sent as 0")
    if p.fedsmp_mask == "randk":
        scope = (f"Fed-SMP rand-k: k = round({p.fedsmp_ratio:g} d) coordinates chosen by a "
                 "mask drawn from public randomness shared by the round's clients (run-config "
                 "seed and round), independent of the data; one Gaussian event per round "
                 "(replace-one, sensitivity 2C), no amplification by client sampling")
        return MethodPrivacy(scope=scope, release=f"update sparsified by a public random "
                             f"mask, {values}")
    scope = (f"Fed-SMP top-k: the client's k = round({p.fedsmp_ratio:g} d) largest-magnitude "
             "update coordinates; the ledger charges the Gaussian on their values (NOT a bound:"
             " their positions are released without noise)")
    return MethodPrivacy(scope=scope, clear=(TOPK_CLEAR,),
                         release=f"update sparsified to its own top-k coordinates, {values}")


METHOD = Method(
    name="fedsmp",
    citation="Hu, Gong & Guo, \"Federated Learning with Sparsified Model Perturbation: "
             "Improving Accuracy under Client-Level Differential Privacy\" (Fed-SMP), IEEE "
             "Transactions on Mobile Computing, 2024 (arXiv 2202.07178)",
    strategy=FedSMPStrategy,
    client=FedSMPClient(),
    params=FedSMPParams,
    trainers=("update-dp", "dpsgd"),
    trainer_reason="Fed-SMP perturbs the client's sparsified update (client-level DP), or "
                   "sparsifies the DP-SGD update (sample level)",
    privacy=fedsmp_privacy,
)
