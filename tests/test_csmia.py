"""CS-MIA (dpfl.attacks.csmia): the confidence series against a hand computation, the
attack on hand-built series (members' confidence rises early, non-members' late, the last
round alike: the series tells them apart, the last round alone cannot), and on an
in-process overfitted federation, where it beats Basic-MIA (the loss threshold) in
accuracy as DP-FedASGP's Table III reports."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from dpfl.attacks import (
    AttackResult,
    confidence_series,
    csmia_attack,
    csmia_scores,
    loss_threshold_attack,
    train_reference_model,
)
from dpfl.attacks.target import label_matched
from dpfl.server.observer import recorded_global_path, recorded_global_rounds

torch.set_num_threads(1)
DIM, CLASSES = 20, 10


def test_confidence_series_is_the_true_label_probability_per_model():
    """Two 2-input, 3-class linear models with hand-set weights; softmax by hand."""
    models = []
    for w in ([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], [[0.0, 0.0], [2.0, 0.0], [0.0, -1.0]]):
        m = nn.Linear(2, 3, bias=False)
        with torch.no_grad():
            m.weight.copy_(torch.tensor(w))
        models.append(m)
    x = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    y = torch.tensor([1, 2])

    def softmax(logits, k):
        return math.exp(logits[k]) / sum(math.exp(v) for v in logits)

    want = [[softmax([1, 2, 0], 1), softmax([0, 2, -2], 1)],   # record 0: logits W x
            [1 / 3, 1 / 3]]                                     # x = 0: uniform
    got = confidence_series(iter(models), x, y)                 # a generator is enough
    assert got.dtype == torch.float64 and got.shape == (2, 2)
    assert got.flatten().tolist() == pytest.approx([v for row in want for v in row])
    with pytest.raises(ValueError, match="at least one model"):
        confidence_series([], x, y)


def _hand_series(n: int, early: bool, rng: np.random.Generator) -> torch.Tensor:
    """10 rounds; confidence from 0.1 to 0.9: members reach it by round 3, non-members
    only in the last round; small noise."""
    t = np.arange(1, 11)
    base = np.where(t >= 3, 0.9, 0.1) if early else np.where(t >= 10, 0.9, 0.1)
    return torch.from_numpy(np.clip(base + rng.normal(0, 0.03, (n, 10)), 0, 1))


def test_series_separates_what_the_last_round_cannot():
    rng = np.random.default_rng(0)
    train = torch.cat([_hand_series(100, True, rng), _hand_series(100, False, rng)])
    labels = torch.tensor([True] * 100 + [False] * 100)
    target = torch.cat([_hand_series(50, True, rng), _hand_series(50, False, rng)])
    target_labels = torch.tensor([True] * 50 + [False] * 50)
    scores = csmia_scores(train, labels, target, seed=0)
    cs = AttackResult("cs-mia", scores, target_labels, 0.5)
    assert cs.accuracy() == 1.0 and cs.auc() == 1.0
    # the last round's confidence alone: both groups at 0.9 + noise, a coin flip
    last = AttackResult("last", target[:, -1], target_labels)
    assert abs(last.auc() - 0.5) < 0.15, last.auc()
    # same inputs and seed, same scores
    assert torch.equal(scores, csmia_scores(train, labels, target, seed=0))


def test_bad_series_raise():
    train, labels = torch.rand(4, 3), torch.tensor([True, False, True, False])
    with pytest.raises(ValueError, match="different lengths"):
        csmia_scores(train, labels, torch.rand(2, 4), seed=0)
    with pytest.raises(ValueError, match="members and non-members"):
        csmia_scores(train, torch.ones(4, dtype=torch.bool), torch.rand(2, 3), seed=0)


def test_recorded_global_rounds_reads_the_folder(tmp_path):
    assert recorded_global_rounds(tmp_path) == []
    for r in (10, 2, 1):
        path = recorded_global_path(tmp_path, r)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"")
    (tmp_path / "globals" / "round-x.pt").write_bytes(b"")
    assert recorded_global_rounds(tmp_path) == [1, 2, 10]


def test_known_nonmembers_match_the_members_label_counts():
    """Members with labels 0,0,0,1,2; a pool with four 0s, one 1 and no 2: three 0s, the
    1, and one more record drawn from the rest (no label 2 exists)."""
    pool = np.array([0, 1, 0, 3, 0, 3, 0])
    rng = np.random.default_rng(0)
    idx = label_matched(np.array([0, 0, 0, 1, 2]), pool, rng)
    assert len(idx) == len(set(idx.tolist())) == 5
    labels = pool[idx].tolist()
    assert labels.count(1) == 1 and labels.count(0) >= 3
    assert labels.count(0) + labels.count(3) == 4     # the top-up is a 0 or a 3
    # a pool with enough of every label reproduces the counts exactly
    big = np.repeat(np.arange(3), 10)
    got = big[label_matched(np.array([2, 2, 1, 0, 2]), big, rng)]
    assert sorted(got.tolist()) == [0, 1, 2, 2, 2]


# ------------------------------------------------- an overfitted in-process federation

def _records(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian inputs with random labels: only memorisation fits them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def _make() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def _fedavg(clients, rounds: int, epochs: int) -> list[nn.Module]:
    """Plain FedAvg by hand: each round every client trains ``epochs`` from the global
    model, the global model is the mean; returns the global model of every round."""
    torch.manual_seed(0)
    state = _make().state_dict()
    out = []
    for r in range(rounds):
        trained = []
        for k, (x, y) in enumerate(clients):
            def start(state=state):
                m = _make()
                m.load_state_dict(state)
                return m
            trained.append(train_reference_model(start, x, y, epochs=epochs, lr=0.1,
                                                 batch_size=16, seed=1000 * r + k,
                                                 momentum=0.9).state_dict())
        state = {n: sum(s[n] for s in trained) / len(trained) for n in state}
        model = _make()
        model.load_state_dict(state)
        out.append(model.eval())
    return out


def test_csmia_beats_basic_mia_on_an_overfitted_federation():
    """Target client and adversary client, 10 rounds x 2 local epochs on random labels.
    Basic-MIA's threshold comes from a shadow model trained centrally for as many epochs
    (the attacker's best guess); CS-MIA's attack model learns from the adversary's own
    records in the federation. Measured (seed 0): Basic-MIA accuracy 0.50 (its threshold,
    tuned on a fully memorised shadow, is too strict for the averaged global model; AUC
    0.96), CS-MIA 0.875 (AUC 0.97)."""
    members, nonmembers, own = _records(64, 1), _records(64, 2), _records(64, 4)
    population = _records(512, 3)
    models = _fedavg([members, own], rounds=10, epochs=2)

    def shadow_train(make, x, y, seed):
        return train_reference_model(make, x, y, epochs=20, lr=0.1, batch_size=16,
                                     seed=seed, momentum=0.9)
    basic = loss_threshold_attack(models[-1], members, nonmembers, population, _make,
                                  shadow_train, seed=0)
    cs = csmia_attack(models, members, nonmembers, own,
                      (population[0][:64], population[1][:64]), seed=0)
    assert cs.name == "cs-mia" and cs.threshold == 0.5 and cs.scores.shape == (128,)
    assert cs.labels.tolist() == [True] * 64 + [False] * 64
    assert cs.accuracy() > 0.8, cs.summary()
    assert cs.accuracy() > basic.accuracy() + 0.2, (cs.summary(), basic.summary())
    # the federation is not at chance for either: both see the memorisation
    assert cs.auc() > 0.9 and basic.auc() > 0.9


# ------------------------------------------------- the recorded rounds and `dpfl attack`

def _digits_run(tmp_path, rounds: int):
    """A run directory by hand: config.json (3 clients, digits, MLP) and the global model
    of ``rounds`` rounds kept by the server's observer."""
    import json

    from dpfl.data import load_dataset
    from dpfl.methods import method_for, run_config
    from dpfl.server.observer import UpdateObserver

    cfg = run_config(dataset="digits", model="mlp", record_global_models=True)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "num-clients": 3}))
    ds = load_dataset("digits", cfg.data_dir, False)
    obs = UpdateObserver(cfg, tmp_path)
    states = []
    for r in range(1, rounds + 1):
        torch.manual_seed(r)
        states.append(method_for(cfg).build_model(cfg, ds.input_shape, ds.num_classes)
                      .state_dict())
        obs.keep_global(r, states[-1])
    return cfg, ds, states


def test_kept_global_models_come_back_in_round_order(tmp_path):
    from dpfl.attacks.target import global_models
    from dpfl.server.observer import UpdateObserver

    cfg, ds, states = _digits_run(tmp_path, 3)
    rounds, models = global_models(tmp_path, cfg, ds.input_shape, ds.num_classes)
    assert rounds == [1, 2, 3]
    for state, model in zip(states, models(), strict=True):
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    off = tmp_path / "off"
    off.mkdir()
    UpdateObserver(_record_nothing_cfg(), off).keep_global(1, states[0])
    assert recorded_global_rounds(off) == []


def _record_nothing_cfg():
    from dpfl.methods import run_config
    return run_config(dataset="digits", model="mlp")


@pytest.mark.parametrize("attacker", [0, 3, -1])
def test_a_bad_csmia_attacker_stops_before_any_attack(tmp_path, attacker):
    """The target itself, or a client the run does not have: one UserError naming the
    option, before the (slow) attacks run — no checkpoint exists, so reaching them would
    fail differently."""
    from dpfl.attacks.command import attack_run
    from dpfl.errors import UserError

    _digits_run(tmp_path, 2)
    with pytest.raises(UserError, match="--csmia-attacker"):
        attack_run(tmp_path, client=0, csmia_attacker=attacker, max_members=50,
                   population=200, log=lambda m: None)
