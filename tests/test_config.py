"""dpcore.config.DPConfig: validation, derived values, events and calibration."""

import dataclasses
import math
import warnings

import pytest

from dpcore import accounting as acc
from dpcore.config import DPConfig

BASE = dict(
    l2_norm_clip=1.0,
    noise_multiplier=1.1,
    expected_batch_size=256,
    num_examples=60000,
    steps=1000,
)


def test_fields_derived_values_and_frozen_keyword_only():
    cfg = DPConfig(**BASE)
    assert cfg.sampling == "poisson" and cfg.accumulation_steps == 1
    assert cfg.target_delta == 1e-5 and cfg.neighboring == "add_remove"
    assert cfg.sampling_prob == 256 / 60000
    assert cfg.epochs == pytest.approx(1000 * 256 / 60000)
    assert isinstance(cfg.expected_batch_size, float) and isinstance(cfg.steps, int)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.noise_multiplier = 2.0
    with pytest.raises(TypeError):
        DPConfig(1.0, 1.1, 256, 60000, 1000)  # keyword-only


def test_from_epochs_step_counts():
    poisson = DPConfig.from_epochs(epochs=60, **{k: v for k, v in BASE.items() if k != "steps"})
    assert poisson.steps == 60 * math.ceil(60000 / 256) == 14100
    shuffle = DPConfig.from_epochs(
        epochs=2,
        sampling="shuffle",
        **{k: v for k, v in BASE.items() if k != "steps"},
    )
    assert shuffle.steps_per_epoch == math.ceil(60000 / 256) == 235
    assert shuffle.steps == 470 and shuffle.epochs == 2.0


def test_one_definition_of_steps_for_epochs():
    """An epoch is ceil(N / B) steps wherever steps are counted, and E whole epochs are E of
    them: steps_for_epochs(1) * E, from_epochs(epochs=E) and the per-epoch ends all agree."""
    from dpcore.accounting import steps_for_epochs

    fields = {k: v for k, v in BASE.items() if k != "steps"}
    for sampling in ("poisson", "shuffle"):
        cfg = DPConfig.from_epochs(epochs=3, **{**fields, "sampling": sampling})
        ends = [cfg.steps_for_epochs(k) for k in range(4)]
        assert ends == [0, 235, 470, 705] and cfg.steps_per_epoch == 235 == ends[1]
        assert ends[3] == cfg.steps == 3 * cfg.steps_for_epochs(1)
        for epochs in (0.5, 1, 2.5, 60):
            assert cfg.steps_for_epochs(epochs) == steps_for_epochs(
                epochs, num_examples=60000, expected_batch_size=256, sampling=sampling
            )
        assert cfg.steps_for_epochs(0.5) == 118  # ceil(0.5 * 235)
    # N / B = 22.67 (the two counts once gave 69 and 68): 23 steps per epoch, 69 for three.
    small = dict(num_examples=1700, expected_batch_size=75)
    assert steps_for_epochs(1, **small) * 3 == 69 == steps_for_epochs(3, **small)
    assert DPConfig.from_epochs(epochs=3, **{**fields, **small}).steps == 69
    for n, b in ((10, 3), (1797, 64), (60000, 2048), (1000, 7.5), (100, 100), (5, 0.5)):
        one = steps_for_epochs(1, num_examples=n, expected_batch_size=b)
        assert one == math.ceil(n / b) and one * b >= n  # an epoch's expected examples cover N
        for e in range(1, 5):
            assert steps_for_epochs(e, num_examples=n, expected_batch_size=b) == e * one
    assert steps_for_epochs(1, num_examples=10, expected_batch_size=10) == 1
    for bad in (-1, math.inf, math.nan, "2"):
        with pytest.raises(ValueError, match="epochs"):
            steps_for_epochs(bad, num_examples=100, expected_batch_size=10)
    with pytest.raises(ValueError, match="expected_batch_size"):
        steps_for_epochs(1, num_examples=100, expected_batch_size=101)
    with pytest.raises(ValueError, match="sampling"):
        steps_for_epochs(1, num_examples=100, expected_batch_size=10, sampling="shuffled")


def test_classic_check_through_the_config():
    # TF Privacy's 60 epochs of its statement: ceil(60 N / B) = 14063 steps.
    cfg = DPConfig(**{**BASE, "steps": math.ceil(60 * 60000 / 256)})
    assert cfg.epsilon("rdp") == pytest.approx(2.597, abs=1e-3)
    assert cfg.epsilon() == pytest.approx(2.382, abs=1e-3)


def test_event_matches_the_accounting_builders_and_ignores_accumulation():
    cfg = DPConfig(**BASE)
    assert cfg.dp_event() == acc.poisson_event(
        noise_multiplier=1.1, sampling_prob=256 / 60000, steps=1000
    )
    assert dataclasses.replace(cfg, accumulation_steps=4).dp_event() == cfg.dp_event()
    shuffle = dataclasses.replace(cfg, sampling="shuffle")
    assert shuffle.dp_event() == acc.shuffle_event(
        noise_multiplier=1.1, steps_per_epoch=235, steps=1000
    )
    assert shuffle.dp_event(assume_poisson=True) == cfg.dp_event()
    assert shuffle.new_ledger().sampling == "shuffle"


@pytest.mark.parametrize(
    "change, pattern",
    [
        (dict(l2_norm_clip=0.0), r"l2_norm_clip.*0\.0"),
        (dict(l2_norm_clip=float("nan")), r"l2_norm_clip.*nan"),
        (dict(noise_multiplier=-0.5), r"noise_multiplier.*-0\.5"),
        (dict(expected_batch_size=0), r"expected_batch_size.*\b0\b"),
        (dict(expected_batch_size=70000), r"expected_batch_size.*70000"),
        (dict(num_examples=0), r"num_examples.*\b0\b"),
        (dict(steps=0), r"steps.*\b0\b"),
        (dict(steps=-5), r"steps.*-5"),
        (dict(steps=2.5), r"steps.*2\.5"),
        (dict(sampling="uniform"), r"sampling.*uniform"),
        (dict(sampling="shuffle", expected_batch_size=12.5), r"expected_batch_size.*12\.5"),
        (dict(accumulation_steps=0), r"accumulation_steps.*\b0\b"),
        (dict(target_delta=0.0), r"target_delta.*0\.0"),
        (dict(target_delta=1.0), r"target_delta.*1\.0"),
        (dict(neighboring="swap"), r"neighboring.*swap"),
    ],
)
def test_validation_names_the_field_and_value(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        DPConfig(**{**BASE, **change})


def test_delta_at_least_one_over_n_warns():
    with pytest.warns(UserWarning, match=r"target_delta=0\.001.*1/1000"):
        DPConfig(**{**BASE, "num_examples": 1000, "target_delta": 1e-3})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DPConfig(**BASE)


def test_calibrated_config_never_exceeds_the_target():
    fields = dict(l2_norm_clip=1.0, expected_batch_size=50, num_examples=5000)
    cfg = DPConfig.calibrated(target_epsilon=2.0, steps=300, accountant="rdp", **fields)
    assert cfg.steps == 300
    assert cfg.epsilon("rdp") <= 2.0
    assert (
        dataclasses.replace(cfg, noise_multiplier=cfg.noise_multiplier * 0.99).epsilon("rdp") > 2.0
    )
    by_epochs = DPConfig.calibrated(target_epsilon=2.0, epochs=3, accountant="rdp", **fields)
    assert by_epochs.steps == 300
    assert by_epochs.noise_multiplier == pytest.approx(cfg.noise_multiplier, rel=1e-4)
    with pytest.raises(ValueError, match="noise_multiplier"):
        DPConfig.calibrated(target_epsilon=2.0, steps=300, noise_multiplier=1.0, **fields)
    with pytest.raises(ValueError, match="steps or epochs"):
        DPConfig.calibrated(target_epsilon=2.0, **fields)


def test_max_steps_is_the_budget_edge():
    cfg = DPConfig(**{**BASE, "expected_batch_size": 100, "num_examples": 5000, "steps": 1})
    n = cfg.max_steps(target_epsilon=1.0, accountant="rdp")
    assert dataclasses.replace(cfg, steps=n).epsilon("rdp") <= 1.0
    assert dataclasses.replace(cfg, steps=n + 1).epsilon("rdp") > 1.0


def test_dict_round_trip():
    cfg = DPConfig(**{**BASE, "sampling": "shuffle", "accumulation_steps": 2})
    data = cfg.to_dict()
    assert data["sampling_prob"] == cfg.sampling_prob and data["epochs"] == cfg.epochs
    assert DPConfig.from_dict(data) == cfg
