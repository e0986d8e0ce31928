"""experiments/dev/soak.py with tiny settings: it runs, reports, and its checks can fail."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from dpcore_experiments.dev import soak

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a process that imports TensorFlow and KerasHub and traces two DP steps
def test_soak_binary_reports_memory_traces_and_epsilon(tmp_path):
    pytest.importorskip("keras_hub")
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "experiments", "dev", "soak.py"),
        "--mlp_steps=6",
        "--hub_steps=4",
        "--check_step=3",
        "--mlp_examples=256",
        "--mlp_batch_size=8",
        "--hub_examples=64",
        "--hub_batch_size=4",
        "--hub_layers=1",
        "--hub_hidden=16",
        "--hub_sequence=8",
        "--max_rss_growth=1.0",  # a few steps say nothing about memory growth
        f"--json={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and [p["phase"] for p in summary["phases"]] == ["mlp", "hub_gpt2"]
    for phase in summary["phases"]:
        assert phase["applied_steps"] == phase["steps"]
        assert phase["epsilon"] == pytest.approx(phase["epsilon_dp_accounting"], rel=1e-9)
        assert phase["at_check"]["step"] == 3
        assert phase["at_end"]["step"] == phase["steps"]
        assert phase["at_end"]["train_step_traces"] == 1
        assert phase["at_end"]["peak_rss_mb"] > 0
        assert set(phase["checks"]) == {
            "steps_applied",
            "epsilon_matches",
            "peak_rss_growth",
            "train_step_traces_constant",
            "shared_norm_bodies_constant",
            "shared_body_traces_constant",
        }


def test_soak_phase_checks_fail_when_they_should():
    """In process, on a tiny model: a growth limit below any growth fails its check, and the
    report says so (the binary then exits with status 1)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.integers(0, 3, 64).astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    report = soak.soak_phase(
        "tiny",
        model,
        x,
        y,
        steps=4,
        expected_batch_size=8.0,
        check_step=2,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        learning_rate=0.1,
        target_delta=1e-5,
        max_rss_growth=-1.0,
        seed=0,
    )
    assert not report["ok"] and report["checks"]["peak_rss_growth"] is False
    others = {k: v for k, v in report["checks"].items() if k != "peak_rss_growth"}
    assert all(others.values()), others
    direct = soak.direct_epsilon(sampling_prob=8 / 64, noise_multiplier=1.0, steps=4, delta=1e-5)
    assert report["epsilon"] == pytest.approx(direct, rel=1e-9)
    assert (
        soak.direct_epsilon(sampling_prob=8 / 64, noise_multiplier=1.0, steps=5, delta=1e-5)
        > report["epsilon"]
    )
