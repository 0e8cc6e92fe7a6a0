"""Run-config: bad values stop the run at start with a message naming the key."""

import tomllib
from pathlib import Path

import pytest

from dpfl.config import ConfigError, RunConfig, validate
from dpfl.methods import parse_run_config

DEFAULTS = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text()
                         )["tool"]["flwr"]["app"]["config"]


def test_demo_defaults_parse():
    cfg = parse_run_config(DEFAULTS)
    assert cfg.dataset == "mnist" and cfg.trainer == "dpsgd" and cfg.target_epsilon == 4.0


@pytest.mark.parametrize("preset", sorted((Path(__file__).parent.parent / "conf").rglob("*.toml")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_preset_parses(preset):
    """Each conf/<paper>/*.toml is a valid run-config on its own (method keys included)."""
    parse_run_config(tomllib.loads(preset.read_text()))


def test_the_fedcompdp_presets_leave_strategy_to_the_reproduction():
    root = Path(__file__).parent.parent / "conf" / "fedcompdp"
    for name, partitioning in (("cifar10", "dirichlet"), ("svhn", "class-grouped")):
        raw = tomllib.loads((root / f"{name}.toml").read_text())
        assert "strategy" not in raw and raw["partitioning"] == partitioning
        assert raw["dataset"] == name and raw["data-dir"] == "data"


@pytest.mark.parametrize("key,value,fragment", [
    ("target-epsilon", 0.0, "'target-epsilon'"),
    ("target-epsilon", -1.0, "'target-epsilon'"),
    ("delta", 1.0, "'delta'"),
    ("delta", 0.0, "'delta'"),
    ("dataset", "imagenet", "'dataset'"),
    ("strategy", "nope", "'strategy'"),
    ("num-rounds", 0, "'num-rounds'"),
    ("evaluate-every", -1, "'evaluate-every'"),
    ("num-rounds", 2.5, "'num-rounds'"),
    ("batch-size", "big", "'batch-size'"),
    ("lr", -0.1, "'lr'"),
    ("fraction-train", 0.0, "'fraction-train'"),
    ("partitioning", "random", "'partitioning'"),
    ("model", "vgg", "'model'"),
    ("trainer", "plain", "'trainer'"),
    ("no-such-key", 1, "unknown run-config key 'no-such-key'"),
])
def test_bad_values_name_the_key(key, value, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("'", "'")):
        parse_run_config({**DEFAULTS, key: value})


def test_fedavg_requires_plain_trainer():
    with pytest.raises(ConfigError, match="'trainer'"):
        parse_run_config({**DEFAULTS, "strategy": "fedavg"})
    cfg = parse_run_config({**DEFAULTS, "strategy": "fedavg", "trainer": "plain"})
    assert not cfg.is_private


# -- the rules that guard privacy -----------------------------------------------------------

# The trainers each strategy accepts: the non-private reference only without DP, DP methods
# never without it; DP-SCAFFOLD's control variates are post-processing of DP-SGD outputs
# only; cpSGD quantises and noises the whole update (over SecAgg+).
ACCEPTED_TRAINERS = {"fedavg": {"plain"}, "dpscaffold": {"dpsgd"}, "cpsgd": {"update-dp"}}
DP_TRAINERS = {"dpsgd", "update-dp"}
# keys a strategy needs under a trainer, added by _parse (DP-FedASGP over DP-SGD: the server's
# validation split, its proxy for the clients' losses; FedCompDP's default cra-score=server-val
# scores on it too)
NEEDED = {("fedasgp", "dpsgd"): {"server_holdout": 1000},
          ("fedcompdp", "dpsgd"): {"server_holdout": 1000},
          ("fedcompdp", "update-dp"): {"server_holdout": 1000},
          ("cpsgd", "update-dp"): {"trust": "distributed"}}


def _strategies():
    from dpfl.methods import METHODS

    return sorted(METHODS)


def _parse(**changes):
    changes = {**NEEDED.get((changes.get("strategy"), changes.get("trainer")), {}), **changes}
    return parse_run_config({**DEFAULTS, **{k.replace("_", "-"): v for k, v in changes.items()}})


@pytest.mark.parametrize("strategy", _strategies())
@pytest.mark.parametrize("trainer", ["plain", "dpsgd", "update-dp"])
def test_trainer_rules_per_strategy(strategy, trainer):
    allowed = ACCEPTED_TRAINERS.get(strategy, DP_TRAINERS)
    if trainer in allowed:
        cfg = _parse(strategy=strategy, trainer=trainer)
        assert cfg.is_private == (trainer != "plain")
    else:
        with pytest.raises(ConfigError, match="'(trainer|strategy)'"):
            _parse(strategy=strategy, trainer=trainer)


def test_fedasgp_over_dpsgd_parses_with_the_servers_split():
    raw = {**DEFAULTS, "strategy": "fedasgp", "trainer": "dpsgd"}
    cfg = parse_run_config({**raw, "server-holdout": 1000})
    assert (cfg.strategy, cfg.trainer, cfg.server_holdout) == ("fedasgp", "dpsgd", 1000)
    with pytest.raises(ConfigError, match="^run-config key 'server-holdout'"):
        parse_run_config(raw)


@pytest.mark.parametrize("strategy", [s for s in _strategies() if s != "fedavg"])
def test_every_dp_strategy_refuses_the_plain_trainer(strategy):
    with pytest.raises(ConfigError, match="run-config key '(trainer|strategy)'"):
        _parse(strategy=strategy, trainer="plain")


def test_dpscaffold_needs_dpsgd_and_aadp_takes_both_dp_trainers():
    with pytest.raises(ConfigError, match="'trainer'.*'dpscaffold' needs trainer 'dpsgd'"):
        _parse(strategy="dpscaffold", trainer="update-dp")
    assert _parse(strategy="dpscaffold", trainer="dpsgd").trainer == "dpsgd"
    assert _parse(strategy="aadp", trainer="dpsgd").trainer == "dpsgd"
    assert _parse(strategy="aadp", trainer="update-dp").trainer == "update-dp"
    # the paper's noise variance is a client-level update noise: refused under DP-SGD
    with pytest.raises(ConfigError, match="'aadp-noise'.*trainer=dpsgd"):
        _parse(strategy="aadp", trainer="dpsgd", aadp_noise="paper")
    assert _parse(strategy="aadp", trainer="update-dp", aadp_noise="paper").trainer


def test_fedavg_refuses_both_dp_trainers():
    for trainer in ("dpsgd", "update-dp"):
        with pytest.raises(ConfigError, match="'trainer'.*needs trainer 'plain'"):
            _parse(strategy="fedavg", trainer=trainer)


def _dp_pairs():
    return [(s, t) for s in _strategies() if s != "fedavg"
            for t in sorted(ACCEPTED_TRAINERS.get(s, DP_TRAINERS))]


@pytest.mark.parametrize("strategy,trainer", _dp_pairs())
def test_guarantee_verdict_of_dp_methods(strategy, trainer):
    """formal as configured by default; released-in-the-clear settings drop it to none."""
    from dpfl.methods import guarantee as guarantee_for

    base = guarantee_for(_parse(strategy=strategy, trainer=trainer))
    assert base.verdict == "formal" and base.formal
    assert base.unit == ("sample" if trainer == "dpsgd" else "client")
    loss = guarantee_for(_parse(strategy=strategy, trainer=trainer, report_train_loss=True))
    assert loss.verdict.startswith("none: ") and "train-loss" in loss.verdict
    assert not loss.formal
    for fraction in (0.5, 1.0):
        ev = guarantee_for(_parse(strategy=strategy, trainer=trainer, fraction_evaluate=fraction))
        assert ev.verdict.startswith("none: ") and "evaluation" in ev.verdict, ev.verdict
    both = guarantee_for(_parse(strategy=strategy, trainer=trainer, report_train_loss=True,
                                fraction_evaluate=0.5))
    assert both.verdict.startswith("none: ")
    assert "train-loss" in both.verdict and "evaluation" in both.verdict


def test_guarantee_verdict_of_the_plain_reference():
    from dpfl.methods import guarantee as guarantee_for

    for changes in ({}, {"report_train_loss": True}, {"fraction_evaluate": 0.5}):
        g = guarantee_for(_parse(strategy="fedavg", trainer="plain", **changes))
        assert g.verdict.startswith("none") and not g.formal, g.verdict


@pytest.mark.parametrize("rounds,every,period", [
    (3, 0, 1), (19, 0, 1), (20, 0, 1), (50, 0, 2), (200, 0, 10), (1000, 0, 50),
    (200, 1, 1), (200, 7, 7),
])
def test_central_evaluation_period_scales_with_the_run_unless_set(rounds, every, period):
    """evaluate-every=0 (the default): every (num-rounds // 20)-th round and the last, so
    20 to 40 central evaluations in a run of 40 rounds or more, every round below; a set
    value is kept."""
    cfg = validate(RunConfig(num_rounds=rounds, evaluate_every=every))
    assert cfg.evaluation_period == period
    evaluated = [r for r in range(1, rounds + 1)
                 if r % cfg.evaluation_period == 0 or r == rounds]   # apps/server.py's rule
    if every == 0:
        assert len(evaluated) == rounds if rounds < 40 else 20 <= len(evaluated) < 40
