"""Whole models on the fast path: fast == vectorized == slow exact reference.

Covers the small versions of the benchmark models (MLP, tanh CNN, text classifier, a 2-block
transformer encoder), a layer shared by two calls, a custom layer without a rule (per-layer
fallback), nested models, a subclassed model (whole-model fallback with a warning), masks, sample
weights, input gradients and the ``explain`` report.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpcore.engine import ghost
from dpcore.engine.summary import prepare_batch
from dpcore.engine.vectorized import vectorized_summary
from dpcore.explain import explain
from dpcore.losses import per_example_loss_fn
from dpcore.options import ExecutionOptions
from dpcore.testing import (
    assert_sq_norm_bound,
    reference_input_gradients,
    reference_per_example_gradients,
)
from tests.models import BUILDERS, batch_for

RTOL = 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
INFERENCE = ExecutionOptions(training=False)


def _both_paths(model, x, y, sw, mask, weights, *, wrt_inputs=False, jit=False):
    loss_fn = per_example_loss_fn(LOSS)
    variables = model.trainable_variables

    @tf.function(jit_compile=jit)
    def step(x, y, sw, mask, weights):
        xp, yp, swp, mkp = prepare_batch(x, y, sw, mask)
        out = []
        for summarize in (ghost.fast_summary, vectorized_summary):
            s = summarize(
                model,
                loss_fn,
                xp,
                yp,
                swp,
                mkp,
                variables,
                options=ExecutionOptions(training=False, wrt_inputs=wrt_inputs),
            )
            out.append((s.sq_norms, s.weighted_sum(weights), s.per_example_loss, s.input_gradients))
        return out

    return tf.nest.map_structure(
        lambda t: None if t is None else np.asarray(t), step(x, y, sw, mask, weights)
    )


def check_model(model, x, y, *, jit=False, wrt_inputs=False):
    b = tf.nest.flatten(x)[0].shape[0]
    sw = np.linspace(0.5, 2.0, b).astype("float32")
    mask = np.ones(b, "float32")
    mask[-1] = 0.0
    ref = reference_per_example_gradients(model, LOSS, x, y, sample_weight=sw, mask=mask)
    ref_sq = np.stack([np.sum(g.reshape(b, -1) ** 2, axis=1) for g in ref], axis=1)
    weights = np.random.default_rng(1).uniform(0.1, 1.0, (b, len(ref))).astype("float32")
    ref_sums = [np.tensordot(weights[:, j], g, axes=1) for j, g in enumerate(ref)]
    # Float32 round-off is relative to the gradient's overall scale: some variables (e.g. the key
    # bias of attention) have an exactly-zero true gradient and only round-off noise.
    scale = max(np.abs(w).max() for w in ref_sums)
    (fast, vec) = _both_paths(model, x, y, sw, mask, weights, wrt_inputs=wrt_inputs, jit=jit)
    for name, (sq, sums, loss, _) in (("fast", fast), ("vectorized", vec)):
        assert_sq_norm_bound(sq, ref_sq, rtol=RTOL, atol=1e-7 * ref_sq.max(), err_msg=name)
        for j, (got, want) in enumerate(zip(sums, ref_sums)):
            np.testing.assert_allclose(
                got, want, rtol=RTOL, atol=1e-6 * scale, err_msg=f"{name} var {j}"
            )
        assert np.all(sq[-1] == 0) and loss[-1] == 0
    np.testing.assert_allclose(fast[2], vec[2], rtol=RTOL)
    if wrt_inputs:
        want = reference_input_gradients(model, LOSS, x, y, sample_weight=sw * mask)
        tf.nest.map_structure(
            lambda got, w: np.testing.assert_allclose(got, w, rtol=RTOL, atol=1e-7),
            fast[3],
            want,
        )
    return fast


@pytest.mark.parametrize("name", ["mlp", "tanh_cnn", "text", "norms", "two_input"])
def test_zoo_models(name, rng):
    model = BUILDERS[name]()
    x, y = batch_for(name, 4, rng)
    assert ghost.supports(model)
    check_model(model, x, y)


@pytest.mark.slow
def test_mlp_input_gradients_and_xla(rng):
    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", 3, rng)
    check_model(model, x, y, jit=True, wrt_inputs=True)


def _transformer(seq=6, d=16, heads=2, vocab=30, classes=3, blocks=2):
    inputs = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(vocab, d)(inputs)
    for _ in range(blocks):
        att = keras.layers.MultiHeadAttention(heads, d // heads)(h, h)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, att]))
        ff = keras.layers.Dense(2 * d, activation="relu")(h)
        ff = keras.layers.Dense(d)(ff)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, ff]))
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, keras.layers.Dense(classes)(h), name="transformer")


@pytest.mark.slow
def test_transformer_encoder(rng):
    model = _transformer()
    x = rng.integers(0, 30, (3, 6)).astype("int32")
    y = rng.integers(0, 3, 3)
    check_model(model, x, y)
    paths = explain(model).paths()
    assert paths["multi_head_attention"] == "ghost"  # projections by the EinsumDense rule
    assert "fallback:vectorized" not in paths.values()


def test_shared_layer_sums_uses_before_norm(rng):
    """A layer used twice: one norm of the summed gradient, not two norms (cross terms count)."""
    shared_dense = keras.layers.Dense(4, activation="tanh", name="shared")
    shared_conv = keras.layers.Conv1D(3, 2, padding="same", name="shared_conv")
    shared_ln = keras.layers.LayerNormalization(name="shared_ln")
    shared_emb = keras.layers.Embedding(9, 4, name="shared_emb")
    a = keras.Input((5, 4))
    ids = keras.Input((3,), dtype="int32")
    h1 = shared_ln(shared_conv(shared_dense(a)))
    h2 = shared_ln(shared_conv(shared_dense(shared_emb(ids))))
    e2 = keras.layers.Flatten()(shared_emb(ids))
    h = keras.layers.Concatenate()([keras.layers.Flatten()(h1), keras.layers.Flatten()(h2), e2])
    model = keras.Model([a, ids], keras.layers.Dense(3)(h))
    x = [rng.normal(size=(4, 5, 4)).astype("float32"), rng.integers(0, 9, (4, 3)).astype("int32")]
    y = rng.integers(0, 3, 4)
    check_model(model, x, y)


class Scale(keras.layers.Layer):
    """A custom trainable layer with no rule: must take the per-layer fallback."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return tf.sin(x * self.w)


def test_custom_layer_falls_back_for_its_own_variables(rng):
    inputs = keras.Input((5,))
    h = Scale(name="scale")(keras.layers.Dense(6)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    x, y = rng.normal(size=(4, 5)).astype("float32"), rng.integers(0, 3, 4)
    check_model(model, x, y)
    paths = explain(model).paths()
    assert paths["scale"] == "fallback:vectorized"
    assert paths[model.layers[1].name] == "ghost"


def test_nested_models(rng):
    inner = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(4)],
        name="inner",
    )
    block_in = keras.Input((4,))
    block = keras.Model(block_in, keras.layers.Dense(4, activation="relu")(block_in), name="block")
    inputs = keras.Input((6,))
    h = block(block(inner(inputs)))  # a nested functional model used twice
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    x, y = rng.normal(size=(4, 6)).astype("float32"), rng.integers(0, 3, 4)
    assert ghost.supports(model)
    check_model(model, x, y)
    assert set(explain(model).paths().values()) == {"ghost"}


def _fast_inference(model, loss_fn, xp, yp, sw, mk):
    """The fast path on a prepared batch, all trainable variables, inference mode."""
    return ghost.fast_summary(
        model, loss_fn, xp, yp, sw, mk, model.trainable_variables, options=INFERENCE
    )


def test_subclassed_model_falls_back_whole_with_warning(rng):
    model = BUILDERS["subclassed"]()
    x, y = batch_for("subclassed", 3, rng)
    assert not ghost.supports(model)
    loss_fn = per_example_loss_fn(LOSS)
    xp, yp, sw, mk = prepare_batch(x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = _fast_inference(model, loss_fn, xp, yp, sw, mk)
    assert any("subclassed" in str(w.message) for w in caught)
    ref = reference_per_example_gradients(model, LOSS, x, y)
    ref_sq = np.stack([np.sum(g.reshape(3, -1) ** 2, axis=1) for g in ref], axis=1)
    assert_sq_norm_bound(s.sq_norms, ref_sq, rtol=RTOL)
    report = explain(model)
    assert report.whole_model_fallback and "subclassed" in str(report)


@pytest.mark.parametrize("reader", ["lambda", "op"])
def test_variable_read_outside_its_layer_falls_back_whole(reader, rng):
    """A kernel also read by a Lambda closure or a Keras op of the graph: the per-layer rules
    cannot see that use, so the model takes the vectorized path (with a warning), and the
    result matches the reference (it silently missed that gradient before)."""
    inputs = keras.Input((5,))
    dense = keras.layers.Dense(5, use_bias=False)
    h = dense(inputs)
    if reader == "lambda":
        h = keras.layers.Lambda(lambda t: keras.ops.matmul(t, dense.kernel))(h)
    else:
        h = keras.ops.matmul(h, dense.kernel)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    x = rng.normal(size=(4, 5)).astype("float32")
    y = rng.integers(0, 3, 4)
    loss_fn = per_example_loss_fn(LOSS)
    xp, yp, sw, mk = prepare_batch(x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = tf.function(lambda: _fast_inference(model, loss_fn, xp, yp, sw, mk).sq_norms)()
    assert any("outside the layer that owns it" in str(w.message) for w in caught)
    ref = reference_per_example_gradients(model, LOSS, x, y)
    ref_sq = np.stack([np.sum(g.reshape(4, -1) ** 2, axis=1) for g in ref], axis=1)
    assert_sq_norm_bound(s, ref_sq, rtol=RTOL)
    assert ghost.supports(model) == (reader == "lambda")  # the op is seen before tracing


def test_variable_subset_and_frozen_layers(rng):
    model = BUILDERS["mlp"]()
    model.get_layer("dense_0").trainable = False
    variables = [model.get_layer("logits").kernel]
    x, y = batch_for("mlp", 3, rng)
    loss_fn = per_example_loss_fn(LOSS)
    xp, yp, sw, mk = prepare_batch(x, y)
    s = ghost.fast_summary(model, loss_fn, xp, yp, sw, mk, variables, options=INFERENCE)
    ref = reference_per_example_gradients(model, LOSS, x, y, variables=variables)
    assert_sq_norm_bound(s.sq_norms[:, 0], np.sum(ref[0].reshape(3, -1) ** 2, axis=1), rtol=RTOL)
    assert explain(model).paths()["dense_0"] == "frozen"


def test_explain_table_lists_every_layer():
    model = BUILDERS["tanh_cnn"]()
    report = explain(model)
    text = str(report)
    for layer in model.layers:
        assert layer.name in text
    paths = report.paths()
    assert paths[model.layers[0].name] in ("ghost", "materialized")
    assert paths[model.layers[1].name] == "no variables"


def test_cross_and_causal_attention(rng):
    q_in, v_in = keras.Input((4, 6)), keras.Input((5, 6))
    mha = keras.layers.MultiHeadAttention(2, 3, value_dim=4, name="cross")
    h = mha(q_in, v_in, use_causal_mask=True)
    h = keras.layers.Flatten()(h)
    model = keras.Model([q_in, v_in], keras.layers.Dense(3)(h))
    x = [rng.normal(size=(3, 4, 6)).astype("float32"), rng.normal(size=(3, 5, 6)).astype("float32")]
    check_model(model, x, rng.integers(0, 3, 3))


def test_embedding_mask_zero_propagates_keras_mask(rng):
    """Keras masks from a rule layer (Embedding mask_zero) still reach masked pooling."""
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(10, 4, mask_zero=True)(inputs)
    h = keras.layers.Dense(5, activation="tanh")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    x = rng.integers(1, 10, (4, 6)).astype("int32")
    x[:, 4:] = 0  # padding tokens: the pooled average must ignore them
    check_model(model, x, rng.integers(0, 3, 4))


def test_summary_paths_name_layers_like_explain(rng):
    model = _transformer(blocks=1)
    x, y = rng.integers(0, 30, (2, 6)).astype("int32"), rng.integers(0, 3, 2)
    xp, yp, sw, mk = prepare_batch(x, y)
    s = ghost.fast_summary(
        model,
        per_example_loss_fn(LOSS),
        xp,
        yp,
        sw,
        mk,
        model.trainable_variables,
        options=INFERENCE,
    )
    report = explain(model).paths()
    for name, path in s.paths.items():
        top = name.split("/")[0]
        assert top in report and path in ("ghost", "materialized"), (name, path)
    mha = next(r.name for r in explain(model).rows if r.cls == "MultiHeadAttention")
    assert s.paths[f"{mha}/query"] == "ghost"
