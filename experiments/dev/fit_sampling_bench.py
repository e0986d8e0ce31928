"""fit(x, y) with fit's own Poisson sampler vs fit(poisson_batches(...)): ms per logical step.

Same MLP (784-512-256-10, the benchmark zoo's), same config (N=8192, expected batch 256, 32
steps per epoch), one epoch per fit, the two alternated for ``--rounds`` rounds in one process;
each fit's first step (iterator start) is excluded. Prints the median and quartiles per path.

    python experiments/dev/fit_sampling_bench.py --rounds=5
"""

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from absl import app, flags

flags.DEFINE_integer("rounds", 5, "Alternated rounds of one epoch per path.")
FLAGS = flags.FLAGS

N, B = 8192, 256


def _timer() -> Any:
    """A Keras callback that records each step's milliseconds, from the previous step's end."""
    import keras

    class Timer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times, self.last = [], None
            self.begin = time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            if self.last is None:
                self.last = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # waits for the step
            now = time.perf_counter()
            self.times.append((now - self.last) * 1e3)
            self.last = now

    return Timer()


def _alternate(
    runs: dict[str, Callable[[Any], Any]], rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Runs each path once per round, in alternating order: (step ms, fit wall s) per path;
    each fit's first step (the iterator's start) is left out."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    walls: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name, run in runs.items() if r % 2 == 0 else reversed(list(runs.items())):
            timer = _timer()
            start = time.perf_counter()
            run(timer)
            walls[name].append(time.perf_counter() - start)
            times[name] += timer.times[1:]
    return times, walls


def main(argv: list[str]) -> None:
    del argv
    import keras
    import tensorflow as tf
    from dpcore_experiments.lib import bench_steps as bench

    import dpcore

    xb, yb = bench.make_batch("mlp", N)
    x, y = np.asarray(xb), np.asarray(yb)
    config = dpcore.DPConfig(
        l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=B, num_examples=N, steps=10**6
    )

    def private():
        return dpcore.make_private(
            bench.build_model("mlp", seed=0),
            config=config,
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    own, given = private(), private()
    xt, yt = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
    runs = {
        "fit(x, y) [own sampler]": lambda cb: own.fit(x, y, epochs=1, verbose=0, callbacks=[cb]),
        "fit(poisson_batches(...))": lambda cb: given.fit(
            dpcore.sampling.poisson_batches(
                xt, yt, sampling_prob=config.sampling_prob, steps=config.steps_per_epoch
            ),
            epochs=1,
            verbose=0,
            callbacks=[cb],
        ),
    }
    for run in runs.values():  # warm-up: traces
        run(_timer())
    times, walls = _alternate(runs, FLAGS.rounds)
    for name in runs:
        t = np.array(times[name])
        q1, med, q3 = np.percentile(t, [25, 50, 75])
        print(
            f"{name:28s} steps={len(t):4d} ms/step median {med:6.2f} (IQR {q1:.2f}-{q3:.2f}); "
            f"fit wall per epoch median {np.median(walls[name]):.2f} s"
        )
    print(
        "steps per epoch",
        config.steps_per_epoch,
        "dp_steps",
        int(own.optimizer.dp_steps),
        int(given.optimizer.dp_steps),
    )


if __name__ == "__main__":
    app.run(main)
