"""Datasets (offline loaders), partitioning and per-client tensors."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from dpfl.data.loaders import (
    ArrayDataset,
    DatasetUnavailable,
    check_dataset,
    load_dataset,
    to_tensor,
)
from dpfl.data.partition import (
    ClientSplit,
    client_splits,
    label_counts,
    partition_indices,
)

__all__ = ["ArrayDataset", "ClientData", "ClientSplit", "DatasetUnavailable", "check_dataset",
           "client_data", "client_splits", "label_counts", "load_dataset", "partition_indices",
           "server_holdout_indices", "server_validation", "test_tensors", "to_tensor"]


@dataclass(frozen=True)
class ClientData:
    """One client's normalised tensors: training share and local validation split."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    num_classes: int


def training_pool(num_examples: int, holdout: int, subset: int, seed: int) -> np.ndarray:
    """The training-set indices the clients' partitions are drawn from: all but the
    server's holdout, or a seeded ``train-subset`` of them (0 = all); sorted."""
    pool = np.setdiff1d(np.arange(num_examples),
                        server_holdout_indices(num_examples, holdout, seed))
    if 0 < subset < len(pool):
        pool = np.sort(np.random.default_rng(seed + 104729).choice(pool, subset, replace=False))
    return pool


def server_holdout_indices(num_examples: int, holdout: int, seed: int) -> np.ndarray:
    """The training-set indices kept from every client for the server's own validation
    split (``server-holdout`` examples, a seeded sample; sorted)."""
    if not 0 <= holdout < num_examples:
        raise ValueError(f"server-holdout {holdout} not in [0, {num_examples})")
    perm = np.random.default_rng(seed + 7919).permutation(num_examples)
    return np.sort(perm[:holdout])


@lru_cache(maxsize=8)
def _splits(dataset: str, data_dir: str, download: bool, scheme: str, num_partitions: int,
            seed: int, val_fraction: float, alpha: float, labels_per_client: int,
            noniid_fraction: float, holdout: int = 0, subset: int = 0
            ) -> tuple[ClientSplit, ...]:
    ds = load_dataset(dataset, data_dir, download)
    pool = training_pool(len(ds.y_train), holdout, subset, seed)
    splits = client_splits(ds.y_train[pool], scheme, num_partitions, seed=seed,
                           val_fraction=val_fraction, alpha=alpha,
                           labels_per_client=labels_per_client,
                           noniid_fraction=noniid_fraction)
    if holdout == 0 and subset == 0:  # pool is the identity: indices unchanged
        return tuple(splits)
    return tuple(ClientSplit(train=pool[s.train], val=pool[s.val]) for s in splits)


def splits_for(cfg, num_partitions: int) -> tuple[ClientSplit, ...]:
    """All clients' splits for a run-config (deterministic, cached per process); the
    ``server-holdout`` examples belong to no client; ``train-subset`` > 0 draws the
    partitions from that many of the others."""
    return _splits(cfg.dataset, cfg.data_dir, cfg.download, cfg.partitioning, num_partitions,
                   cfg.seed, cfg.val_fraction, cfg.dirichlet_alpha, cfg.labels_per_client,
                   cfg.noniid_fraction, cfg.server_holdout, cfg.train_subset)


def server_validation(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's validation split: the ``server-holdout`` training examples no client
    holds (never the test set), as normalised tensors."""
    ds = load_dataset(cfg.dataset, cfg.data_dir, cfg.download)
    idx = server_holdout_indices(len(ds.y_train), cfg.server_holdout, cfg.seed)
    return to_tensor(ds.name, ds.x_train[idx]), torch.from_numpy(ds.y_train[idx])


@lru_cache(maxsize=1)
def _training_tensors(dataset: str, data_dir: str, download: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The whole training set as normalised tensors, once per process (a node that trains
    many clients slices it per client instead of normalising each client's images again)."""
    ds = load_dataset(dataset, data_dir, download)
    return to_tensor(ds.name, ds.x_train), torch.from_numpy(ds.y_train), ds.num_classes


def _client_data(cfg, partition_id: int, num_partitions: int) -> ClientData:
    x, y, num_classes = _training_tensors(cfg.dataset, cfg.data_dir, cfg.download)
    split = splits_for(cfg, num_partitions)[partition_id]
    train = torch.as_tensor(split.train, dtype=torch.long)
    val = torch.as_tensor(split.val, dtype=torch.long)
    return ClientData(x_train=x[train], y_train=y[train], x_val=x[val], y_val=y[val],
                      num_classes=num_classes)


def client_data(cfg, partition_id: int, num_partitions: int) -> ClientData:
    """Tensors of client ``partition_id`` out of ``num_partitions`` for a run-config."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} not in [0, {num_partitions})")
    return _client_data(cfg, partition_id, num_partitions)


@lru_cache(maxsize=4)
def test_tensors(dataset: str, data_dir: str = "", download: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The central test set as normalised tensors (cached per process)."""
    ds = load_dataset(dataset, data_dir, download)
    return to_tensor(ds.name, ds.x_test), torch.from_numpy(ds.y_test)
