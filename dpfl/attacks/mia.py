"""Four membership-inference attacks on a trained model.

Each attack scores the target's ``members`` against as many ``nonmembers`` and may use the
attacker's ``population``: records of the same distribution disjoint from both, on which it
trains shadow / reference models "like the target" with ``train(make_model, x, y, seed)``.
All randomness comes from ``seed``: the same inputs and seed give the same scores.

- loss threshold: Yeom, Giacomelli, Fredrikson & Jha, "Privacy Risk in Machine Learning:
  Analyzing the Connection to Overfitting", CSF 2018 (threshold from a shadow model as in
  Shokri, Stronati, Song & Shmatikov, "Membership Inference Attacks Against Machine
  Learning Models", IEEE S&P 2017);
- ML-Leaks: Salem, Zhang, Humbert, Berrang, Fritz & Backes, "ML-Leaks: Model and Data
  Independent Membership Inference Attacks and Defenses on Machine Learning Models",
  NDSS 2019 (adversary 1);
- RMIA: Zarifzadeh, Liu, Mahmoud & Shokri, "Low-Cost High-Power Membership Inference
  Attacks", ICML 2024 (offline);
- gradient norm (white-box): the per-example gradient norm of the loss, as in Nasr, Shokri
  & Houmansadr, "Comprehensive Privacy Analysis of Deep Learning", IEEE S&P 2019.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from dpfl.attacks.metrics import AttackResult, best_threshold
from dpfl.attacks.reference import (
    per_example_loss,
    softmax_outputs,
    true_label_probability,
)

Records = tuple[torch.Tensor, torch.Tensor]
ModelFactory = Callable[[], nn.Module]
TrainFn = Callable[[ModelFactory, torch.Tensor, torch.Tensor, int], nn.Module]
Progress = Callable[[str], None]

# independent random streams derived from the attack seed
_SHADOW, _REFERENCE, _RMIA_Z, _MLLEAKS = 1, 2, 3, 4


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([stream, seed])


def _seed(rng: np.random.Generator) -> int:
    return int(rng.integers(2**31 - 1))


def _targets(members: Records, nonmembers: Records
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Members then non-members as one batch (x, y) and the membership labels."""
    (x_in, y_in), (x_out, y_out) = members, nonmembers
    if len(x_in) != len(y_in) or len(x_out) != len(y_out):
        raise ValueError("inputs and labels differ in number")
    if len(y_in) != len(y_out):
        raise ValueError(f"{len(y_in)} members but {len(y_out)} non-members: "
                         "the attacks need equal numbers")
    if len(y_in) == 0:
        raise ValueError("no members")
    labels = torch.cat([torch.ones(len(y_in), dtype=torch.bool),
                        torch.zeros(len(y_out), dtype=torch.bool)])
    return torch.cat([x_in, x_out]), torch.cat([y_in, y_out]).long(), labels


@dataclass(frozen=True)
class Shadow:
    """A shadow model trained on ``inside`` (half of the population) and the equal-size
    other half ``outside`` it never saw."""

    model: nn.Module
    inside: Records
    outside: Records


def train_shadow(population: Records, make_model: ModelFactory, train: TrainFn, *,
                 seed: int) -> Shadow:
    """One shadow model on a seeded random half of the population."""
    x, y = population
    half = len(y) // 2
    if half < 1:
        raise ValueError("the population needs at least 2 records")
    rng = _rng(seed, _SHADOW)
    perm = torch.from_numpy(rng.permutation(len(y)))
    i_in, i_out = perm[:half], perm[half:2 * half]
    model = train(make_model, x[i_in], y[i_in], _seed(rng))
    return Shadow(model.eval(), (x[i_in], y[i_in]), (x[i_out], y[i_out]))


def _shadow_threshold(shadow: Shadow, score: Callable[[nn.Module, torch.Tensor,
                                                       torch.Tensor], torch.Tensor]
                      ) -> float:
    """The score threshold with the best membership accuracy on the shadow model."""
    s = torch.cat([score(shadow.model, *shadow.inside), score(shadow.model, *shadow.outside)])
    lab = torch.cat([torch.ones(len(shadow.inside[1]), dtype=torch.bool),
                     torch.zeros(len(shadow.outside[1]), dtype=torch.bool)])
    return best_threshold(s, lab)[0]


def _neg_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -per_example_loss(model, x, y)


def loss_threshold_attack(target: nn.Module, members: Records, nonmembers: Records,
                          population: Records, make_model: ModelFactory, train: TrainFn, *,
                          seed: int, shadow: Shadow | None = None) -> AttackResult:
    """Score = -loss(target; x, y) (Yeom, Giacomelli, Fredrikson & Jha, "Privacy Risk in
    Machine Learning: Analyzing the Connection to Overfitting", CSF 2018); the threshold
    maximises membership accuracy of the same score on a shadow model, shadow-in vs
    shadow-out (Shokri, Stronati, Song & Shmatikov, "Membership Inference Attacks Against
    Machine Learning Models", S&P 2017). ``shadow`` (from :func:`train_shadow` with this
    seed) skips its training."""
    x, y, labels = _targets(members, nonmembers)
    if shadow is None:
        shadow = train_shadow(population, make_model, train, seed=seed)
    return AttackResult("loss", _neg_loss(target, x, y), labels,
                        _shadow_threshold(shadow, _neg_loss))


def top_posteriors(probs: torch.Tensor, k: int = 3) -> torch.Tensor:
    """The k largest posteriors of each row, in descending order (ML-Leaks' features)."""
    return probs.sort(dim=1, descending=True).values[:, :min(k, probs.shape[1])]


def mlleaks_attack(target: nn.Module, members: Records, nonmembers: Records,
                   population: Records, make_model: ModelFactory, train: TrainFn, *,
                   seed: int, shadow: Shadow | None = None) -> AttackResult:
    """ML-Leaks adversary 1 (Salem, Zhang, Humbert, Berrang, Fritz & Backes, "ML-Leaks:
    Model and Data Independent Membership Inference Attacks and Defenses on Machine
    Learning Models", NDSS 2019): an MLP attack classifier (64 hidden
    units, as in the paper; inputs standardised) learns member (shadow-in) vs non-member
    (shadow-out) from the shadow model's top-3 sorted posteriors; score = its member
    probability on the target's top-3 posteriors; threshold 0.5."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y, labels = _targets(members, nonmembers)
    if shadow is None:
        shadow = train_shadow(population, make_model, train, seed=seed)
    f_in = top_posteriors(softmax_outputs(shadow.model, shadow.inside[0]))
    f_out = top_posteriors(softmax_outputs(shadow.model, shadow.outside[0]))
    features = torch.cat([f_in, f_out]).numpy()
    is_member = np.r_[np.ones(len(f_in), int), np.zeros(len(f_out), int)]
    clf = make_pipeline(StandardScaler(), MLPClassifier(
        hidden_layer_sizes=(64,), max_iter=500, random_state=_seed(_rng(seed, _MLLEAKS))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(features, is_member)
    target_features = top_posteriors(softmax_outputs(target, x)).numpy()
    member_col = list(clf.classes_).index(1)
    scores = torch.from_numpy(clf.predict_proba(target_features)[:, member_col])
    return AttackResult("ml-leaks", scores, labels, 0.5)


def rmia_scores(p_x: torch.Tensor, p_x_out: torch.Tensor, p_z: torch.Tensor,
                p_z_out: torch.Tensor, *, a: float = 0.3, gamma: float = 1.0
                ) -> torch.Tensor:
    """RMIA's score (Zarifzadeh et al., ICML 2024, section 3, offline variant).

    p_x = Pr(x|θ) of the target on the records attacked and p_x_out = Pr_OUT(x), their
    mean over reference models not trained on them; p_z, p_z_out the same for the
    population samples z. With the paper's offline approximation of
    Pr(x) = ½(Pr_IN(x) + Pr_OUT(x)) by Pr(x) = ½((1+a)·Pr_OUT(x) + (1-a)) (the same for z),
    LR(x) = Pr(x|θ)/Pr(x), LR(z) = Pr(z|θ)/Pr(z) and
    score(x) = |{z : LR(x)/LR(z) >= γ}| / |Z|, computed by sorting LR(z) and a binary
    search (no loop over pairs).
    """
    tiny = torch.finfo(torch.float64).tiny

    def ratio(p: torch.Tensor, p_out: torch.Tensor) -> torch.Tensor:
        pr = 0.5 * ((1 + a) * p_out.to(torch.float64) + (1 - a))
        return p.to(torch.float64) / pr.clamp_min(tiny)

    lr_x, lr_z = ratio(p_x, p_x_out), ratio(p_z, p_z_out)
    # LR(x)/LR(z) >= γ  <=>  LR(z) <= LR(x)/γ  (likelihoods are positive)
    count = torch.searchsorted(torch.sort(lr_z).values, lr_x / gamma, right=True)
    return count.to(torch.float64) / len(lr_z)


def rmia_attack(target: nn.Module, members: Records, nonmembers: Records,
                population: Records, make_model: ModelFactory, train: TrainFn, *,
                seed: int, reference_models: int = 4, a: float = 0.3, gamma: float = 1.0,
                num_z: int = 1000, progress: Progress | None = None) -> AttackResult:
    """Offline RMIA (Zarifzadeh, Liu, Mahmoud & Shokri, "Low-Cost High-Power Membership
    Inference Attacks", ICML 2024).

    ``reference_models`` models are trained like the target, each on a seeded random half
    of the population; they are all OUT models for the attacked records. The z are a
    seeded sample of up to ``num_z`` population records; Pr_OUT(z) averages the reference
    models whose half left z out (about half of them; a z that every reference model
    trained on is dropped from Z), so x and z get the same offline estimate of Pr(·).
    Pr(·|θ) is the softmax probability of the true label. See :func:`rmia_scores`. No
    threshold: the paper's γ-test is per pair (x, z), not a threshold on the score.
    """
    if reference_models < 1:
        raise ValueError("RMIA needs at least one reference model")
    x, y, labels = _targets(members, nonmembers)
    x_pop, y_pop = population
    half = len(y_pop) // 2
    if half < 1:
        raise ValueError("the population needs at least 2 records")
    rng = _rng(seed, _REFERENCE)
    z_idx = torch.from_numpy(np.sort(_rng(seed, _RMIA_Z).choice(
        len(y_pop), min(num_z, len(y_pop)), replace=False)))
    x_z, y_z = x_pop[z_idx], y_pop[z_idx]
    p_x_ref, p_z_ref, z_in = [], [], []
    for k in range(reference_models):
        if progress:
            progress(f"RMIA: reference model {k + 1}/{reference_models} ({half} records)")
        subset = torch.from_numpy(rng.permutation(len(y_pop))[:half])
        ref = train(make_model, x_pop[subset], y_pop[subset], _seed(rng))
        p_x_ref.append(true_label_probability(ref, x, y))
        p_z_ref.append(true_label_probability(ref, x_z, y_z))
        z_in.append(torch.isin(z_idx, subset))
    out = ~torch.stack(z_in)                                  # [K, |Z|]: z not trained on
    keep = out.any(0)
    p_z_out = (torch.stack(p_z_ref) * out).sum(0)[keep] / out.sum(0)[keep]
    scores = rmia_scores(true_label_probability(target, x, y),
                         torch.stack(p_x_ref).mean(0),
                         true_label_probability(target, x_z[keep], y_z[keep]),
                         p_z_out, a=a, gamma=gamma)
    return AttackResult("rmia", scores, labels, None)


def per_example_grad_norm(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                          chunk: int | None = None) -> torch.Tensor:
    """‖∇_θ loss(θ; x_i, y_i)‖₂ over all trainable parameters, per example (float64),
    with torch.func (functional_call + vmap + grad), in eval mode, ``chunk`` examples at a
    time (default: about 128 MB of per-example gradients)."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    fixed = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    fixed.update({k: v.detach() for k, v in model.named_buffers()})

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, {**p, **fixed}, (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    n_params = sum(v.numel() for v in params.values())
    chunk = chunk or max(1, min(1024, 2**25 // max(n_params, 1)))
    was_training = model.training
    model.eval()
    norms = []
    try:
        for i in range(0, len(y), chunk):
            g = per_example(params, x[i:i + chunk], y[i:i + chunk].long())
            sq = sum(t.flatten(1).to(torch.float64).pow(2).sum(1) for t in g.values())
            norms.append(torch.as_tensor(sq, dtype=torch.float64).sqrt())
    finally:
        model.train(was_training)
    if not norms:
        return torch.zeros(0, dtype=torch.float64)
    return torch.nan_to_num(torch.cat(norms), nan=math.inf)  # unknown: least member-like


def _neg_grad_norm(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -per_example_grad_norm(model, x, y)


def gradient_norm_attack(target: nn.Module, members: Records, nonmembers: Records,
                         population: Records, make_model: ModelFactory, train: TrainFn, *,
                         seed: int, shadow: Shadow | None = None) -> AttackResult:
    """White-box: score = -‖∇_θ loss(θ; x, y)‖₂ (training drives members' gradients
    towards 0; Nasr, Shokri & Houmansadr, "Comprehensive Privacy Analysis of Deep
    Learning", IEEE S&P 2019, use gradient norms as an attack feature; in the spirit of the
    white-box attack of Zhang, Mao, He, Huang & Wu, "Balancing Privacy and Accuracy Using
    Significant Gradient Protection in Federated Learning", IEEE TC 2024, Table III);
    threshold tuned on a shadow model as for the loss attack."""
    x, y, labels = _targets(members, nonmembers)
    if shadow is None:
        shadow = train_shadow(population, make_model, train, seed=seed)
    return AttackResult("gradient-norm", _neg_grad_norm(target, x, y), labels,
                        _shadow_threshold(shadow, _neg_grad_norm))


def run_attacks(target: nn.Module, members: Records, nonmembers: Records,
                population: Records, make_model: ModelFactory, train: TrainFn, *,
                seed: int, reference_models: int = 4,
                progress: Progress | None = None) -> list[AttackResult]:
    """The four attacks (loss, ML-Leaks, RMIA, gradient norm) on the same records; one
    shadow model serves the three attacks that need one (the same one each would train
    alone with this seed). ``progress(msg)`` is called before each stage."""
    say = progress or (lambda msg: None)
    _targets(members, nonmembers)   # fail before any training
    half = len(population[1]) // 2
    say(f"shadow model: training on {half} population records ({half} held out)")
    shadow = train_shadow(population, make_model, train, seed=seed)
    common = (target, members, nonmembers, population, make_model, train)
    say("loss-threshold attack")
    out = [loss_threshold_attack(*common, seed=seed, shadow=shadow)]
    say("ML-Leaks attack (top-3 posteriors, MLP attack classifier)")
    out.append(mlleaks_attack(*common, seed=seed, shadow=shadow))
    say(f"RMIA (offline, {reference_models} reference models)")
    out.append(rmia_attack(*common, seed=seed, reference_models=reference_models,
                           progress=say))
    say("gradient-norm attack (per-example gradients)")
    out.append(gradient_norm_attack(*common, seed=seed, shadow=shadow))
    return out
