"""Tests for the training binary experiments/train.py (tiny runs on the embedded digits)."""

import dataclasses
import json
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
        noise_multiplier=1.0,
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


def test_steps_per_epoch():
    assert train.steps_per_epoch(60000, 2048, "poisson") == 29
    assert train.steps_per_epoch(60000, 2048, "shuffle") == 30
    assert train.steps_per_epoch(10, 64, "poisson") == 1


def test_settings_validation():
    with pytest.raises(ValueError, match="dataset"):
        _settings(dataset="cifar")
    with pytest.raises(ValueError, match="noise_multiplier or --target_epsilon"):
        _settings(noise_multiplier=None)
    with pytest.raises(ValueError, match="output_dir"):
        _settings(resume=True)
    _settings(dp=False, noise_multiplier=None)  # a baseline needs no noise


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
