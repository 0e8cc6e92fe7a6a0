"""Run-config: bad values stop the run at start with a message naming the key."""

import tomllib
from pathlib import Path

import pytest

from dpfl.config import ConfigError, parse_run_config

DEFAULTS = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text()
                         )["tool"]["flwr"]["app"]["config"]


def test_demo_defaults_parse():
    cfg = parse_run_config(DEFAULTS)
    assert cfg.dataset == "mnist" and cfg.trainer == "dpsgd" and cfg.target_epsilon == 4.0


@pytest.mark.parametrize("key,value,fragment", [
    ("target-epsilon", 0.0, "'target-epsilon'"),
    ("target-epsilon", -1.0, "'target-epsilon'"),
    ("delta", 1.0, "'delta'"),
    ("delta", 0.0, "'delta'"),
    ("dataset", "imagenet", "'dataset'"),
    ("strategy", "nope", "'strategy'"),
    ("num-rounds", 0, "'num-rounds'"),
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
