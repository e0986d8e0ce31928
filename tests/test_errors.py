"""Errors a person can read: non-finite data, privacy arguments, and the σ = 0 warning."""

from __future__ import annotations

import math
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpcore import DPConfig, DPOptimizer, ExecutionOptions, dp_train_step, make_private, sampling
from dpcore_accounting import calibration

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
ROWS = 12
NOT_PRIVATE = "ignore:noise_multiplier=0:UserWarning"


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    y = rng.integers(0, 3, size=(ROWS,))
    return x, y


def _model(inputs=None):
    if inputs is None:
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    joined = keras.layers.Concatenate()(list(inputs.values()))
    return keras.Model(inputs, keras.layers.Dense(3)(joined))


def _private(model, **kw):
    # Every row in every step (q = 1), so the bad rows are seen whichever way fit batches.
    return make_private(
        model,
        optimizer=keras.optimizers.SGD(0.1),
        loss=LOSS,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=ROWS,
        seed=0,
        **kw,
    )


def _one_line(error, pattern):
    text = str(error.value)
    assert "\n" not in text, text
    assert text.startswith("dpcore: "), text
    assert pattern in text, text


def test_nan_in_x_is_one_line_naming_x_and_the_row_in_fit_evaluate_and_dp_train_step():
    """A NaN at row 3 of x (and another at row 7): fit and evaluate on arrays name x and the
    data's row 3 in a one-line ValueError (TensorFlow's graph error as its cause); dp_train_step
    eagerly raises the one-line sentence itself, and inside a tf.function TensorFlow's error
    ends with it. No weight changes."""
    x, y = _data()
    x[3, 2] = np.nan
    x[7, 0] = np.inf
    dp = _private(_model())
    before = [v.numpy() for v in dp.trainable_variables]
    with pytest.raises(ValueError) as fit_error:
        dp.fit(x, y, batch_size=ROWS, epochs=1, verbose=0)
    _one_line(fit_error, "NaN or Inf in x at row 3 of the data given to fit")
    assert isinstance(fit_error.value.__cause__, tf.errors.InvalidArgumentError)
    assert "nonfinite='skip'" in str(fit_error.value)
    with pytest.raises(ValueError) as evaluate_error:
        dp.evaluate(x, y, batch_size=5, verbose=0)
    _one_line(evaluate_error, "NaN or Inf in x at row 3 of the data given to evaluate")
    assert int(dp.optimizer.dp_steps) == 0
    for b, v in zip(before, dp.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())
    with pytest.raises(ValueError) as validation_error:
        dp.fit(np.nan_to_num(x), y, batch_size=ROWS, validation_data=(x, y), verbose=0)
    _one_line(validation_error, "NaN or Inf in x at row 3 of validation_data")

    model = _model()
    start = [v.numpy() for v in model.trainable_variables]
    opt = DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=4
    )
    opt.build(model.trainable_variables)
    with pytest.raises(tf.errors.InvalidArgumentError) as eager_error:
        dp_train_step(model, LOSS, x, y, optimizer=opt)
    _one_line(eager_error, "NaN or Inf in x at row 3 of the batch")
    step = tf.function(lambda x, y: dp_train_step(model, LOSS, x, y, optimizer=opt))
    with pytest.raises(tf.errors.InvalidArgumentError) as graph_error:
        step(x[2:], y[2:])
    assert "assertion failed: [dpcore: NaN or Inf in x at row 1 of the batch:" in str(
        graph_error.value
    )
    assert int(opt.dp_steps) == 0
    for b, v in zip(start, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())


@pytest.mark.parametrize("field", ["x['b']", "y", "sample_weight"])
def test_the_error_names_the_dict_key_labels_or_sample_weight(field):
    x, y = _data(1)
    inputs = {k: keras.Input((5,), name=k) for k in ("a", "b")}
    xs = {"a": x, "b": x.copy()}
    weights = np.ones(ROWS, "float32")
    if field == "x['b']":
        xs["b"][5, 1] = -np.inf
    elif field == "y":
        y = y.astype("float32")  # a float label can be NaN (the loss takes float labels)
        y[5] = np.nan
    else:
        weights[5] = np.nan
    dp = _private(_model(inputs))
    with pytest.raises(ValueError) as error:
        dp.fit(xs, y, sample_weight=weights, batch_size=ROWS, verbose=0)
    _one_line(error, f"NaN or Inf in {field} at row 5 of the data given to fit")
    # From a dataset the row in the data is unknown: the batch's row is named.
    data = tf.data.Dataset.from_tensor_slices((xs, y, weights)).batch(4)
    with pytest.raises(ValueError) as from_dataset:
        dp.evaluate(data, verbose=0)
    _one_line(from_dataset, f"NaN or Inf in {field} at row 1 of a batch")


def test_evaluate_skips_nonfinite_rows_under_skip_as_training_does():
    x, y = _data(2)
    bad = x.copy()
    bad[4] = np.nan
    dp = _private(_model(), options=ExecutionOptions(nonfinite="skip"))
    got = dp.evaluate(bad, y, batch_size=ROWS, verbose=0, return_dict=True)["loss"]
    keep = np.arange(ROWS) != 4
    want = dp.evaluate(x[keep], y[keep], batch_size=ROWS, verbose=0, return_dict=True)["loss"]
    assert np.isfinite(got)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ------------------------------------------------------------------------ privacy arguments
BAD = [None, math.nan, math.inf, -1.0, True, "1.0", [1.0]]
GOOD = {
    "l2_norm_clip": 1.0,
    "noise_multiplier": 1.1,
    "expected_batch_size": 10,
    "num_examples": 1000,
    "steps": 100,
    "target_delta": 1e-5,
    "target_epsilon": 2.0,
    "sampling_prob": 0.01,
    "accumulation_steps": 1,
}
ENTRIES = {
    "DPOptimizer": (
        ["l2_norm_clip", "noise_multiplier", "expected_batch_size", "accumulation_steps"],
        lambda kw: DPOptimizer(keras.optimizers.SGD(0.1), **kw),
    ),
    "make_private": (
        ["l2_norm_clip", "noise_multiplier", "expected_batch_size", "accumulation_steps"],
        lambda kw: make_private(_model(), optimizer="sgd", loss=LOSS, **kw),
    ),
    "DPConfig": (
        [
            "l2_norm_clip",
            "noise_multiplier",
            "expected_batch_size",
            "num_examples",
            "steps",
            "target_delta",
        ],
        lambda kw: DPConfig(**kw),
    ),
    "calibrate_noise_multiplier": (
        ["target_epsilon", "target_delta", "sampling_prob", "steps"],
        lambda kw: calibration.calibrate_noise_multiplier(**kw),
    ),
    "poisson_batches": (
        ["sampling_prob", "steps"],
        lambda kw: sampling.poisson_batches(np.zeros((10, 2), "float32"), np.zeros(10), **kw),
    ),
    "calibrate_steps": (
        ["target_epsilon", "target_delta", "noise_multiplier", "sampling_prob", "num_examples"],
        lambda kw: calibration.calibrate_steps(**kw),
    ),
}


def _valid(entry, name, bad):
    """Values these entries take: several clip bounds (one per variable group) for the
    optimizer; None for "not given" where that has a meaning (make_private's keywords, which
    then say what is missing, except accumulation_steps with its default; calibrate_steps'
    num_examples for Poisson sampling)."""
    return (
        (entry in ("DPOptimizer", "make_private") and name == "l2_norm_clip" and bad == [1.0])
        or (entry == "make_private" and name == "accumulation_steps" and bad is None)
        or (entry == "calibrate_steps" and name == "num_examples" and bad is None)
    )


def _cases():
    for entry, (names, _) in ENTRIES.items():
        for name in names:
            for bad in BAD:
                if not _valid(entry, name, bad):
                    yield pytest.param(entry, name, bad, id=f"{entry}-{name}-{bad!r}")


def _arguments(entry, name, bad):
    kw = {k: GOOD[k] for k in ENTRIES[entry][0]}
    if entry.startswith("calibrate"):
        kw["accountant"] = "rdp"
    kw[name] = bad
    return kw


@pytest.mark.parametrize("entry, name, bad", list(_cases()))
def test_every_privacy_argument_error_names_the_argument(entry, name, bad):
    """None, NaN, inf, negative, bool, string and list values of every privacy argument are
    refused with one ValueError line that names the argument (not a TypeError from float())."""
    with pytest.raises(ValueError) as error:
        ENTRIES[entry][1](_arguments(entry, name, bad))
    text = str(error.value)
    assert "\n" not in text, text
    assert re.search(rf"^{name}(\[0\])? must be |{name}=|needs {name}", text), text


@pytest.mark.filterwarnings(NOT_PRIVATE)
def test_numpy_scalars_are_numbers_and_the_setter_is_checked_too():
    config = DPConfig(
        l2_norm_clip=np.float32(1.0),
        noise_multiplier=np.float64(1.1),
        expected_batch_size=np.int64(10),
        num_examples=np.int64(1000),
        steps=np.int32(100),
    )
    assert config.to_dict()["num_examples"] == 1000 and type(config.steps) is int
    opt = DPOptimizer(
        keras.optimizers.SGD(0.1),
        l2_norm_clip=np.float32(1.0),
        noise_multiplier=np.float32(1.0),
        expected_batch_size=np.int64(10),
    )
    for bad in (None, math.nan, -1.0, True, "0.5"):
        with pytest.raises(ValueError, match="^noise_multiplier must be"):
            opt.noise_multiplier = bad
    assert opt.noise_multiplier == 1.0


# ------------------------------------------------------------------------------ σ = 0 warning
def test_zero_noise_warns_once_per_optimizer_that_the_run_is_not_private():
    def build(sigma):
        return DPOptimizer(
            keras.optimizers.SGD(0.1),
            l2_norm_clip=1.0,
            noise_multiplier=sigma,
            expected_batch_size=4,
        )

    def not_private(caught):
        return [str(w.message) for w in caught if "noise_multiplier=0" in str(w.message)]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = build(0.0)
        opt.noise_multiplier = 1.0
        opt.noise_multiplier = 0.0  # the same optimizer: no second warning
        build(0)  # another optimizer warns again
        noisy = build(1.0)
        assert len(not_private(caught)) == 2, not_private(caught)
        noisy.noise_multiplier = 0  # a schedule that reaches 0 warns too
    messages = not_private(caught)
    assert len(messages) == 3, messages
    assert all("NOT differentially private (epsilon = inf)" in m for m in messages), messages
    assert all(w.category is UserWarning for w in caught if "noise_multiplier=0" in str(w.message))


def test_field_names_follow_tf_nest_flatten_order():
    """The name given for a bad leaf is that of the leaf ``tf.nest.flatten`` puts at its index."""
    import collections

    from dpcore.engine.summary import field_names

    pair = collections.namedtuple("pair", "z a")
    structure = {"b": [1.0, {"z": 2.0, "c": 3.0}], "a": pair(4.0, 5.0), "c": 6.0}
    names = field_names(structure, "x")
    assert names == ["x[a][z]", "x[a][a]", "x[b][0]", "x[b][1][c]", "x[b][1][z]", "x[c]"]
    assert tf.nest.flatten(structure) == [4.0, 5.0, 1.0, 3.0, 2.0, 6.0]
    assert field_names(np.zeros(3), "y") == ["y"]
