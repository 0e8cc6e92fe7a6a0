"""Partitioning: disjoint, complete, skew behaves as the scheme says."""

from pathlib import Path

import numpy as np
import pytest

from dpfl.data import load_dataset
from dpfl.data.partition import (
    client_splits,
    label_counts,
    partition_indices,
)
from dpfl.data.partitioners import ClassGroupedPartitioner

LABELS = np.repeat(np.arange(10), 200)  # 2,000 samples, 200 per class


def _check_disjoint_complete(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == len(np.unique(allidx)), "partitions overlap"
    assert sorted(allidx.tolist()) == list(range(n)), "partitions are not complete"


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "size", "gcfl-contiguous",
                                    "noniid-fraction", "class-grouped"])
def test_disjoint_and_complete(scheme):
    parts = partition_indices(LABELS, scheme, 5, seed=1, alpha=0.5, noniid_fraction=0.5)
    assert len(parts) == 5
    _check_disjoint_complete(parts, len(LABELS))


def test_shards_disjoint_and_k_labels():
    parts = partition_indices(LABELS, "shards", 5, seed=1, labels_per_client=2)
    allidx = np.concatenate(parts)
    assert len(allidx) == len(np.unique(allidx))
    for p in parts:
        assert len(np.unique(LABELS[p])) <= 2


def test_iid_is_balanced_and_shuffled():
    parts = partition_indices(LABELS, "iid", 4, seed=0)
    assert {len(p) for p in parts} == {500}
    for p in parts:  # every class present with roughly its share
        counts = np.bincount(LABELS[p], minlength=10)
        assert counts.min() > 25


def _skew(parts):
    """Mean total-variation distance between client label distributions and the global one."""
    glob = np.bincount(LABELS, minlength=10) / len(LABELS)
    return float(np.mean([0.5 * np.abs(np.bincount(LABELS[p], minlength=10) / len(p) - glob).sum()
                          for p in parts]))


def test_dirichlet_skew_grows_as_alpha_shrinks():
    skews = [np.mean([_skew(partition_indices(LABELS, "dirichlet", 5, seed=s, alpha=a))
                      for s in range(3)]) for a in (100.0, 1.0, 0.1)]
    assert skews[0] < skews[1] < skews[2]
    assert skews[0] < 0.1 and skews[2] > 0.4


def test_gcfl_contiguous_two_clients_split_labels_0_4_and_5_9():
    parts = partition_indices(LABELS, "gcfl-contiguous", 2, seed=3)
    assert set(LABELS[parts[0]]) == {0, 1, 2, 3, 4}
    assert set(LABELS[parts[1]]) == {5, 6, 7, 8, 9}


def test_noniid_fraction_extremes():
    iid = partition_indices(LABELS, "noniid-fraction", 10, seed=0, noniid_fraction=0.0)
    pure = partition_indices(LABELS, "noniid-fraction", 10, seed=0, noniid_fraction=1.0)
    half = partition_indices(LABELS, "noniid-fraction", 10, seed=0, noniid_fraction=0.5)
    assert _skew(iid) < _skew(half) < _skew(pure)
    # f = 1 with 10 clients and 10 equal classes: each client holds exactly one label
    assert all(len(np.unique(LABELS[p])) == 1 for p in pure)


def test_size_partition_sizes_grow_linearly():
    sizes = [len(p) for p in partition_indices(LABELS, "size", 4, seed=0)]
    assert sizes == sorted(sizes) and sizes[3] > 3 * sizes[0]


LABELS_10K = np.repeat(np.arange(10), 1000)  # 10,000 samples, 1,000 per class


def test_class_grouped_is_deterministic_uneven_and_never_empty():
    parts = partition_indices(LABELS_10K, "class-grouped", 10, seed=7)
    _check_disjoint_complete(parts, len(LABELS_10K))
    again = partition_indices(LABELS_10K, "class-grouped", 10, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition_indices(LABELS_10K, "class-grouped", 10, seed=8)
    assert [len(p) for p in other] != [len(p) for p in parts]
    assert [len(p) for p in parts] == ClassGroupedPartitioner(10, seed=7).chunk_sizes(
        10_000).tolist()
    for seed in range(20):
        sizes = ClassGroupedPartitioner(10, seed=seed).chunk_sizes(10_000)
        assert sizes.sum() == 10_000
        assert sizes.min() >= 10_000 // (20 * 10)  # the floor: no client is (nearly) empty
        assert sizes.max() / sizes.min() > 2
    # the floor is at least one sample: 7 clients on 9 samples all get some
    tiny = partition_indices(LABELS[:9], "class-grouped", 7, seed=0)
    assert all(len(p) >= 1 for p in tiny) and sum(map(len, tiny)) == 9


def test_class_grouped_clients_hold_contiguous_runs_of_few_classes():
    for seed in range(3):
        parts = partition_indices(LABELS_10K, "class-grouped", 10, seed=seed)
        held = [np.unique(LABELS_10K[p]) for p in parts]
        for k, labels in enumerate(held):
            # a contiguous run of classes, in client order, as wide as the chunk needs:
            # a chunk of s samples spans at most ceil(s / 1000) + 1 classes
            assert np.array_equal(labels, np.arange(labels[0], labels[-1] + 1))
            assert len(labels) <= -(-len(parts[k]) // 1000) + 1
            if k:
                assert held[k - 1][-1] <= labels[0]
        # one to a few classes: most clients hold one or two (chunks of ~1,000 on average)
        assert np.median([len(labels) for labels in held]) <= 2


def test_validation_holdout_disjoint():
    splits = client_splits(LABELS, "iid", 4, seed=0, val_fraction=0.1)
    for s in splits:
        assert len(np.intersect1d(s.train, s.val)) == 0
        assert len(s.val) == 50 and len(s.train) == 450
    counts = label_counts(LABELS, splits, 10)
    assert counts.shape == (4, 10) and counts.sum() == 1800


def test_too_many_clients_is_an_error():
    with pytest.raises(ValueError, match="clients but only"):
        partition_indices(LABELS[:3], "iid", 5)


def test_digits_loader_real_data():
    ds = load_dataset("digits")
    assert ds.x_train.shape[1:] == (8, 8) and ds.x_train.dtype == np.uint8
    assert len(ds.y_train) + len(ds.y_test) == 1797
    assert set(np.unique(ds.y_train)) == set(range(10))


def test_mnist_loader_full_size():
    ds = load_dataset("mnist")
    assert ds.x_train.shape == (60000, 28, 28) and ds.x_test.shape == (10000, 28, 28)
    assert np.bincount(ds.y_train).tolist()[:3] == [5923, 6742, 5958]  # the classic counts


def test_missing_dataset_names_how_to_get_it(tmp_path):
    from dpfl.data.loaders import DatasetUnavailable, _load_torchvision

    with pytest.raises(DatasetUnavailable, match="data-dir"):
        _load_torchvision("cifar10", "", False)


def _write_idx(path, array):
    import gzip
    import struct

    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_mnist_from_a_torchvision_format_data_dir(tmp_path):
    ref = load_dataset("mnist")
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    _write_idx(raw / "train-images-idx3-ubyte.gz", ref.x_train[:100])
    _write_idx(raw / "train-labels-idx1-ubyte.gz", ref.y_train[:100])
    _write_idx(raw / "t10k-images-idx3-ubyte.gz", ref.x_test[:10])
    _write_idx(raw / "t10k-labels-idx1-ubyte.gz", ref.y_test[:10])
    ds = load_dataset("mnist", str(tmp_path))
    assert np.array_equal(ds.x_train, ref.x_train[:100]) and np.array_equal(ds.y_test, ref.y_test[:10])


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").exists(),
                    reason="Debian's dataset-fashion-mnist is not installed "
                           "(apt-get install dataset-fashion-mnist; .ci/run does)")
def test_fashion_mnist_from_debian_package():
    ds = load_dataset("fashion-mnist")
    assert ds.x_train.shape == (60000, 28, 28) and ds.x_test.shape == (10000, 28, 28)
    assert np.bincount(ds.y_train).tolist() == [6000] * 10
