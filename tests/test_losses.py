"""Per-example losses against Keras's own loss: the output mask of a masked sequence model.

Keras's ``compile``d loss (a ``keras.losses.Loss``, or a plain function or name that ``compile``
wraps) turns the output's Keras mask into 0/1 weights on the per-position losses and divides the
batch's sum by the number of unmasked positions in the whole batch. dpcore's per-example loss is
the masked sum over the example's own positions divided by the padded length ``T``: a function of
that example alone, whose batch mean is Keras's loss times ``N / (B T)``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpcore.losses import apply_output_mask, per_example_loss_fn

B, T, C = 4, 5, 2
LENGTHS = [5, 2, 0, 3]  # row 2 is fully masked


def _model():
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(7, 3, mask_zero=True)(inputs)
    return keras.Model(inputs, keras.layers.Dense(C)(h))  # [B, T, C], masked


def _batch(rng):
    x = rng.integers(1, 7, (B, T)).astype("int32")
    for i, n in enumerate(LENGTHS):
        x[i, n:] = 0
    y = rng.normal(size=(B, T, C)).astype("float32")
    return x, y


LOSSES = {
    "name": lambda: "mean_squared_error",
    "function": lambda: keras.losses.mean_squared_error,
    "instance": lambda: keras.losses.MeanSquaredError(),
    "instance_unreduced": lambda: keras.losses.MeanSquaredError(reduction=None),
}


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_output_mask_as_in_keras_compiled_loss(kind, rng):
    model = _model()
    x, y = _batch(rng)
    y_pred = model(x)
    mask = (x != 0).astype("float32")  # what Embedding(mask_zero=True) masks

    per_example = per_example_loss_fn(LOSSES[kind]())(y, y_pred).numpy()
    squared = np.mean((np.asarray(y_pred) - y) ** 2, axis=-1)  # [B, T]
    np.testing.assert_allclose(per_example, (squared * mask).sum(axis=1) / T, rtol=1e-6)
    assert per_example[2] == 0.0

    model.compile(loss=LOSSES[kind]() if kind != "instance_unreduced" else "mse")
    compiled = float(model.compute_loss(x=x, y=y, y_pred=y_pred))
    n = mask.sum()
    np.testing.assert_allclose(per_example.sum() * T / n, compiled, rtol=1e-5)


def test_per_example_loss_depends_on_the_example_alone(rng):
    model = _model()
    x, y = _batch(rng)
    loss_fn = per_example_loss_fn("mean_squared_error")
    batch = loss_fn(y, model(x)).numpy()
    alone = [loss_fn(y[i : i + 1], model(x[i : i + 1])).numpy()[0] for i in range(B)]
    np.testing.assert_allclose(batch, alone, rtol=1e-6)


def test_wrapping_twice_applies_the_mask_once(rng):
    model = _model()
    x, y = _batch(rng)
    once = per_example_loss_fn("mean_squared_error")
    assert per_example_loss_fn(once) is once
    np.testing.assert_allclose(once(y, model(x)), per_example_loss_fn(once)(y, model(x)))


def test_masked_position_with_a_non_finite_loss_contributes_zero():
    values = tf.constant([[1.0, np.nan], [np.inf, 2.0]])
    mask = tf.constant([[True, False], [False, True]])
    np.testing.assert_array_equal(apply_output_mask(values, mask), [[1.0, 0.0], [0.0, 2.0]])
    per_class = tf.ones([2, 2, 3])  # extra trailing axes are masked alike
    assert apply_output_mask(per_class, mask).numpy().sum() == 6.0


def test_loss_reduced_over_the_masked_axis_is_refused(rng):
    model = _model()
    x, y = _batch(rng)

    def per_example_only(y_true, y_pred):
        return tf.reduce_mean((y_true - y_pred) ** 2, axis=[1, 2])

    with pytest.raises(ValueError, match="Keras mask"):
        per_example_loss_fn(per_example_only)(y, model(x))
