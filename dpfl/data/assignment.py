"""Each partitioning scheme's assignment of samples to clients with numpy alone: the check
of a partition memo entry (:mod:`dpfl.data.partition`), and the rule of dpfl's own
partitioners (:mod:`dpfl.data.partitioners`, which compute through flwr-datasets).

For flwr-datasets' partitioners (``IidPartitioner``, ``LinearPartitioner``,
``DirichletPartitioner``, ``PathologicalPartitioner``) each function restates the
partitioner's rule and draws its random numbers in the same order from a generator with the
same seed, so it gives the same arrays, in the same order (tests/test_partition_memo.py
compares them over schemes, sizes and seeds). A flwr-datasets release that changes a rule
is caught there, and by the memo, which then keeps nothing.
"""

from __future__ import annotations

import numpy as np

# ``t`` is the table the partitioners see: the labels in the seeded permutation of
# :func:`dpfl.data.partitioners.compute_partition_indices`; each function returns the rows
# of that table every partition gets, in the partitioner's order.


def contiguous_label_rows(t: np.ndarray, num_partitions: int) -> list[np.ndarray]:
    """GCFL's contiguous label groups (``ContiguousLabelPartitioner``)."""
    classes = np.unique(t)
    if num_partitions <= len(classes):
        return [np.flatnonzero(np.isin(t, group))
                for group in np.array_split(classes, num_partitions)]
    return np.array_split(np.argsort(t, kind="stable"), num_partitions)


def noniid_fraction_rows(t: np.ndarray, num_partitions: int, fraction: float,
                         seed: int) -> list[np.ndarray]:
    """AADP-FL's non-IID fraction (``NonIidFractionPartitioner``): ``fraction`` of the
    rows label-sorted in blocks, the rest IID."""
    order = np.random.default_rng(seed).permutation(len(t))
    n_sorted = int(round(fraction * len(t)))
    sorted_part = order[:n_sorted][np.argsort(t[order[:n_sorted]], kind="stable")]
    iid_part = order[n_sorted:]
    return [np.sort(np.concatenate([a, b]))
            for a, b in zip(np.array_split(sorted_part, num_partitions),
                            np.array_split(iid_part, num_partitions))]


def class_grouped_sizes(n: int, num_partitions: int, seed: int,
                        concentration: float = 1.0) -> np.ndarray:
    """The class-grouped chunk sizes (sum ``n``): the minimum max(1, n // (20 k)), plus the
    rest split by seeded Dirichlet(``concentration``) proportions (largest remainder)."""
    k = num_partitions
    minimum = max(1, n // (20 * k))
    rest = n - minimum * k
    share = np.random.default_rng(seed).dirichlet(np.full(k, concentration))
    raw = share * rest
    sizes = np.floor(raw).astype(np.int64)
    leftover = rest - int(sizes.sum())
    sizes[np.argsort(-(raw - sizes), kind="stable")[:leftover]] += 1
    return sizes + minimum


def class_grouped_rows(t: np.ndarray, num_partitions: int, seed: int,
                       concentration: float = 1.0) -> list[np.ndarray]:
    """Label-sorted contiguous chunks of :func:`class_grouped_sizes` (``ClassGrouped``)."""
    order = np.argsort(t, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(class_grouped_sizes(len(t), num_partitions, seed,
                                                                concentration))])
    return [np.sort(order[bounds[i]:bounds[i + 1]]) for i in range(num_partitions)]


def _size_rows(n: int, num_partitions: int) -> list[np.ndarray]:
    """flwr-datasets' ``LinearPartitioner`` (``IdToSizeFncPartitioner`` with size ~ id):
    sizes int(n (i + 1) / sum), the remainder to the last, contiguous rows."""
    units = np.linspace(start=1, stop=num_partitions, num=num_partitions)
    sizes = np.array(units / units.sum() * n, dtype=np.int64)
    sizes[-1] += n - int(sizes.sum())
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [np.arange(bounds[i], bounds[i + 1]) for i in range(num_partitions)]


def _dirichlet_rows(t: np.ndarray, num_partitions: int, seed: int, alpha: float,
                    min_partition_size: int = 1) -> list[np.ndarray]:
    """flwr-datasets' ``DirichletPartitioner`` (no self-balancing, shuffled): per class in
    sorted order a Dirichlet(alpha) draw cuts the class's rows at int(cumsum x count);
    drawn again (up to 10 times) until every partition has ``min_partition_size`` rows;
    then each partition shuffled, all from one generator seeded with ``seed``."""
    rng = np.random.default_rng(seed)
    alphas = np.array([float(alpha)], dtype=float).repeat(num_partitions)
    classes = sorted(np.unique(t).tolist())
    for _ in range(11):
        parts: list[list[int]] = [[] for _ in range(num_partitions)]
        for k in classes:
            rows = np.nonzero(t == k)[0]
            cuts = (np.cumsum(rng.dirichlet(alphas)) * len(rows)).astype(int)[:-1]
            for part, chunk in zip(parts, np.split(rows, cuts)):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_partition_size:
            break
    else:
        raise ValueError("the Dirichlet draws never gave every partition a sample")
    for part in parts:
        rng.shuffle(part)
    return [np.asarray(p, dtype=np.int64) for p in parts]


def _shards_rows(t: np.ndarray, num_partitions: int, seed: int,
                 labels_per_client: int) -> list[np.ndarray]:
    """flwr-datasets' ``PathologicalPartitioner`` ("first-deterministic", shuffled):
    partition i holds class i mod K and further classes drawn uniformly until it has
    ``labels_per_client``; each class's rows are split evenly (``array_split``) among its
    holders in partition order; then each partition shuffled."""
    rng = np.random.default_rng(seed)
    unique = sorted(np.unique(t).tolist())
    held: list[list] = []
    for pid in range(num_partitions):
        mine = [unique[pid % len(unique)]]
        while len(mine) < labels_per_client:
            label = rng.choice(unique, size=1)[0]
            if label not in mine:
                mine.append(label)
        held.append(mine)
    parts: list[list[int]] = [[] for _ in range(num_partitions)]
    for label in unique:
        holders = [pid for pid in range(num_partitions) if label in held[pid]]
        if not holders:
            continue
        for pid, chunk in zip(holders, np.array_split(np.where(t == label)[0], len(holders))):
            parts[pid].extend(chunk)
    for part in parts:
        rng.shuffle(part)
    return [np.asarray(p, dtype=np.int64) for p in parts]


def reference_partition(labels: np.ndarray, scheme: str, num_partitions: int, *,
                        seed: int = 42, alpha: float = 0.5, labels_per_client: int = 2,
                        noniid_fraction: float = 0.5) -> list[np.ndarray]:
    """The partition :func:`dpfl.data.partitioners.compute_partition_indices` gives, with
    numpy alone (the check of a memo entry; the defaults are ``make_partitioner``'s)."""
    n = len(labels)
    perm = np.random.default_rng(seed).permutation(n)
    t = np.asarray(labels)[perm]
    if scheme == "iid":
        rows = np.array_split(np.arange(n), num_partitions)   # contiguous shards
    elif scheme == "size":
        rows = _size_rows(n, num_partitions)
    elif scheme == "dirichlet":
        rows = _dirichlet_rows(t, num_partitions, seed, alpha)
    elif scheme == "shards":
        rows = _shards_rows(t, num_partitions, seed, labels_per_client)
    elif scheme == "gcfl-contiguous":
        rows = contiguous_label_rows(t, num_partitions)
    elif scheme == "noniid-fraction":
        rows = noniid_fraction_rows(t, num_partitions, noniid_fraction, seed)
    elif scheme == "class-grouped":
        rows = class_grouped_rows(t, num_partitions, seed)
    else:
        raise ValueError(f"unknown partitioning scheme {scheme!r}")
    return [perm[r].astype(np.int64) for r in rows]
