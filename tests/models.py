"""Small models used across tests (tiny versions of the benchmark models)."""

from __future__ import annotations

import keras
import numpy as np
import pytest


def mlp(d=12, hidden=(16, 8), classes=4):
    inputs = keras.Input((d,))
    h = inputs
    for i, units in enumerate(hidden):
        h = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(h)
    outputs = keras.layers.Dense(classes, name="logits")(h)
    return keras.Model(inputs, outputs, name="mlp")


def small_mlp(d=5, hidden=6, classes=3, seed=0, name=None):
    """Dense(hidden, tanh) -> Dense(classes), Glorot weights from ``seed``."""
    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential(
        [
            keras.Input((d,)),
            keras.layers.Dense(hidden, activation="tanh", kernel_initializer=init),
            keras.layers.Dense(classes, kernel_initializer=init),
        ],
        name=name,
    )


def dense_model(d=4, classes=3, seed=0):
    """One Dense layer (a softmax-regression model), Glorot weights from ``seed``."""
    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential(
        [keras.Input((d,)), keras.layers.Dense(classes, kernel_initializer=init)]
    )


def tanh_cnn(size=16, classes=10):
    """The Tramèr & Boneh end-to-end tanh CNN, at a small input size."""
    return keras.Sequential(
        [
            keras.Input((size, size, 1)),
            keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="tanh"),
            keras.layers.MaxPooling2D(2, strides=1),
            keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="tanh"),
            keras.layers.MaxPooling2D(2, strides=1),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(classes),
        ],
        name="tanh_cnn",
    )


def text_model(vocab=50, seq=10, dim=8, classes=3):
    inputs = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim)(inputs)
    h = keras.layers.Conv1D(6, 3, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(classes)(h)
    return keras.Model(inputs, outputs, name="text")


def norm_model(d=6, seq=5, classes=3):
    inputs = keras.Input((seq, d))
    h = keras.layers.Dense(8)(inputs)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.GroupNormalization(groups=2)(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(classes)(h)
    return keras.Model(inputs, outputs, name="norms")


class Subclassed(keras.Model):
    def __init__(self, classes=3):
        super().__init__()
        self.d1 = keras.layers.Dense(8, activation="tanh")
        self.d2 = keras.layers.Dense(classes)

    def call(self, x, training=False):
        return self.d2(self.d1(x) * 2.0)


def subclassed(d=5, classes=3):
    model = Subclassed(classes)
    model(np.zeros((1, d), np.float32))
    return model


def two_input(d1=4, d2=3, classes=2):
    a = keras.Input((d1,), name="a")
    b = keras.Input((d2,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(5)(a), keras.layers.Dense(5)(b)])
    outputs = keras.layers.Dense(classes)(keras.layers.Activation("relu")(h))
    return keras.Model({"a": a, "b": b}, outputs, name="two_input")


def batch_for(model_name, b, rng):
    """A random batch (x, y) matching the model of that name."""
    if model_name == "mlp":
        return rng.normal(size=(b, 12)).astype("float32"), rng.integers(0, 4, b)
    if model_name == "tanh_cnn":
        return rng.normal(size=(b, 16, 16, 1)).astype("float32"), rng.integers(0, 10, b)
    if model_name == "text":
        return rng.integers(0, 50, (b, 10)).astype("int32"), rng.integers(0, 3, b)
    if model_name == "norms":
        return rng.normal(size=(b, 5, 6)).astype("float32"), rng.integers(0, 3, b)
    if model_name == "subclassed":
        return rng.normal(size=(b, 5)).astype("float32"), rng.integers(0, 3, b)
    if model_name == "two_input":
        x = {
            "a": rng.normal(size=(b, 4)).astype("float32"),
            "b": rng.normal(size=(b, 3)).astype("float32"),
        }
        return x, rng.integers(0, 2, b)
    raise KeyError(model_name)


BUILDERS = {
    "mlp": mlp,
    "tanh_cnn": tanh_cnn,
    "text": text_model,
    "norms": norm_model,
    "subclassed": subclassed,
    "two_input": two_input,
}


# Start of a script run in a subprocess: 2 logical CPUs (for a 2-replica MirroredStrategy, set
# before any TensorFlow op), then `data`: one frozen pass of a Poisson sampler over 64 rows.
TWO_REPLICA_DATA = """
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import numpy as np
import dpcore
from dpcore import sampling

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 5)).astype("float32")
y = rng.integers(0, 3, 64).astype("int32")
# One pass of the sampler, frozen, so both runs see the same samples (P = 43: not a multiple
# of 2, so the split needs padding rows).
elements = list(sampling.poisson_batches(x, y, sampling_prob=0.25, steps=6, seed=1))
data = tf.data.Dataset.from_tensor_slices(tuple(tf.stack(p) for p in zip(*elements)))
"""


def keras_divides_activity_penalty() -> bool:
    """Whether this Keras adds an activity penalty divided by the batch size (the batch's mean);
    Keras 3.6 adds it undivided, and dpcore refuses activity regularizers there."""
    layer = keras.layers.Dense(
        1,
        kernel_initializer="ones",
        use_bias=False,
        activity_regularizer=keras.regularizers.L1(1.0),
    )
    layer(np.ones((4, 1), "float32"))
    return bool(np.isclose(float(layer.losses[0]), 1.0))


# Keras 3.6 adds an activity penalty undivided by the batch size and dpcore refuses activity
# regularizers there (tests/test_keras_fit.py checks that refusal on every Keras); tests of the
# penalties' values skip on such a Keras.
divided_activity = pytest.mark.skipif(
    not keras_divides_activity_penalty(), reason="this Keras adds activity penalties undivided"
)
