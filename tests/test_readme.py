"""The README's example runs as written and keeps its privacy promise."""

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


@pytest.mark.slow
def test_readme_example_runs(capsys):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    config, dp_model = namespace["config"], namespace["dp_model"]
    assert config.epsilon() <= 3.0
    # The run recorded exactly the logical steps the config accounts for.
    assert int(dp_model.optimizer.dp_steps.numpy()) == config.steps
    out = capsys.readouterr().out
    assert "accuracy" in out
