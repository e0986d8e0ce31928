"""The vectorized path under TensorFlow's oneDNN CPU kernels (run by tests/test_onednn.py).

Usage: python tests/onednn_worker.py. It runs with the environment it is given (the test leaves
``TF_ENABLE_ONEDNN_OPTS`` unset, as a user runs dpcore, or sets it to 1), prints
``ONEDNN on|off`` first and ``DONE`` last, and raises (exit code 1) on a non-finite norm or a
disagreement with the exact reference (:mod:`dpcore.testing`); a heap corruption aborts it.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.util import _pywrap_util_port  # noqa: E402

import dpcore  # noqa: E402
from dpcore.options import ExecutionOptions  # noqa: E402
from dpcore.testing import (  # noqa: E402
    assert_sq_norm_bound,
    reference_per_example_gradients,
    reference_per_example_norms,
)

L = keras.layers
MSE = keras.losses.MeanSquaredError(reduction=None)
SPARSE_CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
VECTORIZED = ExecutionOptions(method="vectorized", training=False)  # as the reference: no dropout
REPEATS = 20  # of the case that aborted every process on the machines of the report


class EinsumProjection(L.Layer):
    """A user layer without a rule: the fast path's per-layer fallback vectorizes it (the tanh
    makes its gradient need the einsum's value, so the vectorized program computes it)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 8))

    def call(self, x):
        return keras.ops.tanh(keras.ops.einsum("btd,de->bte", x, self.kernel))


def norms(model, loss, x, y, options):
    out = np.asarray(dpcore.per_example_norms(model, loss, x, y, options=options), np.float64)
    assert np.all(np.isfinite(out)), f"{model.name}: non-finite norms {out}"
    return out


# Float32 rounding through attention and normalizations moves a squared norm by up to ~2e-5 of
# itself on random models, on every path and in the float32 reference too (a corrupted product
# moves it by far more).
RTOL = 1e-4


def check_reference(model, loss, x, y, got, rtol=RTOL):
    ref = reference_per_example_norms(reference_per_example_gradients(model, loss, x, y))
    assert_sq_norm_bound(got**2, ref.astype(np.float64) ** 2, rtol=rtol, err_msg=model.name)


def einsum_dense(rng):
    """The reported case: EinsumDense on 3-D inputs, pooling, Dense(1), batch 192."""
    inp = keras.Input((6, 16))
    h = L.EinsumDense("btd,de->bte", output_shape=(None, 8))(inp)
    model = keras.Model(inp, L.Dense(1)(L.GlobalAveragePooling1D()(h)), name="einsum_dense")
    for _ in range(REPEATS):
        x = rng.standard_normal((192, 6, 16)).astype("float32")
        y = rng.standard_normal((192, 1)).astype("float32")
        got = norms(model, MSE, x, y, VECTORIZED)
        # 8 random rows per repetition against the reference (one eager tape each).
        rows = np.sort(rng.choice(192, 8, replace=False))
        check_reference(model, MSE, x[rows], y[rows], got[rows], rtol=1e-5)


def sequence_families(rng):
    """Embedding, attention, LayerNormalization, EinsumDense and Dense on sequences, vectorized,
    per example and in units of two rows; and a rule-less einsum layer through the fast path's
    per-layer fallback."""
    inp = keras.Input((6,), dtype="int32")
    h = L.Embedding(20, 16)(inp)
    h = L.LayerNormalization()(L.MultiHeadAttention(2, 8)(h, h))
    h = L.EinsumDense("btd,dhe->bthe", output_shape=(None, 2, 4), bias_axes="e")(h)
    h = L.EinsumDense("bthe,hef->btf", output_shape=(None, 16))(h)
    h = EinsumProjection()(L.Dense(16)(h))
    model = keras.Model(inp, L.Dense(1)(L.GlobalAveragePooling1D()(h)), name="sequence_families")
    x = rng.integers(0, 20, (16, 6)).astype("int32")
    y = rng.standard_normal((16, 1)).astype("float32")
    for options in (VECTORIZED, ExecutionOptions(training=False)):
        check_reference(model, MSE, x, y, norms(model, MSE, x, y, options))
    norms(model, MSE, x, y, VECTORIZED.replace(group_size=2))


def normalizations(rng):
    """GroupNormalization and RMSNormalization (Keras >= 3.9), each on its own branch."""
    inp = keras.Input((6, 8))
    branches = [L.GroupNormalization(groups=2)(L.Dense(8)(inp))]
    if hasattr(L, "RMSNormalization"):
        branches.append(L.RMSNormalization()(L.Dense(8)(inp)))
    h = L.Concatenate()(branches) if len(branches) > 1 else branches[0]
    model = keras.Model(inp, L.Dense(1)(L.GlobalAveragePooling1D()(h)), name="normalizations")
    x = rng.standard_normal((16, 6, 8)).astype("float32")
    y = rng.standard_normal((16, 1)).astype("float32")
    check_reference(model, MSE, x, y, norms(model, MSE, x, y, VECTORIZED))


def recurrent(rng):
    inp = keras.Input((5, 3))
    h = L.GRU(4)(L.LSTM(4, return_sequences=True)(L.SimpleRNN(4, return_sequences=True)(inp)))
    model = keras.Model(inp, L.Dense(1)(h), name="recurrent")
    x = rng.standard_normal((8, 5, 3)).astype("float32")
    y = rng.standard_normal((8, 1)).astype("float32")
    check_reference(model, MSE, x, y, norms(model, MSE, x, y, VECTORIZED))


def conv_families(rng):
    inp = keras.Input((8, 8, 3))
    h = L.Conv2D(4, 3)(inp)
    h = L.DepthwiseConv2D(3)(h)
    h = L.SeparableConv2D(4, 1)(h)
    h = L.Conv1D(4, 3)(L.Reshape((16, 4))(h))
    model = keras.Model(inp, L.Dense(1)(L.Flatten()(h)), name="conv_families")
    x = rng.standard_normal((16, 8, 8, 3)).astype("float32")
    y = rng.standard_normal((16, 1)).astype("float32")
    check_reference(model, MSE, x, y, norms(model, MSE, x, y, VECTORIZED))


def bert(rng):
    """A tiny, randomly initialized KerasHub BERT classifier through the whole-model fallback's
    vectorized path."""
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=50,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=8,
    )
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None)
    pad = (np.arange(8)[None] < rng.integers(3, 9, (8, 1))).astype("int32")
    x = {
        "token_ids": rng.integers(1, 50, (8, 8)).astype("int32") * pad,
        "segment_ids": (np.arange(8)[None] >= 4).astype("int32").repeat(8, 0),
        "padding_mask": pad,
    }
    y = rng.integers(0, 3, 8)
    check_reference(model, SPARSE_CE, x, y, norms(model, SPARSE_CE, x, y, VECTORIZED))


def main():
    print("ONEDNN", "on" if _pywrap_util_port.IsMklEnabled() else "off", flush=True)
    tf.get_logger().setLevel("CRITICAL")  # pfor's trace of what it cannot vectorize
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    einsum_dense(rng)
    sequence_families(rng)
    normalizations(rng)
    conv_families(rng)
    recurrent(rng)
    try:
        import keras_hub  # noqa: F401
    except ImportError:
        print("keras_hub not installed: BERT skipped", flush=True)
    else:
        bert(rng)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
