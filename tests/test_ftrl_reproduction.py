"""``dpfl reproduce ftrl`` (dpfl/experiments/ftrl.py) without a federation: every arm's
run-config for every cell is one ``dpfl simulate`` accepts at 1,000 clients, with the claim
the module states; the ordering check gives the right verdict both ways; the table, the
seed means, the ordering lines and the plot from hand-made records and round logs."""

import json
import math
import tomllib
from pathlib import Path

import pytest

from dpfl.experiments import common, ftrl
from dpfl.experiments.common import write_record
from dpfl.methods import guarantee, parse_run_config

ROOT = Path(__file__).parent.parent
DEFAULTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def _config(cell: str, arm: str):
    """The RunConfig ``dpfl simulate`` builds (dpfl.runtime.launch.simulate: the app's defaults,
    then the overrides) from the reproduction's overrides of one run."""
    overrides = ftrl.REPRODUCTION.overrides(ROOT, cell, arm, 0)
    return overrides, parse_run_config({**DEFAULTS, **overrides})


def test_ftrl_is_a_listed_reproduction_of_1000_clients():
    r = common.reproduction("ftrl")
    assert r is ftrl.REPRODUCTION and "ftrl" in common.PAPERS
    assert r.clients_for("eps2") == 1000
    assert r.default_cells == ("eps2", "eps4", "eps8")
    assert r.default_methods == ("poisson", "independent", "tree", "banded-mf")
    assert r.extra is ftrl.participations    # every record gets its participations


def test_the_preset_holds_no_schema_key():
    """central-noise=gaussian refuses the schema keys: the preset must stay valid for the
    poisson arm, the schema comes with the correlated arms."""
    preset = tomllib.loads((ROOT / "conf" / "ftrl" / "mnist1000.toml").read_text())
    assert not set(preset) & {"max-participations", "min-separation", "central-band",
                              "tree-restart", "central-noise", "target-epsilon"}
    assert "max-participations" not in ftrl.ARMS["poisson"]


@pytest.mark.parametrize("cell", list(ftrl.EPSILONS))
@pytest.mark.parametrize("arm", list(ftrl.ARMS))
def test_every_arm_of_every_cell_is_a_valid_run_with_its_claim(cell, arm):
    """dpfl's own validation (parse_run_config -> validate, the launcher's preflight rule on
    min-train-nodes) accepts the run at 1,000 clients; its guarantee is formal, client level,
    add-remove; poisson claims Poisson sampling, the others none under the 5 x 10 schema."""
    from dpfl.server.correlated import cohort_size

    overrides, cfg = _config(cell, arm)
    assert overrides["run-name"] == f"{cell}__{arm}__seed0" and overrides["seed"] == 0
    assert cfg.target_epsilon == ftrl.EPSILONS[cell] and cfg.strategy == "dpfedavg"
    assert (cfg.trust, cfg.trainer, cfg.adaptive_clip) == ("central", "update-dp", False)
    assert (cfg.num_rounds, cfg.fraction_train, cfg.clip_norm) == (50, 0.1, 0.5)
    assert cfg.min_train_nodes <= ftrl.CLIENTS
    g = guarantee(cfg)
    assert (g.verdict, g.unit, g.relation) == ("formal", "client", "add-remove")
    if arm == "poisson":
        assert cfg.central_noise == "gaussian" and g.sampling == "poisson"
        assert (cfg.max_participations, cfg.min_separation) == (1, 1)
        return
    assert g.sampling == "none"
    assert (cfg.max_participations, cfg.min_separation) == (5, 10)
    m, k, b, n = cohort_size(cfg, ftrl.CLIENTS), 5, 10, cfg.num_rounds
    # the schema can fill every cohort of 100 (the server's own warning's condition)
    assert m == 100 and m * b <= ftrl.CLIENTS and m * n <= ftrl.CLIENTS * k
    assert (k - 1) * b + 1 <= n


def test_the_correlated_arms_are_the_mechanisms_named():
    """independent: C = identity (one coefficient), sensitivity sqrt(k) c_0; banded-mf: a
    band of 10 coefficients; tree: tree aggregation. All three calibrated to the same
    epsilon: the worst client's charge is the cell's target."""
    from dpfl.privacy.correlated_charging import band_of, correlated_charge

    for arm, mode, band in (("independent", "banded-mf", 1), ("banded-mf", "banded-mf", 10),
                            ("tree", "tree", None)):
        _, cfg = _config("eps4", arm)
        charge = correlated_charge(cfg)
        assert charge.mode == mode
        if band is not None:
            assert band_of(cfg) == band and len(charge.coefficients) == band
        if arm == "independent":
            assert charge.sensitivity == pytest.approx(math.sqrt(5) * abs(charge.coefficients[0]))
        assert charge.worst_epsilon(1e-5, "pld") == pytest.approx(4.0, rel=2e-3)


def _rec(cell, arm, seed, accuracy, eps=None, **extra):
    eps = ftrl.EPSILONS[cell] if eps is None else eps
    return {"cell": cell, "method": arm, "seed": seed, "accuracy": accuracy,
            "epsilon": {"client-0": eps, "client-1": eps / 2}, "verdict": "formal",
            "randomness": "secret (OS entropy)", "wall-seconds": 600.0, **extra}


def test_ordering_holds_and_fails_and_waits_for_missing_arms():
    held = [_rec("eps2", "banded-mf", 0, 0.90), _rec("eps2", "banded-mf", 1, 0.92),
            _rec("eps2", "tree", 0, 0.89), _rec("eps2", "independent", 0, 0.80),
            _rec("eps2", "poisson", 0, 0.99)]      # poisson is beside the ordering
    out = ftrl.ordering(held)
    assert set(out) == {"eps2"}
    assert out["eps2"]["held"] is True and out["eps2"]["broken"] == []
    assert out["eps2"]["means"]["banded-mf"] == pytest.approx(0.91)
    assert "held" in ftrl.ordering_line("eps2", out["eps2"])
    # ties count as held (>=)
    assert ftrl.ordering([_rec("eps4", a, 0, 0.5) for a in ftrl.ORDERING])["eps4"]["held"]
    broken = [_rec("eps8", "banded-mf", 0, 0.90), _rec("eps8", "tree", 0, 0.85),
              _rec("eps8", "independent", 0, 0.87)]
    out = ftrl.ordering(broken)["eps8"]
    assert out["held"] is False and out["broken"] == [("tree", "independent")]
    line = ftrl.ordering_line("eps8", out)
    assert "did NOT hold" in line and "tree 85.00 < independent 87.00" in line
    # a pair broken is decided even with an arm missing; nothing broken waits for it
    assert ftrl.ordering(broken[1:])["eps8"]["held"] is False
    waiting = ftrl.ordering(held[:3])["eps2"]
    assert waiting["held"] is None and waiting["missing"] == ["independent"]
    assert "not decided yet" in ftrl.ordering_line("eps2", waiting)


def _round_log(run_dir: Path, cohorts: list[list[int]]) -> None:
    run_dir.mkdir(parents=True)
    lines = [{"round": i, "sampled-nodes": [1000 + n for n in nodes],
              "clients": {f"client-{n}": {"status": "accepted"} for n in nodes}}
             for i, nodes in enumerate(cohorts, 1)]
    (run_dir / "rounds.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_participations_are_counted_from_the_round_log(tmp_path):
    _round_log(tmp_path / "run", [[0, 1], [2, 3], [0, 2], [0]])
    seen = ftrl.participations({"run-dir": str(tmp_path / "run")})["participations"]
    assert seen == {"max": 3, "mean": 7 / ftrl.CLIENTS, "max-accepted": 3}
    assert ftrl.participations({"run-dir": str(tmp_path / "gone")}) == {}


def test_table_means_ordering_and_plot_from_records(tmp_path):
    results = tmp_path / "results"
    _round_log(tmp_path / "poisson-run", [[0, 1], [0], [0, 2]])
    accs = {"poisson": (0.95, 0.97), "independent": (0.80, 0.82), "tree": (0.85, 0.87),
            "banded-mf": (0.90, 0.92)}
    for arm, pair in accs.items():
        for seed, acc in enumerate(pair):
            extra = ({"run-dir": str(tmp_path / "poisson-run")} if arm == "poisson" else
                     {"participations": {"max": 5, "mean": 5.0, "max-accepted": 5}})
            write_record(results, f"eps2__{arm}__seed{seed}", _rec("eps2", arm, seed, acc,
                                                                    **extra))
    write_record(results, "eps8__tree__seed0", _rec("eps8", "tree", 0, 0.93))
    text = ftrl.build_table(results, "dpfl reproduce ftrl")
    assert text == (results / "table.md").read_text()
    assert (results / "accuracy-vs-epsilon.png").stat().st_size > 1000
    assert "Command: `dpfl reproduce ftrl`" in text
    assert "| eps2 | independent | 1 | formal | 2 | 1.5 | 82.00 | 5 (5.00) | 10.0 |" in text
    # the poisson arm's participations read from its run directory's round log
    assert "| eps2 | poisson | 0 | formal | 2 | 1.5 | 95.00 | 3 (0.01) | 10.0 |" in text
    assert "| eps8 | tree | 0 | formal | 8 | 6 | 93.00 | — | 10.0 |" in text
    assert "| eps2 | banded-mf | 2 | 91.00 ± 1.41 | 2 | 5 |" in text
    assert "| eps8 | tree | 1 | 93.00 | 8 | — |" in text
    assert ("- eps2 (ε = 2): banded-mf 91.00 ≥ tree 86.00 ≥ independent 81.00 — held"
            in text)
    assert "- eps8 (ε = 8): banded-mf — ≥ tree 93.00 ≥ independent — — not decided yet" in text
    table = json.loads((results / "table.json").read_text())
    assert len(table["runs"]) == 9 and len(table["means"]) == 5
    assert table["ordering"]["eps2"]["held"] is True
    rows = [line for line in text.splitlines() if line.startswith("| eps2 |")]
    # rows in cell, arm (module order), seed order
    assert [r.split(" | ")[1] for r in rows[:8]] == [a for a in ftrl.ARMS for _ in (0, 1)]


def test_an_empty_results_folder_gives_a_table_without_rows(tmp_path):
    (tmp_path / "runs").mkdir()
    text = ftrl.build_table(tmp_path, "dpfl reproduce ftrl")
    assert "- no records yet" in text
    assert not (tmp_path / "accuracy-vs-epsilon.png").exists()
