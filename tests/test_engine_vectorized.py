"""The vectorized engine against the slow exact reference."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dpcore
import dpcore.engine as engine
from dpcore import aggregation
from dpcore.options import ExecutionOptions
from dpcore.testing import (
    reference_clipped_mean,
    reference_input_gradients,
    reference_per_example_gradients,
    reference_per_example_norms,
)
from tests.models import BUILDERS, batch_for

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("compiled", [False, True])
def test_per_example_gradients_match_reference(name, compiled, rng):
    model = BUILDERS[name]()
    b = 5
    x, y = batch_for(name, b, rng)
    sw = rng.uniform(0.5, 2.0, b).astype("float32")
    mask = np.array([1, 1, 0, 1, 1], bool)
    ref = reference_per_example_gradients(model, LOSS, x, y, sample_weight=sw, mask=mask)

    def run(x, y, sw, mask):
        return engine.per_example_gradients(model, LOSS, x, y, sample_weight=sw, mask=mask)

    fn = tf.function(run) if compiled else run
    got = fn(x, y, sw, mask)
    assert len(got) == len(model.trainable_variables)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        _close(g, r)
    assert np.all(np.asarray(got[0])[2] == 0)  # masked example


@pytest.mark.parametrize("name", ["mlp", "tanh_cnn", "two_input"])
def test_summary_norms_and_clipped_sum_match_reference(name, rng):
    model = BUILDERS[name]()
    x, y = batch_for(name, 6, rng)
    ref = reference_per_example_gradients(model, LOSS, x, y)
    ref_norms = reference_per_example_norms(ref)
    c = float(np.median(ref_norms))

    @tf.function
    def step(x, y):
        s = engine.summarize(
            model, LOSS, x, y, options=ExecutionOptions(method="vectorized", training=False)
        )
        clipped = aggregation.clip(s, l2_norm_clip=c)
        return clipped.per_example_norms, [g / 6.0 for g in clipped.grads]

    norms, mean = step(x, y)
    _close(norms, ref_norms)
    for g, r in zip(mean, reference_clipped_mean(ref, l2_norm_clip=c, expected_batch_size=6)):
        _close(g, r)


def test_chunked_summary_equals_unchunked(rng):
    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", 7, rng)
    mask = np.array([1, 0, 1, 1, 1, 1, 1], bool)

    @tf.function
    def step(x, y, chunk):
        s = engine.summarize(
            model,
            LOSS,
            x,
            y,
            mask=mask,
            options=ExecutionOptions(method="vectorized", training=False, chunk_size=chunk),
        )
        clipped = aggregation.clip(s, l2_norm_clip=0.5)
        return clipped.per_example_norms, clipped.grads

    n1, g1 = step(x, y, None)
    n3, g3 = step(x, y, 3)  # 7 is not a multiple of 3: padding chunk
    _close(n1, n3)
    for a, b in zip(g1, g3):
        _close(a, b)


def test_input_gradients_match_reference_in_same_step(rng):
    model = BUILDERS["tanh_cnn"]()
    x, y = batch_for("tanh_cnn", 4, rng)
    grads, xg = engine.per_example_gradients(
        model, LOSS, x, y, options=ExecutionOptions(wrt_inputs=True)
    )
    _close(xg, reference_input_gradients(model, LOSS, x, y))
    for g, r in zip(grads, reference_per_example_gradients(model, LOSS, x, y)):
        _close(g, r)


def test_eager_calls_compile_once(rng):
    model = BUILDERS["mlp"]()
    for _step in range(5):
        x, y = batch_for("mlp", 4, rng)
        engine.per_example_gradients(model, LOSS, x, y, options=ExecutionOptions(wrt_inputs=True))
    fn = next(iter(engine._COMPILED[model].values()))
    traces = fn.experimental_get_tracing_count()
    assert traces == 1, traces


def test_compiled_cache_stays_bounded_with_a_new_loss_object_per_call(rng):
    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", 2, rng)
    first = None
    for _ in range(engine._MAX_COMPILED_PER_MODEL + 4):
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        norms = engine.per_example_norms(model, loss, x, y)
        first = norms if first is None else first
        np.testing.assert_allclose(norms, first, rtol=1e-6)  # every entry computes the same
    assert len(engine._COMPILED[model]) == engine._MAX_COMPILED_PER_MODEL


def test_scalar_loss_is_rejected(rng):
    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", 3, rng)
    mean_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)  # reduces
    # A Loss instance is rebuilt unreduced; a plain function returning a scalar is refused.
    engine.per_example_gradients(model, mean_loss, x, y)

    def scalar_loss(y_true, y_pred):
        return tf.reduce_mean(LOSS(y_true, y_pred))

    with pytest.raises(ValueError, match="scalar"):
        engine.per_example_gradients(model, scalar_loss, x, y)


def test_no_trainable_variables_is_rejected(rng):
    model = BUILDERS["mlp"]()
    model.trainable = False
    x, y = batch_for("mlp", 3, rng)
    with pytest.raises(ValueError, match="no trainable variables"):
        engine.per_example_gradients(model, LOSS, x, y)


def test_label_batch_mismatch_is_rejected(rng):
    model = BUILDERS["mlp"]()
    x, _ = batch_for("mlp", 4, rng)
    with pytest.raises(ValueError, match="batch size"):
        engine.per_example_gradients(model, LOSS, x, np.zeros(3, "int64"))


def test_nonfinite_inputs_raise_or_skip(rng):
    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", 4, rng)
    x[1, 3] = np.nan
    with pytest.raises(tf.errors.InvalidArgumentError, match="NaN or Inf in x at row 1 of"):
        engine.per_example_gradients(model, LOSS, x, y)
    got = engine.per_example_gradients(
        model, LOSS, x, y, options=ExecutionOptions(nonfinite="skip")
    )
    ref = reference_per_example_gradients(model, LOSS, np.nan_to_num(x), y, mask=[1, 0, 1, 1])
    for g, r in zip(got, ref):
        assert np.all(np.isfinite(g))
        _close(g, r)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_sample_weight_raises_or_is_skipped(bad, rng):
    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", 4, rng)
    sw = np.array([1.0, bad, 0.5, 2.0], "float32")
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="NaN or Inf in sample_weight at row 1 "
    ):
        engine.per_example_gradients(model, LOSS, x, y, sample_weight=sw)
    got = engine.per_example_gradients(
        model, LOSS, x, y, sample_weight=sw, options=ExecutionOptions(nonfinite="skip")
    )
    ref = reference_per_example_gradients(
        model, LOSS, x, y, sample_weight=np.nan_to_num(sw, posinf=0.0), mask=[1, 0, 1, 1]
    )
    for g, r in zip(got, ref):
        assert np.all(np.isfinite(g))
        _close(g, r)
    # A non-finite weight on a padding row is ignored, as the row is.
    padded = engine.per_example_gradients(model, LOSS, x, y, sample_weight=sw, mask=[1, 0, 1, 1])
    for g, r in zip(padded, ref):
        _close(g, r)


def test_empty_batch_gives_empty_gradients():
    model = BUILDERS["mlp"]()
    x = np.zeros((0, 12), np.float32)
    y = np.zeros((0,), np.int64)
    got = engine.per_example_gradients(model, LOSS, x, y)
    assert got[0].shape[0] == 0


def test_per_example_gradients_chunked_equal_unchunked(rng):
    model = BUILDERS["tanh_cnn"]()
    x, y = batch_for("tanh_cnn", 5, rng)
    full = engine.per_example_gradients(model, LOSS, x, y)
    chunked = engine.per_example_gradients(
        model, LOSS, x, y, options=ExecutionOptions(chunk_size=2)
    )
    for a, b in zip(full, chunked):
        assert a.shape == b.shape
        _close(a, b)
    with pytest.raises(ValueError, match="chunk_size"):
        engine.per_example_gradients(model, LOSS, x, y, options=ExecutionOptions(chunk_size=0))


def test_nonfinite_check_gates_the_update_in_a_compiled_step(rng):
    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", 4, rng)
    x[0, 0] = np.inf
    var = model.trainable_variables[0]
    before = var.numpy()

    @tf.function
    def step(x, y):
        g = engine.per_example_gradients(model, LOSS, x, y)
        var.assign_sub(tf.reduce_sum(g[0], 0))

    with pytest.raises(
        tf.errors.InvalidArgumentError, match="NaN or Inf in x at row 0 of the batch"
    ):
        step(x, y)
    np.testing.assert_array_equal(var.numpy(), before)


class _GroupedConvNet(keras.Model):
    """Subclassed, so the fast path falls back to the vectorized engine as a whole."""

    def __init__(self):
        super().__init__()
        self.conv = keras.layers.Conv2D(4, 3, groups=2, activation="tanh")
        self.flat = keras.layers.Flatten()
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.flat(self.conv(x)))


def test_grouped_conv_takes_the_per_example_loop_and_matches_the_reference(rng):
    """TensorFlow builds a vectorized filter gradient for grouped convolutions that fails when it
    runs; the engine must loop over examples instead, on the whole-model fallback too."""
    model = _GroupedConvNet()
    x = rng.normal(size=(3, 6, 6, 4)).astype("float32")
    y = rng.integers(0, 3, 3)
    model(x)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    with pytest.warns(RuntimeWarning, match="grouped convolution"):
        got = engine.per_example_gradients(model, loss, x, y)
    want = reference_per_example_gradients(model, loss, x, y)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6)
    norms = dpcore.per_example_norms(model, loss, x, y)  # the whole-model fallback of "auto"
    ref = np.sqrt(sum(np.sum(w.reshape(3, -1) ** 2, axis=1) for w in want))
    np.testing.assert_allclose(np.asarray(norms), ref, rtol=1e-5)
