"""Parameter averaging (the inner optimizer's EMA) under DP training: values, evaluation, saving."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dpcore
from dpcore.optimizer import DPOptimizer
from dpcore.step import dp_train_step

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
MOMENTUM = 0.8


def small_model(seed=0):
    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer=init)])


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


def test_custom_loop_ema_is_the_average_of_applied_logical_steps(rng):
    x, y = data(rng)
    model, opt = small_model(), ema_opt(accumulation_steps=2)

    @tf.function
    def step(x, y):
        return dp_train_step(model, LOSS, x, y, optimizer=opt)

    trajectory = []
    for i in range(0, 32, 4):
        step(x[i : i + 4], y[i : i + 4])
        if i % 8 == 4:  # a logical step (two micro-batches) ended: the weights moved
            trajectory.append([v.numpy().copy() for v in model.trainable_variables])
    assert int(opt.dp_steps) == len(trajectory) == 4
    for got, want in zip(averages(opt), hand_ema(trajectory)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    opt.finalize_variable_values(model.trainable_variables)
    for v, want in zip(model.trainable_variables, hand_ema(trajectory)):
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-6, atol=1e-7)


def test_fit_evaluates_with_the_ema_and_saves_it(tmp_path, rng):
    x, y = data(rng)
    model = small_model()
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

    fresh_model, fresh = small_model(seed=1), ema_opt()
    fresh.build(fresh_model.trainable_variables)
    path = tf.train.Checkpoint(model=model, optimizer=dp_model.optimizer).save(str(tmp_path / "c"))
    tf.train.Checkpoint(model=fresh_model, optimizer=fresh).restore(path).assert_consumed()
    for got, want in zip(averages(fresh), ema):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
