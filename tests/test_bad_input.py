"""Bad input gets a clear error and loses nothing: one line naming the key, argument or file,
exit 2, before any process starts or any file is written (the red team's cases, issue 46).
No test here starts a federation: each input is refused at parse time or by the launcher's
checks before the SuperLink."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dpfl.config import ConfigError, parse_node_partitions

from cli_helpers import fails

ROOT = Path(__file__).resolve().parents[1]


def _listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# -- run-config values: refused by dpfl.config.validate / the method registry ---------------


@pytest.mark.parametrize("argv,named", [
    # tracebacks in the accountants (overflow) and in the summary of a diverged run
    (["noise-multiplier=1e300"], ["run-config key 'noise-multiplier'", "[0, 1e+06]"]),
    (["server-lr=1e300"], ["run-config key 'server-lr'", "(0, 1000]"]),
    # refused by the ServerApp only
    (["seed=-1"], ["run-config key 'seed'", "[0, 4294967295]", "got -1"]),
    (["train-subset=1"], ["run-config key 'train-subset'", "0 (all) or >= 2", "got 1"]),
    (["trust=distributed", "secagg-scale=1e300"], ["run-config key 'secagg-scale'"]),
    (["trust=distributed", "trainer=update-dp", "secagg-scale=1e300"],
     ["run-config key 'secagg-scale'", "[1, 1073741823]"]),
    (["trust=distributed", "trainer=update-dp", "clip-norm=100", "secagg-scale=1e8"],
     ["run-config key 'secagg-scale'", "clip-norm x secagg-scale = 1e+10"]),
    # accepted before
    (["target-epsilon=1e-300"], ["run-config key 'target-epsilon'", "[0.001, 1e+15]"]),
    (["delta=1e-300"], ["run-config key 'delta'", "[1e-12, 0.1]"]),
    (["delta=0.5"], ["run-config key 'delta'", "[1e-12, 0.1]", "protects nobody"]),
    (["lr=1e300"], ["run-config key 'lr'", "(0, 1000]"]),
    (["round-timeout=0.001"], ["run-config key 'round-timeout'", "must be >= 1"]),
    (["max-update-norm=1e-300"], ["run-config key 'max-update-norm'",
                                  "0 (off) or in [1e-06, 1e+06]"]),
    (["local-epochs=1000000"], ["run-config key 'local-epochs'", "[1, 1000]"]),
    (['node-partitions="99999999999999999999999999:0"'],
     ["run-config key 'node-partitions'", "node id 99999999999999999999999999",
      "64-bit"]),
    (['node-partitions="٣:0"'], ["run-config key 'node-partitions'", "ASCII digits"]),
    (['node-partitions="1:٣"'], ["run-config key 'node-partitions'", "ASCII digits"]),
    (["audit-seed=-1"], ["run-config key 'audit-seed'"]),
])
def test_bad_run_config_values_are_one_line_before_anything(tmp_path, capsys, argv, named):
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), *argv], *named)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("key,value", [
    ("delta", 1e-12), ("delta", 0.1), ("target-epsilon", 1e-3), ("lr", 1e3),
    ("server-lr", 1e3), ("noise-multiplier", 1e6), ("round-timeout", 1.0),
    ("local-epochs", 1000), ("max-update-norm", 1e-6), ("seed", 2**32 - 1),
    ("train-subset", 2),
])
def test_the_documented_ends_of_each_range_are_accepted(key, value):
    from dpfl.methods import parse_run_config

    assert parse_run_config({key: value}).to_dict()[key] == value


def test_node_partitions_take_64_bit_node_ids_in_ascii_digits_only():
    assert parse_node_partitions(f"{2**64 - 1}:0,-5:1") == {2**64 - 1: 0, -5: 1}
    for bad in (f"{2**64}:0", f"-{2**63 + 1}:0", "٣:0", "1:٣", "１:0", "²:0"):
        with pytest.raises(ValueError):
            parse_node_partitions(bad)
    from dpfl.methods import parse_run_config

    with pytest.raises(ConfigError, match="^run-config key 'node-partitions': node id"):
        parse_run_config({"node-partitions": f"{2**64}:0"})


# -- sizes the launcher checks against the dataset before any process starts ----------------


@pytest.mark.parametrize("argv,named", [
    (["server-holdout=100000000"], ["run-config key 'server-holdout'", "at most 1429",
                                    "digits has 1437 training examples"]),
    (["train-subset=100000000"], ["run-config key 'train-subset'", "0 (all) or in [8, 1437]"]),
    (["server-holdout=1000", "train-subset=500"],
     ["run-config key 'train-subset'", "[8, 437]", "less server-holdout 1000"]),
    (["train-subset=6"], ["run-config key 'train-subset'", "[8, 1437]"]),
    (["--clients", "1000000"], ["--clients 1000000: digits has 1437 training examples",
                                "at most 718 clients"]),
    (["trainer=update-dp", "audit-canaries=5"], ["run-config key 'audit-canaries'",
                                                  "at most 4"]),
    (["audit-canaries=401"], ["run-config key 'audit-canaries'", "at most 400"]),
])
def test_sizes_beyond_the_dataset_are_refused_before_the_superlink(tmp_path, capsys, argv,
                                                                   named):
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), "dataset=digits", "model=mlp",
                    *argv], *named)
    assert not any(tmp_path.iterdir())


def test_the_default_dataset_bounds_clients_too(tmp_path, capsys):
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), "--clients", "1000000"],
           "--clients 1000000: mnist has 60000 training examples", "at most 30000 clients")
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), "train-subset=100000000"],
           "run-config key 'train-subset'", "[8, 60000]")
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), "server-holdout=100000000"],
           "run-config key 'server-holdout'", "at most 59992")
    assert not any(tmp_path.iterdir())


# -- output folders ------------------------------------------------------------------------


def test_a_symbolic_link_loop_as_output_dir(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    fails(capsys, ["simulate", "--output-dir", str(loop)],
           f"error: --output-dir {loop}: a symbolic link loop")
    fails(capsys, ["simulate", "--output-dir", str(out), f"output-dir={loop}"],
           f"error: run-config key 'output-dir' {loop}: a symbolic link loop")
    fails(capsys, ["simulate", "--output-dir", str(out), f"output-dir={loop / 'sub'}"],
           "error: run-config key 'output-dir' ", "a symbolic link loop")
    assert _listing(tmp_path) == ["loop", "out"]

    from dpfl.errors import writable_dir_problem

    assert writable_dir_problem(loop / "runs") == f"{loop} is a symbolic link loop"


def test_a_refused_launch_does_not_take_over_a_stale_lock(tmp_path):
    """A run-config error found by the launcher is the only line: it comes before the
    launcher lock, so no "taking over the lock" INFO line, and the stale lock file is left as
    it was (a subprocess: Flower's log handler writes to the real stderr)."""
    run = tmp_path / "r"
    run.mkdir()
    (run / ".launch.lock").write_text("999999 dpfl simulate\n")
    proc = subprocess.run([sys.executable, "-m", "dpfl.cli", "simulate", "--output-dir",
                           str(tmp_path), "--clients", "3", "run-name=r", "min-train-nodes=4"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: run-config key 'min-train-nodes': 4 nodes needed but --clients is 3: the "
        "server would wait for nodes that never come"], proc.stderr
    assert (run / ".launch.lock").read_text() == "999999 dpfl simulate\n"
    assert _listing(tmp_path) == ["r", "r/.launch.lock"]


# -- dpfl summary -----------------------------------------------------------------------------


@pytest.mark.parametrize("text,why", [
    ("[]", "a JSON object expected, found a JSON list"),
    ("{}", "no 'guarantee' object"),
    ('"x"', "a JSON object expected, found a JSON str"),
    ('{"guarantee": {"verdict": "formal"}}', "'guarantee' has no text 'scope'"),
    ('{"guarantee": {"verdict": "formal", "scope": "s", "unit": "sample", "relation": "r", '
     '"sampling": "s", "delta": 1e-5}, "clients": {"client-0": 3}}',
     "client 'client-0' is not a JSON object"),
])
def test_a_summary_of_the_wrong_shape_is_named(tmp_path, capsys, text, why):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "summary.json").write_text(text)
    fails(capsys, ["summary", str(tmp_path)],
           f"error: {tmp_path / 'summary.json'}: run summary is damaged ({why})")
    assert _listing(tmp_path) == ["config.json", "summary.json"]


def test_a_diverged_runs_null_metrics_print_as_n_a():
    """A run whose loss became inf/nan (JSON null) prints "n/a", not a traceback."""
    from dpfl.server.report import epsilon_table, summary_problem

    g = {"verdict": "formal", "scope": "s", "unit": "sample", "relation": "add-remove",
         "sampling": "poisson", "delta": 1e-5, "accountant": "pld"}
    summary = {"guarantee": g, "clients": {"client-0": {"epsilon": None, "rounds": [1]}},
               "final": {"accuracy": 0.098, "loss": None}, "wall-seconds": 3.0}
    assert summary_problem(summary) is None
    text = epsilon_table(summary)
    assert "accuracy 0.0980, loss n/a | wall 3.0 s" in text


# -- dpfl attack, dpfl audit, dpfl reproduce ----------------------------------------------


def _saved_run(tmp_path: Path, clients: int, **changes) -> Path:
    """A finished run's config.json (the defaults, ``clients`` clients)."""
    from dpfl.methods import parse_run_config
    from dpfl.server.runidentity import NUM_CLIENTS

    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    cfg = parse_run_config({**defaults["config"], "run-name": "r",
                            "output-dir": str(tmp_path), **changes})
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**cfg.to_dict(), NUM_CLIENTS: clients}))
    return run


@pytest.mark.parametrize("argv,named", [
    (["--reference-models", "-1"], ["--reference-models -1: must be in [1, 100]"]),
    (["--reference-models", "0"], ["--reference-models 0: must be in [1, 100]"]),
    (["--max-members", "0"], ["--max-members 0: must be >= 1"]),
    (["--seed", "-1"], ["--seed -1: must be in [0, 4294967295]"]),
    (["--shadow-epochs", "-1"], ["--shadow-epochs -1: must be in [1, 1000]"]),
    (["--shadow-epochs", "0"], ["--shadow-epochs 0: must be in [1, 1000]"]),
    (["--client", "-1"], ["--client -1: must be >= 0"]),
    (["--csmia-attacker", "-2"], ["--csmia-attacker -2: must be >= 0"]),
])
def test_attack_arguments_are_checked_first(tmp_path, capsys, argv, named):
    run = _saved_run(tmp_path, 2)
    fails(capsys, ["attack", str(run), *argv], *named)
    assert _listing(run) == ["config.json"]   # no attack/ folder


@pytest.mark.parametrize("trainer,argv,named", [
    ("dpsgd", ["--canaries", "1000"], ["--canaries 1000: must be in [1, 200]",
                                       "at most 100 per client", "2 clients"]),
    ("update-dp", ["--canaries", "1000"], ["--canaries 1000: must be in [1, 2]"]),
    ("dpsgd", ["--audit-seed", "-1"], ["--audit-seed -1: must be in [0, 4294967295]"]),
])
def test_audit_arguments_are_checked_before_the_audit_run(tmp_path, capsys, trainer, argv,
                                                          named):
    run = _saved_run(tmp_path, 2, trainer=trainer)
    fails(capsys, ["audit", str(run), *argv], *named)
    assert _listing(run) == ["config.json"]   # no audit/ folder


@pytest.mark.parametrize("argv,named", [
    (["--seeds", "-1"], ["--seeds -1: must be in [0, 4294967295]"]),
    (["--seeds", "0", str(2**32)], [f"--seeds {2**32}: must be in [0, 4294967295]"]),
    (["--cells", "nope"], ["--cells: unknown gcfl cell(s) ['nope']"]),
])
def test_reproduce_arguments_are_checked_before_any_run(tmp_path, capsys, argv, named):
    fails(capsys, ["reproduce", "gcfl", "--results", str(tmp_path / "res"), "--work-dir",
                    str(tmp_path / "work"), *argv], *named)
    assert not any(tmp_path.iterdir())
