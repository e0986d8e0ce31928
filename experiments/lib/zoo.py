"""The experiments' model zoo: plain Keras model definitions for Keras 2 and Keras 3.

Contract:
  * Imports nothing at module level but the standard library, and never dpcore or TensorFlow:
    every builder takes the Keras module to build with (``keras`` under Keras 3, ``tf.keras``
    in the peer's TensorFlow 2.15 / Keras 2 environment), and uses only layer arguments both
    versions accept. The dpcore side imports it as ``dpcore_experiments.lib.zoo``; the peer's
    ``experiments/peers/bench.py`` runs as a script, puts this folder on `sys.path` and imports
    it as ``zoo``.
  * The benchmark models (``BENCH_MODELS``) and their synthetic batches are defined here once,
    so both sides time the same networks on the same data.
  * The training experiments' small models (the tanh MLP and the Tramèr & Boneh CNN) are
    defined here too; their layer lists feed ``keras.Sequential`` (or TensorFlow Privacy's
    ``DPSequential``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BENCH_MODELS = ("mlp", "cnn", "text", "transformer")
NUM_CLASSES = {"mlp": 10, "cnn": 10, "text": 2, "transformer": 2}
TEXT_VOCAB, TEXT_SEQ, TEXT_DIM = 20000, 256, 64
TRANSFORMER_SEQ, TRANSFORMER_DIM = 128, 128


def _input_layer(keras: Any, shape: Sequence[int], dtype: str = "float32") -> Any:
    """An ``InputLayer`` of that per-example shape (``shape=`` in Keras 3, ``input_shape=`` in 2)."""
    major = int(str(getattr(keras, "__version__", "3")).split(".")[0])
    key = "shape" if major >= 3 else "input_shape"
    return keras.layers.InputLayer(**{key: tuple(shape)}, dtype=dtype)


def tanh_mlp_layers(
    keras: Any, input_shape: Sequence[int], num_classes: int = 10, *, hidden: int = 128
) -> list[Any]:
    """Flatten -> dense ``hidden`` tanh -> dense ``num_classes`` (logits)."""
    L = keras.layers
    return [
        _input_layer(keras, input_shape),
        L.Flatten(),
        L.Dense(hidden, activation="tanh"),
        L.Dense(num_classes),
    ]


def cnn_layers(
    keras: Any,
    input_shape: Sequence[int] = (28, 28, 1),
    num_classes: int = 10,
    *,
    activation: str = "tanh",
) -> list[Any]:
    """The end-to-end CNN of Tramèr & Boneh (2021) (TensorFlow Privacy's tutorial CNN with relu).

    conv16 8x8 stride 2 -> maxpool 2 stride 1 -> conv32 4x4 stride 2 -> maxpool 2 stride 1 ->
    dense32 -> dense ``num_classes`` (logits). The first convolution uses 'same' padding (the
    original pads by 2; on 28x28 inputs both give the same 5x5x32 feature map and 26,010
    parameters). On inputs smaller than 16x16 (the 8x8 digits) the second convolution also uses
    'same' padding so that the shapes stay valid.
    """
    L = keras.layers
    small = min(tuple(input_shape)[:2]) < 16
    return [
        _input_layer(keras, input_shape),
        L.Conv2D(16, 8, strides=2, padding="same", activation=activation),
        L.MaxPooling2D(2, strides=1),
        L.Conv2D(32, 4, strides=2, padding="same" if small else "valid", activation=activation),
        L.MaxPooling2D(2, strides=1),
        L.Flatten(),
        L.Dense(32, activation=activation),
        L.Dense(num_classes),
    ]


def bench_layers(keras: Any, name: str) -> list[Any] | None:
    """The layer list of a sequential benchmark model (``mlp``, ``cnn``); None for the others."""
    L = keras.layers
    if name == "mlp":
        return [
            _input_layer(keras, (784,)),
            L.Dense(512, activation="relu"),
            L.Dense(256, activation="relu"),
            L.Dense(10),
        ]
    if name == "cnn":
        return cnn_layers(keras, (28, 28, 1), 10, activation="tanh")
    return None


def bench_graph(keras: Any, name: str) -> tuple[Any, Any]:
    """``(inputs, outputs)`` of a functional benchmark model (``text``, ``transformer``)."""
    L = keras.layers
    if name == "text":
        inputs = keras.Input((TEXT_SEQ,), dtype="int32")
        h = L.Embedding(TEXT_VOCAB, TEXT_DIM)(inputs)
        h = L.Conv1D(64, 5, activation="relu")(h)
        h = L.GlobalMaxPooling1D()(h)
        h = L.Dense(64, activation="relu")(h)
        return inputs, L.Dense(2)(h)
    if name == "transformer":  # 2 encoder blocks on [seq, d] float features (no embedding)
        inputs = keras.Input((TRANSFORMER_SEQ, TRANSFORMER_DIM))
        h = inputs
        for _ in range(2):
            a = L.MultiHeadAttention(num_heads=4, key_dim=TRANSFORMER_DIM // 4)(h, h)
            h = L.LayerNormalization()(h + a)
            f = L.Dense(2 * TRANSFORMER_DIM, activation="relu")(h)
            f = L.Dense(TRANSFORMER_DIM)(f)
            h = L.LayerNormalization()(h + f)
        h = L.GlobalAveragePooling1D()(h)
        return inputs, L.Dense(2)(h)
    raise ValueError(f"unknown model {name!r}; expected one of {BENCH_MODELS}.")


def build_bench_model(keras: Any, name: str) -> Any:
    """The benchmark model of that name, built with ``keras`` (not seeded: seed first)."""
    layers = bench_layers(keras, name)
    if layers is not None:
        return keras.Sequential(layers, name=name)
    inputs, outputs = bench_graph(keras, name)
    return keras.Model(inputs, outputs, name=name)


def make_bench_batch(name: str, batch_size: int, *, seed: int = 0) -> tuple[Any, Any]:
    """A synthetic batch ``(x, y)`` (numpy) for the benchmark model of that name."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y = rng.integers(0, NUM_CLASSES[name], batch_size).astype("int32")
    if name == "mlp":
        x = rng.random((batch_size, 784), dtype=np.float32)
    elif name == "cnn":
        x = rng.random((batch_size, 28, 28, 1), dtype=np.float32)
    elif name == "text":
        x = rng.integers(0, TEXT_VOCAB, (batch_size, TEXT_SEQ)).astype("int32")
    elif name == "transformer":
        x = rng.normal(size=(batch_size, TRANSFORMER_SEQ, TRANSFORMER_DIM)).astype("float32")
    else:
        raise ValueError(f"unknown model {name!r}; expected one of {BENCH_MODELS}.")
    return x, y
