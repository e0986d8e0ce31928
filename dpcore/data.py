"""Local datasets for examples and experiments; nothing is ever downloaded.

Contract:
  * Every loader returns `(x_train, y_train), (x_test, y_test)` as numpy arrays: images
    float32 `[n, height, width]` scaled to [0, 1], labels int32 `[n]`.
  * `load_digits()` is the embedded default: scikit-learn's bundled 8x8 digits (they ship
    inside the installed package), split deterministically (every fifth example is a test
    example), so a first run needs no download and no root.
  * `load_idx_dataset(data_dir)` reads MNIST-format IDX files (gzip or plain) from a local
    directory, validating magic numbers, shapes and counts, with errors that say what is wrong.
    The default directory is where Debian's `dataset-fashion-mnist` package installs
    Fashion-MNIST.
  * `load_dataset(name, data_dir=None)` dispatches on `digits`, `fashion_mnist` or `mnist`.
"""

from __future__ import annotations

import gzip
import os

import numpy as np

__all__ = [
    "DATASETS",
    "FASHION_MNIST_DIR",
    "MNIST_DIR",
    "IDX_FILES",
    "load_dataset",
    "load_digits",
    "load_idx_dataset",
    "read_idx",
]

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
MNIST_DIR = "/usr/share/datasets/mnist"
DATASETS = ("digits", "fashion_mnist", "mnist")

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}

# IDX type codes (third byte of the magic number) -> big-endian numpy dtypes.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

Split = tuple[np.ndarray, np.ndarray]


def load_digits() -> tuple[Split, Split]:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes).

    The data ships inside the scikit-learn package (no download). Pixels (0..16) are scaled to
    [0, 1]. The split is fixed and needs no random generator: example i is a test example iff
    i % 5 == 4 (1438 train, 359 test, all classes in both).

    Returns:
      `(x_train, y_train), (x_test, y_test)`: float32 `[n, 8, 8]` and int32 `[n]`.

    Raises:
      ImportError: if scikit-learn is not installed (it is in the `experiments` extra).
    """
    try:
        from sklearn.datasets import load_digits as sklearn_load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "The embedded 'digits' dataset comes from scikit-learn, which is not installed. "
            "Install it with `pip install 'dpcore[experiments]'` (or `pip install scikit-learn`)."
        ) from err
    bunch = sklearn_load_digits()
    images = np.asarray(bunch.images, dtype=np.float32) / 16.0
    labels = np.asarray(bunch.target, dtype=np.int32)
    test = np.arange(len(labels)) % 5 == 4
    return (images[~test], labels[~test]), (images[test], labels[test])


def _open_maybe_gzip(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise ValueError(f"{path}: corrupt gzip data ({err}).") from err
    return raw


def read_idx(path: str) -> np.ndarray:
    """Reads one IDX file (gzip-compressed or plain) into a numpy array.

    Args:
      path: the file path.

    Returns:
      The array, with the shape and element type its header declares (native byte order).

    Raises:
      FileNotFoundError: if the file does not exist.
      ValueError: on a bad magic number, an unknown type code, or a size mismatch.
    """
    data = _open_maybe_gzip(path)
    if len(data) < 4:
        raise ValueError(f"{path}: too short for an IDX header ({len(data)} bytes).")
    if data[0] != 0 or data[1] != 0:
        raise ValueError(
            f"{path}: bad IDX magic number 0x{data[:4].hex()} (must start with two zero bytes)."
        )
    type_code, ndim = data[2], data[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX type code 0x{type_code:02x}.")
    if ndim < 1:
        raise ValueError(f"{path}: IDX header declares {ndim} dimensions.")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header.")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = len(data) - header
    if actual != expected:
        raise ValueError(
            f"{path}: IDX header declares shape {shape} ({expected} bytes of data) "
            f"but the file holds {actual} bytes."
        )
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return array.astype(dtype.newbyteorder("="), copy=True)


def _find_idx(data_dir: str, name: str) -> str:
    """The gzip file `name`, or its uncompressed twin without `.gz`."""
    candidates = [os.path.join(data_dir, name)]
    if name.endswith(".gz"):
        candidates.append(os.path.join(data_dir, name[: -len(".gz")]))
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"IDX file {name!r} (or its uncompressed form) not found in {data_dir!r}. "
        f"Expected the four files {sorted(IDX_FILES.values())}."
    )


def _check_pair(images: np.ndarray, labels: np.ndarray, what: str, data_dir: str) -> None:
    if images.ndim != 3:
        raise ValueError(f"{data_dir}: {what} images must be 3-D [n, h, w], got {images.shape}.")
    if labels.ndim != 1:
        raise ValueError(f"{data_dir}: {what} labels must be 1-D [n], got {labels.shape}.")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{data_dir}: {what} has {images.shape[0]} images but {labels.shape[0]} labels."
        )


def load_idx_dataset(data_dir: str = FASHION_MNIST_DIR) -> tuple[Split, Split]:
    """Loads an MNIST-format dataset (MNIST, Fashion-MNIST) from local IDX files.

    Reads `train-images-idx3-ubyte.gz`, `train-labels-idx1-ubyte.gz`,
    `t10k-images-idx3-ubyte.gz` and `t10k-labels-idx1-ubyte.gz` (each may also be present
    uncompressed, without `.gz`). Nothing is downloaded.

    Args:
      data_dir: directory holding the four files; defaults to Debian's
        `dataset-fashion-mnist` location.

    Returns:
      `(x_train, y_train), (x_test, y_test)`: float32 `[n, h, w]` in [0, 1] and int32 `[n]`.

    Raises:
      FileNotFoundError: if the directory or a file is missing.
      ValueError: if a file is malformed or train/test shapes disagree.
    """
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(
            f"Dataset directory {data_dir!r} does not exist. Pass --data_dir pointing at the "
            "four MNIST-format IDX files (for Fashion-MNIST on Debian/Ubuntu: "
            "`apt-get install dataset-fashion-mnist`)."
        )
    arrays = {key: read_idx(_find_idx(data_dir, name)) for key, name in IDX_FILES.items()}
    _check_pair(arrays["train_images"], arrays["train_labels"], "train", data_dir)
    _check_pair(arrays["test_images"], arrays["test_labels"], "test", data_dir)
    if arrays["train_images"].shape[1:] != arrays["test_images"].shape[1:]:
        raise ValueError(
            f"{data_dir}: train images are {arrays['train_images'].shape[1:]} but test images "
            f"are {arrays['test_images'].shape[1:]}."
        )

    def images(a: np.ndarray) -> np.ndarray:
        scale = 255.0 if a.dtype == np.uint8 else 1.0
        return a.astype(np.float32) / np.float32(scale)

    return (
        (images(arrays["train_images"]), arrays["train_labels"].astype(np.int32)),
        (images(arrays["test_images"]), arrays["test_labels"].astype(np.int32)),
    )


def load_dataset(name: str, data_dir: str | None = None) -> tuple[Split, Split]:
    """Loads a dataset by name: `digits` (embedded), `fashion_mnist` or `mnist` (IDX files).

    Args:
      name: one of `DATASETS`.
      data_dir: directory of IDX files for `fashion_mnist` / `mnist`; defaults to
        `FASHION_MNIST_DIR` / `MNIST_DIR`. Ignored for `digits`.

    Returns:
      `(x_train, y_train), (x_test, y_test)` as described in the module docstring.
    """
    if name == "digits":
        return load_digits()
    if name == "fashion_mnist":
        return load_idx_dataset(data_dir or FASHION_MNIST_DIR)
    if name == "mnist":
        return load_idx_dataset(data_dir or MNIST_DIR)
    raise ValueError(f"Unknown dataset {name!r}; expected one of {DATASETS}.")
