"""Tests of the shared experiments modules: dpcore_experiments.lib.common and dpcore_experiments.lib.zoo."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from dpcore_experiments.lib import common, zoo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_write_json_atomic_replaces_the_file_whole(tmp_path):
    path = tmp_path / "sub" / "out.json"
    common.write_json_atomic(str(path), {"a": 1})
    common.write_json_atomic(str(path), {"b": float("inf"), "c": object()}, default=str)
    data = json.loads(path.read_text())
    assert set(data) == {"b", "c"}
    assert not os.path.exists(str(path) + ".tmp")


def test_memory_probes():
    assert common.proc_status_kb("VmRSS") > 0
    assert common.proc_status_kb("NoSuchField") is None
    assert common.proc_status_kb("VmRSS", pid=2**30) is None
    assert common.peak_rss_mb() > 0
    assert common.reset_peak_rss() in (True, False)


@pytest.mark.parametrize(
    "name,params",
    [
        ("mlp", 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10),
        ("cnn", 26010),  # Tramer & Boneh's published count
        ("text", 20000 * 64 + 5 * 64 * 64 + 64 + 64 * 64 + 64 + 64 * 2 + 2),
    ],
)
def test_bench_models_and_batches(name, params):
    model = zoo.build_bench_model(keras, name)
    assert model.count_params() == params
    x, y = zoo.make_bench_batch(name, 3, seed=1)
    assert model(x).shape == (3, zoo.NUM_CLASSES[name])
    assert y.dtype == np.int32 and y.max() < zoo.NUM_CLASSES[name]


def test_small_models_build_on_digits_and_28x28_inputs():
    for shape in ((8, 8, 1), (28, 28, 1)):
        cnn = keras.Sequential(zoo.cnn_layers(keras, shape, 10))
        mlp = keras.Sequential(zoo.tanh_mlp_layers(keras, shape, 10, hidden=16))
        assert cnn.output_shape == mlp.output_shape == (None, 10)


def test_zoo_and_common_import_neither_tensorflow_nor_dpcore():
    code = (
        "import sys; sys.path.insert(0, 'experiments/lib'); import zoo, common; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'dpcore')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
