"""Module paths that moved keep working for one release, with a DeprecationWarning naming the
new path."""

import importlib
import subprocess
import sys

import pytest

from dpcore_accounting import cli

# old module path -> the module that now holds its names
MOVED = {"dpcore_experiments.epsilon": cli}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_and_gives_the_same_objects(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)  # import it afresh
    new = MOVED[old]
    with pytest.warns(DeprecationWarning, match=new.__name__.replace(".", r"\.")):
        module = importlib.import_module(old)
    public = [name for name in vars(module) if not name.startswith("_") and name != "warnings"]
    assert public and all(getattr(module, name) is getattr(new, name) for name in public)


def test_old_epsilon_program_still_answers():
    args = ["--num_examples=60000", "--batch_size=256", "--steps=14063", "--noise_multiplier=1.1"]
    done = subprocess.run(
        [sys.executable, "-m", "dpcore_experiments.epsilon", *args, "--accountant=rdp"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epsilon = 2.5967 at delta = 1e-05 (RDP, add_remove adjacency)" in done.stdout
    assert "DeprecationWarning" in done.stderr and "dpcore_accounting.cli" in done.stderr
