"""The run-side halves of `dpfl audit` and `dpfl attack`: canary clients, the server's
canary scores and recorded updates, and the scoring of an audit run directory."""

import json
import math

import pytest
import torch

from dpfl.attacks.audit import audit_overrides, canary_statistics, score_audit_run
from dpfl.client.canary import canary_norm, canary_update, is_canary
from dpfl.config import ConfigError
from dpfl.errors import UserError
from dpfl.methods import run_config
from dpfl.privacy.audit.canaries import canary_bits, canary_direction
from dpfl.server.observer import AUDIT_FILE, UpdateObserver, recorded_update_path
from dpfl.server.validation import ClientUpdate


def _cfg(**kw):
    base = dict(strategy="dpfedavg", trainer="update-dp", audit_canaries=6, audit_seed=1234)
    return run_config(**{**base, **kw})


@pytest.mark.parametrize("fields,key", [
    (dict(audit_canaries=-1), "audit-canaries"),
    (dict(audit_canary_norm=-0.5), "audit-canary-norm"),
    (dict(record_updates=-2), "record-updates"),
])
def test_bad_measurement_keys_stop_at_start(fields, key):
    with pytest.raises(ConfigError, match=key):
        _cfg(**fields)


def test_canary_client_releases_its_canary_only_when_its_bit_is_set():
    cfg = _cfg(clip_norm=0.7)
    bits = canary_bits(cfg.audit_seed, cfg.audit_canaries)
    assert 0 < int(bits[:6].sum()) < 6     # this seed has both kinds of canary client
    update = torch.randn(500)
    for pid in range(8):
        out = canary_update(cfg, pid, update.clone())
        if pid < 6 and bool(bits[pid]):
            assert is_canary(cfg, pid)
            expected = 0.7 * canary_direction(cfg.audit_seed, pid, 500)
            torch.testing.assert_close(out, expected)
            assert math.isclose(float(out.norm()), 0.7, rel_tol=1e-5)
        else:
            assert torch.equal(out, update)
    assert canary_norm(_cfg(audit_canary_norm=3.0)) == 3.0
    assert canary_norm(_cfg(clip_norm=0.25)) == 0.25


def _update(pid, flat):
    return ClientUpdate(node_id=100 + pid, partition_id=pid, flat=flat, num_examples=1,
                        metrics={})


def test_observer_scores_canary_replies_and_keeps_target_updates(tmp_path):
    cfg = _cfg(record_updates=2)
    obs = UpdateObserver(cfg, tmp_path)
    flats = {pid: torch.randn(300) for pid in (0, 1, 5, 7)}
    g = torch.randn(300)
    obs.observe(3, [_update(p, f) for p, f in flats.items()], g)
    lines = [json.loads(l) for l in (tmp_path / AUDIT_FILE).read_text().splitlines()]
    assert [l["client"] for l in lines] == [0, 1, 5]          # 7 is not a canary
    for line in lines:
        u = canary_direction(cfg.audit_seed, line["client"], 300)
        assert line["round"] == 3
        assert math.isclose(line["score"], float(flats[line["client"]].double()
                                                 @ u.double()), rel_tol=1e-9)
    for pid in (0, 1):
        rec = torch.load(recorded_update_path(tmp_path, pid))
        assert rec["round"] == 3 and torch.equal(rec["update"], flats[pid])
        assert torch.equal(rec["global"], g)
    assert not recorded_update_path(tmp_path, 5).exists()


def _audit_run_dir(tmp_path, cfg, scores_by_client, eps, name="run"):
    run = tmp_path / name
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**cfg.to_dict(), "num-clients": 40}))
    (run / "summary.json").write_text(json.dumps({
        "rounds-run": 2, "final": {"accuracy": 0.5},
        "clients": {f"client-{c}": {"epsilon": eps} for c in range(40)}}))
    with open(run / AUDIT_FILE, "w") as f:
        for c, scores in scores_by_client.items():
            for r, s in enumerate(scores, 1):
                f.write(json.dumps({"round": r, "client": c, "score": s, "norm": 1.0}) + "\n")
    return run


def test_audit_scoring_sums_rounds_and_flags_a_bound_above_the_ledger(tmp_path):
    cfg = _cfg(audit_canaries=40)
    bits = canary_bits(cfg.audit_seed, 40)
    # perfectly separable sums over two rounds; client 3 never took part (left out)
    scores = {c: [0.5 * float(bits[c]), 0.5 * float(bits[c]) + 0.001 * c]
              for c in range(40) if c != 3}
    run = _audit_run_dir(tmp_path, cfg, scores, eps=1e-3)
    assert canary_statistics(run)[2] == pytest.approx(bits[2].item() + 0.002)
    report = score_audit_run(run)
    assert report["canaries-seen"] == 39
    # sums separate perfectly: every guess of the reported abstention level is right
    # unless it guesses more "included" than there are (no abstention)
    assert report["guesses"] - 1 <= report["correct"] <= report["guesses"]
    assert report["epsilon-lower-bound"] > 0.5
    assert report["verdict"] == "formal"
    assert report["bound-exceeds-accounted"]          # 1e-3 accounted: the check fires
    generous = _audit_run_dir(tmp_path, cfg, scores, eps=50.0, name="generous")
    assert not score_audit_run(generous)["bound-exceeds-accounted"]


def test_damaged_canary_line_is_a_one_line_error(tmp_path):
    (tmp_path / AUDIT_FILE).write_text('{"round": 1, "client": 0, "score": 1.0}\nnot json\n')
    with pytest.raises(UserError, match="line 2"):
        canary_statistics(tmp_path)


def test_audit_run_copies_the_training_config_and_adds_canaries(tmp_path):
    cfg = run_config(strategy="dpfedavg", trainer="update-dp", num_rounds=3,
                     run_name="orig", record_updates=1)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "num-clients": 5}))
    overrides, n = audit_overrides(tmp_path, None, 77)
    assert n == 5 and overrides["audit-canaries"] == 5 and overrides["audit-seed"] == 77
    assert overrides["num-rounds"] == 3 and overrides["run-name"] == "audit-run"
    assert "record-updates" not in overrides and "output-dir" not in overrides
    assert audit_overrides(tmp_path, 2, None)[0]["audit-canaries"] == 2
    with pytest.raises(UserError, match="--canaries"):
        audit_overrides(tmp_path, 9, None)


def test_canary_examples_join_their_hosts_data_when_their_bit_is_set():
    from dpfl.client.canary import canary_examples, with_canary_examples
    from dpfl.data import ClientData

    cfg = run_config(strategy="dpfedavg", trainer="dpsgd", audit_canaries=9, audit_seed=3)
    bits = canary_bits(3, 9)
    x, y = canary_examples(cfg, (1, 8, 8), 10)
    assert x.shape == (9, 1, 8, 8) and int(y.min()) >= 0 and int(y.max()) < 10
    base = ClientData(torch.zeros(5, 1, 8, 8), torch.zeros(5, dtype=torch.long),
                      torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long), 10)
    total = 0
    for pid in range(4):   # canary i lives on client i mod 4
        got = with_canary_examples(cfg, pid, 4, base)
        mine = [i for i in range(9) if i % 4 == pid and bool(bits[i])]
        assert len(got.y_train) == 5 + len(mine)
        torch.testing.assert_close(got.x_train[5:], x[mine])
        assert torch.equal(got.y_train[5:], y[mine])
        total += len(mine)
    assert total == int(bits.sum())
    # client-level runs: no canary examples, and update-dp canaries are not examples
    assert with_canary_examples(_cfg(), 0, 4, base) is base
    assert not is_canary(cfg, 0)


def test_dpsgd_samples_at_the_public_rate_whatever_the_canaries_add():
    from dpfl.client.trainers import train_dpsgd
    from dpfl.data import ClientData
    from dpfl.models import build_model
    from dpfl.privacy.plan import dpsgd_sample_rate, planned_dpsgd_steps

    cfg = run_config(strategy="dpfedavg", trainer="dpsgd", batch_size=16, lr=0.1,
                     noise_multiplier=1.0)
    g = torch.Generator().manual_seed(0)
    data = ClientData(torch.randn(70, 1, 8, 8, generator=g), torch.randint(0, 10, (70,), generator=g),
                      torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long), 10)
    model = build_model("mlp", (1, 8, 8), 10)
    result = train_dpsgd(model, data, cfg, 1.0, torch.Generator().manual_seed(1),
                         torch.Generator().manual_seed(2), torch.device("cpu"),
                         public_examples=40)
    assert result.sample_rate == pytest.approx(dpsgd_sample_rate(40, 16))   # 1/3, not 1/5
    assert result.steps == planned_dpsgd_steps(40, cfg)


def test_sparse_canaries_and_the_support_overlap_statistic(tmp_path):
    from dpfl.privacy.audit.canaries import support_overlap

    dense = canary_direction(5, 2, 1000)
    assert torch.equal(canary_direction(5, 2, 1000, 0), dense)   # the default is unchanged
    sparse = canary_direction(5, 2, 1000, 30)
    assert int((sparse != 0).sum()) == 30
    assert math.isclose(float(sparse.norm()), 1.0, rel_tol=1e-5)
    update = torch.zeros(1000)
    update[sparse != 0] = 1.0
    update[(sparse != 0).nonzero().flatten()[:6]] = 0.0
    assert support_overlap(update, sparse) == pytest.approx(24 / 30)   # worked by hand
    # the observer records the overlap; the auditor tries both statistics
    cfg = _cfg(audit_canaries=40, audit_canary_support=30)
    obs = UpdateObserver(cfg, tmp_path)
    bits = canary_bits(cfg.audit_seed, 40)
    for c in range(40):   # included canaries: their own support; the others: a random one
        u = canary_direction(cfg.audit_seed, c, 1000, 30) if bits[c] else \
            canary_direction(99, c, 1000, 30)
        # (included ones with the sign flipped: the dot product points the wrong way)
        obs.observe(1, [_update(c, u * (-1.0 if bits[c] else 1.0))], torch.zeros(1000))
    lines = [json.loads(l) for l in (tmp_path / AUDIT_FILE).read_text().splitlines()]
    assert all(("overlap" in l) and (l["overlap"] == 1.0) == bool(bits[l["client"]])
               for l in lines)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "num-clients": 40}))
    (tmp_path / "summary.json").write_text(json.dumps(
        {"clients": {f"client-{c}": {"epsilon": 100.0} for c in range(40)}}))
    report = score_audit_run(tmp_path)
    assert report["statistic"] == "support-overlap" and report["epsilon-lower-bound"] > 0.5
    assert set(report["by-statistic"]) == {"dot", "support-overlap"}


@pytest.mark.parametrize("command", ["attack", "audit"])
def test_bad_run_directory_is_a_one_line_error(tmp_path, capsys, command):
    from dpfl.cli import main

    assert main([command, str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert main([command, str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{broken")
    assert main([command, str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "config.json" in err and "damaged" in err and "\n" not in err
