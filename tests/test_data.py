"""Tests for dpcore.data: embedded digits and the IDX reader."""

import gzip
import os
import struct

import numpy as np
import pytest

from dpcore import data


def _idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
    header = struct.pack(">BBBB", 0, 0, type_code, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def _write(path, payload: bytes, compress: bool) -> None:
    if compress:
        payload = gzip.compress(payload)
    with open(path, "wb") as f:
        f.write(payload)


def _write_dataset(tmp_path, n_train=7, n_test=3, h=4, w=5, compress=True, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, h, w), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, (n_train,), dtype=np.uint8),
        "test_images": rng.integers(0, 256, (n_test, h, w), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, (n_test,), dtype=np.uint8),
    }
    for key, name in data.IDX_FILES.items():
        target = name if compress else name[: -len(".gz")]
        _write(tmp_path / target, _idx_bytes(arrays[key]), compress)
    return arrays


@pytest.mark.parametrize("compress", [True, False])
def test_load_idx_dataset_roundtrip(tmp_path, compress):
    arrays = _write_dataset(tmp_path, compress=compress)
    (x_train, y_train), (x_test, y_test) = data.load_idx_dataset(str(tmp_path))
    assert x_train.shape == (7, 4, 5) and x_train.dtype == np.float32
    assert y_train.shape == (7,) and y_train.dtype == np.int32
    assert x_test.shape == (3, 4, 5) and y_test.shape == (3,)
    np.testing.assert_allclose(x_train * 255.0, arrays["train_images"], atol=1e-4)
    np.testing.assert_array_equal(y_train, arrays["train_labels"])
    np.testing.assert_allclose(x_test * 255.0, arrays["test_images"], atol=1e-4)
    np.testing.assert_array_equal(y_test, arrays["test_labels"])
    assert 0.0 <= x_train.min() and x_train.max() <= 1.0


def test_read_idx_other_types_and_byte_order(tmp_path):
    a = np.arange(-6, 6, dtype=np.int32).reshape(3, 4) * 1000
    _write(tmp_path / "a.idx", _idx_bytes(a, 0x0C), compress=False)
    out = data.read_idx(str(tmp_path / "a.idx"))
    np.testing.assert_array_equal(out, a)
    assert out.dtype.isnative
    f = np.linspace(-1, 1, 6).astype(np.float32)
    _write(tmp_path / "f.idx.gz", _idx_bytes(f, 0x0D), compress=True)
    np.testing.assert_array_equal(data.read_idx(str(tmp_path / "f.idx.gz")), f)


def test_read_idx_bad_magic(tmp_path):
    payload = bytearray(_idx_bytes(np.zeros((2, 2), np.uint8)))
    payload[0] = 1
    _write(tmp_path / "bad", bytes(payload), compress=True)
    with pytest.raises(ValueError, match="magic"):
        data.read_idx(str(tmp_path / "bad"))


def test_read_idx_unknown_type(tmp_path):
    payload = bytearray(_idx_bytes(np.zeros((2, 2), np.uint8)))
    payload[2] = 0x42
    _write(tmp_path / "bad", bytes(payload), compress=False)
    with pytest.raises(ValueError, match="type code"):
        data.read_idx(str(tmp_path / "bad"))


def test_read_idx_size_mismatch(tmp_path):
    payload = _idx_bytes(np.zeros((3, 2, 2), np.uint8))[:-1]
    _write(tmp_path / "short", payload, compress=True)
    with pytest.raises(ValueError, match="declares shape"):
        data.read_idx(str(tmp_path / "short"))


def test_load_idx_dataset_count_mismatch(tmp_path):
    _write_dataset(tmp_path)
    _write(
        tmp_path / data.IDX_FILES["train_labels"],
        _idx_bytes(np.zeros((6,), np.uint8)),
        compress=True,
    )
    with pytest.raises(ValueError, match="7 images but 6 labels"):
        data.load_idx_dataset(str(tmp_path))


def test_load_idx_dataset_missing_file(tmp_path):
    _write_dataset(tmp_path)
    os.remove(tmp_path / data.IDX_FILES["test_labels"])
    with pytest.raises(FileNotFoundError, match="t10k-labels"):
        data.load_idx_dataset(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_idx_dataset(str(tmp_path / "nope"))


def test_load_digits_split():
    (x_train, y_train), (x_test, y_test) = data.load_digits()
    assert x_train.shape == (1438, 8, 8) and x_test.shape == (359, 8, 8)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int32
    assert x_train.min() >= 0.0 and x_train.max() == 1.0
    assert set(np.unique(y_train)) == set(range(10)) == set(np.unique(y_test))
    # Deterministic and disjoint: the split is the same on every call and shares no image.
    (x_train2, _), _ = data.load_digits()
    np.testing.assert_array_equal(x_train, x_train2)
    train_rows = {row.tobytes() for row in x_train}
    assert sum(row.tobytes() in train_rows for row in x_test) < 5  # a few duplicate scans exist


def test_load_dataset_dispatch(tmp_path):
    _write_dataset(tmp_path)
    (x, _), _ = data.load_dataset("mnist", str(tmp_path))
    assert x.shape == (7, 4, 5)
    (x, _), _ = data.load_dataset("digits")
    assert x.shape[1:] == (8, 8)
    with pytest.raises(ValueError, match="Unknown dataset"):
        data.load_dataset("cifar")


@pytest.mark.skipif(
    not os.path.isdir(data.FASHION_MNIST_DIR), reason="dataset-fashion-mnist not installed"
)
def test_debian_fashion_mnist():
    (x_train, y_train), (x_test, y_test) = data.load_idx_dataset()
    assert x_train.shape == (60000, 28, 28) and y_train.shape == (60000,)
    assert x_test.shape == (10000, 28, 28) and y_test.shape == (10000,)
    np.testing.assert_array_equal(np.bincount(y_train), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(y_test), [1000] * 10)
    assert x_train.min() == 0.0 and x_train.max() == 1.0
