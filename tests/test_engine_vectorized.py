"""The vectorized engine against the slow exact reference."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import dpcore
import dpcore.engine as engine
from dpcore import aggregation
from dpcore.engine import vectorized
from dpcore.options import ExecutionOptions
from dpcore.testing import (
    assert_sq_norm_bound,
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


MSE = keras.losses.MeanSquaredError(reduction=None)


class _EinsumProjection(keras.layers.Layer):
    """A layer without a rule: the fast path's per-layer fallback vectorizes its gradient."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4))

    def call(self, x):
        return keras.ops.tanh(keras.ops.einsum("btd,de->bte", x, self.kernel))


def _einsum_model():
    """The model of the oneDNN report (EinsumDense on 3-D inputs, pooling, Dense(1)), with
    attention and a rule-less einsum layer."""
    L = keras.layers  # named layers: Keras's automatic names stay as other tests expect them
    inp = keras.Input((6, 16))
    h = L.EinsumDense("btd,de->bte", output_shape=(None, 8), name="einsum")(inp)
    h = L.MultiHeadAttention(2, 4, name="mha")(h, h)
    h = _EinsumProjection(name="projection")(h)
    out = L.Dense(1, name="head")(L.GlobalAveragePooling1D(name="pool")(h))
    return keras.Model(inp, out, name="einsum_model")


@pytest.mark.filterwarnings("ignore:dpcore. model")
def test_vectorized_path_never_builds_the_broadcast_product_onednn_corrupts(rng):
    """tf.vectorized_map turns EinsumDense's ``[1, T, D] x [D, E]`` into ``[B, 1, T, D] x [D, E]``,
    the product on which TensorFlow 2.21's oneDNN matmul corrupts the heap; what dpcore traces
    (the vectorized path per example, in units, in chunks, and the fast path's per-layer fallback)
    holds none, and still matches the reference."""
    model = _einsum_model()
    x = rng.normal(size=(8, 6, 16)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    ref = reference_per_example_norms(reference_per_example_gradients(model, MSE, x, y))
    ref_sq = np.asarray(ref, np.float64) ** 2

    def traced(options):
        def step(x, y):
            return engine.summarize(model, MSE, x, y, options=options).sq_norms

        return tf.function(step).get_concrete_function(x, y)

    plain = ExecutionOptions(method="vectorized", training=False)
    for options in (
        plain,
        plain.replace(group_size=2),
        plain.replace(chunk_size=3),
        ExecutionOptions(method="fast", training=False),
    ):
        fn = traced(options)
        assert vectorized.broadcast_batch_matmul(fn.graph) is None, options
        if options.group_size == 1:
            got = np.sum(np.asarray(fn(x, y), np.float64), axis=1)
            assert_sq_norm_bound(got, ref_sq, err_msg=str(options))
    # The same trace with TensorFlow's own conversion holds the product (the search reaches the
    # vectorized program's own function graph).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vectorized, "folded_products", contextlib.nullcontext)
        found = vectorized.broadcast_batch_matmul(traced(plain).graph)
    assert found is not None and "einsum" in found and "[8, 1, 6, 16] x [16, 8]" in found, found


@pytest.mark.parametrize(
    "x_shape, x_per_example, y_shape, y_per_example, adj_x, adj_y",
    [
        ((1, 6, 5), True, (5, 3), False, False, False),  # EinsumDense: [1, T, D] x [D, E]
        ((1, 6, 5), True, (3, 5), False, False, True),
        ((5, 6), True, (1, 5, 3), False, True, False),
        ((6, 5), True, (2, 5, 3), False, False, False),  # the shared operand broadcasts
        ((2, 6, 5), True, (5, 3), False, False, False),
        ((1, 6, 5), False, (5, 3), True, False, False),  # the per-example operand on the right
        ((2, 5, 6), False, (2, 3, 5), True, True, True),
        ((6, 5), False, (1, 5, 3), True, False, False),
        ((1, 6, 5), True, (1, 5, 3), True, False, False),  # both per example: TensorFlow's own
    ],
)
def test_folded_products_compute_each_examples_product(
    x_shape, x_per_example, y_shape, y_per_example, adj_x, adj_y, rng
):
    """Under folded_products, vectorized_map of a batched matmul equals the matmul of each
    example, holds no broadcast rank-4 product, and TensorFlow's converter is back afterwards."""
    from tensorflow.python.ops.parallel_for import pfor

    n = 4
    xs = tf.constant(rng.normal(size=((n,) if x_per_example else ()) + x_shape), tf.float32)
    ys = tf.constant(rng.normal(size=((n,) if y_per_example else ()) + y_shape), tf.float32)

    def one(i):
        a = tf.gather(xs, i) if x_per_example else xs
        b = tf.gather(ys, i) if y_per_example else ys
        return tf.matmul(a, b, adjoint_a=adj_x, adjoint_b=adj_y)

    original = pfor._pfor_converter_registry["BatchMatMulV2"]
    fn = tf.function(lambda i: vectorized.map_examples(one, i)).get_concrete_function(
        tf.TensorSpec([n], tf.int32)
    )
    assert pfor._pfor_converter_registry["BatchMatMulV2"] is original
    assert vectorized.broadcast_batch_matmul(fn.graph) is None
    want = np.stack([one(tf.constant(i)).numpy() for i in range(n)])
    np.testing.assert_allclose(fn(tf.range(n)).numpy(), want, rtol=1e-5, atol=1e-5)
