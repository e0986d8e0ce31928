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
from tests.models import keras_divides_activity_penalty

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(kind, activity=False):
    """The MLP or CNN; with ``activity``, activity regularizers (L2, L1L2, L1) on three layers."""
    init = keras.initializers.GlorotUniform(seed=0)
    regs = [None, None, None]
    if activity:
        regs = [
            keras.regularizers.L2(0.05),
            keras.regularizers.L1L2(0.02, 0.01),
            keras.regularizers.L1(0.03),
        ]
    if kind == "mlp":
        layers = [
            keras.Input((6, 6, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(
                8, activation="tanh", kernel_initializer=init, activity_regularizer=regs[0]
            ),
            keras.layers.Activation("relu", activity_regularizer=regs[1]),
            keras.layers.Dense(3, kernel_initializer=init, activity_regularizer=regs[2]),
        ]
    else:
        layers = [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(
                4,
                3,
                strides=2,
                activation="tanh",
                kernel_initializer=init,
                activity_regularizer=regs[0],
            ),
            keras.layers.MaxPooling2D(2, strides=1, activity_regularizer=regs[1]),
            keras.layers.Flatten(),
            keras.layers.Dense(3, kernel_initializer=init, activity_regularizer=regs[2]),
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


@pytest.mark.parametrize("labels", ["sparse", "one_hot"])
def test_class_weight_on_sampler_batches_weights_each_row_by_its_class(labels):
    """fit(poisson_batches(...), class_weight=...) weights every row's loss by its class before
    clipping, as fit on arrays does; a label with no class weight fails the step."""
    x, y = _data()
    class_weight = {0: 0.5, 1: 2.0, 2: 1.0}
    model = _model("mlp")
    before = [v.numpy().copy() for v in model.trainable_variables]
    y_fed, loss = y, LOSS
    if labels == "one_hot":
        y_fed = np.eye(3, dtype="float32")[y]
        loss = keras.losses.CategoricalCrossentropy(from_logits=True)
    weights = np.array([class_weight[int(c)] for c in y], "float32")
    grads = reference_per_example_gradients(model, loss, x, y_fed, sample_weight=weights)
    clip = 0.5 * float(np.median(reference_per_example_norms(grads)))
    expected = reference_clipped_mean(grads, l2_norm_clip=clip, expected_batch_size=len(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # σ = 0 is not private; this test checks the weights only
        dp_model = dpcore.make_private(
            model,
            optimizer=keras.optimizers.SGD(1.0),
            loss=loss,
            l2_norm_clip=clip,
            noise_multiplier=0.0,
            expected_batch_size=float(len(x)),
        )
        batches = dpcore.sampling.poisson_batches(x, y_fed, sampling_prob=1.0, steps=1, seed=0)
        dp_model.fit(batches, class_weight=class_weight, verbose=0)
        for w0, w1, g in zip(before, model.trainable_variables, expected):
            np.testing.assert_allclose(w1.numpy(), w0 - g, rtol=1e-4, atol=1e-6)
        after = [v.numpy().copy() for v in model.trainable_variables]
        with pytest.raises(ValueError, match="not a class of class_weight"):
            dp_model.fit(batches, class_weight={0: 1.0, 1: 1.0}, verbose=0)
        with pytest.raises(ValueError, match="keys must be the classes 0 .. K-1"):
            dp_model.fit(batches, class_weight={0: 1.0, 2: 1.0}, verbose=0)
    for w0, w1 in zip(after, model.trainable_variables):
        np.testing.assert_array_equal(w1.numpy(), w0)


@pytest.mark.parametrize("method", ["fast", "vectorized"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_activity_regularized_fit_step_is_keras_and_the_reference_clipped_mean(kind, method):
    """With activity regularizers, a step with nothing clipped is plain Keras's step on the same
    batch, and a step that clips is the reference clipped mean of the gradients of each
    example's loss plus its penalties. A Keras that adds the whole batch's penalty undivided is
    refused before any update."""
    x, y = _data()
    options = dpcore.ExecutionOptions(method=method)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # σ = 0 is not private; this test checks the update only
        if not keras_divides_activity_penalty():
            model = _model(kind, activity=True)
            before = [v.numpy().copy() for v in model.trainable_variables]
            dp_model = dpcore.make_private(
                model,
                optimizer=keras.optimizers.SGD(1.0),
                loss=LOSS,
                l2_norm_clip=1.0,
                noise_multiplier=0.0,
                expected_batch_size=float(len(x)),
                options=options,
            )
            batches = dpcore.sampling.poisson_batches(x, y, sampling_prob=1.0, steps=1, seed=0)
            with pytest.raises(ValueError, match="without dividing it by the batch size"):
                dp_model.fit(batches, verbose=0)
            for w0, w1 in zip(before, model.trainable_variables):
                np.testing.assert_array_equal(w1.numpy(), w0)
            return

        plain = _model(kind, activity=True)
        plain.compile(optimizer=keras.optimizers.SGD(1.0), loss=LOSS)
        plain.fit(x, y, batch_size=len(x), shuffle=False, verbose=0)
        model = _model(kind, activity=True)
        before = [v.numpy().copy() for v in model.trainable_variables]
        grads = reference_per_example_gradients(model, LOSS, x, y)
        for clip in (1e9, 0.5 * float(np.median(reference_per_example_norms(grads)))):
            for v, w0 in zip(model.trainable_variables, before):
                v.assign(w0)
            dp_model = dpcore.make_private(
                model,
                optimizer=keras.optimizers.SGD(1.0),
                loss=LOSS,
                l2_norm_clip=clip,
                noise_multiplier=0.0,
                expected_batch_size=float(len(x)),
                options=options,
            )
            batches = dpcore.sampling.poisson_batches(x, y, sampling_prob=1.0, steps=1, seed=0)
            dp_model.fit(batches, verbose=0)
            expected = reference_clipped_mean(grads, l2_norm_clip=clip, expected_batch_size=len(x))
            for w0, w1, g in zip(before, model.trainable_variables, expected):
                np.testing.assert_allclose(w1.numpy(), w0 - g, rtol=1e-4, atol=1e-6)
            if clip == 1e9:
                for w1, w in zip(model.trainable_variables, plain.trainable_variables):
                    np.testing.assert_allclose(w1.numpy(), w.numpy(), rtol=1e-4, atol=1e-6)


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
