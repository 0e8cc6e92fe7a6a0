"""Seeded regression runs for refactors: the demo, one GCFL cell, one PEGASUS cell, the
AADP-FL MNIST-MLP row, a central-DP run (adaptive clipping, Poisson sampling) and a
distributed one (SecAgg+, Skellam), all with ``reproducible=true`` (DP noise from public
seeds, so two checkouts must give the same numbers).

Besides accuracy and epsilon, each run keeps two digests: the ledger's (every client's events
and every charge, sorted; no timestamps) and the final model's (the checkpoint's tensors,
bytes). Equal digests mean bit-identical ledgers and models.

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
    "central": ("direct", "", ""),
    "central-all": ("direct", "", ""),
    "distributed": ("direct", "", ""),
}
# the two trust-model runs (digits, small; the settings of tests/e2e/test_trust_federation.py)
DIRECT = {
    "central": (6, {"dataset": "digits", "batch-size": 32, "trainer": "update-dp",
                    "trust": "central", "fraction-train": 0.5, "num-rounds": 3,
                    "adaptive-clip": True, "clip-count-stddev": 2.0, "target-epsilon": 8,
                    "noise-multiplier": 1.0, "clip-norm": 0.1, "lr": 0.05}),
    # every client every round (q = 1): no sampling, so bit-identical run to run. The sampled
    # run above is not: Poisson sampling draws over node ids, which a simulation assigns at
    # random, so the same seed samples other partitions in each run (its ledger, charged to
    # every client, stays identical; its model does not)
    "central-all": (6, {"dataset": "digits", "batch-size": 32, "trainer": "update-dp",
                        "trust": "central", "fraction-train": 1.0, "num-rounds": 3,
                        "adaptive-clip": True, "clip-count-stddev": 2.0, "target-epsilon": 8,
                        "noise-multiplier": 1.0, "clip-norm": 0.1, "lr": 0.05}),
    "distributed": (4, {"dataset": "digits", "batch-size": 32, "trainer": "update-dp",
                        "trust": "distributed", "num-rounds": 2, "target-epsilon": 8,
                        "secagg-min-survivors": 3, "secure-noise": "skellam"}),
}


def digests(run_dir: Path) -> dict[str, str]:
    """sha256 of the ledger's content (clients' events, charges; order-free) and of the
    final model's tensors."""
    import hashlib

    from dpfl.tensorfile import load_tensors

    ledger = json.loads((run_dir / "ledger.json").read_text())
    content = {"clients": {c: v.get("events") for c, v in sorted(ledger["clients"].items())},
               "charges": sorted((json.dumps(c, sort_keys=True) for c in ledger["charges"])),
               "population": ledger.get("population")}
    model = load_tensors(run_dir / "checkpoint.pt")["model"]
    h = hashlib.sha256()
    for name in sorted(model):
        h.update(name.encode())
        h.update(model[name].detach().contiguous().cpu().numpy().tobytes())
    return {"ledger-digest": hashlib.sha256(json.dumps(content, sort_keys=True).encode())
            .hexdigest()[:16], "model-digest": h.hexdigest()[:16]}


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
        elif paper == "direct":
            clients, overrides = DIRECT[name]
            record = reproducible(ROOT, clients, {"run-name": name, **overrides}, work)
        else:
            module = importlib.import_module(f"dpfl.experiments.{paper}")
            record = module.run_one(ROOT, cell, method, 0, out / "records", work)
        keep = {k: record[k] for k in ("accuracy", "macro-f1", "epsilon", "rounds-run",
                                       "verdict", "accuracy-by-round")}
        keep.update(digests(Path(record["run-dir"])))
        (out / f"{name}.json").write_text(json.dumps(keep, indent=1))
        print(name, keep["accuracy"], max(keep["epsilon"].values(), default=0.0), flush=True)


def compare(old: Path, new: Path) -> int:
    worst = 0.0
    print(f"{'run':34s} {'acc old':>9s} {'acc new':>9s} {'max |d eps|':>12s} "
          f"{'max |d acc|/round':>18s} {'ledger':>7s} {'model':>7s}")
    for name in RUNS:
        a, b = old / f"{name}.json", new / f"{name}.json"
        if not (a.exists() and b.exists()):
            print(f"{name:34s} missing")
            continue
        x, y = json.loads(a.read_text()), json.loads(b.read_text())
        d_eps = max((abs(x["epsilon"][c] - y["epsilon"].get(c, float("nan")))
                     for c in x["epsilon"]), default=0.0)
        d_acc = max((abs(p - q) for p, q in zip(x["accuracy-by-round"], y["accuracy-by-round"])
                     if p is not None and q is not None),
                    default=0.0)
        worst = max(worst, d_eps, d_acc)
        same = ["same" if x.get(k) is not None and x.get(k) == y.get(k) else "DIFFERS"
                for k in ("ledger-digest", "model-digest")]
        print(f"{name:34s} {x['accuracy']:9.4f} {y['accuracy']:9.4f} {d_eps:12.3g} "
              f"{d_acc:18.3g} {same[0]:>7s} {same[1]:>7s}")
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
