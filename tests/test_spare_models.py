"""A host keeps a finished client's model for its next client (dpfl.apps.client_handlers):
only where nothing of the training can stay in it, and a kept model trains to the same
reply as a new one, bit for bit."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from dpfl.apps import client_handlers
from dpfl.apps.client import train
from dpfl.models import build_model

from flower_helpers import context, message

DIGITS = {"dataset": "digits", "batch-size": 16, "num-rounds": 2, "lr": 0.1,
          "reproducible": True, "seed": 3}


def _spares() -> int:
    return sum(len(models) for models in client_handlers._spare_models.values())


def _round(run_config: dict, pid: int, arrays: ArrayRecord):
    msg = message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})}))
    return train(msg, context(run_config, pid, 3))


def _arrays(reply) -> dict[str, torch.Tensor]:
    return reply.content["arrays"].to_torch_state_dict()


@pytest.mark.parametrize("model,overrides", [
    ("mlp", {"strategy": "fedavg", "trainer": "plain"}),
    ("mnist-cnn", {"strategy": "fedavg", "trainer": "plain"}),
    ("mlp", {"trainer": "update-dp", "trust": "central"}),
    ("mnist-cnn", {"trainer": "update-dp", "trust": "local", "noise-multiplier": 1.0,
                   "target-epsilon": 50.0}),
])
def test_a_kept_model_trains_to_the_same_reply_as_a_new_one(model, overrides):
    run_config = {**DIGITS, "model": model, **overrides}
    shape = (1, 28, 28) if model == "mnist-cnn" else (1, 8, 8)
    if model == "mnist-cnn":
        run_config["dataset"] = "mnist"
        run_config["train-subset"] = 600
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model(model, shape, 10).state_dict())
    client_handlers._spare_models.clear()
    _round(run_config, 0, arrays)            # client 0's model is kept, trained
    assert _spares() == 1
    kept = _arrays(_round(run_config, 1, arrays))
    assert _spares() == 1                    # taken, then kept again
    client_handlers._spare_models.clear()
    fresh = _arrays(_round(run_config, 1, arrays))
    assert kept.keys() == fresh.keys()
    assert all(torch.equal(kept[k], fresh[k]) for k in kept)


@pytest.mark.parametrize("overrides", [
    {"trainer": "dpsgd", "target-epsilon": 50.0},            # Opacus hooks the model
    {"strategy": "dpfedprox", "trainer": "update-dp", "trust": "central"},   # a step hook
])
def test_a_model_whose_training_can_stay_in_it_is_not_kept(overrides):
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    client_handlers._spare_models.clear()
    reply = _round({**DIGITS, "model": "mlp", **overrides}, 0, arrays)
    assert "arrays" in reply.content
    assert _spares() == 0
