"""The console scripts behave like one tool: a user error is one `error:` line and status 2,
found before TensorFlow is imported; outputs go to --output_dir (runs/<binary>-<time>/ by
default), named in the last line; --help is written for users."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from dpcore_experiments.lib import cli

BIN = os.path.dirname(sys.executable)
SCRIPTS = (
    "dpcore-train",
    "dpcore-finetune",
    "dpcore-epsilon",
    "dpcore-audit",
    "dpcore-gradient-stats",
    "dpcore-launch-local",
    "dpcore-tfp-tutorial",
)


def _script(name):
    path = shutil.which(name, path=BIN)
    assert path, f"{name} is not installed next to {sys.executable} (pip install -e .)"
    return path


def _run(args, cwd, *, env=None, timeout=120):
    return subprocess.run(
        [_script(args[0]), *args[1:]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _user_error_cases(tmp):
    """(command, words the error line must contain), one or more per binary."""
    empty = tmp / "empty"
    empty.mkdir()
    a_file = tmp / "a_file"
    a_file.write_text("x")
    return [
        (["dpcore-train", "--epochs=0"], "--epochs"),
        (["dpcore-train", "--epochs=two"], "--epochs"),
        (["dpcore-train", "--no_such_flag"], "no_such_flag"),
        (["dpcore-train", "--dataset=mnist", f"--data_dir={empty}"], "--data_dir"),
        (["dpcore-train", "--resume", f"--output_dir={empty}"], "--resume"),
        (["dpcore-train", f"--output_dir={a_file}/sub"], "--output_dir"),
        (["dpcore-audit", "--dataset=fashion_mnist", f"--data_dir={tmp}/none"], "--data_dir"),
        (["dpcore-audit", f"--output_dir={a_file}"], "--output_dir"),
        (["dpcore-finetune", f"--text_file={tmp}/none.txt"], "--text_file"),
        (["dpcore-finetune", f"--text_file={a_file}", f"--preset={empty}"], "--preset"),
        (["dpcore-gradient-stats", "--steps=0"], "--steps"),
        (["dpcore-gradient-stats", f"--output_dir={a_file}/sub"], "--output_dir"),
        (["dpcore-tfp-tutorial", "--dataset=mnist", f"--data_dir={empty}"], "--data_dir"),
        (["dpcore-epsilon", "--num_examples=100"], "--batch_size"),
        (
            [
                "dpcore-epsilon",
                "--num_examples=100",
                "--batch_size=10",
                "--steps=5",
                "--noise_multiplier=1",
                f"--output_json={a_file}/out.json",
            ],
            "--output_json",
        ),
        (["dpcore-launch-local", "--workers=2"], "command"),
        (["dpcore-launch-local", "--", f"{tmp}/no_such_program"], "not found"),
    ]


def test_user_errors_are_one_line_exit_2_before_tensorflow(tmp_path):
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")  # lists every module imported
    for args, words in _user_error_cases(tmp_path):
        done = _run(args, tmp_path, env=env)
        lines = [ln for ln in done.stderr.splitlines() if not ln.startswith("import time:")]
        imported = {
            ln.rsplit("|", 1)[1].strip().split(".")[0]
            for ln in done.stderr.splitlines()
            if ln.startswith("import time:") and ln.count("|") == 2
        }
        assert done.returncode == 2, (args, done.returncode, done.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, lines)
        assert words in lines[0], (args, lines[0])
        assert done.stdout == "", (args, done.stdout)
        assert "tensorflow" not in imported, args  # found before any TensorFlow work
    assert not (tmp_path / "runs").exists()  # a refused run leaves no output folder


def test_bad_data_file_is_a_user_error_without_start_up_noise(tmp_path):
    """A data folder that passes the cheap check but does not parse: still one line, after
    TensorFlow's import, whose start-up lines (cuInit, oneDNN, CPU notes) are not shown."""
    data = tmp_path / "idx"
    data.mkdir()
    for name in cli.IDX_FILES:
        (data / name).write_bytes(b"not gzip")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    done = _run(
        ["dpcore-train", "--dataset=mnist", f"--data_dir={data}", f"--output_dir={tmp_path}/o"],
        tmp_path,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr[-3000:]
    assert done.stderr.startswith("error: ") and "IDX" in done.stderr


def test_help_is_for_users_and_lists_the_flags(tmp_path):
    for name in SCRIPTS:
        done = _run([name, "--help"], tmp_path)
        assert done.stdout.startswith(name + ": "), (name, done.stdout[:300])
        assert "Contract:" not in done.stdout, name
        assert re.search(r"^\s+--\[?\w", done.stdout, re.M), (name, done.stdout)  # its flags


def test_constants_agree_with_the_data_loader():
    from dpcore import data

    assert cli.IDX_FILES == tuple(data.IDX_FILES.values())
    assert cli.DEFAULT_DATA_DIRS == {
        "fashion_mnist": data.FASHION_MNIST_DIR,
        "mnist": data.MNIST_DIR,
    }


def test_output_dir_default_is_a_new_folder_under_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = cli.output_dir(None, "train")
    second = cli.output_dir(None, "train")
    assert re.fullmatch(r"runs/train-\d{8}-\d{6}(-\d+)?", first), first
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    assert cli.output_dir("mine/x", "train") == "mine/x" and os.path.isdir("mine/x")
    with pytest.raises(cli.UserError, match="--output_dir=mine/x/f/y"):
        (tmp_path / "mine" / "x" / "f").write_text("")
        cli.output_dir("mine/x/f/y", "train")


@pytest.mark.slow
def test_gradient_stats_writes_under_runs_by_default(tmp_path):
    done = _run(["dpcore-gradient-stats", "--steps=1", "--batch_size=4", "--noplot"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.splitlines()[-1]
    match = re.fullmatch(r"results: (runs/gradient_stats-[\d-]+/gradient_stats\.json)", last)
    assert match, last
    assert (tmp_path / match.group(1)).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing in the cwd


@pytest.mark.slow
def test_train_default_run_writes_results_and_names_them(tmp_path):
    """What `make train` runs (here one short epoch): results.json under runs/, named last."""
    done = _run(["dpcore-train", "--epochs=1", "--batch_size=256"], tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.splitlines()[-1]
    match = re.fullmatch(r"results: (runs/train-[\d-]+/results\.json)", last)
    assert match, last
    assert (tmp_path / match.group(1)).is_file()
    assert "epsilon spent: " in done.stdout
    assert "cuInit" not in done.stderr and "cpu_feature_guard" not in done.stderr
