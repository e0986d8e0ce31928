"""dpcore.config.DPConfig: validation, derived values, events and calibration."""

import dataclasses
import math
import warnings

import dp_accounting
import dp_accounting.rdp
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


# TF Privacy's privacy statement test (compute_dp_sgd_privacy_test, DP_SGD_STATEMENT_KWARGS):
# 10000 examples, batch 64, 5 epochs, noise multiplier 2.0 "with microbatching", which TF Privacy
# accounts as noise multiplier 1.0 (its microbatches double the sensitivity), delta 1e-6. Its
# expected figures, printed to 3 decimals: (example, user) for each epoch order and k.
TFP_STATEMENT = dict(
    l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=64, num_examples=10000,
    target_delta=1e-6,
)  # fmt: skip


def _tfp_runs():
    """TF Privacy's statement counts ceil(E N / B) = 782 Poisson steps for 5 epochs (dpcore's
    epochs are 157 steps each), and 5 Gaussian epochs for the shuffled order."""
    shuffle = DPConfig.from_epochs(epochs=5.0, sampling="shuffle", **TFP_STATEMENT)
    poisson = DPConfig(steps=782, **TFP_STATEMENT)
    assert (shuffle.steps, shuffle.steps_per_epoch) == (785, 157)
    return shuffle, poisson


@pytest.mark.parametrize(
    "k, once_per_epoch, poisson",
    [(1, 13.376, 1.616), (3, 56.224, 6.425), (10, 366.374, math.inf)],
)
def test_user_level_epsilon_matches_tf_privacy_statement_rdp(k, once_per_epoch, poisson):
    """test_dp_sgd_privacy_statement_(no_)user_dp(_infinite)_with_rdp: example- and user-level."""
    shuffle_run, poisson_run = _tfp_runs()
    got_shuffle = shuffle_run.planned_epsilon("rdp", max_examples_per_user=k)
    got_poisson = poisson_run.planned_epsilon("rdp", max_examples_per_user=k)
    assert round(got_shuffle, 3) == once_per_epoch
    assert (round(got_poisson, 3) if math.isfinite(got_poisson) else got_poisson) == poisson
    if k > 1:  # a user-level figure is never below the example-level one
        assert got_poisson >= poisson_run.planned_epsilon("rdp")
        assert got_shuffle > shuffle_run.planned_epsilon("rdp")
    else:
        assert got_poisson == poisson_run.planned_epsilon("rdp")


@pytest.mark.slow
def test_user_level_epsilon_matches_tf_privacy_statement_pld():
    """test_dp_sgd_privacy_statement_user_dp_with_pld (at most 2 examples per user)."""
    shuffle_run, poisson_run = _tfp_runs()
    assert round(shuffle_run.planned_epsilon(), 3) == 12.595
    assert round(poisson_run.planned_epsilon(), 3) == 1.199
    assert round(shuffle_run.planned_epsilon(max_examples_per_user=2), 3) == 30.579
    assert round(poisson_run.planned_epsilon(max_examples_per_user=2), 3) == 2.532


def test_group_privacy_conversion_is_vadhan_lemma_at_the_returned_point():
    """Where no user-level event exists (RDP, Poisson), k ε₁ at the largest example δ₁ whose
    group δ₁ (e^(kε₁) - 1) / (e^ε₁ - 1) is <= δ: check that δ₁ against dp-accounting."""
    _, run = _tfp_runs()
    k, delta = 3, 1e-6
    user = run.planned_epsilon("rdp", max_examples_per_user=k)
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(run.dp_event())

    def group_delta(example_delta):
        eps = accountant.get_epsilon(example_delta)
        return example_delta * math.expm1(k * eps) / math.expm1(eps), eps

    # Find δ₁ with k ε₁(δ₁) = user by bisection, independently of the library's search.
    lo, hi = 1e-300, delta
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if k * accountant.get_epsilon(mid) > user:
            lo = mid
        else:
            hi = mid
    got_delta, eps = group_delta(hi)
    assert k * eps == pytest.approx(user, rel=1e-9)
    assert got_delta <= delta * (1 + 1e-6)
    assert group_delta(hi * 1.001)[0] > delta  # and no larger δ₁ would do


def test_planned_epsilon_is_the_old_epsilon_which_is_deprecated():
    cfg = DPConfig(**BASE)
    with pytest.warns(DeprecationWarning, match="planned_epsilon"):
        old = cfg.epsilon("rdp")
    assert old == cfg.planned_epsilon("rdp")
    with pytest.warns(DeprecationWarning, match="planned_delta"):
        old_delta = cfg.delta(target_epsilon=2.0, accountant="rdp")
    assert old_delta == cfg.planned_delta(target_epsilon=2.0, accountant="rdp")
    with pytest.raises(ValueError, match="max_examples_per_user"):
        cfg.planned_epsilon(max_examples_per_user=0)
