"""Run configuration: Flower run-config keys parsed once into a typed, validated object.

Every global key of ``[tool.flwr.app.config]`` in ``pyproject.toml`` maps to one field of
:class:`RunConfig` (dashes become underscores); a method's own keys belong to its
parameters (``dpfl.method.MethodParams``), parsed by the registry (``dpfl.methods``) into
``RunConfig.params``. A bad value raises :class:`ConfigError` naming the key, so a run stops
at start instead of failing mid-way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from dpfl.errors import UserError
from dpfl.numbers import is_finite_number, is_number

DATASETS = ("mnist", "fashion-mnist", "digits", "cifar10", "cifar100", "svhn")
PARTITIONINGS = ("iid", "dirichlet", "shards", "size", "gcfl-contiguous", "noniid-fraction",
                 "class-grouped")
TRAINERS = ("plain", "dpsgd", "update-dp")
# pld: dp-accounting PLD (tightest, the default); rdp: Opacus / dp-accounting RDP;
# prv: Opacus PRV (DP-SGD only)
ACCOUNTANTS = ("pld", "rdp", "prv")
OPACUS_MODES = ("ghost", "hooks", "functorch", "ew", "bk")
# who adds the noise (dpfl.privacy.trust): each client (local), a trusted server (central)
# or every client a share under secure aggregation (distributed)
TRUSTS = ("local", "central", "distributed")
# central: dpfl's own mechanism, or Flower's server-side DP wrapper for a side-by-side
CENTRAL_IMPLS = ("dpfl", "flower")
# trust=distributed: the integer noise of the shares (dpfl.privacy.skellam,
# dpfl.privacy.ddgauss)
SECURE_NOISES = ("skellam", "ddgauss")


# Upper ends of the sensible ranges (a value above them is a typo or an attack on the
# record, e.g. a clip norm of 1e308 makes every norm bound meaningless). target-epsilon
# stays finite but may be huge: reproductions switch the budget off with 1e15.
MAX_EPSILON = 1e15
MAX_NORM = 1e6
# A million rounds: no run reaches it (a Flower round takes a second or more, so 10^6 rounds
# is 12 days of nothing but rounds; the papers dpfl reproduces run at most a few thousand),
# yet it leaves room for any real schedule. num-rounds=1e12 is a typo, refused at start.
MAX_ROUNDS = 1_000_000
MAX_RUN_NAME = 100   # characters (and at most 255 bytes in UTF-8: one folder name)
# A norm bound below 10^-6 (max-update-norm, clip norms) bounds nothing a model moves by:
# every update would be refused or clipped to zero.
MIN_NORM = 1e-6
# target-epsilon below 10^-3 protects nothing more than 10^-3 does (e^0.001 = 1.001) and
# leaves no round affordable at any sane noise.
MIN_EPSILON = 1e-3
# delta: at most 0.1 (a larger delta lets a mechanism expose one record in ten: it protects
# nobody); at least 10^-12 (below it the PLD accountant's truncated tails, ~10^-15, decide
# epsilon, which then becomes infinite, and Opacus' PRV refuses it).
MIN_DELTA = 1e-12
MAX_DELTA = 0.1
# Step sizes (lr, server-lr) above 10^3 only make a model diverge; a noise multiplier above
# 10^6 drowns every update (and 1e300 overflows the accountants).
MAX_LR = 1e3
MAX_NOISE_MULTIPLIER = 1e6
# A local epoch is a pass over a client's data: more than 1000 per round is a typo.
MAX_LOCAL_EPOCHS = 1000
# Flower's rounds need seconds; a round that waits less than one second for replies never
# hears from any client.
MIN_ROUND_TIMEOUT = 1.0
# Seeds feed numpy, torch and Python's generators: [0, 2^32 - 1] is what all of them take.
MAX_SEED = 2**32 - 1
# SecAgg+'s integer share range with one client is [-(2^30 - 1), 2^30 - 1]
# (dpfl.privacy.trust.share_limit): a clipped update's coordinate, up to C s, must fit it.
MAX_SECAGG_UNITS = 2**30 - 1
# Every client holds at least this many training examples on average (a partition of one
# example leaves nothing to validate or sample from): bounds --clients, server-holdout and
# train-subset by the dataset's size (dpfl.launch.check_data_size).
MIN_EXAMPLES_PER_CLIENT = 2
# A sample-level audit run hosts at most this many canary examples per client (the default
# is 10): out-of-distribution examples with random labels must stay a small part of a
# client's data, or the audit measures another training than the one audited.
MAX_CANARY_EXAMPLES_PER_CLIENT = 100
# Flower's node ids are 64-bit integers (uint64 in Flower 1.39, sint64 before it).
MIN_NODE_ID = -(2**63)
MAX_NODE_ID = 2**64 - 1


class ConfigError(UserError, ValueError):
    """An invalid run-config value; the message names the key."""


def parse_node_partitions(text: str) -> dict[int, int]:
    """``"<node-id>:<partition-id>,..."`` as {node id: partition id}: ValueError when a
    pair is malformed or a node or a partition appears twice."""
    out: dict[int, int] = {}
    for pair in filter(None, (p.strip() for p in text.replace(" ", ",").split(","))):
        node, sep, pid = pair.partition(":")
        node, pid = node.strip(), pid.strip()
        # ASCII digits only: int() also reads other scripts' digits ("٣" is 3)
        if not sep or not _ascii_digits(node.removeprefix("-")) or not _ascii_digits(pid):
            raise ValueError(f"expected <node-id>:<partition-id> in ASCII digits, got {pair!r}")
        node_id, partition = int(node), int(pid)
        if not MIN_NODE_ID <= node_id <= MAX_NODE_ID:
            raise ValueError(f"node id {node_id} is not a Flower node id (a 64-bit integer)")
        if node_id in out:
            raise ValueError(f"node {node_id} appears twice")
        if partition in out.values():
            raise ValueError(f"partition {partition} is bound to two nodes")
        out[node_id] = partition
    return out


def _ascii_digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def run_name_problem(name: str) -> str | None:
    """Why ``name`` is not one plain folder name (None when it is): no path separator,
    not ``.``/``..``, no blank or control character, valid UTF-8, not hidden, not too long."""
    if not name or not name.strip():
        return "must not be blank"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid UTF-8"
    if len(name) > MAX_RUN_NAME or len(encoded) > 255:
        return f"must be at most {MAX_RUN_NAME} characters"
    if "/" in name or "\\" in name or name in (".", ".."):
        return "must be one folder name (no '/', '\\', '.' or '..')"
    if name.startswith((".", "-")):
        return "must not start with '.' or '-'"
    if any(ch.isspace() or not ch.isprintable() for ch in name):
        return "must not contain blanks or control characters"
    return None


@dataclass(frozen=True)
class RunConfig:
    """Typed view of the run-config (see ``pyproject.toml`` for the demo defaults)."""

    strategy: str = ""         # the method; "" = the registry's default (dpfl.methods)
    trainer: str = "dpsgd"
    dataset: str = "mnist"
    data_dir: str = ""
    download: bool = False
    partitioning: str = "iid"
    dirichlet_alpha: float = 0.5
    labels_per_client: int = 2
    noniid_fraction: float = 0.5
    val_fraction: float = 0.1
    # training examples kept from every client as the server's own validation split
    # (methods that score updates on the server; never the test set)
    server_holdout: int = 0
    # partition only this many training examples (seeded sample; 0 = all): quick runs
    train_subset: int = 0
    model: str = "mnist-cnn"
    num_rounds: int = 5
    local_epochs: int = 1
    batch_size: int = 256
    lr: float = 2.0
    momentum: float = 0.0
    max_grad_norm: float = 1.0
    clip_norm: float = 1.0
    noise_multiplier: float = 0.0
    target_epsilon: float = 4.0
    delta: float = 1e-5
    accountant: str = "pld"
    opacus_mode: str = "bk"
    fraction_train: float = 1.0
    min_train_nodes: int = 2
    fraction_evaluate: float = 0.0
    # central evaluation on the server's test set after every k-th round and the last one
    evaluate_every: int = 1
    server_lr: float = 1.0
    max_update_norm: float = 0.0
    round_timeout: float = 900.0
    # seconds the server waits for min-train-nodes connected nodes (at start and before
    # each round) before it stops the run, saying so
    node_wait: float = 600.0
    seed: int = 42
    # true = DP noise and Poisson sampling seeded from public values (bit-identical reruns,
    # verdict none); false = secret OS entropy per client and round (dpfl.privacy.randomness)
    reproducible: bool = False
    output_dir: str = "runs"
    run_name: str = ""
    resume: bool = False
    # with resume=true and a lost/damaged checkpoint: continue with a fresh model after the
    # ledger's last round, every recorded spend kept charged (else the resume is refused)
    resume_without_checkpoint: bool = False
    report_train_loss: bool = False
    # privacy measurement (dpfl audit / dpfl attack): clients 0..audit-canaries-1 are canary
    # clients; each replaces its update by a secret canary vector of norm audit-canary-norm
    # (0 = clip-norm) with probability 1/2 (bits and directions from the auditor's secret
    # audit-seed); the server scores every canary reply (audit.jsonl). Under trainer=dpsgd
    # the canaries are examples added to the clients' data (dpfl.client.canary)
    audit_canaries: int = 0
    audit_seed: int = 0
    audit_canary_norm: float = 0.0
    # > 0: sparse canaries on that many secret coordinates (the auditor then also scores
    # the overlap of each reply's non-zero pattern with the canary's support)
    audit_canary_support: int = 0
    # keep the last received update of clients 0..record-updates-1 (updates/, for the
    # membership-inference attacks on what the server saw)
    record_updates: int = 0
    # keep the global model of every round (globals/round-<r>.pt) for CS-MIA, the attack
    # on the confidence series of a record across the rounds' global models
    record_global_models: bool = False
    # draw the run's figures (labels.png, accuracy.png, epsilon.png); off in a sweep whose
    # runs nobody looks at one by one (matplotlib costs a ServerApp ~1.5 s of CPU)
    plots: bool = True
    # trust model (dpfl.privacy.trust): local = noise on each client (no amplification);
    # central = clients clip, a trusted server samples clients by Poisson(fraction-train),
    # adds N(0, sigma^2 C^2) to the sum (amplification accounted, every client charged every
    # round); distributed = clients clip, quantise and add Skellam noise shares, Flower's
    # SecAgg+ reveals only the sum
    trust: str = "local"
    # central: adapt C by Andrew et al. 2021's private quantile estimate
    adaptive_clip: bool = False
    clip_target_quantile: float = 0.5
    clip_lr: float = 0.2
    # std of the clipped-count noise (0 = expected clients per round / 20, Andrew et al.)
    clip_count_stddev: float = 0.0
    # central: dpfl's mechanism, or Flower's DifferentialPrivacyServerSide*Clipping wrapper
    # around FedAvg on the same round (fixed-size sampling; a side-by-side reference)
    central_impl: str = "dpfl"
    # distributed: the guaranteed minimum of surviving clients per round (0 = every
    # sampled client must survive); each adds 1/n_min of the noise variance
    secagg_min_survivors: int = 0
    # distributed: how many of a round's survivors may omit their noise share (or add
    # less) while the sum still carries the full noise: each share carries
    # 1/(n_min - t) of the variance (Kairouz, Liu & Steinke 2021's minimum honest count)
    secagg_noiseless: int = 0
    # SecAgg+ neighbourhood: shares per client (0 = all sampled clients) and the fraction
    # of a neighbourhood needed to reconstruct a dropped client's masks
    secagg_num_shares: int = 0
    secagg_threshold: float = 0.5
    # integer units per unit of clip-norm C (quantisation scale s; the rounding adds at
    # most sqrt(d) to the integer vector's L2 norm C s)
    secagg_scale: float = 1e5
    # test-only fault injection: this partition raises at SecAgg+'s masked-vector stage
    # (-1 = none), i.e. drops out mid-protocol after sharing its keys
    secagg_drop_partition: int = -1
    # distributed: the integer noise each client adds to its share: Skellam (Agarwal,
    # Kairouz & Liu 2021) or the distributed discrete Gaussian (Kairouz, Liu & Steinke 2021)
    secure_noise: str = "skellam"
    # the operator's binding of SuperNodes to partitions, "<node-id>:<partition-id>,..."
    # (deploy/netns.sh and `dpfl deploy` write it from the keys they register); when set,
    # a reply is charged to the partition of the node that sent it, whatever it claims,
    # and a node outside the map is refused. Empty: a node is pinned to the partition it
    # first claims and no two nodes may hold one partition (simulation: the engine's
    # node_config is the claim)
    node_partitions: str = ""
    # the active method's own parameters (a dpfl.method.MethodParams, or None)
    params: Any = None

    @property
    def is_private(self) -> bool:
        """True when clients apply a DP mechanism (DP-SGD or update-level DP)."""
        return self.trainer != "plain"

    def to_dict(self) -> dict[str, Any]:
        """The config as run-config keys (dashes), e.g. for ``config.json``."""
        out = {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)
               if f.name != "params"}
        return {**out, **(self.params.to_dict() if self.params is not None else {})}

    def replace(self, **changes: Any) -> "RunConfig":
        """A validated copy with some fields changed (underscored names)."""
        return validate(dataclasses.replace(self, **changes))


# The allowed values of the global string keys (``strategy`` and ``model`` come from the
# registries: dpfl.methods, dpfl.models).
KEY_CHOICES: dict[str, tuple[str, ...]] = {
    "trainer": TRAINERS,
    "dataset": DATASETS,
    "partitioning": PARTITIONINGS,
    "accountant": ACCOUNTANTS,
    "opacus-mode": OPACUS_MODES,
    "trust": TRUSTS,
    "central-impl": CENTRAL_IMPLS,
    "secure-noise": SECURE_NOISES,
}

# One line per global key: the generated run-config reference (docs/run-config.md) and the
# CLI read these; a method's own keys are described by its MethodParams.HELP.
KEY_HELP: dict[str, str] = {
    "strategy": "the method (see the Methods pages); `fedavg` is the non-private reference "
                "and needs `trainer=plain`",
    "trainer": "`dpsgd` (sample-level DP-SGD, Opacus), `update-dp` (client-level: clip the "
               "whole update + Gaussian noise), `plain` (no DP)",
    "dataset": "the dataset; MNIST, Fashion-MNIST and digits load offline, CIFAR-10/100 and "
               "SVHN through torchvision from `data-dir`",
    "data-dir": "where torchvision-format files live (\"\" = the bundled or system copy); a "
                "folder you set that lacks the dataset is an error, never a silent fall-back",
    "download": "let torchvision download into `data-dir` (only when `true`)",
    "partitioning": "how training examples are split among clients: `iid`, `dirichlet` "
                    "(`dirichlet-alpha`), `shards` (`labels-per-client`), `size` (client i's "
                    "share ∝ i+1), `gcfl-contiguous` (GCFL's contiguous label groups), "
                    "`noniid-fraction` (`noniid-fraction`), "
                    "`class-grouped` (label-sorted, cut into uneven contiguous shares: "
                    "FedCompDP's SVHN split)",
    "dirichlet-alpha": "`partitioning=dirichlet`: concentration α of the label distribution "
                       "(smaller = more skewed)",
    "labels-per-client": "`partitioning=shards`: labels per client",
    "noniid-fraction": "`partitioning=noniid-fraction`: AADP-FL's non-IID share f: a "
                       "fraction f of the training set is label-sorted and dealt in "
                       "contiguous blocks, the rest split IID (0 = IID, 1 = label-sorted)",
    "val-fraction": "local validation hold-out per client",
    "server-holdout": "training examples kept from every client as the server's own "
                      "validation split (FedCompDP's `cra-score=server-val`, DP-FedASGP "
                      "over DP-SGD; never the test set); 0 = none; at most the dataset's "
                      "training examples less 2 per client",
    "train-subset": "partition only this many training examples (a seeded sample; 0 = all): "
                    "quick grids; else at least 2 per client and at most the training "
                    "examples `server-holdout` leaves (checked against the dataset before "
                    "anything starts, as is `--clients`: at most half the training examples)",
    "model": "the network every client trains and the server evaluates (`*-gn`: ResNets "
             "with GroupNorm, made out-of-place so DP-SGD runs on them)",
    "num-rounds": "federated rounds (at most 10^6)",
    "local-epochs": "local epochs per round (1 to 1000)",
    "batch-size": "local batch size (DP-SGD: the expected Poisson batch; part of the "
                  "privacy accounting, not a device setting)",
    "lr": "local learning rate (the default 2.0 is DP-SGD's, whose gradients are clipped "
          "and noised; plain SGD diverges at it: use e.g. 0.1); in (0, 1000]",
    "momentum": "local SGD momentum",
    "max-grad-norm": "DP-SGD per-sample clipping bound C (10^-6 to 10^6)",
    "clip-norm": "update-DP clipping bound C on the whole update (10^-6 to 10^6)",
    "noise-multiplier": "σ (at most 10^6); 0 = calibrate so a client taking part in every "
                        "round ends at `target-epsilon`",
    "target-epsilon": "each client's ε budget (10^-3 to 10^15); a client refuses a round that "
                      "would exceed it",
    "delta": "δ of every client's (ε, δ) guarantee, in [10^-12, 0.1] (above 0.1 it protects "
             "nobody; below 10^-12 the accountants' precision decides ε)",
    "accountant": "`pld` (dp-accounting's privacy-loss distributions, both units; the "
                  "tightest, with a coarser grid or RDP as a logged fallback for very long "
                  "histories), `rdp` (Opacus / dp-accounting RDP), `prv` (Opacus PRV, DP-SGD "
                  "only); adaptive histories (AADP-FL) are bounded by a Rényi filter "
                  "whatever this says",
    "opacus-mode": "how DP-SGD forms the clipped sum: `bk` (book-keeping clipping: Bu, Wang, "
                   "Zha & Karypis, \"Differentially Private Optimization on Large Model at "
                   "Small Cost\", ICML 2023; `dpfl/client/bookkeeping.py`: per-sample norms "
                   "and the clipped sum from one backward pass; Conv2d, Linear and GroupNorm "
                   "layers "
                   "(every registered model), others refused by name; Opacus' ghost-mode "
                   "optimizer, Poisson loader and accountant, so noise and ε are unchanged; "
                   "equal to `hooks` to float tolerance; 1.6× Opacus' `ghost` on the idle "
                   "machine, `results/speed/README.md`), or Opacus' `ghost`, `hooks`, "
                   "`functorch`, `ew`",
    "fraction-train": "client sampling per round (`trust=central`: the Poisson sampling rate "
                      "q, with amplification accounted)",
    "min-train-nodes": "the fewest clients a round trains on",
    "fraction-evaluate": "client-side evaluation (releases validation metrics in the clear)",
    "evaluate-every": "central evaluation (the server's test set) after every k-th round and "
                      "the run's last; other rounds' lines in `rounds.jsonl` have no "
                      "`central`",
    "server-lr": "server step size η on the averaged update, in (0, 1000]",
    "max-update-norm": "extra L2 bound on accepted updates (0 = off, else 10^-6 to 10^6)",
    "round-timeout": "seconds a round waits for replies (at least 1)",
    "node-wait": "seconds the server waits for `min-train-nodes` connected nodes (at start "
                 "and before each round) before it stops the run early, saying so (the run "
                 "folder's `stopped.json`, a non-zero exit)",
    "seed": "seeds model initialisation, partitioning and evaluation (never DP noise unless "
            "`reproducible=true`); 0 to 2^32 − 1",
    "reproducible": "`true`: DP noise and sampling seeded from `seed` (bit-identical reruns, "
                    "verdict `none`); `false`: secret OS entropy per client and round",
    "output-dir": "the folder that holds run directories",
    "run-name": "the run directory's name (\"\" = automatic: a timestamp with ms, the method "
                "and a random suffix; a new run never reuses a directory); one plain folder "
                "name",
    "resume": "continue the run in `run-name` with its saved settings (only `num-rounds`, "
              "`round-timeout`, `node-wait`, `evaluate-every`, `report-train-loss`, `node-partitions` may "
              "change)",
    "resume-without-checkpoint": "with `resume=true` when `checkpoint.pt` is lost or "
                                 "damaged: train a fresh model after the ledger's last "
                                 "round, every recorded spend kept charged (without it such "
                                 "a resume is refused)",
    "report-train-loss": "send the local train loss (in the clear: the verdict becomes "
                         "`none`)",
    "audit-canaries": "an audit run (`dpfl audit`): clients 0..m−1 are canary clients; each, "
                      "with a secret coin, replaces its update by the canary vector c·u_i "
                      "before its method's release, and the server writes each canary "
                      "reply's score ⟨update, u_i⟩ to `audit.jsonl` (under `trainer=dpsgd` "
                      "the canaries are examples added to the clients' data, at most 100 "
                      "per client; else m is at most the clients)",
    "audit-seed": "the auditor's secret seed of the canaries' coins and directions "
                  "(0 to 2^32 − 1)",
    "audit-canary-norm": "the canary vector's norm c (0 = `clip-norm`)",
    "audit-canary-support": "> 0: sparse canaries on that many secret coordinates (the "
                            "auditor also scores the overlap of each reply's non-zero "
                            "pattern with the canary's support); 0 = dense",
    "record-updates": "keep the last update the server received from clients 0..k−1 "
                      "(`updates/client-<i>.pt`, with the global model it started from) for "
                      "`dpfl attack`",
    "record-global-models": "keep the global model of every round "
                            "(`globals/round-<r>.pt`, ~4 bytes per parameter per round) for "
                            "`dpfl attack`'s CS-MIA (the confidence series of a record across "
                            "the rounds' global models); the global models are what every "
                            "sampled client receives anyway: no privacy cost",
    "plots": "draw the run's figures: `labels.png` (the clients' label counts), "
             "`accuracy.png` and, in a private run, `epsilon.png`; `false` in a sweep of "
             "many runs saves a ServerApp ~1.5 s of CPU (matplotlib)",
    "trust": "who adds the noise (see Trust models): `local` (each client), `central` (a "
             "trusted server; `fraction-train` becomes a Poisson rate and amplification is "
             "accounted), `distributed` (Skellam or discrete Gaussian shares under Flower's "
             "SecAgg+, `secure-noise`); `central` "
             "and `distributed` need `trainer=update-dp` and a method that only uses the "
             "mean of the updates",
    "adaptive-clip": "`trust=central`: adapt C towards a quantile of the update norms "
                     "(Andrew et al. 2021); the noisy count is charged",
    "clip-target-quantile": "`adaptive-clip`: the target quantile γ of the update norms",
    "clip-lr": "`adaptive-clip`: the geometric update's step η",
    "clip-count-stddev": "`adaptive-clip`: the noise std of the clipped count (0 = expected "
                         "clients per round / 20)",
    "central-impl": "`trust=central`: `dpfl`, or `flower` to run the same round through "
                    "Flower's `DifferentialPrivacyServerSideFixedClipping` wrapper "
                    "(fixed-size sampling, missing replies as zero updates; its ε charged "
                    "without amplification, under replace-one) for a side-by-side; not with "
                    "`adaptive-clip`",
    "secagg-min-survivors": "`trust=distributed`: n_min, the guaranteed minimum of "
                            "surviving clients per round (0 = every sampled client); each "
                            "adds 1/n_min of the noise variance, fewer survivors discard "
                            "the round",
    "secagg-noiseless": "`trust=distributed`: t, how many of a round's n_min survivors may "
                        "omit their noise share while the sum still carries the full noise "
                        "(each share then carries 1/(n_min − t) of it; the guarantee states "
                        "the honest count n_min − t it assumes)",
    "secagg-num-shares": "`trust=distributed`: SecAgg+ neighbourhood size (0 = all sampled "
                         "clients, else ≥ 3)",
    "secagg-threshold": "`trust=distributed`: the fraction of a neighbourhood needed to "
                        "reconstruct a dropped client's masks",
    "secagg-scale": "`trust=distributed`: integer units per unit of C (quantisation scale s; "
                    "C s at most 2^30 − 1, SecAgg+'s share range)",
    "secagg-drop-partition": "fault injection for tests: this partition drops out of SecAgg+ "
                             "after sharing its keys (−1 = none)",
    "secure-noise": "`trust=distributed`: the integer noise of each share: `skellam` "
                    "(Agarwal, Kairouz & Liu 2021) or `ddgauss`, the distributed discrete "
                    "Gaussian with its own accounting (Kairouz, Liu & Steinke 2021)",
    "node-partitions": "deployment: the operator's binding `\"<node-id>:<partition-id>,...\"`; "
                       "each reply is charged to its node's partition, and a node outside "
                       "it or claiming another partition is refused (`deploy/netns.sh run` "
                       "and `dpfl deploy` pass it); ids in ASCII digits, node ids 64-bit",
}


def coerce(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"run-config key '{key}': expected true/false, got {value!r}")
    if kind is int:
        if not is_finite_number(value) or int(value) != value:
            raise ConfigError(f"run-config key '{key}': expected an integer, got {value!r}")
        return int(value)
    if kind is float:
        if not is_number(value):
            raise ConfigError(f"run-config key '{key}': expected a number, got {value!r}")
        if not math.isfinite(value):   # no setting means "infinite": inf/nan are typos
            raise ConfigError(f"run-config key '{key}': expected a finite number, got "
                              f"{value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"run-config key '{key}': expected a string, got {value!r}")
    return value


_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def coerce_field(key: str, value: Any, field: dataclasses.Field) -> Any:
    """``coerce`` to a dataclass field's annotated type (bool, int, float or str)."""
    return coerce(key, value, _TYPES[str(field.type)])


GLOBAL_KEYS = tuple(f.name.replace("_", "-") for f in fields(RunConfig) if f.name != "params")


def parse_global(raw: Mapping[str, Any], method_keys: frozenset[str] = frozenset()
                 ) -> RunConfig:
    """The global keys of Flower's run-config mapping as a validated :class:`RunConfig`.

    A key that is neither global nor in ``method_keys`` (every registered method's own
    keys) is an error: a typo would otherwise be ignored."""
    by_key = {f.name.replace("_", "-"): f for f in fields(RunConfig) if f.name != "params"}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        field = by_key.get(key)
        if field is None:
            if key not in method_keys:
                known = ", ".join(sorted(set(by_key) | set(method_keys)))
                raise ConfigError(f"unknown run-config key '{key}' (known keys: {known})")
            continue
        values[field.name] = coerce_field(key, value, field)
    return validate(RunConfig(**values))


def need(cond: bool, key: str, message: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"run-config key '{key}': {message}, got {value!r}")


def validate(cfg: RunConfig) -> RunConfig:
    """Check every global value's range; raise :class:`ConfigError` naming the first bad key.
    (The strategy and model names and the method's own rules are checked by the registry,
    ``dpfl.methods.parse_run_config``.)"""
    need(cfg.dataset in DATASETS, "dataset", f"must be one of {DATASETS}", cfg.dataset)
    need(cfg.partitioning in PARTITIONINGS, "partitioning",
          f"must be one of {PARTITIONINGS}", cfg.partitioning)
    need(cfg.trainer in TRAINERS, "trainer", f"must be one of {TRAINERS}", cfg.trainer)
    need(cfg.accountant in ACCOUNTANTS, "accountant", f"must be one of {ACCOUNTANTS}",
          cfg.accountant)
    if cfg.accountant == "prv":
        need(cfg.trainer == "dpsgd", "accountant",
              "'prv' is Opacus' DP-SGD accountant; use 'pld' or 'rdp' for client-level DP",
              cfg.accountant)
    need(cfg.opacus_mode in OPACUS_MODES, "opacus-mode", f"must be one of {OPACUS_MODES}",
          cfg.opacus_mode)
    need(cfg.dirichlet_alpha > 0, "dirichlet-alpha", "must be > 0", cfg.dirichlet_alpha)
    need(cfg.labels_per_client >= 1, "labels-per-client", "must be >= 1",
          cfg.labels_per_client)
    need(0.0 <= cfg.noniid_fraction <= 1.0, "noniid-fraction", "must be in [0, 1]",
          cfg.noniid_fraction)
    need(0.0 <= cfg.val_fraction < 1.0, "val-fraction", "must be in [0, 1)", cfg.val_fraction)
    need(cfg.server_holdout >= 0, "server-holdout", "must be >= 0", cfg.server_holdout)
    # (the upper ends of both depend on the dataset and the clients: dpfl.launch.preflight)
    need(cfg.train_subset == 0 or cfg.train_subset >= 2, "train-subset",
         "must be 0 (all) or >= 2 (2 examples per client)", cfg.train_subset)
    need(1 <= cfg.num_rounds <= MAX_ROUNDS, "num-rounds", f"must be in [1, {MAX_ROUNDS}]",
         cfg.num_rounds)
    need(1 <= cfg.local_epochs <= MAX_LOCAL_EPOCHS, "local-epochs",
         f"must be in [1, {MAX_LOCAL_EPOCHS}]", cfg.local_epochs)
    need(cfg.batch_size >= 1, "batch-size", "must be >= 1", cfg.batch_size)
    need(0 < cfg.lr <= MAX_LR, "lr", f"must be in (0, {MAX_LR:g}]", cfg.lr)
    need(0.0 <= cfg.momentum < 1.0, "momentum", "must be in [0, 1)", cfg.momentum)
    need(MIN_NORM <= cfg.max_grad_norm <= MAX_NORM, "max-grad-norm",
         f"must be in [{MIN_NORM:g}, {MAX_NORM:g}]", cfg.max_grad_norm)
    need(MIN_NORM <= cfg.clip_norm <= MAX_NORM, "clip-norm",
         f"must be in [{MIN_NORM:g}, {MAX_NORM:g}]", cfg.clip_norm)
    need(0 <= cfg.noise_multiplier <= MAX_NOISE_MULTIPLIER, "noise-multiplier",
         f"must be in [0, {MAX_NOISE_MULTIPLIER:g}] (0 = calibrate to target-epsilon)",
         cfg.noise_multiplier)
    need(MIN_EPSILON <= cfg.target_epsilon <= MAX_EPSILON, "target-epsilon",
         f"must be in [{MIN_EPSILON:g}, {MAX_EPSILON:g}]", cfg.target_epsilon)
    need(MIN_DELTA <= cfg.delta <= MAX_DELTA, "delta",
         f"must be in [{MIN_DELTA:g}, {MAX_DELTA:g}] (above {MAX_DELTA:g} it protects nobody; "
         f"below {MIN_DELTA:g} the accountants lose precision)", cfg.delta)
    need(0.0 < cfg.fraction_train <= 1.0, "fraction-train", "must be in (0, 1]",
          cfg.fraction_train)
    need(cfg.min_train_nodes >= 1, "min-train-nodes", "must be >= 1", cfg.min_train_nodes)
    need(0.0 <= cfg.fraction_evaluate <= 1.0, "fraction-evaluate", "must be in [0, 1]",
          cfg.fraction_evaluate)
    need(0 < cfg.server_lr <= MAX_LR, "server-lr", f"must be in (0, {MAX_LR:g}]", cfg.server_lr)
    need(cfg.max_update_norm == 0 or MIN_NORM <= cfg.max_update_norm <= MAX_NORM,
         "max-update-norm", f"must be 0 (off) or in [{MIN_NORM:g}, {MAX_NORM:g}]",
         cfg.max_update_norm)
    need(cfg.round_timeout >= MIN_ROUND_TIMEOUT, "round-timeout",
         f"must be >= {MIN_ROUND_TIMEOUT:g} (seconds)", cfg.round_timeout)
    need(cfg.node_wait > 0, "node-wait", "must be > 0", cfg.node_wait)
    need(cfg.evaluate_every >= 1, "evaluate-every", "must be >= 1", cfg.evaluate_every)
    need(0 <= cfg.seed <= MAX_SEED, "seed", f"must be in [0, {MAX_SEED}]", cfg.seed)
    need(cfg.audit_canaries >= 0, "audit-canaries", "must be >= 0 (0 = no canaries)",
         cfg.audit_canaries)
    need(0 <= cfg.audit_seed <= MAX_SEED, "audit-seed", f"must be in [0, {MAX_SEED}]",
         cfg.audit_seed)
    need(cfg.audit_canary_norm >= 0, "audit-canary-norm", "must be >= 0 (0 = clip-norm)",
         cfg.audit_canary_norm)
    need(cfg.audit_canary_support >= 0, "audit-canary-support", "must be >= 0 (0 = dense)",
         cfg.audit_canary_support)
    need(cfg.record_updates >= 0, "record-updates", "must be >= 0 (0 = none)",
         cfg.record_updates)
    need(cfg.trust in TRUSTS, "trust", f"must be one of {TRUSTS}", cfg.trust)
    need(0.0 < cfg.clip_target_quantile < 1.0, "clip-target-quantile", "must be in (0, 1)",
         cfg.clip_target_quantile)
    need(cfg.clip_lr > 0, "clip-lr", "must be > 0", cfg.clip_lr)
    need(cfg.central_impl in CENTRAL_IMPLS, "central-impl", f"must be one of {CENTRAL_IMPLS}",
         cfg.central_impl)
    need(cfg.clip_count_stddev >= 0, "clip-count-stddev", "must be >= 0 (0 = m / 20)",
         cfg.clip_count_stddev)
    if cfg.adaptive_clip:
        need(cfg.trust == "central", "adaptive-clip", "needs trust=central",
             cfg.adaptive_clip)
        need(cfg.central_impl != "flower", "adaptive-clip",
             "central-impl=flower's adaptive wrapper noises each round with the clip it has "
             "just moved by that round's noisy count, a data-dependent noise no fixed "
             "composition bounds: use central-impl=dpfl or adaptive-clip=false",
             cfg.adaptive_clip)
    need(cfg.secagg_min_survivors >= 0, "secagg-min-survivors", "must be >= 0",
         cfg.secagg_min_survivors)
    need(cfg.secagg_noiseless >= 0, "secagg-noiseless", "must be >= 0", cfg.secagg_noiseless)
    need(cfg.secagg_num_shares == 0 or cfg.secagg_num_shares >= 3, "secagg-num-shares",
         "must be 0 (all) or >= 3", cfg.secagg_num_shares)
    need(0.0 < cfg.secagg_threshold <= 1.0, "secagg-threshold", "must be in (0, 1]",
         cfg.secagg_threshold)
    need(1.0 <= cfg.secagg_scale <= MAX_SECAGG_UNITS, "secagg-scale",
         f"must be in [1, {MAX_SECAGG_UNITS}]", cfg.secagg_scale)
    need(cfg.secagg_drop_partition >= -1, "secagg-drop-partition", "must be >= -1",
         cfg.secagg_drop_partition)
    need(cfg.secure_noise in SECURE_NOISES, "secure-noise", f"must be one of {SECURE_NOISES}",
         cfg.secure_noise)
    # (after every trust key's own range: a bad value is named before the combination)
    if cfg.trust != "local":
        need(cfg.trainer == "update-dp", "trainer",
             f"trust={cfg.trust} is client-level DP: it needs trainer=update-dp", cfg.trainer)
    if cfg.secure_noise != "skellam":
        need(cfg.trust == "distributed", "secure-noise",
             f"secure-noise={cfg.secure_noise} needs trust=distributed", cfg.secure_noise)
    need(cfg.resume or not cfg.resume_without_checkpoint, "resume-without-checkpoint",
          "needs resume=true", cfg.resume_without_checkpoint)
    need(bool(cfg.output_dir), "output-dir", "must not be empty", cfg.output_dir)
    try:
        parse_node_partitions(cfg.node_partitions)
    except ValueError as exc:
        raise ConfigError(f"run-config key 'node-partitions': {exc}") from None
    if cfg.run_name:
        why = run_name_problem(cfg.run_name)
        need(why is None, "run-name", str(why), cfg.run_name)
    return cfg
