"""The partition memo: a hit equals a fresh partition and needs no flwr-datasets import;
damaged or edited entries (overlapping, out of range, missing a sample, skewed, reordered)
are logged, discarded and recomputed; the numpy reference the entries are checked against
equals flwr-datasets' partitioners."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpfl import memo
from dpfl.data import partition
from dpfl.data.assignment import reference_partition
from dpfl.data.partitioners import compute_partition_indices

LABELS = np.repeat(np.arange(10), 60)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(memo.CACHE_ENV, str(tmp_path))
    return tmp_path / partition.MEMO_KIND


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.filterwarnings("ignore:Classes.*will NOT be used:UserWarning")  # shards' own
@pytest.mark.parametrize("scheme,kwargs", [("dirichlet", {"alpha": 0.3}), ("iid", {}),
                                           ("shards", {"labels_per_client": 2})])
def test_a_hit_equals_the_fresh_partition(folder, scheme, kwargs):
    fresh = compute_partition_indices(LABELS, scheme, 5, seed=3, **kwargs)
    first = partition.partition_indices(LABELS, scheme, 5, seed=3, **kwargs)
    assert len(list(folder.iterdir())) == 1
    again = partition.partition_indices(LABELS, scheme, 5, seed=3, **kwargs)
    assert _same(fresh, first) and _same(fresh, again)
    other = partition.partition_indices(LABELS, scheme, 5, seed=4, **kwargs)
    assert len(list(folder.iterdir())) == 2 and not _same(other, fresh)


def test_other_labels_miss(folder):
    partition.partition_indices(LABELS, "dirichlet", 4, seed=1, alpha=0.5)
    shuffled = np.random.default_rng(0).permutation(LABELS)
    parts = partition.partition_indices(shuffled, "dirichlet", 4, seed=1, alpha=0.5)
    assert _same(parts, compute_partition_indices(shuffled, "dirichlet", 4, seed=1, alpha=0.5))
    assert len(list(folder.iterdir())) == 2


def _tamper(folder, change):
    """Edit the kept entry as one array per partition ("p0", "p1", ...; the entry packs
    them as "indices" and "offsets") and the "key", and write it back packed."""
    [path] = list(folder.iterdir())
    with np.load(path) as npz:
        indices, offsets, key = npz["indices"], npz["offsets"], npz["key"]
    arrays = {f"p{i}": part for i, part in enumerate(np.split(indices, offsets[1:-1]))}
    arrays["key"] = key
    change(arrays)
    parts = [arrays[f"p{i}"] for i in range(len(offsets) + 1) if f"p{i}" in arrays]
    sizes = np.array([len(part) for part in parts], dtype=np.int64)
    with path.open("wb") as f:
        np.savez(f, key=arrays["key"], indices=np.concatenate(parts),
                 offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))


def test_offsets_that_do_not_cut_the_indices_are_recomputed(folder):
    fresh = partition.partition_indices(LABELS, "iid", 3, seed=0)
    [path] = list(folder.iterdir())
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["offsets"] = arrays["offsets"][::-1].copy()
    with path.open("wb") as f:
        np.savez(f, **arrays)
    assert _same(partition.partition_indices(LABELS, "iid", 3, seed=0), fresh)


@pytest.mark.parametrize("change", [
    lambda a: a.__setitem__("p1", np.concatenate([a["p1"], a["p0"][:1]])),   # overlap
    lambda a: a.__setitem__("p0", a["p0"][1:]),                                # a sample lost
    lambda a: a.__setitem__("p2", a["p2"] + 10_000),                           # out of range
    lambda a: a.__setitem__("p0", a["p0"].astype(np.float64)),                 # wrong type
    lambda a: a.pop("p3"),                                                     # a partition gone
])
def test_an_edited_entry_is_recomputed(folder, change):
    fresh = partition.partition_indices(LABELS, "dirichlet", 4, seed=2, alpha=0.5)
    _tamper(folder, change)
    assert _same(partition.partition_indices(LABELS, "dirichlet", 4, seed=2, alpha=0.5), fresh)


@pytest.mark.parametrize("damage", [lambda data: b"not an npz",
                                    lambda data: data[:len(data) // 2]])   # a truncated zip
def test_a_damaged_file_is_recomputed(folder, damage):
    fresh = partition.partition_indices(LABELS, "iid", 3, seed=0)
    [path] = list(folder.iterdir())
    path.write_bytes(damage(path.read_bytes()))
    assert _same(partition.partition_indices(LABELS, "iid", 3, seed=0), fresh)


def test_a_hit_imports_no_flwr_datasets(folder, monkeypatch):
    """The point of the memo: a process that finds its partition kept never imports
    flwr-datasets (nor HF datasets, pandas, seaborn)."""
    partition.partition_indices(LABELS, "dirichlet", 4, seed=5, alpha=0.5)
    code = ("import sys, numpy as np; from dpfl.data import partition\n"
            "partition.partition_indices(np.repeat(np.arange(10), 60), 'dirichlet', 4, seed=5,"
            " alpha=0.5)\n"
            "print(sorted(m for m in ('flwr_datasets', 'datasets', 'seaborn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={**__import__("os").environ})
    assert out.stdout.strip() == "[]"
    miss = subprocess.run([sys.executable, "-c", code.replace("seed=5", "seed=6")], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    assert "flwr_datasets" in miss.stdout


def test_turned_off_nothing_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(memo.CACHE_ENV, "off")
    partition.partition_indices(LABELS, "iid", 3, seed=0)
    assert not any(tmp_path.iterdir())


# -- an entry is checked against what it claims: the partitioner's answer -----------------

SCHEMES = [("iid", {}), ("size", {}), ("dirichlet", {"alpha": 0.3}),
           ("dirichlet", {"alpha": 5.0}), ("shards", {"labels_per_client": 2}),
           ("shards", {"labels_per_client": 3}), ("gcfl-contiguous", {}),
           ("noniid-fraction", {"noniid_fraction": 0.4}), ("class-grouped", {})]


@pytest.mark.filterwarnings("ignore:Classes.*will NOT be used:UserWarning")
@pytest.mark.filterwarnings("ignore:The specified min_partition_size:UserWarning")
@pytest.mark.parametrize("scheme,kwargs", SCHEMES)
@pytest.mark.parametrize("labels,num_partitions,seed", [
    (LABELS, 5, 3), (LABELS, 13, 0),
    (np.random.default_rng(1).integers(0, 7, 911), 4, 11),
    (np.random.default_rng(2).integers(0, 3, 257), 6, 42)])
def test_the_numpy_reference_is_flwr_datasets_partition(scheme, kwargs, labels,
                                                        num_partitions, seed):
    """The check's reference gives flwr-datasets' arrays exactly (same samples, same order):
    an flwr-datasets release that draws differently fails here before it fails the memo."""
    fresh = compute_partition_indices(labels, scheme, num_partitions, seed=seed, **kwargs)
    assert _same(reference_partition(labels, scheme, num_partitions, seed=seed, **kwargs),
                 fresh)


def _warnings(caplog):
    return [r for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "flwr.dpfl.data"]


def _skew(arrays):
    """Move 10 samples of partition 1's commonest class to partition 0: still disjoint and
    complete, within range, int64 (the old checks pass it); partition 0 now has more of
    that class, partition 1 fewer."""
    p0, p1 = arrays["p0"], arrays["p1"]
    moved = p1[LABELS[p1] == np.bincount(LABELS[p1]).argmax()][:10]
    assert len(moved) == 10
    arrays["p0"] = np.concatenate([p0, moved])
    arrays["p1"] = p1[~np.isin(p1, moved)]


def _swap_same_label(arrays):
    """Swap one class-3 sample between partitions 0 and 1: sizes and label counts hold."""
    p0, p1 = arrays["p0"].copy(), arrays["p1"].copy()
    i, j = np.flatnonzero(LABELS[p0] == 3)[0], np.flatnonzero(LABELS[p1] == 3)[0]
    p0[i], p1[j] = p1[j], p0[i]
    arrays["p0"], arrays["p1"] = p0, p1


def _reorder(arrays):
    """Reverse partition 2: the same samples, another local validation hold-out."""
    arrays["p2"] = arrays["p2"][::-1].copy()


@pytest.mark.parametrize("change,why", [
    (_skew, "label counts differ by"),
    (_swap_same_label, "other samples"),
    (_reorder, "another order"),
    (lambda a: a.__setitem__("p1", np.concatenate([a["p1"], a["p0"][:1]])), "disjoint"),
    (lambda a: a.__setitem__("key", np.array("another question")), "another key"),
])
def test_a_planted_partition_is_detected_logged_and_not_used(folder, caplog, change, why):
    """A skewed partition planted in the memo was used silently (every process of the
    federation reads the same memo: server sizes, clients' data and all). Now one WARNING
    names the memo file and the key, the entry is discarded, and the fresh partition is
    used and kept again."""
    fresh = partition.partition_indices(LABELS, "dirichlet", 4, seed=2, alpha=0.5)
    [path] = list(folder.iterdir())
    with np.load(path) as npz:
        key = str(npz["key"])
    _tamper(folder, change)
    caplog.set_level(logging.WARNING, logger="flwr.dpfl.data")
    again = partition.partition_indices(LABELS, "dirichlet", 4, seed=2, alpha=0.5)
    assert _same(again, fresh)
    [warning] = _warnings(caplog)
    message = warning.getMessage()
    assert str(path) in message and repr(key) in message and why in message
    assert "discarded" in message
    caplog.clear()
    assert _same(partition.partition_indices(LABELS, "dirichlet", 4, seed=2, alpha=0.5), fresh)
    assert not _warnings(caplog)          # mended: the kept entry is the fresh one


def test_the_skew_reaches_no_client(folder, monkeypatch):
    """Through the loaders: with a skewed entry planted, every client's split (and so the
    server's public sizes) is the partitioner's, as without a memo."""
    fresh = partition.client_splits(LABELS, "iid", 3, seed=0, val_fraction=0.1)
    _tamper(folder, _skew)
    planted = partition.client_splits(LABELS, "iid", 3, seed=0, val_fraction=0.1)
    assert all(np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
               for a, b in zip(planted, fresh))


def test_a_fresh_partition_the_reference_does_not_reproduce_is_not_kept(folder, caplog,
                                                                        monkeypatch):
    """If flwr-datasets and the reference disagree (a new release's draws), the fresh
    answer is used, a WARNING says why, and nothing is kept: no unchecked entry."""
    monkeypatch.setattr(partition, "reference_partition",
                        lambda labels, scheme, k, **kw: [np.sort(p) for p in
                                                         compute_partition_indices(
                                                             labels, scheme, k, **kw)])
    caplog.set_level(logging.WARNING, logger="flwr.dpfl.data")
    parts = partition.partition_indices(LABELS, "dirichlet", 4, seed=9, alpha=0.5)
    assert _same(parts, compute_partition_indices(LABELS, "dirichlet", 4, seed=9, alpha=0.5))
    assert not folder.exists() or not list(folder.iterdir())
    [warning] = _warnings(caplog)
    assert "does not reproduce" in warning.getMessage()
