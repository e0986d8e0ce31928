"""Import boundaries: TensorFlow-free accounting, `import dpcore` enough to load models, and
experiment binaries that import TensorFlow without its start-up noise.

`dpcore_accounting` must compute ε without importing TensorFlow (the `dpcore-epsilon` CLI relies
on it); `dpcore/__init__.py` must stay eager, since importing it is what registers DPModel and
DPOptimizer with Keras for `keras.saving.load_model` in a fresh process.
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import dpcore
import dpcore_accounting
from dpcore.model import make_private


def _python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_dpcore_accounting_computes_epsilon_without_tensorflow():
    done = _python(
        """
        import sys
        import dpcore_accounting as acc

        config = acc.DPConfig(l2_norm_clip=1.0, noise_multiplier=1.1,
                              expected_batch_size=256, num_examples=60000, steps=1000)
        ledger = config.new_ledger()
        ledger.record_steps(steps=1000, noise_multiplier=1.1, sampling_prob=config.sampling_prob)
        sigma = acc.calibrate_noise_multiplier(
            target_epsilon=1.0, target_delta=1e-5, sampling_prob=config.sampling_prob,
            steps=1000, accountant="rdp")
        eps = ledger.epsilon(target_delta=1e-5)
        print(config.planned_epsilon("pld"), config.planned_epsilon("rdp"), eps, sigma)
        loaded = sorted({m.split(".")[0] for m in sys.modules} & {"tensorflow", "keras", "dpcore"})
        print("loaded:", loaded)
        """
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded: []" in done.stdout, done.stdout


def test_dpcore_names_are_the_tensorflow_free_objects():
    from dpcore.accounting import calibration, events, ledger

    assert dpcore.DPConfig is dpcore_accounting.DPConfig
    assert dpcore.config.DPConfig is dpcore_accounting.DPConfig
    assert events is dpcore_accounting.events and dpcore.accounting.events is events
    assert calibration is dpcore_accounting.calibration
    assert ledger is dpcore_accounting.ledger
    assert dpcore.accounting.PrivacyLedger is dpcore_accounting.PrivacyLedger
    assert set(dpcore.accounting.__all__) == set(dpcore_accounting.__all__)


@pytest.mark.slow
def test_saved_dp_model_loads_in_a_fresh_process_after_import_dpcore(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.integers(0, 3, size=(16,))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    dp = make_private(
        model,
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        l2_norm_clip=1.0,
        noise_multiplier=0.5,
        expected_batch_size=8,
    )
    dp.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "dp.keras"
    dp.save(path)
    done = _python(
        f"""
        import dpcore
        import keras

        loaded = keras.saving.load_model({str(path)!r})
        print(type(loaded).__name__, type(loaded.optimizer).__name__,
              int(loaded.optimizer.dp_steps))
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["DPModel", "DPOptimizer", "2"], done.stdout


def test_startup_noise_filter_drops_only_known_lines():
    from dpcore_experiments.lib.tf_startup import is_startup_noise

    noise = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "I0000 00:00:1796087169.383605   26486 port.cc:153] oneDNN custom operations are on.",
        "I0000 00:00:1796087169.383914   26486 cudart_stub.cc:31] Could not find cuda drivers on "
        "your machine, GPU will not be used.",
        "E0000 00:00:1796087171.388773   26486 cuda_platform.cc:52] failed call to cuInit: "
        "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
        # TensorFlow 2.16's form (the oldest supported)
        "2026-12-06 01:56:53.635249: E external/local_xla/xla/stream_executor/cuda/"
        "cuda_blas.cc:1442] Unable to register cuBLAS factory: Attempting to register factory "
        "for plugin cuBLAS when one has already been registered",
        "2026-12-06 01:56:53.693858: I tensorflow/core/platform/cpu_feature_guard.cc:210] This "
        "TensorFlow binary is optimized to use available CPU instructions",
        "2026-12-06 01:56:59.439968: W tensorflow/compiler/tf2tensorrt/utils/py_utils.cc:38] "
        "TF-TRT Warning: Could not find TensorRT",
    ]
    kept = [
        "2026-12-06 01:56:59.439968: E tensorflow/core/kernels/op.cc:38] OP_REQUIRES failed",
        "E0000 00:00:1796087171.388773   26486 op_kernel.cc:1857] OP_REQUIRES failed",
        "F1201 01:06:15.743156   26486 check.cc:12] Check failed: x",
        "Traceback (most recent call last):",
        "UserWarning: something the user should see",
    ]
    assert all(is_startup_noise(line) for line in noise)
    assert not any(is_startup_noise(line) for line in kept)


@pytest.mark.slow
def test_experiment_binaries_import_tensorflow_without_startup_noise():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")  # as a user runs it
    }
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from dpcore_experiments.lib.tf_startup import import_tensorflow_quietly\n"
            "tf = import_tensorflow_quietly()\n"
            "import keras\n"
            "print(float(tf.constant(1.0) + 1))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "2.0"
    assert done.stderr == "", done.stderr
