"""DP-FedSAM (Shi, Liu, Wei, Shen, Wang & Tao, "Make Landscape Flatter in Differentially
Private Federated Learning", CVPR 2023): the SAM step by hand, its edge cases, the
registry entry and one real ClientApp train call whose update is checked against SAM."""

import math
import tomllib
from functools import partial
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from dpfl.apps.client import train
from dpfl.client.trainers import sgd_step, train_dpsgd, train_plain
from dpfl.config import ConfigError, RunConfig
from dpfl.data import client_data
from dpfl.methods import (
    METHODS,
    build_strategy,
    guarantee,
    parse_run_config,
    run_config,
)
from dpfl.methods.dpfedsam import DPFedSAMParams, NoisyGradientSAM, sam_step
from dpfl.models import build_model
from dpfl.models.evaluation import device_for
from dpfl.privacy.mechanisms.randomness import public_seed
from dpfl.privacy.mechanisms.release import l2_clip
from dpfl.server.strategy import DPFLStrategy
from dpfl.tensors import flatten, state_difference

from flower_helpers import context, message

PYPROJECT = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text()
                          )["tool"]["flwr"]["app"]["config"]


class Two(nn.Module):
    """out = (a, 2 b) for x = (1, 2); ``c`` is never used (its gradient stays None)."""

    def __init__(self, a: float, b: float) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor([a]))
        self.b = nn.Parameter(torch.tensor([b]))
        self.c = nn.Parameter(torch.tensor([7.0]))
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        return torch.cat([self.a, self.b]) * x


X, ZERO = torch.tensor([1.0, 2.0]), torch.zeros(2)


def half_sq(out, y):
    """L = 0.5 ||out - y||^2; with y = 0: L = 0.5 (a^2 + 4 b^2), grad = (a, 4 b)."""
    return 0.5 * ((out - y) ** 2).sum()


def _values(model: Two) -> list[float]:
    return [float(p.detach()) for p in (model.a, model.b, model.c)]


def test_sam_step_by_hand_one_parameter():
    """L(w) = (w x - 0)^2 with x = 1, w = 3: g = 6, e = rho g/|g| = 0.5, g_SAM = 2 (3.5)
    = 7, lr 0.1: w = 3 - 0.7 = 2.3 (plain SGD would give 2.4)."""
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(3.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = sam_step(model, opt, nn.MSELoss(), torch.ones(1, 1), torch.zeros(1, 1), rho=0.5)
    assert float(loss) == pytest.approx(9.0, abs=1e-6)          # the loss at w, not w + e
    assert float(model.weight.detach()) == pytest.approx(2.3, abs=1e-6)


def test_sam_step_by_hand_two_tensors_global_norm():
    """a = 3, b = 1: g = (3, 4), ||g|| = 5 over both tensors, rho 0.5: e = (0.3, 0.4),
    w + e = (3.3, 1.4), g_SAM = (3.3, 5.6); lr 0.1: (a, b) = (2.67, 0.44). (Per-tensor
    norms would give e = (0.5, 0.5) -> (2.65, 0.4); plain SGD (2.7, 0.6).) The unused c
    (grad None) is neither perturbed nor stepped; the momentum buffer holds g_SAM."""
    model = Two(3.0, 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = sam_step(model, opt, half_sq, X, ZERO, rho=0.5)
    assert float(loss) == pytest.approx(6.5, abs=1e-6)          # 0.5 (9 + 4)
    assert _values(model) == pytest.approx([2.67, 0.44, 7.0], abs=1e-6)
    assert model.c.grad is None and model.forwards == 2
    buffers = [float(opt.state[p]["momentum_buffer"]) for p in (model.a, model.b)]
    assert buffers == pytest.approx([3.3, 5.6], abs=1e-6)


def test_the_weights_are_restored_exactly_before_the_step():
    """lr 0: the step moves nothing, so sam_step must leave w bit-identical (restored from
    a copy, not w + e - e); with lr > 0 the result is the hand value from w, not from
    w + e (which would give a = 3.3 - 0.33 = 2.97)."""
    model = Two(3.0, 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    sam_step(model, torch.optim.SGD(model.parameters(), lr=0.0), half_sq, X, ZERO, rho=0.5)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    model = Two(3.0, 1.0)
    sam_step(model, torch.optim.SGD(model.parameters(), lr=0.1), half_sq, X, ZERO, rho=0.5)
    assert float(model.a.detach()) == pytest.approx(2.67, abs=1e-6)


def test_zero_gradient_is_exactly_the_plain_sgd_step():
    """A first plain step fills the momentum buffers; at a point where the batch gradient is
    0 (y = the model's output) SAM does not perturb (no 0/0) and its step is bit-identical
    to sgd_step's, which still moves by lr * momentum * buffer; one forward pass only."""
    models = [Two(3.0, 1.0), Two(3.0, 1.0)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for m, o in zip(models, opts):
        sgd_step(m, o, half_sq, X, ZERO)
    y = models[0](X).detach()
    moved_from = _values(models[0])
    forwards = models[0].forwards
    sam_step(models[0], opts[0], half_sq, X, y, rho=0.5)
    sgd_step(models[1], opts[1], half_sq, X, y)
    assert models[0].forwards == forwards + 1
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters()))
    assert _values(models[0]) != moved_from
    assert all(math.isfinite(v) for v in _values(models[0]))


# -- the registry entry ----------------------------------------------------------------------

def test_registry_parses_checks_and_states_a_formal_guarantee():
    cfg = run_config(strategy="dpfedsam", trainer="update-dp", sam_rho=0.1)
    assert type(cfg.params) is DPFedSAMParams and cfg.params.sam_rho == 0.1
    assert run_config(strategy="dpfedsam", trainer="update-dp").params.sam_rho == 0.5
    assert PYPROJECT["sam-rho"] == DPFedSAMParams().sam_rho
    assert type(build_strategy(cfg)) is DPFLStrategy
    with pytest.raises(ConfigError, match="'trainer'.*'dpfedsam' needs trainer 'update-dp'"):
        run_config(strategy="dpfedsam", trainer="plain")
    dpsgd = guarantee(run_config(strategy="dpfedsam", trainer="dpsgd", sam_rho=0.05))
    assert dpsgd.verdict == "formal" and dpsgd.unit == "sample" and "DP-SAT" in dpsgd.scope
    # run_config's defaults: secret randomness, no train loss, no client evaluation
    assert (cfg.reproducible, cfg.report_train_loss, cfg.fraction_evaluate) == (False, False, 0)
    g = guarantee(cfg)
    assert g.verdict == "formal" and g.unit == "client" and "SAM (rho 0.1)" in g.scope
    assert guarantee(run_config(strategy="dpfedsam", trainer="update-dp",
                                reproducible=True)).verdict.startswith("none: ")


@pytest.mark.parametrize("rho", [0, 0.0, -0.1, float("nan"), float("inf"), "0.5"])
def test_a_bad_sam_rho_is_refused_whichever_method_runs(rho):
    with pytest.raises(ConfigError, match="'sam-rho'"):
        run_config(strategy="dpfedsam", trainer="update-dp", sam_rho=rho)
    with pytest.raises(ConfigError, match="'sam-rho'"):
        parse_run_config({**PYPROJECT, "strategy": "dpfedavg", "sam-rho": rho})


def test_the_client_half_hands_the_trainer_a_sam_step():
    cfg = run_config(strategy="dpfedsam", trainer="update-dp", sam_rho=0.2)
    hooks = METHODS["dpfedsam"].client.hooks(cfg, None, None, nn.Linear(1, 1))
    assert hooks.step.func is sam_step and hooks.step.keywords == {"rho": 0.2}
    assert hooks.pre_step is None and hooks.post_step is None


# -- through the real ClientApp train function -----------------------------------------------

RUN = {"strategy": "dpfedsam", "trainer": "update-dp", "dataset": "digits", "model": "mlp",
       "batch-size": 128, "num-rounds": 2, "lr": 0.1, "clip-norm": 0.5,
       "noise-multiplier": 2.0, "target-epsilon": 40.0, "reproducible": True,
       "accountant": "rdp"}


def _flat(arrays: ArrayRecord) -> torch.Tensor:
    return flatten(arrays.to_torch_state_dict())


def test_client_app_trains_with_sam_and_releases_one_gaussian_event():
    """One round of partition 0 at two radii with public (reproducible) randomness: both
    replies carry the same noise, so their difference is exactly clip(u_0.1) - clip(u_0.5),
    with u_rho the local update of train_plain with sam_step at that radius (recomputed
    here). The default SGD step gives another update: the app ran SAM at the run-config's
    rho."""
    torch.manual_seed(0)
    init = build_model("mlp", (1, 8, 8), 10).state_dict()
    replies = {}
    for rho in (0.1, 0.5):
        run = {**RUN, "sam-rho": rho}
        msg = message(RecordDict({"arrays": ArrayRecord(init),
                                  "config": ConfigRecord({"server-round": 1})}))
        reply = train(msg, context(run, 0, 2))
        privacy, metrics = reply.content["privacy"], reply.content["metrics"]
        assert list(reply.content["arrays"].keys()) == list(init.keys())
        assert privacy["mechanism"] == ["gaussian"] and privacy["relation"] == ["replace-one"]
        assert privacy["sigma"] == [2.0] and privacy["clip"] == 0.5
        assert metrics["num-examples"] == 1 and metrics["steps"] == 1   # one release
        replies[rho] = _flat(reply.content["arrays"])

    cfg = parse_run_config(RUN)
    data = client_data(cfg, 0, 2)

    def clipped_update(step) -> torch.Tensor:
        model = build_model("mlp", (1, 8, 8), 10)
        model.load_state_dict(init)
        train_plain(model, data, cfg, public_seed(cfg.seed, 0, 1), device_for(), step=step)
        return l2_clip(flatten(state_difference(model.state_dict(), init)), 0.5)

    sam = {rho: clipped_update(partial(sam_step, rho=rho)) for rho in (0.1, 0.5)}
    expected = sam[0.1] - sam[0.5]
    assert float(expected.norm()) > 1e-3
    assert torch.allclose(replies[0.1] - replies[0.5], expected, atol=1e-5)
    plain = clipped_update(None)
    # plain SGD vs SAM at rho 0.1 here: ||clip(u_plain) - clip(u_0.1)|| ~ 0.05
    assert float((replies[0.1] - replies[0.5] - (plain - sam[0.5])).norm()) > 1e-2


# -- the record-level variant: DP-SAT over DP-SGD --------------------------------------------

def test_dpsat_two_steps_by_hand():
    """sigma 0, q 1 (batch = n), a clip no gradient reaches, two steps at lr 0.5: step 1 is
    plain (no released gradient yet), step 2's gradient is taken at w1 + rho g1 / ||g1||
    (g1 = step 1's noised gradient, here the exact mean gradient) and applied from w1."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
    from dpfl.data import ClientData
    data = ClientData(x, y, torch.empty(0, 1, 8, 8), torch.empty(0, dtype=torch.long), 10)
    cfg = RunConfig(dataset="digits", model="mlp", batch_size=16, lr=0.5, local_epochs=2,
                    max_grad_norm=1e6, opacus_mode="bk")
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    ref = build_model("mlp", (1, 8, 8), 10)
    ref.load_state_dict(model.state_dict())

    def grads_at(weights: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            for p, w in zip(ref.parameters(), weights):
                p.copy_(w)
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        return [p.grad.detach().clone() for p in ref.parameters()]

    rho = 0.3
    w0 = [p.detach().clone() for p in ref.parameters()]
    g1 = grads_at(w0)
    w1 = [w - 0.5 * gi for w, gi in zip(w0, g1)]
    norm = float(torch.sqrt(sum((gi ** 2).sum() for gi in g1)))
    g2 = grads_at([w + rho * gi / norm for w, gi in zip(w1, g1)])
    w2 = [w - 0.5 * gi for w, gi in zip(w1, g2)]

    gen = torch.Generator().manual_seed(0)
    result = train_dpsgd(model, data, cfg, 0.0, gen, gen, torch.device("cpu"),
                         perturb=NoisyGradientSAM(rho))
    assert result.steps == 2
    for p, w in zip(model.parameters(), w2):
        assert torch.allclose(p.detach(), w, atol=1e-5)
    # and it differs from plain DP-SGD (the perturbation mattered)
    plain = build_model("mlp", (1, 8, 8), 10)
    with torch.no_grad():
        for p, w in zip(plain.parameters(), w0):
            p.copy_(w)
    train_dpsgd(plain, data, cfg, 0.0, gen, gen, torch.device("cpu"))
    assert max(float((p - q).detach().abs().max()) for p, q in
               zip(plain.parameters(), model.parameters())) > 1e-4


def test_client_app_under_dpsgd_releases_one_dpsgd_event():
    """Through the real ClientApp: trainer=dpsgd replies with one sample-level Poisson
    DP-SGD event at the planned sigma, the per-sample clip, and the public size."""
    run = {**RUN, "trainer": "dpsgd", "sam-rho": 0.05, "max-grad-norm": 1.0,
           "batch-size": 32}
    torch.manual_seed(0)
    init = build_model("mlp", (1, 8, 8), 10).state_dict()
    msg = message(RecordDict({"arrays": ArrayRecord(init),
                              "config": ConfigRecord({"server-round": 1})}))
    reply = train(msg, context(run, 0, 2))
    privacy, metrics = reply.content["privacy"], reply.content["metrics"]
    assert privacy["mechanism"] == ["dpsgd"] and privacy["relation"] == ["add-remove"]
    assert privacy["sigma"] == [2.0] and privacy["clip"] == 1.0
    n = len(client_data(parse_run_config(run), 0, 2).y_train)
    assert metrics["num-examples"] == n and metrics["steps"] == math.ceil(n / 32)
    assert float(_flat(reply.content["arrays"]).norm()) > 0
