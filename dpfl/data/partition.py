"""Split a training set across clients, through flwr-datasets partitioners.

Schemes (run-config ``partitioning``):

- ``iid``: shuffled, equal shares (``IidPartitioner``).
- ``dirichlet``: per-class Dirichlet(alpha) proportions (``DirichletPartitioner``);
  smaller alpha = more skew.
- ``shards``: pathological, ``labels-per-client`` classes per client
  (``PathologicalPartitioner``, the first class is ``partition_id mod num_classes``).
- ``size``: size-skewed, client i gets a share proportional to i+1 (``LinearPartitioner``).
- ``gcfl-contiguous``: GCFL's non-IID split (Wan et al., arXiv 2506.03618, 2025): contiguous label groups, so with 2
  clients on MNIST client 0 holds labels 0-4 (30,596 samples; the paper says "the first
  30,000") and client 1 labels 5-9.
- ``noniid-fraction``: AADP-FL's "percentage of non-IID" f (the AADP-FL paper gives no formula; we use
  the DP-SCAFFOLD "similarity" construction, s = 1 - f): a fraction f of the training set is
  sorted by label and dealt in contiguous equal blocks, one per client; the remaining 1 - f
  is shuffled and split IID. f = 0 is IID; f = 1 is a pure label-sorted split.
- ``class-grouped``: samples grouped by class and unevenly dealt out (the SVHN split of "An
  Adaptive Differentially Private Federated Learning Framework with Bi-level Optimization",
  2025, which gives no formula): the label-sorted training set is cut into contiguous chunks
  whose sizes follow a seeded Dirichlet(1.0) over clients, each at least
  max(1, n // (20 * num_partitions)) samples. A client holds a contiguous run of classes,
  one to a few, in uneven amounts; a large chunk spans more classes (10 clients on 10
  balanced classes: most hold 1-2, the largest 4 or more for about 6 seeds in 10).

Every scheme is deterministic given (seed, num_partitions). Each client then holds out
``val-fraction`` of its share as a local validation split.

The partitioners live in :mod:`dpfl.data.partitioners`. Every process of a federation (the
launcher, the ServerApp, each client, each round's ClientApp process of a deployment)
needs the partition, and importing flwr-datasets costs seconds of CPU each time, so
:func:`partition_indices` keeps its answers in a memo on disk (:mod:`dpfl.memo`) keyed by
the question, a digest of the labels and the versions of flwr-datasets and of this code.

A kept answer is checked against what it claims to be before use: one int64 index array
per partition, within range, disjoint, complete where the scheme is, and equal, array for
array (sizes, label counts, which samples, their order, which decides each client's local
validation hold-out), to :func:`dpfl.data.assignment.reference_partition`: the same
assignment recomputed with numpy alone (each partitioner's rule, its random draws in the
same order from the same seed; milliseconds, no flwr-datasets import). A skewed or
otherwise edited entry, an unreadable one or one of another key is logged (one WARNING
naming the memo file and the key), discarded and partitioned afresh. A fresh answer is
kept only if it equals the reference too: a flwr-datasets release whose partitioners draw
differently (its version is in the key) then runs without the memo, with a WARNING, rather
than with an unchecked one.
"""

from __future__ import annotations

import hashlib
import io
import logging
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from dpfl import memo
from dpfl.data.assignment import reference_partition

log = logging.getLogger("flwr.dpfl.data")

MEMO_KIND = "partitions"
# schemes whose partitions may leave samples out (the pathological partitioner may leave
# classes unassigned)
INCOMPLETE_SCHEMES = ("shards",)


@lru_cache(maxsize=1)
def _code_version() -> str:
    here = Path(__file__).parent
    return memo.code_version("flwr-datasets", here / "partition.py", here / "partitioners.py",
                             here / "assignment.py")


def _memo_key(labels: np.ndarray, scheme: str, num_partitions: int, seed: int,
              kwargs: dict[str, float]) -> str:
    labels_digest = hashlib.sha256(np.ascontiguousarray(labels).tobytes()).hexdigest()
    return repr((_code_version(), scheme, int(num_partitions), int(seed),
                 sorted(kwargs.items()), str(labels.dtype), len(labels), labels_digest))


def valid_partition(parts: list[np.ndarray], n: int, num_partitions: int,
                    complete: bool) -> bool:
    """One int64 index array per partition, within [0, n), disjoint, and covering every
    index when ``complete``."""
    if len(parts) != num_partitions or any(p.dtype != np.int64 or p.ndim != 1 for p in parts):
        return False
    everything = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if everything.size and (everything.min() < 0 or everything.max() >= n):
        return False
    if np.unique(everything).size != everything.size:
        return False
    return everything.size == n if complete else True


def partition_problem(parts: list[np.ndarray], reference: list[np.ndarray], labels: np.ndarray,
                      complete: bool) -> str | None:
    """Why ``parts`` is not the partition it claims to be (None: it is): its structure
    (:func:`valid_partition`), then, partition by partition, its size and label counts and
    its indices against ``reference``."""
    n, k = len(labels), len(reference)
    if not valid_partition(parts, n, k, complete):
        return ("not one int64 index array per partition, within range, disjoint"
                + (" and complete" if complete else ""))
    if (np.array_equal([len(p) for p in parts], [len(r) for r in reference])
            and np.array_equal(np.concatenate(parts) if parts else np.empty(0),
                               np.concatenate(reference) if reference else np.empty(0))):
        return None   # the reference itself, index for index: no partition differs
    classes, codes = np.unique(labels, return_inverse=True)
    for pid, (mine, ref) in enumerate(zip(parts, reference)):
        have = np.bincount(codes[mine], minlength=len(classes))
        want = np.bincount(codes[ref], minlength=len(classes))
        if len(mine) != len(ref) or not np.array_equal(have, want):
            diff = {classes[c].item(): int(have[c] - want[c])
                    for c in np.flatnonzero(have - want)}
            return (f"partition {pid} holds {len(mine)} samples where the partitioner gives "
                    f"{len(ref)}, its label counts differ by {diff} (a skewed partition)")
        if not np.array_equal(mine, ref):
            return (f"partition {pid} holds other samples (or in another order) than the "
                    "partitioner gives")
    return None


def _discard(key: str, why: str) -> None:
    """One WARNING naming the entry's file and key, and the entry removed."""
    log.warning("partition memo entry %s (key %r) fails its check: %s; discarded, "
                "partitioning afresh", memo.entry_file(MEMO_KIND, key), key, why)
    memo.discard(MEMO_KIND, key)


def _recall(key: str, labels: np.ndarray, reference: Callable[[], list[np.ndarray]],
            complete: bool) -> list[np.ndarray] | None:
    """The kept partition of ``key`` once checked against ``reference()`` (None: no memo,
    no entry, or one that fails, discarded with a WARNING)."""
    data = memo.read(MEMO_KIND, key)
    if data is None:
        return None
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            kept_key = str(npz["key"])
            if kept_key != key:
                _discard(key, f"it holds the partition of another key ({kept_key[:80]!r})")
                return None
            indices, offsets = npz["indices"], npz["offsets"]
        parts = _unpacked(indices, offsets)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        _discard(key, f"unreadable ({type(exc).__name__}: {exc})")
        return None
    why = partition_problem(parts, reference(), labels, complete)
    if why is not None:
        _discard(key, why)
        return None
    return parts


def _unpacked(indices: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """The partitions a memo entry packs as one index array and the partitions' offsets
    into it (a ValueError when the offsets do not cut ``indices`` into consecutive parts)."""
    if (indices.ndim != 1 or offsets.ndim != 1 or offsets.dtype != np.int64
            or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(indices)
            or bool((np.diff(offsets) < 0).any())):
        raise ValueError("its offsets do not cut its indices into partitions")
    return np.split(indices, offsets[1:-1])


def _keep(key: str, parts: list[np.ndarray]) -> None:
    """Keep ``parts`` packed in two arrays (one entry per partition took ~1.4 s to read
    back at 10,000 clients in every process, two arrays a few milliseconds)."""
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    indices = np.concatenate(parts) if parts else np.empty(0, np.int64)
    buffer = io.BytesIO()
    np.savez(buffer, key=np.array(key), indices=indices, offsets=offsets)
    memo.write(MEMO_KIND, key, buffer.getvalue())


def partition_indices(labels: np.ndarray, scheme: str, num_partitions: int, *,
                      seed: int = 42, **kwargs: float) -> list[np.ndarray]:
    """Indices into ``labels`` for every partition (disjoint; complete for all schemes
    except ``shards``, whose partitioner may leave classes unassigned)."""
    if num_partitions < 1:
        raise ValueError("num_partitions must be >= 1")
    if num_partitions > len(labels):
        raise ValueError(f"{num_partitions} clients but only {len(labels)} training samples")
    labels = np.asarray(labels)
    complete = scheme not in INCOMPLETE_SCHEMES
    key = _memo_key(labels, scheme, num_partitions, seed, kwargs)
    if memo.memo_dir(MEMO_KIND) is None:   # no memo: nothing to check or keep
        from dpfl.data.partitioners import compute_partition_indices

        return compute_partition_indices(labels, scheme, num_partitions, seed=seed, **kwargs)
    ref: list[list[np.ndarray]] = []

    def reference() -> list[np.ndarray]:
        if not ref:
            ref.append(reference_partition(labels, scheme, num_partitions, seed=seed,
                                           **kwargs))
        return ref[0]

    kept = _recall(key, labels, reference, complete)
    if kept is not None:
        return kept
    from dpfl.data.partitioners import compute_partition_indices

    parts = compute_partition_indices(labels, scheme, num_partitions, seed=seed, **kwargs)
    try:
        why = partition_problem(parts, reference(), labels, complete)
    except ValueError as exc:   # e.g. the reference's own draws fail where flwr's did not
        why = str(exc)
    if why is None:
        _keep(key, parts)
    else:
        log.warning("the partition memo's check does not reproduce %s's %r partition (%s): "
                    "no entry kept, every process partitions afresh", _code_version(),
                    scheme, why)
    return parts


@dataclass(frozen=True)
class ClientSplit:
    """One client's share of the training set: train and local-validation indices."""

    train: np.ndarray
    val: np.ndarray


def split_validation(indices: np.ndarray, val_fraction: float, seed: int) -> ClientSplit:
    """Hold out ``val_fraction`` of a client's indices (at least one sample stays in train)."""
    rng = np.random.default_rng(seed)
    shuffled = indices[rng.permutation(len(indices))]
    n_val = min(int(round(val_fraction * len(indices))), max(len(indices) - 1, 0))
    return ClientSplit(train=np.sort(shuffled[n_val:]), val=np.sort(shuffled[:n_val]))


def client_splits(labels: np.ndarray, scheme: str, num_partitions: int, *, seed: int,
                  val_fraction: float, **kwargs: float) -> list[ClientSplit]:
    """Partition, then hold out each client's validation split (seeded per client)."""
    parts = partition_indices(labels, scheme, num_partitions, seed=seed, **kwargs)
    return [split_validation(p, val_fraction, seed + 1000 + i) for i, p in enumerate(parts)]


def label_counts(labels: np.ndarray, splits: list[ClientSplit], num_classes: int) -> np.ndarray:
    """(num_clients, num_classes) counts of training labels per client."""
    return np.stack([np.bincount(labels[s.train], minlength=num_classes) for s in splits])
