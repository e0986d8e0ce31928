"""TensorFlow Privacy's Keras MNIST tutorial, translated to dpcore (see MIGRATING.md).

The tutorial (`tutorials/mnist_dpsgd_tutorial_keras.py` in TensorFlow Privacy 0.9.0) trains a
small ReLU CNN with `DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
num_microbatches=250, learning_rate=0.15)` on batches of 250 for 60 epochs and reports ε at
δ = 1e-5. This is the same model, optimizer and privacy parameters with dpcore: genuine Poisson
sampling (`dpcore.sampling.poisson_batches`, expected batch 250), `dpcore.make_private`, and
`dpcore.callbacks.EpsilonCallback`, which accounts the steps that ran. MNIST is not available
offline, so the default dataset is scikit-learn's bundled 8x8 digits (`--dataset=fashion_mnist`
reads Debian's Fashion-MNIST when installed).

Contract:
  * Flags live here only; `run_tutorial(...)` takes keyword arguments and returns the results
    dict (test accuracy, ε by PLD and RDP, logical steps, the `DPConfig`), for tests.
  * One epoch is ceil(N / batch_size) logical Poisson steps, so on MNIST 60 epochs are the
    tutorial's 14,400 steps. Every epoch draws fresh samples; ε is for the steps applied.
  * `--out` writes the results dict as JSON.

Example:
  python -m dpcore_experiments.tfp_tutorial --epochs=60 --out=runs/tfp_tutorial.json
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from absl import app, flags
from dpcore_experiments import common, zoo

DATASETS = ("digits", "fashion_mnist", "mnist")


def build_model(input_shape: tuple[int, ...]) -> Any:
    """The tutorial's CNN: conv16 8x8/2, maxpool 2/1, conv32 4x4/2, maxpool 2/1, dense32, dense10.

    ReLU activations and logits, as in TensorFlow Privacy's tutorial. On inputs smaller than
    16x16 (the 8x8 digits) the second convolution pads ('same') so that the shapes stay valid.
    """
    import keras

    return keras.Sequential(zoo.cnn_layers(keras, input_shape, 10, activation="relu"))


def run_tutorial(
    *,
    dataset: str = "digits",
    data_dir: str | None = None,
    epochs: int = 60,
    batch_size: int = 250,
    learning_rate: float = 0.15,
    noise_multiplier: float = 1.1,
    l2_norm_clip: float = 1.0,
    target_delta: float = 1e-5,
    seed: int | None = None,
    verbose: int = 2,
) -> dict[str, Any]:
    """Trains the tutorial's CNN with DP-SGD on Poisson-sampled batches.

    Args:
      dataset: one of `DATASETS` (`digits` ships with scikit-learn; the others are IDX files).
      data_dir: IDX directory for `fashion_mnist` / `mnist` (default: Debian's location).
      epochs: passes over the data; one pass is ceil(N / batch_size) logical steps.
      batch_size: expected logical batch size q · N.
      learning_rate: plain SGD learning rate (the tutorial's optimizer).
      noise_multiplier: σ.
      l2_norm_clip: per-example clip norm C.
      target_delta: δ for ε.
      seed: fixes the sampling and noise seeds (tests only); None draws them from OS entropy.
      verbose: Keras `fit` verbosity.

    Returns:
      A dict with `test_accuracy`, `epsilon` (PLD, as logged by `EpsilonCallback`),
      `epsilon_rdp`, `steps` (logical steps applied), `config` (`DPConfig.to_dict()`),
      `dataset`, `num_examples` and `wall_s`.

    Privacy:
      ε is for the steps the optimizer applied (its `dp_steps`), Poisson-sampled with
      q = batch_size / N, at the config's σ and δ.
    """
    import keras

    import dpcore

    if dataset not in DATASETS:
        raise ValueError(f"dataset={dataset!r}; expected one of {DATASETS}.")
    start = time.perf_counter()
    if seed is not None:
        keras.utils.set_random_seed(seed)
    (x, y), (x_test, y_test) = dpcore.data.load_dataset(dataset, data_dir)
    x, x_test = x[..., None], x_test[..., None]  # [n, h, w, 1] as in the tutorial
    steps_per_epoch = dpcore.accounting.steps_for_epochs(
        1, num_examples=len(x), expected_batch_size=batch_size
    )
    config = dpcore.DPConfig(
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=noise_multiplier,
        expected_batch_size=batch_size,
        num_examples=len(x),
        steps=epochs * steps_per_epoch,
        target_delta=target_delta,
    )
    dp_model = dpcore.make_private(
        build_model(x.shape[1:]),
        config=config,
        optimizer=keras.optimizers.SGD(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        seed=seed,
    )
    batches = dpcore.sampling.poisson_batches(
        x, y, sampling_prob=config.sampling_prob, steps=steps_per_epoch, seed=seed
    )
    epsilon = dpcore.callbacks.EpsilonCallback(config)
    dp_model.fit(
        batches,
        epochs=epochs,
        validation_data=(x_test, y_test),
        callbacks=[epsilon],
        verbose=verbose,
    )
    steps = int(dp_model.optimizer.dp_steps.numpy())
    ran = dataclasses.replace(config, steps=steps)  # what was applied (equals config.steps)
    test = dp_model.evaluate(x_test, y_test, return_dict=True, verbose=0)
    return {
        "dataset": dataset,
        "num_examples": len(x),
        "test_accuracy": float(test["accuracy"]),
        "epsilon": float(epsilon.epsilon()),
        "epsilon_rdp": float(ran.epsilon("rdp")),
        "target_delta": target_delta,
        "steps": steps,
        "config": ran.to_dict(),
        "wall_s": time.perf_counter() - start,
    }


def _define_flags() -> None:
    """Defines the flags (only when run as a program, so the module imports cleanly)."""
    flags.DEFINE_enum("dataset", "digits", DATASETS, "Dataset (digits ships with scikit-learn).")
    flags.DEFINE_string("data_dir", None, "IDX directory for fashion_mnist / mnist.")
    flags.DEFINE_integer("epochs", 60, "Passes over the data (ceil(N / batch_size) steps each).")
    flags.DEFINE_integer("batch_size", 250, "Expected logical batch size.")
    flags.DEFINE_float("learning_rate", 0.15, "SGD learning rate.")
    flags.DEFINE_float("noise_multiplier", 1.1, "Noise multiplier σ.")
    flags.DEFINE_float("l2_norm_clip", 1.0, "Per-example clip norm C.")
    flags.DEFINE_float("delta", 1e-5, "δ for the reported ε.")
    flags.DEFINE_integer("seed", None, "Fixed seed (tests only; default: OS entropy).")
    flags.DEFINE_string("out", None, "Write the results as JSON to this path.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    results = run_tutorial(
        dataset=f.dataset,
        data_dir=f.data_dir,
        epochs=f.epochs,
        batch_size=f.batch_size,
        learning_rate=f.learning_rate,
        noise_multiplier=f.noise_multiplier,
        l2_norm_clip=f.l2_norm_clip,
        target_delta=f.delta,
        seed=f.seed,
    )
    print(f"Test accuracy after {f.epochs} epochs is: {results['test_accuracy']:.3f}")
    print(
        f"For delta={f.delta:g}, epsilon is {results['epsilon']:.3f} (PLD), "
        f"{results['epsilon_rdp']:.3f} (RDP), Poisson sampling, {results['steps']} steps"
    )
    if f.out:
        common.write_json_atomic(f.out, results)


def run() -> None:
    _define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
