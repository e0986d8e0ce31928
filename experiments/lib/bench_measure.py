"""Timing and memory of one benchmark configuration, measured inside its own process.

Contract:
  * `measure` builds the model and step of one (model, method, batch size), traces it, runs the
    warm-up steps and times the others: per step inside one ``fit`` for the ``fit`` rows, per
    call for the others. It reports the median and every step's milliseconds, the process's
    peak resident memory and that of the timed steps alone, and on a GPU peak device memory.
  * `profile_top_ops` profiles more steps after the timed ones (timings are unaffected).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from dpcore_experiments.lib import common
from dpcore_experiments.lib.bench_steps import (
    FIT_METHODS,
    build_model,
    fit_batch,
    make_batch,
    make_train_step,
)


def _gpu_memory(reset: bool = False) -> float | None:
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        return None
    if reset:
        tf.config.experimental.reset_memory_stats("GPU:0")
        return None
    return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20


def planned_steps(steps: int, step_s: float, budget_s: float | None) -> int:
    """Timed steps within a time budget: ``steps``, or fewer (at least ``min(steps, 3)``)."""
    if budget_s is None or step_s <= 0:
        return steps
    return max(min(steps, 3), min(steps, int(budget_s / step_s)))


def path_counts(paths: dict[str, str]) -> dict[str, int]:
    """How many variables each engine path computed."""
    counts: dict[str, int] = {}
    for p in paths.values():
        counts[p] = counts.get(p, 0) + 1
    return counts


def measure(
    model_name: str,
    method: str,
    batch_size: int,
    *,
    steps: int,
    warmup: int,
    step_budget_s: float | None = None,
    l2_norm_clip: float = 1.0,
    noise_multiplier: float = 1.0,
    learning_rate: float = 0.01,
    profile_ops: int = 0,
    profile_steps: int = 5,
) -> dict:
    """Times one configuration in this process.

    Args:
      model_name: one of ``MODELS``.
      method: one of ``METHODS``.
      batch_size: examples per step.
      steps: timed steps (at most).
      warmup: untimed calls first; the first traces.
      step_budget_s: if set, fewer timed steps (never under ``min(steps, 3)``) when ``steps`` of
        them would take longer than this, judged from the last warm-up step.
      l2_norm_clip: clip bound of the DP methods.
      noise_multiplier: noise multiplier of the DP methods.
      learning_rate: SGD learning rate.
      profile_ops: if > 0, ``top_ops`` lists the ops with the most self time per step over
        ``profile_steps`` profiled steps (run after the timed ones, so timings are unaffected).
      profile_steps: steps profiled for ``profile_ops``.

    Returns:
      The row's fields (see `_row`).

    Privacy:
      Runs on synthetic data only.
    """
    import tensorflow as tf

    model = build_model(model_name)
    x, y = tf.nest.map_structure(tf.constant, make_batch(model_name, batch_size))
    info: dict = {}
    step = make_train_step(
        model,
        method,
        batch_size=batch_size,
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=noise_multiplier,
        learning_rate=learning_rate,
        info=info,
    )
    run_steps = _step_runner(step, method, x, y)
    timing = _time_steps(run_steps, steps=steps, warmup=warmup, step_budget_s=step_budget_s)
    top = (
        profile_top_ops(step, (x, y), top=profile_ops, steps=profile_steps) if profile_ops else None
    )
    return _row(timing, top, model, info)


def _step_runner(
    step: Any, method: str, x: Any, y: Any
) -> Callable[[int], tuple[list[float], float]]:
    """``run_steps(n) -> (milliseconds of each step, last loss)`` for the step."""
    if method in FIT_METHODS:
        # make_train_step compiled the model (or its DPModel) for this fit; time its steps
        # inside fit itself, with the same batch each step.
        fit_model = step.fit_model
        fit_x, fit_y = fit_batch(method, x, y)

        def run_steps(n: int) -> tuple[list[float], float]:
            return _timed_fit(fit_model, fit_x, fit_y, n)

    else:

        def run_steps(n: int) -> tuple[list[float], float]:
            times, loss = [], float("nan")
            for _ in range(n):
                t0 = time.perf_counter()
                loss = float(step(x, y))
                times.append((time.perf_counter() - t0) * 1000.0)
            return times, loss

    return run_steps


class _Timing(NamedTuple):
    times: list[float]  # milliseconds of each timed step
    steps: int  # timed steps
    trace_s: float  # the first call
    loss: float  # the last step's
    step_peak_kb: float | None  # peak RSS during the timed steps
    rss_before_mb: float
    rss_anon_kb: float | None  # after the steps
    rss_file_kb: float | None


def _time_steps(
    run_steps: Callable[[int], tuple[list[float], float]],
    *,
    steps: int,
    warmup: int,
    step_budget_s: float | None,
) -> _Timing:
    """Traces, warms up and times the steps, with resident memory around the timed ones."""
    t0 = time.perf_counter()
    _, loss = run_steps(1)
    trace_s = last_s = time.perf_counter() - t0
    if warmup > 1:
        warm, loss = run_steps(warmup - 1)
        last_s = warm[-1] / 1000.0
    steps = planned_steps(steps, last_s, step_budget_s)
    rss_before_mb = (common.proc_status_kb("VmRSS") or 0.0) / 1024
    hwm_reset = common.reset_peak_rss()
    _gpu_memory(reset=True)
    times, loss = run_steps(steps)
    step_peak = common.proc_status_kb("VmHWM") if hwm_reset else None
    # Resident memory after the steps, split into anonymous pages (heap, tensors) and pages of
    # mapped files (the code of the libraries loaded, XLA's compiler included).
    rss_anon, rss_file = (common.proc_status_kb(f) for f in ("RssAnon", "RssFile"))
    return _Timing(times, steps, trace_s, loss, step_peak, rss_before_mb, rss_anon, rss_file)


def _row(timing: _Timing, top: list[dict] | None, model: Any, info: dict) -> dict:
    """A configuration's measured fields.

    Returns:
      ``top_ops``, ``median_ms``, ``step_ms`` (every timed step), ``peak_rss_mb`` (whole process),
      ``step_peak_rss_mb`` (peak during the timed steps, tracing excluded), ``rss_anon_after_mb``
      and ``rss_file_after_mb`` (resident memory after the steps: anonymous pages, then pages of
      mapped files such as the libraries' code), ``peak_device_mb`` (GPU only), ``trace_s`` (the
      first call) and the engine paths taken.
    """
    import tensorflow as tf

    times, step_peak, rss_anon, rss_file = (
        timing.times,
        timing.step_peak_kb,
        timing.rss_anon_kb,
        timing.rss_file_kb,
    )
    return {
        "top_ops": top,
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "step_ms": [round(t, 3) for t in times],
        "steps_timed": timing.steps,
        "trace_s": round(timing.trace_s, 3),
        "peak_rss_mb": common.peak_rss_mb(),
        "step_peak_rss_mb": None if step_peak is None else step_peak / 1024,
        "rss_before_steps_mb": timing.rss_before_mb,
        "rss_anon_after_mb": None if rss_anon is None else rss_anon / 1024,
        "rss_file_after_mb": None if rss_file is None else rss_file / 1024,
        "peak_device_mb": _gpu_memory(),
        "params": int(sum(int(tf.size(v)) for v in model.trainable_variables)),
        "final_loss": timing.loss,
        "paths": path_counts(info.get("paths", {})),
    }


def _timed_fit(model: Any, x: Any, y: Any, steps: int) -> tuple[list[float], float]:
    """Milliseconds of each of ``steps`` steps of one ``model.fit`` on the batch ``(x, y)``.

    A step is timed from the end of the previous one to its end, so the fit loop's own work
    between steps (the next batch, the callbacks) counts too.

    Returns:
      ``(times_ms, last_loss)``.
    """
    import keras
    import tensorflow as tf

    class StepTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []
            self.loss = float("nan")
            self.last = 0.0

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.last = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if logs and "loss" in logs:
                self.loss = float(logs["loss"])  # waits for the step's result
            now = time.perf_counter()
            self.times.append((now - self.last) * 1000.0)
            self.last = now

    timer = StepTimer()
    # One untimed step first: the fit's first step also starts its dataset iterator.
    data = tf.data.Dataset.from_tensors((x, y)).repeat(steps + 1)
    model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
    return timer.times[1:], timer.loss


def profile_top_ops(step: Callable, args: tuple, *, top: int, steps: int = 5) -> list[dict]:
    """The ``top`` TensorFlow ops by host self time per step, over ``steps`` profiled calls.

    Self time is wall time inside the op; ops that run concurrently (inter-op parallelism) both
    count, so the column can add up to more than the step. ``IDLE`` is left out.

    Args:
      step: the compiled step, already traced.
      args: its arguments.
      top: how many ops to report.
      steps: calls profiled.

    Returns:
      ``[{"type", "op", "self_ms", "calls"}]`` per step, most expensive first; a single
      ``{"type": "unavailable", ...}`` entry where this TensorFlow build lacks the op-stats tool.
    """
    import tensorflow as tf

    try:  # the converter behind TensorBoard's profile plugin (ships with TensorFlow)
        from tensorflow.python.profiler.internal import _pywrap_profiler_plugin as plugin
    except ImportError as err:
        return [{"type": "unavailable", "op": str(err)[:200], "self_ms": None, "calls": None}]
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            for _ in range(steps):
                float(step(*args))
        finally:
            tf.profiler.experimental.stop()
        spaces = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        data, _ = plugin.xspace_to_tools_data(spaces, "framework_op_stats", {})
    table = json.loads(data)
    table = table[0] if isinstance(table, list) else table
    cols = [c["id"] for c in table["cols"]]
    ops = []
    for r in table["rows"]:
        row = dict(zip(cols, [c.get("v") if c else None for c in r["c"]]))
        if row.get("type") == "IDLE":
            continue
        ops.append(
            {
                "type": row["type"],
                "op": row["operation"],
                "self_ms": round(float(row["total_self_time"]) / 1000.0 / steps, 3),
                "calls": round(float(row["occurrences"]) / steps, 2),
            }
        )
    ops.sort(key=lambda o: -o["self_ms"])
    return ops[:top]
