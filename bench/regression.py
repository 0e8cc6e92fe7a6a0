"""Seeded regression runs for refactors: the demo, one GCFL cell, one PEGASUS cell and the
AADP-FL MNIST-MLP row, all with ``reproducible=true`` (DP noise from public seeds, so two
checkouts must give the same numbers up to float noise).

    python bench/regression.py OUT_DIR [--only demo gcfl pegasus aadp]
    python bench/regression.py --compare OLD_DIR NEW_DIR

Each run's key numbers go to OUT_DIR/<name>.json; ``--compare`` prints a table of the
differences (final accuracy and every client's epsilon).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = {  # name -> (experiment module or "demo", cell, method)
    "demo": ("demo", "", ""),
    "gcfl-eps2-gcfl": ("gcfl", "eps2", "gcfl"),
    "pegasus-calibrated-pegasus": ("pegasus", "calibrated", "pegasus"),
    **{f"aadp-mnist-mlp-{m}": ("aadp", "mnist-mlp", m)
       for m in ("fedavg", "dpfedavg", "dpscaffold", "aadp", "aadp-paper-noise")},
}


def run(out: Path, only: list[str]) -> None:
    import dpfl.experiments.common as common

    original = common.simulate_record
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"

    def reproducible(root, clients, overrides, work_dir):
        return original(root, clients, {**overrides, "reproducible": True}, work_dir)

    common.simulate_record = reproducible
    for name, (paper, cell, method) in RUNS.items():
        if only and not any(name.startswith(o) for o in only):
            continue
        if (out / f"{name}.json").exists():
            continue
        if paper == "demo":
            record = reproducible(ROOT, 4, {"run-name": "demo"}, work)
        else:
            module = importlib.import_module(f"dpfl.experiments.{paper}")
            record = module.run_one(ROOT, cell, method, 0, out / "records", work)
        keep = {k: record[k] for k in ("accuracy", "macro-f1", "epsilon", "rounds-run",
                                       "verdict", "accuracy-by-round")}
        (out / f"{name}.json").write_text(json.dumps(keep, indent=1))
        print(name, keep["accuracy"], max(keep["epsilon"].values(), default=0.0), flush=True)


def compare(old: Path, new: Path) -> int:
    worst = 0.0
    print(f"{'run':34s} {'acc old':>9s} {'acc new':>9s} {'max |d eps|':>12s} {'max |d acc|/round':>18s}")
    for name in RUNS:
        a, b = old / f"{name}.json", new / f"{name}.json"
        if not (a.exists() and b.exists()):
            print(f"{name:34s} missing")
            continue
        x, y = json.loads(a.read_text()), json.loads(b.read_text())
        d_eps = max((abs(x["epsilon"][c] - y["epsilon"].get(c, float("nan")))
                     for c in x["epsilon"]), default=0.0)
        d_acc = max((abs(p - q) for p, q in zip(x["accuracy-by-round"], y["accuracy-by-round"])),
                    default=0.0)
        worst = max(worst, d_eps, d_acc)
        print(f"{name:34s} {x['accuracy']:9.4f} {y['accuracy']:9.4f} {d_eps:12.3g} {d_acc:18.3g}")
    print(f"largest difference: {worst:.3g}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?")
    p.add_argument("--only", nargs="+", default=[])
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = p.parse_args()
    if args.compare:
        sys.exit(compare(Path(args.compare[0]), Path(args.compare[1])))
    run(Path(args.out), args.only)
