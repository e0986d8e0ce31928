"""The slow exact reference is itself checked against closed forms and tape.jacobian."""

import keras
import numpy as np
import tensorflow as tf

from dpcore.testing import reference_input_gradients, reference_per_example_gradients


def test_reference_matches_linear_regression_closed_form(rng):
    # loss_i = 0.5 * (w.x_i + b - y_i)^2  =>  dw_i = r_i x_i, db_i = r_i
    layer = keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((3,)), layer])
    x = rng.normal(size=(6, 3)).astype("float32")
    y = rng.normal(size=(6, 1)).astype("float32")

    def loss(y_true, y_pred):
        return 0.5 * tf.reduce_sum(tf.square(y_pred - y_true), axis=-1)

    gw, gb = reference_per_example_gradients(model, loss, x, y)
    w, b = (v.numpy() for v in layer.weights)
    r = x @ w + b - y  # [B, 1]
    np.testing.assert_allclose(gw, r[:, :, None] * x[:, :, None], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gb, r, rtol=1e-5, atol=1e-6)
    # input gradients: d loss_i / d x_i = r_i w
    gx = reference_input_gradients(model, loss, x, y)
    np.testing.assert_allclose(gx, r * w[:, 0][None, :], rtol=1e-5, atol=1e-6)


def test_reference_matches_tape_jacobian(rng):
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)]
    )
    x = rng.normal(size=(7, 5)).astype("float32")
    y = rng.integers(0, 3, 7)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    ref = reference_per_example_gradients(model, loss, x, y)
    with tf.GradientTape(persistent=True) as tape:
        losses = loss(y, model(x))
    jac = tape.jacobian(losses, model.trainable_variables, experimental_use_pfor=False)
    for r, j in zip(ref, jac):
        np.testing.assert_allclose(r, j.numpy(), rtol=1e-5, atol=1e-6)
