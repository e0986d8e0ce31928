"""Recurrent layers (LSTM, GRU, SimpleRNN, Bidirectional) against the slow exact reference.

They have no fast-path rule: each takes the per-layer vectorized fallback (its own variables only;
the rest of the model keeps its rules), which must give the exact per-example norms and clipped
sums, with ``return_sequences`` on and off, Keras masks (``Masking``, ``Embedding(mask_zero=True)``),
padding rows and sample weights, eagerly and under ``tf.function``; and train through
``make_private(...).fit`` with the exact clipped mean. Masked sequence outputs get Keras's output
mask in the loss on every path; a padding row that the model turns into NaN (fully masked by
``Masking`` or ``mask_zero`` under a masked average) contributes exactly zero, also when every row
is padding; the whole-model vectorized path runs a masked LSTM (by its ``map_fn`` fallback).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dpcore
from dpcore.explain import explain
from dpcore.testing import reference_clipped_mean, reference_per_example_gradients
from tests.test_rules import FAST_MODES, check_rule

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")

T, F = 4, 3

LAYERS = {
    "lstm_last": lambda: keras.layers.LSTM(3),
    "lstm_sequences": lambda: keras.layers.LSTM(2, return_sequences=True),
    "gru_last": lambda: keras.layers.GRU(3),
    "gru_sequences": lambda: keras.layers.GRU(2, return_sequences=True, reset_after=False),
    "simple_rnn_last": lambda: keras.layers.SimpleRNN(3),
    "simple_rnn_sequences": lambda: keras.layers.SimpleRNN(2, return_sequences=True),
    "bidirectional_lstm": lambda: keras.layers.Bidirectional(keras.layers.LSTM(2)),
    "bidirectional_gru_sequences": lambda: keras.layers.Bidirectional(
        keras.layers.GRU(2, return_sequences=True), merge_mode="sum"
    ),
}


def _cases(table):
    """Parameters for ``table``; the Bidirectional ones (two RNNs, 50-80 s here) marked slow."""
    out = []
    for k in sorted(table):
        marks = [pytest.mark.slow] if "bidirectional" in k else []
        out.append(pytest.param(k, marks=marks))
    return out


@pytest.mark.parametrize("case", _cases(LAYERS))
def test_recurrent_layer_falls_back_exactly(case, rng):
    layer = LAYERS[case]()
    model = keras.Sequential([keras.Input((T, F)), layer])
    x = rng.normal(size=(4, T, F)).astype("float32")
    y = rng.normal(size=model(x).shape).astype("float32")
    # Eager and compiled run the same fallback code: both for one case, compiled for the rest.
    modes = FAST_MODES if case == "lstm_last" else ("function",)
    paths = check_rule(model, x, y, modes=modes, expect_path="fallback:vectorized")
    assert paths == {layer.name: "fallback:vectorized"}
    row = {r.name: r for r in explain(model).rows}[layer.name]
    assert row.path == "fallback:vectorized" and f"no rule for {type(layer).__name__}" in row.why


def _masked_model(rnn, masking, pool=False):
    """Padded sequences -> ``Embedding(mask_zero=True)`` (ids, 0 = padding) or ``Masking`` (all-zero
    steps) -> ``rnn`` -> (masked average over steps if ``pool``) -> Dense."""
    if masking == "mask_zero":
        inputs = keras.Input((T + 2,), dtype="int32")
        h = keras.layers.Embedding(9, F, mask_zero=True)(inputs)
    else:
        inputs = keras.Input((T + 2, F))
        h = keras.layers.Masking(0.0)(inputs)
    h = rnn(h)
    if pool:
        h = keras.layers.GlobalAveragePooling1D()(h)  # uses the mask
    return keras.Model(inputs, keras.layers.Dense(3)(h))


def _masked_batch(masking, rng, b=4):
    if masking == "mask_zero":
        x = rng.integers(1, 9, (b, T + 2)).astype("int32")
    else:
        x = rng.normal(size=(b, T + 2, F)).astype("float32")
    for i, n in enumerate([6, 3, 1, 4, 2, 5][:b]):
        x[i, n:] = 0  # trailing padding steps, a different length per example
    return x, rng.integers(0, 3, b)


MASKED = {
    "lstm_mask_zero": (lambda: keras.layers.LSTM(3), "mask_zero"),
    "gru_sequences_masking": (lambda: keras.layers.GRU(3, return_sequences=True), "masking"),
    "simple_rnn_sequences_mask_zero": (
        lambda: keras.layers.SimpleRNN(2, return_sequences=True),
        "mask_zero",
    ),
    "bidirectional_lstm_masking": (
        lambda: keras.layers.Bidirectional(keras.layers.LSTM(2)),
        "masking",
    ),
}


@pytest.mark.parametrize("case", _cases(MASKED))
def test_masked_recurrent_model(case, rng):
    """Keras masks reach the fallback's per-example calls: padded steps change nothing. The
    batch has a fully masked example (all padding) and a padding row."""
    make, masking = MASKED[case]
    rnn = make()
    model = _masked_model(rnn, masking)
    x, _ = _masked_batch(masking, rng)
    y = rng.normal(size=model(x).shape).astype("float32")
    # Eager and compiled run the same fallback code: both for one case of each kind of mask,
    # compiled for the rest.
    modes = FAST_MODES if case in ("lstm_mask_zero", "gru_sequences_masking") else ("function",)
    paths = check_rule(model, x, y, modes=modes)
    assert paths[rnn.name] == "fallback:vectorized"
    paths = explain(model).paths()
    assert paths.pop(rnn.name) == "fallback:vectorized"
    assert "fallback:vectorized" not in paths.values()  # the other layers keep their rules


@pytest.mark.parametrize("case", ["gru_sequences_masking", "simple_rnn_sequences_mask_zero"])
def test_masked_sequence_output_on_the_vectorized_path(case, rng):
    """The whole-model vectorized path applies the output mask too: exact norms, and zero for the
    fully masked example (row 1) and the padding row (row 3)."""
    make, masking = MASKED[case]
    model = _masked_model(make(), masking)
    x, _ = _masked_batch(masking, rng)
    x[1] = 0  # every step masked
    y = rng.normal(size=model(x).shape).astype("float32")
    loss = keras.losses.MeanSquaredError(reduction=None)
    mask = np.array([1, 1, 1, 0], "float32")
    grads = reference_per_example_gradients(model, loss, x, y, mask=mask)
    want = np.sqrt(sum(np.sum(g.reshape(len(x), -1) ** 2, axis=1) for g in grads))
    assert want[0] > 0 and want[1] == 0
    for method in ("vectorized", "fast"):
        options = dpcore.ExecutionOptions(method=method)
        got = dpcore.per_example_norms(model, loss, x, y, mask=mask, options=options).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=method)
        assert got[1] == 0 and got[3] == 0


def test_masked_sequence_output_trains_with_a_loss_name(rng):
    """``make_private(...).fit`` with ``loss="mean_squared_error"`` (a plain function, which Keras's
    ``compile`` wraps so that the output mask applies): one sigma = 0 SGD(1.0) step applies the exact
    clipped mean of the masked per-example losses."""
    model = _masked_model(keras.layers.GRU(3, return_sequences=True), "masking")
    x, _ = _masked_batch("masking", rng)
    y = rng.normal(size=model(x).shape).astype("float32")
    _check_one_fit_step(model, "mean_squared_error", x, y, clip=0.05)


def _check_one_fit_step(model, loss, x, y, *, clip):
    """One sigma = 0 SGD(1.0) step of ``make_private(...).fit`` applies the exact clipped mean."""
    grads = reference_per_example_gradients(model, loss, x, y)
    expected = reference_clipped_mean(grads, l2_norm_clip=clip, expected_batch_size=len(x))
    before = [v.numpy() for v in model.trainable_variables]
    dp_model = dpcore.make_private(
        model,
        optimizer=keras.optimizers.SGD(1.0),
        loss=loss,
        l2_norm_clip=clip,
        noise_multiplier=0.0,
        expected_batch_size=len(x),
        options=dpcore.ExecutionOptions(method="fast"),
    )
    dp_model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    for v, b, e in zip(model.trainable_variables, before, expected):
        np.testing.assert_allclose(b - v.numpy(), e, rtol=1e-4, atol=1e-7, err_msg=v.path)


def _pooled_step(masking, method, x, y, mask, *, noise_multiplier=0.0, nonfinite="raise"):
    """One SGD(1.0) ``dp_train_step`` of a fresh masked GRU -> masked average pooling model;
    returns ``(model, loss, parameters before, parameters after)``."""
    keras.utils.set_random_seed(7)
    model = _masked_model(keras.layers.GRU(3, return_sequences=True), masking, pool=True)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    opt = dpcore.DPOptimizer(
        keras.optimizers.SGD(1.0),
        l2_norm_clip=0.1,
        noise_multiplier=noise_multiplier,
        expected_batch_size=len(mask),
        seed=3,
    )
    before = [v.numpy() for v in model.trainable_variables]
    options = dpcore.ExecutionOptions(method=method, nonfinite=nonfinite)
    dpcore.dp_train_step(model, loss, x, y, mask=mask, optimizer=opt, options=options)
    return model, loss, before, [v.numpy() for v in model.trainable_variables]


@pytest.mark.parametrize("method", ["fast", "vectorized"])
@pytest.mark.parametrize("masking", ["masking", "mask_zero"])
def test_padding_row_fully_masked_by_masking_and_pooling(masking, method, rng):
    """``prepare_batch`` zeroes a padding row, so ``Masking`` (all-zero steps) or ``mask_zero``
    (all-zero ids) masks all its steps and the masked average is 0/0 = NaN; the row must still
    contribute exactly zero: the step applies the exact clipped mean of the real rows."""
    x, y = _masked_batch(masking, rng)
    mask = np.array([1, 1, 1, 0], "float32")
    _check_clipped_mean(*_pooled_step(masking, method, x, y, mask), x, y, mask)


def _check_clipped_mean(model, loss, before, after, x, y, mask):
    """``before - after`` is the exact clipped mean of the rows where ``mask`` is 1."""
    for v, b in zip(model.trainable_variables, before):
        v.assign(b)
    grads = reference_per_example_gradients(model, loss, x, y, mask=mask)
    expected = reference_clipped_mean(grads, l2_norm_clip=0.1, expected_batch_size=len(mask))
    for b, a, e in zip(before, after, expected):
        np.testing.assert_allclose(b - a, e, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("method", ["fast", "vectorized"])
def test_all_padding_batch_applies_noise_only(method, rng):
    """An empty Poisson sample (every row padding, every one NaN under the masked average): no
    gradient, and the noise still applies (finite)."""
    x, y = _masked_batch("masking", rng)
    mask = np.zeros(4, "float32")
    _, _, before, after = _pooled_step("masking", method, x, y, mask)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)
    _, _, before, after = _pooled_step("masking", method, x, y, mask, noise_multiplier=1.0)
    assert all(np.all(np.isfinite(a)) for a in after)
    assert any(np.any(a != b) for a, b in zip(after, before))


def test_real_row_fully_masked_still_fails_the_step(rng):
    """A REAL row that the model turns into NaN (all steps masked) fails the step with
    ``nonfinite="raise"``, and is dropped with ``"skip"``: only padding is neutralized."""
    x, y = _masked_batch("masking", rng)
    x[2] = 0.0  # a real row with every step masked: its pooled features are NaN
    mask = np.array([1, 1, 1, 0], "float32")
    with pytest.raises(tf.errors.InvalidArgumentError, match="NaN/Inf"):
        _pooled_step("masking", "fast", x, y, mask)
    skipped = _pooled_step("masking", "fast", x, y, mask, nonfinite="skip")
    _check_clipped_mean(*skipped, x, y, np.array([1, 1, 0, 0], "float32"))


@pytest.mark.slow
def test_whole_model_vectorized_path_with_masked_lstm(rng):
    """pfor cannot convert the masked LSTM's while loop (its ``TensorList`` ops); the attempt is
    traced in a graph of its own, so the ``map_fn`` fallback runs cleanly and is exact."""
    model = _masked_model(keras.layers.LSTM(3), "mask_zero")
    x, y = _masked_batch("mask_zero", rng)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    with pytest.warns(RuntimeWarning, match="map_fn"):
        got = dpcore.per_example_norms(
            model, loss, x, y, options=dpcore.ExecutionOptions(method="vectorized")
        )
    grads = reference_per_example_gradients(model, loss, x, y)
    want = np.sqrt(sum(np.sum(g.reshape(len(x), -1) ** 2, axis=1) for g in grads))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4)


def test_masking_is_honoured(rng):
    """The reference itself: a padded step's value does not change the masked model's output."""
    model = _masked_model(keras.layers.LSTM(3), "masking")
    x, _ = _masked_batch("masking", rng)
    x2 = x.copy()
    x2[1, 3:] = 0.0
    np.testing.assert_allclose(model(x), model(x2), rtol=1e-6)


def test_lstm_trains_through_make_private_fit(rng):
    """One sigma = 0 SGD(1.0) step of ``make_private(...).fit`` applies the exact clipped mean."""
    model = _masked_model(keras.layers.LSTM(3), "mask_zero")
    x, y = _masked_batch("mask_zero", rng, b=6)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    clip = 0.05  # small enough that every example is clipped
    grads = reference_per_example_gradients(model, loss, x, y)
    norms = np.sqrt(sum(np.sum(g.reshape(len(x), -1) ** 2, axis=1) for g in grads))
    assert np.all(norms > clip)
    _check_one_fit_step(model, loss, x, y, clip=clip)
