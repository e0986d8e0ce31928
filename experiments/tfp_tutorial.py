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
  * `<output_dir>/results.json` holds the results dict.

Example:
  dpcore-tfp-tutorial --epochs=60 --output_dir=runs/tfp_tutorial
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from absl import flags
from dpcore_experiments.lib import cli, common, zoo

DATASETS = ("digits", "fashion_mnist", "mnist")
RESULTS_FILE = "results.json"


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
    with cli.user_errors(FileNotFoundError, ValueError):  # the user's data files
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
    return _report(dp_model, config, epsilon, dataset, len(x), (x_test, y_test), start)


def _report(
    dp_model: Any,
    config: Any,
    epsilon: Any,
    dataset: str,
    num_examples: int,
    test_data: tuple[Any, Any],
    start: float,
) -> dict[str, Any]:
    """`run_tutorial`'s result: test accuracy, and ε of the steps the optimizer applied."""
    steps = int(dp_model.optimizer.dp_steps.numpy())
    ran = dataclasses.replace(config, steps=steps)  # what was applied (equals config.steps)
    test = dp_model.evaluate(*test_data, return_dict=True, verbose=0)
    return {
        "dataset": dataset,
        "num_examples": num_examples,
        "test_accuracy": float(test["accuracy"]),
        "epsilon": float(epsilon.epsilon()),
        "epsilon_rdp": float(ran.epsilon("rdp")),
        "target_delta": config.target_delta,
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
    flags.DEFINE_string(
        "output_dir", None, "Where results.json goes (default runs/tfp_tutorial-<time>/)."
    )


HELP = """dpcore-tfp-tutorial: TensorFlow Privacy's Keras tutorial, run with dpcore.

The tutorial's CNN, optimizer (SGD 0.15) and privacy parameters (C = 1.0, σ = 1.1, batch
250, 60 epochs), trained on genuinely Poisson-sampled batches; prints the test accuracy and
the ε spent at --delta, and writes results.json to --output_dir (default
runs/tfp_tutorial-<date>-<time>/). The default dataset is the 8x8 digits that ship with
scikit-learn (MNIST is not available offline).

Example:
  dpcore-tfp-tutorial --epochs=60 --seed=0
"""


def prepare(argv: list[str]) -> str:
    """Checks the flags and the data; returns the output folder."""
    cli.check_no_arguments(argv)
    f = flags.FLAGS
    for name, ok in (
        ("epochs", f.epochs >= 1),
        ("batch_size", f.batch_size >= 1),
        ("learning_rate", f.learning_rate > 0),
        ("noise_multiplier", f.noise_multiplier > 0),
        ("l2_norm_clip", f.l2_norm_clip > 0),
        ("delta", 0 < f.delta < 1),
    ):
        if not ok:
            raise cli.UserError(f"--{name}={f[name].value} is out of range (see --help).")
    cli.check_dataset(f.dataset, f.data_dir)
    return cli.output_dir(f.output_dir, "tfp_tutorial")


def execute(output_dir: str) -> None:
    """Trains, prints the tutorial's two lines; the last line names results.json."""
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
        f"For delta={f.delta:g}, epsilon spent is {results['epsilon']:.3f} (PLD), "
        f"{results['epsilon_rdp']:.3f} (RDP), Poisson sampling, {results['steps']} steps"
    )
    path = os.path.join(output_dir, RESULTS_FILE)
    common.write_json_atomic(path, results)
    print(f"results: {path}")


def run() -> None:
    """Console-script entry point (`dpcore-tfp-tutorial`)."""
    cli.run_program(prepare=prepare, execute=execute, define_flags=_define_flags, help_text=HELP)


if __name__ == "__main__":
    run()
