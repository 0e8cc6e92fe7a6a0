"""The run directory: config.json, rounds.jsonl, ledger.json, summary.json, checkpoint, plots.

What a crash must not lose is written durably (:mod:`dpfl.durable`), in this order each
round: ``ledger.json`` (every charge of the round) → the round's line in ``rounds.jsonl``
→ ``checkpoint.pt``. A kill at any instant therefore leaves a ledger at least as long as
the checkpoint's, and :meth:`RunDir.resume_point` resumes from the checkpoint's model with
the ledger file's history (a round charged but not checkpointed is trained again and
charged again: two releases, two charges). A directory whose privacy history cannot be
read, or whose model is lost, is never silently restarted.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpfl.config import RunConfig
from dpfl.durable import append_line, atomic_write, atomic_write_text, read_lines
from dpfl.errors import UserError, damaged_text, read_json_file, writable_dir_problem
from dpfl.logs import get_logger
from dpfl.privacy.accounting.ledger import Ledger
from dpfl.runlock import LOCK_FILES, WRITER_LOCK, RunLock
from dpfl.tensorfile import UnsafeTensorFile, load_tensors, save_tensors

log = get_logger("flwr.dpfl.rundir")
# Files a launcher may create in a run directory before the server opens it, and the locks.
LAUNCHER_FILES = {".flwr"} | LOCK_FILES
# The run's identity, written once when it starts (never rewritten), and what every resume
# appends about itself.
CONFIG_FILE = "config.json"
RESUMES_FILE = "resumes.jsonl"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def unique_run_name(label: str) -> str:
    """``YYYYmmdd-HHMMSS-mmm-<8 hex>-<label>``: two runs started in the same millisecond
    still get different names."""
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{stamp}-{int(now * 1000) % 1000:03d}-{secrets.token_hex(4)}-{label}"


def default_run_name(cfg: RunConfig) -> str:
    return unique_run_name(f"{cfg.strategy}-{cfg.dataset}")


def resolve_output_dir(cfg: RunConfig, root: Path | None = None) -> Path:
    """``output-dir``; a relative path is taken from ``root`` (a launcher's, which it also
    passes to the ServerApp as $DPFL_OUTPUT_ROOT), else $DPFL_OUTPUT_ROOT, else the cwd."""
    out = Path(os.path.expanduser(cfg.output_dir))
    if not out.is_absolute():
        out = Path(root or os.environ.get("DPFL_OUTPUT_ROOT", os.getcwd())) / out
    return out


def run_dir_path(cfg: RunConfig, root: Path | None = None) -> Path:
    """Where the run of ``cfg`` lives: the output directory / ``run-name`` (a fresh unique
    name when none is set), always inside the output directory (``run-name`` is one plain
    folder name, :func:`dpfl.config.run_name_problem`; a symlink leading out is refused)."""
    out = resolve_output_dir(cfg, root)
    path = out / (cfg.run_name or default_run_name(cfg))
    if path.resolve().parent != out.resolve():
        raise UserError(f"run-config key 'run-name': {path} resolves to {path.resolve()}, "
                        f"outside output-dir {out}")
    return path


def existing_run_files(path: Path) -> list[str]:
    """What a run directory already holds (ignoring what a launcher put there)."""
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if p.name not in LAUNCHER_FILES)


def _read_lines(path: Path, what: str) -> tuple[list[str], str | None]:
    """:func:`dpfl.durable.read_lines`, a file that is not UTF-8 text a :class:`UserError`."""
    try:
        return read_lines(path)
    except UnicodeDecodeError as exc:
        raise UserError(damaged_text(path, what, exc)) from exc


def check_run_dir(path: Path, resume: bool) -> None:
    """``resume=true`` needs a run in ``path``; a new run needs ``path`` unused."""
    if not resume:
        check_new_run_dir(path)
    elif not existing_run_files(path):
        raise UserError(f"resume=true but there is no run to resume in {path}: check "
                        "run-name and output-dir, or drop resume=true")


def check_new_run_dir(path: Path) -> None:
    """A new run never reuses a directory: :class:`UserError` if ``path`` holds anything."""
    held = existing_run_files(path)
    if held:
        raise UserError(f"run directory {path} already exists (holds {', '.join(held[:4])}"
                        f"{', ...' if len(held) > 4 else ''}): choose another run-name, or "
                        "set resume=true to continue that run")


@dataclass
class ResumePoint:
    """Where a resumed run continues: after ``round``, with the ledger file's history."""

    round: int
    ledger: Ledger
    rounds: list[dict[str, Any]]
    model: dict[str, Any] | None           # None: resume-without-checkpoint, fresh model
    strategy: dict[str, Any]
    initial: dict[str, float]


@dataclass
class RunDir:
    """Files of one run."""

    path: Path
    lock: RunLock | None = None

    @classmethod
    def open(cls, cfg: RunConfig) -> "RunDir":
        """The run directory of ``cfg``, locked for this process (one writer per run
        folder: a second one is refused naming the holder's PID) and checked: a new run
        never reuses one; ``resume=true`` needs one."""
        path = run_dir_path(cfg)
        check_run_dir(path, cfg.resume)   # before creating anything
        why = writable_dir_problem(path)   # e.g. a deployment's output-dir under /proc
        if why is not None:
            raise UserError(f"run-config key 'output-dir' {resolve_output_dir(cfg)}: {why}")
        lock = RunLock(path, WRITER_LOCK, "dpfl ServerApp").acquire()
        try:
            check_run_dir(path, cfg.resume)   # again, now that nobody else can write
        except BaseException:
            lock.release()
            raise
        return cls(path, lock)

    def close(self) -> None:
        """Release the run folder's lock (process exit releases it too)."""
        if self.lock is not None:
            self.lock.release()

    def saved_config(self) -> dict[str, Any] | None:
        """The run's identity (``config.json`` as written at its start); None when the
        run never got that far."""
        path = self.file(CONFIG_FILE)
        if not path.exists():
            return None
        data = read_json_file(path, "run config")
        if not isinstance(data, dict):
            raise UserError(f"{path}: not a dpfl run config (a JSON object expected)")
        return data

    def record_resume(self, entry: dict[str, Any]) -> None:
        """Append what a resume did (``resumes.jsonl``); config.json stays as it was."""
        append_line(self.file(RESUMES_FILE), json.dumps(_jsonable(entry)))

    def resumes(self) -> list[dict[str, Any]]:
        path = self.file(RESUMES_FILE)
        if not path.exists():
            return []
        lines, _ = _read_lines(path, "resume log")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s: skipping a damaged line", path)
        return out

    def resume_verdicts(self) -> list[str | None]:
        """The guarantee verdict each resume recorded, in order (None for a damaged line or
        an entry without one: that part of the run is unknown, never assumed formal)."""
        path = self.file(RESUMES_FILE)
        if not path.exists():
            return []
        lines, partial = _read_lines(path, "resume log")
        out: list[str | None] = []
        for line in lines + ([partial] if partial else []):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                out.append(None)
                continue
            if isinstance(entry, dict) and "repair" in entry:
                continue                    # a ledger repair, not a launch
            verdict = entry.get("verdict") if isinstance(entry, dict) else None
            out.append(verdict if isinstance(verdict, str) else None)
        return out

    def create(self) -> "RunDir":
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    def file(self, name: str) -> Path:
        return self.path / name

    def write_json(self, name: str, data: Any, indent: int | None = 1) -> Path:
        return atomic_write_text(self.file(name), json.dumps(_jsonable(data), indent=indent))

    def append_round(self, record: dict[str, Any]) -> None:
        append_line(self.file("rounds.jsonl"), json.dumps(_jsonable(record)))

    def read_rounds(self, warn: bool = True) -> list[dict[str, Any]]:
        """The complete round lines; a partial last line (a kill mid-append) is dropped
        (with a warning unless ``warn`` is false), a damaged line elsewhere (not JSON, not a
        round record), or a file that is not UTF-8, is a :class:`UserError`. The one reader
        of ``rounds.jsonl``: a resume and ``dpfl privacy-report`` read it alike."""
        path = self.file("rounds.jsonl")
        lines, partial = _read_lines(path, "round log")
        if partial is not None and warn:
            log.warning("%s: dropping a partial last line left by an interruption", path)
        out = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}: line {number} is damaged (invalid JSON at column "
                                f"{exc.colno})") from exc
            if not isinstance(record, dict) or not isinstance(record.get("round"), int):
                raise UserError(f"{path}: line {number} is not a round record (no integer "
                                "'round')")
            out.append(record)
        return out

    def check_resumable(self) -> None:
        """What a resume reads first, checked before a launcher starts anything: a damaged
        ``ledger.json`` (invalid JSON, not UTF-8, not a ledger) or ``rounds.jsonl`` is the
        same one-line :class:`UserError` the ServerApp's :meth:`resume_point` would raise
        after the federation had started."""
        ledger = self.file("ledger.json")
        if ledger.exists():
            Ledger.load(ledger)
        self.read_rounds(warn=False)   # the ServerApp warns about a partial line, once

    def truncate_rounds(self, last_round: int,
                        rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Keep the ``rounds`` (the file's lines, :meth:`read_rounds`) up to ``last_round``,
        those the checkpoint covers, and rewrite the file with them."""
        kept = [r for r in rounds if r["round"] <= last_round]
        atomic_write_text(self.file("rounds.jsonl"), "".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def save_ledger(self, ledger: Ledger) -> str:
        """Step 1 of a round's persistence, as soon as its charges are made; returns
        ``ledger.json``'s text (the checkpoint keeps the same copy)."""
        return ledger.save(self.file("ledger.json"))

    def publish_round(self, line: dict[str, Any], checkpoint: dict[str, Any]) -> None:
        """Step 2, after :meth:`save_ledger`: the round's line, then the checkpoint (a kill
        between the two re-runs the round on resume; its line is then dropped)."""
        self.append_round(line)
        self.save_checkpoint(checkpoint)

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        atomic_write(self.file("checkpoint.pt"), lambda f: save_tensors(state, f))

    def load_checkpoint(self) -> tuple[dict[str, Any] | None, str]:
        """``(state, "")``, or ``(None, why)`` when the checkpoint is missing or unusable."""
        path = self.file("checkpoint.pt")
        if not path.exists():
            return None, f"{path.name} is missing"
        try:
            state = load_tensors(path)   # data only: a planted pickle never runs
        except UnsafeTensorFile as exc:
            return None, str(exc)
        except Exception as exc:  # torch raises many kinds for a damaged file
            return None, f"{path.name} is damaged ({type(exc).__name__})"
        if not isinstance(state, dict) or not {"round", "model", "ledger"} <= set(state):
            return None, f"{path.name} is not a dpfl checkpoint"
        return state, ""

    def resume_point(self, without_checkpoint: bool = False, population: list[str] | None = None,
                     adaptive: bool = False) -> ResumePoint | None:
        """Where to resume this directory's run, from what is on disk.

        - nothing recorded yet (no checkpoint, no rounds, no charge): None, start afresh;
        - a ledger and a usable checkpoint: the checkpoint's model and strategy state, and
          the LONGER of the two privacy histories (ledger.json is written first, so it is
          normally the longer; the spend is never shortened);
        - a ledger but no usable checkpoint: refused, unless ``without_checkpoint``
          (``resume-without-checkpoint=true``): then a fresh model continues after the
          ledger's last round with every recorded spend kept charged;
        - a damaged ledger, or a checkpoint without its ledger file: refused.

        In every case the ledger is reconciled first with the run's other records — the
        checkpoint's copy and every round's charges in ``rounds.jsonl`` — so that each
        client keeps the largest history any of them holds (:meth:`Ledger.restore`); a
        ledger that was behind is a warning and is repaired on disk, never a silent loss.
        ``population``/``adaptive``: how to restore a client the ledger file never had.
        """
        ledger_path = self.file("ledger.json")
        checkpoint, why = self.load_checkpoint()
        rounds = self.read_rounds()
        if not ledger_path.exists():
            if checkpoint is None and not rounds:
                return None
            raise UserError(f"{ledger_path} is missing but the run has "
                            f"{'a checkpoint' if checkpoint else 'recorded rounds'}: refusing "
                            "to resume without its privacy history (restore ledger.json)")
        ledger = Ledger.load(ledger_path)  # UserError when damaged: never an empty history
        if checkpoint is None and not ledger.charges and not rounds:
            return None  # killed while starting: nothing released, nothing to keep
        self._reconcile(ledger, checkpoint, rounds, population or [], adaptive)
        if checkpoint is not None:
            done = int(checkpoint["round"])
            return ResumePoint(done, ledger, self.truncate_rounds(done, rounds),
                               checkpoint["model"],
                               checkpoint.get("strategy", {}), checkpoint.get("initial", {}))
        if not without_checkpoint:
            raise UserError(
                f"{self.path}: {why}, but ledger.json records privacy spend of "
                f"{len(ledger.clients)} clients up to round {ledger.last_round}: refusing to "
                "restart and spend their budgets again. Set resume-without-checkpoint=true to "
                "train a fresh model here with that spend kept charged (or start a new "
                "run-name, where it is NOT carried over)")
        done = max(ledger.last_round, max((r["round"] for r in rounds), default=0))
        log.warning("%s: %s; resuming after round %d with a FRESH model, every recorded "
                    "spend kept charged", self.path, why, done)
        return ResumePoint(done, ledger, self.truncate_rounds(done, rounds), None, {}, {})

    def _checkpoint_ledger(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's copy of the ledger: a JSON text (a dict in older checkpoints)."""
        data = checkpoint["ledger"]
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except ValueError:
                raise UserError(f"{self.file('checkpoint.pt')}: its copy of the ledger is "
                                "damaged (restore the file, or resume with "
                                "resume-without-checkpoint=true)") from None
        return data

    def _reconcile(self, ledger: Ledger, checkpoint: dict[str, Any] | None,
                   rounds: list[dict[str, Any]], population: list[str],
                   adaptive: bool) -> None:
        """Bring ``ledger`` (read from ``ledger.json``) up to the checkpoint's copy and to
        ``rounds.jsonl``'s charges; save it when anything was missing."""
        sources: list[tuple[str, list[dict[str, Any]]]] = []
        if checkpoint is not None:
            sources.append(("checkpoint.pt",
                            Ledger.from_json(self._checkpoint_ledger(checkpoint)).charges))
        from_rounds = []
        for line in rounds:   # "charges" in rounds written before "ledger-charges" existed
            from_rounds.extend(line.get("ledger-charges", line.get("charges", [])))
        sources.append(("rounds.jsonl", from_rounds))
        repaired = False
        for origin, charges in sources:
            try:
                touched = ledger.restore(charges, origin, population, adaptive)
            except (KeyError, TypeError, ValueError) as exc:
                raise UserError(f"{self.path / origin}: its privacy charges cannot be read "
                                f"({exc}); refusing to resume on a ledger that may be behind"
                                ) from exc
            if touched:
                repaired = True
                names = sorted(set(touched))
                log.warning("ledger.json was behind %s: restored %d charges of %s",
                            origin, len(touched),
                            ", ".join(names[:6]) + (", ..." if len(names) > 6 else ""))
                self.record_resume({"repair": origin, "restored-charges": len(touched),
                                    "clients": names, "time": time.time()})
        if repaired:
            self.save_ledger(ledger)
