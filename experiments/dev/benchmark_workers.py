"""benchmark_workers: DP step time on 1 and 2 (or more) local workers of one cluster.

Contract:
  * For each worker count W in `--workers` the driver starts W local workers
    (`dpcore_experiments.lib.workers.launch`, `MultiWorkerMirroredStrategy` on 127.0.0.1) that
    run this program with `--worker_mode`. Every worker times, on each model of `--models`
    (the MLP and CNN of `dpcore_experiments.lib.zoo`), two custom loops under the same strategy over
    the same global batch of `--batch_size` rows (B / W synthetic rows per worker, all real):
    `strategy.run(dpcore.dp_train_step)` (clip per example on each worker, all-reduce the
    clipped sums, noise once) and a non-private step (mean loss gradient, applied by the same
    Keras SGD, which all-reduces it). `--warmup` steps are not timed (tracing), then
    `--steps` steps are, ended by reading a variable (a barrier: steps are collective).
  * The chief writes the timings; the driver gathers them in `--output` (JSON) and prints a
    Markdown table: step time, examples/s, DP/non-private ratio, and the all-reduce bytes per
    step (model size in float32: one all-reduce for the non-private step, two for the DP step,
    the clipped sums and then the inner optimizer's), which do not depend on the batch size.
  * Timings are of this machine as it runs; nothing here asserts a speed.

Example:
  python -m dpcore_experiments.dev.benchmark_workers --workers=1,2 --models=mlp,cnn \\
      --batch_size=256 --output=bench_workers.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("workers", ["1", "2"], "Worker counts to time.")
flags.DEFINE_list("models", ["mlp", "cnn"], "Models of dpcore_experiments.lib.zoo (mlp, cnn).")
flags.DEFINE_integer("batch_size", 256, "Global batch (rows per step over all workers).")
flags.DEFINE_integer("steps", 20, "Timed steps per loop.")
flags.DEFINE_integer("warmup", 3, "Untimed steps per loop (tracing).")
flags.DEFINE_integer("repeats", 3, "Timed runs per loop; the median is reported.")
flags.DEFINE_float("timeout_s", 1200.0, "Kill a launch's workers after this many seconds.")
flags.DEFINE_string("output", None, "JSON file for the gathered results.")
flags.DEFINE_bool("worker_mode", False, "Internal: run as one worker of a launch.")
flags.DEFINE_string("worker_output", None, "Internal: where the chief writes its timings.")


def _time_loops(models: Sequence[str], batch_size: int) -> dict[str, Any]:
    """One worker's part: time the DP and non-private loops of each model (see the contract)."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # before any other TF operation
    from dpcore import distribute

    info = distribute.worker_info(strategy)
    if batch_size % info.num_workers:
        raise ValueError(f"batch_size={batch_size} is not a multiple of {info.num_workers}.")
    return {
        "num_workers": info.num_workers,
        "models": {name: _time_model(strategy, name, batch_size) for name in models},
    }


def _median_step_s(strategy: Any, replica_fn: Any, counter: Any, batches: Any) -> float:
    """Median seconds per step over --repeats runs of --steps steps, after --warmup steps."""
    import tensorflow as tf

    step = tf.function(lambda it: strategy.run(replica_fn, args=next(it)))
    for _ in range(FLAGS.warmup):
        step(batches)
    runs = []
    for _ in range(FLAGS.repeats):
        int(counter.numpy())
        start = time.perf_counter()
        for _ in range(FLAGS.steps):
            step(batches)
        int(counter.numpy())  # waits for the last step
        runs.append((time.perf_counter() - start) / FLAGS.steps)
    return statistics.median(runs)


def _time_model(strategy: Any, name: str, batch_size: int) -> dict[str, Any]:
    """Times the DP and the non-private step of one model on this worker's B / W rows."""
    import keras
    import numpy as np
    import tensorflow as tf
    from dpcore_experiments.lib import zoo

    import dpcore
    from dpcore import distribute

    info = distribute.worker_info(strategy)
    rows = batch_size // info.num_workers
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    x, y = zoo.make_bench_batch(name, rows, seed=1 + info.worker_index)
    data = tf.data.Dataset.from_tensors((x, y, np.ones(rows, "float32"), np.array(True)))
    batches = iter(strategy.distribute_datasets_from_function(lambda _: data.repeat()))
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = zoo.build_bench_model(keras, name)
        dp_opt = dpcore.DPOptimizer(
            keras.optimizers.SGD(0.01),
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            expected_batch_size=batch_size,
        )
        dp_opt.build(model.trainable_variables)
        plain_opt = keras.optimizers.SGD(0.01)
        plain_opt.build(model.trainable_variables)

    def dp_replica(x: Any, y: Any, mask: Any, end: Any) -> None:
        dpcore.dp_train_step(model, loss_fn, x, y, optimizer=dp_opt, mask=mask, step_end=end)

    def plain_replica(x: Any, y: Any, mask: Any, end: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(y, model(x, training=True))) / batch_size
        grads = tape.gradient(loss, model.trainable_variables)
        plain_opt.apply(grads, model.trainable_variables)  # sums over the replicas

    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    dp_s = _median_step_s(strategy, dp_replica, dp_opt.dp_steps, batches)
    plain_s = _median_step_s(strategy, plain_replica, plain_opt.iterations, batches)
    return {
        "params": params,
        "dp_step_ms": 1e3 * dp_s,
        "plain_step_ms": 1e3 * plain_s,
        "dp_examples_per_s": batch_size / dp_s,
        "plain_examples_per_s": batch_size / plain_s,
        "ratio": dp_s / plain_s,
        "allreduce_bytes_plain": 4 * params,
        "allreduce_bytes_dp": 2 * 4 * params,
    }


def _table(gathered: dict[str, Any], batch_size: int) -> str:
    lines = [
        "| model | workers | global batch | DP step (ms) | DP ex/s | non-private step (ms) | "
        "ratio | all-reduce per step (DP / non-private) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workers, result in sorted(gathered.items(), key=lambda kv: int(kv[0])):
        for name, r in result["models"].items():
            lines.append(
                f"| {name} | {workers} | {batch_size} | {r['dp_step_ms']:.1f} | "
                f"{r['dp_examples_per_s']:.0f} | {r['plain_step_ms']:.1f} | {r['ratio']:.2f}x | "
                f"{r['allreduce_bytes_dp'] / 1e6:.2f} MB / "
                f"{r['allreduce_bytes_plain'] / 1e6:.2f} MB |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    del argv
    if FLAGS.worker_mode:
        results = _time_loops(FLAGS.models, FLAGS.batch_size)
        if os.environ.get("DPCORE_WORKER_INDEX", "0") == "0":
            with open(FLAGS.worker_output, "w") as f:
                json.dump(results, f)
        return
    from dpcore_experiments.lib.workers import launch

    folder = tempfile.mkdtemp(prefix="bench_workers_")
    gathered: dict[str, Any] = {}
    for workers in (int(w) for w in FLAGS.workers):
        out = os.path.join(folder, f"workers{workers}.json")
        argv = [
            sys.executable,
            "-m",
            "dpcore_experiments.dev.benchmark_workers",
            "--worker_mode",
            f"--worker_output={out}",
            f"--models={','.join(FLAGS.models)}",
            f"--batch_size={FLAGS.batch_size}",
            f"--steps={FLAGS.steps}",
            f"--warmup={FLAGS.warmup}",
            f"--repeats={FLAGS.repeats}",
        ]
        runs = launch(
            argv,
            workers=workers,
            timeout_s=FLAGS.timeout_s,
            log_dir=os.path.join(folder, f"logs{workers}"),
        )
        failed = [r for r in runs if r.returncode != 0]
        if failed:
            raise SystemExit(f"{workers} worker(s) failed; logs: {failed[0].log_path}")
        with open(out) as f:
            gathered[str(workers)] = json.load(f)
    payload = {
        "batch_size": FLAGS.batch_size,
        "steps": FLAGS.steps,
        "repeats": FLAGS.repeats,
        "cpu_count": os.cpu_count(),
        "results": gathered,
    }
    if FLAGS.output:
        from dpcore_experiments.lib.common import write_json_atomic

        write_json_atomic(FLAGS.output, payload)
    print(_table(gathered, FLAGS.batch_size))


if __name__ == "__main__":
    app.run(main)
