"""Smoke and correctness tests of experiments/benchmark.py and experiments/gradient_stats.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from dpcore_experiments import benchmark, gradient_stats

import dpcore
from dpcore.options import ExecutionOptions
from dpcore.testing import assert_sq_norm_bound
from dpcore.testing.reference import reference_per_example_gradients

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW_KEYS = {"model", "method", "batch_size", "median_ms", "ratio_to_nonprivate", "peak_rss_mb"}


def _updated_weights(model_name: str, method: str, x, y, *, l2_norm_clip: float):
    model = benchmark.build_model(model_name, seed=0)
    step = benchmark.make_train_step(
        model,
        method,
        batch_size=len(y),
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=0.0,
        learning_rate=1.0,
    )
    before = [v.numpy() for v in model.trainable_variables]
    step(tf.constant(x), tf.constant(y))
    return [b - v.numpy() for b, v in zip(before, model.trainable_variables)]


def _reference_grads(model_name: str, x, y):
    """Per-example gradients and norms from the slow eager one-example-at-a-time reference."""
    model = benchmark.build_model(model_name, seed=0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    grads = reference_per_example_gradients(model, loss, x, y, training=True)
    b = len(y)
    return grads, np.sqrt(sum(np.sum(g.reshape(b, -1) ** 2, axis=1) for g in grads))


def _fast_norm_bounds(model_name: str, x, y) -> np.ndarray:
    """The fast path's per-example norm bounds for the same model and batch."""
    model = benchmark.build_model(model_name, seed=0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    bounds = dpcore.per_example_norms(model, loss, x, y, options=ExecutionOptions(method="fast"))
    return np.asarray(bounds, np.float64)


def _clipped_mean(grads, norms, *, l2_norm_clip: float):
    factors = np.minimum(1.0, l2_norm_clip / np.maximum(norms, 1e-12))
    return [np.tensordot(factors, g, axes=1) / len(norms) for g in grads]


@pytest.mark.parametrize(
    "model_name,methods",
    [
        ("mlp", ("loop", "jacobian", "vectorized", "fast")),
        ("cnn", ("fast",)),
        ("text", ("loop", "fast")),
    ],
)
def test_dp_steps_apply_the_reference_clipped_mean(model_name, methods):
    # With noise 0 and lr 1, one step moves the weights by exactly the clipped mean gradient.
    x, y = benchmark.make_batch(model_name, 3, seed=1)
    grads, norms = _reference_grads(model_name, x, y)
    # C at the median norm: one example clipped, one not, so both the clip factors and the
    # unclipped gradients' scale are checked (clipping everything would hide a scale error).
    c = float(np.median(norms))
    assert norms.min() < c < norms.max()
    expected = _clipped_mean(grads, norms, l2_norm_clip=c)
    for method in methods:
        if method == "fast":
            # The fast path clips with certified upper bounds of the norms (dpcore.norms), up to
            # NORM_BOUND_SLACK above the exact ones: check that contract, then the update against
            # the reference gradients weighted with the clip factors of those bounds.
            bounds = _fast_norm_bounds(model_name, x, y)
            assert_sq_norm_bound(bounds**2, norms**2)
            want = _clipped_mean(grads, bounds, l2_norm_clip=c)
        else:
            want = expected
        got = _updated_weights(model_name, method, x, y, l2_norm_clip=c)
        assert len(got) == len(want)
        for g, e in zip(got, want):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-7, err_msg=method)


@pytest.mark.parametrize("method", ["make_private_fit", "dp_train_step"])
def test_user_path_steps_apply_the_reference_clipped_mean(method):
    # make_private(...).fit and dp_train_step with sigma 0 and lr 1: one step moves the weights
    # by the clipped mean gradient, clipped with the default engine's certified norm bounds.
    x, y = benchmark.make_batch("mlp", 3, seed=1)
    grads, norms = _reference_grads("mlp", x, y)
    c = float(np.median(norms))
    assert norms.min() < c < norms.max()
    bounds = _fast_norm_bounds("mlp", x, y)
    assert_sq_norm_bound(bounds**2, norms**2)
    want = _clipped_mean(grads, bounds, l2_norm_clip=c)
    got = _updated_weights("mlp", method, x, y, l2_norm_clip=c)
    assert len(got) == len(want)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-7, err_msg=method)


@pytest.mark.parametrize("method", ["nonprivate", "make_private_fit", "dp_train_step"])
def test_measure_reports_a_user_path_row(method):
    row = benchmark.measure("mlp", method, 4, steps=2, warmup=1)
    assert row["median_ms"] > 0 and len(row["step_ms"]) == 2
    assert row["params"] == 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10
    assert np.isfinite(row["final_loss"])


def test_user_path_rows_compare_to_keras_fit_and_engine_rows_to_the_hand_written_step():
    rows = [
        {"impl": "dpcore", "model": "mlp", "batch_size": 4, "method": m}
        for m in ("nonprivate", "make_private_fit", "dp_train_step", "nonprivate_step", "fast")
    ]
    for r, ms in zip(rows, [10.0, 13.0, 12.0, 8.0, 10.0]):
        r.update(status="ok", median_ms=ms, peak_rss_mb=100.0, step_ms=[ms])
    benchmark.add_ratios(rows)
    ratios = {r["method"]: r["ratio_to_nonprivate"] for r in rows}
    assert ratios["make_private_fit"] == pytest.approx(1.3)
    assert ratios["dp_train_step"] == pytest.approx(1.2)
    assert ratios["nonprivate_step"] == 1.0 and ratios["fast"] == pytest.approx(1.25)
    table = benchmark.format_tables(rows)
    assert "fast (engine)" in table and "| make_private_fit |" in table
    assert "| 1.30x | 1.20x | 1.00x | 1.25x |" in table


def test_measure_reports_a_row():
    row = benchmark.measure("mlp", "vectorized", 4, steps=2, warmup=1)
    assert row["median_ms"] > 0 and len(row["step_ms"]) == 2
    assert row["peak_rss_mb"] > 0
    assert row["params"] == 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10
    assert row["paths"] == {"vectorized": 6}
    assert np.isfinite(row["final_loss"])
    assert row["top_ops"] is None  # profiling only when asked for


def test_profile_top_ops_sees_the_noise_draw_only_in_the_dp_step():
    rows = {
        m: benchmark.measure("mlp", m, 8, steps=1, warmup=1, profile_ops=50, profile_steps=2)
        for m in ("nonprivate", "fast")
    }
    for row in rows.values():
        ops = row["top_ops"]
        assert 0 < len(ops) <= 50
        assert all(o["self_ms"] >= 0 for o in ops) and ops[0]["self_ms"] > 0
        assert [o["self_ms"] for o in ops] == sorted((o["self_ms"] for o in ops), reverse=True)
        assert "IDLE" not in {o["type"] for o in ops}
    types = {m: {o["type"] for o in row["top_ops"]} for m, row in rows.items()}
    # The Gaussian noise: Box-Muller on Philox bits (dpcore.aggregation.standard_normal).
    assert "StatelessRandomUniformFullIntV2" in types["fast"]
    assert "StatelessRandomUniformFullIntV2" not in types["nonprivate"]


def test_planned_steps_keeps_at_least_three_within_budget():
    assert benchmark.planned_steps(10, 0.5, None) == 10
    assert benchmark.planned_steps(10, 0.5, 60.0) == 10
    assert benchmark.planned_steps(10, 10.0, 60.0) == 6
    assert benchmark.planned_steps(10, 100.0, 60.0) == 3
    assert benchmark.planned_steps(2, 100.0, 60.0) == 2


def test_add_ratios_and_tables():
    rows = [
        {"impl": "dpcore", "model": "mlp", "batch_size": 4, "method": "nonprivate"},
        {"impl": "dpcore", "model": "mlp", "batch_size": 4, "method": "fast"},
        {"impl": "dpcore", "model": "mlp", "batch_size": 4, "method": "loop"},
        {"impl": "tf_privacy-0.9.0", "model": "mlp", "batch_size": 4, "method": "nonprivate"},
        {"impl": "tf_privacy-0.9.0", "model": "mlp", "batch_size": 4, "method": "dpkeras"},
    ]
    for r, ms, rss in zip(rows, [10.0, 12.5, 0, 20.0, 400.0], [100.0, 110.0, 0, 200.0, 300.0]):
        r.update(status="ok", median_ms=ms, peak_rss_mb=rss, step_peak_rss_mb=rss)
    rows[2].update(status="skipped", median_ms=None, peak_rss_mb=None)
    rows[0]["step_ms"], rows[1]["step_ms"] = [10.0, 8.0, 30.0], [12.5, 10.0, 40.0]
    benchmark.add_ratios(rows)
    assert rows[0]["ratio_to_nonprivate"] == 1.0
    assert rows[1]["ratio_to_nonprivate"] == pytest.approx(1.25)
    assert rows[1]["step_rss_ratio_to_nonprivate"] == pytest.approx(1.1)
    assert rows[1]["min_ratio_to_nonprivate"] == pytest.approx(1.25)
    assert rows[2]["ratio_to_nonprivate"] is None
    assert rows[4]["ratio_to_nonprivate"] == pytest.approx(20.0)  # to the peer's own baseline
    table = benchmark.format_tables(rows)
    assert "| mlp | 4 | 10.0 | 1.25x | skipped | 20.00x |" in table


def test_run_subprocess_reports_timeouts_errors_and_results():
    py = sys.executable
    slow = benchmark.run_subprocess(
        [py, "-c", "import time; time.sleep(30)"], timeout_s=1.0, max_rss_mb=1e6
    )
    assert slow["status"] == "timeout"
    big = benchmark.run_subprocess(
        [
            py,
            "-c",
            "import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
            "time.sleep(30)",
        ],
        timeout_s=60.0,
        max_rss_mb=200.0,
    )
    assert big["status"] == "memory_cap"
    bad = benchmark.run_subprocess(
        [py, "-c", "raise SystemExit('boom')"], timeout_s=30, max_rss_mb=1e6
    )
    assert bad["status"] == "error" and "boom" in bad["note"]
    good = benchmark.run_subprocess(
        [
            py,
            "-c",
            f"print('noise'); print({benchmark.RESULT_PREFIX!r} + '{{\"status\": \"ok\"}}')",
        ],
        timeout_s=30,
        max_rss_mb=1e6,
    )
    assert good["status"] == "ok" and "wall_s" in good


@pytest.mark.slow
def test_benchmark_binary_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "experiments", "benchmark.py"),
        "--models=mlp",
        "--methods=nonprivate,jacobian",
        "--batch_sizes=8",
        "--slow_max_batch=4",
        "--steps=2",
        "--warmup=1",
        f"--json={out}",
        f"--markdown={md}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["nonprivate", "jacobian"]
    for r in rows:
        assert ROW_KEYS <= set(r)
    assert rows[0]["status"] == "ok" and rows[0]["ratio_to_nonprivate"] == 1.0
    assert rows[1]["status"] == "skipped" and rows[1]["median_ms"] is None
    assert "| mlp | 8 |" in md.read_text()
    assert "[2/2]" in proc.stdout  # progress is printed as it goes


# ------------------------------------------------------------------------- gradient_stats


def test_gradient_stats_match_the_reference():
    (x, y), _ = _digits_subset()
    # Step 0 sees the initial weights on the first batch of the seeded order.
    model = gradient_stats.build_mlp(x.shape[1:], 10, hidden=8, seed=3)
    idx = np.random.default_rng(3).permutation(len(x))[:8]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    grads = reference_per_example_gradients(model, loss, x[idx], y[idx])
    flat = np.concatenate([g.reshape(8, -1) for g in grads], axis=1).astype(np.float64)
    norms = np.linalg.norm(flat, axis=1)
    mean = flat.mean(axis=0)
    cosine = flat @ mean / (norms * np.linalg.norm(mean))
    c = float(np.median(norms))  # about half the examples are clipped

    result = gradient_stats.run(
        x,
        y,
        steps=2,
        batch_size=8,
        l2_norm_clip=c,
        noise_multiplier=1.0,
        learning_rate=0.5,
        hidden=8,
        seed=3,
    )
    assert result["check_passed"]
    assert [r["step"] for r in result["steps"]] == [0, 1]
    first = result["steps"][0]
    np.testing.assert_allclose(first["norms"], norms, rtol=1e-5)
    np.testing.assert_allclose(first["cosine"], cosine, rtol=1e-4, atol=1e-6)
    assert first["fraction_clipped"] == np.mean(norms > c)
    assert 0.0 < first["fraction_clipped"] < 1.0
    # The DP step changed the weights between the two steps.
    assert result["steps"][1]["norms"] != result["steps"][0]["norms"]


def test_gradient_stats_check_can_fail():
    rng = np.random.default_rng(0)
    per_example = [rng.normal(size=(5, 3, 2)), rng.normal(size=(5, 2))]
    batch = [g.mean(axis=0) for g in per_example]
    ok = gradient_stats.step_stats(per_example, batch, l2_norm_clip=1.0, rtol=1e-5, atol=1e-7)
    assert ok["mean_equals_batch"]
    batch[1] = batch[1] + 1e-3
    bad = gradient_stats.step_stats(per_example, batch, l2_norm_clip=1.0, rtol=1e-5, atol=1e-7)
    assert not bad["mean_equals_batch"]
    assert bad["mean_grad_max_abs_diff"] == pytest.approx(1e-3)


@pytest.mark.slow
def test_gradient_stats_binary_writes_json_and_png(tmp_path):
    out, png = tmp_path / "gradient_stats.json", tmp_path / "gradient_stats.png"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "experiments", "gradient_stats.py"),
        "--steps=2",
        "--batch_size=16",
        f"--output_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["dataset"] == "digits" and result["check_passed"]
    assert len(result["steps"]) == 2 and len(result["steps"][0]["norms"]) == 16
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "step" in proc.stdout and "yes" in proc.stdout
    assert proc.stdout.splitlines()[-1] == f"results: {out}"


def _digits_subset():
    from dpcore import data

    (x, y), test = data.load_digits()
    return (x[:200], y[:200]), test


def test_interleaved_step_times_both_steps_of_a_checkout():
    from dpcore_experiments.dev import interleaved_step

    row = interleaved_step.measure(ROOT, "mlp", 4, rounds=2, warmup=1)
    assert set(row["median_ms"]) == {"nonprivate_step", "fast"}
    assert all(ms > 0 for ms in row["median_ms"].values())
    assert row["ratio"] == row["median_ms"]["fast"] / row["median_ms"]["nonprivate_step"]


@pytest.mark.parametrize("method", list(benchmark.UNIT_FIT_METHODS))
def test_unit_fit_rows_clip_each_unit_once_over_the_same_rows(method):
    # sigma 0, lr 1: a 16-row step of make_private_fit_aug4 (4 examples x 4 identical views) or
    # make_private_fit_user8 (2 units of 8 rows) moves the weights by the per-unit clipped sum
    # over the expected number of units, from the slow per-unit reference.
    from dpcore.testing import reference_unit_gradients

    rows = 16
    augmentations, group_size = benchmark.UNIT_FIT_METHODS[method]
    x, y = benchmark.make_batch("mlp", rows, seed=1)
    fx, fy = (np.asarray(t) for t in benchmark.fit_batch(method, tf.constant(x), tf.constant(y)))
    assert len(fy) == rows // augmentations
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    ref = reference_unit_gradients(
        benchmark.build_model("mlp", seed=0),
        loss,
        np.repeat(fx, augmentations, axis=0),
        np.repeat(fy, augmentations, axis=0),
        group_size=augmentations * group_size,
        group_reduction="mean" if augmentations > 1 else "sum",
        training=True,
    )
    units = rows // (augmentations * group_size)
    norms = np.sqrt(sum(np.sum(g.reshape(units, -1) ** 2, axis=1) for g in ref))
    c = float(np.median(norms))
    assert norms.min() < c < norms.max()
    # The units are clipped with the engine's certified bounds of their norms: check those,
    # then weight the reference gradients with the clip factors of the bounds.
    options = ExecutionOptions(group_size=augmentations * group_size)
    if augmentations > 1:
        options = options.replace(group_reduction="mean")
    bounds = np.asarray(
        dpcore.per_example_norms(
            benchmark.build_model("mlp", seed=0),
            loss,
            np.repeat(fx, augmentations, axis=0),
            np.repeat(fy, augmentations, axis=0),
            options=options,
        ),
        np.float64,
    )
    assert_sq_norm_bound(bounds**2, norms**2)
    want = _clipped_mean(ref, bounds, l2_norm_clip=c)
    got = _updated_weights("mlp", method, x, y, l2_norm_clip=c)
    # Float32 round-off of the 16-row sums, relative to the update's overall scale.
    scale = max(np.abs(e).max() for e in want)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * scale, err_msg=method)
    row = benchmark.measure("mlp", method, rows, steps=2, warmup=1)
    assert row["median_ms"] > 0 and np.isfinite(row["final_loss"])


def test_interleaved_fit_times_every_method_against_keras_fit():
    from dpcore_experiments.dev import interleaved_fit

    rows = interleaved_fit.measure(
        "mlp", 8, ["make_private_fit_float_labels", "make_private_fit_user8"], rounds=2, warmup=1
    )
    assert [r["method"] for r in rows] == [
        "nonprivate",
        "make_private_fit",  # the integer labels' steps the float labels' ones are paired with
        "make_private_fit_float_labels",
        "make_private_fit_user8",
    ]
    assert rows[2]["paired_ratio_to_int_labels"] > 0
    assert rows[0]["ratio_to_nonprivate"] == 1.0
    assert rows[0]["paired_ratio_to_nonprivate"] == 1.0  # each round's Keras step over itself
    for r in rows:
        assert r["rounds"] == 2 and 0 < r["min_ms"] <= r["median_ms"]
        assert r["paired_ratio_to_nonprivate"] > 0
    table = interleaved_fit.markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "make_private_fit_user8" in table
