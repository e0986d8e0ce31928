"""Tests for the training binary experiments/train.py (tiny runs on the embedded digits)."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from dpcore_experiments import train


def _settings(tmp_path=None, **overrides):
    base = dict(
        dataset="digits",
        model="mlp",
        epochs=2,
        batch_size=128,
        learning_rate=0.5,
        momentum=0.9,
        l2_norm_clip=1.0,
        noise_multiplier=2.0,
        target_epsilon=None,
        seed=0,
        verbose=0,
        output_dir=None if tmp_path is None else str(tmp_path),
    )
    base.update(overrides)
    return train.TrainSettings(**base)


def test_cnn_is_the_tramer_boneh_architecture():
    model = train.build_model("cnn", (28, 28, 1))
    assert model.count_params() == 26010  # the published parameter count
    assert model.output_shape == (None, 10)
    small = train.build_model("cnn", (8, 8, 1))
    assert small.output_shape == (None, 10)
    assert train.build_model("mlp", (8, 8, 1)).output_shape == (None, 10)


def test_epochs_end_where_the_library_counts_steps_for_epochs():
    from dpcore.accounting import steps_for_epochs

    # Every epoch is ceil(N / B) = ceil(29.3) = 30 steps, so E epochs end at 30 E.
    plan = train.make_plan(_settings(epochs=3, batch_size=2048, dataset="fashion_mnist"), 60000)
    assert plan.epoch_end_steps == (30, 60, 90)
    assert [plan.epoch_steps(k) for k in range(3)] == [30, 30, 30]
    assert (
        plan.total_steps == 90 == steps_for_epochs(3, num_examples=60000, expected_batch_size=2048)
    )
    shuffle = train.make_plan(_settings(epochs=2, batch_size=2048, sampling="shuffle"), 60000)
    assert shuffle.epoch_end_steps == (30, 60)
    tiny = train.make_plan(_settings(epochs=1, batch_size=64), 10)  # B > N: one step of all
    assert tiny.epoch_end_steps == (1,) and tiny.expected_batch_size == 10


def test_settings_validation():
    with pytest.raises(ValueError, match="dataset"):
        _settings(dataset="cifar")
    with pytest.raises(ValueError, match="noise_multiplier or --target_epsilon"):
        _settings(noise_multiplier=None)
    with pytest.raises(ValueError, match="not both"):
        _settings(target_epsilon=3.0)
    with pytest.raises(ValueError, match="output_dir"):
        _settings(resume=True)
    _settings(dp=False, noise_multiplier=None)  # a baseline needs no noise
    assert train.TrainSettings().target_epsilon == 3.0  # the main job calibrates to ε = 3


def test_non_private_baseline_writes_results(tmp_path):
    results = train.run_training(_settings(tmp_path, dp=False, sampling="shuffle", epochs=2))
    with open(tmp_path / train.RESULTS_FILE) as f:
        on_disk = json.load(f)
    assert on_disk["settings"]["dp"] is False
    assert on_disk["privacy"]["dp"] is False
    assert len(on_disk["epochs"]) == 2
    for record in on_disk["epochs"]:
        for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "wall_time_s"):
            assert np.isfinite(record[key])
    assert set(on_disk["versions"]) >= {"tensorflow", "dp_accounting", "keras"}
    assert on_disk["dataset"]["name"] == "digits" and on_disk["dataset"]["num_train"] == 1438
    # Two epochs of plain SGD learn the digits well above chance.
    assert results["test_accuracy"] > 0.8
    assert os.path.isdir(tmp_path / train.CHECKPOINT_DIR)


def test_resume_refuses_a_different_run(tmp_path):
    settings = _settings(tmp_path, dp=False, epochs=2, stop_after_epochs=1)
    train.run_training(settings)
    changed = dataclasses.replace(settings, learning_rate=0.1, resume=True, stop_after_epochs=None)
    with pytest.raises(ValueError, match="learning_rate"):
        train.run_training(changed)


def test_resume_without_checkpoint_fails(tmp_path):
    with pytest.raises(FileNotFoundError):
        train.run_training(_settings(tmp_path, dp=False, resume=True))


def test_resume_non_private_continues(tmp_path):
    first = train.run_training(_settings(tmp_path, dp=False, epochs=3, stop_after_epochs=2))
    assert len(first["epochs"]) == 2 and first["completed"] is False
    resumed = train.run_training(_settings(tmp_path, dp=False, epochs=3, resume=True))
    assert resumed["completed"] is True
    assert [e["epoch"] for e in resumed["epochs"]] == [1, 2, 3]
    assert resumed["epochs"][:2] == first["epochs"]
    assert resumed["resumed_from_epoch"] == 2


def test_cli_help_lists_flags():
    out = subprocess.run(
        [sys.executable, "-m", "dpcore_experiments.train", "--helpfull"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    for flag in ("--dataset", "--target_epsilon", "--sampling", "--resume", "--noise_multiplier"):
        assert flag in out.stdout


def _weights(output_dir):
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(output_dir, train.CHECKPOINT_DIR))
    names = sorted(
        k for k in reader.get_variable_to_shape_map() if k.startswith("model_variables/")
    )
    return {k: reader.get_tensor(k) for k in names}


def test_dp_run_records_event_and_epsilon(tmp_path):
    from dpcore.config import DPConfig

    settings = _settings(tmp_path, epochs=2, batch_size=256)
    results = train.run_training(settings)
    privacy = results["privacy"]
    plan = results["plan"]
    assert plan["epoch_end_steps"] == [6, 12] and plan["total_steps"] == 12
    assert "PoissonSampledDpEvent" in privacy["dp_event"]
    assert "count=12" in privacy["dp_event"]
    expected = DPConfig(
        l2_norm_clip=1.0,
        noise_multiplier=2.0,
        expected_batch_size=256.0,
        num_examples=1438,
        steps=12,
        sampling="poisson",
        target_delta=1e-5,
    )
    assert privacy["epsilon_pld"] == pytest.approx(expected.epsilon(accountant="pld"), rel=1e-9)
    assert privacy["epsilon_rdp"] == pytest.approx(expected.epsilon(accountant="rdp"), rel=1e-9)
    eps = [e["epsilon"] for e in results["epochs"]]
    assert 0 < eps[0] < eps[1] == privacy["epsilon"]
    assert results["completed"] is True


def test_target_epsilon_calibrates_noise(tmp_path):
    settings = _settings(
        tmp_path, epochs=1, batch_size=256, noise_multiplier=None, target_epsilon=2.0
    )
    results = train.run_training(settings)
    assert results["privacy"]["epsilon"] <= 2.0
    assert results["privacy"]["epsilon"] == pytest.approx(2.0, abs=0.05)
    assert results["plan"]["noise_multiplier"] > 0


@pytest.mark.slow
def test_dp_resume_matches_uninterrupted_run(tmp_path):
    full_dir, split_dir = tmp_path / "full", tmp_path / "split"
    full = train.run_training(_settings(full_dir, epochs=2, batch_size=256))
    first = train.run_training(_settings(split_dir, epochs=2, batch_size=256, stop_after_epochs=1))
    assert first["completed"] is False
    resumed = train.run_training(_settings(split_dir, epochs=2, batch_size=256, resume=True))
    assert resumed["completed"] is True
    assert resumed["privacy"]["epsilon"] == full["privacy"]["epsilon"]
    assert resumed["privacy"]["dp_event"] == full["privacy"]["dp_event"]
    # With a fixed seed the resumed run continues the same samples and noise (restored optimizer
    # noise state, sampler step offset): it ends at the same weights as the uninterrupted run.
    w_full, w_split = _weights(full_dir), _weights(split_dir)
    assert w_full.keys() == w_split.keys() and w_full
    for name in w_full:
        np.testing.assert_allclose(w_split[name], w_full[name], rtol=1e-5, atol=1e-6)


def test_shuffle_mode_reports_no_amplification_bound(tmp_path):
    results = train.run_training(_settings(tmp_path, epochs=1, batch_size=256, sampling="shuffle"))
    assert results["plan"]["epoch_end_steps"] == [6]
    assert "PoissonSampled" not in results["privacy"]["dp_event"]
    assert "no Poisson amplification" in results["privacy"]["accounting"]


def test_baseline_batches_normalize_like_the_dp_step():
    """Keras's weighted mean over P padded rows equals sum(real losses) / expected_batch_size."""
    import keras
    import tensorflow as tf

    x = np.arange(12, dtype="float32").reshape(4, 3)
    y = np.array([0, 1, 0, 0], "int32")
    mask = np.array([1, 1, 1, 0], "float32")  # P = 4 rows, 3 real
    ds = tf.data.Dataset.from_tensors((x, y, mask, True))
    ((_, _, weights),) = list(train.baseline_batches(ds, expected_batch_size=2.0))
    np.testing.assert_allclose(weights.numpy(), [2.0, 2.0, 2.0, 0.0])
    losses = np.array([0.5, 1.5, 2.0, 7.0], "float32")
    keras_mean = keras.losses.MeanSquaredError()  # sum_over_batch_size: divides by P
    got = float(keras_mean(losses[:, None] ** 0.5, np.zeros((4, 1)), sample_weight=weights))
    assert got == pytest.approx((0.5 + 1.5 + 2.0) / 2.0)


def test_synthetic_users_are_skewed_and_fixed():
    users = train.synthetic_users(1438)
    np.testing.assert_array_equal(users, train.synthetic_users(1438))  # part of the dataset
    counts = np.bincount(users)
    counts = counts[counts > 0]
    assert np.max(counts) >= 20 * np.median(counts)  # Zipf-like: a few users own many rows
    with pytest.raises(ValueError, match="Poisson"):
        _settings(privacy_unit="user", sampling="shuffle")


def test_user_level_run_reports_epsilon_per_user(tmp_path):
    """A tiny user-level run: users are sampled and counted, ε is the DpEvent over users."""
    from dpcore.config import DPConfig

    settings = _settings(
        tmp_path, epochs=1, batch_size=32, privacy_unit="user", max_rows_per_user=4
    )
    results = train.run_training(settings)
    with open(tmp_path / train.RESULTS_FILE) as f:
        on_disk = json.load(f)
    users = on_disk["users"]
    num_users = len(np.unique(train.synthetic_users(1438)))
    assert users["synthetic"] is True and users["num_users"] == num_users
    assert users["max_rows_per_user"] == 4 and users["rows_dropped_by_cap"] > 0
    privacy = on_disk["privacy"]
    assert privacy["privacy_unit"] == "user" and "per user" in privacy["accounting"]
    plan = results["plan"]
    assert plan["num_examples"] == num_users
    assert plan["total_steps"] == math.ceil(num_users / 32)
    expected = DPConfig(
        l2_norm_clip=1.0,
        noise_multiplier=2.0,
        expected_batch_size=32.0,
        num_examples=num_users,
        steps=plan["total_steps"],
        privacy_unit="user",
    )
    assert privacy["epsilon_pld"] == pytest.approx(expected.epsilon(accountant="pld"), rel=1e-9)
    assert results["completed"] is True and np.isfinite(results["test_accuracy"])


def test_scatter_linear_on_a_validation_split_with_a_feature_cache(tmp_path):
    cache = str(tmp_path / "features.npz")
    settings = _settings(
        tmp_path / "run",
        model="scatter_linear",
        epochs=2,
        batch_size=256,
        learning_rate=2.0,
        l2_norm_clip=0.1,
        validation_examples=300,
        feature_cache=cache,
    )
    results = train.run_training(settings)
    assert results["dataset"]["input_shape"] == [81 * 2 * 2]  # 8x8 digits: 2x2 positions
    assert results["dataset"]["num_train"] == 1438 - 300 and results["dataset"]["num_test"] == 300
    assert results["dataset"]["evaluated_on"].startswith("validation")
    assert results["test_accuracy"] > 0.5  # a linear model on scattering features learns digits
    assert os.path.exists(cache)
    again = train.load_data(settings)  # served from the cache, identical
    fresh = train.load_data(dataclasses.replace(settings, feature_cache=None))
    for (a, _), (b, _) in zip(again, fresh):
        np.testing.assert_array_equal(a, b)
