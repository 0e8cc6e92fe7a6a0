"""The GCFL probes in dpfl.experiments.probes: argument parsing, and that each imports."""

import importlib

import pytest

from dpfl.config import RunConfig
from dpfl.experiments.probes import config_from, parse_args


def test_probe_arguments_become_typed_run_config_fields():
    base = RunConfig(dataset="mnist", batch_size=32, target_epsilon=2.0, lr=0.03)
    kw = parse_args(["target-epsilon=3", "lr=0.05", "partitioning=gcfl-contiguous", "seed=1"])
    assert kw == {"target-epsilon": "3", "lr": "0.05", "partitioning": "gcfl-contiguous",
                  "seed": "1"}
    cfg = config_from(base, kw)
    assert (cfg.target_epsilon, cfg.lr, cfg.partitioning, cfg.seed) == (3.0, 0.05,
                                                                         "gcfl-contiguous", 1)
    assert isinstance(cfg.seed, int) and cfg.batch_size == 32  # the rest stays the base's
    with pytest.raises(AttributeError):
        config_from(base, {"no-such-key": "1"})


@pytest.mark.parametrize("name", ["gcfl_cosine", "gcfl_lr_sweep", "gcfl_per_step"])
def test_probe_imports_without_running(name, capsys):
    # the probes import dpfl.methods.gcfl and dpfl.models.evaluation (the strategies' and the
    # evaluation helper's homes after the "one method, one module" refactor)
    pytest.importorskip("dpfl.methods.gcfl")
    pytest.importorskip("dpfl.models.evaluation")
    module = importlib.import_module(f"dpfl.experiments.probes.{name}")
    assert callable(module.main) and module.BASE.dataset == "mnist"
    assert capsys.readouterr().out == ""  # importing trains nothing
