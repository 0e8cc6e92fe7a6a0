"""The flwr-datasets partitioners behind each scheme of :mod:`dpfl.data.partition`, and dpfl's
own (GCFL's contiguous labels, AADP-FL's non-IID fraction, the class-grouped split).

Kept apart because importing flwr-datasets (with HF datasets, pandas, seaborn and
matplotlib) costs seconds of CPU: :func:`dpfl.data.partition.partition_indices` imports
this module only when its partition memo cannot answer.
"""

from __future__ import annotations

import numpy as np
from datasets import Dataset
from flwr_datasets.partitioner import (
    DirichletPartitioner,
    IidPartitioner,
    LinearPartitioner,
    Partitioner,
    PathologicalPartitioner,
)

from dpfl.data.assignment import (
    class_grouped_rows,
    class_grouped_sizes,
    contiguous_label_rows,
    noniid_fraction_rows,
)


class _OwnPartitioner(Partitioner):
    """dpfl's partitioners: a fixed number of partitions over the ``partition_by`` column,
    with a seed where the split draws one."""

    def __init__(self, num_partitions: int, partition_by: str = "label", seed: int = 42) -> None:
        super().__init__()
        self._num_partitions = num_partitions
        self._partition_by = partition_by
        self._seed = seed

    @property
    def num_partitions(self) -> int:
        return self._num_partitions


class ContiguousLabelPartitioner(_OwnPartitioner):
    """GCFL's contiguous label split: the classes are cut into ``num_partitions``
    contiguous groups and client k gets every sample whose label is in group k (2 clients on
    MNIST: labels 0-4, 30,596 samples, and labels 5-9). With more clients than classes it
    falls back to label-sorted contiguous blocks of equal size
    (:func:`dpfl.data.assignment.contiguous_label_rows`)."""

    def load_partition(self, partition_id: int) -> Dataset:
        labels = np.asarray(self.dataset[self._partition_by])
        return self.dataset.select(
            contiguous_label_rows(labels, self._num_partitions)[partition_id])


class NonIidFractionPartitioner(_OwnPartitioner):
    """AADP-FL's non-IID fraction f: f of the data label-sorted in blocks, 1 - f IID
    (:func:`dpfl.data.assignment.noniid_fraction_rows`)."""

    def __init__(self, num_partitions: int, fraction: float, seed: int = 42,
                 partition_by: str = "label") -> None:
        super().__init__(num_partitions, partition_by, seed)
        self._fraction = fraction

    def load_partition(self, partition_id: int) -> Dataset:
        labels = np.asarray(self.dataset[self._partition_by])
        return self.dataset.select(noniid_fraction_rows(labels, self._num_partitions,
                                                        self._fraction, self._seed)[partition_id])


class ClassGroupedPartitioner(_OwnPartitioner):
    """Label-sorted contiguous chunks with Dirichlet(``concentration``) sizes, each at least
    ``max(1, n // (20 * num_partitions))`` samples (see the module docstring;
    :func:`dpfl.data.assignment.class_grouped_rows`)."""

    def __init__(self, num_partitions: int, seed: int = 42, concentration: float = 1.0,
                 partition_by: str = "label") -> None:
        super().__init__(num_partitions, partition_by, seed)
        self._concentration = concentration

    def chunk_sizes(self, n: int) -> np.ndarray:
        """The ``num_partitions`` chunk sizes (sum ``n``): the minimum, plus the rest split
        by seeded Dirichlet proportions (largest-remainder rounding)."""
        return class_grouped_sizes(n, self._num_partitions, self._seed, self._concentration)

    def load_partition(self, partition_id: int) -> Dataset:
        # numpy format: one array, not a Python object per row
        labels = np.asarray(self.dataset.with_format("numpy")[:][self._partition_by])
        return self.dataset.select(class_grouped_rows(labels, self._num_partitions,
                                                      self._seed,
                                                      self._concentration)[partition_id])


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


def compute_partition_indices(labels: np.ndarray, scheme: str, num_partitions: int, *,
                              seed: int = 42, **kwargs: float) -> list[np.ndarray]:
    """Indices into ``labels`` for every partition, through the scheme's partitioner.
    Schemes that do not shuffle themselves (iid, size) see a seeded permutation; the
    label-sorted schemes sort stably, so the permutation only reorders within a label."""
    n = len(labels)
    perm = np.random.default_rng(seed).permutation(n)
    table = Dataset.from_dict({"idx": perm, "label": labels[perm]})
    partitioner = make_partitioner(scheme, num_partitions, seed=seed, **kwargs)  # type: ignore[arg-type]
    partitioner.dataset = table
    return [np.asarray(partitioner.load_partition(i)["idx"], dtype=np.int64)
            for i in range(num_partitions)]
