"""The SuperNode's durable privacy history (dpfl.client.node_history): a release the server
never saw (a reply sent just before a SuperLink restart) stays counted by the client, which
budgets and reports it; the file never shrinks and a damaged one is never read as empty."""

import json
import math

import pytest
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from dpfl.apps.client import train
from dpfl.client.node_history import (
    NodeHistoryError,
    adopt,
    history_path,
    load_events,
    missing_events,
    record,
)
from dpfl.config import RunConfig
from dpfl.data import client_data
from dpfl.models import build_model
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent

from flower_helpers import context, message

E1 = PrivacyEvent.dpsgd(1, 1.0, 0.1, 10)
E2 = PrivacyEvent.dpsgd(2, 1.0, 0.1, 10)


def test_path_needs_the_node_setting_and_names_run_and_partition(tmp_path, monkeypatch):
    monkeypatch.delenv("DPFL_PRIVACY_DIR", raising=False)
    assert history_path({}, "r", 7, 0) is None
    assert history_path({"privacy-dir": ""}, "r", 7, 0) is None
    cfg = {"privacy-dir": str(tmp_path)}
    assert history_path(cfg, "fed-a", 7, 3) == tmp_path / "fed-a-partition-3.json"
    assert history_path(cfg, "", 7, 3) == tmp_path / "flower-run-7-partition-3.json"
    assert history_path(cfg, "../x y", 7, 0).parent == tmp_path  # never outside the folder
    monkeypatch.setenv("DPFL_PRIVACY_DIR", str(tmp_path / "env"))
    assert history_path({}, "r", 7, 0) == tmp_path / "env" / "r-partition-0.json"
    assert history_path(cfg, "r", 7, 0).parent == tmp_path  # the node config wins


def test_union_counts_a_round_run_twice_as_two_releases(tmp_path):
    path = tmp_path / "h.json"
    record(PrivacyHistory([E1, E2, E2]), path)
    assert missing_events(PrivacyHistory([E1]), load_events(path)) == [E2, E2]
    fresh = PrivacyHistory([E1])
    assert adopt(fresh, path) == 2 and fresh.events == [E1, E2, E2]
    assert adopt(fresh, path) == 0


def test_the_file_never_shrinks(tmp_path):
    path = tmp_path / "h.json"
    record(PrivacyHistory([E1, E2]), path)
    record(PrivacyHistory([E1]), path)  # a history that lost round 2 cannot erase it
    assert load_events(path) == [E1, E2]


@pytest.mark.parametrize("text", ["{", '{"events": [{"round": 1}]}', '{"no": []}'])
def test_a_damaged_file_is_an_error_naming_it(tmp_path, text):
    path = tmp_path / "h.json"
    path.write_text(text)
    with pytest.raises(NodeHistoryError, match=str(path)):
        load_events(path)


RUN = {"dataset": "digits", "model": "mlp", "batch-size": 64, "num-rounds": 3,
       "target-epsilon": 2.0, "lr": 0.1, "accountant": "rdp", "run-name": "fed-a"}


def _node(tmp_path, run_id):
    ctx = context(RUN, 0, 2)
    ctx.run_id = run_id
    ctx.node_config["privacy-dir"] = str(tmp_path / "privacy")
    return ctx


def _round(ctx, arrays, rnd, extra=None):
    cfg = ConfigRecord({"server-round": rnd, **(extra or {})})
    return train(message(RecordDict({"arrays": arrays, "config": cfg})), ctx)


def test_a_release_lost_in_a_superlink_restart_stays_charged(tmp_path):
    """Run 1: rounds 1 and 2 train; round 2's reply is lost with the SuperLink. The resumed
    run (a new Flower run: fresh node state) gets round 1 back from the server's ledger and
    runs round 2 again: the client counts rounds 1, 2, 2 (an independent Opacus accountant
    over three rounds' steps), and refuses round 3, which would overspend."""
    cfg = RunConfig(**{k.replace("-", "_"): v for k, v in RUN.items()})
    n = len(client_data(cfg, 0, 2).y_train)
    batches = math.ceil(n / 64)
    q = 1.0 / batches
    sigma = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=q,
                                 steps=3 * batches, accountant="rdp", epsilon_tolerance=0.01)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    before = _node(tmp_path, run_id=1)
    first = _round(before, arrays, 1)
    _round(before, arrays, 2)  # released, then lost with the SuperLink
    # the resumed run: the server's ledger holds round 1 only (ledger-* keys)
    prior = {"ledger-client": [0], **{f"ledger-{k}": list(v) for k, v in
                                      PrivacyHistory([_event(first, 1)]).to_record().items()
                                      if k != "adaptive"}}
    after = _node(tmp_path, run_id=2)
    reply = _round(after, arrays, 2, prior)
    acc = RDPAccountant()
    acc.history = [(sigma, q, 3 * batches)]
    assert reply.content["metrics"]["noise-multiplier"] == pytest.approx(sigma, rel=1e-9)
    assert reply.content["metrics"]["epsilon"] == pytest.approx(acc.get_epsilon(1e-5),
                                                                rel=1e-9)
    events = json.loads((tmp_path / "privacy" / "fed-a-partition-0.json").read_text())["events"]
    assert [e["round"] for e in events] == [1, 2, 2]
    refused = _round(after, arrays, 3, prior)
    assert refused.content["status"]["status"] == "refused"
    # without the node's file the same resumed client would have counted two rounds only
    (tmp_path / "privacy" / "fed-a-partition-0.json").write_text("{")
    damaged = _round(_node(tmp_path, run_id=3), arrays, 2, prior)
    assert damaged.content["status"]["status"] == "refused"
    assert "fed-a-partition-0.json" in damaged.content["status"]["reason"]


def _event(reply, rnd):
    m = reply.content["metrics"]
    return PrivacyEvent.dpsgd(rnd, m["noise-multiplier"], m["sample-rate"], int(m["steps"]))
