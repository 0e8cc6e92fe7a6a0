"""``dpfl audit RUN_DIR``: an empirical lower bound on epsilon from one training run
(Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023).

A run directory whose run had canary clients (``audit-canaries`` = m > 0) is scored; any
other finished run is audited by ONE more training run with the same configuration in
``RUN_DIR/audit/`` in which clients 0 .. m-1 (default: every client) are canary clients
(:mod:`dpfl.client.canary`: with a secret bit b_i ~ Bernoulli(1/2) client i releases the
canary vector c * u_i through its method instead of its training update) and the server
scores every canary reply by <update, u_i> (:mod:`dpfl.server.observer`).

Sample-level DP-SGD runs (``trainer=dpsgd``) audit canary *examples* instead
(:func:`dpfl.client.canary.with_canary_examples`: m out-of-distribution examples with random
labels, canary i added to client i mod N's data when its bit is 1; default m = 10 per
client), scored offline by minus their loss under the model the server rebuilt from the
host's last update (the audit run keeps every host's update), and compared with the hosts'
per-sample epsilon.

The auditor's statistic for canary i is the sum of its scores over the rounds it took part
in (the server sees each reply: the strongest auditor of the local trust model); canaries
that never took part are left out (which clients are sampled does not depend on the bits,
so the bits of those that took part are still independent fair coins). Guesses: the
highest sums "included", the lowest "excluded", abstaining in between; the bound is
:func:`dpfl.privacy.audit.one_run.audit_scores` at 95 % confidence (Bonferroni over the abstention
levels tried). It is compared with the largest accounted epsilon of the audited canary
clients (the ledger's, replace-one client level): every canary's guarantee is its
client's. A lower bound above the accounted epsilon of a ``formal`` run is a bug in the
audit or in the accounting: the command then exits 3.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any, Callable

import torch

from dpfl.attacks.reference import per_example_loss
from dpfl.attacks.target import run_config, target_models
from dpfl.client.canary import canary_examples, canary_host, canary_norm
from dpfl.config import MAX_CANARY_EXAMPLES_PER_CLIENT, MAX_SEED, RunConfig
from dpfl.data import load_dataset
from dpfl.durable import atomic_write_text, read_lines
from dpfl.errors import UserError, read_json_file
from dpfl.methods import guarantee
from dpfl.privacy.accounting.ledger import client_key
from dpfl.privacy.audit.canaries import canary_bits
from dpfl.privacy.audit.one_run import audit_scores
from dpfl.server.observer import AUDIT_FILE

# keys of config.json that belong to the audited run's identity, not to its training
_NOT_COPIED = ("run-name", "output-dir", "resume", "resume-without-checkpoint",
               "audit-canaries", "audit-seed", "record-updates")


def canary_statistics(run_dir: Path, key: str = "score") -> dict[int, float]:
    """Canary client -> the sum of its ``key`` values over ``audit.jsonl`` (replies seen):
    ``score`` = <update, u_i>, ``overlap`` = the support overlap (sparse canaries)."""
    path = run_dir / AUDIT_FILE
    if not path.exists():
        raise UserError(f"{path}: no canary scores (the run had no accepted canary reply)")
    lines, _partial = read_lines(path)
    sums: dict[int, float] = {}
    for number, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
            client, score = int(rec["client"]), float(rec[key])
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{path}: line {number} is damaged ({exc})") from exc
        sums[client] = sums.get(client, 0.0) + score
    return sums


def example_canary_scores(run_dir: Path, cfg: RunConfig, num_clients: int
                          ) -> tuple[dict[int, float], dict[int, int]]:
    """DP-SGD audit runs: canary example i's score is minus its loss under the model the
    server last rebuilt from its host's update (global + update, kept by
    ``record-updates``), or under the final global model when the host's update was not
    kept; returns the scores and each canary's host."""
    ds = load_dataset(cfg.dataset, cfg.data_dir, cfg.download)
    x, y = canary_examples(cfg, tuple(ds.input_shape), ds.num_classes)
    scores: dict[int, float] = {}
    hosts = {i: canary_host(i, num_clients) for i in range(cfg.audit_canaries)}
    for host in sorted(set(hosts.values())):
        models = target_models(run_dir, cfg, host, ds.input_shape, ds.num_classes)
        model = models[-1].model   # the host's update when kept, else the global model
        mine = [i for i, h in hosts.items() if h == host]
        loss = per_example_loss(model, x[mine], y[mine])
        scores.update({i: -float(v) for i, v in zip(mine, loss)})
    return scores, hosts


def score_audit_run(run_dir: Path, confidence: float = 0.95) -> dict[str, Any]:
    """The epsilon lower bound of an audit run, beside its accounted epsilon."""
    cfg, num_clients = run_config(run_dir)
    if cfg.audit_canaries < 1:
        raise UserError(f"{run_dir}: not an audit run (audit-canaries = 0)")
    statistics: dict[str, dict[int, float]]
    if cfg.trainer == "dpsgd":   # canary examples, scored offline
        sums, hosts = example_canary_scores(run_dir, cfg, num_clients)
        statistics = {"loss": sums}
    else:                         # canary clients, scored by the server
        hosts = {}
        statistics = {"dot": canary_statistics(run_dir)}
        if cfg.audit_canary_support:   # sparse canaries: the zero pattern too
            statistics["support-overlap"] = canary_statistics(run_dir, "overlap")
    seen = sorted(c for c in statistics[next(iter(statistics))]
                  if 0 <= c < cfg.audit_canaries)
    bits = canary_bits(cfg.audit_seed, cfg.audit_canaries)
    included = bits[seen] if seen else torch.zeros(0, dtype=torch.bool)
    # several statistics: each tested at a Bonferroni share of the confidence, best kept
    level = 1.0 - (1.0 - confidence) / len(statistics)
    results = {name: audit_scores(torch.tensor([sums[c] for c in seen], dtype=torch.float64),
                                  included, cfg.delta, level)
               for name, sums in statistics.items()}
    statistic, result = max(results.items(), key=lambda kv: kv[1].epsilon_lower)
    summary = read_json_file(run_dir / "summary.json", "run summary")
    clients = summary.get("clients", {})
    # each canary is covered by its client's epsilon (its host's, for canary examples)
    owners = sorted({hosts.get(c, c) for c in seen})
    canary_eps = [float(clients[client_key(c)]["epsilon"]) for c in owners
                  if client_key(c) in clients]
    verdict = guarantee(cfg).verdict
    accounted = max(canary_eps) if canary_eps else (float("inf") if not cfg.is_private
                                                      else 0.0)
    out = {
        "run-dir": str(run_dir), "strategy": cfg.strategy, "trainer": cfg.trainer,
        "verdict": verdict, "delta": cfg.delta, "confidence": confidence,
        "canaries": cfg.audit_canaries, "canaries-seen": len(seen),
        "canary-kind": ("examples (sample level)" if cfg.trainer == "dpsgd" else
                        f"clients (client level), norm {canary_norm(cfg):g}"),
        "clients": num_clients,
        "rounds": summary.get("rounds-run"),
        "epsilon-lower-bound": result.epsilon_lower, "statistic": statistic,
        "by-statistic": {name: r.epsilon_lower for name, r in results.items()},
        "guesses": result.r, "correct": result.v, "k-plus": result.k_plus,
        "k-minus": result.k_minus,
        "accounted-epsilon-max": accounted,
        "accounted-epsilon-min": min(canary_eps) if canary_eps else None,
        "final-accuracy": summary.get("final", {}).get("accuracy"),
    }
    out["bound-exceeds-accounted"] = bool(verdict == "formal"
                                          and result.epsilon_lower > accounted + 1e-9)
    return out


def audit_overrides(run_dir: Path, canaries: int | None, audit_seed: int | None
                    ) -> tuple[dict[str, Any], int]:
    """The run-config of the audit run of finished run ``run_dir`` and its client count."""
    raw = dict(read_json_file(run_dir / "config.json", "run configuration"))
    num_clients = int(raw.pop("num-clients", 0))
    if num_clients < 1:
        raise UserError(f"{run_dir / 'config.json'}: no 'num-clients' (not a finished run)")
    sample_level = raw.get("trainer") == "dpsgd"
    m = (num_clients if not sample_level else 10 * num_clients) if canaries is None else canaries
    most = MAX_CANARY_EXAMPLES_PER_CLIENT * num_clients if sample_level else num_clients
    if not 1 <= m <= most:
        raise UserError(f"--canaries {m}: must be in [1, {most}] (the run's clients)"
                        if not sample_level else
                        f"--canaries {m}: must be in [1, {most}] (canary examples: at most "
                        f"{MAX_CANARY_EXAMPLES_PER_CLIENT} per client, the run has "
                        f"{num_clients} clients)")
    if audit_seed is not None and not 0 <= audit_seed <= MAX_SEED:
        raise UserError(f"--audit-seed {audit_seed}: must be in [0, {MAX_SEED}]")
    overrides = {k: v for k, v in raw.items() if k not in _NOT_COPIED}
    if raw.get("trainer") == "dpsgd":   # canary examples: keep the hosts' updates to score
        overrides["record-updates"] = min(m, num_clients)
    overrides.update({"audit-canaries": m, "run-name": "audit-run",
                      "audit-seed": secrets.randbits(31) if audit_seed is None else audit_seed})
    return overrides, num_clients


def audit(run_dir: Path, simulate: Callable[..., Path], canaries: int | None = None,
          audit_seed: int | None = None, confidence: float = 0.95, log=print
          ) -> dict[str, Any]:
    """Score ``run_dir`` when it is an audit run, else run its audit run first
    (``simulate(num_clients, overrides, output_root) -> run dir``); write ``audit.json``."""
    cfg, _ = run_config(run_dir)
    target = run_dir
    done = run_dir / "audit" / "audit-run"
    if cfg.audit_canaries == 0 and (done / "summary.json").exists():
        log(f"{done}: audit run already finished: scoring it")
        target = done
    elif cfg.audit_canaries == 0:
        overrides, num_clients = audit_overrides(run_dir, canaries, audit_seed)
        log(f"audit of {run_dir.name}: one training run with {overrides['audit-canaries']} "
            f"canary clients of {num_clients} in {run_dir / 'audit'}")
        target = simulate(num_clients, overrides, run_dir / "audit")
    report = score_audit_run(target, confidence)
    atomic_write_text(target / "audit.json", json.dumps(report, indent=1))
    log(f"audited epsilon >= {report['epsilon-lower-bound']:.3f} at {confidence:.0%} "
        f"confidence ({report['correct']}/{report['guesses']} guesses right, "
        f"{report['canaries-seen']} canaries seen); accounted epsilon "
        f"{report['accounted-epsilon-max']:.4g}; verdict {report['verdict']}")
    if report["bound-exceeds-accounted"]:
        log("ERROR: the audited lower bound exceeds the accounted epsilon of a formal run: "
            "a bug in the audit or in the accounting")
    log(f"wrote {target / 'audit.json'}")
    return report
