"""The server's reading of a reply's arrays (dpfl/server/validation.py, array_values): the
values Flower's own Array.numpy() gives, without its header parsing when the header is the
expected one byte for byte; anything else goes through np.load as before."""

import numpy as np
import pytest
from flwr.app import Array

from dpfl.server.validation import array_values, npy_header


@pytest.mark.parametrize("shape,dtype", [((3, 4), np.float32), ((), np.float64),
                                         ((0, 5), np.float32), ((16, 1, 5, 5), np.float32),
                                         ((7,), np.int64)])
def test_the_fast_path_gives_numpys_values(shape, dtype):
    rng = np.random.default_rng(0)
    values = rng.standard_normal(shape).astype(dtype) if shape else np.array(1.5, dtype=dtype)
    arr = Array(values)
    assert arr.data.startswith(npy_header(shape, np.dtype(dtype)))   # Flower's own bytes
    got = array_values(arr, shape, np.dtype(dtype))
    expected = arr.numpy()
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert np.array_equal(got, expected) and got.flags.writeable


def test_other_bytes_are_read_by_numpy():
    arr = Array(np.arange(12, dtype=np.float32).reshape(3, 4))
    # a header of another shape: numpy's own reading (its true shape, as before)
    assert array_values(arr, (4, 3), np.dtype(np.float32)).shape == (3, 4)
    # another dtype than expected
    assert array_values(arr, (3, 4), np.dtype(np.float64)).dtype == np.float32
    # data shorter than the header promises: numpy raises, as Array.numpy() does
    arr.data = arr.data[:-4]
    with pytest.raises(ValueError):
        array_values(arr, (3, 4), np.dtype(np.float32))
