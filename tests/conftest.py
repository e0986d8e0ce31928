"""Shared test set-up: quiet TensorFlow logs, deterministic seeds, small model zoo."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# TensorFlow 2.21's oneDNN CPU kernels intermittently return NaN or abort ("dnnl::error: object is
# not initialized") inside vectorized_map over attention layers on AMD Zen 4 CPUs; the stock
# Eigen kernels are exact and deterministic here. Tests compare against exact references.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    yield


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_configure(config):
    tf.config.threading.set_inter_op_parallelism_threads(2)
