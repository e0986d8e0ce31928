"""Times ``make_private(...).fit`` steps and plain Keras ``fit`` steps interleaved in one process.

``benchmark.py`` measures every configuration in its own process, one after another; on a shared
machine the load drifts between them by more than the differences being measured. This binary
builds every method's compiled model (same architecture, same seed, same batch) in one process,
traces and warms each up, then runs ``--rounds`` rounds in which each method takes one
``fit`` step, in a fresh random order every round. Drift of the machine's load then falls on all
methods alike, and the ratios to ``nonprivate`` (Keras ``fit``) are read from the same moments.
Each row gives the ratio of the medians, of the fastest steps, and the paired ratio: the median
over rounds of each round's step over that round's Keras step (the steadiest of the three when
the load drifts).

A step is one call of the model's own train function (what ``fit`` calls per batch, with its
``tf.data`` iterator), timed until its logs are on the host.

``make_private_fit_float_labels`` is ``make_private_fit`` fed the same labels as ``float32``
(common with ``SparseCategoricalCrossentropy``); its rows also give the paired ratio to the
integer labels' ``make_private_fit`` steps, which run beside it.

Usage:
  python experiments/dev/interleaved_fit.py --models=mlp,cnn --batch_sizes=256,1024 \\
      --methods=nonprivate,make_private_fit,make_private_fit_aug4,make_private_fit_user8
  python experiments/dev/interleaved_fit.py --models=mlp,cnn --batch_sizes=256,1024 \
      --methods=make_private_fit,make_private_fit_float_labels --rounds=10

Privacy:
  Benchmark only: synthetic data, no accounting. The DP methods clip and noise every step.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from absl import app, flags
from dpcore_experiments.lib import bench_steps as bench

FLAGS = flags.FLAGS

# make_private_fit fed float32 labels; compared with make_private_fit (integer labels).
FLOAT_LABELS = "make_private_fit_float_labels"
METHODS = (*bench.FIT_METHODS, FLOAT_LABELS)


def _define_flags() -> None:
    flags.DEFINE_list("models", ["mlp", "cnn"], "Benchmark models (benchmark.py's names).")
    flags.DEFINE_list("batch_sizes", ["256", "1024"], "Rows per step.")
    flags.DEFINE_list(
        "methods",
        ["nonprivate", "make_private_fit"],
        f"From {METHODS}; nonprivate (Keras fit) is always included.",
    )
    flags.DEFINE_integer("rounds", 30, "Interleaved rounds (each runs every method's step once).")
    flags.DEFINE_integer("warmup", 3, "Untimed steps of each method first (the first traces).")
    flags.DEFINE_string("json", None, "Write the rows (a JSON list) here.")


def _warm_step(
    model_name: str, method: str, x: Any, y: Any, batch_size: int, warmup: int
) -> tuple[Any, Any]:
    """(train function, iterator) of the method's compiled model, traced and warmed up."""
    import tensorflow as tf

    fit_model = bench.make_fit_model(
        bench.build_model(model_name, seed=0),
        "make_private_fit" if method == FLOAT_LABELS else method,
        batch_size=batch_size,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        learning_rate=0.01,
    )
    labels = tf.nest.map_structure(lambda t: tf.cast(t, tf.float32), y)
    batch = (x, labels) if method == FLOAT_LABELS else bench.fit_batch(method, x, y)
    data = tf.data.Dataset.from_tensors(batch).repeat()
    fit_model.fit(data, steps_per_epoch=1, epochs=1, verbose=0)  # builds everything
    iterator = iter(data)
    train_function = fit_model.make_train_function()
    for _ in range(warmup):
        train_function(iterator)
    return train_function, iterator


def measure(
    model_name: str, batch_size: int, methods: list[str], *, rounds: int, warmup: int
) -> list[dict[str, Any]]:
    """One row per method: median and fastest step (ms) and their ratios to ``nonprivate``.

    Args:
      model_name: a benchmark model (``benchmark.MODELS`` or ``benchmark.HUB_MODELS``).
      batch_size: rows per step (``make_private_fit_aug4`` feeds a quarter of them as examples
        and makes 4 views of each, as in ``benchmark.py``).
      methods: ``benchmark.FIT_METHODS`` entries or ``FLOAT_LABELS`` (which brings
        ``make_private_fit`` along); ``nonprivate`` is added first if missing.
      rounds: interleaved rounds.
      warmup: untimed steps per method before the rounds.
    """
    import numpy as np
    import tensorflow as tf

    methods = ["nonprivate", *[m for m in methods if m != "nonprivate"]]
    if FLOAT_LABELS in methods and "make_private_fit" not in methods:
        methods.insert(methods.index(FLOAT_LABELS), "make_private_fit")
    xb, yb = bench.make_batch(model_name, batch_size)
    x, y = tf.nest.map_structure(tf.constant, (xb, yb))
    steps = {m: _warm_step(model_name, m, x, y, batch_size, warmup) for m in methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        for method in rng.permutation(methods):
            train_function, iterator = steps[method]
            start = time.perf_counter()
            logs = train_function(iterator)
            float(logs["loss"])  # waits for the step
            times[method].append((time.perf_counter() - start) * 1e3)
    base = np.asarray(times["nonprivate"])
    base_median, base_min = float(np.median(base)), float(np.min(base))
    rows = [
        {
            "model": model_name,
            "batch_size": batch_size,
            "method": method,
            "rounds": rounds,
            "median_ms": round(float(np.median(t)), 3),
            "min_ms": round(float(np.min(t)), 3),
            "ratio_to_nonprivate": round(float(np.median(t)) / base_median, 3),
            "min_ratio_to_nonprivate": round(float(np.min(t)) / base_min, 3),
            # Each round's step over the same round's Keras step, then the median over rounds:
            # load that drifts between rounds falls on both terms of each ratio.
            "paired_ratio_to_nonprivate": round(float(np.median(np.asarray(t) / base)), 3),
        }
        for method, t in times.items()
    ]
    for row in rows:
        if row["method"] == FLOAT_LABELS:
            ints = np.asarray(times["make_private_fit"])
            paired = np.asarray(times[FLOAT_LABELS]) / ints
            row["paired_ratio_to_int_labels"] = round(float(np.median(paired)), 3)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| model | rows | method | median ms | fastest ms | x Keras fit (median / fastest) "
        "| x Keras fit, paired |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        method = r["method"]
        if "paired_ratio_to_int_labels" in r:
            method += f" ({r['paired_ratio_to_int_labels']:.2f}x int labels, paired)"
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {method} | {r['median_ms']:.1f} | "
            f"{r['min_ms']:.1f} | {r['ratio_to_nonprivate']:.2f}x / "
            f"{r['min_ratio_to_nonprivate']:.2f}x | {r['paired_ratio_to_nonprivate']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    unknown = [m for m in FLAGS.methods if m not in METHODS]
    if unknown:
        raise app.UsageError(f"--methods: {unknown} not in {METHODS}.")
    rows: list[dict[str, Any]] = []
    for model_name in FLAGS.models:
        for batch_size in (int(b) for b in FLAGS.batch_sizes):
            print(f"{model_name} @ {batch_size} rows ...", file=sys.stderr, flush=True)
            rows.extend(
                measure(
                    model_name,
                    batch_size,
                    list(FLAGS.methods),
                    rounds=FLAGS.rounds,
                    warmup=FLAGS.warmup,
                )
            )
    print(markdown(rows))
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(rows, f, indent=1)


def run() -> None:
    _define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
