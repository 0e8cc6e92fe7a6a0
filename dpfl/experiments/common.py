"""Shared pieces of the paper reproductions: one simulation -> one JSON record, one
description per paper (:class:`Reproduction`) and the one loop that runs its grid."""

from __future__ import annotations

import importlib
import json
import statistics
import textwrap
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAPERS = ("gcfl", "pegasus", "aadp", "fedcompdp", "fedasgp", "audit", "trust", "frontier",
          "ftrl")  # modules dpfl.experiments.<name>, each a REPRODUCTION


def simulate_record(root: Path, clients: int, overrides: dict[str, Any],
                    work: Path) -> dict[str, Any]:
    """Run one real Flower simulation; return its key numbers (final metrics, per-client
    epsilon, per-round accuracy / mean epsilon / per-client epsilon / selected clients,
    throughput)."""
    from dpfl.runtime.launch import simulate

    t0 = time.time()
    run_dir = simulate(root, clients, overrides, work, quiet=True)
    return run_record(run_dir, clients, overrides, time.time() - t0)


def run_record(run_dir: Path, clients: int, overrides: dict[str, Any],
               wall: float) -> dict[str, Any]:
    """The record :func:`simulate_record` keeps of a finished run directory."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = [json.loads(l) for l in (run_dir / "rounds.jsonl").read_text().splitlines() if l]
    trained = sum(sum(c.get("num-examples", 0) for c in r["clients"].values()
                      if c.get("status") == "accepted") for r in rounds)
    train_seconds = sum(r["seconds"] for r in rounds)
    eps_rounds = [r.get("epsilon", {}) for r in rounds]
    return {
        "config": overrides, "run-dir": str(run_dir),
        "accuracy": summary["final"]["accuracy"], "macro-recall": summary["final"]["macro-recall"],
        "macro-f1": summary["final"]["macro-f1"],
        # what each client is guaranteed: an adaptive (Rényi filter) history's is the
        # filter's budget; the plain composition of its rounds is only informative
        "epsilon": {c: v.get("guaranteed-epsilon", v["epsilon"])
                    for c, v in summary["clients"].items()},
        "composed-epsilon": {c: v["epsilon"] for c, v in summary["clients"].items()},
        "rounds-run": summary.get("rounds-run"), "verdict": summary["guarantee"]["verdict"],
        "randomness": ("public (reproducible=true)" if str(overrides.get("reproducible", ""))
                       .lower() == "true" else "secret (OS entropy)"),
        "samples-per-second": trained * int(overrides.get("local-epochs", 1)) / max(train_seconds, 1e-9),
        "wall-seconds": round(wall, 1),
        # None for a round not evaluated (evaluate-every > 1)
        "accuracy-by-round": [r["central"]["accuracy"] if "central" in r else None
                              for r in rounds],
        "selected-by-round": [len(r["sampled-nodes"]) for r in rounds],
        "mean-epsilon-by-round": [sum(e.values()) / clients if e else 0.0 for e in eps_rounds],
        "epsilon-by-round": eps_rounds,
    }


def set_aside_incomplete(work: Path, name: str) -> None:
    """A run directory ``work/name`` without its record (an interrupted attempt) is renamed
    ``<name>.incomplete-<time>`` (kept whole: its ledger is a record of releases made), so
    the same command can run it again instead of refusing an existing directory."""
    stale = work / name
    if stale.exists():
        kept = work / f"{name}.incomplete-{time.strftime('%Y%m%d-%H%M%S')}"
        stale.rename(kept)
        print(f"    {name}: an interrupted attempt is kept as {kept.name}; running it again",
              flush=True)


class RoundProgress:
    """Prints ``round r/T`` of a run as its ``rounds.jsonl`` grows (a background thread
    polling every 2 s), so a long reproduction shows where it is."""

    def __init__(self, run_dir: Path, rounds: Any = None, every: float = 2.0) -> None:
        import threading

        self.path = Path(run_dir) / "rounds.jsonl"
        self.rounds = rounds
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._t0 = time.time()

    def _watch(self) -> None:
        seen = 0
        while not self._stop.wait(self.every):
            try:
                count = sum(1 for line in self.path.read_text().splitlines() if line.strip())
            except OSError:
                continue
            if count > seen:
                seen = count
                total = f"/{self.rounds}" if self.rounds else ""
                print(f"    round {count}{total} done, {time.time() - self._t0:.0f} s",
                      flush=True)

    def __enter__(self) -> "RoundProgress":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


PUBLIC_SEEDED = ("none: DP noise seeded from public values (recorded before dpfl drew DP "
                 "randomness from OS entropy)")


def randomness_of(record: dict[str, Any]) -> str:
    """How a record's DP noise and sampling were drawn. Records without the field were made
    before the fix: their noise came from a seed the server could recompute."""
    return record.get("randomness", "public-seeded (before the fix)")


def record_epsilons(record: dict[str, Any]) -> dict[str, float]:
    """Each client's guaranteed epsilon in a record. Records written before
    :func:`run_record` stored the guarantee kept, for an adaptive method's run (its budgets
    a Rényi filter), the plain composition of its rounds, which that run does not
    guarantee: its epsilon is then the filter's budget, the run's ``target-epsilon``."""
    eps = record["epsilon"]
    if "composed-epsilon" in record:
        return eps
    from dpfl.methods import METHODS

    config = record.get("config", {})
    method = METHODS.get(config.get("strategy") or "dpfedavg")
    budget = config.get("target-epsilon")
    if method is None or not method.adaptive or budget is None or \
            config.get("trainer") == "plain":
        return eps
    return {c: float(budget) for c in eps}


def honest_verdict(record: dict[str, Any]) -> str:
    """The record's verdict, downgraded when its DP randomness was public."""
    if "randomness" not in record:
        return PUBLIC_SEEDED
    return record["verdict"]


def randomness_note(runs: list[dict[str, Any]]) -> str:
    """One line for a results table: which randomness produced its runs, and what that means."""
    modes: dict[str, int] = {}
    for r in runs:
        modes[randomness_of(r)] = modes.get(randomness_of(r), 0) + 1
    parts = ", ".join(f"{n} run(s) {m}" for m, n in sorted(modes.items()))
    note = f"DP randomness: {parts}."
    if any("randomness" not in r for r in runs):
        note += (" Public-seeded runs used noise and Poisson sampling seeded from the run-config "
                 "seed, partition id and round (today's `reproducible=true`): their accuracy "
                 "and ε stand — the noise had the right distribution — but anyone knowing the "
                 "run-config could regenerate the noise, so their verdict is `none`; "
                 "rerunning them today draws the randomness from OS entropy (verdict formal).")
    return note


def record_path(results: Path, name: str) -> Path:
    """Where the record of run ``name`` lives."""
    return results / "runs" / f"{name}.json"


def write_record(results: Path, name: str, record: dict[str, Any]) -> Path:
    """Write one run's record (``results/runs/<name>.json``)."""
    out = record_path(results, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    return out


def load_records(results: Path) -> list[dict[str, Any]]:
    """Every record under ``results/runs``, in file-name order."""
    return [json.loads(p.read_text()) for p in sorted((results / "runs").glob("*.json"))]


def load_preset(root: Path, folder: str, file: str) -> dict[str, Any]:
    """The run-config preset ``conf/<folder>/<file>``."""
    return tomllib.loads((root / "conf" / folder / file).read_text())


# -- table pieces --------------------------------------------------------------------------

def mean_std(values: list[float], scale: float = 100.0) -> str:
    """``mean ± sample std`` of ``scale * values`` (2 decimals); the mean alone for one
    value, ``—`` for none."""
    if not values:
        return "—"
    mean = scale * statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.2f}"
    return f"{mean:.2f} ± {scale * statistics.stdev(values):.2f}"


def table_header(title: str, command: str, description: str,
                 runs: list[dict[str, Any]]) -> list[str]:
    """The lines every table.md starts with: title, command, what the numbers are, and the
    randomness the runs drew."""
    return [f"# {title}", "", f"Command: `{command}`", "", description, "",
            randomness_note(runs), ""]


def write_table(results: Path, lines: list[str], table: dict[str, Any]) -> str:
    """Write ``table.json`` and ``table.md``; return the markdown."""
    (results / "table.json").write_text(json.dumps(table, indent=1, default=str))
    text = "\n".join(lines) + "\n"
    (results / "table.md").write_text(text)
    return text


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, save at 110 dpi, close."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


# -- one paper's grid ----------------------------------------------------------------------

def strategy_is_method(preset: dict[str, Any], cell: str, method: str) -> dict[str, Any]:
    """The usual mapping: the cell's preset with ``strategy = method``."""
    return {**preset, "strategy": method}


def cell_method_seed(cell: str, method: str, seed: int) -> str:
    """The usual record (and run) name ``<cell>__<method>__seed<k>``."""
    return f"{cell}__{method}__seed{seed}"


def _no_extra(record: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Reproduction:
    """What ``dpfl reproduce <name>`` runs: the cells (preset files in ``conf/<presets>/``),
    the methods, how (preset, cell, method) maps to run-config overrides, the record names,
    and the table builder. Every run goes through :func:`simulate_record`."""

    name: str
    presets: str  # folder under conf/
    clients: int  # SuperNodes per simulation
    cells: Mapping[str, str]  # cell -> preset file
    default_cells: tuple[str, ...]
    methods: tuple[str, ...]  # every known method, in table order
    default_methods: tuple[str, ...]
    build_table: Callable[[Path, str], str]  # (results, command) -> markdown
    run_config: Callable[[dict[str, Any], str, str], dict[str, Any]] = strategy_is_method
    record_name: Callable[[str, str, int], str] = cell_method_seed
    extra: Callable[[dict[str, Any]], dict[str, Any]] = field(default=_no_extra)
    # SuperNodes of a cell when cells differ in size (None: ``clients`` for every cell)
    clients_of: Callable[[str], int] | None = None

    def clients_for(self, cell: str) -> int:
        return self.clients_of(cell) if self.clients_of is not None else self.clients

    def overrides(self, root: Path, cell: str, method: str, seed: int) -> dict[str, Any]:
        """The full run-config overrides of one run: preset, method keys, seed, run name."""
        preset = load_preset(root, self.presets, self.cells[cell])
        return {**self.run_config(preset, cell, method), "seed": seed,
                "run-name": self.record_name(cell, method, seed)}

    def run_one(self, root: Path, cell: str, method: str, seed: int, results: Path,
                work: Path) -> dict[str, Any]:
        """One simulation; writes and returns its record. A run directory left by an
        interrupted attempt (no record) is kept aside whole and the run starts afresh."""
        overrides = self.overrides(root, cell, method, seed)
        set_aside_incomplete(work, str(overrides["run-name"]))
        with RoundProgress(work / str(overrides["run-name"]), overrides.get("num-rounds")):
            outcome = simulate_record(root, self.clients_for(cell), overrides, work)
        record = {"cell": cell, "method": method, "seed": seed, **outcome}
        record.update(self.extra(record))
        write_record(results, overrides["run-name"], record)
        return record

    def reproduce(self, root: Path, results: Path, work: Path, cells: list[str],
                  methods: list[str], seeds: list[int], skip_existing: bool,
                  command: str) -> str:
        """Run the grid seed-major (every cell once before any second seed), skipping runs
        already recorded when ``skip_existing``; rebuild the table after every run."""
        results.mkdir(parents=True, exist_ok=True)
        todo = [(c, m, s) for s in seeds for c in cells for m in methods]
        done = [skip_existing and record_path(results, self.record_name(c, m, s)).exists()
                for c, m, s in todo]
        print(f"reproduce: {len(todo)} run(s), {sum(done)} already recorded in {results}; "
              f"run directories in {work}", flush=True)
        t_start, ran = time.time(), 0
        for i, (cell, method, seed) in enumerate(todo, 1):
            if done[i - 1]:
                continue
            left = len(todo) - i + 1 - sum(done[i:])
            eta = ((time.time() - t_start) / ran * left) if ran else None
            print(f"[{i}/{len(todo)}] {cell} {method} seed {seed}: starting"
                  + (f" (ETA of the remaining {left}: {eta / 60:.0f} min)" if eta else ""),
                  flush=True)
            t0 = time.time()
            rec = self.run_one(root, cell, method, seed, results, work)
            ran += 1
            eps = list(rec["epsilon"].values())
            print(f"[{i}/{len(todo)}] {cell} {method} seed {seed}: accuracy "
                  f"{rec['accuracy']:.4f}, max eps {max(eps, default=float('inf')):.4g}, "
                  f"mean eps {statistics.fmean(eps) if eps else float('inf'):.4g}, "
                  f"{time.time() - t0:.0f} s", flush=True)
            self.build_table(results, command)
        return self.build_table(results, command)


def reproduction(name: str) -> Reproduction:
    """The :class:`Reproduction` of paper ``name`` (one of :data:`PAPERS`)."""
    if name not in PAPERS:
        raise KeyError(f"no reproduction named {name!r}; known: {list(PAPERS)}")
    return importlib.import_module(f"dpfl.experiments.{name}").REPRODUCTION


def _listing(label: str, known: tuple[str, ...], default: tuple[str, ...]) -> str:
    names = ", ".join(f"{k}*" if k in default else k for k in known)
    return textwrap.fill(names, 88, initial_indent=f"    {label:<9}", subsequent_indent=" " * 13,
                         break_on_hyphens=False)


def help_epilog() -> str:
    """Every paper with its cells and methods (``*``: run when not named), for --help."""
    lines = ["papers, their cells and methods (* = run when --cells / --methods is not given):"]
    for name in PAPERS:
        r = reproduction(name)
        lines += [f"  {name}: {r.clients} clients, presets in conf/{r.presets}/",
                  _listing("cells:", tuple(r.cells), r.default_cells),
                  _listing("methods:", r.methods, r.default_methods)]
    return "\n".join(lines)
