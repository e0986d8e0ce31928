"""The README: two set-up commands, a quick start that runs as written and prints the ε spent,
and nothing outside the repository."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_has_exactly_two_setup_commands():
    text = README.read_text()
    block = re.search(r"## Set-up: two commands.*?```bash\n(.*?)```", text, re.S).group(1)
    commands = [ln.split("#")[0].strip() for ln in block.splitlines() if ln.strip()]
    assert commands == ["make train", "make test"]
    ci = (README.parent / ".ci" / "run").read_text()
    assert "\nmake test\n" in ci


def test_readme_is_one_screen_and_names_nothing_outside_the_repository():
    text = README.read_text()
    assert len(text.splitlines()) <= 80
    # Absolute paths (a system folder, another machine's checkout) are outside the repository.
    assert not re.search(r"(?<![\w./-])/(usr|etc|home|tmp|work|opt|root|var|mnt)\b", text)
    assert "import dpcore` before `keras.models.load_model" in " ".join(text.split())


@pytest.mark.slow
def test_readme_example_runs(capsys):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    config, dp_model, history = namespace["config"], namespace["dp_model"], namespace["history"]
    # The run recorded exactly the logical steps the config plans, and spent what it planned.
    assert int(dp_model.optimizer.dp_steps.numpy()) == config.steps
    spent = dp_model.epsilon()
    assert spent == pytest.approx(history.history["epsilon"][-1], rel=1e-9)
    assert spent == pytest.approx(config.planned_epsilon(), rel=1e-6) and spent <= 3.0
    out = capsys.readouterr().out
    assert f"epsilon spent: {spent:.3f} at delta = 1e-05" in out
    assert "test accuracy:" in out
