"""``dpfl privacy-report`` cross-checks the ledger against summary.json, rounds.jsonl and
config.json: every difference is one ``DIFFERENCE`` line and the verdict is
``inconsistent`` (exit code 3); a missing, truncated or non-ledger ledger.json is a
one-line UserError naming the file.

The runs are charged with the real Ledger and real events (a Gaussian update release,
sigma 1.2 under replace-one, i.e. dp-accounting's GaussianDpEvent(0.6)), and written the
way the ServerApp writes them (tests/rundir_helpers.py). Expected epsilons come from
dp-accounting's RdpAccountant built here; they are printed with 6 significant digits."""

import io
import json
import shutil

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

from dpfl.cli import main
from dpfl.errors import UserError
from dpfl.privacy.accounting.ledger import Ledger
from dpfl.privacy.mechanisms.release import GaussianMechanism
from dpfl.privacy_report import (
    EXIT_INCONSISTENT,
    Difference,
    build_privacy_report,
    privacy_report,
    privacy_report_command,
)

from rundir_helpers import RunWriter

D = 1e-5
SIGMA = 1.2
CLIENTS = ["client-0", "client-1", "client-2"]
ROUNDS = 3


def eps(k: int) -> float:
    """dp-accounting's epsilon of k Gaussian releases at multiplier 0.6 (replace-one, 1.2)."""
    acc = RdpAccountant()
    acc.compose(dp_event.GaussianDpEvent(SIGMA / 2), k)
    return acc.get_epsilon(D)


def g(x: float) -> str:
    return f"{x:.6g}"


def _event(r: int):
    mech = GaussianMechanism(SIGMA, sensitivity=1.0, relation="replace-one")
    return mech.release(torch.zeros(4), torch.Generator().manual_seed(r), r)[1]


def _writer(path, rounds=ROUNDS, on_round=None) -> RunWriter:
    """Every client releases one update per round and reports its own epsilon (computed
    independently by dp-accounting, so the ledger records no mismatch)."""
    w = RunWriter(path, Ledger(D, "rdp"))
    for r in range(1, rounds + 1):
        for c in CLIENTS:
            w.charge(c, r, [_event(r)], reported=eps(r))
        w.end_round(r)
        if on_round is not None:
            on_round(w, r)
    return w


@pytest.fixture
def run(tmp_path):
    return _writer(tmp_path / "run").write()


def _differences(path) -> list[str]:
    return [d.line() for d in build_privacy_report(path).differences]


def test_a_consistent_run_keeps_its_verdict(run):
    report = build_privacy_report(run)
    assert report.consistent and report.exit_code == 0 and report.finished
    lines = report.text.splitlines()
    assert lines[0] == "verdict: formal"
    assert lines[1] == ("checked: ledger.json against summary.json, rounds.jsonl and "
                        "config.json: 3 round line(s), 9 charge(s); agrees")
    assert "DIFFERENCE" not in report.text and "inconsistent" not in report.text
    rows = [line for line in lines if line.startswith("│ client-")]
    assert len(rows) == 3 and all(f"{eps(3):.4f}" in row and "formal" in row for row in rows)


def test_an_empty_ledger_is_inconsistent(run):
    Ledger(D, "rdp").save(run / "ledger.json")  # a valid ledger with no clients
    report = build_privacy_report(run)
    assert report.exit_code == EXIT_INCONSISTENT == 3
    assert report.text.splitlines()[0] == (
        "verdict: inconsistent (6 difference(s) between ledger.json and summary.json, "
        "rounds.jsonl and config.json; summary.json records: formal)")
    assert [d.line() for d in report.differences] == (
        [f"DIFFERENCE {c} client: ledger absent vs summary.json present (epsilon {g(eps(3))})"
         for c in CLIENTS]
        + [f"DIFFERENCE {c} client: ledger absent vs rounds.jsonl present (3 charged event(s))"
           for c in CLIENTS])
    assert "verdict: formal" not in report.text


@pytest.mark.parametrize("content, message", [
    (None, "no such file (privacy ledger)"),
    ("", "privacy ledger is empty"),
    ('{"delta": 1e-05, "accountant": "rdp", "clie', ("privacy ledger is damaged (invalid JSON at "
                                                   "line 1, column 39)")),
    ("{}", "not a privacy ledger (no 'delta', 'accountant', 'clients')"),
    ("[]", "not a privacy ledger (a JSON list, not an object)"),
    (('{"delta": 1e-05, "accountant": "rdp", "clients": {"client-0": {"events": [{"round": 1, '
     '"mechanism": "gaussian", "sigma": 1.2, "rate": 2.0}]}}}'),
     "not a valid privacy ledger (ValueError: rate must be in (0, 1] and steps >= 0)"),
    ('{"delta": 1e-05, "accountant": "rpd", "clients": {}}',
     "not a valid privacy ledger (accountant 'rpd' not one of rdp, prv, pld)"),
    ('{"delta": 1e-05, "accountant": "rdp", "clients": {"client-0": {"events": ['
     '{"round": 1, "mechanism": "gaussian", "sigma": 1.2}, '
     '{"round": 2, "mechanism": "dpsgd", "sigma": 1.0, "rate": 0.1}]}}}',
     "not a valid privacy ledger (ValueError: a history mixes sample-level and client-level "
     "events)"),
    ('{"delta": 1e-05, "accountant": "rdp", "clients": {"client-0": 3}}',
     ("not a valid privacy ledger (ValueError: 'clients' must map each client to its 'events' "
     "list)")),
])
def test_a_missing_truncated_or_non_ledger_file_is_a_user_error(run, content, message):
    path = run / "ledger.json"
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    with pytest.raises(UserError) as exc:
        privacy_report(run)
    assert str(exc.value) == f"{path}: {message}"


def test_the_cli_prints_one_line_for_a_truncated_ledger(run, capsys):
    text = (run / "ledger.json").read_text()
    (run / "ledger.json").write_text(text[: len(text) // 2])
    assert main(["privacy-report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / 'ledger.json'}: privacy ledger is damaged (invalid "
                          "JSON at line ") and err.count("\n") == 1


def test_a_charge_missing_from_the_ledger_is_named(run):
    # ledger.json loses client-1's round-2 event (its stored figures stay those of 3 rounds)
    data = json.loads((run / "ledger.json").read_text())
    events = data["clients"]["client-1"]["events"]
    data["clients"]["client-1"]["events"] = [e for e in events if e["round"] != 2]
    (run / "ledger.json").write_text(json.dumps(data))
    assert _differences(run) == [
        (f"DIFFERENCE client-1 recomputed-epsilon (stored): ledger {g(eps(2))} (from its "
        f"events) vs ledger.json {g(eps(3))}"),
        (f"DIFFERENCE client-1 recomputed-epsilon: ledger {g(eps(2))} vs summary.json "
        f"{g(eps(3))}"),
        "DIFFERENCE client-1 rounds: ledger [1, 3] vs summary.json [1, 2, 3]",
        ("DIFFERENCE client-1 round 2 charge [gaussian sigma=1.2 x1 (replace-one)]: ledger 0x "
        "vs rounds.jsonl 1x"),
    ]
    # the client's own report (3 rounds) keeps its figure: epsilon itself agrees
    row = [line for line in privacy_report(run).splitlines() if line.startswith("│ client-1 ")]
    assert f"│ 1e-05 │ {eps(3):7.4f} │      2 │" in row[0]


def test_summary_epsilon_and_client_set(tmp_path):
    run = _writer(tmp_path / "a").write()
    summary = json.loads((run / "summary.json").read_text())
    summary["clients"]["client-0"]["epsilon"] = 1.5
    (run / "summary.json").write_text(json.dumps(summary))
    assert _differences(run) == [(f"DIFFERENCE client-0 epsilon: ledger {g(eps(3))} vs "
                                 "summary.json 1.5")]
    # a client the ledger holds but summary.json does not
    w = _writer(tmp_path / "b")
    run = w.write()
    w.charge("client-3", 3, [_event(3)], logged=False)
    w.ledger.save(run / "ledger.json")
    assert _differences(run) == [(f"DIFFERENCE client-3 client: ledger present (epsilon "
                                 f"{g(eps(1))}) vs summary.json absent")]


def test_the_last_round_epsilon_may_not_exceed_the_ledger(run):
    lines = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]

    def rewrite(value):
        lines[-1]["epsilon"]["client-2"] = value
        (run / "rounds.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))

    rewrite(eps(2))  # below the ledger: allowed
    assert _differences(run) == []
    rewrite(eps(3) * 1.01)
    assert _differences(run) == [(f"DIFFERENCE client-2 epsilon after round 3: ledger "
                                 f"{g(eps(3))} vs rounds.jsonl {g(eps(3) * 1.01)} (more than "
                                 "the ledger)")]
    rewrite(eps(3) * (1 + 1e-9))  # within the relative tolerance 1e-6
    assert _differences(run) == []


def test_more_charges_in_the_ledger_are_not_an_inconsistency(tmp_path):
    # a resumed round charged again (client-0, round 2) and a reply charged after the last
    # round line (client-2): in the ledger, not in rounds.jsonl
    def extra(w, r):
        if r == 2:
            w.charge("client-0", 2, [_event(2)], logged=False)

    w = _writer(tmp_path / "run", on_round=extra)
    w.charge("client-2", 3, [_event(3)], logged=False)
    run = w.write()
    report = build_privacy_report(run)
    assert report.consistent, report.text
    assert w.ledger.epsilons()["client-0"] == pytest.approx(eps(4), rel=1e-9)


def test_an_unfinished_run_is_checked_against_rounds_only(tmp_path):
    def keep(w, r):
        if r == 2:
            w.path.mkdir(parents=True, exist_ok=True)
            w.ledger.save(w.path / "ledger-after-2.json")

    run = _writer(tmp_path / "run", on_round=keep).write(summary=False)
    report = build_privacy_report(run)
    assert report.consistent and not report.finished
    assert report.text.splitlines()[:2] == [
        "verdict: unknown (no summary.json)",
        ("checked: ledger.json against rounds.jsonl and config.json only (no summary.json: "
        "unfinished or killed run): 3 round line(s), 9 charge(s); agrees")]
    # killed after round 3's line was written but before the ledger was saved again
    shutil.copy(run / "ledger-after-2.json", run / "ledger.json")
    report = build_privacy_report(run)
    assert report.text.splitlines()[0] == (
        "verdict: inconsistent (6 difference(s) between ledger.json and rounds.jsonl and "
        "config.json only; no summary.json: unfinished or killed run)")
    expected = []
    for c in CLIENTS:
        expected += [(f"DIFFERENCE {c} round 3 charge [gaussian sigma=1.2 x1 (replace-one)]: "
                     "ledger 0x vs rounds.jsonl 1x"),
                     (f"DIFFERENCE {c} epsilon after round 3: ledger {g(eps(2))} vs "
                     f"rounds.jsonl {g(eps(3))} (more than the ledger)")]
    assert [d.line() for d in report.differences] == expected


def test_run_settings_and_the_command_exit_code(run):
    (run / "config.json").write_text(json.dumps({"delta": D, "accountant": "pld"}))
    out = io.StringIO()
    assert privacy_report_command(run, out=out) == EXIT_INCONSISTENT
    text = out.getvalue()
    assert "DIFFERENCE run accountant: ledger rdp vs config.json pld" in text.splitlines()
    assert text.count("│ inconsistent │") == 3  # every client's row
    assert build_privacy_report(run).differences == [
        Difference("run", "accountant", "rdp", "config.json", "pld")]
    (run / "config.json").write_text(json.dumps({"delta": D, "accountant": "rdp"}))
    out = io.StringIO()
    assert privacy_report_command(run, out=out) == 0
    assert out.getvalue().startswith("verdict: formal\n")


def test_damaged_round_log_and_summary_are_named(run):
    rounds = run / "rounds.jsonl"
    text = rounds.read_text()
    rounds.write_text(text[:-40] + "\n")  # the last COMPLETE line cut short (a partial
    with pytest.raises(UserError, match=r"rounds\.jsonl: line 3 is damaged \(invalid JSON at "
                                        r"column \d+\)$"):   # one, no newline, is dropped)
        privacy_report(run)
    rounds.write_text(text + '{"round": "four"}\n')
    with pytest.raises(UserError, match=r"rounds\.jsonl: line 4 is not a round record \(no "
                                        r"integer 'round'\)$"):
        privacy_report(run)
    rounds.unlink()
    with pytest.raises(UserError, match=r"rounds\.jsonl: no such file \(round log\)$"):
        privacy_report(run)
    rounds.write_text(text)
    (run / "summary.json").write_text(json.dumps({"guarantee": {
        "verdict": "formal", "scope": "s", "relation": "r", "sampling": "none"}}))
    with pytest.raises(UserError, match=r"summary\.json: not a run summary \(no 'clients'"):
        privacy_report(run)


def test_a_read_only_run_folder_gets_its_report_without_the_plot(run, capsys, monkeypatch):
    """privacy-report writes privacy-report.png into RUN_DIR; where it cannot (a read-only
    copy of a run: root ignores chmod, so the write check fails here by hand) it still
    prints the report and says why there is no plot."""
    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("dpfl.errors.tempfile.mkstemp", read_only)
    assert main(["privacy-report", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verdict: formal\n")
    assert (f"plot: not written (cannot write in {run}: Read-only file system)"
            in " ".join(out.split()))   # the report's console wraps long lines
    assert not (run / "privacy-report.png").exists()


def test_a_partial_last_round_line_is_read_as_a_resume_reads_it(tmp_path, caplog):
    """Issue 50.5: the report refused a killed run (a partial last line in rounds.jsonl)
    that resume=true accepts, dropping it with a warning. One rule for both now; a damaged
    COMPLETE line is still an error naming it."""
    import logging

    from dpfl.errors import UserError
    from dpfl.server.rundir import RunDir

    run = _writer(tmp_path / "run").write(summary=False)
    with open(run / "rounds.jsonl", "a") as f:
        f.write('{"round": 4, "epsilon": {"client-0"')        # the kill, mid-append
    with caplog.at_level(logging.WARNING, logger="flwr"):
        report = build_privacy_report(run)
    assert report.consistent and "3 round line(s)" in report.text
    assert any("partial last line" in r.getMessage() for r in caplog.records)
    assert len(RunDir(run).read_rounds()) == 3                    # what a resume reads
    text = (run / "rounds.jsonl").read_text().split("\n")
    text[1] = text[1][:20]
    (run / "rounds.jsonl").write_text("\n".join(text) + "\n")
    with pytest.raises(UserError, match="line 2 is damaged"):
        build_privacy_report(run)
