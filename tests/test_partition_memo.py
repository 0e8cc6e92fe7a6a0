"""The partition memo: a hit equals a fresh partition and needs no flwr-datasets import;
damaged or edited entries (overlapping, out of range, missing a sample) are recomputed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpfl import memo
from dpfl.data import partition
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
    [path] = list(folder.iterdir())
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    change(arrays)
    with path.open("wb") as f:
        np.savez(f, **arrays)


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
