"""Every training entry point validates the model the same way (issue 7, section 4).

``dp_step``/``dp_train_step`` (eager and inside ``tf.function``), ``engine.summarize`` (the source
of every ClippedSum given to ``DPOptimizer.apply_clipped_sum``) and ``DPModel`` refuse layers
that mix examples or update state from the batch, naming the layer path and a replacement, and
leave the model's variables untouched when they refuse.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpcore import engine, validation
from dpcore.optimizer import DPOptimizer
from dpcore.options import ExecutionOptions
from dpcore.step import dp_step, dp_train_step

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")

RNG = np.random.default_rng(0)
X = RNG.normal(size=(4, 3)).astype("float32")
Y = RNG.normal(size=(4, 1)).astype("float32")


def _optimizer() -> DPOptimizer:
    return DPOptimizer(
        keras.optimizers.SGD(0.1),
        l2_norm_clip=1.0,
        noise_multiplier=0.0,
        expected_batch_size=4,
        seed=0,
    )


class Counter(keras.layers.Layer):
    """Writes its own non-trainable variable from the batch in call (a batch-size counter)."""

    def build(self, shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False, name="seen")
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")

    def call(self, x):
        self.seen.assign_add(tf.cast(tf.shape(x)[0], self.seen.dtype))
        return x * self.w


class RunningMean(keras.layers.Layer):
    """Keeps a raw tf.Variable (untracked by Keras) of the batch mean, updated in call."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")
        self.mean = tf.Variable(tf.zeros(shape[-1:]), trainable=False)

    def call(self, x):
        def update():  # a data-dependent branch: the write sits in a cond body
            self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(x, axis=0))
            return tf.constant(0.0)

        tf.cond(tf.reduce_sum(x) > 0.0, update, lambda: tf.constant(0.0))
        return x * self.w


class BranchCounter(keras.layers.Layer):
    """Assigns its Keras variable inside a data-dependent branch (a cond body)."""

    def build(self, shape):
        self.hits = self.add_weight(shape=(), initializer="zeros", trainable=False, name="hits")
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")

    def call(self, x):
        def hit():
            self.hits.assign(self.hits + 1.0)
            return tf.constant(0.0)

        tf.cond(tf.reduce_max(x) > 1.0, hit, lambda: tf.constant(0.0))
        return x * self.w


class StaticBatch(keras.layers.Layer):
    """Needs a static batch size (fails to trace with an unknown one); updates nothing."""

    def call(self, x):
        return x + tf.zeros([x.shape[0], x.shape[1]])

    def compute_output_shape(self, shape):
        return shape


def _bn_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(1),
        ],
        name="bnnet",
    )


def _with(layer: keras.layers.Layer, name: str) -> keras.Model:
    return keras.Sequential([keras.Input((3,)), layer, keras.layers.Dense(1)], name=name)


def _snapshot(model: keras.Model) -> list[np.ndarray]:
    return [np.array(v) for v in model.variables]


def _assert_unchanged(model: keras.Model, before: list[np.ndarray]) -> None:
    for v, b in zip(model.variables, before):
        np.testing.assert_array_equal(np.array(v), b, err_msg=v.path)


def _entry_points(model, method):
    """Calls every public training entry point once on (X, Y)."""
    yield (
        "dp_step",
        lambda: dp_step(
            model, "mse", X, Y, optimizer=_optimizer(), options=ExecutionOptions(method=method)
        ),
    )
    opt = _optimizer()

    @tf.function
    def step(x, y):
        return dp_train_step(
            model, "mse", x, y, optimizer=opt, options=ExecutionOptions(method=method)
        )

    yield "dp_train_step", lambda: step(X, Y)
    yield (
        "summarize",
        lambda: engine.summarize(model, "mse", X, Y, options=ExecutionOptions(method=method)),
    )


@pytest.mark.parametrize("method", ["vectorized", "fast"])
def test_trainable_batch_norm_is_refused_by_every_entry_point(method):
    model = _bn_model()
    before = _snapshot(model)
    for entry, call in _entry_points(model, method):
        with pytest.raises(ValueError, match="bnnet/bn") as err:
            call()
        assert "GroupNormalization" in str(err.value), entry
        assert "LayerNormalization" in str(err.value), entry
    _assert_unchanged(model, before)  # moving statistics never saw the batch


@pytest.mark.parametrize("method", ["vectorized", "fast"])
def test_layer_writing_its_own_variable_from_the_batch_is_refused(method):
    model = _with(Counter(name="ctr"), "ctrnet")
    model(X)
    before = _snapshot(model)
    for entry, call in _entry_points(model, method):
        with pytest.raises(ValueError, match="update state") as err:
            call()
        message = str(err.value)
        assert "ctrnet/ctr (Counter)" in message and "seen" in message, entry
        assert "Normalization.adapt" in message, entry
    _assert_unchanged(model, before)


def test_raw_tf_variable_written_in_a_data_dependent_branch_is_refused():
    model = _with(RunningMean(name="running"), "rawnet")
    model(X)
    before = np.array(model.layers[0].mean)
    with pytest.raises(ValueError, match=r"update state[^$]*rawnet/running \(RunningMean\)"):
        dp_step(
            model,
            "mse",
            X,
            Y,
            optimizer=_optimizer(),
            options=ExecutionOptions(method="vectorized"),
        )
    np.testing.assert_array_equal(np.array(model.layers[0].mean), before)


def test_keras_variable_assigned_in_a_branch_is_refused():
    model = _with(BranchCounter(name="branchy"), "condnet")
    model(X)
    with pytest.raises(ValueError, match=r"condnet/branchy \(BranchCounter\).*hits"):
        engine.summarize(model, "mse", X, Y, options=ExecutionOptions(method="fast"))


def test_model_needing_a_static_batch_size_is_validated_and_trains():
    model = _with(StaticBatch(name="static"), "staticnet")
    kernel = np.array(model.layers[-1].kernel)
    dp_step(model, "mse", X, Y, optimizer=_optimizer(), options=ExecutionOptions(method="fast"))
    assert not np.allclose(np.array(model.layers[-1].kernel), kernel)


def test_dp_model_refuses_a_state_updating_layer_in_fit():
    import dpcore

    model = _with(Counter(name="ctr"), "ctrnet")
    model(X)
    dp = dpcore.DPModel(model)
    dp.compile(optimizer=_optimizer(), loss="mse")
    before = _snapshot(model)
    with pytest.raises(ValueError, match="ctrnet/ctr"):
        dp.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    _assert_unchanged(model, before)


@pytest.mark.parametrize("method", ["vectorized", "fast"])
def test_frozen_batch_norm_dropout_and_adapted_normalization_still_train(method):
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(RNG.normal(size=(32, 3)).astype("float32"))  # offline, on public data
    bn = keras.layers.BatchNormalization(name="bn")
    model = keras.Sequential(
        [keras.Input((3,)), norm, keras.layers.Dense(4), bn, keras.layers.Dropout(0.1)]
        + [keras.layers.Dense(1)],
        name="ok",
    )
    bn.trainable = False  # Keras 3: inference mode, per-example, no statistics update
    stats = [np.array(bn.moving_mean), np.array(bn.moving_variance), np.array(norm.mean)]
    opt = _optimizer()
    kernel = np.array(model.layers[-1].kernel)
    result = dp_step(model, "mse", X, Y, optimizer=opt, options=ExecutionOptions(method=method))
    assert np.isfinite(float(result.loss))
    assert not np.allclose(np.array(model.layers[-1].kernel), kernel)  # it trained
    after = [np.array(bn.moving_mean), np.array(bn.moving_variance), np.array(norm.mean)]
    for a, b in zip(stats, after):
        np.testing.assert_array_equal(a, b)
    # Toggling trainable is seen (the cache key holds the flags): the same model is refused now.
    bn.trainable = True
    with pytest.raises(ValueError, match="ok/bn"):
        dp_step(model, "mse", X, Y, optimizer=opt, options=ExecutionOptions(method=method))


def test_frozen_batch_norm_sum_moves_by_at_most_c_when_one_example_is_removed():
    bn = keras.layers.BatchNormalization(name="bn")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8), bn, keras.layers.Dense(1)])
    bn.trainable = False
    big_x = (100.0 * X).astype("float32")
    big_y = (100.0 * Y).astype("float32")

    def clipped_sum(mask):
        s = engine.summarize(
            model, "mse", big_x, big_y, mask=mask, options=ExecutionOptions(method="fast")
        )
        w = tf.minimum(1.0, 1.0 / tf.sqrt(tf.reduce_sum(s.sq_norms, axis=1) + 1e-30))
        w = tf.tile(w[:, None], [1, len(s.variables)])
        return np.concatenate([np.ravel(g) for g in s.weighted_sum(w)])

    full = clipped_sum(np.ones(4, "float32"))
    for i in range(4):
        mask = np.ones(4, "float32")
        mask[i] = 0.0
        assert np.linalg.norm(full - clipped_sum(mask)) <= 1.0 + 1e-5


def test_summarize_with_training_false_accepts_keras_batch_norm():
    model = _bn_model()
    before = _snapshot(model)
    summary = engine.summarize(
        model, "mse", X, Y, options=ExecutionOptions(training=False, method="vectorized")
    )
    assert summary.sq_norms.shape[0] == 4
    _assert_unchanged(model, before)


def test_validation_is_cached_per_structure(monkeypatch):
    model = _with(keras.layers.Dense(3, name="d"), "plain")
    model(X)
    calls = []
    real = validation._state_update_issues

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(validation, "_state_update_issues", counting)
    for batch in (X, X[:2], X):  # the batch size is not part of the key
        validation.check_model(model, batch)
    assert len(calls) == 1
    model.layers[0].trainable = False
    validation.check_model(model, X)
    assert len(calls) == 2
