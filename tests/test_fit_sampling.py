"""make_private(...).fit samples by itself: the sampling that runs is the one accounted for.

Arrays and unbatched examples get fit's own Poisson sampler (the SamplingSpec of
poisson_batches, q = expected_batch_size / N, steps_for_epochs(1) steps per epoch); fixed-size
batches are opted into with sampling="shuffle"; everything else is refused before a step. The
sampler's epochs have a known length in logical steps, and augment_fn is checked by values.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dpcore
from dpcore import sampling
from dpcore.accounting import steps_for_epochs
from dpcore.callbacks import EpsilonCallback
from dpcore.config import DPConfig
from dpcore.model import check_augment_fn_rows

N, B = 68, 3.0  # N / B = 22.67: 23 steps per epoch, 69 for three epochs
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(n=N):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def _config(**kw):
    base = dict(
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=B,
        num_examples=N,
        steps=69,
        target_delta=1e-3,
    )
    return DPConfig(**{**base, **kw})


def _private(config=None, **kw):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    return dpcore.make_private(
        model,
        optimizer=keras.optimizers.SGD(0.1),
        loss=LOSS,
        config=_config() if config is None else config,
        **kw,
    )


class _Recorder(keras.callbacks.Callback):
    """Keras's epoch length as its progress bar sees it, and the optimizer's steps per epoch."""

    def __init__(self):
        super().__init__()
        self.steps_param, self.steps_at_epoch_end = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps_param.append(self.params.get("steps"))

    def on_epoch_end(self, epoch, logs=None):
        self.steps_at_epoch_end.append(int(self.model.optimizer.dp_steps))


@pytest.mark.parametrize("callbacks", [False, True])
@pytest.mark.parametrize("feed", ["arrays", "examples"])
def test_fit_on_arrays_and_examples_runs_the_configs_poisson_sampling(feed, callbacks):
    """A Poisson config and fit(x, y, epochs=3): Keras's shuffled batches of 32 ran while the
    config reported the Poisson epsilon. Now fit runs poisson_batches at the config's q for
    steps_for_epochs(1) steps per epoch, 69 steps in all, the config's steps, with its epoch
    length known from the first epoch; EpsilonCallback accounts exactly those steps."""
    x, y = _data()
    config = _config()
    dp = _private(config)
    recorder = _Recorder()
    cbs = [recorder] + ([EpsilonCallback(config)] if callbacks else [])
    data = (x, y) if feed == "arrays" else (tf.data.Dataset.from_tensor_slices((x, y)),)
    dp.fit(*data, epochs=3, verbose=0, callbacks=cbs)
    spec = dp.sampling_spec
    assert spec is not None
    assert (spec.sampling, spec.num_examples, spec.steps) == ("poisson", N, 23)
    assert spec.sampling_prob == config.sampling_prob and spec.expected_batch_size == B
    assert spec.padded_batch_size == sampling.padded_batch_size_for(N, sampling_prob=B / N)
    spec.check_config(config)  # what EpsilonCallback checks: the accounted sampling ran
    assert steps_for_epochs(1, num_examples=N, expected_batch_size=B) * 3 == 69
    assert int(dp.optimizer.dp_steps) == 69 == config.steps
    assert recorder.steps_param == [23, 23, 23]  # a total from the first epoch on
    assert recorder.steps_at_epoch_end == [23, 46, 69]
    if callbacks:
        assert cbs[1].epsilon() == pytest.approx(config.epsilon(), rel=1e-6)


def test_fits_own_samples_are_poisson_samples():
    """The realized batches of fit's own sampler are Poisson samples at q (sizes vary around
    q * N, every example can be drawn at every step): fixed-size batches would give B each."""
    x, y = _data(400)
    config = _config(num_examples=400, expected_batch_size=40.0, steps=10)
    dp = _private(config, run_eagerly=True)
    sizes, seen = [], []
    original = dp.train_step

    def train_step(data):
        sizes.append(int(tf.reduce_sum(data.mask)))
        seen.append(data.x.numpy()[data.mask.numpy() > 0])
        return original(data)

    dp.train_step = train_step
    dp.fit(x, y, epochs=3, verbose=0)
    assert len(sizes) == 30 and int(dp.optimizer.dp_steps) == 30
    assert len(set(sizes)) > 3 and 30 <= np.mean(sizes) <= 50
    rows = np.concatenate(seen)
    # Each step's rows are distinct examples of x (a sample without replacement).
    for step_rows in seen:
        assert len({r.tobytes() for r in step_rows}) == len(step_rows)
    known = {r.tobytes() for r in x}
    assert all(r.tobytes() in known for r in rows)


@pytest.mark.parametrize("callbacks", [False, True])
def test_batched_data_without_a_spec_is_refused_under_poisson(callbacks):
    """fit(tf.data...batch(64)) with a Poisson config trained on fixed-size batches with no
    word unless EpsilonCallback was attached; now fit refuses it itself, naming both ways out."""
    x, y = _data()
    config = _config()
    dp = _private(config)
    cbs = [EpsilonCallback(config)] if callbacks else []
    batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(3)
    with pytest.raises(ValueError, match="unbatched.*poisson_batches.*sampling='shuffle'"):
        dp.fit(batched, epochs=1, verbose=0, callbacks=cbs)
    assert int(dp.optimizer.dp_steps) == 0


@pytest.mark.parametrize("callbacks", [False, True])
def test_a_batch_size_that_contradicts_expected_batch_size_is_refused(callbacks):
    """expected_batch_size=3 and fit(batch_size=10) trained on batches of 10 divided by 3 with
    no word; now refused under both samplings, naming both ways out."""
    x, y = _data()
    for config in (_config(), _config(sampling="shuffle")):
        dp = _private(config)
        cbs = [EpsilonCallback(config)] if callbacks else []
        with pytest.raises(ValueError, match=r"batch_size=10.*expected_batch_size=3.*sampling="):
            dp.fit(x, y, batch_size=10, epochs=1, verbose=0, callbacks=cbs)
        assert int(dp.optimizer.dp_steps) == 0
    # Repeating the expected batch size is not a contradiction.
    dp = _private(_config())
    dp.fit(x, y, batch_size=3, epochs=1, verbose=0)
    assert dp.sampling_spec.sampling == "poisson" and int(dp.optimizer.dp_steps) == 23


def test_the_data_size_must_be_the_configs():
    """q = expected_batch_size / N: fit on another N than the config's (fewer rows, or rows
    split off by validation_split) would sample at another q than the one accounted."""
    x, y = _data()
    dp = _private()
    with pytest.raises(ValueError, match=r"fit got 40 training examples.*num_examples=68"):
        dp.fit(x[:40], y[:40], epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"fit got 54 training examples.*num_examples=68"):
        dp.fit(x, y, validation_split=0.2, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="num_examples=68"):
        dp.fit(sampling.poisson_batches(x[:40], y[:40], sampling_prob=3 / 40, steps=2), verbose=0)
    assert int(dp.optimizer.dp_steps) == 0
    # Without a config, N is the rows fit trains on (after the split).
    free = dpcore.make_private(
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]),
        optimizer="sgd",
        loss=LOSS,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=B,
    )
    history = free.fit(x, y, validation_split=0.25, epochs=1, verbose=0)
    assert free.sampling_spec.num_examples == 51 and "val_loss" in history.history
    assert free.sampling_spec.sampling_prob == B / 51


def test_fixed_size_batches_are_opted_into_and_accounted_as_such():
    """sampling="shuffle" on the config: Keras's shuffled batches of expected_batch_size (its
    default batch_size), and EpsilonCallback reports the no-amplification bound."""
    x, y = _data(60)
    config = _config(num_examples=60, expected_batch_size=6.0, sampling="shuffle", steps=20)
    dp = _private(config)
    assert dp.sampling == "shuffle"
    eps = EpsilonCallback(config)
    recorder = _Recorder()
    dp.fit(x, y, epochs=2, verbose=0, callbacks=[eps, recorder])
    assert recorder.steps_param == [10, 10] and int(dp.optimizer.dp_steps) == 20
    assert dp.sampling_spec is None and dp.data_feed == "arrays"
    assert eps.epsilon() == pytest.approx(config.epsilon(), rel=1e-6)
    # Batched data of the configured size trains as given.
    dp.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(6), verbose=0)
    with pytest.raises(ValueError, match=r"\[4\] rows.*is 6"):
        dp.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4, drop_remainder=True))
    with pytest.raises(ValueError, match="conflicts with config.sampling"):
        _private(config, sampling="poisson")


def test_sample_and_class_weights_travel_with_the_sampled_rows():
    """fit's sampler carries each row's weight: all-zero weights (noise-free) leave the model
    unchanged, and the sampled rows' weights are those of their examples."""
    x, y = _data()
    config = _config(noise_multiplier=0.0)
    for weights in (
        {"sample_weight": np.zeros(N, "float32")},
        {"class_weight": dict.fromkeys(range(3), 0.0)},
    ):
        dp = _private(config)
        before = [v.numpy() for v in dp.trainable_variables]
        dp.fit(x, y, epochs=1, verbose=0, **weights)
        assert int(dp.optimizer.dp_steps) == 23
        for b, v in zip(before, dp.trainable_variables):
            np.testing.assert_array_equal(b, v.numpy())
    dp = _private(config, run_eagerly=True)
    seen = []
    original = dp.train_step

    def train_step(data):
        keep = data.mask.numpy() > 0
        seen.append((data.x.numpy()[keep][:, 0], data.y.sample_weight.numpy()[keep]))
        return original(data)

    dp.train_step = train_step
    dp.fit(x, y, sample_weight=np.arange(N, dtype="float32"), epochs=1, verbose=0)
    for first_feature, weight in seen:
        np.testing.assert_array_equal(x[weight.astype(int), 0], first_feature)
    with pytest.raises(ValueError, match=r"class_weight has no weight for class\(es\) \[2\]"):
        dp.fit(x, y, class_weight={0: 1.0, 1: 2.0}, verbose=0)


def test_fit_refuses_what_its_poisson_sampler_cannot_carry():
    x, y = _data()
    accumulating = _private(_config(accumulation_steps=3))
    with pytest.raises(ValueError, match="accumulation_steps=3.*sampling='shuffle'"):
        accumulating.fit(x, y, verbose=0)
    assert int(accumulating.optimizer.dp_steps) == 0


def test_a_sampler_epoch_has_its_length_in_logical_steps():
    """The first epoch over poisson_batches showed 1/Unknown .. 17/Unknown. Keras now knows
    spec.steps logical steps per epoch (overflow chunks do not count: a train-function call
    runs whole steps), every epoch is a fresh pass and ends at a step boundary."""
    x, y = _data(40)
    dp = _private(_config(num_examples=40, expected_batch_size=20.0, steps=6))
    # Padded size 5 for an expected 20: every step is several chunks.
    data = sampling.poisson_batches(x, y, sampling_prob=0.5, steps=3, padded_batch_size=5)
    recorder = _Recorder()
    dp.fit(data, epochs=2, verbose=0, callbacks=[recorder])
    assert recorder.steps_param == [3, 3]
    assert recorder.steps_at_epoch_end == [3, 6]
    assert sampling.passes_started(data) == 2
    assert int(dp.optimizer.micro_steps) == 0


# ------------------------------------------------------------------------------ augment_fn


def _standardize_with_batch_statistics(t):
    """A common way to write it: the batch's mean and std, held constant for the gradient."""
    mean = tf.stop_gradient(tf.reduce_mean(t, 0, keepdims=True))
    std = tf.stop_gradient(tf.math.reduce_std(t, 0, keepdims=True))
    return (t - mean) / (std + 1e-6)


def _copy_a_token_from_the_next_example(t):
    return tf.concat([tf.roll(t, -1, axis=0)[:, :1], t[:, 1:]], axis=1)


def test_a_stop_gradient_batch_standardization_is_refused():
    """augmentations=2 with a batch standardization under tf.stop_gradient was accepted (the
    gradient probe saw zero) and moved the clipped sum by 3.47 C; refused now, by values."""
    x, y = _data()
    dp = _private(augmentations=2, augment_fn=_standardize_with_batch_statistics)
    with pytest.raises(ValueError, match="mixes examples.*batch statistics|mixes examples"):
        dp.fit(x, y, epochs=1, verbose=0)
    assert int(dp.optimizer.dp_steps) == 0
    with pytest.raises(ValueError, match="per-example statistics.*training set"):
        check_augment_fn_rows(
            _standardize_with_batch_statistics, tf.TensorSpec([None, 4], tf.float32), 2
        )


def test_an_augment_fn_on_integer_tokens_that_copies_across_examples_is_refused():
    """No floating input: the gradient probe returned without a check, and a token copied from
    another example moved the clipped sum by 2.05 C. Integer inputs are probed by values too."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, (N, 6)).astype("int32")
    y = rng.integers(0, 3, N).astype("int32")
    model = keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(50, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )
    dp = dpcore.make_private(
        model,
        optimizer="sgd",
        loss=LOSS,
        config=_config(),
        augment_fn=_copy_a_token_from_the_next_example,
    )
    with pytest.raises(ValueError, match="mixes examples"):
        dp.fit(tokens, y, epochs=1, verbose=0)
    assert int(dp.optimizer.dp_steps) == 0
    for spec in (tf.TensorSpec([None, 6], tf.int32), tf.TensorSpec([None, 6], tf.int64)):
        with pytest.raises(ValueError, match="mixes examples"):
            check_augment_fn_rows(_copy_a_token_from_the_next_example, spec, 1)
    # In a dict, next to a floating leaf that it leaves alone.
    specs = {"ids": tf.TensorSpec([None, 6], tf.int32), "w": tf.TensorSpec([None, 2], tf.float32)}
    with pytest.raises(ValueError, match="mixes examples"):
        check_augment_fn_rows(
            lambda d: {"ids": _copy_a_token_from_the_next_example(d["ids"]), "w": d["w"]}, specs, 2
        )
    check_augment_fn_rows(lambda d: {"ids": d["ids"][:, ::-1], "w": -d["w"]}, specs, 2)


def test_per_example_random_augmentations_are_accepted():
    """Random flips and crops drawn per example (TensorFlow ops, a Keras layer with its own
    generator) pass: the probe replays their draws; the user's generator state is unchanged."""
    flip = keras.layers.RandomFlip("horizontal", seed=3)
    state = np.array(flip.generator.state)

    def crop(t):  # a random 4x4 window of the 6x6 zero-padded image, per example
        offsets = tf.random.uniform([tf.shape(t)[0], 2], 0, 3, dtype=tf.int32)
        padded = tf.pad(t, [[0, 0], [1, 1], [1, 1], [0, 0]])
        return tf.map_fn(
            lambda a: tf.slice(a[0], [a[1][0], a[1][1], 0], [4, 4, 1]),
            (padded, offsets),
            fn_output_signature=t.dtype,
        )

    spec = tf.TensorSpec([None, 4, 4, 1], tf.float32)
    for augment in (
        lambda t: tf.image.random_flip_left_right(t),
        lambda t: flip(t, training=True),
        crop,
        lambda t: crop(tf.image.random_flip_up_down(t)),
    ):
        check_augment_fn_rows(augment, spec, 4)
    np.testing.assert_array_equal(np.array(flip.generator.state), state)
    x = np.random.default_rng(1).normal(size=(N, 4, 4, 1)).astype("float32")
    y = np.random.default_rng(2).integers(0, 3, N).astype("int32")
    model = keras.Sequential(
        [keras.Input((4, 4, 1)), keras.layers.Flatten(), keras.layers.Dense(3)]
    )
    dp = dpcore.make_private(
        model, optimizer="sgd", loss=LOSS, config=_config(), augmentations=2, augment_fn=crop
    )
    dp.fit(x, y, epochs=1, verbose=0)
    assert int(dp.optimizer.dp_steps) == 23


def test_an_augment_fn_whose_views_cannot_be_replayed_is_refused():
    """NumPy randomness at trace time gives other views of the same batch on every trace; the
    probe cannot tell whether they depend on other examples, so it refuses rather than skips."""
    with pytest.raises(ValueError, match="cannot be checked"):
        check_augment_fn_rows(
            lambda t: t * np.float32(np.random.rand()), tf.TensorSpec([None, 3], tf.float32), 1
        )
