"""MIGRATING.md's code runs, and the translated TensorFlow Privacy tutorial trains and accounts."""

import math
import pathlib
import re

import dp_accounting
import pytest

MIGRATING = pathlib.Path(__file__).resolve().parents[1] / "MIGRATING.md"
NOT_RUN = "# not run"
TUTORIAL_EPOCHS = "EPOCHS, BATCH_SIZE = 60, 250"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", MIGRATING.read_text(), re.S)


def _runnable_blocks() -> list[str]:
    return [b for b in _python_blocks() if not b.startswith(NOT_RUN)]


def _dp_accounting_epsilon(*, q: float, sigma: float, steps: int, delta: float, rdp: bool) -> float:
    """ε straight from dp-accounting for `steps` Poisson-sampled Gaussian steps."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    if rdp:
        accountant = dp_accounting.rdp.RdpAccountant()
    else:
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    return accountant.compose(event).get_epsilon(delta)


def test_only_tensorflow_privacy_code_is_not_run():
    blocks = _python_blocks()
    runnable = _runnable_blocks()
    assert len(runnable) >= 3
    assert sum(TUTORIAL_EPOCHS in b for b in runnable) == 1
    for block in blocks:
        uses_peer = "tensorflow_privacy" in block
        assert uses_peer == block.startswith(NOT_RUN), block[:80]


@pytest.mark.slow
def test_translated_tutorial_trains_and_reports_dp_accounting_epsilon():
    from dpcore_experiments import tfp_tutorial

    # Two epochs of 45 Poisson steps (expected batch 32) at a larger learning rate than the
    # tutorial's 0.15: test accuracy 0.47 to 0.59 over seeds 0-2 (chance is 0.1).
    result = tfp_tutorial.run_tutorial(
        epochs=2, batch_size=32, learning_rate=0.5, seed=0, verbose=0
    )
    n = result["num_examples"]
    assert n == 1438
    assert result["steps"] == 2 * round(n / 32)
    assert result["test_accuracy"] > 0.3
    direct = dict(q=32 / n, sigma=1.1, steps=result["steps"], delta=1e-5)
    assert math.isfinite(result["epsilon"])
    assert result["epsilon"] == pytest.approx(_dp_accounting_epsilon(**direct, rdp=False), rel=1e-9)
    assert result["epsilon_rdp"] == pytest.approx(
        _dp_accounting_epsilon(**direct, rdp=True), rel=1e-9
    )


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_runnable_blocks())))
def test_migrating_block_runs(index, capsys):
    code = _runnable_blocks()[index]
    tutorial = TUTORIAL_EPOCHS in code
    if tutorial:  # one epoch instead of 60
        code = code.replace(TUTORIAL_EPOCHS, "EPOCHS, BATCH_SIZE = 1, 250")
    namespace: dict = {}
    exec(compile(code, f"{MIGRATING}[python block {index}]", "exec"), namespace)
    if not tutorial:
        return
    config, dp_model, callback = namespace["config"], namespace["dp_model"], namespace["epsilon"]
    assert int(dp_model.optimizer.dp_steps.numpy()) == config.steps == round(1438 / 250)
    expected = _dp_accounting_epsilon(
        q=config.sampling_prob, sigma=1.1, steps=config.steps, delta=1e-5, rdp=False
    )
    assert callback.epsilon() == pytest.approx(expected, rel=1e-9)
    assert f"the current epsilon is: {expected:.2f}" in capsys.readouterr().out
