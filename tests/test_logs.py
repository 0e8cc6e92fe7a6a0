"""Each dpfl log line is printed once, even after Opacus configured the root logger."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A fresh interpreter, as the ServerApp process: Flower's logger, then Opacus imported
# (its module_utils calls logging.basicConfig), then one dpfl line and one library warning.
SCRIPT = """
import logging
import flwr.common.logger
{setup}
import opacus.utils.module_utils
logging.getLogger("flwr.dpfl.test").info("dpfl line %d", 7)
logging.getLogger("flwr").info("flower line")
logging.getLogger("some.library").warning("library warning")
"""


def _run(setup: str) -> str:
    code = textwrap.dedent(SCRIPT.format(setup=setup))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_without_the_guard_opacus_makes_every_line_print_twice():
    """The bug itself, so the test below can fail: Flower's handler plus Opacus's."""
    out = _run("")
    assert out.count("dpfl line 7") == 2
    assert out.count("flower line") == 2


def test_each_line_is_printed_once_and_library_warnings_still_show():
    out = _run("from dpfl.logs import get_logger\nget_logger('flwr.dpfl.server')")
    assert out.count("dpfl line 7") == 1
    assert out.count("flower line") == 1
    assert out.count("library warning") == 1
    assert "WARNING some.library: library warning" in out


def test_a_configured_root_logger_is_left_alone():
    import logging

    from dpfl.logs import guard_root

    root = logging.getLogger()
    before = list(root.handlers)
    probe = logging.NullHandler()
    root.addHandler(probe)
    try:
        guard_root()
        assert root.handlers == before + [probe]
    finally:
        root.removeHandler(probe)


def test_only_flwr_dpfl_names():
    from dpfl.logs import get_logger

    with pytest.raises(ValueError):
        get_logger("dpfl.server")


# -- the known third-party warnings: filtered precisely, the same everywhere ------------------


def _examples():
    """(message, category, module) of each known warning as its library emits it."""
    from dpfl.logs import KNOWN_WARNINGS

    for known in KNOWN_WARNINGS:
        text = (known.example or known.message) + " (the rest of the message)"
        for module in known.modules or ("dpfl.client.trainers",):   # none: the caller's
            yield text, known.category, module


def test_pyproject_filters_each_known_warning_and_nothing_broader():
    """pytest's filterwarnings (pyproject) ignore each of dpfl.logs.KNOWN_WARNINGS, and each
    filter there is an ``ignore`` of a message with a category (no blanket ignore)."""
    import re
    import tomllib

    from _pytest.config import parse_warning_filter

    lines = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["filterwarnings"]
    filters = [parse_warning_filter(line, escape=False) for line in lines]
    for action, message, category, module, _ in filters:
        assert action == "ignore" and len(message) >= 10 and category is not Warning, \
            (message, category)

    def ignored(text: str, cat: type[Warning], mod: str) -> bool:
        return any(re.match(message, text, re.I) and issubclass(cat, category)
                   and re.match(module or "", mod) for _, message, category, module, _ in filters)

    for text, category, module in _examples():
        assert ignored(text, category, module), (text, module)
        assert not ignored(text, category, "somewhere.else") or module == "dpfl.client.trainers"
        assert not ignored("Some other message", category, module)
    assert len(filters) == len(lines)


def test_the_known_warnings_are_filtered_and_nothing_else():
    """In this process (quiet_known_warnings) and in a child through PYTHONWARNINGS
    (known_warnings_option, as the launcher sets it): each known warning is silenced where
    its library emits it; the same text from another module, and any other warning, shows."""
    import os
    import warnings

    from dpfl.logs import known_warnings_option, quiet_known_warnings

    cases = [(text, category.__name__, module) for text, category, module in _examples()]
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        quiet_known_warnings()
        for text, category, module in _examples():
            warnings.warn_explicit(text, category, "f.py", 1, module=module)
            if module != "dpfl.client.trainers":
                warnings.warn_explicit(text, category, "f.py", 2, module=module + "x")
        warnings.warn_explicit("an unknown warning", UserWarning, "f.py", 3, module="opacus")
    shown = sorted(str(w.message) for w in seen)
    expected = sorted([text for text, _, module in cases if module != "dpfl.client.trainers"]
                      + ["an unknown warning"])
    assert shown == expected
    code = ("import warnings, builtins\n"
            f"for text, cat, mod in {cases!r}:\n"
            "    warnings.warn_explicit(text, getattr(builtins, cat), 'f.py', 1, module=mod)\n"
            "warnings.warn_explicit('an unknown warning', UserWarning, 'f.py', 3, module='x')\n")
    env = {**os.environ, "PYTHONWARNINGS": known_warnings_option("always")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0 and "Invalid -W option" not in done.stderr, done.stderr
    assert [line for line in done.stderr.splitlines() if "Warning: " in line] == \
        ["f.py:3: UserWarning: an unknown warning"]


def test_flowers_routine_actor_termination_record_is_dropped_and_nothing_else(caplog):
    import logging

    from dpfl.logs import RoutineFlowerRecords, quiet_routine_flower_records

    flower = logging.getLogger("flwr")
    saved = list(flower.filters)   # dpfl.apps may have installed it already
    try:
        flower.filters[:] = [f for f in saved if not isinstance(f, RoutineFlowerRecords)]
        quiet_routine_flower_records()
        quiet_routine_flower_records()
        assert sum(isinstance(f, RoutineFlowerRecords) for f in flower.filters) == 1
        with caplog.at_level(logging.INFO, logger="flwr"):
            flower.warning("Manually terminating %s", "ClientAppActor")
            flower.warning("Manually terminating %s", "OtherActor")
            flower.info("Manually terminating %s", "ClientAppActor")
            flower.warning("fraction_train is set to 0.0.")
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("WARNING", "Manually terminating OtherActor"),
            ("INFO", "Manually terminating ClientAppActor"),
            ("WARNING", "fraction_train is set to 0.0.")]
    finally:
        flower.filters[:] = saved


def test_flowers_empty_info_spacer_record_is_dropped(caplog):
    """Flower's ``log(INFO, "")`` (an ``INFO :`` line with nothing after it) is dropped where
    dpfl's filter is installed; an empty text with arguments or at another level is kept."""
    import logging

    from dpfl.logs import RoutineFlowerRecords

    flower = logging.getLogger("flwr")
    saved = list(flower.filters)
    try:
        flower.filters[:] = [RoutineFlowerRecords()]
        with caplog.at_level(logging.INFO, logger="flwr"):
            flower.info("")
            flower.info("%s", "round 1")
            flower.warning("")
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("INFO", "round 1"), ("WARNING", "")]
    finally:
        flower.filters[:] = saved


def _as_flower_prints(msg: str, *args: object, level: int = 20) -> str:
    """A record as Flower 1.39's console handler prints it (colours on, as `flwr run
    --stream` relays it)."""
    import logging

    from flwr.supercore.logger import ConsoleHandler

    handler = ConsoleHandler(timestamps=False, json=False, colored=True)
    return handler.format(logging.makeLogRecord({
        "levelno": level, "levelname": logging.getLevelName(level), "msg": msg,
        "args": args})) + "\n"


def test_the_launcher_drops_flowers_federation_size_advice_and_empty_lines():
    """`dpfl simulate` relays `flwr run --stream` without the lines Flower's simulation
    process logs before any app code (flwr/simulation/app.py, flwr_simulation): its
    advice to resize with `flwr federation simulation-config` (dpfl's size is --clients)
    and its empty INFO spacer; the federation's size line and everything else are kept."""
    import io

    from dpfl.runtime.launch import relay_stream

    dropped = [
        # Flower 1.39's own format strings and arguments (flwr/simulation/app.py)
        _as_flower_prints("To change federation size, use the following command:"),
        _as_flower_prints("\tflwr federation simulation-config %s <superlink> "
                          "--num-supernodes <N>", "@none/default"),
        _as_flower_prints(""),
        _as_flower_prints("Since flwr 1.32, default simulated SuperNodes changed from 10 to "
                          "2.", level=30),
    ]
    kept = [
        _as_flower_prints("Federation `%s` (%s simulated SuperNodes)", "@none/default", 4),
        _as_flower_prints("[round 1/1] accuracy 0.7083"),
        _as_flower_prints("To change federation size, ask dpfl"),
    ]
    stream = io.BytesIO("".join([kept[0], *dropped, kept[1], kept[2]]).encode())
    out = io.BytesIO()
    relay_stream(stream, out)
    assert out.getvalue().decode() == "".join(kept)


def test_dpfls_internal_engine_note_is_not_an_info_line():
    """"Flower's simulation state indexes its instructions by node" is an internal detail:
    logged at DEBUG, not printed by a default run."""
    import inspect

    from dpfl.apps import server

    source = inspect.getsource(server._speed_up_simulation_engine)
    assert 'log.debug("Flower\'s simulation state indexes' in source
    assert "log.info(" not in source


def test_the_shipped_flower_config_uses_no_deprecated_options(tmp_path, monkeypatch, capsys):
    """deploy/flwr-config.toml, read by Flower 1.39's own loader: both connections, no
    `options.` (Flower warns at every `flwr run` that reads them)."""
    import shutil
    from pathlib import Path

    from flwr.cli.flower_config import read_superlink_connection
    from flwr.cli.run.run import _parse_federation_config_overrides

    root = Path(__file__).resolve().parents[1]
    shutil.copy(root / "deploy" / "flwr-config.toml", tmp_path / "config.toml")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    local = read_superlink_connection(None)
    assert local.name == "local" and local.address == ":local:" and local.options is None
    deployment = read_superlink_connection("deployment")
    assert deployment.address == "127.0.0.1:9093" and deployment.options is None
    sim = _parse_federation_config_overrides(
        ["num-supernodes=4 client-resources-num-cpus=1"], local)
    assert sim.num_supernodes == 4
    out = capsys.readouterr()
    assert "deprecated" not in out.out + out.err
