"""A run folder's tensor files are data only: a planted pickle never runs (issue 46.9).

The planted ``checkpoint.pt`` (and recorded update / global model) is a real pickle whose
``__reduce__`` creates a marker file when unpickled; before this fix ``resume=true`` and
``dpfl attack RUN`` loaded it with ``weights_only=False`` and ran it."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dpfl.cli import main
from dpfl.config import RunConfig
from dpfl.errors import UserError
from dpfl.server.rundir import RunDir
from dpfl.tensorfile import UnsafeTensorFile, load_tensors, plain, save_tensors


class _Planted:
    """Unpickling this creates ``path`` (what an attacker's payload would do)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.mknod, (self.path,))


def _plant(target: Path, marker: Path, **content) -> None:
    torch.save({"round": 3, "model": {}, "ledger": {}, **content, "x": _Planted(marker)},
               target)


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "MARKER"
    _plant(tmp_path / "checkpoint.pt", marker)
    with pytest.raises(UnsafeTensorFile, match="checkpoint.pt: holds objects other than "
                                               r"tensors.*\(posix.mknod\).*never loaded"):
        load_tensors(tmp_path / "checkpoint.pt")
    assert not marker.exists()
    # the control: torch's default unpickler would have run it
    torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert marker.exists()


def test_what_dpfl_checkpoints_loads_back_as_data():
    """Every kind of value a strategy's state holds (sampling RNG state, numpy numbers and
    arrays from metrics, tensors, nested dicts with int keys, None) survives the round
    trip, numpy values as Python numbers and tensors."""
    rng = random.Random(7)
    state = {"round": 2, "model": {"w": torch.randn(3, 2)},
             "strategy": {"rng": rng.getstate(), "f1": {3: np.float64(0.25)},
                          "moments": np.arange(4.0), "count": np.int64(5), "cd": None,
                          "clips": [np.float32(0.5), 1.0]}}
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"dpfl-tensorfile-{os.getpid()}.pt"
    try:
        save_tensors(state, path)
        back = load_tensors(path)
    finally:
        path.unlink(missing_ok=True)
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    restored = random.Random()
    restored.setstate(back["strategy"]["rng"])
    assert restored.random() == rng.random()
    assert back["strategy"]["f1"] == {3: 0.25} and type(back["strategy"]["f1"][3]) is float
    assert torch.equal(back["strategy"]["moments"], torch.arange(4.0, dtype=torch.float64))
    assert back["strategy"]["count"] == 5 and back["strategy"]["clips"] == [0.5, 1.0]
    with pytest.raises(TypeError, match="not checkpointable"):
        plain({"bad": object()})


def test_resume_refuses_a_planted_checkpoint(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    marker = tmp_path / "MARKER"
    _plant(run / "checkpoint.pt", marker)
    state, why = RunDir(run).load_checkpoint()
    assert state is None and "checkpoint.pt: holds objects other than tensors" in why
    assert not marker.exists()


def _finished_run(run: Path) -> None:
    run.mkdir()
    cfg = RunConfig(dataset="digits", model="mlp", trainer="update-dp")
    (run / "config.json").write_text(json.dumps({**cfg.to_dict(), "num-clients": 2}))


def test_attack_refuses_a_planted_checkpoint_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    _finished_run(run)
    marker = tmp_path / "MARKER"
    _plant(run / "checkpoint.pt", marker)
    assert main(["attack", str(run), "--reference-models", "1", "--shadow-epochs", "1",
                 "--max-members", "20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint.pt" in err[0] and "never loaded as code" in err[0]
    assert not marker.exists()


def test_a_planted_recorded_update_is_refused(tmp_path):
    """``record-updates``' files are read by the attack too."""
    from dpfl.attacks.target import target_models
    from dpfl.data import load_dataset
    from dpfl.server.observer import recorded_update_path

    run = tmp_path / "run"
    _finished_run(run)
    cfg = RunConfig(dataset="digits", model="mlp", trainer="update-dp", record_updates=1)
    ds = load_dataset("digits", cfg.data_dir, False)
    from dpfl.methods import method_for

    model = method_for(cfg).build_model(cfg, tuple(ds.input_shape), ds.num_classes)
    save_tensors({"round": 1, "model": model.state_dict(), "strategy": {}, "ledger": {}},
                 run / "checkpoint.pt")
    marker = tmp_path / "MARKER"
    path = recorded_update_path(run, 0)
    path.parent.mkdir()
    _plant(path, marker)
    with pytest.raises(UserError, match="holds objects other than tensors"):
        target_models(run, cfg, 0, tuple(ds.input_shape), ds.num_classes)
    assert not marker.exists()
