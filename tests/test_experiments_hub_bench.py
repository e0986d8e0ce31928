"""The opt-in KerasHub rows of experiments/benchmark.py: both sides of a ratio do the same work."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")

pytest.importorskip(
    "keras_hub", reason="keras-hub is not installed (pip install -e '.[test]' installs it)"
)

from dpcore_experiments import benchmark  # noqa: E402
from dpcore_experiments.lib import hub_models, zoo  # noqa: E402


def test_hub_models_are_opt_in_and_not_shared_with_the_peer():
    assert set(benchmark.HUB_MODELS) == set(hub_models.BENCH_MODELS)
    assert not set(benchmark.HUB_MODELS) & set(zoo.BENCH_MODELS)


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.slow), "bert_lora"])
def test_plain_and_dp_fit_compute_the_same_outputs(name):
    """The plain side must not carry the KerasHub task's own default metric (an argmax over every
    logit): it made the plain step slower than the DP step in an earlier comparison."""
    x, y = tf.nest.map_structure(tf.constant, benchmark.make_batch(name, 2))
    logs = {}
    for method in benchmark.FIT_METHODS[:2]:
        model = benchmark.build_model(name)
        fit_model = benchmark.make_fit_model(
            model,
            method,
            batch_size=2,
            l2_norm_clip=1.0,
            noise_multiplier=0.0,
            learning_rate=0.01,
        )
        history = fit_model.fit(
            tf.data.Dataset.from_tensors((x, y)), epochs=1, verbose=0, shuffle=False
        )
        logs[method] = set(history.history)
        assert np.isfinite(history.history["loss"]).all()
        assert fit_model.get_compile_config()["jit_compile"] is False
    assert logs["nonprivate"] == logs["make_private_fit"] == {"loss"}
