"""make_private / DPModel: fit, evaluate and predict behave like Keras, with a DP train_step."""

import dataclasses
import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpcore.model import DPModel, make_private
from dpcore.optimizer import DPOptimizer
from tests.helpers import weights
from tests.models import TWO_REPLICA_DATA, small_mlp

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(rng, n=32):
    x = rng.normal(size=(n, 5)).astype("float32")
    return x, rng.integers(0, 3, n).astype("int32")


def test_fit_with_noise0_clip_inf_equals_plain_keras_fit(rng):
    x, y = data(rng)
    dp = make_private(
        small_mlp(),
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=LOSS,
        metrics=["accuracy"],
        l2_norm_clip=math.inf,
        noise_multiplier=0.0,
        expected_batch_size=8,
        sampling="shuffle",  # Keras's fixed-size batches, as the plain model trains on
    )
    plain = small_mlp()
    plain.compile(keras.optimizers.SGD(0.1, momentum=0.9), loss=LOSS, metrics=["accuracy"])
    h_dp = dp.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    h_plain = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    for a, b in zip(weights(dp.model), weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(h_dp["loss"], h_plain["loss"], rtol=1e-5)
    np.testing.assert_allclose(h_dp["accuracy"], h_plain["accuracy"])
    assert int(dp.optimizer.dp_steps) == 8
    # evaluate / predict behave as on the wrapped model
    ev_dp = dp.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    ev_plain = plain.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    np.testing.assert_allclose(ev_dp["loss"], ev_plain["loss"], rtol=1e-5)
    np.testing.assert_allclose(ev_dp["accuracy"], ev_plain["accuracy"])
    np.testing.assert_allclose(dp.predict(x, verbose=0), plain.predict(x, verbose=0), rtol=1e-5)


class TraceCounting(DPModel):
    """A DPModel that counts the traces of its train step."""

    traces = 0

    def train_step(self, data):
        self.traces += 1
        return super().train_step(data)


def padded_dataset(x, y, mask, step_end):
    return (
        tf.data.Dataset.from_tensor_slices((x, y, mask))
        .batch(8)
        .map(lambda a, b, m: (a, b, m, tf.constant(step_end)))
    )


def test_padding_rows_do_not_count_in_loss_metrics_or_update(rng):
    x, y = data(rng, 32)
    mask = (rng.random(32) < 0.6).astype("float32")
    x_pad, y_pad = x.copy(), y.copy()
    x_pad[mask == 0] = 100.0  # garbage padding that would dominate loss and gradients
    y_pad[mask == 0] = 0
    model = small_mlp()
    dp = make_private(
        model,
        optimizer=keras.optimizers.SGD(0.0),  # lr 0: metrics are all on the same weights
        loss=LOSS,
        metrics=["accuracy"],
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="w_acc")],
        l2_norm_clip=1.0,
        noise_multiplier=0.0,
        expected_batch_size=5,
    )
    history = dp.fit(padded_dataset(x_pad, y_pad, mask, True), epochs=1, verbose=0).history
    real = mask > 0
    logits = model.predict(x[real], verbose=0)
    ref_loss = float(np.mean(LOSS.call(y[real], logits)))
    ref_acc = float(np.mean(np.argmax(logits, 1) == y[real]))
    np.testing.assert_allclose(history["loss"][0], ref_loss, rtol=1e-5)
    np.testing.assert_allclose(history["accuracy"][0], ref_acc)
    np.testing.assert_allclose(history["w_acc"][0], ref_acc)
    ev = dp.evaluate(padded_dataset(x_pad, y_pad, mask, True), verbose=0, return_dict=True)
    np.testing.assert_allclose(ev["loss"], ref_loss, rtol=1e-5)
    np.testing.assert_allclose(ev["accuracy"], ref_acc)
    assert dp.predict(padded_dataset(x_pad, y_pad, mask, True), verbose=0).shape == (32, 3)
    assert int(dp.optimizer.dp_steps) == 4


def test_fit_accumulates_sampler_chunks_and_traces_once(rng):
    """Chunks with step_end False/True equal one step per pair of chunks; one trace."""
    x, y = data(rng, 32)
    mask = np.ones(32, "float32")
    ends = tf.data.Dataset.from_tensor_slices([False, True]).repeat(2)
    chunked = tf.data.Dataset.zip(
        (tf.data.Dataset.from_tensor_slices((x, y, mask)).batch(8), ends)
    ).map(lambda b, e: (b[0], b[1], b[2], e))

    chunk_model = TraceCounting(small_mlp())
    chunk_model.compile(
        DPOptimizer(
            keras.optimizers.Adam(0.05),
            l2_norm_clip=0.5,
            noise_multiplier=0.0,
            expected_batch_size=16,
        ),
        loss=LOSS,
    )
    chunk_model.optimizer.build(chunk_model.trainable_variables)
    chunk_model.fit(chunked, epochs=3, verbose=0)
    assert chunk_model.traces == 1
    assert int(chunk_model.optimizer.dp_steps) == 6

    big = make_private(
        small_mlp(),
        optimizer=keras.optimizers.Adam(0.05),
        loss=LOSS,
        l2_norm_clip=0.5,
        noise_multiplier=0.0,
        expected_batch_size=16,
        sampling="shuffle",  # the same fixed batches of 16 as the chunks
    )
    big.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    for a, b in zip(weights(chunk_model.model), weights(big.model)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_fit_traces_its_step_once_without_a_built_optimizer(rng):
    """fit creates the optimizer's variables before tracing: a first trace that created them
    would be followed by a second one, both held in memory."""
    x, y = data(rng, 32)

    dp = TraceCounting(small_mlp())
    dp.compile(
        DPOptimizer(
            keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=0.5, expected_batch_size=8
        ),
        loss=LOSS,
    )
    assert not dp.optimizer.built
    dp.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert dp.traces == 1
    assert int(dp.optimizer.dp_steps) == 8


def test_all_padding_batch_is_a_noise_only_step(rng):
    x, y = data(rng, 8)
    model = small_mlp()
    dp = make_private(
        model,
        optimizer="sgd",
        loss=LOSS,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8,
        seed=3,
    )
    before = weights(model)
    history = dp.fit(padded_dataset(x, y, np.zeros(8, "float32"), True), verbose=0).history
    assert history["loss"] == [0.0]
    assert int(dp.optimizer.dp_steps) == 1
    assert any(np.any(a != b) for a, b in zip(before, weights(model)))


def test_make_private_argument_errors():
    model = small_mlp()
    with pytest.raises(ValueError, match="noise_multiplier, expected_batch_size"):
        make_private(model, optimizer="sgd", loss=LOSS, l2_norm_clip=1.0)
    opt = DPOptimizer("sgd", l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=4)
    with pytest.raises(ValueError, match="noise_multiplier=2.0 conflicts"):
        make_private(model, optimizer=opt, loss=LOSS, noise_multiplier=2.0)
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
        make_private(
            model,
            optimizer="sgd",
            loss=LOSS,
            l2_norm_clip=1.0,
            noise_multiplier=-1.0,
            expected_batch_size=4,
        )
    with pytest.raises(TypeError, match="DPOptimizer"):
        DPModel(model).compile(optimizer="sgd", loss=LOSS)
    with pytest.raises(ValueError, match="loss=None"):
        make_private(model, optimizer=opt, loss=None)


def test_make_private_reads_a_config_object():
    class Config:
        l2_norm_clip = 0.7
        noise_multiplier = 1.2
        expected_batch_size = 64.0
        accumulation_steps = 1

    dp = make_private(small_mlp(), optimizer="adam", loss=LOSS, config=Config(), seed=1)
    opt = dp.optimizer
    assert (opt.l2_norm_clip, opt.noise_multiplier, opt.expected_batch_size) == (0.7, 1.2, 64.0)
    assert isinstance(opt.inner_optimizer, keras.optimizers.Adam)


def test_make_private_refuses_batch_norm_naming_the_layer():
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4), keras.layers.BatchNormalization(name="bn")],
        name="net",
    )
    with pytest.raises(ValueError, match=r"net/bn.*GroupNormalization"):
        make_private(
            model,
            optimizer="sgd",
            loss=LOSS,
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            expected_batch_size=4,
        )


def test_plain_model_compiled_with_dp_optimizer_refuses_to_train(rng):
    x, y = data(rng, 8)
    model = small_mlp()
    model.compile(
        DPOptimizer("sgd", l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=8),
        loss=LOSS,
    )
    with pytest.raises(ValueError, match="make_private"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_labels_are_required(rng):
    x, _ = data(rng, 8)
    dp = make_private(
        small_mlp(),
        optimizer="sgd",
        loss=LOSS,
        l2_norm_clip=1.0,
        noise_multiplier=0.0,
        expected_batch_size=8,
    )
    with pytest.raises(ValueError, match="needs labels"):
        dp.fit(x, batch_size=8, verbose=0)


@pytest.mark.slow
def test_keras_file_round_trip_keeps_optimizer_state(rng, tmp_path):
    x, y = data(rng, 16)
    dp = make_private(
        small_mlp(),
        optimizer=keras.optimizers.Adam(0.01),
        loss=LOSS,
        metrics=["accuracy"],
        l2_norm_clip=1.0,
        noise_multiplier=0.5,
        expected_batch_size=8,
    )
    dp.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "dp.keras")
    dp.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, DPModel) and isinstance(loaded.optimizer, DPOptimizer)
    np.testing.assert_array_equal(
        loaded.optimizer.noise_seed.numpy(), dp.optimizer.noise_seed.numpy()
    )
    assert int(loaded.optimizer.dp_steps) == 2
    np.testing.assert_allclose(loaded.predict(x, verbose=0), dp.predict(x, verbose=0), rtol=1e-6)


def test_fit_over_sampler_epochs_draws_fresh_samples_and_counts_every_step(rng):
    """fit(ds, epochs=3) on the Poisson sampler: 3 x steps noisy steps, each on a new sample."""
    from dpcore import sampling
    from dpcore.callbacks import EpsilonCallback
    from dpcore.config import DPConfig

    x, y = data(rng, 40)
    steps = 4
    config = DPConfig(
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=10,
        num_examples=40,
        steps=steps,
        target_delta=1e-3,
    )
    ds = sampling.poisson_batches(x, y, sampling_prob=config.sampling_prob, steps=steps, seed=5)
    epochs = [[tuple(xb.numpy()[m.numpy() > 0, 0]) for xb, _, m, _ in ds] for _ in range(2)]
    assert epochs[0] != epochs[1]  # a second pass is a new sample, not a replay
    dp = make_private(small_mlp(), config=config, optimizer="sgd", loss=LOSS, seed=1)
    callback = EpsilonCallback(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no spurious "input ran out of data"
        history = dp.fit(ds, epochs=3, callbacks=[callback], verbose=0).history
    assert int(dp.optimizer.dp_steps) == 3 * steps
    assert callback.ledger.steps == 3 * steps
    assert history["epsilon"][-1] == pytest.approx(
        dataclasses.replace(config, steps=3 * steps).epsilon()
    )


_REPLICA_FIT_SCRIPT = (
    TWO_REPLICA_DATA
    + """

def build():
    init = keras.initializers.GlorotUniform(seed=0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, kernel_initializer=init)])
    return dpcore.make_private(
        model, optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        l2_norm_clip=0.5, noise_multiplier=1.0, expected_batch_size=16, metrics=["accuracy"],
        seed=3)


def train(dp):
    logs = dp.fit(data, verbose=0).history
    ev = dp.evaluate(data, verbose=0, return_dict=True)
    weights = [np.asarray(v.numpy()) for v in dp.model.trainable_variables]
    return weights, logs, ev, int(dp.optimizer.dp_steps.numpy())


single = train(build())
with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
    two = build()
multi = train(two)
err = max(float(np.abs(a - b).max()) for a, b in zip(single[0], multi[0]))
moved = float(np.abs(single[0][0] - build().model.trainable_variables[0].numpy()).max())
print("RESULT", err, moved, P := elements[0][2].shape[0], single[3], multi[3],
      single[1]["loss"][-1], multi[1]["loss"][-1],
      single[1]["accuracy"][-1], multi[1]["accuracy"][-1],
      single[2]["loss"], multi[2]["loss"])
"""
)


@pytest.mark.slow
@pytest.mark.replica_script(_REPLICA_FIT_SCRIPT)
def test_fit_on_sampler_batches_under_two_replicas_matches_one_device(replica_run):
    """The sampler's 4-tuples split across 2 replicas (padded to an even size): same noisy
    update, step count, loss and metrics as on one device."""
    lines = [line for line in replica_run["stdout"].splitlines() if line.startswith("RESULT")]
    assert lines, replica_run["error"][-3000:]
    err, moved, rows, steps1, steps2, *logs = (float(v) for v in lines[0].split()[1:])
    assert rows % 2 == 1  # the uneven split is exercised
    assert moved > 0.05  # training (with noise) did change the weights
    assert err < 1e-6
    assert steps1 == steps2 == 6
    for one, two in zip(logs[0::2], logs[1::2]):
        assert one == pytest.approx(two, rel=1e-6)
