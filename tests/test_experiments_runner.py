"""The generic reproduction runner: per (paper, cell, method, seed) the run-config it hands to
``simulate_record``, the record it writes, the seed-major loop with --skip-existing, the CLI
defaults and help, and that the committed tables rebuild unchanged from the committed records."""

import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from dpfl.experiments import common

ROOT = Path(__file__).resolve().parents[1]


def _preset(folder: str, file: str) -> dict:
    return tomllib.loads((ROOT / "conf" / folder / file).read_text())


_AADP_CALIBRATED = {"strategy": "aadp", "trainer": "update-dp", "aadp-epsilon": 4.0,
                    "clip-norm": 0.25, "server-lr": 0.01, "aadp-threshold": 1e-3,
                    "target-epsilon": 1e15}
# (paper, cell, method, seed) -> (SuperNodes, record name, run-config), written out by hand
# from the presets and the methods as the per-paper runners built them before the refactor
# (except the AADP-FL filter cap: calibrated ``aadp`` had 1e6, now 1e15 like the others).
CASES = [
    ("gcfl", "eps2", "gcfl", 1, 2, "eps2__gcfl__seed1",
     {**_preset("gcfl", "mnist_eps2.toml"), "strategy": "gcfl"}),
    ("gcfl", "noniid-eps2", "dpscaffold", 0, 2, "noniid-eps2__dpscaffold__seed0",
     {**_preset("gcfl", "mnist_noniid_eps2.toml"), "strategy": "dpscaffold"}),
    ("pegasus", "calibrated", "pegasus", 0, 50, "pegasus__seed0",
     {**_preset("pegasus", "mnist.toml"), "strategy": "pegasus"}),
    ("pegasus", "common-sigma", "dpfedavg", 3, 50, "common-sigma__dpfedavg__seed3",
     {**_preset("pegasus", "mnist-common-sigma.toml"), "strategy": "dpfedavg"}),
    ("aadp", "mnist-cnn", "dpfedavg", 2, 20, "mnist-cnn__dpfedavg__seed2",
     {**_preset("aadp", "mnist.toml"), "model": "mnist-cnn", "strategy": "dpfedavg",
      "trainer": "dpsgd", "target-epsilon": 4.0, "max-grad-norm": 1.0}),
    ("aadp", "fmnist-mlp", "fedavg", 0, 20, "fmnist-mlp__fedavg__seed0",
     {**_preset("aadp", "fmnist.toml"), "model": "mlp", "strategy": "fedavg",
      "trainer": "plain"}),
    ("aadp", "mnist-mlp", "aadp", 4, 20, "mnist-mlp__aadp__seed4",
     {**_preset("aadp", "mnist.toml"), "model": "mlp", **_AADP_CALIBRATED}),
    ("aadp", "mnist-mlp", "aadp-paper-noise", 1, 20, "mnist-mlp__aadp-paper-noise__seed1",
     {**_preset("aadp", "mnist.toml"), "model": "mlp", **_AADP_CALIBRATED,
      "aadp-noise": "paper"}),
    ("aadp", "fmnist-cnn", "aadp-eps64", 0, 20, "fmnist-cnn__aadp-eps64__seed0",
     {**_preset("aadp", "fmnist.toml"), "model": "mnist-cnn", **_AADP_CALIBRATED,
      "aadp-epsilon": 64.0}),
    # DP-FedASGP: the cell sets the arm's epsilon per round and every arm's whole-run target
    # (30 rounds x 4 = 120 by basic composition; 30 x 0.5 = 15)
    ("fedasgp", "eps4", "dpfedavg", 0, 100, "eps4__dpfedavg__seed0",
     {**_preset("fedasgp", "mnist.toml"), "strategy": "dpfedavg", "target-epsilon": 120.0}),
    ("fedasgp", "eps0.5", "fedasgp-strict", 1, 100, "eps0.5__fedasgp-strict__seed1",
     {**_preset("fedasgp", "mnist.toml"), "strategy": "fedasgp", "asgp-variant": "strict",
      "asgp-epsilon": 0.5, "target-epsilon": 15.0}),
    ("fedasgp", "eps4", "fedsmp-randk", 2, 100, "eps4__fedsmp-randk__seed2",
     {**_preset("fedasgp", "mnist.toml"), "strategy": "fedsmp", "fedsmp-mask": "randk",
      "target-epsilon": 120.0}),
    # trust models: the cell's size (100 or 1,000 SuperNodes), the arm's trust keys, n_min
    # = 80 % of a distributed round, Flower's wrapper at the preset's sigma without a budget
    ("trust", "eps8", "distributed", 0, 100, "eps8__distributed__seed0",
     {**_preset("trust", "mnist100.toml"), "strategy": "dpfedavg", "trust": "distributed",
      "target-epsilon": 8.0, "secagg-min-survivors": 8}),
    ("trust", "k1000-eps8", "central", 0, 1000, "k1000-eps8__central__seed0",
     {**_preset("trust", "mnist1000.toml"), "strategy": "dpfedavg", "trust": "central",
      "adaptive-clip": True, "target-epsilon": 8.0}),
    ("trust", "cmp", "flower-central", 0, 100, "cmp__flower-central__seed0",
     {**_preset("trust", "mnist100-cmp.toml"), "strategy": "dpfedavg", "trust": "central",
      "central-impl": "flower", "adaptive-clip": False, "target-epsilon": 1e6,
      "noise-multiplier": 0.5}),
]


class FakeSimulation:
    """Stands in for ``simulate_record`` (as bench/regression.py wraps it): records every call
    and returns a minimal record whose run-dir holds a ledger in which client-0's noise drops
    at round 3 (an AADP-FL budget raise)."""

    def __init__(self, run_dir: Path):
        self.calls: list[tuple[int, dict]] = []
        self.run_dir = run_dir
        events = [{"round": 1, "sigma": 2.0}, {"round": 2, "sigma": 2.0},
                  {"round": 3, "sigma": 0.2}]
        (run_dir / "ledger.json").write_text(json.dumps({"clients": {"client-0": {"events": events}}}))

    def __call__(self, root, clients, overrides, work):
        self.calls.append((clients, overrides))
        return {"config": overrides, "run-dir": str(self.run_dir), "accuracy": 0.5,
                "epsilon": {"client-0": 1.0, "client-1": 3.0}}


@pytest.fixture
def fake(tmp_path, monkeypatch):
    sim = FakeSimulation(tmp_path)
    monkeypatch.setattr(common, "simulate_record", sim)
    return sim


@pytest.mark.parametrize("paper,cell,method,seed,clients,name,config", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_run_one_hands_simulate_record_the_paper_run_config(
        tmp_path, fake, paper, cell, method, seed, clients, name, config):
    import importlib

    module = importlib.import_module(f"dpfl.experiments.{paper}")
    results = tmp_path / "results"
    record = module.run_one(ROOT, cell, method, seed, results, tmp_path / "work")
    expected = {**config, "seed": seed, "run-name": name}
    [(used_clients, overrides)] = fake.calls
    assert used_clients == clients
    assert overrides == expected and list(overrides) == list(expected)  # same keys, same order
    written = json.loads((results / "runs" / f"{name}.json").read_text())
    assert written == record
    assert list(written)[:3] == ["cell", "method", "seed"]
    assert (written["cell"], written["method"], written["seed"]) == (cell, method, seed)
    if method.startswith("aadp"):  # the raise at round 3 read from the run's ledger
        assert written["raised-at-rounds"] == [3]
    else:
        assert "raised-at-rounds" not in written


def test_reproduce_is_seed_major_and_skips_recorded_runs(tmp_path, fake, monkeypatch):
    from dataclasses import replace

    from dpfl.experiments.pegasus import REPRODUCTION

    tables: list[str] = []
    paper = replace(REPRODUCTION, build_table=lambda results, command: tables.append(command) or "T")
    results = tmp_path / "results"
    (results / "runs").mkdir(parents=True)
    (results / "runs" / "pegasus__seed0.json").write_text("{}")  # calibrated keeps old names
    out = paper.reproduce(ROOT, results, tmp_path / "work", ["calibrated", "common-sigma"],
                          ["dpfedavg", "pegasus"], [0, 1], True, "cmd")
    assert [o["run-name"] for _, o in fake.calls] == [
        "dpfedavg__seed0", "common-sigma__dpfedavg__seed0", "common-sigma__pegasus__seed0",
        "dpfedavg__seed1", "pegasus__seed1", "common-sigma__dpfedavg__seed1",
        "common-sigma__pegasus__seed1"]
    assert out == "T" and tables == ["cmd"] * 8  # after each of the 7 runs, then once more
    fake.calls.clear()
    paper.reproduce(ROOT, results, tmp_path / "work", ["calibrated"], ["pegasus"], [0], False, "c")
    assert [o["run-name"] for _, o in fake.calls] == ["pegasus__seed0"]  # no skip: rerun


@pytest.mark.parametrize("paper,cells,methods", [
    ("gcfl", ["eps2", "noniid-eps2", "eps3", "eps4"],
     ["dpfedavg", "dpfedprox", "dpscaffold", "dpfedexp", "gcfl"]),
    ("pegasus", ["calibrated"], ["dpfedavg", "pegasus"]),
    ("aadp", ["mnist-mlp", "mnist-cnn"],
     ["aadp", "aadp-paper-noise", "fedavg", "dpfedavg", "dpscaffold"]),
    ("fedasgp", ["eps0.1", "eps0.2", "eps0.5", "eps1", "eps2", "eps4"],
     ["dpfedavg", "fedasgp-paper", "fedasgp-strict", "fedsmp-randk"]),
])
def test_cli_runs_the_default_grid_of_each_paper(tmp_path, monkeypatch, capsys, paper, cells,
                                                 methods):
    from dpfl.cli import main

    seen = []

    def fake_reproduce(self, root, results, work, c, m, seeds, skip, command):
        seen.append((self.name, results, work, c, m, seeds, skip, command))
        return "table"

    monkeypatch.setattr(common.Reproduction, "reproduce", fake_reproduce)
    assert main(["reproduce", paper, "--results", str(tmp_path), "--work-dir", "w"]) == 0
    assert seen == [(paper, tmp_path, Path("w"), cells, methods, [0, 1, 2], False,
                     f"dpfl reproduce {paper}")]
    assert capsys.readouterr().out == "table\n"
    seen.clear()
    assert main(["reproduce", paper, "--cells", cells[-1], "--methods", methods[0],
                 "--seeds", "4", "--skip-existing", "--results", str(tmp_path)]) == 0
    assert seen[0][3:7] == ([cells[-1]], [methods[0]], [4], True)


def _reproduce_help(capsys) -> str:
    from dpfl.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["reproduce", "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def _paper_block(text: str, paper: str) -> str:
    """The epilog's lines for one paper (its header up to the next paper's header)."""
    start = text.index(f"\n  {paper}: ")
    rest = text[start + 1:]
    nxt = re.search(r"^  [a-z]+: ", rest[3:], re.MULTILINE)
    return rest if nxt is None else rest[:nxt.start() + 3]


def _listed(block: str, label: str) -> list[str]:
    """Names after ``cells:`` / ``methods:`` (continuation lines included)."""
    body = block.split(f"{label}:", 1)[1]
    body = re.split(r"^    [a-z]+:", body, flags=re.MULTILINE)[0]
    return [n.strip() for n in body.replace("\n", " ").split(",") if n.strip()]


@pytest.mark.parametrize("paper", common.PAPERS)
def test_reproduce_help_lists_every_cell_and_method_of_every_paper(capsys, paper):
    """Every known cell and method, in order, each starred iff it is a default."""
    r = common.reproduction(paper)
    block = _paper_block(_reproduce_help(capsys), paper)
    assert block.startswith(f"  {paper}: {r.clients} clients, presets in conf/{r.presets}/")
    star = lambda names, default: [f"{n}*" if n in default else n for n in names]
    assert _listed(block, "cells") == star(list(r.cells), r.default_cells)
    assert _listed(block, "methods") == star(list(r.methods), r.default_methods)


def test_reproduce_help_gives_every_option_and_its_default(capsys):
    text = _reproduce_help(capsys)
    assert "{" + ",".join(common.PAPERS) + "}" in text and "seeds to run (default: 0 1 2)" in text
    for option in ("--cells", "--methods", "--skip-existing", "--results", "--work-dir"):
        line = text[text.index(f"  {option}"):].split("\n  -")[0]
        assert len(line.split(None, 2)) == 3, f"{option} has no help text"
    assert "results/<paper>/" in text and "runs/reproduce-<paper>/" in text
    assert "aadp-eps8*" not in text  # the sweep is not in the default grid


def test_aadp_filter_cap_is_beyond_every_recorded_epsilon():
    """All AADP-FL methods share one cap, above the whole-run epsilon of every committed
    AADP-FL record (the paper-noise runs end near 1e14): the filter never refused a round."""
    from dpfl.experiments.aadp import FILTER_OUT_OF_REACH, METHODS

    caps = {m: v["target-epsilon"] for m, v in METHODS.items() if m.startswith("aadp")}
    assert set(caps.values()) == {FILTER_OUT_OF_REACH}
    runs = (ROOT / "results" / "aadp" / "runs").glob("*.json")
    records = [json.loads(p.read_text()) for p in runs]
    reached = [max(r["epsilon"].values()) for r in records if r["method"].startswith("aadp")]
    assert reached and max(reached) < FILTER_OUT_OF_REACH
    assert max(reached) > 1e13  # the cap matters: 1e6 would have stopped these runs


@pytest.mark.parametrize("paper", ["gcfl", "pegasus", "aadp"])
def test_committed_tables_rebuild_unchanged_from_committed_records(tmp_path, paper):
    import importlib

    committed = ROOT / "results" / paper
    results = tmp_path / paper
    shutil.copytree(committed / "runs", results / "runs")
    command = re.search(r"^Command: `(.*)`$", (committed / "table.md").read_text(), re.MULTILINE)[1]
    importlib.import_module(f"dpfl.experiments.{paper}").build_table(results, command)
    for name in ("table.md", "table.json"):
        assert (results / name).read_text() == (committed / name).read_text(), name


def test_mean_std_formats_percent_mean_and_sample_std():
    assert common.mean_std([0.90, 0.92]) == "91.00 ± 1.41"
    assert common.mean_std([0.88]) == "88.00"
    assert common.mean_std([]) == "—"


def test_reproduce_defaults_to_a_fresh_folder_and_resumes_with_the_same_command(
        tmp_path, monkeypatch, capsys):
    """Issue 48.1: by default `dpfl reproduce` wrote into the committed results/<paper>/ and,
    stopped and started again, refused its own unfinished run directory. Now: a fresh
    folder under the work dir, finished runs kept, the unfinished run's directory set aside
    and run again, a start line per run."""
    import dpfl.experiments.common as common
    from dpfl.cli import main

    calls = []

    def fake(root, clients, overrides, work):
        calls.append(overrides["run-name"])
        run_dir = Path(work) / overrides["run-name"]
        run_dir.mkdir(parents=True)
        return {"config": overrides, "run-dir": str(run_dir), "accuracy": 0.5,
                "macro-recall": 0.5, "macro-f1": 0.5, "epsilon": {"client-0": 1.0},
                "composed-epsilon": {"client-0": 1.0}, "verdict": "formal",
                "randomness": "secret (OS entropy)", "rounds-run": 1,
                "accuracy-by-round": [0.5], "selected-by-round": [1],
                "mean-epsilon-by-round": [1.0], "epsilon-by-round": [{"client-0": 1.0}],
                "samples-per-second": 1.0, "wall-seconds": 1.0}

    monkeypatch.setattr(common, "simulate_record", fake)
    work = tmp_path / "work"
    argv = ["reproduce", "pegasus", "--seeds", "0", "--work-dir", str(work)]
    assert main(argv) == 0
    first = list(calls)
    assert first and (work / "results").is_dir()
    out = capsys.readouterr().out
    assert f"reproduce: {len(first)} run(s), 0 already recorded" in out and "starting" in out
    # interrupted: one record lost, its run directory left behind
    lost = first[-1]
    (work / "results" / "runs" / f"{lost}.json").unlink()
    calls.clear()
    assert main(argv) == 0                          # the same command
    assert calls == [lost]                          # only the unfinished run, again
    assert any(p.name.startswith(f"{lost}.incomplete-") for p in work.iterdir())
