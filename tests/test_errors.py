"""Errors a person can read: privacy arguments, and the σ = 0 warning."""

from __future__ import annotations

import math
import re
import warnings

import keras
import numpy as np
import pytest

from dpcore import DPConfig, DPOptimizer, make_private
from dpcore_accounting import calibration

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
NOT_PRIVATE = "ignore:noise_multiplier=0:UserWarning"


def _model():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])


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
