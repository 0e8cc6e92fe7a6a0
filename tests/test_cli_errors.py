"""Every `dpfl` command fails in one line naming the file, directory or argument, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dpfl.cli import main

from cli_helpers import fails


@pytest.mark.parametrize("command", ["summary", "privacy-report"])
def test_missing_and_non_run_directories(tmp_path, capsys, command):
    fails(capsys, [command, str(tmp_path / "nope")], str(tmp_path / "nope"),
           "no such run directory")
    fails(capsys, [command, str(tmp_path)], str(tmp_path), "not a dpfl run directory")


def test_damaged_summary_is_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    fails(capsys, ["summary", str(tmp_path)], "summary.json", "no such file")
    (tmp_path / "summary.json").write_text('{"guarantee": ')
    fails(capsys, ["summary", str(tmp_path)], "summary.json", "damaged")
    (tmp_path / "summary.json").write_text("")
    fails(capsys, ["summary", str(tmp_path)], "summary.json", "empty")


def test_simulate_rejects_before_starting(tmp_path, capsys):
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), "num-rounds"], "key=value")
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), "target-epsilon=-1"],
           "target-epsilon")
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), "--clients", "3",
                    "min-train-nodes=4"], "min-train-nodes", "--clients is 3")
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), "dataset=mnist",
                    f"data-dir={tmp_path / 'no-data'}"], "mnist", str(tmp_path / "no-data"))
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), "resume=true",
                    "run-name=gone"], "no run to resume", str(tmp_path / "gone"))
    fails(capsys, ["simulate", "--output-dir", str(tmp_path),
                    "resume-without-checkpoint=true"], "resume-without-checkpoint",
           "needs resume=true")
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), "--clients", "0"],
           "--clients must be at least 1")
    assert not any(tmp_path.iterdir())  # nothing was written


def test_a_budget_one_round_exceeds_stops_before_training(tmp_path, capsys):
    """sigma 0.3 on digits (2 clients, q = 32/646, 21 steps): one round costs epsilon ~39
    under RDP, far above 1.0; found before any process starts, by the clients' own check."""
    line = fails(capsys, ["simulate", "--clients", "2", "--output-dir", str(tmp_path),
                           "dataset=digits", "model=mlp", "batch-size=32", "accountant=rdp",
                           "noise-multiplier=0.3", "target-epsilon=1.0"],
                  "target-epsilon", "one round already costs client-0")
    import re

    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [(0.3, 32 / 646, 21)]
    stated = float(re.search(r"epsilon ([0-9.]+) > 1", line).group(1))
    # Opacus' RDP on its own order grid: 39.77; dpfl's RDP (finer orders) is a bit tighter
    assert stated == pytest.approx(acc.get_epsilon(1e-5), rel=0.03)
    assert not any(tmp_path.iterdir())


def test_a_new_run_never_reuses_a_finished_run_directory(tmp_path, capsys):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text("{}")
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), "run-name=old"],
           str(tmp_path / "old"), "already exists")


# -- issue 28, item 6: no traceback, and nothing started, on bad input -----------------------


@pytest.mark.parametrize("argv,named", [
    (["noise-multiplier=inf"], ["run-config key 'noise-multiplier'", "finite number, got inf"]),
    (["target-epsilon=inf"], ["run-config key 'target-epsilon'", "finite number, got inf"]),
    (["lr=nan"], ["run-config key 'lr'", "finite number, got nan"]),
    (["num-rounds=1e12"], ["run-config key 'num-rounds'", "must be in [1, 1000000]"]),
    (["num-rounds=2.5"], ["run-config key 'num-rounds'", "expected an integer, got 2.5"]),
    (["local-epochs=inf"], ["run-config key 'local-epochs'", "expected an integer, got inf"]),
    (["seed=1", "seed=2"], ["run-config key 'seed' is given twice ('seed=1' and 'seed=2')"]),
    (["seed=1", "num-rounds=2", "seed=1"], ["run-config key 'seed' is given twice"]),
])
def test_bad_values_are_refused_before_anything_starts(tmp_path, capsys, argv, named):
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), *argv], *named)
    assert not any(tmp_path.iterdir())


def test_every_numeric_key_refuses_infinite_and_nan():
    """Every int and float key, global or a method's own, goes through the same finite
    check: no setting means "infinite" (inf and nan are typos), whichever method runs."""
    import dataclasses
    import math

    from dpfl.config import RunConfig
    from dpfl.methods import METHODS, ConfigError, parse_run_config

    numeric = [f for f in dataclasses.fields(RunConfig) if str(f.type) in ("int", "float")]
    for method in METHODS.values():
        if method.params is not None:
            numeric += [f for f in dataclasses.fields(method.params)
                        if str(f.type) in ("int", "float")]
    keys = sorted({f.name.replace("_", "-") for f in numeric})
    assert {"num-rounds", "target-epsilon", "noise-multiplier", "lr"} <= set(keys)
    assert len(keys) > 40
    for key in keys:
        for value in (math.inf, -math.inf, math.nan):
            with pytest.raises(ConfigError, match=f"run-config key '{key}': expected an? "):
                parse_run_config({key: value})


def test_an_output_folder_that_cannot_be_written_is_refused(tmp_path, capsys):
    """--output-dir and the output-dir key: one line naming the option and why, exit 2,
    before the launcher creates anything (no traceback from mkdir)."""
    if Path("/proc/self").is_dir():   # Linux: a pseudo file system where mkdir fails
        fails(capsys, ["simulate", "--output-dir", "/proc/x"],
               "error: --output-dir /proc/x: cannot create a folder in /proc: ")
        assert not Path("/proc/x").exists()
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "runs"
    fails(capsys, ["simulate", "--output-dir", str(out)],
           f"error: --output-dir {out}: {tmp_path / 'file'} exists and is not a directory")
    fails(capsys, ["simulate", f"output-dir={out}"],
           f"error: run-config key 'output-dir' {out}: {tmp_path / 'file'} exists and is not")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_path_options_go_through_the_same_writability_check(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "sub"
    fails(capsys, ["reproduce", "gcfl", "--results", str(bad)],
           f"error: --results {bad}: {tmp_path / 'file'} exists and is not a directory")
    fails(capsys, ["reproduce", "gcfl", "--results", str(tmp_path / "r"), "--work-dir",
                    str(bad)], f"error: --work-dir {bad}: ")
    # a run folder the command cannot write into (read-only mount; root ignores chmod, so
    # the write fails here by hand)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("dpfl.errors.tempfile.mkstemp", read_only)
    fails(capsys, ["attack", str(run)], f"error: RUN_DIR {run}: cannot write in {run}: "
           "Read-only file system (this command writes attack/ there)")
    fails(capsys, ["audit", str(run)], f"error: RUN_DIR {run}: cannot write in {run}: ",
           "audit/")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "run"]
    assert [p.name for p in run.iterdir()] == ["config.json"]


def _saved_run(tmp_path: Path) -> Path:
    """A run folder as a run that stopped after starting leaves it: config.json (the
    ServerApp writes it first) and the files a test damages."""
    import json
    import tomllib

    from dpfl.methods import parse_run_config
    from dpfl.server.runidentity import NUM_CLIENTS

    root = Path(__file__).resolve().parents[1]
    defaults = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    cfg = parse_run_config({**defaults["config"], "run-name": "r",
                            "output-dir": str(tmp_path)})
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**cfg.to_dict(), NUM_CLIENTS: 4}))
    return run


@pytest.mark.parametrize("name,what", [("ledger.json", "privacy ledger"),
                                       ("rounds.jsonl", "round log"),
                                       ("config.json", "run config")])
def test_a_resume_over_records_that_are_not_utf8(tmp_path, capsys, name, what):
    """Bytes that are not UTF-8 in a record a resume reads: the same one line and exit 2 as
    every other damaged record, found by the launcher before the SuperLink starts."""
    run = _saved_run(tmp_path)
    if name != "ledger.json":
        (run / "ledger.json").write_text('{"delta": 1e-05, "accountant": "pld", "clients": {}}')
    (run / name).write_bytes(b'{"delta": 1e-05, "accountant": "pld", "clients": {"\xff": 1}}\n')
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), "resume=true", "run-name=r"],
           f"error: {run / name}: {what} is damaged (not UTF-8 text: byte 0xff at offset ")
    assert not (run / ".flwr").exists()   # no SuperLink was started


# -- issue 48, item 1: errors that help ------------------------------------------------------


@pytest.mark.parametrize("argv,line", [
    (["num-round=3"], ("error: unknown run-config key 'num-round': did you mean 'num-rounds'? "
                       "(every key: docs/run-config.md)")),
    (["gcfl-referenses=2"], ("error: unknown run-config key 'gcfl-referenses': did you mean "
                             "'gcfl-references'? (every key: docs/run-config.md)")),
    (["zzzz=1"], "error: unknown run-config key 'zzzz' (every key: docs/run-config.md)"),
])
def test_a_misspelled_key_gets_the_closest_keys_in_one_short_line(tmp_path, capsys, argv,
                                                                   line):
    """Not the ~140 known keys on one ~2,000-character line: the closest global or method
    keys, and where every key is described."""
    assert fails(capsys, ["simulate", "--output-dir", str(tmp_path), *argv]) == line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv,line", [
    (["strategy=gcfll"], ("error: run-config key 'strategy': must be one of ('aadp', "
                          "'cpsgd', 'dpfedavg', 'dpfedavgm', 'dpfedexp', 'dpfedprox', "
                          "'dpfedsam', 'dpscaffold', 'fedacg', 'fedasgp', 'fedavg', "
                          "'fedcompdp', 'fedsmp', 'gcfl', 'pegasus'), got 'gcfll': did you mean "
                          "'gcfl'?")),
    (["model=mnist_cnn"], ("error: run-config key 'model': must be one of ('mlp', 'mnist-cnn', "
                           "'cifar-cnn', 'alexnet', 'resnet18-gn', 'resnet50-gn'), got "
                           "'mnist_cnn': did you mean 'mnist-cnn'?")),
    (["trust=centrale"], ("error: run-config key 'trust': must be one of ('local', 'central', "
                          "'distributed'), got 'centrale': did you mean 'central'?")),
])
def test_a_misspelled_name_gets_the_closest_choice(tmp_path, capsys, argv, line):
    assert fails(capsys, ["simulate", "--output-dir", str(tmp_path), *argv]) == line


def test_bad_keys_and_names_are_refused_before_torch_is_imported(tmp_path):
    """Issue 48: a run-config error in < 0.5 s. Measured on the real command in a fresh
    interpreter; the import check is what makes it fast (torch, Flower, Opacus and the
    method registry take ~2.4 s to import), so it is asserted rather than the time."""
    probe = ("import sys; from dpfl.cli import main\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
             "heavy = sorted(m for m in ('torch', 'flwr', 'opacus', 'dp_accounting', "
             "'dpfl.methods') if m in sys.modules)\nprint(heavy)")
    for bad in ("num-round=3", "strategy=gcfll", "model=cnn", "lr=-1", "trust=centrale"):
        out = subprocess.run([sys.executable, "-c", probe, "simulate", "--output-dir",
                              str(tmp_path), bad], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip().splitlines()[-1] == "[]", (bad, out.stdout, out.stderr)
        assert out.stderr.startswith("error: run-config key") or "unknown" in out.stderr, bad


def test_a_bad_preset_file_is_named_in_one_line(tmp_path, capsys):
    out = ["--output-dir", str(tmp_path / "runs")]
    missing = tmp_path / "nope.toml"
    assert fails(capsys, ["simulate", "--config", str(missing), *out]) == (
        f"error: --config {missing}: no such file or directory")
    bad = tmp_path / "bad.toml"
    bad.write_text("num-rounds = = 3\n")
    assert fails(capsys, ["simulate", "--config", str(bad), *out]).startswith(
        f"error: --config {bad}: not TOML (")
    nested = tmp_path / "nested.toml"
    nested.write_text("[tool.flwr.app.config]\nnum-rounds = 3\n")
    assert fails(capsys, ["simulate", "--config", str(nested), *out]) == (
        f"error: --config {nested}: key 'tool' holds a table; a preset is a flat list of "
        "run-config key = value lines")
    typo = tmp_path / "typo.toml"
    typo.write_text("num-round = 3\n")
    assert fails(capsys, ["simulate", "--config", str(typo), *out]) == (
        "error: unknown run-config key 'num-round': did you mean 'num-rounds'? (every key: "
        "docs/run-config.md)")
    assert not (tmp_path / "runs").exists()


def test_presets_merge_in_order_and_the_command_line_wins(tmp_path):
    from dpfl.cli import build_parser, run_config_overrides

    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text("num-rounds = 3\nlr = 0.5\nstrategy = \"gcfl\"\n")
    second.write_text("lr = 0.25\n")
    args = build_parser()[0].parse_args(["simulate", "--config", str(first), "--config",
                                         str(second), "num-rounds=7"])
    assert run_config_overrides(args) == {"num-rounds": 7, "lr": 0.25, "strategy": "gcfl"}


def test_every_shipped_preset_passes_the_key_check():
    from dpfl.cli import app_dir, check_run_config_keys, read_preset

    presets = sorted((app_dir() / "conf").rglob("*.toml"))
    assert len(presets) > 20
    for path in presets:
        check_run_config_keys(app_dir(), read_preset(str(path)))


def test_the_suggestions_come_from_global_and_method_keys():
    from dpfl.config import ConfigError, parse_global
    from dpfl.methods import method_keys

    with pytest.raises(ConfigError) as exc:
        parse_global({"clipnorm": 1.0}, method_keys())
    assert str(exc.value).startswith("unknown run-config key 'clipnorm': did you mean "
                                     "'clip-norm'")
    assert len(str(exc.value)) < 200


def test_the_cheap_key_check_agrees_with_the_launchers(tmp_path):
    """The CLI's early check (no torch, Opacus, Flower) treats exactly the registry's keys
    as known: every method key passes it and its message is the registry's."""
    from dpfl.cli import app_dir, check_run_config_keys
    from dpfl.config import ConfigError
    from dpfl.methods import method_keys, parse_run_config

    check_run_config_keys(app_dir(), {})
    for key in sorted(method_keys()):   # known to both (values: the pyproject's defaults)
        check_run_config_keys(app_dir(), {"strategy": "dpfedavg"} | {key: _default(key)})
    with pytest.raises(ConfigError) as early:
        check_run_config_keys(app_dir(), {"num-round": 3})
    with pytest.raises(ConfigError) as late:
        parse_run_config({"num-round": 3})
    assert str(early.value) == str(late.value)


def _default(key: str) -> object:
    import tomllib

    root = Path(__file__).resolve().parents[1]
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "config"][key]


@pytest.mark.parametrize("argv,option", [
    (["simulate", "--client", "4"], "--clients"),
    (["simulate", "--output", "/tmp/x"], "--output-dir"),
    (["attack", "run", "--reference", "2"], "--reference-models"),
    (["reproduce", "gcfl", "--seed", "0"], "--seeds"),
    (["audit", "run", "--canary", "2"], "--canaries"),
    (["deploy", "up", "--state", "s", "--insec"], None),   # deploy passes extras to flwr
])
def test_no_abbreviated_options(capsys, argv, option):
    """`--client 4` was silently taken as `--clients 4`: every parser refuses abbreviations
    and names the option meant."""
    from dpfl.cli import build_parser

    parser, commands = build_parser()
    assert not parser.allow_abbrev and not any(p.allow_abbrev for p in commands.values())
    if option is None:
        args, extra = parser.parse_known_args(argv)
        assert extra == ["--insec"] and not args.insecure
        return
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unrecognized arguments: " + argv[-2] in last and f"did you mean {option}?" in last


def test_help_texts_are_plain_and_complete(capsys):
    """`dpfl --help`: plain text (no RST markup), every reproduction of the registry; every
    option and argument of every command described; simulate --help points to the keys."""
    import argparse

    from dpfl.cli import build_parser
    from dpfl.experiments.common import PAPERS

    parser, commands = build_parser()
    text = parser.format_help()
    assert "``" not in text and ":func:" not in text and text.startswith("usage: dpfl ")
    for paper in PAPERS:
        assert paper in text, paper
    for name, p in [("dpfl", parser), *commands.items()]:
        for action in p._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, (name, action.option_strings or action.dest)
    simulate = commands["simulate"].format_help()
    assert "docs/run-config.md" in simulate
    for option in ("--output-dir", "--cpus-per-client"):
        assert option in simulate


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    """Ctrl-C (KeyboardInterrupt in the command) ends with one line, not a traceback; a
    reproduction says the same command resumes it."""
    import dpfl.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_summary", interrupted)
    monkeypatch.setattr(cli, "cmd_reproduce", interrupted)
    assert cli.main(["summary", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "interrupted\n"
    assert cli.main(["reproduce", "pegasus", "--seeds", "0"]) == 130
    assert capsys.readouterr().err == ("interrupted (the same command resumes: finished runs "
                                       "are kept)\n")


def test_under_pld_the_refusal_states_the_pld_figure_not_the_rdp_precheck(tmp_path, capsys):
    """The launcher first asks RDP (an upper bound: a round it shows within budget fits);
    a round RDP does not clear is decided by the run's own accountant, whose figure the
    error states: here dp-accounting's PLD, not RDP's."""
    line = fails(capsys, ["simulate", "--clients", "2", "--output-dir", str(tmp_path),
                           "dataset=digits", "model=mlp", "batch-size=32", "accountant=pld",
                           "noise-multiplier=0.7", "target-epsilon=1.0"],
                  "target-epsilon", "one round already costs client-0")
    import re

    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    # client-0 holds 647 examples: 21 batches of 32 an epoch, Poisson rate 1/21 (Opacus')
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(1 / 21, dp_event.GaussianDpEvent(0.7)), 21)
    stated = float(re.search(r"epsilon ([0-9.]+) > 1", line).group(1))
    assert stated == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)
    assert "absl" not in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_round_rdp_clears_skips_the_launchers_pld_check(monkeypatch):
    from dpfl.methods import build_strategy, parse_run_config
    from dpfl.runtime import preflight as launch

    cfg = parse_run_config({"dataset": "digits", "model": "mlp", "trainer": "update-dp",
                            "trust": "central", "noise-multiplier": 1.0, "fraction-train": 0.1,
                            "target-epsilon": 8.0, "accountant": "pld"})
    strategy = build_strategy(cfg, {i: 30 for i in range(20)})
    asked: list[str] = []
    original = launch.first_round_affordable
    monkeypatch.setattr(launch, "first_round_affordable",
                        lambda s, c: asked.append(c.accountant) or original(s, c))
    assert launch.round_one_fits_by_rdp(strategy, cfg)
    assert asked == ["rdp"]
    tight = parse_run_config({**{k: v for k, v in cfg.to_dict().items()
                                 if k in ("dataset", "model", "trainer", "trust",
                                          "noise-multiplier", "fraction-train", "accountant")},
                              "target-epsilon": 0.01})
    assert not launch.round_one_fits_by_rdp(build_strategy(tight, {i: 30 for i in range(20)}),
                                            tight)
