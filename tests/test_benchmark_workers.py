"""Tests for experiments/dev/benchmark_workers.py: 1 and 2 local workers, timed end to end.

The 1-worker launch is a one-replica MultiWorkerMirroredStrategy, where the DP optimizer's
inner all-reduce needs a merge call like any multi-replica strategy.
"""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_one_and_two_workers_are_timed(tmp_path):
    output = tmp_path / "bench.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpcore_experiments.dev.benchmark_workers",
            "--workers=1,2",
            "--models=mlp",
            "--batch_size=8",
            "--steps=1",
            "--warmup=1",
            "--repeats=1",
            "--timeout_s=300",
            f"--output={output}",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(output.read_text())["results"]
    assert sorted(results) == ["1", "2"]
    for workers, result in results.items():
        assert result["num_workers"] == int(workers)
        mlp = result["models"]["mlp"]
        assert mlp["params"] == 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10
        assert mlp["allreduce_bytes_plain"] == 4 * mlp["params"]
        assert mlp["allreduce_bytes_dp"] == 2 * mlp["allreduce_bytes_plain"]
        assert mlp["dp_step_ms"] > 0 and mlp["plain_step_ms"] > 0
    assert "| mlp | 2 | 8 |" in out.stdout
