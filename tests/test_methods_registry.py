"""The registry is the only list of methods, and every entry is complete: citation,
trainers, its own keys (declared in pyproject.toml, owned by no other method, validated),
its presets folder, a buildable strategy and a guarantee."""

import re
import tomllib
from pathlib import Path

import pytest

from dpfl.config import GLOBAL_KEYS, TRAINERS, ConfigError
from dpfl.methods import METHODS, build_strategy, guarantee, parse_run_config, run_config

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_is_complete(name):
    method = METHODS[name]
    assert method.name == name
    assert re.search(r"(19|20)\d\d|arXiv \d{4}\.\d{4,5}|SBRC", method.citation), method.citation
    assert "seed 0" not in method.citation
    assert method.trainers and set(method.trainers) <= set(TRAINERS)
    if method.presets is not None:
        assert list((ROOT / "conf" / method.presets).glob("*.toml")), method.presets
    trainer = method.trainers[0]
    # FedCompDP's default CRA scores on the server's own validation split: it needs one
    cfg = run_config(strategy=name, trainer=trainer,
                     **({"server_holdout": 100} if name == "fedcompdp" else {}),
                     **({"trust": method.trusts[0]} if "local" not in method.trusts else {}))
    assert build_strategy(cfg).cfg.strategy == name
    assert guarantee(cfg).verdict.startswith(("formal", "none: "))
    if method.params is not None:
        assert type(cfg.params) is method.params
        assert set(method.params.keys()) <= set(PYPROJECT), "declare the keys in pyproject"
        assert cfg.to_dict().keys() >= set(method.params.keys())


def test_the_light_name_lists_are_the_registries():
    """config.method_names() (the modules of dpfl/methods/) and MODEL_NAMES let the CLI
    refuse a misspelled strategy or model before torch is imported: they must be exactly the
    registries' names, and every method module must be named as its method."""
    import importlib

    from dpfl.config import MODEL_NAMES, method_names
    from dpfl.models import MODELS

    assert method_names() == tuple(sorted(METHODS))
    for name in method_names():
        assert importlib.import_module(f"dpfl.methods.{name}").METHOD.name == name
    assert MODEL_NAMES == tuple(MODELS)


def test_method_keys_are_owned_by_one_method_and_never_global():
    owners: dict[str, str] = {}
    for name, method in METHODS.items():
        for key in (method.params.keys() if method.params else ()):
            assert key not in GLOBAL_KEYS, key
            assert owners.setdefault(key, name) == name, f"{key}: {owners[key]} and {name}"
    assert set(PYPROJECT) == set(GLOBAL_KEYS) | set(owners), "pyproject keys = global + method"


def test_a_bad_method_key_stops_the_run_whichever_method_runs():
    with pytest.raises(ConfigError, match="'aadp-rho'"):
        parse_run_config({**PYPROJECT, "strategy": "dpfedavg", "aadp-rho": 2.0})
    with pytest.raises(ConfigError, match="unknown run-config key 'gcfl-referenses'"):
        parse_run_config({**PYPROJECT, "gcfl-referenses": 2})
    cfg = parse_run_config({**PYPROJECT, "strategy": "gcfl", "gcfl-references": 3})
    assert cfg.params.gcfl_references == 3
