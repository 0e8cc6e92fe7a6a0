"""CIFAR-10 and SVHN from a data-dir in torchvision's on-disk format, through dpfl's public
data path (check_dataset, client_data, test_tensors): shapes, dtype, normalisation, label
mapping (SVHN's 10 is digit 0) and sizes.

The files are written here in the real format, tiny and random:

- CIFAR-10: ``cifar-10-batches-py/data_batch_1..5`` and ``test_batch``, pickled dicts with
  ``data`` (N x 3072 uint8: 1024 red, 1024 green, 1024 blue values, each a row-major 32x32
  plane) and ``labels`` (N ints 0-9); ``batches.meta`` with ``label_names``.
- SVHN: ``train_32x32.mat`` and ``test_32x32.mat`` (MATLAB v5, scipy.io.savemat) with ``X``
  of shape 32 x 32 x 3 x N (uint8, height x width x channel x sample) and ``y`` N x 1 (double,
  as in the real files) holding 1-10, where 10 is the digit 0.

torchvision checks each file's md5 against the real dataset's, which no fake file passes
(tests/test_data_errors.py shows that failure is a one-line DatasetUnavailable); the tests
that load replace that check with "the file exists", so the parsing path is the real one.
"""

import os
import pickle

import numpy as np
import pytest
import torch

import dpfl.data as data  # not `from ... import test_tensors`: pytest would collect it
from dpfl.data import DatasetUnavailable, check_dataset, client_data, load_dataset
from dpfl.data.loaders import NORMALISATION
from dpfl.methods import run_config

torchvision = pytest.importorskip("torchvision")
sio = pytest.importorskip("scipy.io")

CIFAR_TRAIN_PER_BATCH, CIFAR_TEST = 50, 20
SVHN_TRAIN, SVHN_TEST = 60, 20


@pytest.fixture
def no_md5(monkeypatch):
    """torchvision's integrity check reduced to "the file exists" (fake files, real md5s)."""
    exists = lambda fpath, md5=None: os.path.isfile(fpath)  # noqa: E731
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", exists)
    monkeypatch.setattr(torchvision.datasets.svhn, "check_integrity", exists)


def _write_cifar10(root, rng) -> dict[str, np.ndarray]:
    """Five train batches, a test batch and the meta file; returns the images (N, 3, 32, 32)
    and labels written, train and test."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    written: dict[str, list] = {"x_train": [], "y_train": [], "x_test": [], "y_test": []}
    files = [(f"data_batch_{i}", CIFAR_TRAIN_PER_BATCH, "train") for i in range(1, 6)]
    for name, n, split in files + [("test_batch", CIFAR_TEST, "test")]:
        images = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        entry = {"batch_label": f"fake {name}", "labels": labels,
                 "data": images.reshape(n, 3072), "filenames": [f"{i}.png" for i in range(n)]}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
        written[f"x_{split}"].append(images)
        written[f"y_{split}"].extend(labels)
    meta = {"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                            "horse", "ship", "truck"], "num_cases_per_batch": 10000,
            "num_vis": 3072}
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return {k: np.concatenate(v) if k.startswith("x") else np.array(v)
            for k, v in written.items()}


def _write_svhn(root, rng) -> dict[str, np.ndarray]:
    """train_32x32.mat and test_32x32.mat; returns the images (N, 3, 32, 32) and the .mat
    labels (1-10) written."""
    root.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, n in (("train", SVHN_TRAIN), ("test", SVHN_TEST)):
        images = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        labels = np.arange(n) % 10 + 1  # 1..10, every class, 10 = digit 0
        sio.savemat(root / f"{split}_32x32.mat",
                    {"X": images.transpose(2, 3, 1, 0),  # (H, W, C, N)
                     "y": labels.reshape(n, 1).astype(np.float64)})
        written[f"x_{split}"], written[f"y_{split}"] = images, labels
    return written


def _normalised(name: str, images: np.ndarray) -> torch.Tensor:
    """What dpfl should make of uint8 (N, 3, 32, 32) images, computed independently."""
    mean = torch.tensor(NORMALISATION[name][0]).view(1, 3, 1, 1)
    std = torch.tensor(NORMALISATION[name][1]).view(1, 3, 1, 1)
    return (torch.from_numpy(images).double() / 255.0 - mean.double()) / std.double()


def _check_tensors(name: str, x: torch.Tensor, images: np.ndarray) -> None:
    assert x.shape == (len(images), 3, 32, 32) and x.dtype == torch.float32
    assert torch.allclose(x.double(), _normalised(name, images), atol=1e-5)
    # uniform random pixels average 127.5/255: after normalisation about (0.5 - mean) / std
    mean, std = NORMALISATION[name]
    for c in range(3):
        expected = (0.5 - mean[c]) / std[c]
        assert abs(float(x[:, c].mean()) - expected) < 0.1


def test_cifar10_from_torchvision_files(tmp_path, no_md5):
    written = _write_cifar10(tmp_path, np.random.default_rng(0))
    check_dataset("cifar10", str(tmp_path), False)
    ds = load_dataset("cifar10", str(tmp_path))
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == 10
    assert len(ds.y_train) == 5 * CIFAR_TRAIN_PER_BATCH and len(ds.y_test) == CIFAR_TEST
    assert np.array_equal(ds.y_train, written["y_train"])  # batch order 1..5 kept

    x_test, y_test = data.test_tensors("cifar10", str(tmp_path))
    _check_tensors("cifar10", x_test, written["x_test"])
    assert y_test.dtype == torch.int64 and y_test.tolist() == written["y_test"].tolist()

    cfg = run_config(dataset="cifar10", data_dir=str(tmp_path), model="cifar-cnn",
                     partitioning="iid", val_fraction=0.1)
    clients = [client_data(cfg, pid, 2) for pid in range(2)]
    assert sum(len(c.y_train) + len(c.y_val) for c in clients) == 5 * CIFAR_TRAIN_PER_BATCH
    for c in clients:
        assert c.num_classes == 10 and c.x_train.shape[1:] == (3, 32, 32)
        assert c.x_train.dtype == torch.float32 and c.y_train.dtype == torch.int64
        assert len(c.y_val) == round(0.1 * (len(c.y_train) + len(c.y_val)))
    # every client row is one of the written images, normalised, with its own label
    everything = _normalised("cifar10", written["x_train"]).float()
    for c in clients:
        for x, y in zip(c.x_train[:5], c.y_train[:5]):
            match = torch.isclose(everything, x, atol=1e-5).flatten(1).all(1).nonzero()
            assert len(match) == 1 and written["y_train"][int(match[0, 0])] == int(y)


def test_svhn_from_torchvision_files_maps_label_10_to_0(tmp_path, no_md5):
    written = _write_svhn(tmp_path, np.random.default_rng(1))
    check_dataset("svhn", str(tmp_path), False)
    ds = load_dataset("svhn", str(tmp_path))
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == 10
    assert len(ds.y_train) == SVHN_TRAIN and len(ds.y_test) == SVHN_TEST
    assert np.array_equal(ds.y_train, written["y_train"] % 10)  # 10 -> 0, 1..9 unchanged
    assert ds.y_train.min() == 0 and ds.y_train.max() == 9

    x_test, y_test = data.test_tensors("svhn", str(tmp_path))
    _check_tensors("svhn", x_test, written["x_test"])  # (H, W, C, N) -> (N, C, H, W)
    assert y_test.tolist() == (written["y_test"] % 10).tolist()

    cfg = run_config(dataset="svhn", data_dir=str(tmp_path), model="cifar-cnn",
                     partitioning="class-grouped", val_fraction=0.0)
    clients = [client_data(cfg, pid, 3) for pid in range(3)]
    assert sum(len(c.y_train) for c in clients) == SVHN_TRAIN
    for c in clients:
        assert c.x_train.shape[1:] == (3, 32, 32) and c.x_train.dtype == torch.float32
        assert len(c.y_train) >= 1 and int(c.y_train.max()) <= 9
    assert sorted(torch.cat([c.y_train for c in clients]).tolist()) == \
        sorted((written["y_train"] % 10).tolist())


def test_fake_svhn_files_fail_torchvisions_md5_check_as_one_line_error(tmp_path):
    _write_svhn(tmp_path, np.random.default_rng(2))
    check_dataset("svhn", str(tmp_path), False)  # existence only
    with pytest.raises(DatasetUnavailable) as exc:
        load_dataset.__wrapped__("svhn", str(tmp_path), False)
    assert str(exc.value).startswith(f"svhn: the torchvision files under data-dir {tmp_path} "
                                     "failed (") and "\n" not in str(exc.value)
