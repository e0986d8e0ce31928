"""dpcore_accounting/cli.py (the `dpcore-epsilon` console script)."""

import functools
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import dp_accounting
import pytest

from dpcore import accounting as acc
from dpcore_accounting import cli

REPO = pathlib.Path(__file__).resolve().parents[1]
# TF Privacy's MNIST setting, 60 epochs as its statement counts them: ceil(60 N / B) steps.
CLASSIC = dict(num_examples=60000, batch_size=256, epochs=None, steps=14063, delta=1e-5)


def test_compute_matches_the_accountant_and_has_the_documented_keys():
    result = cli.compute(
        noise_multiplier=1.1, target_epsilon=None, sampling="poisson", accountant="rdp", **CLASSIC
    )
    for key in (
        "epsilon",
        "delta",
        "noise_multiplier",
        "steps",
        "sampling_prob",
        "accountant",
        "sampling",
    ):
        assert key in result
    assert result["steps"] == math.ceil(60 * 60000 / 256)
    assert result["epsilon"] == pytest.approx(2.597, abs=1e-3)
    assert result["epsilon"] == acc.compute_epsilon(
        acc.poisson_event(noise_multiplier=1.1, sampling_prob=256 / 60000, steps=result["steps"]),
        target_delta=1e-5,
        accountant="rdp",
    )
    assert "epsilon_assuming_poisson" not in result
    json.dumps(result)  # JSON-ready


def test_epochs_are_whole_epochs_of_ceil_n_over_b_steps():
    """--epochs counts the library's steps: 60 epochs of ceil(60000 / 256) = 235 steps."""
    result = cli.compute(
        noise_multiplier=1.1,
        target_epsilon=None,
        sampling="poisson",
        accountant="rdp",
        **{**CLASSIC, "epochs": 60, "steps": None},
    )
    assert result["steps"] == 60 * 235 == 14100


def test_shuffle_reports_the_sound_bound_and_labels_the_poisson_assumption():
    kw = dict(num_examples=1000, batch_size=100, epochs=None, steps=40, delta=1e-5)
    result = cli.compute(
        noise_multiplier=4.0,
        target_epsilon=None,
        sampling="shuffle",
        accountant="rdp",
        poisson_assumption=True,
        **kw,
    )
    sound = acc.shuffle_event(noise_multiplier=4.0, steps_per_epoch=10, steps=40)
    assert result["epsilon"] == acc.compute_epsilon(sound, target_delta=1e-5, accountant="rdp")
    assert result["epsilon_assuming_poisson"] < result["epsilon"]
    assert "ASSUMPTION" in result["epsilon_assuming_poisson_note"]
    text = cli.format_result(result)
    assert "without amplification" in text and "an assumption" in text
    assert "zero-out adjacency" in text  # fixed batch positions: not literal add/remove


def test_target_epsilon_prints_a_calibrated_noise_multiplier():
    kw = dict(num_examples=5000, batch_size=50, epochs=None, steps=300, delta=1e-5)
    result = cli.compute(
        noise_multiplier=None, target_epsilon=2.0, sampling="poisson", accountant="rdp", **kw
    )
    assert result["calibrated"] and result["epsilon"] <= 2.0
    event = acc.poisson_event(
        noise_multiplier=0.99 * result["noise_multiplier"], sampling_prob=0.01, steps=300
    )
    assert acc.compute_epsilon(event, target_delta=1e-5, accountant="rdp") > 2.0
    assert "calibrated" in cli.format_result(result)


def test_user_unit_is_the_poisson_event_over_users_and_says_so():
    """--privacy_unit=user: N and the batch count users; ε is dp-accounting's for that event."""
    run = functools.partial(
        cli.compute,
        num_examples=5000,
        batch_size=50,
        epochs=None,
        steps=2000,
        delta=1e-5,
        noise_multiplier=1.0,
        target_epsilon=None,
        sampling="poisson",
        accountant="rdp",
    )
    result = run(privacy_unit="user")
    # The same event built and composed by dp-accounting itself: each of the 5000 users
    # joins each of the 2000 steps with probability 50 / 5000.
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 2000
    )
    direct = dp_accounting.rdp.RdpAccountant()
    direct.compose(event)
    assert result["epsilon"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-12)
    example = run()
    assert result["epsilon"] == example["epsilon"]  # the unit renames, it changes no number
    assert result["privacy_unit"] == "user" and example["privacy_unit"] == "example"
    assert "epsilon per user" in result["accounting"]
    text = cli.format_result(result)
    assert text.startswith(f"epsilon per user = {result['epsilon']:.4f} at delta = 1e-05")
    assert "N = 5000 users, batch = 50 users" in text
    assert "per user" not in cli.format_result(example)
    with pytest.raises(ValueError, match="--privacy_unit"):
        run(privacy_unit="device")


def test_console_script_names_the_privacy_unit(tmp_path):
    out = tmp_path / "eps.json"
    args = ["--num_examples=5000", "--batch_size=50", "--steps=2000", "--noise_multiplier=1.0"]
    done = subprocess.run(
        _script() + args + ["--accountant=rdp", "--privacy_unit=user", f"--output_json={out}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["privacy_unit"] == "user" and "epsilon per user" in data["accounting"]
    assert f"epsilon per user = {data['epsilon']:.4f} at delta = 1e-05" in done.stdout
    assert data["num_examples"] == 5000 and data["sampling_prob"] == 0.01


def test_compute_rejects_ambiguous_or_bad_input():
    with pytest.raises(ValueError, match="--noise_multiplier or --target_epsilon"):
        cli.compute(
            noise_multiplier=1.0,
            target_epsilon=1.0,
            sampling="poisson",
            accountant="rdp",
            **CLASSIC,
        )
    with pytest.raises(ValueError, match="--epochs or --steps"):
        cli.compute(
            noise_multiplier=1.0,
            target_epsilon=None,
            sampling="poisson",
            accountant="rdp",
            **{**CLASSIC, "epochs": 60, "steps": 10},
        )
    with pytest.raises(ValueError, match=r"target_delta.*1\.5"):
        cli.compute(
            noise_multiplier=1.0,
            target_epsilon=None,
            sampling="poisson",
            accountant="rdp",
            **{**CLASSIC, "delta": 1.5},
        )


def _script() -> list[str]:
    exe = shutil.which("dpcore-epsilon", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "dpcore_accounting.cli"]


@pytest.mark.slow
def test_console_script_writes_json(tmp_path):
    out = tmp_path / "eps.json"
    args = ["--num_examples=60000", "--batch_size=256", "--steps=14063", "--noise_multiplier=1.1"]
    done = subprocess.run(
        _script() + args + ["--accountant=rdp", f"--output_json={out}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epsilon = 2.5967" in done.stdout and "add_remove adjacency" in done.stdout
    data = json.loads(out.read_text())
    assert data["epsilon"] == pytest.approx(2.597, abs=1e-3)
    assert data["accountant"] == "rdp" and data["sampling"] == "poisson"
    assert data["steps"] == 14063 and data["delta"] == 1e-5


def _imported_top_level(importtime_stderr: str) -> set[str]:
    """Top-level packages named by `python -X importtime` (one line per module imported)."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.parametrize("entry", ["console_script", "python_m_experiments"])
def test_cli_answers_without_importing_tensorflow(entry):
    """Both entry points compute ε with dpcore_accounting alone: no TensorFlow, no dpcore."""
    args = ["--num_examples=60000", "--batch_size=256", "--steps=14063", "--noise_multiplier=1.1"]
    if entry == "console_script":
        exe = shutil.which("dpcore-epsilon", path=os.path.dirname(sys.executable))
        if exe is None:
            pytest.skip("dpcore-epsilon is not installed next to this interpreter")
        program = [exe]
    else:
        program = ["-m", "dpcore_accounting.cli"]  # from the repository root
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *program, *args, "--accountant=rdp"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epsilon = 2.5967 at delta = 1e-05 (RDP, add_remove adjacency)" in done.stdout
    imported = _imported_top_level(done.stderr)
    assert {"dp_accounting", "dpcore_accounting"} <= imported  # the parse saw the imports
    assert not imported & {"tensorflow", "keras", "dpcore"}, sorted(imported)


def test_user_level_epsilon_next_to_the_example_level_one():
    """--max_examples_per_user: TF Privacy's statement test (RDP, k = 3), both figures."""
    args = dict(num_examples=10000, batch_size=64, delta=1e-6)
    result = cli.compute(  # TF Privacy's Poisson count for 5 epochs: ceil(5 N / B) steps
        noise_multiplier=1.0,
        target_epsilon=None,
        accountant="rdp",
        sampling="poisson",
        max_examples_per_user=3,
        epochs=None,
        steps=782,
        **args,
    )
    assert round(result["epsilon"], 3) == 1.616 and round(result["epsilon_per_user"], 3) == 6.425
    text = cli.format_result(result)
    assert f"epsilon = {result['epsilon']:.4f} at delta = 1e-06" in text
    assert (
        f"epsilon per user with at most 3 examples = {result['epsilon_per_user']:.4f} at "
        "delta = 1e-06 (group privacy"
    ) in text
    shuffle = cli.compute(
        noise_multiplier=1.0,
        target_epsilon=None,
        accountant="rdp",
        sampling="shuffle",
        max_examples_per_user=3,
        poisson_assumption=True,
        epochs=5.0,
        steps=None,
        **args,
    )
    assert round(shuffle["epsilon"], 3) == 13.376
    assert round(shuffle["epsilon_per_user"], 3) == 56.224
    # 785 shuffled steps (5 whole passes of 157), so a little above the 782-step figure.
    assert shuffle["epsilon_per_user_assuming_poisson"] > result["epsilon_per_user"]
    assert "epsilon per user assuming Poisson sampling" in cli.format_result(shuffle)
    with pytest.raises(ValueError, match="max_examples_per_user"):
        cli.compute(
            noise_multiplier=1.0,
            target_epsilon=None,
            accountant="rdp",
            sampling="poisson",
            max_examples_per_user=0,
            epochs=5.0,
            steps=None,
            **args,
        )
