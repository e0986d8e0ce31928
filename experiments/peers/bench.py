"""Peer side of the benchmark: one TensorFlow Privacy 0.9.0 training-step configuration.

Contract: runs inside the peer's own environment (TensorFlow 2.15.1, Keras 2,
tensorflow-privacy 0.9.0; see ``experiments/benchmark.py --peer``), never in dpcore's. It builds
the same four benchmark models as ``experiments/benchmark.py`` (``experiments/lib/zoo.py``) with
``tf.keras``, times the
compiled model's own ``train_step`` (wrapped in one ``tf.function``) for one method and prints one line ``BENCH_RESULT {json}`` with the same
fields as dpcore's rows. It imports nothing from dpcore.

Methods:
  nonprivate    plain SGD, mean loss (the peer's own baseline; ratios are to it).
  dpkeras       ``DPKerasSGDOptimizer`` with ``num_microbatches`` = batch size (per-example
                clipping through ``tape.jacobian``).
  vectorized    ``VectorizedDPKerasSGDOptimizer``, same microbatching.
  dpsequential  ``DPSequential`` / ``DPModel`` with a layer registry (fast gradient clipping).
                Its registry covers Dense and Embedding (plus LayerNormalization and
                MultiHeadAttention here); a model with any other trainable layer (Conv) falls
                back to its vectorized per-microbatch path, reported as ``fast_clipping: false``.
                ``use_xla=False``, like every other row.

Usage (inside the peer env):
  python experiments/peers/bench.py --model=mlp --method=dpsequential --batch_size=256
"""

import json
import os
import statistics
import sys
import time

# experiments/lib, where common.py and zoo.py live, as plain modules: this runs in the peer's
# environment, where dpcore_experiments is not installed.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "lib"))
import common  # noqa: E402  (stdlib only)
import zoo  # noqa: E402  (plain Keras builders, Keras 2 and 3: the same models as dpcore's benchmark)
from absl import app, flags  # noqa: E402

RESULT_PREFIX = "BENCH_RESULT "
MODELS = zoo.BENCH_MODELS
METHODS = ("nonprivate", "dpkeras", "vectorized", "dpsequential")
SLOW_METHODS = ("dpkeras", "vectorized")

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "mlp", MODELS, "Benchmark model.")
flags.DEFINE_enum("method", "nonprivate", METHODS, "Peer method.")
flags.DEFINE_integer("batch_size", 64, "Batch size.")
flags.DEFINE_integer("steps", 10, "Timed steps.")
flags.DEFINE_integer("warmup", 2, "Untimed steps first (the first one traces).")
flags.DEFINE_integer("slow_steps", 3, "Timed steps for the microbatched optimizers.")
flags.DEFINE_float("step_budget_s", 60.0, "Fewer timed steps (at least 3) past this budget.")
flags.DEFINE_float("l2_norm_clip", 1.0, "Clip bound.")
flags.DEFINE_float("noise_multiplier", 1.0, "Noise multiplier.")
flags.DEFINE_float("learning_rate", 0.01, "SGD learning rate.")


def _registry():
    import tensorflow as tf
    from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry

    registry = layer_registry.make_default_layer_registry()
    try:
        from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions import (
            layer_normalization,
            multi_head_attention,
        )

        registry.insert(
            tf.keras.layers.LayerNormalization,
            layer_normalization.layer_normalization_computation,
        )
        registry.insert(
            tf.keras.layers.MultiHeadAttention,
            multi_head_attention.multi_head_attention_layer_computation,
        )
    except (ImportError, AttributeError):
        pass
    return registry


def build(name, method, batch_size):
    """The compiled peer model for one method."""
    import tensorflow as tf
    import tensorflow_privacy as tfp

    tf.keras.utils.set_random_seed(0)
    dp_args = dict(l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=FLAGS.noise_multiplier)
    layers = zoo.bench_layers(tf.keras, name)
    if method == "dpsequential":
        dp_args.update(use_xla=False, layer_registry=_registry())
        if layers is not None:
            model = tfp.DPSequential(layers=layers, **dp_args)
        else:
            inputs, outputs = zoo.bench_graph(tf.keras, name)
            model = tfp.DPModel(inputs=inputs, outputs=outputs, **dp_args)
    elif layers is not None:
        model = tf.keras.Sequential(layers)
    else:
        inputs, outputs = zoo.bench_graph(tf.keras, name)
        model = tf.keras.Model(inputs, outputs)
    reduction = tf.keras.losses.Reduction.AUTO
    if method == "nonprivate" or method == "dpsequential":
        opt = tf.keras.optimizers.SGD(learning_rate=FLAGS.learning_rate)
    else:
        cls = tfp.DPKerasSGDOptimizer if method == "dpkeras" else tfp.VectorizedDPKerasSGDOptimizer
        opt = cls(num_microbatches=batch_size, learning_rate=FLAGS.learning_rate, **dp_args)
        reduction = tf.keras.losses.Reduction.NONE
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    model.compile(optimizer=opt, loss=loss, jit_compile=False)
    return model


def measure(name, method, batch_size, steps, warmup):
    import tensorflow as tf

    model = build(name, method, batch_size)
    xb, yb = zoo.make_bench_batch(name, batch_size)
    x, y = tf.constant(xb), tf.constant(yb)
    # The model's own train_step (DP or not) in one tf.function, like dpcore's rows: no
    # per-call data-adapter overhead of train_on_batch in the baseline or the DP rows.
    train_step = tf.function(lambda x, y: model.train_step((x, y))["loss"])
    t0 = time.perf_counter()
    loss = train_step(x, y)
    trace_s = last_s = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        t0 = time.perf_counter()
        loss = train_step(x, y)
        last_s = time.perf_counter() - t0
    if FLAGS.step_budget_s and last_s > 0:  # same rule as benchmark.planned_steps
        steps = max(min(steps, 3), min(steps, int(FLAGS.step_budget_s / last_s)))
    reset = common.reset_peak_rss()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = train_step(x, y)
        times.append((time.perf_counter() - t0) * 1000.0)
    row = {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "step_ms": [round(t, 3) for t in times],
        "steps_timed": steps,
        "trace_s": round(trace_s, 3),
        "peak_rss_mb": common.peak_rss_mb(),
        "step_peak_rss_mb": common.proc_status_kb("VmHWM") / 1024 if reset else None,
        "peak_device_mb": None,
        "params": int(sum(int(tf.size(v)) for v in model.trainable_variables)),
        "final_loss": float(loss),
        "tf_version": tf.__version__,
    }
    if method == "dpsequential":
        fast = bool(getattr(model, "_enable_fast_peg_computation", False))
        row["paths"] = {"fast_clipping" if fast else "vectorized_microbatch": 1}
    return row


def main(argv):
    del argv
    steps = FLAGS.slow_steps if FLAGS.method in SLOW_METHODS else FLAGS.steps
    row = {"impl": "tf_privacy-0.9.0", "model": FLAGS.model, "method": FLAGS.method}
    row["batch_size"] = FLAGS.batch_size
    try:
        row.update(measure(FLAGS.model, FLAGS.method, FLAGS.batch_size, steps, FLAGS.warmup))
        row["status"] = "ok"
        if row["steps_timed"] < FLAGS.steps:
            row["note"] = f"capped: {row['steps_timed']} timed steps"
    except Exception as err:  # reported in the row
        row["status"] = "error"
        msg = [ln for ln in str(err).splitlines() if ln.strip()]
        row["note"] = f"{type(err).__name__}: {(msg[-1] if msg else '')[:400]}"
    sys.stdout.write(RESULT_PREFIX + json.dumps(row) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
