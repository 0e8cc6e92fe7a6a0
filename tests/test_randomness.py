"""DP randomness is secret by default: the same run-config gives different noise; only
``reproducible=true`` (verdict none) gives bit-identical updates; the OS entropy behind the
noise shows up in no reply and no log line."""

import logging
import os

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

import dpfl.privacy.mechanisms.randomness as randomness
from dpfl.apps.client import train
from dpfl.config import RunConfig
from dpfl.methods import guarantee as guarantee_for
from dpfl.models import build_model

from flower_helpers import context, message

BASE = {"dataset": "digits", "model": "mlp", "batch-size": 64, "num-rounds": 2,
        "target-epsilon": 8.0, "lr": 0.1}
TRAINERS = [{"trainer": "dpsgd"}, {"trainer": "update-dp", "clip-norm": 0.5}]


def _update(run_config: dict) -> torch.Tensor:
    """One client's round-1 update from a fresh node (same message every time)."""
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    msg = message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})}))
    reply = train(msg, context(run_config, 0, 2))
    return torch.cat([torch.from_numpy(a.numpy()).reshape(-1)
                      for a in reply.content["arrays"].values()])


@pytest.mark.parametrize("extra", TRAINERS, ids=lambda e: e["trainer"])
def test_same_run_config_gives_different_noise_by_default(extra):
    a, b = _update({**BASE, **extra}), _update({**BASE, **extra})
    assert not torch.equal(a, b)
    # the difference is noise of the configured scale, not a rounding artefact
    assert float((a - b).abs().max()) > 1e-3


@pytest.mark.parametrize("extra", TRAINERS, ids=lambda e: e["trainer"])
def test_reproducible_mode_is_bit_identical(extra):
    cfg = {**BASE, **extra, "reproducible": True}
    assert torch.equal(_update(cfg), _update(cfg))


def test_verdict_switches_with_the_flag():
    secret = guarantee_for(RunConfig())
    public = guarantee_for(RunConfig(reproducible=True))
    assert secret.verdict == "formal"
    assert "not a CSPRNG" in secret.scope and "Mironov 2012" in secret.scope
    assert public.verdict == "none: DP noise seeded from public values (reproducible mode)"


def test_secret_generator_state_comes_from_os_entropy_and_hides_its_seed():
    g1, g2 = randomness.secret_generator(), randomness.secret_generator()
    assert g1.initial_seed() == 0 == g2.initial_seed()
    x1, x2 = torch.randn(10_000, generator=g1), torch.randn(10_000, generator=g2)
    assert not torch.equal(x1, x2)
    # still standard normal: mean 0, std 1 within 5 standard errors
    assert abs(float(x1.mean())) < 5 / 100 and abs(float(x1.std()) - 1) < 5 / 141
    # not the generator of any public seed the client could have used (round 0..9)
    for rnd in range(10):
        public = torch.Generator().manual_seed(randomness.public_seed(42, 0, rnd))
        assert not torch.equal(torch.randn(10_000, generator=public), x1)


def test_secret_entropy_appears_in_no_reply_and_no_log(monkeypatch, caplog):
    """Spy on the OS entropy the client draws (real bytes, recorded) and look for any 8-byte
    window of it in every record of the reply, in the node state and in the log."""
    drawn: list[bytes] = []
    real = os.urandom

    def spy(n: int) -> bytes:
        out = real(n)
        drawn.append(out)
        return out

    monkeypatch.setattr(randomness.os, "urandom", spy)
    caplog.set_level(logging.DEBUG)
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
    msg = message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})}))
    ctx = context({**BASE, "trainer": "update-dp"}, 0, 2)
    reply = train(msg, ctx)
    assert drawn, "the client drew no OS entropy"
    blobs = [caplog.text.encode()]
    for rd in (reply.content, ctx.state):
        for rec in rd.array_records.values():
            blobs += [a.data for a in rec.values()]
        for rec in list(rd.config_records.values()) + list(rd.metric_records.values()):
            blobs += [repr(dict(rec)).encode()]
    windows = {chunk[i:i + 8] for chunk in drawn for i in range(0, len(chunk) - 7, 4)}
    texts = {w.hex() for w in windows} | {str(int.from_bytes(w, "little")) for w in windows}
    for blob in blobs:
        assert not any(w in blob for w in windows)
        assert not any(t.encode() in blob for t in texts)


def test_the_randomness_scope_names_only_what_the_mechanism_draws():
    """Update-level DP samples nothing (every client's whole update, every round): its
    guarantee must not speak of Poisson sampling; DP-SGD's and the central server's do."""
    from dpfl.methods import guarantee, run_config

    def randomness_of(**kw):
        return guarantee(run_config(**kw)).scope.split("randomness: ")[1]

    assert randomness_of(trainer="update-dp").startswith("noise comes from a PRNG")
    assert "Poisson" not in guarantee(run_config(trainer="update-dp")).scope
    assert randomness_of(trainer="dpsgd").startswith("noise and Poisson sampling come from")
    assert randomness_of(trainer="update-dp", trust="central").startswith(
        "the server's noise and Poisson client sampling come from")
    assert randomness_of(trainer="update-dp", trust="distributed").startswith(
        "the clients' noise shares come from")
