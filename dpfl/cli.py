"""The ``dpfl`` command line: :func:`main`; ``dpfl --help`` prints :data:`DESCRIPTION`."""

from __future__ import annotations

import argparse
import difflib
import signal
import sys
import textwrap
import tomllib
from collections.abc import Callable
from pathlib import Path

from dpfl.errors import (
    EXIT_USER_ERROR,
    UserError,
    check_writable_dir,
    read_json_file,
    writable_dir_problem,
)

# `dpfl --help` (plain text: argparse prints it as is); {papers}: the reproduction registry's
# names (dpfl.experiments.common.PAPERS)
DESCRIPTION = """\
dpfl: differentially private federated learning on Flower, PyTorch and Opacus.

commands (each has its own --help):
  dpfl simulate [--clients N] [--output-dir DIR] [key=value ...]
      run a Flower simulation (default: the demo in pyproject.toml) with a SuperLink
      this command owns and stops; key=value pairs override the run-config (every
      key: docs/run-config.md).
  dpfl summary RUN_DIR
      print the guarantee and the per-client epsilon table of a finished run.
  dpfl privacy-report RUN_DIR
      verdict, then per-client unit, relation, sampling, delta, epsilon (recomputed from
      the ledger), rounds and verdict; cross-checks the ledger against summary.json and
      rounds.jsonl; writes RUN_DIR/privacy-report.png (epsilon by round).
  dpfl reproduce PAPER [--seeds 0 1 2] [--cells CELL ...] [--methods METHOD ...]
      run a paper's grid (cells x methods x seeds) and write results/PAPER/ (a table
      beside the paper's numbers); `dpfl reproduce --help` lists each PAPER's cells and
      methods (docs/reproductions.md).
{papers}
  dpfl attack RUN_DIR [--client 0] [--seed 0] [--reference-models 4] [--csmia-attacker K]
      membership inference (loss threshold, ML-Leaks, RMIA, gradient norm) against a
      finished run's client: its final global model and, when the run kept it
      (record-updates), the client's update as the server saw it; CS-MIA on the global
      models of every round when the run kept them (record-global-models=true);
      writes RUN_DIR/attack/.
  dpfl audit RUN_DIR [--canaries M] [--audit-seed S]
      an empirical epsilon lower bound (one-run canary audit): scores an audit run, or
      runs one (same config, canary clients) in RUN_DIR/audit/; exit 3 when the bound
      exceeds a formal run's accounted epsilon.
  dpfl deploy up --clients N --state DIR [--image dpfl:0.1.0] [--insecure]
  dpfl deploy run --state DIR -- [flwr run options, e.g. --run-config "num-rounds=2"]
  dpfl deploy logs --state DIR
  dpfl deploy down --state DIR
      a containerised federation of N SuperNodes with distinct partitions (Docker SDK;
      TLS and SuperNode auth unless --insecure); see docker-compose.yml for the fixed one.
  dpfl doctor
      what is installed and usable here (torch, CUDA, Opacus, flwr, datasets, Docker,
      docker-compose, debootstrap, network namespaces), one verdict per item; exit 1 when
      the default demo cannot run.
  dpfl --version
      dpfl's version and those of flwr, Opacus, torch and Python.

exit codes: 0 done; 1 the run or command failed; 2 a user error (one line names the key,
argument or file); 3 privacy-report found the run's records inconsistent, or audit's bound
exceeds the accounted epsilon; 4 privacy-report found a client over its epsilon budget;
143 stopped by SIGTERM.
"""

SIMULATE_DESCRIPTION = """\
Run one simulated federation: a SuperLink this command starts and stops, N simulated
SuperNodes (Ray), one ClientApp process per parallel client. Settings that cannot work
stop it before anything starts (exit 2). It prints the per-client privacy table and the
run directory at the end.

key=value pairs override the run-config ([tool.flwr.app.config] in pyproject.toml, the
demo: MNIST, 4 IID clients, DP-SGD at epsilon <= 4); every key, its default, type and
allowed values: docs/run-config.md. Examples:
  dpfl simulate num-rounds=3 strategy=gcfl
  dpfl simulate --clients 10 dataset=fashion-mnist partitioning=dirichlet dirichlet-alpha=0.3
  dpfl simulate --clients 2 --config conf/gcfl/mnist_eps2.toml num-rounds=2
"""

def _parse_value(text: str) -> object:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(pairs: list[str]) -> dict[str, object]:
    """``key=value`` arguments as run-config overrides; a key given twice is refused (which
    one should win is a guess either way: Flower's ``--run-config`` keeps the last)."""
    out: dict[str, object] = {}
    given: dict[str, str] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UserError(f"expected key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        key = key.strip()
        if key in given:
            raise UserError(f"run-config key '{key}' is given twice ({given[key]!r} and "
                            f"{pair!r}): give it once")
        given[key] = pair
        out[key] = _parse_value(value.strip())
    return out


def read_preset(path: str) -> dict[str, object]:
    """A preset file's run-config (a flat TOML table of key = value, the files under
    ``conf/``, which ``flwr run . --run-config FILE`` reads too); one line naming the file
    for a missing, unreadable or malformed one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise UserError(f"--config {path}: {reason.lower()}") from None
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"--config {path}: not TOML ({exc})") from None
    for key, value in table.items():
        if isinstance(value, (dict, list)):
            raise UserError(f"--config {path}: key '{key}' holds a "
                            f"{'table' if isinstance(value, dict) else 'list'}; a preset is a "
                            "flat list of run-config key = value lines")
    return table


def run_config_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The presets of ``--config`` (in the order given, a later file's key winning), then
    the command line's ``key=value`` pairs over them."""
    merged: dict[str, object] = {}
    for path in args.config or ():
        merged.update(read_preset(path))
    return {**merged, **parse_overrides(args.overrides)}


def app_dir() -> Path:
    """The Flower app folder (the one holding dpfl's pyproject.toml, the run-config defaults,
    and conf/): the source checkout, or an installed dpfl's copy
    (:func:`dpfl.runtime.fab.app_folder`)."""
    from dpfl.runtime.fab import app_folder

    try:
        return app_folder()
    except FileNotFoundError as exc:
        raise SystemExit(f"error: {exc}") from None


def cmd_simulate(args: argparse.Namespace) -> int:
    """Invalid settings stop before any process starts (exit 2); a federation that did not
    finish exits 1, whatever files an earlier run left."""
    overrides = run_config_overrides(args)   # before the imports below (seconds)
    root = app_dir()
    check_run_config_keys(root, overrides)
    from dpfl.runtime.warm_clientapps import EarlyZygote

    # the simulation's zygote imports its libraries while this process imports its own
    zygote = EarlyZygote.start()
    try:
        from dpfl.runtime.launch import RunFailed, simulate
        from dpfl.server.report import epsilon_table

        try:
            run_dir = simulate(root, args.clients, overrides, Path(args.output_dir),
                               num_cpus=args.cpus_per_client, prints_summary=True,
                               ray_address=args.ray_address, parallel=args.parallel_clients,
                               early_zygote=zygote)
        except RunFailed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    finally:
        if zygote is not None:
            zygote.stop()
    print(epsilon_table(read_summary(run_dir / "summary.json")))
    print(f"run directory: {run_dir}")
    return 0


def check_run_config_keys(root: Path, overrides: dict[str, object]) -> None:
    """Check the global run-config keys of ``overrides`` over the pyproject's defaults (names,
    types, ranges, their combinations) without importing torch, Opacus or Flower, so that a
    misspelled key or a bad global value is refused at once (exit 2 in ~0.1 s, not ~3 s).

    The same check as the launcher's first (:func:`dpfl.runtime.launch.simulate` parses exactly this
    mapping with :func:`dpfl.methods.parse_run_config`, which starts with
    :func:`dpfl.config.parse_global`): the method keys are the pyproject's keys that are not
    global (tests/test_methods_registry.py keeps them equal to every method's keys), so
    what this refuses the launcher would refuse with the same message; method values,
    strategy and model names are left to the launcher."""
    from dpfl.config import GLOBAL_KEYS, parse_global

    defaults = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    config = dict(defaults["config"])
    # unless given, the launcher sets both: a fresh valid run-name, output-dir = --output-dir
    # (which it checks with a message of its own)
    merged = {**config, "run-name": "", "output-dir": "runs", **overrides}
    parse_global(merged, frozenset(config) - frozenset(GLOBAL_KEYS))


def read_summary(path: Path) -> dict:
    """A run's ``summary.json`` that :func:`dpfl.server.report.epsilon_table` can print, or
    a :class:`UserError` naming it (missing, damaged, or not a run summary's shape)."""
    from dpfl.server.report import summary_problem

    summary = read_json_file(path, "run summary")
    why = summary_problem(summary)
    if why is not None:
        raise UserError(f"{path}: run summary is damaged ({why})")
    return summary  # type: ignore[return-value]


def cmd_summary(args: argparse.Namespace) -> int:
    summary = read_summary(run_directory(args.run_dir) / "summary.json")
    from dpfl.server.report import TABLE_ROWS, epsilon_table  # torch: only to print

    print(epsilon_table(summary, max_rows=None if args.all_clients else TABLE_ROWS))
    return 0


def run_directory(text: str, writes: str = "") -> Path:
    """A run directory given on the command line, or a :class:`UserError` naming it;
    ``writes``: what the command writes into it (then it must be writable)."""
    path = Path(text)
    if not path.is_dir():
        raise UserError(f"{path}: no such run directory")
    if not (path / "config.json").exists():
        raise UserError(f"{path}: not a dpfl run directory (no config.json)")
    if writes:
        why = writable_dir_problem(path)
        if why is not None:
            raise UserError(f"RUN_DIR {path}: {why} (this command writes {writes} there)")
    return path


def cmd_privacy_report(args: argparse.Namespace) -> int:
    run_dir = run_directory(args.run_dir)
    from dpfl.privacy_report import privacy_report_command
    from dpfl.server.plots import plot_epsilon

    why = writable_dir_problem(run_dir)

    def plot(series, path, budget, title):  # a read-only run folder: the report, no plot
        return plot_epsilon(series, path, budget, title) if why is None else \
            f"not written ({why})"

    return privacy_report_command(run_dir, plot=plot)


# `dpfl attack`'s bounds: each reference or shadow model is a full training (RMIA's
# reference models: 1 to 100), its epochs as local-epochs' (1 to 1000).
MAX_REFERENCE_MODELS = 100


def check_range(option: str, value: int, low: int, high: int | None = None,
                why: str = "") -> None:
    """A :class:`UserError` naming ``option`` when ``value`` is outside [low, high]."""
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise UserError(f"{option} {value}: must be {bound}{f' ({why})' if why else ''}")


def cmd_attack(args: argparse.Namespace) -> int:
    from dpfl.config import MAX_LOCAL_EPOCHS, MAX_SEED

    check_range("--seed", args.seed, 0, MAX_SEED)
    check_range("--reference-models", args.reference_models, 1, MAX_REFERENCE_MODELS,
                "RMIA's reference models, each a full training")
    check_range("--shadow-epochs", args.shadow_epochs, 1, MAX_LOCAL_EPOCHS)
    check_range("--max-members", args.max_members, 1)
    check_range("--client", args.client, 0)
    if args.csmia_attacker is not None:
        check_range("--csmia-attacker", args.csmia_attacker, 0)
    run_dir = run_directory(args.run_dir, writes="attack/")
    from dpfl.attacks.command import attack_run

    attack_run(run_dir, client=args.client, seed=args.seed, reference_models=args.reference_models,
               shadow_epochs=args.shadow_epochs, max_members=args.max_members,
               csmia_attacker=args.csmia_attacker)
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    run_dir = run_directory(args.run_dir, writes="audit/")
    from dpfl.attacks.audit import audit
    from dpfl.runtime.launch import RunFailed, simulate

    root = app_dir()

    def run(num_clients: int, overrides: dict, output_root: Path) -> Path:
        return simulate(root, num_clients, overrides, output_root,
                        num_cpus=args.cpus_per_client, parallel=args.parallel_clients,
                        ray_address=args.ray_address)

    try:
        report = audit(run_dir, run, args.canaries, args.audit_seed)
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 3 if report["bound-exceeds-accounted"] else 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from dpfl.experiments.common import reproduction

    paper = reproduction(args.paper)
    root = app_dir()
    from dpfl.runtime.fab import is_installed_app

    # the checkout's runs/, or (an installed dpfl: its app folder is package data) ./runs;
    # a fresh folder by default: the committed results/<paper>/ only when asked for
    runs = Path("runs") if is_installed_app(root) else root / "runs"
    work = Path(args.work_dir or runs / f"reproduce-{args.paper}")
    results = Path(args.results) if args.results else work / "results"
    command = "dpfl reproduce " + " ".join(sys.argv[2:] if argv_is_cli() else [args.paper])
    for kind, given, known in (("cell", args.cells, paper.cells),
                               ("method", args.methods, paper.methods)):
        unknown = sorted(set(given or ()) - set(known))
        if unknown:  # before any run starts
            raise UserError(f"--{kind}s: unknown {args.paper} {kind}(s) {unknown}; known: "
                            f"{list(known)}")
    from dpfl.config import MAX_SEED

    for seed in args.seeds:   # each is a run's run-config seed
        check_range("--seeds", seed, 0, MAX_SEED, "each is a run's seed")
    check_writable_dir(results, "--results")
    check_writable_dir(work, "--work-dir")
    # the default folder is this command's own: started again, it keeps the runs it
    # finished and runs the rest (an explicit --results keeps what --skip-existing says)
    skip = args.skip_existing or not args.results
    print(paper.reproduce(root, results, work, args.cells or list(paper.default_cells),
                          args.methods or list(paper.default_methods), args.seeds,
                          skip, command))
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from dpfl.runtime import containers

    state = Path(args.state)
    if args.action == "up":
        if args.flwr_args:
            raise UserError(f"unexpected arguments: {args.flwr_args}")
        if args.control_port is not None:
            raise UserError("--control-port: the Control API is not published any more (it "
                            "accepts runs and SuperNode keys from anyone who reaches it); "
                            "`dpfl deploy run` runs flwr in the SuperLink's network namespace")
        try:
            fed = containers.up(args.clients, state, image=args.image, name=args.name,
                                insecure=args.insecure)
        except containers.DeployFailed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"federation {fed.name} up: {fed.clients} SuperNodes, Control API on the "
              f"SuperLink's loopback only, TLS and SuperNode auth "
              f"{'OFF' if fed.insecure else 'on'}; state in {fed.state}")
        return 0
    if args.action == "run":
        return containers.run(state, [a for a in args.flwr_args if a != "--"])
    if args.action == "logs":
        print(containers.logs(state))
        return 0
    print("removed:", " ".join(containers.down(state)) or "nothing")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from dpfl.doctor import doctor

    return doctor()


class _VersionAction(argparse.Action):
    """``--version``: computed only when asked (it reads package metadata)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print dpfl's version and those of flwr, opacus, torch and python"):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from dpfl.doctor import version_line

        print(version_line())
        parser.exit()


def unrecognized(extra: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" line, with the closest option for each unknown
    one (``--client``: did you mean --clients?)."""
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for arg in extra:
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            close = ([o for o in options if o.startswith(name)][:1]   # an abbreviation
                     or difflib.get_close_matches(name, options, n=1))
            if close:
                hints.append(f"{name}: did you mean {close[0]}?")
    return f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})"
                                                             if hints else "")


def argv_is_cli() -> bool:
    return len(sys.argv) > 1 and sys.argv[1] == "reproduce"


def _on_sigterm(signum: int, frame: object) -> None:
    launch = sys.modules.get("dpfl.runtime.launch")
    if launch is not None and launch.stop_active(signum):
        return   # the federation is being stopped; the main thread unwinds and exits
    sys.exit(128 + signum)


def _lazy_epilog(parser: argparse.ArgumentParser, epilog: Callable[[], str]) -> None:
    """Compute ``parser``'s epilog only when its help is printed (``dpfl --help`` and every
    command start without importing what the epilog needs: torch, Opacus, Flower)."""
    format_help = parser.format_help

    def with_epilog() -> str:
        parser.epilog = epilog()
        return format_help()

    parser.format_help = with_epilog  # type: ignore[method-assign]


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """``dpfl``'s parser and each command's."""
    from dpfl.experiments.common import PAPERS, help_epilog

    # allow_abbrev=False everywhere: `--client 4` must not silently mean `--clients 4`
    parser = argparse.ArgumentParser(prog="dpfl", allow_abbrev=False,
                                     description=DESCRIPTION.format(papers=textwrap.fill(
                                         ", ".join(PAPERS), 88, initial_indent="      PAPER: ",
                                         subsequent_indent=" " * 13)),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of the commands above (each has its own --help)")
    commands: dict[str, argparse.ArgumentParser] = {}

    def command(name: str, **kwargs) -> argparse.ArgumentParser:
        commands[name] = sub.add_parser(name, allow_abbrev=False, **kwargs)
        return commands[name]

    p = command("simulate", help="run a simulated federation", description=SIMULATE_DESCRIPTION,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=None, metavar="N",
                   help="simulated SuperNodes (default 4; a resume: the run's); at most half the "
                        "dataset's training examples (2 each)")
    p.add_argument("--output-dir", default="runs", metavar="DIR",
                   help="where the run directory <run-name>/ is written (default: runs; a "
                        "relative run-config output-dir is taken from here)")
    p.add_argument("--cpus-per-client", type=float, default=1.0, metavar="CPUS",
                   help="CPUs Ray reserves for each ClientApp (default 1; fractions allowed, "
                        "at most this machine's CPUs)")
    p.add_argument("--parallel-clients", type=int, default=None, metavar="N",
                   help="at most N ClientApp processes (~1.5-1.9 GB each) at once (default: "
                        "one per --cpus-per-client of this machine's CPUs)")
    p.add_argument("--ray-address", metavar="HOST:PORT", help="run the clients on this Ray "
                   "cluster (its head's `ray start --head --port`; docs/ray-cluster.md)")
    p.add_argument("--config", action="append", metavar="FILE",
                   help="a preset: a TOML file of run-config key = value lines (e.g. the "
                        "files under conf/); key=value pairs override it; given twice, the "
                        "later file's keys win")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="run-config overrides, e.g. num-rounds=3 (every key, its default and "
                        "allowed values: docs/run-config.md)")
    p.set_defaults(func=cmd_simulate)
    p = command("summary", help="print a run's privacy table")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished run's directory")
    p.add_argument("--all", action="store_true", dest="all_clients",
                   help="every client (default: the 30 of largest epsilon, and the range)")
    p.set_defaults(func=cmd_summary)
    p = command("reproduce", help="run a paper's reproduction grid",
                description="Run a paper's grid (cells x methods x seeds, seed-major), one real "
                "Flower\nsimulation per run; write results/<paper>/ (per-run JSON, table.md "
                "beside the\npaper's numbers, plots). docs/reproductions.md describes each.",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    _lazy_epilog(p, help_epilog)   # it imports every paper's module: only for its --help
    p.add_argument("paper", choices=PAPERS, help="which paper (its cells and methods below)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], metavar="SEED",
                   help="seeds to run (default: 0 1 2); each 0 to 2^32-1")
    p.add_argument("--cells", nargs="+", metavar="CELL",
                   help="cells to run (default: the paper's cells marked * below)")
    p.add_argument("--methods", nargs="+", metavar="METHOD",
                   help="methods to run (default: the paper's methods marked * below)")
    p.add_argument("--skip-existing", action="store_true",
                   help="skip runs whose record is already in the results folder (always "
                        "so in the default folder: the same command started again resumes)")
    p.add_argument("--results", metavar="DIR",
                   help="results folder (default: <work-dir>/results, a fresh folder; the "
                        "committed results/<paper>/ only when named here)")
    p.add_argument("--work-dir", metavar="DIR",
                   help="run directories (default: runs/reproduce-<paper>/ in the checkout; an "
                        "installed dpfl: in the current folder)")
    p.set_defaults(func=cmd_reproduce)
    p = command("deploy", help="a containerised N-client federation (Docker)",
                epilog="docs/deployment.md describes the federation, its certificates "
                       "and its threat model.")
    p.add_argument("action", choices=["up", "run", "logs", "down"],
                   help="up: start the federation; run: `flwr run` in it (flwr options after "
                        "--); logs: print its containers' logs; down: remove it")
    p.add_argument("--state", required=True, help="folder for certificates, keys, runs")
    p.add_argument("--clients", type=int, default=2,
                   help="SuperNodes, each with its own partition (up; default 2)")
    p.add_argument("--image", default="dpfl:0.1.0", help="the dpfl image (up; default "
                   "dpfl:0.1.0, built by deploy/image.sh)")
    p.add_argument("--name", default="dpfl-fed", help="prefix of containers and network")
    p.add_argument("--control-port", type=int, default=None, help=argparse.SUPPRESS)  # gone
    p.add_argument("--insecure", action="store_true",
                   help="no TLS, no SuperNode authentication (warns)")
    p.set_defaults(func=cmd_deploy)
    p = command("attack", help="membership-inference attacks on a finished run")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished run's directory "
                   "(writes RUN_DIR/attack/)")
    p.add_argument("--client", type=int, default=0, help="target client (partition id)")
    p.add_argument("--seed", type=int, default=0, help="attacker's seed (splits, shadows; 0 to 2^32-1)")
    p.add_argument("--reference-models", type=int, default=4,
                   help="RMIA's reference models (default 4; 1 to 100)")
    p.add_argument("--shadow-epochs", type=int, default=10,
                   help="epochs of the global model's shadow/reference training (1 to 1000)")
    p.add_argument("--max-members", type=int, default=1000,
                   help="at most this many member records (seeded sample; >= 1)")
    p.add_argument("--csmia-attacker", type=int, default=None,
                   help="CS-MIA's adversary: the client whose records label the attack "
                        "model's members (default: the target client + 1, mod clients)")
    p.set_defaults(func=cmd_attack)
    p = command("audit", help="one-run canary audit: an epsilon lower bound")
    p.add_argument("run_dir", metavar="RUN_DIR", help="an audit run's directory to score, or "
                   "a run to audit (its audit run goes to RUN_DIR/audit/)")
    p.add_argument("--canaries", type=int, default=None,
                   help="canary clients of the audit run (default: every client); under DP-SGD canary "
                        "examples (default 10, at most 100 per client)")
    p.add_argument("--audit-seed", type=int, default=None,
                   help="the auditor's secret seed (default: fresh OS entropy)")
    p.add_argument("--cpus-per-client", type=float, default=1.0, metavar="CPUS",
                   help="CPUs Ray reserves for each ClientApp of the audit run (default 1)")
    p.add_argument("--parallel-clients", type=int, default=None, metavar="N",
                   help="at most N ClientApp processes (~1.5-1.9 GB each) at once (default: "
                        "one per --cpus-per-client of this machine's CPUs)")
    p.add_argument("--ray-address", metavar="HOST:PORT", help="run the audit run's clients on "
                   "this Ray cluster (as `dpfl simulate --ray-address`)")
    p.set_defaults(func=cmd_audit)
    p = command("privacy-report", help="per-client privacy table and epsilon plot")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished run's directory (writes "
                   "RUN_DIR/privacy-report.png when it can)")
    p.set_defaults(func=cmd_privacy_report)
    p = command("doctor", help="what is installed and usable here")
    p.set_defaults(func=cmd_doctor)
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "deploy":  # `dpfl deploy run ... -- <flwr run options>`
        args.flwr_args = extra
    elif extra:
        commands[args.command].error(unrecognized(extra, commands[args.command]))
    # A SIGTERM (e.g. `kill PID` of a background run) ends the command within a bounded
    # time with exit 128 + 15: a running federation is signalled and unwinds (the launcher
    # stops the SuperLink and everything it started, dpfl.runtime.launch.stop_active; on SIGKILL
    # the watchdog above them does, dpfl.runtime.watchdog); with nothing running, at once.
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return int(args.func(args))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:   # Ctrl-C: the launcher has stopped what it started
        again = (" (the same command resumes: finished runs are kept)"
                 if args.command == "reproduce" else "")
        print(f"interrupted{again}", file=sys.stderr)
        return 128 + signal.SIGINT


def entry() -> None:
    """The ``dpfl`` command: :func:`main`, then the process ends at once with its exit code,
    its output flushed, without tearing its libraries down: the teardown of torch's and
    Flower's modules took 0.7-1.0 s after a simulation's last line, with nothing of the
    command left to do (every file it writes is closed and synced before; its children are
    stopped)."""
    from dpfl.runtime.forking import exit_fork

    exit_fork(main())


if __name__ == "__main__":
    entry()
