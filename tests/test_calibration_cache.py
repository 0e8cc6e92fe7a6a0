"""The on-disk memo of calibrated sigmas: a hit gives the bit-identical answer of a fresh
calibration without the bisection, and is used only after the accounting function confirms
it meets the target; damaged, tampered or foreign entries cost a recalibration, never
privacy."""

from __future__ import annotations

import json
import logging
import os

import pytest

from dpfl import memo
from dpfl.privacy.accounting import accountants as accounting
from dpfl.privacy.accounting import calibration_cache

QUESTION = dict(target_epsilon=4.0, delta=1e-5, sample_rate=0.04, steps=50, accountant="pld")


@pytest.fixture
def memo_folder(tmp_path, monkeypatch):
    """A fresh memo folder, in-process caches cleared, and a count of bisections run."""
    monkeypatch.setenv(memo.CACHE_ENV, str(tmp_path))
    accounting.calibrate_dpsgd_noise.cache_clear()
    searches = []
    search = accounting._search_pld

    def counted(*args, **kwargs):
        searches.append(args)
        return search(*args, **kwargs)

    monkeypatch.setattr(accounting, "_search_pld", counted)
    yield tmp_path / calibration_cache.KIND, searches
    accounting.calibrate_dpsgd_noise.cache_clear()


def _calibrate() -> float:
    accounting.calibrate_dpsgd_noise.cache_clear()   # only the disk memo may answer
    return accounting.calibrate_dpsgd_noise(**QUESTION)


def _entries(folder):
    return sorted(folder.glob("*.json"))


def test_a_hit_is_the_fresh_answer_without_the_bisection(memo_folder):
    folder, searches = memo_folder
    sigma = _calibrate()
    assert len(searches) == 1 and len(_entries(folder)) == 1
    assert _calibrate() == sigma and len(searches) == 1          # bit-identical, no search
    eps = accounting.dpsgd_epsilon(0.04, sigma, 50, 1e-5, "pld")
    assert eps <= 4.0 < accounting.dpsgd_epsilon(0.04, sigma * (1 - 1e-3), 50, 1e-5, "pld")


def test_another_question_misses(memo_folder):
    folder, searches = memo_folder
    _calibrate()
    accounting.calibrate_dpsgd_noise(3.0, 1e-5, 0.04, 50, "pld")
    accounting.calibrate_dpsgd_noise(4.0, 1e-5, 0.04, 60, "pld")
    assert len(searches) == 3 and len(_entries(folder)) == 3


def test_a_tampered_sigma_below_the_target_is_recalibrated(memo_folder, caplog):
    folder, searches = memo_folder
    sigma = _calibrate()
    [path] = _entries(folder)
    entry = json.loads(path.read_text())
    entry["sigma"] = (sigma / 2).hex()      # would overspend: eps(sigma/2) > 4
    path.write_text(json.dumps(entry))
    caplog.set_level(logging.WARNING, logger="flwr.dpfl.accounting")
    assert _calibrate() == sigma and len(searches) == 2
    assert any("above the target epsilon" in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text())["sigma"] == sigma.hex()   # the entry is mended


@pytest.mark.parametrize("damage", ["garbage", "{}", '{"key": 1, "sigma": "nan"}', ""])
def test_a_damaged_entry_is_a_miss(memo_folder, damage):
    folder, searches = memo_folder
    sigma = _calibrate()
    [path] = _entries(folder)
    path.write_text(damage)
    assert _calibrate() == sigma and len(searches) == 2


def test_another_code_version_misses(memo_folder, monkeypatch):
    folder, searches = memo_folder
    _calibrate()
    monkeypatch.setattr(accounting, "memo_version", lambda: "dp-accounting 9.9")
    _calibrate()
    assert len(searches) == 2 and len(_entries(folder)) == 2


@pytest.mark.parametrize("setting", ["off", ""])
def test_turned_off_nothing_is_kept(tmp_path, monkeypatch, setting):
    monkeypatch.setenv(memo.CACHE_ENV, setting)
    assert memo.memo_dir(calibration_cache.KIND) is None
    calibration_cache.store("k", 1.5)
    assert calibration_cache.lookup("k") is None


def test_default_folder_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv(memo.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert memo.memo_dir(calibration_cache.KIND) == tmp_path / "dpfl" / "calibration"


def test_an_unwritable_folder_only_loses_the_memo(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(memo.CACHE_ENV, str(blocker))
    calibration_cache.store("k", 1.5)            # no error
    assert calibration_cache.lookup("k") is None
    accounting.calibrate_dpsgd_noise.cache_clear()
    assert accounting.calibrate_dpsgd_noise(**QUESTION) > 0


def test_client_level_calibrations_are_kept_too(memo_folder):
    folder, searches = memo_folder
    args = (2.0, 1e-5, 20)
    kwargs = dict(sampling_rate=0.5, sampling="poisson", accountant="pld")
    accounting.calibrate_noise.cache_clear()
    sigma = accounting.calibrate_noise(*args, **kwargs)
    accounting.calibrate_noise.cache_clear()
    assert accounting.calibrate_noise(*args, **kwargs) == sigma and len(searches) == 1
    accounting.calibrate_noise.cache_clear()
    accounting.calibrate_noise(*args, **{**kwargs, "relation": "replace-one",
                                          "sampling": "none", "sampling_rate": 1.0})
    assert len(searches) == 2


# -- an entry is checked against what it claims: the smallest sigma meeting the target ------

def _warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING
            and r.name == "flwr.dpfl.accounting"]


def test_a_planted_sigma_ten_times_the_answer_is_detected_and_not_used(memo_folder, caplog):
    """A sigma x10 meets the target (more noise), so the old check passed it and every run
    of that question silently trained with ten times the noise. It is not the smallest:
    eps(10 sigma (1 - rel_tol)) still meets the target. One WARNING names the file and the
    key; the entry is discarded, the answer calibrated afresh and kept instead."""
    folder, searches = memo_folder
    sigma = _calibrate()
    [path] = _entries(folder)
    entry = json.loads(path.read_text())
    entry["sigma"] = (10 * sigma).hex()
    path.write_text(json.dumps(entry))
    caplog.set_level(logging.WARNING, logger="flwr.dpfl.accounting")
    assert _calibrate() == sigma and len(searches) == 2
    [warning] = _warnings(caplog)
    message = warning.getMessage()
    assert str(path) in message and repr(entry["key"]) in message
    assert "not the smallest" in message and "discarded" in message
    assert json.loads(path.read_text())["sigma"] == sigma.hex()
    caplog.clear()
    assert _calibrate() == sigma and len(searches) == 2 and not _warnings(caplog)


def _synthetic(monkeypatch, tmp_path):
    """memoised on eps(sigma) = 1 / sigma (target 1: the answer is 1), counting
    evaluations and searches."""
    monkeypatch.setenv(memo.CACHE_ENV, str(tmp_path))
    calls = {"eps": 0, "search": 0}

    def eps(sigma):
        calls["eps"] += 1
        return 1.0 / sigma

    def search(answer=1.0005):      # the smallest to 1e-3: eps(answer (1 - 1e-3)) > 1
        calls["search"] += 1
        return answer

    return calls, eps, search


def test_a_hit_costs_two_evaluations_and_both_halves_are_checked(monkeypatch, tmp_path,
                                                                 caplog):
    calls, eps, search = _synthetic(monkeypatch, tmp_path)
    assert calibration_cache.memoised("q", eps, 1.0, search, tolerance=1e-3) == 1.0005
    assert calls == {"eps": 1, "search": 1}         # the fresh answer's minimality only
    calls.update(eps=0, search=0)
    assert calibration_cache.memoised("q", eps, 1.0, search, tolerance=1e-3) == 1.0005
    assert calls == {"eps": 2, "search": 0}         # a hit: two evaluations, no search
    caplog.set_level(logging.WARNING, logger="flwr.dpfl.accounting")
    for planted, why in ((10.0, "not the smallest"), (1.01, "not the smallest"),
                         (0.5, "above the target epsilon")):
        calibration_cache.store("q", planted)
        caplog.clear()
        assert calibration_cache.memoised("q", eps, 1.0, search, tolerance=1e-3) == 1.0005
        [warning] = _warnings(caplog)
        assert why in warning.getMessage() and "'q'" in warning.getMessage()
        assert calibration_cache.lookup("q") == 1.0005      # mended


def test_a_fresh_answer_that_is_not_minimal_is_not_kept(monkeypatch, tmp_path):
    """A search whose answer fails the minimality check (an accountant not monotone
    there) is used but not kept: otherwise every later read would flag it."""
    calls, eps, _ = _synthetic(monkeypatch, tmp_path)
    assert calibration_cache.memoised("q", eps, 1.0, lambda: 1.5, tolerance=1e-3) == 1.5
    assert calibration_cache.lookup("q") is None


@pytest.mark.parametrize("content", ["garbage", '{"key": "other", "sigma": "0x1.0p+0"}',
                                     '{"key": "q", "sigma": "-0x1.0p+0"}'])
def test_an_unreadable_or_foreign_entry_is_logged_and_discarded(monkeypatch, tmp_path, caplog,
                                                                content):
    _synthetic(monkeypatch, tmp_path)
    path = memo.entry_file(calibration_cache.KIND, "q", calibration_cache.SUFFIX)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    caplog.set_level(logging.WARNING, logger="flwr.dpfl.accounting")
    assert calibration_cache.lookup("q") is None
    [warning] = _warnings(caplog)
    assert str(path) in warning.getMessage() and not path.exists()


# -- within one launch: one process checks, the others take its proof ------------------------


def _launch(monkeypatch, secret: str = "ab" * 32) -> None:
    monkeypatch.setenv(memo.PROOF_ENV, secret)


def test_an_answer_checked_in_this_launch_is_not_evaluated_again(monkeypatch, tmp_path):
    calls, eps, search = _synthetic(monkeypatch, tmp_path)
    _launch(monkeypatch)
    assert calibration_cache.memoised("q", eps, 1.0, search, tolerance=1e-3) == 1.0005
    assert calls == {"eps": 1, "search": 1}
    calls.update(eps=0, search=0)
    assert calibration_cache.memoised("q", eps, 1.0, search, tolerance=1e-3) == 1.0005
    assert calls == {"eps": 0, "search": 0}         # proven: no evaluation at all
    _launch(monkeypatch, "cd" * 32)                  # the next launch checks it again, once
    assert calibration_cache.memoised("q", eps, 1.0, search, tolerance=1e-3) == 1.0005
    assert calibration_cache.memoised("q", eps, 1.0, search, tolerance=1e-3) == 1.0005
    assert calls == {"eps": 2, "search": 0}
    monkeypatch.delenv(memo.PROOF_ENV)               # no launch: every read is checked
    assert calibration_cache.memoised("q", eps, 1.0, search, tolerance=1e-3) == 1.0005
    assert calls == {"eps": 4, "search": 0}


@pytest.mark.parametrize("planted,why", [(10.0, "not the smallest"),
                                         (0.5, "above the target epsilon")])
def test_a_proof_binds_the_answer_a_changed_entry_is_checked(monkeypatch, tmp_path, caplog,
                                                              planted, why):
    """A proof covers the kind, the key and the exact sigma under the launch's secret: an
    entry planted after its check (or a proof copied to another key, or a secret too short
    to be one) proves nothing, and the planted sigma is caught as without proofs."""
    calls, eps, search = _synthetic(monkeypatch, tmp_path)
    _launch(monkeypatch)
    calibration_cache.memoised("q", eps, 1.0, search, tolerance=1e-3)
    calibration_cache.store("q", planted)
    caplog.set_level(logging.WARNING, logger="flwr.dpfl.accounting")
    assert calibration_cache.memoised("q", eps, 1.0, search, tolerance=1e-3) == 1.0005
    [warning] = _warnings(caplog)
    assert why in warning.getMessage()
    answer = (1.0005).hex().encode()
    assert memo.proven(calibration_cache.KIND, "q", answer)
    assert not memo.proven(calibration_cache.KIND, "q", planted.hex().encode())
    proof = memo.entry_file(calibration_cache.KIND, "q", memo.PROOF_SUFFIX)
    other = memo.entry_file(calibration_cache.KIND, "r", memo.PROOF_SUFFIX)
    other.write_bytes(proof.read_bytes())
    assert not memo.proven(calibration_cache.KIND, "r", answer)
    assert not memo.proven("partitions", "q", answer)
    _launch(monkeypatch, "ab" * 8)                    # 8 bytes: not a secret
    assert not memo.proven(calibration_cache.KIND, "q", answer)


def test_processes_of_a_launch_check_an_entry_once_between_them(monkeypatch, tmp_path):
    """Three processes of one launch read the same entry at once: one checks it (two
    evaluations), the others wait on its lock and take its proof (none). Evaluations are
    counted in a file, each slow enough for the processes to meet at the lock."""
    import multiprocessing
    import time

    _synthetic(monkeypatch, tmp_path)
    calibration_cache.store("q", 1.0005)
    _launch(monkeypatch)
    log = tmp_path / "evaluations"
    start = multiprocessing.get_context("fork").Barrier(3)

    def one_process() -> None:
        def eps(sigma):
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
            time.sleep(0.3)
            return 1.0 / sigma

        start.wait()
        assert calibration_cache.memoised("q", eps, 1.0, lambda: 99.0, tolerance=1e-3) == 1.0005

    processes = [multiprocessing.get_context("fork").Process(target=one_process)
                 for _ in range(3)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(30)
    assert [p.exitcode for p in processes] == [0, 0, 0]
    checkers = log.read_text().split()
    assert len(checkers) == 2 and len(set(checkers)) == 1   # both halves, by one process
