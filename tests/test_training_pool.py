"""The server's holdout and the training subset: disjoint from every client's data,
deterministic, and no change at all when both are 0."""

import numpy as np

from dpfl.data import (
    client_splits,
    load_dataset,
    server_holdout_indices,
    splits_for,
    training_pool,
)
from dpfl.methods import run_config


def test_holdout_and_subset_are_disjoint_from_the_clients():
    c = run_config(dataset="digits", server_holdout=200, train_subset=900,
                   partitioning="dirichlet", dirichlet_alpha=0.5)
    splits = splits_for(c, 5)
    n = len(load_dataset("digits").y_train)
    held = set(server_holdout_indices(n, 200, c.seed).tolist())
    used = [set(s.train.tolist()) | set(s.val.tolist()) for s in splits]
    assert len(held) == 200 and sum(len(u) for u in used) == 900
    assert all(not (u & held) for u in used)
    assert len(set().union(*used)) == 900          # clients disjoint from each other
    assert splits_for(c, 5)[3].train.tolist() == splits[3].train.tolist()


def test_no_holdout_no_subset_leaves_the_partitions_unchanged():
    c = run_config(dataset="digits", partitioning="dirichlet", dirichlet_alpha=0.5)
    labels = np.asarray(load_dataset("digits").y_train)
    direct = client_splits(labels, "dirichlet", 4, seed=c.seed, val_fraction=c.val_fraction,
                           alpha=0.5, labels_per_client=2, noniid_fraction=0.5)
    assert [s.train.tolist() for s in splits_for(c, 4)] == [s.train.tolist() for s in direct]
    assert training_pool(10, 0, 0, 1).tolist() == list(range(10))
