"""Parameter averaging (the inner optimizer's EMA) under DP training: values, evaluation, saving."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dpcore
from dpcore.optimizer import DPOptimizer
from dpcore.step import dp_train_step
from tests.models import TWO_REPLICA_DATA, dense_model

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
MOMENTUM = 0.8


def ema_opt(**kw):
    kw.setdefault("accumulation_steps", 1)
    return DPOptimizer(
        keras.optimizers.SGD(0.5, use_ema=True, ema_momentum=MOMENTUM),
        l2_norm_clip=1.0,
        noise_multiplier=0.5,
        expected_batch_size=8,
        seed=0,
        **kw,
    )


def hand_ema(trajectory):
    """Keras's EMA: the first applied step's weights, then ``m * ema + (1 - m) * weights``."""
    ema = None
    for weights in trajectory:
        if ema is None:
            ema = [w.copy() for w in weights]
        else:
            ema = [MOMENTUM * e + (1 - MOMENTUM) * w for e, w in zip(ema, weights)]
    return ema


def averages(opt):
    return [v.numpy() for v in opt.inner_optimizer._model_variables_moving_average]


def data(rng, n=32):
    return rng.normal(size=(n, 4)).astype("float32"), rng.integers(0, 3, n).astype("int32")


class RecordWeights(keras.callbacks.Callback):
    def __init__(self, model):
        super().__init__()
        self.tracked, self.trajectory, self.at_epoch_end = model, [], []

    def on_train_batch_end(self, batch, logs=None):
        self.trajectory.append([v.numpy().copy() for v in self.tracked.trainable_variables])

    def on_epoch_end(self, epoch, logs=None):
        self.at_epoch_end.append(hand_ema(self.trajectory))


def loss_with(model, weights, x, y):
    saved = [v.numpy() for v in model.trainable_variables]
    for v, w in zip(model.trainable_variables, weights):
        v.assign(w)
    value = float(keras.ops.mean(LOSS(y, model(x))))
    for v, w in zip(model.trainable_variables, saved):
        v.assign(w)
    return value


def custom_loop(model, opt, x, y, after_step=None):
    """``dp_train_step`` on micro-batches of 4 rows, two per logical step (the optimizer has
    ``accumulation_steps=2``): the weights after each logical step. ``after_step(k)`` runs after
    logical step ``k``."""

    @tf.function
    def step(x, y):
        return dp_train_step(model, LOSS, x, y, optimizer=opt)

    trajectory = []
    for i in range(0, 32, 4):
        step(x[i : i + 4], y[i : i + 4])
        if i % 8 == 4:  # a logical step (two micro-batches) ended: the weights moved
            trajectory.append([v.numpy().copy() for v in model.trainable_variables])
            if after_step is not None:
                after_step(len(trajectory))
    return trajectory


def test_custom_loop_ema_is_the_average_of_applied_logical_steps(rng):
    x, y = data(rng)
    model, opt = dense_model(), ema_opt(accumulation_steps=2)
    trajectory = custom_loop(model, opt, x, y)
    assert int(opt.dp_steps) == len(trajectory) == 4
    for got, want in zip(averages(opt), hand_ema(trajectory)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    opt.finalize_variable_values(model.trainable_variables)
    for v, want in zip(model.trainable_variables, hand_ema(trajectory)):
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-6, atol=1e-7)


def test_fit_evaluates_with_the_ema_and_saves_it(tmp_path, rng):
    x, y = data(rng)
    model = dense_model()
    dp_model = dpcore.make_private(model, optimizer=ema_opt(), loss=LOSS)
    record = RecordWeights(model)
    history = dp_model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        validation_data=(x, y),
        callbacks=[record, keras.callbacks.SwapEMAWeights()],
        verbose=0,
    )
    ema = hand_ema(record.trajectory)
    assert len(record.trajectory) == int(dp_model.optimizer.dp_steps) == 8
    # Validation during fit used the EMA of that moment, not the raw weights.
    for val_loss, weights in zip(history.history["val_loss"], record.at_epoch_end):
        assert val_loss == pytest.approx(loss_with(model, weights, x, y), rel=1e-5)
        assert val_loss != pytest.approx(loss_with(model, record.trajectory[-1], x, y), rel=1e-5)
    # fit ends by writing the EMA into the model, so evaluate/predict use it afterwards.
    for v, want in zip(model.trainable_variables, ema):
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-6, atol=1e-7)
    assert dp_model.evaluate(x, y, verbose=0) == pytest.approx(loss_with(model, ema, x, y), 1e-5)

    dp_model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.inner_optimizer.use_ema
    for got, want in zip(averages(loaded.optimizer), ema):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    fresh_model, fresh = dense_model(seed=1), ema_opt()
    fresh.build(fresh_model.trainable_variables)
    path = tf.train.Checkpoint(model=model, optimizer=dp_model.optimizer).save(str(tmp_path / "c"))
    tf.train.Checkpoint(model=fresh_model, optimizer=fresh).restore(path).assert_consumed()
    for got, want in zip(averages(fresh), ema):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def polyak_opt(start, **kw):
    kw.setdefault("accumulation_steps", 1)
    return DPOptimizer(
        keras.optimizers.SGD(0.5),
        l2_norm_clip=1.0,
        noise_multiplier=0.5,
        expected_batch_size=8,
        seed=0,
        polyak_start_step=start,
        **kw,
    )


def mean_of(trajectory):
    return [np.mean(np.stack(ws), axis=0) for ws in zip(*trajectory)]


def test_custom_loop_polyak_is_the_mean_of_the_logical_steps_after_the_start(rng):
    x, y = data(rng)
    model, opt = dense_model(), polyak_opt(1, accumulation_steps=2)
    start = [v.numpy().copy() for v in model.trainable_variables]

    def after_step(k):
        if k == 1:  # step 1 is not past the start: nothing averaged, finalize changes nothing
            assert opt.polyak_count == 0
            before = [v.numpy().copy() for v in model.trainable_variables]
            opt.finalize_variable_values(model.trainable_variables)
            for v, w in zip(model.trainable_variables, before):
                np.testing.assert_array_equal(v.numpy(), w)

    trajectory = custom_loop(model, opt, x, y, after_step)
    assert int(opt.dp_steps) == len(trajectory) == 4 and opt.polyak_count == 3
    want = mean_of(trajectory[1:])
    for got, w, w0 in zip(opt.polyak_averages, want, start):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-6, atol=1e-7)
        assert not np.allclose(w, w0)  # the weights moved: the average is not trivially right
    opt.finalize_variable_values(model.trainable_variables)
    for v, w in zip(model.trainable_variables, want):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-6, atol=1e-7)


def test_fit_evaluates_with_the_polyak_average_and_saves_it(tmp_path, rng):
    x, y = data(rng)
    model = dense_model()
    dp_model = dpcore.make_private(model, optimizer=polyak_opt(2), loss=LOSS)
    record = RecordWeights(model)
    means = []

    class AtEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            means.append(mean_of(record.trajectory[2:]))

    history = dp_model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        validation_data=(x, y),
        callbacks=[record, AtEpochEnd(), dpcore.callbacks.SwapPolyakWeights()],
        verbose=0,
    )
    opt = dp_model.optimizer
    assert len(record.trajectory) == int(opt.dp_steps) == 8 and opt.polyak_count == 6
    # Validation during fit used the average of that moment (steps 3.. so far), not the weights.
    for val_loss, weights in zip(history.history["val_loss"], means):
        assert val_loss == pytest.approx(loss_with(model, weights, x, y), rel=1e-5)
        assert val_loss != pytest.approx(loss_with(model, record.trajectory[-1], x, y), rel=1e-5)
    # fit ends by writing the average into the model.
    want = mean_of(record.trajectory[2:])
    for v, w in zip(model.trainable_variables, want):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-6, atol=1e-7)

    dp_model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.polyak_start_step == 2 and loaded.optimizer.polyak_count == 6
    for got, w in zip(loaded.optimizer.polyak_averages, want):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-6, atol=1e-7)

    fresh_model, fresh = dense_model(seed=1), polyak_opt(2)
    fresh.build(fresh_model.trainable_variables)
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "c"))
    tf.train.Checkpoint(model=fresh_model, optimizer=fresh).restore(path).assert_consumed()
    assert fresh.polyak_count == 6
    for got, w in zip(fresh.polyak_averages, want):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("start", [-1, 1.5, True, "3"])
def test_polyak_start_step_is_checked(start):
    with pytest.raises(ValueError, match="polyak_start_step"):
        polyak_opt(start)


def test_polyak_and_ema_are_not_combined():
    with pytest.raises(ValueError, match="choose one"):
        DPOptimizer(
            keras.optimizers.SGD(0.5, use_ema=True),
            l2_norm_clip=1.0,
            noise_multiplier=0.5,
            expected_batch_size=8,
            polyak_start_step=0,
        )


def test_swap_polyak_weights_needs_the_average(rng):
    x, y = data(rng)
    dp_model = dpcore.make_private(dense_model(), optimizer=ema_opt(), loss=LOSS)
    with pytest.raises(ValueError, match="polyak_start_step"):
        dp_model.fit(x, y, batch_size=8, callbacks=[dpcore.callbacks.SwapPolyakWeights()])


_REPLICA_POLYAK_SCRIPT = (
    TWO_REPLICA_DATA
    + """

def build():
    init = keras.initializers.GlorotUniform(seed=0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, kernel_initializer=init)])
    opt = dpcore.DPOptimizer(keras.optimizers.SGD(0.5), l2_norm_clip=0.5, noise_multiplier=1.0,
                             expected_batch_size=16, seed=3, polyak_start_step=2)
    return dpcore.make_private(model, optimizer=opt,
                               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def train(dp):
    dp.fit(data, verbose=0)
    averages = [np.asarray(v.numpy()) for v in dp.optimizer.polyak_averages]
    weights = [np.asarray(v.numpy()) for v in dp.model.trainable_variables]
    return averages, weights, dp.optimizer.polyak_count


single = train(build())
with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
    two = build()
multi = train(two)
err = max(float(np.abs(a - b).max()) for a, b in zip(single[0] + single[1], multi[0] + multi[1]))
final = max(float(np.abs(a - b).max()) for a, b in zip(single[0], single[1]))
print("RESULT", err, final, single[2], multi[2])
"""
)


@pytest.mark.slow
@pytest.mark.replica_script(_REPLICA_POLYAK_SCRIPT)
def test_polyak_under_two_replicas_matches_one_device(replica_run):
    """Under MirroredStrategy (2 replicas) the average counts each logical step once and equals
    one device's; fit ends with it in the model."""
    lines = [line for line in replica_run["stdout"].splitlines() if line.startswith("RESULT")]
    assert lines, replica_run["error"][-3000:]
    err, final, count1, count2 = (float(v) for v in lines[0].split()[1:])
    assert count1 == count2 == 4  # steps 3..6
    assert err < 1e-6
    assert final == 0.0  # the model holds the average after fit
