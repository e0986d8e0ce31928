"""The vectorized path under TensorFlow's oneDNN CPU kernels, in fresh processes.

TensorFlow 2.21's oneDNN matmul corrupts the heap on a batched matmul with broadcast batch axes
and a rank-4 result (``[B, 1, T, D] x [D, E]``, what ``tf.vectorized_map`` makes of an
``EinsumDense`` without :func:`dpcore.engine.vectorized.folded_products`); the process aborts, or
a gradient comes back NaN or wrong. TensorFlow turns oneDNN on by default on CPUs with AVX-512
VNNI/BF16, AVX-VNNI or AMX. tests/onednn_worker.py runs the reported model (20 repetitions at
batch 192), the vectorized path over the built-in layer families and a tiny KerasHub BERT against
the exact reference, first with the environment a user has (``TF_ENABLE_ONEDNN_OPTS`` unset) and,
where that leaves oneDNN off (older CPUs), again with oneDNN forced on. With ``ONEDNN_VERBOSE=1``
oneDNN logs the shape of every matmul it runs, so the test also fails where the corrupting product
runs without crashing on the machine at hand.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = str(Path(__file__).with_name("onednn_worker.py"))


def broadcast_products(log: str) -> list[str]:
    """oneDNN matmuls (``src:weights`` dims) of rank >= 4 whose batch axes differ."""
    found = []
    for line in log.splitlines():
        if not line.startswith("onednn_verbose") or ",exec," not in line or ",matmul," not in line:
            continue
        problem = line.split(",")[-2]  # e.g. 192x1x6x16:1x1x16x8
        try:
            src, wei = ([int(d) for d in part.split("x")] for part in problem.split(":")[:2])
        except ValueError:
            continue
        if len(src) >= 4 and src[:-2] != wei[:-2]:
            found.append(problem)
    return sorted(set(found))


def test_broadcast_products_reads_onednn_verbose_lines():
    log = "\n".join(
        [
            "onednn_verbose,v1,primitive,exec,cpu,matmul,gemm:jit:f32,undef,src:f32::blocked:abcd"
            "::f0 wei:f32::blocked:abcd::f0 dst:f32::blocked:abcd::f0,attr-scratchpad:user,,"
            "13x1x3x4:1x1x4x16,14.06",
            "onednn_verbose,v1,primitive,exec,cpu,matmul,gemm:jit:f32,undef,src,,12x6x16:1x16x8,0.1",
            "onednn_verbose,v1,primitive,exec,cpu,matmul,gemm:jit:f32,undef,src,,4x2x6x8:4x2x8x6,0.1",
            "onednn_verbose,v1,primitive,exec,cpu,gemm_api,,undef,src,,,36x18:18x2,0.0009",
        ]
    )
    assert broadcast_products(log) == ["13x1x3x4:1x1x4x16"]


def _run(**env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}  # as users run
    done = subprocess.run(
        [sys.executable, WORKER],
        capture_output=True,
        text=True,
        timeout=900,
        env={**base, "ONEDNN_VERBOSE": "1", **env},
    )
    where = f"with {env or 'the default environment'}"
    assert done.returncode == 0, f"{where}: exit {done.returncode}\n{done.stderr[-3000:]}"
    assert done.stdout.rstrip().endswith("DONE"), f"{where}:\n{done.stdout[-2000:]}"
    assert not broadcast_products(done.stdout), f"{where}: {broadcast_products(done.stdout)}"
    return done


@pytest.mark.slow
def test_vectorized_path_runs_under_onednn_without_the_corrupting_product():
    done = _run()  # as users run dpcore: TF_ENABLE_ONEDNN_OPTS unset
    if "ONEDNN off" in done.stdout:  # this CPU's default: exercise the kernels of newer CPUs too
        forced = _run(TF_ENABLE_ONEDNN_OPTS="1")
        assert "ONEDNN on" in forced.stdout
