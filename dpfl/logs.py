"""dpfl's loggers: children of Flower's ``flwr`` logger, printed once.

Flower prints ``flwr.*`` records with its own console handler, and the ``flwr`` logger
propagates to the root logger. Opacus calls ``logging.basicConfig`` when it is imported
(``opacus.utils.module_utils``), which gives the root logger a stderr handler with a date
prefix: from then on every Flower and dpfl line was printed twice (``flwr run --stream``
forwards both streams of the ServerApp process). :func:`get_logger` gives the root logger a
handler first, so ``basicConfig`` leaves it alone; that handler skips ``flwr.*`` records
(Flower's handler printed them) and prints other libraries' warnings to stderr, as Python's
last-resort handler would have.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

FLOWER = "flwr"


class NotFlower(logging.Filter):
    """Passes records of every logger outside Flower's ``flwr`` tree."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != FLOWER and not record.name.startswith(FLOWER + ".")


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (as Python's
    last-resort handler does), so a later redirection of stderr is followed."""

    def __init__(self, level: int = logging.NOTSET) -> None:
        logging.Handler.__init__(self, level)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


def guard_root() -> None:
    """Give an unconfigured root logger a stderr handler (WARNING and up) that skips
    ``flwr.*`` records; a root logger someone already configured is left alone."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = StderrHandler(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(NotFlower())
    root.addHandler(handler)


class RoutineFlowerRecords(logging.Filter):
    """Drops the Flower records that say nothing to a dpfl user, each by level, format string
    and arguments: ``Manually terminating ClientAppActor`` is logged (WARNING) by every Ray
    actor of a simulation when the simulation ends normally (flwr 1.39,
    ``flwr/simulation/ray_transport/ray_actor.py``, ``terminate``); ``log(INFO, "")`` is
    Flower's spacer between its own blocks (an ``INFO :`` line with nothing after it).
    (The lines Flower's simulation process logs before any app code runs are dropped where
    ``dpfl simulate`` relays them: ``dpfl.runtime.launch.DROPPED_FLOWER_LINES``.)"""

    ROUTINE = frozenset({(logging.WARNING, "Manually terminating %s", ("ClientAppActor",)),
                         (logging.INFO, "", ())})

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        try:
            return (record.levelno, record.msg, args) not in self.ROUTINE
        except TypeError:   # unhashable arguments (e.g. Flower logs a list): not routine
            return True


def quiet_routine_flower_records() -> None:
    """Install :class:`RoutineFlowerRecords` on Flower's ``flwr`` logger (once)."""
    flower = logging.getLogger(FLOWER)
    if not any(isinstance(f, RoutineFlowerRecords) for f in flower.filters):
        flower.addFilter(RoutineFlowerRecords())


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` for a ``flwr.dpfl.*`` name, after :func:`guard_root`."""
    if not name.startswith(FLOWER + ".dpfl"):
        raise ValueError(f"dpfl loggers live under 'flwr.dpfl', got {name!r}")
    guard_root()
    return logging.getLogger(name)


# -- third-party warnings known to be harmless -----------------------------------------------
#
# Filtered precisely (the start of the message, the category and the module the warning is
# attributed to), never by a blanket ignore: in this process by :func:`quiet_known_warnings`
# (the ClientApp and ServerApp, wherever they run), in every Flower process `dpfl simulate`
# starts by ``PYTHONWARNINGS`` (:func:`known_warnings_option`), and in the test suite by the
# same entries in pyproject's ``[tool.pytest.ini_options] filterwarnings``
# (tests/test_logs.py checks that each entry here is there). A warning not listed is shown.


@dataclass(frozen=True)
class KnownWarning:
    """One harmless third-party warning: ``message`` is the literal start of its text (no
    ':' or ',', which PYTHONWARNINGS cannot carry), ``modules`` the modules it is attributed
    to (empty: any, for a warning attributed to whoever called the library)."""

    message: str
    category: type[Warning]
    modules: tuple[str, ...]
    why: str
    example: str = ""   # the message as the library words it, when ``message`` is shorter


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning("Secure RNG turned off", UserWarning, ("opacus.privacy_engine",),
                 "Opacus warns at every PrivacyEngine(secure_mode=False); secure_mode needs "
                 "torchcsprng, which cannot be installed here, and every guarantee text states "
                 "that the noise comes from a PRNG, not a CSPRNG"),
    KnownWarning("Optimal order is the largest alpha", UserWarning,
                 ("opacus.accountants.analysis.rdp",),
                 "Opacus' RDP accountant: its bound is best at the largest order it tries, so "
                 "the RDP epsilon is looser than it could be (still an upper bound); dpfl's "
                 "default accountant is PLD, RDP a cross-check or fallback"),
    KnownWarning("Full backward hook is firing when gradients are computed with respect to "
                 "module outputs since no inputs require gradients", UserWarning, (),
                 "torch 2.14 on Opacus' per-sample-gradient hooks at the first layer (its "
                 "input needs no gradient); the hooks use the output gradients only "
                 "(tests compare them with a per-example loop); attributed to the caller"),
    KnownWarning("Tip", FutureWarning, ("ray._private.worker",),
                 "Ray 2.55 announces that a future Ray will stop hiding GPUs from actors with "
                 "num_gpus=0; its only FutureWarning starting 'Tip'. Today's behaviour (clients "
                 "without a GPU share see none) is the one dpfl wants, so the opt-in variable "
                 "is not set",
                 example="Tip: In future versions of Ray, Ray will no longer override "
                         "accelerator visible devices env var if num_gpus=0"),
    KnownWarning("'click.utils.get_binary_stream' is deprecated", DeprecationWarning,
                 ("typer",), "typer 0.20 (Flower's CLI) imports a click 8.5 name deprecated "
                 "for click 9; dpfl never calls it"),
    KnownWarning("'click.utils.get_text_stream' is deprecated", DeprecationWarning,
                 ("typer",), "as above"),
    KnownWarning("The 'is_flag' and 'flag_value' parameters are not supported by Typer",
                 DeprecationWarning, ("typer.params",),
                 "an option declaration inside Flower's CLI, for typer's maintainers"),
    KnownWarning("GitWildMatchPattern ('gitwildmatch') is deprecated", DeprecationWarning,
                 ("pathspec.pathspec", "pathspec.pattern"),
                 "flwr 1.39's FAB builder names pathspec's 'gitwildmatch' patterns, renamed "
                 "'gitignore' in pathspec 1.0 with the same matching"),
)


def _filters() -> Iterator[tuple[str, type[Warning], str]]:
    for known in KNOWN_WARNINGS:
        for module in known.modules or ("",):
            yield known.message, known.category, module


def quiet_known_warnings() -> None:
    """Ignore each of :data:`KNOWN_WARNINGS` in this process (as PYTHONWARNINGS would: the
    message's start, case-insensitive; the exact module). Idempotent."""
    for message, category, module in _filters():
        warnings.filterwarnings("ignore", message=re.escape(message), category=category,
                                module=re.escape(module) + r"\Z" if module else "")


def known_warnings_option(current: str = "") -> str:
    """A ``PYTHONWARNINGS`` value: ``current`` (the user's, kept first, so a user's
    ``error`` or ``default`` still applies to everything else) and one ``ignore`` entry per
    known warning (later entries take precedence)."""
    ours = [f"ignore:{message}:{category.__name__}:{module}"
            for message, category, module in _filters()]
    return ",".join([current, *ours] if current else ours)
