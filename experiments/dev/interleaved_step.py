"""Times a checkout's non-private step and fast DP step interleaved, for before/after comparisons.

The benchmark's per-row processes measure each configuration at a different moment; on a shared,
noisy machine two such rows can drift apart by more than the effect being measured. This binary
runs both steps of one checkout in one process, alternating them in a random order for
``--rounds`` rounds, and prints the median of each and their ratio as JSON. Run it once per
checkout (e.g. two ``git worktree``s, before and after a change), alternating the checkouts, and
compare the ratios: drift of the machine's load cancels within each ratio.

Usage:
  python experiments/dev/interleaved_step.py --tree=/path/to/checkout --model=cnn --batch_size=256
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags() -> None:
    flags.DEFINE_string("tree", ".", "The checkout whose experiments/benchmark.py is timed.")
    flags.DEFINE_string("model", "cnn", "A model of that checkout's benchmark zoo.")
    flags.DEFINE_integer("batch_size", 256, "Batch size.")
    flags.DEFINE_integer("rounds", 30, "Interleaved rounds (each times both steps once).")
    flags.DEFINE_integer("warmup", 3, "Untimed steps of each first (the first one traces).")


def _benchmark_module(tree: str):
    """The checkout's own experiments/benchmark.py (and the dpcore next to it)."""
    sys.path[:0] = [tree, os.path.join(tree, "experiments")]
    path = os.path.join(tree, "experiments", "benchmark.py")
    spec = importlib.util.spec_from_file_location("checkout_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(tree: str, model_name: str, batch_size: int, rounds: int, warmup: int) -> dict:
    """Median step times (ms) of the checkout's non-private and fast DP steps, and their ratio."""
    import numpy as np
    import tensorflow as tf

    bench = _benchmark_module(os.path.abspath(tree))
    # The hand-written non-private step is "nonprivate_step" since the user-path rows came in.
    plain = "nonprivate_step" if "nonprivate_step" in bench.METHODS else "nonprivate"
    xb, yb = bench.make_batch(model_name, batch_size)
    x, y = tf.constant(xb), tf.constant(yb)
    steps = {}
    for method in (plain, "fast"):
        model = bench.build_model(model_name, seed=0)
        steps[method] = bench.make_train_step(
            model,
            method,
            batch_size=batch_size,
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            learning_rate=0.01,
            info={},
        )
        for _ in range(warmup):
            steps[method](x, y)
    times: dict[str, list[float]] = {m: [] for m in steps}
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        for method in rng.permutation(list(steps)):
            start = time.perf_counter()
            out = steps[method](x, y)
            tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)
            times[method].append(time.perf_counter() - start)
    median = {m: float(np.median(v)) * 1e3 for m, v in times.items()}
    return {
        "tree": tree,
        "model": model_name,
        "batch_size": batch_size,
        "median_ms": median,
        "ratio": median["fast"] / median[plain],
    }


def main(argv: list[str]) -> None:
    del argv
    row = measure(FLAGS.tree, FLAGS.model, FLAGS.batch_size, FLAGS.rounds, FLAGS.warmup)
    print(json.dumps(row))


def run() -> None:
    _define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
