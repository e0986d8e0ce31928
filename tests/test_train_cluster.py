"""experiments/train.py as one worker of a cluster: launch_local starts 2 workers end to end."""

import json
import subprocess
import sys

import pytest
from dpcore_experiments import train

ARGS = [
    "--dataset=digits",
    "--model=mlp",
    "--epochs=1",
    "--batch_size=256",
    "--learning_rate=0.5",
    "--noise_multiplier=2.0",
    "--seed=0",
]


@pytest.mark.slow
def test_train_on_two_local_workers_matches_one_process(tmp_path):
    out_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpcore_experiments.launch_local",
            "--workers=2",
            "--timeout_s=400",
            f"--worker_log_dir={tmp_path / 'logs'}",
            "--",
            sys.executable,
            "-m",
            "dpcore_experiments.train",
            *ARGS,
            f"--output_dir={out_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert out.returncode == 0, out.stderr[-4000:] + out.stdout[-2000:]
    assert "epsilon spent:" in out.stdout  # the chief's lines, streamed
    results = json.loads((out_dir / "results.json").read_text())
    assert results["completed"] and results["plan"]["total_steps"] == 6
    assert sorted(p.name for p in out_dir.iterdir()) == ["checkpoint", "results.json"]
    # The same global sample, noise seed and steps as one process with these settings.
    single = train.run_training(
        train.TrainSettings(
            dataset="digits",
            model="mlp",
            epochs=1,
            batch_size=256,
            learning_rate=0.5,
            noise_multiplier=2.0,
            target_epsilon=None,
            seed=0,
            verbose=0,
        )
    )
    assert results["privacy"]["epsilon"] == single["privacy"]["epsilon"]
    assert results["privacy"]["dp_event"] == single["privacy"]["dp_event"]
    assert results["test_accuracy"] == pytest.approx(single["test_accuracy"], abs=0.01)


def test_a_cluster_run_refuses_what_it_does_not_shard(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:1"]}}')
    settings = train.TrainSettings(dataset="digits", sampling="shuffle", verbose=0)
    with pytest.raises(ValueError, match="shuffle"):
        train.cluster_strategy(settings)
