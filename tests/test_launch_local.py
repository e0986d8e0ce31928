"""Tests for experiments/launch_local.py: local workers with TF_CONFIG, bounded and cleaned up."""

import json
import subprocess
import sys
import time
from pathlib import Path

from dpcore_experiments import launch_local

PRINT_CONFIG = "import os; print(os.environ['TF_CONFIG']); print(os.environ['DPCORE_WORKER_INDEX'])"


def test_each_worker_gets_its_task_in_one_loopback_cluster(tmp_path, capsys):
    runs = launch_local.launch(
        [sys.executable, "-c", PRINT_CONFIG], workers=3, timeout_s=60, log_dir=str(tmp_path)
    )
    assert [r.returncode for r in runs] == [0, 0, 0] and not any(r.killed for r in runs)
    configs = []
    for i, run in enumerate(runs):
        config_line, index_line = Path(run.log_path).read_text().splitlines()
        config = json.loads(config_line)
        assert config["task"] == {"type": "worker", "index": i} and index_line == str(i)
        configs.append(config["cluster"])
    assert all(c == configs[0] for c in configs)
    addresses = configs[0]["worker"]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)


def test_chief_output_is_streamed(tmp_path):
    class Sink:
        text = ""

        def write(self, s):
            Sink.text += s

        def flush(self):
            pass

    launch_local.launch(
        [sys.executable, "-c", PRINT_CONFIG],
        workers=2,
        timeout_s=60,
        log_dir=str(tmp_path),
        stream=Sink(),
    )
    assert Sink.text.splitlines()[1] == "0"  # the chief's lines only


def test_a_failed_worker_stops_the_others(tmp_path):
    # Worker 1 fails at once; the chief would wait forever (as in a collective with a dead peer).
    script = (
        "import os, time, sys\n"
        "if os.environ['DPCORE_WORKER_INDEX'] == '1': sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    start = time.monotonic()
    runs = launch_local.launch(
        [sys.executable, "-c", script], workers=2, timeout_s=120, log_dir=str(tmp_path)
    )
    assert time.monotonic() - start < 60  # not the timeout: the failure ended the launch
    assert runs[1].returncode == 3 and not runs[1].killed
    assert runs[0].killed and runs[0].returncode != 0


def test_timeout_kills_every_worker(tmp_path):
    runs = launch_local.launch(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        workers=2,
        timeout_s=2,
        log_dir=str(tmp_path),
    )
    assert all(r.killed and r.returncode != 0 for r in runs)


def test_workers_left_after_the_chief_get_a_grace_period(tmp_path):
    script = "import os, time\nif os.environ['DPCORE_WORKER_INDEX'] != '0': time.sleep(600)\n"
    runs = launch_local.launch(
        [sys.executable, "-c", script], workers=2, timeout_s=120, grace_s=1, log_dir=str(tmp_path)
    )
    assert runs[0].returncode == 0 and not runs[0].killed
    assert runs[1].killed


def test_program_exits_with_the_status_of_the_failed_worker(tmp_path):
    script = (
        "import os, sys, time\n"
        "if os.environ['DPCORE_WORKER_INDEX'] == '1': sys.exit(6)\n"
        "time.sleep(600)\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpcore_experiments.launch_local",
            "--workers=2",
            f"--worker_log_dir={tmp_path}",
            "--timeout_s=60",
            "--",
            sys.executable,
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 6, out.stderr
    assert "worker 1 failed (status 6)" in out.stderr
    assert "worker 0 stopped by the launcher" in out.stderr
