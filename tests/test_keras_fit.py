"""make_private(...).fit on the MLP and CNN applies the reference DP-SGD update, and Keras's own
callbacks (TensorBoard) work in it. Also part of the oldest-TensorFlow smoke run (.ci/oldest)."""

import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import dpcore
from dpcore.testing import (
    reference_clipped_mean,
    reference_per_example_gradients,
    reference_per_example_norms,
)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(kind):
    init = keras.initializers.GlorotUniform(seed=0)
    if kind == "mlp":
        layers = [
            keras.Input((6, 6, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="tanh", kernel_initializer=init),
            keras.layers.Dense(3, kernel_initializer=init),
        ]
    else:
        layers = [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(4, 3, strides=2, activation="tanh", kernel_initializer=init),
            keras.layers.MaxPooling2D(2, strides=1),
            keras.layers.Flatten(),
            keras.layers.Dense(3, kernel_initializer=init),
        ]
    return keras.Sequential(layers)


def _data(n=12):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6, 6, 1)).astype("float32"), rng.integers(0, 3, n).astype("int32")


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_fit_step_is_the_reference_clipped_mean(kind):
    """One logical step over every example (q = 1, σ = 0): w <- w - lr * clipped sum / B."""
    x, y = _data()
    model = _model(kind)
    before = [v.numpy().copy() for v in model.trainable_variables]
    grads = reference_per_example_gradients(model, LOSS, x, y)
    clip = 0.5 * float(np.median(reference_per_example_norms(grads)))  # half the rows clipped
    expected = reference_clipped_mean(grads, l2_norm_clip=clip, expected_batch_size=len(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # σ = 0 is not private; this test checks clipping only
        dp_model = dpcore.make_private(
            model,
            optimizer=keras.optimizers.SGD(1.0),
            loss=LOSS,
            l2_norm_clip=clip,
            noise_multiplier=0.0,
            expected_batch_size=float(len(x)),
        )
        batches = dpcore.sampling.poisson_batches(x, y, sampling_prob=1.0, steps=1, seed=0)
        dp_model.fit(batches, verbose=0)
    assert int(dp_model.optimizer.dp_steps.numpy()) == 1
    for w0, w1, g in zip(before, model.trainable_variables, expected):
        np.testing.assert_allclose(w1.numpy(), w0 - g, rtol=1e-4, atol=1e-6)


def test_tensorboard_callback_logs_a_dp_fit(tmp_path):
    """keras.callbacks.TensorBoard needs the tensorboard package (the `experiments` and `test`
    extras install it) and logs the DP run's losses."""
    x, y = _data(32)
    config = dpcore.DPConfig(
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8,
        num_examples=len(x),
        steps=4,
        target_delta=1e-3,
    )
    dp_model = dpcore.make_private(
        _model("mlp"), config=config, optimizer=keras.optimizers.SGD(0.1), loss=LOSS
    )
    batches = dpcore.sampling.poisson_batches(
        x, y, sampling_prob=config.sampling_prob, steps=config.steps
    )
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path))
    dp_model.fit(batches, epochs=1, callbacks=[board], verbose=0)
    events = sorted((tmp_path / "train").glob("events.out.tfevents.*"))
    assert events, list(tmp_path.rglob("*"))
    tags, losses = set(), []
    for event in tf.compat.v1.train.summary_iterator(str(events[0])):
        for value in event.summary.value:
            tags.add(value.tag)
            if value.tag == "epoch_loss":
                losses.append(float(tf.make_ndarray(value.tensor)))
    assert "epoch_loss" in tags and len(losses) == 1 and math.isfinite(losses[0])
