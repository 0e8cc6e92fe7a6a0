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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from datasets import Dataset
from flwr_datasets.partitioner import (
    DirichletPartitioner,
    IidPartitioner,
    LinearPartitioner,
    Partitioner,
    PathologicalPartitioner,
)


class ContiguousLabelPartitioner(Partitioner):
    """GCFL's contiguous label split: the classes are cut into ``num_partitions``
    contiguous groups and client k gets every sample whose label is in group k (2 clients on
    MNIST: labels 0-4, 30,596 samples, and labels 5-9). With more clients than classes it
    falls back to label-sorted contiguous blocks of equal size."""

    def __init__(self, num_partitions: int, partition_by: str = "label") -> None:
        super().__init__()
        self._num_partitions = num_partitions
        self._partition_by = partition_by

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    def load_partition(self, partition_id: int) -> Dataset:
        labels = np.asarray(self.dataset[self._partition_by])
        classes = np.unique(labels)
        if self._num_partitions <= len(classes):
            group = np.array_split(classes, self._num_partitions)[partition_id]
            return self.dataset.select(np.flatnonzero(np.isin(labels, group)))
        order = np.argsort(labels, kind="stable")
        return self.dataset.select(np.array_split(order, self._num_partitions)[partition_id])


class NonIidFractionPartitioner(Partitioner):
    """AADP-FL's non-IID fraction f: f of the data label-sorted in blocks, 1 - f IID."""

    def __init__(self, num_partitions: int, fraction: float, seed: int = 42,
                 partition_by: str = "label") -> None:
        super().__init__()
        self._num_partitions = num_partitions
        self._fraction = fraction
        self._seed = seed
        self._partition_by = partition_by

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    def load_partition(self, partition_id: int) -> Dataset:
        labels = np.asarray(self.dataset[self._partition_by])
        order = np.random.default_rng(self._seed).permutation(len(labels))
        n_sorted = int(round(self._fraction * len(labels)))
        sorted_part = order[:n_sorted][np.argsort(labels[order[:n_sorted]], kind="stable")]
        iid_part = order[n_sorted:]
        mine = np.concatenate([np.array_split(sorted_part, self._num_partitions)[partition_id],
                               np.array_split(iid_part, self._num_partitions)[partition_id]])
        return self.dataset.select(np.sort(mine))


class ClassGroupedPartitioner(Partitioner):
    """Label-sorted contiguous chunks with Dirichlet(``concentration``) sizes, each at least
    ``max(1, n // (20 * num_partitions))`` samples (see the module docstring)."""

    def __init__(self, num_partitions: int, seed: int = 42, concentration: float = 1.0,
                 partition_by: str = "label") -> None:
        super().__init__()
        self._num_partitions = num_partitions
        self._seed = seed
        self._concentration = concentration
        self._partition_by = partition_by

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    def chunk_sizes(self, n: int) -> np.ndarray:
        """The ``num_partitions`` chunk sizes (sum ``n``): the minimum, plus the rest split
        by seeded Dirichlet proportions (largest-remainder rounding)."""
        k = self._num_partitions
        minimum = max(1, n // (20 * k))
        rest = n - minimum * k
        share = np.random.default_rng(self._seed).dirichlet(np.full(k, self._concentration))
        raw = share * rest
        sizes = np.floor(raw).astype(np.int64)
        leftover = rest - int(sizes.sum())
        sizes[np.argsort(-(raw - sizes), kind="stable")[:leftover]] += 1
        return sizes + minimum

    def load_partition(self, partition_id: int) -> Dataset:
        # numpy format: one array, not a Python object per row
        labels = np.asarray(self.dataset.with_format("numpy")[:][self._partition_by])
        order = np.argsort(labels, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(self.chunk_sizes(len(labels)))])
        mine = order[bounds[partition_id]:bounds[partition_id + 1]]
        return self.dataset.select(np.sort(mine))


def make_partitioner(scheme: str, num_partitions: int, *, seed: int = 42,
                     alpha: float = 0.5, labels_per_client: int = 2,
                     noniid_fraction: float = 0.5) -> Partitioner:
    """The flwr-datasets partitioner for a scheme name (see the module docstring)."""
    if scheme == "iid":
        return IidPartitioner(num_partitions)
    if scheme == "dirichlet":
        return DirichletPartitioner(num_partitions, "label", alpha, min_partition_size=1,
                                    self_balancing=False, shuffle=True, seed=seed)
    if scheme == "shards":
        return PathologicalPartitioner(num_partitions, "label", labels_per_client,
                                       class_assignment_mode="first-deterministic",
                                       shuffle=True, seed=seed)
    if scheme == "size":
        return LinearPartitioner(num_partitions)
    if scheme == "gcfl-contiguous":
        return ContiguousLabelPartitioner(num_partitions)
    if scheme == "noniid-fraction":
        return NonIidFractionPartitioner(num_partitions, noniid_fraction, seed=seed)
    if scheme == "class-grouped":
        return ClassGroupedPartitioner(num_partitions, seed=seed)
    raise ValueError(f"unknown partitioning scheme {scheme!r}")


def partition_indices(labels: np.ndarray, scheme: str, num_partitions: int, *,
                      seed: int = 42, **kwargs: float) -> list[np.ndarray]:
    """Indices into ``labels`` for every partition (disjoint; complete for all schemes
    except ``shards``, whose partitioner may leave classes unassigned)."""
    if num_partitions < 1:
        raise ValueError("num_partitions must be >= 1")
    if num_partitions > len(labels):
        raise ValueError(f"{num_partitions} clients but only {len(labels)} training samples")
    n = len(labels)
    # Schemes that do not shuffle themselves (iid, size) see a seeded permutation; the
    # label-sorted schemes sort stably, so the permutation only reorders within a label.
    perm = np.random.default_rng(seed).permutation(n)
    table = Dataset.from_dict({"idx": perm, "label": labels[perm]})
    partitioner = make_partitioner(scheme, num_partitions, seed=seed, **kwargs)  # type: ignore[arg-type]
    partitioner.dataset = table
    return [np.asarray(partitioner.load_partition(i)["idx"], dtype=np.int64)
            for i in range(num_partitions)]


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
