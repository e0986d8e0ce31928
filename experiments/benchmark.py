"""Benchmark of one DP-SGD training step against the non-private step.

Contract: for every (model, method, batch size) configuration, one child process builds the
model, traces the step, runs ``--warmup`` untimed steps and then ``--steps`` timed ones, and
reports the median milliseconds per training step (forward + backward + clip + noise + apply),
its peak resident memory (whole process, and during the timed steps alone) and, on a GPU, peak
device memory. One process per configuration keeps each peak-memory figure its own. The parent
process runs the non-private configuration of each (model, batch size) first and reports every
other row's ratio to it, measured in the same run. A per-row timeout and a per-row resident
memory cap stop pathological configurations (the row says so instead of hanging the run).

With ``--peer``, the same rows are produced for TensorFlow Privacy 0.9.0 by
``experiments/peers/bench.py`` in its own TensorFlow 2.15 virtual environment; each peer row's
ratio is to the peer's own non-private step.

Methods (dpcore side), the path users run (ratios to the plain Keras ``fit`` row):
  nonprivate        plain Keras: ``model.compile(SGD, loss)`` and ``fit`` (mean loss, one
                    backward pass, apply). Timed per step inside one ``fit`` call.
  make_private_fit  ``dpcore.make_private(model, ...)`` and ``fit`` on the same model, batches
                    and optimizer, default ``ExecutionOptions``; timed like ``nonprivate``.
  dp_train_step     ``dpcore.dp_train_step`` with a ``DPOptimizer`` inside the user's own
                    ``tf.function`` (the custom-training-loop path).
  make_private_fit_aug4
                    ``make_private(..., augmentations=4)``: each example's 4 views form one
                    privacy unit, clipped once. The batch size counts rows (4 views per
                    example), so the step takes batch / 4 examples and processes as many rows
                    as the ``nonprivate`` row of that batch size, its baseline.
  make_private_fit_user8
                    ``make_private(..., options=ExecutionOptions(group_size=8))``: user-level
                    units of 8 rows, batch / 8 units per step: the same rows as the baseline.

Engine-level breakdown (a hand-written step around one engine call; ratios to
``nonprivate_step`` when that row is run, else to ``nonprivate``):
  nonprivate_step   mean loss, one backward pass, apply, in one ``tf.function`` (no Keras
                    ``fit`` machinery): the breakdown's baseline.
  loop        a ``tf.while_loop`` over examples, batch size 1 each: per-example gradient, clip,
              accumulate (the textbook reference; slow).
  jacobian    ``tape.jacobian`` of the ``[B]`` per-example losses (what TF Privacy's
              microbatched optimizer does).
  vectorized  ``dpcore.engine.summarize(method="vectorized")``.
  fast        ``dpcore.engine.summarize(method="fast")`` (ghost norms + book-keeping).

KerasHub models (dpcore only, opt-in: not in the default ``--models``, no peer rows):
``bert``, ``gpt2`` (2 layers, hidden 256, T = 128, vocabulary 8192), ``bert_lora``,
``gpt2_lora`` (the same with rank-8 LoRA) and ``gpt2_small`` (12 layers, hidden 768, vocabulary
50257, T = 256); see :mod:`dpcore_experiments.lib.hub_models`. Both sides of a ratio compile alike:
SGD, the same loss, no metrics (a KerasHub task compiles itself with Adam and an accuracy
metric when it is built, and recompiling with ``metrics=None`` keeps that metric: the plain side
passes empty lists) and ``jit_compile=False`` (the ``DPModel`` default; plain Keras' ``"auto"``
would turn XLA on for the non-private side alone on a GPU).

Usage:
  python experiments/benchmark.py --models=mlp,cnn --methods=nonprivate,vectorized,fast \
      --batch_sizes=64,256 --steps=10 --json=bench.json
  python experiments/benchmark.py --models=bert,gpt2,bert_lora,gpt2_lora \
      --methods=nonprivate,make_private_fit --batch_sizes=32 --steps=5
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags
from dpcore_experiments.lib import common, hub_models, zoo

MODELS = zoo.BENCH_MODELS
HUB_MODELS = hub_models.BENCH_MODELS  # dpcore-only, opt-in (never in the default --models)
# make_private(...).fit with privacy units of several rows: (augmentations, group_size). Their
# batch size counts rows, like the nonprivate Keras fit row they are compared with.
UNIT_FIT_METHODS = {"make_private_fit_aug4": (4, 1), "make_private_fit_user8": (1, 8)}
USER_METHODS = ("nonprivate", "make_private_fit", "dp_train_step", *UNIT_FIT_METHODS)
ENGINE_METHODS = ("nonprivate_step", "loop", "jacobian", "vectorized", "fast")
METHODS = USER_METHODS + ENGINE_METHODS
FIT_METHODS = ("nonprivate", "make_private_fit", *UNIT_FIT_METHODS)
SLOW_METHODS = ("loop", "jacobian")
PEER_METHODS = ("nonprivate", "dpkeras", "dpsequential", "vectorized")
RESULT_PREFIX = "BENCH_RESULT "

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """Defines the command-line flags (called only when run as a program).

    Keeping flag definitions out of import time lets the experiment modules be imported
    together (tests, other binaries) without duplicate-flag errors.
    """
    flags.DEFINE_list(
        "models", list(MODELS), f"Models, from {MODELS}, or the opt-in KerasHub {HUB_MODELS}."
    )
    flags.DEFINE_list("methods", list(METHODS), f"dpcore methods, from {METHODS}.")
    flags.DEFINE_list("batch_sizes", ["64", "256", "1024"], "Batch sizes.")
    flags.DEFINE_integer("steps", 10, "Timed steps per configuration (the median is reported).")
    flags.DEFINE_integer("warmup", 2, "Untimed steps first (the first one traces).")
    flags.DEFINE_integer(
        "slow_max_batch",
        256,
        "loop/jacobian (and the peer's dpkeras/vectorized) rows above this batch size are skipped "
        "and marked so; they take minutes per step there.",
    )
    flags.DEFINE_integer("slow_steps", 3, "Timed steps for loop/jacobian rows (capped, marked).")
    flags.DEFINE_float(
        "step_budget_s",
        60.0,
        "Fewer timed steps (at least 3) where --steps of them would take longer than this.",
    )
    flags.DEFINE_float("row_timeout_s", 600.0, "Wall-clock limit of one configuration's process.")
    flags.DEFINE_float("max_rss_mb", 12000.0, "A configuration whose RSS passes this is stopped.")
    flags.DEFINE_float("l2_norm_clip", 1.0, "Clip bound C of the DP step.")
    flags.DEFINE_float("noise_multiplier", 1.0, "Noise multiplier of the DP step.")
    flags.DEFINE_float("learning_rate", 0.01, "SGD learning rate (every method).")
    flags.DEFINE_integer(
        "profile_ops",
        0,
        "If > 0 (dpcore rows only), profile --profile_steps more steps with the TensorFlow "
        "profiler after the timed ones and report the ops with the most self time per step.",
    )
    flags.DEFINE_integer("profile_steps", 5, "Steps profiled for --profile_ops.")
    flags.DEFINE_string("json", None, "Write the rows (a JSON list) here.")
    flags.DEFINE_string("markdown", None, "Write the tables (Markdown) here.")
    flags.DEFINE_bool("peer", False, "Also run TensorFlow Privacy 0.9.0 in its own TF 2.15 env.")
    flags.DEFINE_list(
        "peer_methods",
        ["nonprivate", "dpkeras", "dpsequential"],
        f"Peer methods, from {PEER_METHODS}.",
    )
    flags.DEFINE_string(
        "peer_python", None, "Python of the peer env (default: built on first use)."
    )
    flags.DEFINE_string("child", None, "Internal: run one 'model,method,batch' row and print it.")


# ---------------------------------------------------------------------------------------------
# Models and data (the child process side).


def build_model(name: str, *, seed: int = 0) -> Any:
    """The benchmark model of that name (a built Keras 3 model; :mod:`dpcore_experiments.lib.zoo`,
    or :mod:`dpcore_experiments.lib.hub_models` for ``HUB_MODELS``).

    Args:
      name: one of ``MODELS`` or ``HUB_MODELS``.
      seed: weight initialization seed.

    Returns:
      A Functional or Sequential Keras model (a KerasHub task for ``HUB_MODELS``) producing
      logits.
    """
    import keras

    keras.utils.set_random_seed(seed)
    if name in HUB_MODELS:
        return hub_models.build_bench_model(name)
    return zoo.build_bench_model(keras, name)


def make_batch(name: str, batch_size: int, *, seed: int = 0) -> tuple[Any, Any]:
    """A synthetic batch ``(x, y)`` (numpy; ``x`` a dict for ``HUB_MODELS``) for that model."""
    if name in HUB_MODELS:
        return hub_models.make_bench_batch(name, batch_size, seed=seed)
    return zoo.make_bench_batch(name, batch_size, seed=seed)


# ---------------------------------------------------------------------------------------------
# DP steps built directly from the engine and aggregation APIs.


def _dense(g: Any) -> Any:
    import tensorflow as tf

    return tf.convert_to_tensor(g)


def _summary_from_grads(variables, grads, losses, y_pred) -> Any:
    """A GradientSummary over materialized per-example gradients ``[B, *var.shape]``."""
    import tensorflow as tf

    from dpcore import norms
    from dpcore.engine.summary import GradientSummary

    flat = [tf.reshape(g, [tf.shape(g)[0], -1]) for g in grads]
    # float64 certified bounds (the GradientSummary contract), the clipped sum is a matvec of flat.
    sq = tf.stack([norms.sq_norm_bound(f) for f in flat], axis=1)

    def weighted_sum(weights):
        return [
            tf.reshape(tf.linalg.matvec(f, weights[:, v], transpose_a=True), tf.shape(g)[1:])
            for v, (f, g) in enumerate(zip(flat, grads))
        ]

    return GradientSummary(
        variables=tuple(variables),
        sq_norms=sq,
        per_example_loss=losses,
        mask=tf.ones_like(losses),
        y_pred=y_pred,
        weighted_sum=weighted_sum,
    )


def _loop_clipped_sum(model, loss_fn, x, y, variables, *, l2_norm_clip: float) -> Any:
    """Clipped sum by a loop over examples, one batch-size-1 backward pass each."""
    import tensorflow as tf

    from dpcore import norms as dp_norms
    from dpcore.aggregation import ClippedSum, clip_factors, round_down_f32, total_norm_bound

    b = tf.shape(y)[0]

    def factor(norm):
        """float32 clip factor rounded toward zero, as ``aggregation.clip`` forms it."""
        return round_down_f32(clip_factors(norm, l2_norm_clip=l2_norm_clip))

    def body(i, acc, norms, losses):
        xi, yi = x[i : i + 1], y[i : i + 1]
        with tf.GradientTape() as tape:
            li = tf.reduce_sum(loss_fn(yi, model(xi, training=True)))
        g = tape.gradient(li, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        g = [_dense(t) for t in g]
        # float64 upper bound of the norm (certified, combined as aggregation.clip does).
        sq = [dp_norms.sq_norm_bound(t[None], weighted_by_matmul=False) for t in g]
        norm = total_norm_bound(tf.stack(sq, axis=1))[0]
        acc = [a + factor(norm) * t for a, t in zip(acc, g)]
        return i + 1, acc, norms.write(i, tf.cast(norm, tf.float32)), losses.write(i, li)

    acc0 = [tf.zeros(v.shape, v.dtype) for v in variables]
    # Two arrays: one TensorArray passed twice aliases norms and losses when run eagerly.
    norms_ta, losses_ta = (tf.TensorArray(tf.float32, size=b) for _ in range(2))
    _, acc, norms, losses = tf.while_loop(
        lambda i, *_: i < b,
        body,
        [tf.constant(0), acc0, norms_ta, losses_ta],
        parallel_iterations=1,
    )
    norms = norms.stack()
    return ClippedSum(
        grads=tuple(acc),
        l2_sensitivity=float(l2_norm_clip),
        num_examples=tf.cast(b, tf.float32),
        per_example_norms=norms,
        clip_weights=factor(norms)[:, None],
        per_example_loss=losses.stack(),
    )


def make_fit_model(
    model: Any,
    method: str,
    *,
    batch_size: int,
    l2_norm_clip: float,
    noise_multiplier: float,
    learning_rate: float,
) -> Any:
    """The compiled model whose ``fit`` a ``nonprivate`` / ``make_private_fit`` row runs.

    Both compile the same model with SGD and the same loss, no metrics and
    ``jit_compile=False`` (a KerasHub task compiles itself with default metrics when built, and
    a later ``compile(metrics=None)`` keeps them; plain Keras' ``"auto"`` would compile with XLA
    on a GPU, the ``DPModel`` does not);
    ``make_private_fit`` wraps it with ``dpcore.make_private`` (default
    :class:`dpcore.ExecutionOptions`).

    Privacy:
      ``make_private_fit`` clips and noises every step (benchmark only: synthetic data, no
      accounting).
    """
    import keras

    optimizer = keras.optimizers.SGD(learning_rate=learning_rate)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if method == "nonprivate":
        # Empty lists, not None: recompiling with None keeps the previous compile's metrics, and
        # a KerasHub task compiles itself on construction (GPT2CausalLM: an accuracy metric,
        # an argmax over every [B, T, vocab] logit each step).
        model.compile(
            optimizer=optimizer, loss=loss, metrics=[], weighted_metrics=[], jit_compile=False
        )
        return model
    if method not in FIT_METHODS:
        raise ValueError(f"method={method!r}; expected one of {FIT_METHODS}.")
    import dpcore
    from dpcore.options import ExecutionOptions

    augmentations, group_size = UNIT_FIT_METHODS.get(method, (1, 1))
    rows_per_unit = augmentations * group_size
    if batch_size % rows_per_unit:
        raise ValueError(f"{method} needs a batch size (rows) divisible by {rows_per_unit}.")
    return dpcore.make_private(
        model,
        optimizer=optimizer,
        loss=loss,
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=noise_multiplier,
        expected_batch_size=batch_size // rows_per_unit,
        augmentations=augmentations,
        options=ExecutionOptions(group_size=group_size),
        sampling="shuffle",  # one fixed batch per step: the step's cost, not a sampler's
        jit_compile=False,
    )


def fit_batch(method: str, x: Any, y: Any) -> tuple[Any, Any]:
    """What a fit row feeds each step, given ``batch_size`` rows ``(x, y)``: all of them, or the
    first ``batch_size / 4`` examples for ``make_private_fit_aug4`` (its step makes the views)."""
    import tensorflow as tf

    augmentations, _ = UNIT_FIT_METHODS.get(method, (1, 1))
    if augmentations == 1:
        return x, y
    examples = int(tf.nest.flatten(y)[0].shape[0]) // augmentations
    return tf.nest.map_structure(lambda t: t[:examples], (x, y))


def make_train_step(
    model: Any,
    method: str,
    *,
    batch_size: int,
    l2_norm_clip: float,
    noise_multiplier: float,
    learning_rate: float,
    info: dict | None = None,
) -> Callable[[Any, Any], Any]:
    """One training step ``step(x, y) -> loss`` for the given method.

    ``nonprivate`` and ``make_private_fit`` return one ``fit`` call on the one batch (for tests
    and profiling; :func:`measure` times their steps inside a single ``fit``). The others return
    a ``tf.function``.

    Args:
      model: a built Keras model.
      method: one of ``METHODS``.
      batch_size: used as ``expected_batch_size`` of the DP step.
      l2_norm_clip: clip bound C.
      noise_multiplier: noise std / C.
      learning_rate: SGD learning rate.
      info: if given, filled at trace time with the engine's per-variable paths.

    Returns:
      A ``tf.function``; the DP variants clip, add noise (seed advanced every step) and apply.

    Privacy:
      The DP variants clip every example to ``l2_norm_clip`` and add Gaussian noise once per step
      (benchmark only: the data are synthetic and no accounting is done).
    """
    import keras
    import tensorflow as tf

    from dpcore import aggregation, engine
    from dpcore.options import ExecutionOptions

    if method not in METHODS:
        raise ValueError(f"method={method!r}; expected one of {METHODS}.")
    if method in FIT_METHODS:
        fit_model = make_fit_model(
            model,
            method,
            batch_size=batch_size,
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier,
            learning_rate=learning_rate,
        )

        def fit_step(x, y):
            ds = tf.data.Dataset.from_tensors(fit_batch(method, x, y))
            return fit_model.fit(ds, epochs=1, verbose=0, shuffle=False).history["loss"][-1]

        fit_step.fit_model = fit_model  # measure() times its steps inside one fit
        return fit_step
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    variables = list(model.trainable_variables)
    opt = keras.optimizers.SGD(learning_rate=learning_rate)
    opt.build(variables)
    seed = tf.Variable([0, 0], dtype=tf.int64, trainable=False)
    info = {} if info is None else info

    def privatize_and_apply(clipped):
        s = seed.read_value()
        seed.assign_add(tf.constant([0, 1], tf.int64))
        grads = aggregation.privatize(
            clipped,
            noise_multiplier=noise_multiplier,
            expected_batch_size=batch_size,
            seed=s,
        )
        opt.apply(grads, variables)
        return tf.reduce_mean(clipped.per_example_loss)

    if method == "dp_train_step":
        import dpcore

        dp_optimizer = dpcore.DPOptimizer(
            keras.optimizers.SGD(learning_rate=learning_rate),
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier,
            expected_batch_size=batch_size,
        )

        @tf.function
        def custom_loop_step(x, y):
            return dpcore.dp_train_step(model, loss_fn, x, y, optimizer=dp_optimizer)

        return custom_loop_step

    @tf.function
    def step(x, y):
        if method == "nonprivate_step":
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(y, model(x, training=True)))
            opt.apply(tape.gradient(loss, variables), variables)
            return loss
        if method == "loop":
            clipped = _loop_clipped_sum(model, loss_fn, x, y, variables, l2_norm_clip=l2_norm_clip)
            return privatize_and_apply(clipped)
        if method == "jacobian":
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                losses = loss_fn(y, y_pred)
            jac = tape.jacobian(
                losses, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
            summary = _summary_from_grads(variables, [_dense(j) for j in jac], losses, y_pred)
        else:
            summary = engine.summarize(
                model, loss_fn, x, y, variables=variables, options=ExecutionOptions(method=method)
            )
        info["paths"] = dict(summary.paths)
        return privatize_and_apply(aggregation.clip(summary, l2_norm_clip=l2_norm_clip))

    return step


# ---------------------------------------------------------------------------------------------
# Measuring one configuration (inside its own process).


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
      A row with ``median_ms``, ``step_ms`` (every timed step), ``peak_rss_mb`` (whole process),
      ``step_peak_rss_mb`` (peak during the timed steps, tracing excluded), ``rss_anon_after_mb``
      and ``rss_file_after_mb`` (resident memory after the steps: anonymous pages, then pages of
      mapped files such as the libraries' code), ``peak_device_mb`` (GPU only), ``trace_s`` (the
      first call) and the engine paths taken.

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
    top = (
        profile_top_ops(step, (x, y), top=profile_ops, steps=profile_steps) if profile_ops else None
    )
    return {
        "top_ops": top,
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "step_ms": [round(t, 3) for t in times],
        "steps_timed": steps,
        "trace_s": round(trace_s, 3),
        "peak_rss_mb": common.peak_rss_mb(),
        "step_peak_rss_mb": None if step_peak is None else step_peak / 1024,
        "rss_before_steps_mb": rss_before_mb,
        "rss_anon_after_mb": None if rss_anon is None else rss_anon / 1024,
        "rss_file_after_mb": None if rss_file is None else rss_file / 1024,
        "peak_device_mb": _gpu_memory(),
        "params": int(sum(int(tf.size(v)) for v in model.trainable_variables)),
        "final_loss": loss,
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
    import glob
    import tempfile

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


# ---------------------------------------------------------------------------------------------
# The parent: one subprocess per configuration.


def run_subprocess(
    cmd: Sequence[str], *, timeout_s: float, max_rss_mb: float, env: dict | None = None
) -> dict:
    """Runs one configuration's process; returns its result row fields or why it has none.

    The child prints one line ``BENCH_RESULT {json}``. The parent watches its RSS and wall time
    and kills it (status ``memory_cap`` / ``timeout``) past the limits.
    """
    env = dict(os.environ if env is None else env)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    status, max_seen = None, 0.0
    while proc.poll() is None:
        max_seen = max(max_seen, (common.proc_status_kb("VmRSS", proc.pid) or 0.0) / 1024)
        if max_seen > max_rss_mb:
            status = "memory_cap"
        elif time.perf_counter() - start > timeout_s:
            status = "timeout"
        if status:
            proc.kill()
            break
        time.sleep(0.1)
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    if status:
        limit = f"{max_rss_mb:.0f} MB RSS" if status == "memory_cap" else f"{timeout_s:.0f} s"
        return {"status": status, "note": f"stopped at {limit}", "wall_s": round(wall, 1)}
    for line in out.splitlines():
        if line.startswith(RESULT_PREFIX):
            row = json.loads(line[len(RESULT_PREFIX) :])
            row["wall_s"] = round(wall, 1)
            return row
    tail = [ln for ln in (err or "").splitlines() if ln.strip()][-3:]
    return {
        "status": "error",
        "note": f"exit {proc.returncode}: " + " | ".join(tail)[-500:],
        "wall_s": round(wall, 1),
    }


def child_main(spec: str) -> None:
    """Runs one ``model,method,batch`` configuration and prints its row."""
    model_name, method, batch = spec.split(",")
    batch_size = int(batch)
    steps = FLAGS.slow_steps if method in SLOW_METHODS else FLAGS.steps
    row: dict[str, Any] = {"impl": "dpcore", "model": model_name, "method": method}
    row["batch_size"] = batch_size
    try:
        row.update(
            measure(
                model_name,
                method,
                batch_size,
                steps=steps,
                warmup=FLAGS.warmup,
                step_budget_s=FLAGS.step_budget_s,
                l2_norm_clip=FLAGS.l2_norm_clip,
                noise_multiplier=FLAGS.noise_multiplier,
                learning_rate=FLAGS.learning_rate,
                profile_ops=FLAGS.profile_ops,
                profile_steps=FLAGS.profile_steps,
            )
        )
        row["status"] = "ok"
        if row["steps_timed"] < FLAGS.steps:
            row["note"] = f"capped: {row['steps_timed']} timed steps"
    except Exception as err:  # reported in the row, not raised: the run goes on
        row["status"] = "unavailable" if isinstance(err, ImportError) else "error"
        msg = [ln for ln in str(err).splitlines() if ln.strip()]
        row["note"] = f"{type(err).__name__}: {(msg[-1] if msg else '')[:400]}"
    print(RESULT_PREFIX + json.dumps(row), flush=True)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Adds each row's time and memory ratios to its baseline row of the same impl/model/batch.

    The baseline (``baseline`` in the row) is ``nonprivate`` (dpcore: plain Keras ``fit``; the
    peer: its own non-private step), except that dpcore's engine-level breakdown rows
    (``ENGINE_METHODS``) compare to ``nonprivate_step`` when that row was run.
    """
    ok_rows = {
        (r["impl"], r["model"], r["batch_size"], r["method"]): r
        for r in rows
        if r.get("status") == "ok"
    }
    for r in rows:
        key = (r["impl"], r["model"], r["batch_size"])
        baseline = "nonprivate"
        if r["impl"] == "dpcore" and r["method"] in ENGINE_METHODS:
            if (*key, "nonprivate_step") in ok_rows:
                baseline = "nonprivate_step"
        r["baseline"] = baseline
        b = ok_rows.get((*key, baseline))
        ok = r.get("status") == "ok" and b is not None
        r["ratio_to_nonprivate"] = r["median_ms"] / b["median_ms"] if ok else None
        # Fastest step over fastest step: less sensitive to other load on a shared machine.
        r["min_ratio_to_nonprivate"] = (
            min(r["step_ms"]) / min(b["step_ms"]) if ok and r.get("step_ms") else None
        )
        r["rss_ratio_to_nonprivate"] = r["peak_rss_mb"] / b["peak_rss_mb"] if ok else None
        sp, bp = r.get("step_peak_rss_mb"), (b or {}).get("step_peak_rss_mb")
        r["step_rss_ratio_to_nonprivate"] = sp / bp if ok and sp and bp else None
    return rows


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _column(impl: str, method: str) -> str:
    """A method's column head: user path as is, engine breakdown and peer labelled."""
    if impl != "dpcore":
        return f"peer {method}"
    return f"{method} (engine)" if method in ENGINE_METHODS else method


def _baseline_label(row: dict) -> str:
    base = row.get("baseline")
    if base is None:
        return "-"
    if row["impl"] == "dpcore" and base == "nonprivate":
        return "Keras fit"
    return base


def format_tables(rows: list[dict]) -> str:
    """Markdown: a full table of rows and a compact ratio table per (model, batch).

    Each row's ratio is to its ``baseline`` (see :func:`add_ratios`): the user-path rows to the
    plain Keras ``fit`` row, the engine-level breakdown rows (marked "engine") to
    ``nonprivate_step`` where it was run.
    """
    lines = [
        "| model | batch | impl | method | median ms | x baseline | baseline | peak RSS MB "
        "| step peak RSS MB | x RSS (step) | status / note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = r.get("status", "")
        if r.get("note"):
            note += f": {r['note']}"
        if r.get("paths") and r["method"] in ("fast", "dpsequential"):
            note += " paths " + ",".join(f"{k}={v}" for k, v in sorted(r["paths"].items()))
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {r['impl']} | {_column(r['impl'], r['method'])} "
            f"| {_fmt(r.get('median_ms'))} | {_fmt(r.get('ratio_to_nonprivate'), '.2f')} "
            f"| {_baseline_label(r)} "
            f"| {_fmt(r.get('peak_rss_mb'), '.0f')} | {_fmt(r.get('step_peak_rss_mb'), '.0f')} "
            f"| {_fmt(r.get('step_rss_ratio_to_nonprivate'), '.2f')} | {note} |"
        )
    cols = []
    for r in rows:
        key = (r["impl"], r["method"])
        if r["method"] != "nonprivate" and key not in cols:
            cols.append(key)
    head = ["model", "batch", "non-private ms"] + [_column(i, m) for i, m in cols]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = []
    for r in rows:
        if (r["model"], r["batch_size"]) not in keys:
            keys.append((r["model"], r["batch_size"]))
    index = {(r["impl"], r["model"], r["batch_size"], r["method"]): r for r in rows}
    for model, batch in keys:
        np_row = index.get(("dpcore", model, batch, "nonprivate"), {})
        cells = [model, str(batch), _fmt(np_row.get("median_ms"))]
        for impl, method in cols:
            r = index.get((impl, model, batch, method))
            if r is None:
                cells.append("")
            elif r.get("ratio_to_nonprivate") is not None:
                cells.append(f"{r['ratio_to_nonprivate']:.2f}x")
            else:
                cells.append(r.get("status", "-"))
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        if r.get("top_ops"):
            lines += [
                "",
                f"Top ops by self time, {r['model']} {r['method']} batch {r['batch_size']} "
                "(ms per step; concurrent ops overlap):",
                "",
                "| self ms | calls | type | op |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| {_fmt(o['self_ms'], '.2f')} | {_fmt(o['calls'], 'g')} | {o['type']} "
                f"| {o['op'][:80]} |"
                for o in r["top_ops"]
            ]
    return "\n".join(lines) + "\n"


def peer_python() -> str:
    """Path of the peer env's Python (TF 2.15.1 + tensorflow-privacy 0.9.0), built on first use.

    ``--peer_python`` if given, else :func:`dpcore_experiments.peers.env.ensure_peer_env`.
    """
    if FLAGS.peer_python:
        return FLAGS.peer_python
    from dpcore_experiments.peers.env import ensure_peer_env

    return str(ensure_peer_env())


def _rows_plan(models, methods, batch_sizes) -> list[tuple[str, str, int]]:
    plan = []
    for model in models:
        for b in batch_sizes:
            ordered = ["nonprivate"] + [m for m in methods if m != "nonprivate"]
            plan += [(model, m, b) for m in ordered]
    return plan


def _common_flags() -> list[str]:
    return [
        f"--steps={FLAGS.steps}",
        f"--warmup={FLAGS.warmup}",
        f"--slow_steps={FLAGS.slow_steps}",
        f"--step_budget_s={FLAGS.step_budget_s}",
        f"--l2_norm_clip={FLAGS.l2_norm_clip}",
        f"--noise_multiplier={FLAGS.noise_multiplier}",
        f"--learning_rate={FLAGS.learning_rate}",
    ]


def run_benchmark() -> list[dict]:
    """Runs every configuration (and the peer's, with ``--peer``); returns rows with ratios."""
    for m in FLAGS.models:
        if m not in MODELS + HUB_MODELS:
            raise app.UsageError(
                f"--models: unknown {m!r}; expected some of {MODELS} or {HUB_MODELS}."
            )
    for m in FLAGS.methods:
        if m not in METHODS:
            raise app.UsageError(f"--methods: unknown {m!r}; expected some of {METHODS}.")
    for m in FLAGS.peer_methods:
        if m not in PEER_METHODS:
            raise app.UsageError(f"--peer_methods: unknown {m!r}; expected some of {PEER_METHODS}.")
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    # Side by side: each (model, batch) runs dpcore's rows, then the peer's, non-private first.
    jobs = []
    for model in FLAGS.models:
        for b in batch_sizes:
            jobs += [("dpcore", *c) for c in _rows_plan([model], FLAGS.methods, [b])]
            if FLAGS.peer and model not in HUB_MODELS:  # the peer has no KerasHub
                jobs += [("peer", *c) for c in _rows_plan([model], FLAGS.peer_methods, [b])]
    if FLAGS.peer:
        peer_py = peer_python()
        peer_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "bench.py")
    rows = []
    for k, (side, model, method, b) in enumerate(jobs, 1):
        slow = method in (SLOW_METHODS if side == "dpcore" else ("dpkeras", "vectorized"))
        row = {"impl": "dpcore" if side == "dpcore" else "tf_privacy-0.9.0"}
        row.update(model=model, method=method, batch_size=b, median_ms=None, peak_rss_mb=None)
        if slow and b > FLAGS.slow_max_batch:
            row.update(status="skipped", note=f"batch > --slow_max_batch={FLAGS.slow_max_batch}")
        else:
            if side == "dpcore":
                cmd = [sys.executable, os.path.abspath(__file__), f"--child={model},{method},{b}"]
                cmd += [
                    f"--profile_ops={FLAGS.profile_ops}",
                    f"--profile_steps={FLAGS.profile_steps}",
                ]
            else:
                cmd = [peer_py, peer_script, f"--model={model}", f"--method={method}"]
                cmd += [f"--batch_size={b}"]
            row.update(
                run_subprocess(
                    cmd + _common_flags(),
                    timeout_s=FLAGS.row_timeout_s,
                    max_rss_mb=FLAGS.max_rss_mb,
                )
            )
            row["impl"] = "dpcore" if side == "dpcore" else "tf_privacy-0.9.0"
        print(
            f"[{k}/{len(jobs)}] {row['impl']} {model} {method} b={b}: {row.get('status')} "
            f"{_fmt(row.get('median_ms'))} ms, peak RSS {_fmt(row.get('peak_rss_mb'), '.0f')} MB"
            + (f" ({row['note']})" if row.get("note") else ""),
            flush=True,
        )
        rows.append(row)
        if FLAGS.json:  # rows so far, so an interrupted run keeps what it measured
            common.write_json_atomic(FLAGS.json, add_ratios([dict(r) for r in rows]), indent=1)
    return add_ratios(rows)


def main(argv: Sequence[str]) -> None:
    del argv
    if FLAGS.child:
        child_main(FLAGS.child)
        return
    rows = run_benchmark()
    tables = format_tables(rows)
    print(tables)
    if FLAGS.json:
        common.write_json_atomic(FLAGS.json, rows, indent=1)
    if FLAGS.markdown:
        with open(FLAGS.markdown, "w") as f:
            f.write(tables)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
