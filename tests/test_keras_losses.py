"""Keras's loss terms in the DP update: regularizers, add_loss, several outputs and loss_weights.

Plain Keras trains on ``compiled loss + sum(model.losses)``. The weight regularizers and the
``add_loss`` terms that are functions of the weights alone enter dpcore's update after the noise,
as Keras adds them; ``add_loss`` terms computed from the batch are refused. Activity
regularizers' penalties (Keras adds the batch's penalty divided by the batch size: the mean of
the examples' penalties) enter each example's loss before clipping; one that may not be a sum
over the rows is refused. A model with several outputs trains on Keras's weighted sum of its
outputs' losses, per example.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import dpcore
from dpcore import engine
from dpcore.losses import per_example_loss_fn, regularization
from dpcore.model import make_private
from dpcore.optimizer import DPOptimizer
from dpcore.testing import (
    reference_per_example_gradients,
    reference_per_example_norms,
    reference_unit_gradients,
)
from tests.models import divided_activity, keras_divides_activity_penalty

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")

METHODS = ["fast", "vectorized"]


def _tf_privacy_regularization_model():
    """TF Privacy's testRegularizationGradient set-up: the data loss is zero, only L2 acts."""
    inputs = keras.Input((10,))
    dense = keras.layers.Dense(
        1,
        kernel_initializer="ones",
        use_bias=False,
        kernel_regularizer=keras.regularizers.L2(0.025),
    )
    return keras.Model(inputs, keras.ops.multiply(dense(inputs), 0.0))


def _tf_privacy_batch():
    x = np.arange(20, dtype="float32").reshape(2, 10)
    return x, np.zeros((2, 1), "float32")


@pytest.mark.parametrize("method", METHODS)
def test_kernel_regularizer_enters_the_update_as_in_tf_privacy(method):
    # TF Privacy's testRegularizationGradient: one SGD(1.0) step, sigma 0, a clip nothing reaches;
    # the L2 gradient 2 * 0.025 * 1 moves every kernel entry from 1 to 0.95, as plain Keras does.
    x, y = _tf_privacy_batch()
    model = _tf_privacy_regularization_model()
    dp = make_private(
        model,
        optimizer=keras.optimizers.SGD(1.0),
        loss=keras.losses.MeanSquaredError(),
        l2_norm_clip=1e9,
        noise_multiplier=0.0,
        expected_batch_size=2,
        options=dpcore.ExecutionOptions(method=method),
    )
    history = dp.fit(x, y, batch_size=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), np.full((10, 1), 0.95))
    # Keras's logged loss holds the penalty too: 0.025 * 10 at the weights before the step.
    np.testing.assert_allclose(history["loss"], [0.25], rtol=1e-6)

    custom = _tf_privacy_regularization_model()
    optimizer = DPOptimizer(
        keras.optimizers.SGD(1.0), l2_norm_clip=1e9, noise_multiplier=0.0, expected_batch_size=2
    )
    optimizer.build(custom.trainable_variables)

    @tf.function
    def step(x, y):
        return dpcore.dp_train_step(
            custom,
            keras.losses.MeanSquaredError(reduction=None),
            x,
            y,
            optimizer=optimizer,
            options=dpcore.ExecutionOptions(method=method),
        )

    np.testing.assert_allclose(float(step(x, y)), 0.25, rtol=1e-6)
    np.testing.assert_allclose(custom.trainable_variables[0].numpy(), np.full((10, 1), 0.95))


def test_regularization_is_added_once_per_logical_step():
    # Two micro-batches of one row make one logical step: one L2 step (0.95), not two (0.9).
    x, y = _tf_privacy_batch()
    model = _tf_privacy_regularization_model()
    optimizer = DPOptimizer(
        keras.optimizers.SGD(1.0),
        l2_norm_clip=1e9,
        noise_multiplier=0.0,
        expected_batch_size=2,
        accumulation_steps=2,
    )
    optimizer.build(model.trainable_variables)
    step = tf.function(lambda x, y: dpcore.dp_train_step(model, "mse", x, y, optimizer=optimizer))
    step(x[:1], y[:1])
    np.testing.assert_array_equal(model.trainable_variables[0].numpy(), np.ones((10, 1)))
    step(x[1:], y[1:])
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), np.full((10, 1), 0.95))


class WeightPenalty(keras.layers.Layer):
    """Scales its inputs by a weight vector and adds an L2 penalty of that vector (add_loss)."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        self.add_loss(0.03 * keras.ops.sum(keras.ops.square(self.w - 0.5)))
        return x * self.w


class BatchPenalty(keras.layers.Layer):
    """add_loss of the batch's activations: a function of the data."""

    def call(self, x):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.square(x)))
        return x


class BatchSizePenalty(keras.layers.Layer):
    """add_loss of the weights scaled by the number of rows: the batch size is data too."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        rows = keras.ops.cast(keras.ops.shape(x)[0], "float32")
        self.add_loss(0.01 * rows * keras.ops.sum(keras.ops.square(self.w)))
        return x * self.w


def two_outputs(penalty=WeightPenalty, *, as_dict, regularized=True, seed=0):
    init = keras.initializers.GlorotUniform(seed=seed)
    reg = keras.regularizers.L2(0.01) if regularized else None
    inputs = keras.Input((4,))
    h = keras.layers.Dense(
        5, activation="tanh", kernel_initializer=init, kernel_regularizer=reg, name="h"
    )(inputs)
    if penalty is not None:
        h = penalty(name="penalty")(h)
    a = keras.layers.Dense(3, kernel_initializer=init, name="a")(h)
    b = keras.layers.Dense(
        2,
        kernel_initializer=init,
        bias_regularizer=keras.regularizers.L1(0.02) if regularized else None,
        name="b",
    )(h)
    return keras.Model(inputs, {"a": a, "b": b} if as_dict else [a, b])


LOSSES = {"a": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "b": "mse"}
LOSS_WEIGHTS = {"a": 1.0, "b": 0.5}


def two_output_batch(rng, n=8):
    x = rng.normal(size=(n, 4)).astype("float32")
    y = {"a": rng.integers(0, 3, n).astype("int32"), "b": rng.normal(size=(n, 2)).astype("float32")}
    return x, y


def _weights(model):
    return [v.numpy().copy() for v in model.trainable_variables]


@pytest.mark.parametrize("as_dict", [False, True], ids=["list_outputs", "dict_outputs"])
@pytest.mark.parametrize("method", METHODS)
def test_sigma0_update_equals_plain_keras_with_regularizers_and_weighted_outputs(
    method, as_dict, rng
):
    # Nothing is clipped (C = 1e9) and sigma = 0, so one step is plain Keras's step: the weighted
    # outputs' losses, the kernel and bias regularizers and the weights' add_loss term all count.
    # The run must take the requested path whole (no fallback warning from the mixing probe).
    x, y = two_output_batch(rng)
    sample_weight = rng.uniform(0.5, 2.0, 8).astype("float32")
    # Keras copies one sample_weight array to every output; list outputs take list labels.
    labels = y if as_dict else [y["a"], y["b"]]
    plain = two_outputs(as_dict=as_dict)
    plain.compile(keras.optimizers.SGD(0.1), loss=LOSSES, loss_weights=LOSS_WEIGHTS)
    before = _weights(plain)
    h_plain = plain.fit(
        x, labels, sample_weight=sample_weight, batch_size=8, shuffle=False, verbose=0
    ).history

    model = two_outputs(as_dict=as_dict)
    dp = make_private(
        model,
        optimizer=keras.optimizers.SGD(0.1),
        loss=LOSSES,
        loss_weights=LOSS_WEIGHTS,
        l2_norm_clip=1e9,
        noise_multiplier=0.0,
        expected_batch_size=8,
        options=dpcore.ExecutionOptions(method=method),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        h_dp = dp.fit(
            x, labels, sample_weight=sample_weight, batch_size=8, shuffle=False, verbose=0
        ).history
    for got, want, start in zip(_weights(model), _weights(plain), before):
        assert np.abs(want - start).max() > 1e-3  # the step moved every variable
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # The total and each output's loss as Keras logs them, plus the epsilon spent.
    assert set(h_plain) == {"loss", "a_loss", "b_loss"}
    assert set(h_dp) == set(h_plain) | {"epsilon"}
    for key in h_plain:
        np.testing.assert_allclose(h_dp[key], h_plain[key], rtol=1e-6)

    # The same step in a custom loop.
    custom = two_outputs(as_dict=as_dict)
    optimizer = DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=1e9, noise_multiplier=0.0, expected_batch_size=8
    )
    optimizer.build(custom.trainable_variables)
    loss_fn = per_example_loss_fn(
        LOSSES, loss_weights=LOSS_WEIGHTS, output_names=custom.output_names
    )

    @tf.function
    def step(x, y):
        return dpcore.dp_train_step(
            custom,
            loss_fn,
            x,
            y,
            optimizer=optimizer,
            sample_weight=sample_weight,
            options=dpcore.ExecutionOptions(method=method),
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        loss = step(x, y)
    np.testing.assert_allclose(float(loss), h_plain["loss"][0], rtol=1e-6)
    for got, want in zip(_weights(custom), _weights(plain)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _keras_per_example_gradients(model, x, y, sample_weight, key=None):
    """Each example's gradient of Keras's own compiled loss on that example alone (with
    ``model.losses`` of the call); ``key`` names the one entry of ``y`` for a single output."""
    out = [np.zeros((len(x), *v.shape), np.float32) for v in model.trainable_variables]
    for i in range(len(x)):
        yi = {k: v[i : i + 1] for k, v in y.items()}
        if key is not None:
            yi = yi[key]
        with tf.GradientTape() as tape:
            value = model.compute_loss(
                x=x[i : i + 1],
                y=yi,
                y_pred=model(x[i : i + 1], training=True),
                sample_weight=sample_weight[i : i + 1],
            )
        for k, g in enumerate(tape.gradient(value, model.trainable_variables)):
            out[k][i] = g.numpy()
    return out


@pytest.mark.parametrize("as_dict", [False, True], ids=["list_outputs", "dict_outputs"])
def test_two_output_per_example_gradients_equal_the_references(as_dict, rng):
    # Both engine paths against the slow reference (dpcore.testing) and against Keras's own
    # compiled loss (outputs' losses weighted and summed) on one example at a time.
    x, y = two_output_batch(rng, n=6)
    sample_weight = rng.uniform(0.5, 2.0, 6).astype("float32")
    mask = np.array([1, 1, 0, 1, 1, 1], "float32")
    model = two_outputs(None, as_dict=as_dict, regularized=False)
    loss_fn = per_example_loss_fn(
        LOSSES, loss_weights=LOSS_WEIGHTS, output_names=model.output_names
    )
    reference = reference_per_example_gradients(
        model, loss_fn, x, y, sample_weight=sample_weight, mask=mask, training=True
    )
    model.compile(loss=LOSSES, loss_weights=LOSS_WEIGHTS)
    keras_grads = _keras_per_example_gradients(model, x, y, sample_weight)
    for ref, kg in zip(reference, keras_grads):
        np.testing.assert_allclose(ref, kg * mask.reshape(-1, *[1] * (kg.ndim - 1)), atol=1e-6)

    variables = model.trainable_variables
    eye = tf.eye(6, dtype=tf.float32)

    @tf.function
    def one_hot_sums(method):
        summary = engine.summarize(
            model,
            loss_fn,
            x,
            y,
            sample_weight=sample_weight,
            mask=mask,
            options=dpcore.ExecutionOptions(method=method),
        )
        # Row i's clip weights select example i alone: its gradient, per variable.
        per_row = [
            summary.weighted_sum(tf.tile(eye[i][:, None], [1, len(variables)])) for i in range(6)
        ]
        return [tf.stack([row[k] for row in per_row]) for k in range(len(variables))]

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for method in METHODS:
            got = one_hot_sums(method)
            for g, ref in zip(got, reference):
                np.testing.assert_allclose(g.numpy(), ref, rtol=0, atol=1e-6)
        materialized = dpcore.per_example_gradients(
            model, loss_fn, x, y, sample_weight=sample_weight, mask=mask
        )
    for g, ref in zip(materialized, reference):
        np.testing.assert_allclose(np.asarray(g), ref, rtol=0, atol=1e-6)


def test_per_example_loss_of_several_outputs_is_keras_total_per_example(rng):
    x, y = two_output_batch(rng, n=5)
    model = two_outputs(None, as_dict=False, regularized=False)
    model.compile(loss=LOSSES, loss_weights=LOSS_WEIGHTS)
    y_pred = model(x)
    per_example = per_example_loss_fn(
        LOSSES, loss_weights=LOSS_WEIGHTS, output_names=model.output_names
    )(y, y_pred).numpy()
    alone = [
        float(
            model.compute_loss(
                x=x[i : i + 1],
                y={k: v[i : i + 1] for k, v in y.items()},
                y_pred=model(x[i : i + 1]),
            )
        )
        for i in range(5)
    ]
    np.testing.assert_allclose(per_example, alone, rtol=1e-6)
    np.testing.assert_allclose(
        per_example.mean(), float(model.compute_loss(x=x, y=y, y_pred=y_pred)), rtol=1e-6
    )
    # A list of losses and of weights in output order is the same loss.
    as_list = per_example_loss_fn(
        [LOSSES["a"], LOSSES["b"]], loss_weights=[1.0, 0.5], output_names=None
    )
    np.testing.assert_allclose(as_list([y["a"], y["b"]], y_pred).numpy(), per_example, rtol=1e-6)
    with pytest.raises(ValueError, match="not outputs of the model"):
        per_example_loss_fn({"a": "mse", "c": "mse"}, output_names=["a", "b"])(y, y_pred)


@pytest.mark.parametrize(
    "penalty", [BatchPenalty, BatchSizePenalty], ids=["of_the_inputs", "of_the_batch_size"]
)
def test_add_loss_of_the_batch_is_refused(penalty, rng):
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.integers(0, 3, 8).astype("int32")

    def one_output():
        return keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(5), penalty(), keras.layers.Dense(3)]
        )

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dp = make_private(
        one_output(),
        optimizer=keras.optimizers.SGD(0.1),
        loss=loss,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8,
    )
    before = _weights(dp.model)
    with pytest.raises(ValueError, match="add_loss that depends on the batch"):
        dp.fit(x, y, batch_size=8, verbose=0)
    for got, want in zip(_weights(dp.model), before):
        np.testing.assert_array_equal(got, want)

    model = one_output()
    optimizer = DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=8
    )
    with pytest.raises(ValueError, match="add_loss that depends on the batch"):
        tf.function(lambda x, y: dpcore.dp_train_step(model, loss, x, y, optimizer=optimizer))(x, y)


class Scale(keras.layers.Layer):
    """Scales its inputs by a weight vector (no engine rule: the fast path's per-layer fallback)."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w


def _activity_model(kind, regularizer=None):
    init = keras.initializers.GlorotUniform(seed=0)
    if kind == "dense":
        inputs = keras.Input((4,))
        h = keras.layers.Dense(
            5,
            activation="tanh",
            kernel_initializer=init,
            activity_regularizer=regularizer or keras.regularizers.L2(0.3),
            name="act",
        )(inputs)
        h = keras.layers.Activation(
            "relu", activity_regularizer=keras.regularizers.L1(0.2), name="relu"
        )(h)
        h = Scale(activity_regularizer=keras.regularizers.L2(0.4), name="scale")(h)
    else:
        inputs = keras.Input((6, 6, 2))
        h = keras.layers.Conv2D(
            3,
            3,
            activation="tanh",
            kernel_initializer=init,
            activity_regularizer=regularizer or keras.regularizers.L1L2(0.05, 0.2),
            name="act",
        )(inputs)
        h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(
        3,
        kernel_initializer=init,
        activity_regularizer=keras.regularizers.L1L2(0.1, 0.05),
        name="out",
    )(h)
    return keras.Model(inputs, outputs)


def _activity_batch(kind, rng, n=6):
    shape = (4,) if kind == "dense" else (6, 6, 2)
    return rng.normal(size=(n, *shape)).astype("float32"), rng.integers(0, 3, n).astype("int32")


@divided_activity
@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_activity_penalties_enter_each_examples_loss_on_every_path(kind, rng):
    # Example i's loss is its weighted loss plus its own outputs' penalties, unweighted: what
    # Keras's compiled loss plus model.losses is on that example alone. Both engine paths, the
    # materialized gradients and units of two rows agree with the one-at-a-time reference.
    x, y = _activity_batch(kind, rng)
    sample_weight = rng.uniform(0.5, 2.0, 6).astype("float32")
    sample_weight[1] = 0.0  # Keras still adds this example's penalties
    mask = np.array([1, 1, 0, 1, 1, 1], "float32")
    model = _activity_model(kind)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = reference_per_example_gradients(
        model, loss, x, y, sample_weight=sample_weight, mask=mask
    )
    model.compile(loss=loss)
    keras_grads = _keras_per_example_gradients(model, x, {"y": y}, sample_weight, key="y")
    for ref, kg in zip(reference, keras_grads):
        np.testing.assert_allclose(ref, kg * mask.reshape(-1, *[1] * (kg.ndim - 1)), atol=1e-6)
    assert np.abs(reference[0][1]).max() > 1e-3  # the penalties' gradient at zero weight

    variables = model.trainable_variables
    eye = tf.eye(6, dtype=tf.float32)

    @tf.function
    def one_hot_sums(method):
        summary = engine.summarize(
            model,
            loss,
            x,
            y,
            sample_weight=sample_weight,
            mask=mask,
            options=dpcore.ExecutionOptions(method=method),
        )
        per_row = [
            summary.weighted_sum(tf.tile(eye[i][:, None], [1, len(variables)])) for i in range(6)
        ]
        sums = [tf.stack([row[k] for row in per_row]) for k in range(len(variables))]
        return sums, summary.per_example_loss

    norms = reference_per_example_norms(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # each path runs whole
        for method in METHODS:
            sums, per_example_loss = one_hot_sums(method)
            for g, ref in zip(sums, reference):
                np.testing.assert_allclose(g.numpy(), ref, rtol=0, atol=1e-6)
            got = dpcore.per_example_norms(
                model,
                loss,
                x,
                y,
                sample_weight=sample_weight,
                mask=mask,
                options=dpcore.ExecutionOptions(method=method),
            )
            np.testing.assert_allclose(got.numpy(), norms, rtol=1e-5)
            alone = [
                float(
                    model.compute_loss(x=x[i : i + 1], y=y[i : i + 1], y_pred=model(x[i : i + 1]))
                )
                - float(loss(y[i : i + 1], model(x[i : i + 1]))) * (1 - sample_weight[i])
                for i in range(6)
            ]
            np.testing.assert_allclose(per_example_loss.numpy(), np.array(alone) * mask, rtol=1e-5)
        materialized = dpcore.per_example_gradients(
            model, loss, x, y, sample_weight=sample_weight, mask=mask
        )
        for g, ref in zip(materialized, reference):
            np.testing.assert_allclose(np.asarray(g), ref, rtol=0, atol=1e-6)
        units = reference_unit_gradients(
            model, loss, x, y, group_size=2, group_reduction="mean", mask=mask
        )
        for method in METHODS:
            options = dpcore.ExecutionOptions(method=method, group_size=2, group_reduction="mean")
            got = dpcore.per_example_norms(model, loss, x, y, mask=mask, options=options)
            np.testing.assert_allclose(got.numpy(), reference_per_example_norms(units), rtol=1e-5)


class _SubclassedL2(keras.regularizers.L2):
    def __call__(self, x):
        return super().__call__(keras.ops.mean(x, axis=0))


@pytest.mark.parametrize(
    "regularizer",
    [
        lambda h: 0.1 * keras.ops.sum(keras.ops.square(keras.ops.mean(h, axis=0))),
        _SubclassedL2(0.1),
    ],
    ids=["callable", "subclass"],
)
def test_activity_regularizer_that_may_mix_examples_is_refused(regularizer, rng):
    x, y = _activity_batch("dense", rng, n=8)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = _activity_model("dense", regularizer)
    dp = make_private(
        model,
        optimizer=keras.optimizers.SGD(0.1),
        loss=loss,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8,
    )
    before = _weights(model)
    message = r"layer '.*act' has activity_regularizer=.* keras\.regularizers\.L1, L2 or L1L2"
    with pytest.raises(ValueError, match=message):
        dp.fit(dpcore.sampling.poisson_batches(x, y, sampling_prob=1.0, steps=1), verbose=0)
    for got, want in zip(_weights(model), before):
        np.testing.assert_array_equal(got, want)
    for method in METHODS:
        with pytest.raises(ValueError, match=message):
            dpcore.per_example_norms(
                model, loss, x, y, options=dpcore.ExecutionOptions(method=method)
            )
    assert model.get_layer("act").activity_regularizer is regularizer  # left as it was


@divided_activity
def test_activity_regularizer_on_an_output_without_rows_first_is_refused(rng):
    # Keras would divide the penalty of a transposed output by its feature count, and its rows
    # are positions, not examples: no example's share can be read from it.
    x, y = _activity_batch("dense", rng, n=8)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8),
            keras.layers.Lambda(
                keras.ops.transpose,
                activity_regularizer=keras.regularizers.L2(0.1),
                name="transposed",
            ),
            keras.layers.Lambda(keras.ops.transpose),
            keras.layers.Dense(3),
        ]
    )
    for method in METHODS:
        with pytest.raises(
            ValueError, match="'.*transposed' has an activity_regularizer on an out"
        ):
            dpcore.per_example_norms(
                model, loss, x, y, options=dpcore.ExecutionOptions(method=method)
            )


@divided_activity
@pytest.mark.parametrize("method", METHODS)
def test_activity_penalty_of_huge_activations_is_clipped(method, rng):
    # One record with inputs of 1e4 makes activations, penalties and gradients of ~1e8 and more:
    # adding it to a batch moves the sigma-0 update by at most C / expected_batch_size.
    x, y = _activity_batch("dense", rng, n=5)
    x[4] = 1e4
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    init = keras.initializers.GlorotUniform(seed=0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(
                5, kernel_initializer=init, activity_regularizer=keras.regularizers.L2(0.3)
            ),
            keras.layers.Dense(3, kernel_initializer=init),
        ]
    )
    clip = 0.3
    optimizer = DPOptimizer(
        keras.optimizers.SGD(1.0), l2_norm_clip=clip, noise_multiplier=0.0, expected_batch_size=1
    )
    optimizer.build(model.trainable_variables)
    start = _weights(model)
    reference = reference_per_example_gradients(model, loss, x[4:], y[4:])
    assert reference_per_example_norms(reference)[0] > 1e6 * clip  # far beyond the bound
    step = tf.function(
        lambda x, y: dpcore.dp_train_step(
            model, loss, x, y, optimizer=optimizer, options=dpcore.ExecutionOptions(method=method)
        )
    )
    updates = []
    for rows in (slice(0, 4), slice(0, 5)):
        for v, w in zip(model.trainable_variables, start):
            v.assign(w)
        step(x[rows], y[rows])
        updates.append(np.concatenate([(w - v).ravel() for v, w in zip(_weights(model), start)]))
    moved = np.linalg.norm(updates[1] - updates[0])
    assert clip * 0.999 < moved <= clip * (1 + 1e-5)


class NonNegative(keras.layers.Layer):
    """Passes its inputs on, failing on a negative one (as a model of counts or images might)."""

    def call(self, x):
        tf.debugging.assert_non_negative(x, message="inputs must be non-negative")
        return x


@pytest.mark.parametrize("penalty", [WeightPenalty, None], ids=["add_loss", "no_add_loss"])
def test_add_loss_that_cannot_be_evaluated_without_the_data_is_refused(penalty, rng):
    # The synthetic batch (normals) fails the model's own check: a weight-only add_loss term can
    # then be neither checked nor evaluated, and leaving it out would train another loss than
    # Keras's. Without add_loss terms nothing is left out and the model trains.
    x = np.abs(rng.normal(size=(8, 4))).astype("float32")
    y = rng.integers(0, 3, 8).astype("int32")
    layers = [keras.Input((4,)), NonNegative(), keras.layers.Dense(5)]
    layers += [penalty(name="penalty")] if penalty is not None else []
    model = keras.Sequential([*layers, keras.layers.Dense(3)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dp = make_private(
        model,
        optimizer=keras.optimizers.SGD(0.1),
        loss=loss,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8,
        options=dpcore.ExecutionOptions(method="vectorized"),
    )
    before = _weights(model)
    batches = dpcore.sampling.poisson_batches(x, y, sampling_prob=1.0, steps=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*add_loss")
        if penalty is None:
            dp.fit(batches, verbose=0)
            assert int(dp.optimizer.dp_steps) == 1
            return
        with pytest.raises(ValueError, match="adds losses with add_loss, and calling it on synth"):
            dp.fit(batches, verbose=0)
    for got, want in zip(_weights(model), before):
        np.testing.assert_array_equal(got, want)


def test_weight_only_terms_are_evaluated_without_the_data():
    # The add_loss term comes from a synthetic batch: its gradient is the same for any inputs.
    model = two_outputs(as_dict=True)
    reg = regularization(model, tf.zeros([8, 4]), training=True)
    assert reg is not None and reg.inputs is not None
    value, grads = reg.value_and_gradients(model.trainable_variables)
    penalty = model.get_layer("penalty").w.numpy()
    h_kernel = model.get_layer("h").kernel.numpy()
    b_bias = model.get_layer("b").bias.numpy()
    expected = (
        0.01 * np.sum(h_kernel**2)
        + 0.02 * np.sum(np.abs(b_bias))
        + 0.03 * np.sum((penalty - 0.5) ** 2)
    )
    np.testing.assert_allclose(float(value), expected, rtol=1e-6)
    by_path = {v.path: g for v, g in zip(model.trainable_variables, grads)}
    np.testing.assert_allclose(by_path[model.get_layer("penalty").w.path], 0.06 * (penalty - 0.5))
    assert by_path[model.get_layer("a").kernel.path] is None
    assert (
        regularization(
            two_outputs(None, as_dict=True, regularized=False), tf.zeros([8, 4]), training=True
        )
        is None
    )


def test_several_outputs_fit_on_sampler_batches_and_evaluate_as_keras(rng):
    # The sampler's batches build Keras's compiled loss and metrics from the element spec (list
    # outputs keyed by output name); evaluate reports Keras's loss, regularization included.
    x, y = two_output_batch(rng)
    model = two_outputs(as_dict=False)
    dp = make_private(
        model,
        optimizer=keras.optimizers.SGD(0.1),
        loss=LOSSES,
        loss_weights=LOSS_WEIGHTS,
        metrics={"a": ["accuracy"]},
        l2_norm_clip=1.0,
        noise_multiplier=0.5,
        expected_batch_size=4,
    )
    batches = dpcore.sampling.poisson_batches(x, y, sampling_prob=0.5, steps=3)
    history = dp.fit(batches, verbose=0).history
    assert set(history) == {"loss", "a_loss", "b_loss", "a_accuracy", "epsilon"}
    plain = two_outputs(as_dict=False)
    plain.compile(loss=LOSSES, loss_weights=LOSS_WEIGHTS, metrics={"a": ["accuracy"]})
    plain.set_weights(model.get_weights())
    want = plain.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    got = dp.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6)


def test_outputs_with_different_sample_weights_are_refused(rng):
    x, y = two_output_batch(rng)
    model = two_outputs(None, as_dict=True, regularized=False)
    optimizer = DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=0.0, expected_batch_size=8
    )
    optimizer.build(model.trainable_variables)
    before = _weights(model)
    step = tf.function(
        lambda sw: dpcore.dp_train_step(
            model, per_example_loss_fn(LOSSES), x, y, optimizer=optimizer, sample_weight=sw
        )
    )
    ones = np.ones(8, "float32")
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="sample weights of the outputs differ"
    ):
        step({"a": ones, "b": 2 * ones})
    for got, want in zip(_weights(model), before):
        np.testing.assert_array_equal(got, want)
    step({"a": ones, "b": ones})  # Keras's copies of one array
    assert int(optimizer.dp_steps) == 1


def test_evaluate_adds_the_losses_keras_adds_even_those_training_refuses(rng):
    # Evaluation is not private anyway: its loss is Keras's, activity and batch terms included;
    # training refuses the add_loss term of the batch.
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.integers(0, 3, 8).astype("int32")

    def model():
        init = keras.initializers.GlorotUniform(seed=0)
        return keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(
                    5,
                    kernel_initializer=init,
                    kernel_regularizer=keras.regularizers.L2(0.1),
                    activity_regularizer=keras.regularizers.L1(0.05),
                ),
                BatchPenalty(),
                keras.layers.Dense(3, kernel_initializer=init),
            ]
        )

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain = model()
    plain.compile(loss=loss)
    dp = make_private(
        model(),
        optimizer=keras.optimizers.SGD(0.1),
        loss=loss,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8,
    )
    want = plain.evaluate(x, y, batch_size=8, verbose=0)
    np.testing.assert_allclose(dp.evaluate(x, y, batch_size=8, verbose=0), want, rtol=1e-6)
    refusal = (
        "add_loss that depends on the batch"
        if keras_divides_activity_penalty()
        else "adds its penalty of the whole batch without dividing it"
    )
    with pytest.raises(ValueError, match=refusal):
        dp.fit(x, y, batch_size=8, verbose=0)
