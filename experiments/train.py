"""Trains a small classifier with DP-SGD (or without, as a baseline) and records the run.

The default invocation (no flags) is the project's main job: a short DP-SGD run on the embedded
scikit-learn digits dataset that prints the dataset, the test accuracy and ε.

Contract:
  * Flags live here only; `run_training(settings)` takes a plain `TrainSettings` and returns the
    results dict, so tests and notebooks can call it without absl flags.
  * `--sampling=poisson` trains on genuine Poisson-subsampled batches (`dpcore.sampling`) and
    accounts them with `PoissonSampledDpEvent`; `--sampling=shuffle` trains on shuffled
    fixed-size batches and reports the sound no-amplification bound.
  * `--privacy_unit=user` trains with user-level DP: the training rows are assigned to
    SYNTHETIC users (`synthetic_users`: a Zipf-like number of rows per user, fixed seed; the
    datasets have no real user column), `dpcore.units.unit_batches` Poisson-samples users with
    up to `--max_rows_per_user` rows each, every user's rows are clipped together
    (`ExecutionOptions(group_size=...)`), and `--batch_size`, N and ε count users: ε is per
    user (`results.json` says so under `privacy.privacy_unit` and `users`).
  * With `TF_CONFIG` set the process is one worker of a `MultiWorkerMirroredStrategy` cluster
    (e.g. `dpcore-launch-local --workers=2 -- dpcore-train --output_dir=... ...`): every worker Poisson-samples its shard of the one global
    sample (`sharded_poisson_batches`, seed from `--seed` or OS entropy broadcast from the chief),
    the clipped sums are all-reduced and noised once per step, and only the chief keeps
    results.json and the checkpoint. DP, Poisson, example-level runs only; no `--resume`.
  * `<output_dir>/results.json` holds the full settings, the DpEvent that ran, ε by PLD and
    RDP, per-epoch train/test accuracy and loss, wall time per epoch, and the dp-accounting and
    TensorFlow versions; `<output_dir>/checkpoint` holds the model and optimizer state (the
    noise seed and step counter included). `--resume` continues from the last finished epoch:
    the step count continues, so ε after a resumed run equals ε of an uninterrupted run.

Example (the Fashion-MNIST reproduction of Tramèr & Boneh's end-to-end CNN at ε = 3):

  dpcore-train --dataset=fashion_mnist --model=cnn --epochs=40 \
      --batch_size=2048 --learning_rate=4 --momentum=0.9 --l2_norm_clip=0.1 \
      --target_epsilon=3 --output_dir=runs/fmnist_cnn_eps3
"""

from __future__ import annotations

import dataclasses
import os

from dpcore_experiments.lib import cli

# The programmatic API, for tests and notebooks: `run_training(TrainSettings(...))` and its parts.
from dpcore_experiments.lib.train_data import (
    baseline_batches,
    load_data,
    synthetic_users,
    train_batches,
)
from dpcore_experiments.lib.train_loop import cluster_strategy, run_training
from dpcore_experiments.lib.train_model import build_model
from dpcore_experiments.lib.train_plan import (
    CHECKPOINT_DIR,
    DATASETS,
    MODELS,
    OPTIMIZERS,
    PRIVACY_UNITS,
    RESULTS_FILE,
    SAMPLING,
    Plan,
    TrainSettings,
    make_plan,
    privacy_report,
)

__all__ = [
    "CHECKPOINT_DIR",
    "RESULTS_FILE",
    "Plan",
    "TrainSettings",
    "baseline_batches",
    "build_model",
    "cluster_strategy",
    "load_data",
    "make_plan",
    "privacy_report",
    "run",
    "run_training",
    "synthetic_users",
    "train_batches",
]


def _define_flags() -> None:
    from absl import flags

    defaults = TrainSettings()
    flags.DEFINE_enum("dataset", defaults.dataset, DATASETS, "Dataset (digits is embedded).")
    flags.DEFINE_string("data_dir", None, "Directory of IDX files for fashion_mnist / mnist.")
    flags.DEFINE_enum("model", defaults.model, MODELS, "Model architecture.")
    flags.DEFINE_enum("optimizer", defaults.optimizer, OPTIMIZERS, "Inner optimizer.")
    flags.DEFINE_float("learning_rate", defaults.learning_rate, "Learning rate.")
    flags.DEFINE_float("momentum", defaults.momentum, "SGD momentum.")
    flags.DEFINE_integer("epochs", defaults.epochs, "Number of epochs.")
    flags.DEFINE_integer(
        "batch_size", defaults.batch_size, "Expected (Poisson) or fixed (shuffle) batch size."
    )
    flags.DEFINE_float("l2_norm_clip", defaults.l2_norm_clip, "Per-example clipping bound C.")
    flags.DEFINE_float(
        "noise_multiplier",
        defaults.noise_multiplier,
        "Noise multiplier σ; when set, --target_epsilon is ignored.",
    )
    flags.DEFINE_float(
        "target_epsilon",
        defaults.target_epsilon,
        "Calibrate σ (PLD) so the whole run reaches this ε (unless --noise_multiplier is set).",
    )
    flags.DEFINE_float("delta", defaults.target_delta, "δ of the (ε, δ) guarantee.")
    flags.DEFINE_enum("sampling", defaults.sampling, SAMPLING, "Batch sampling mode.")
    flags.DEFINE_enum(
        "privacy_unit",
        defaults.privacy_unit,
        PRIVACY_UNITS,
        "example: example-level DP. user: user-level DP over SYNTHETIC users (rows assigned "
        "Zipf-like, fixed seed); --batch_size and epsilon then count users.",
    )
    flags.DEFINE_integer(
        "max_rows_per_user", defaults.max_rows_per_user, "User-level: rows kept per user (cap)."
    )
    flags.DEFINE_integer(
        "num_users", None, "User-level: synthetic users to draw (default training rows / 5)."
    )
    flags.DEFINE_bool("dp", defaults.dp, "--nodp / --dp=false trains a non-private baseline.")
    flags.DEFINE_integer("seed", None, "Fixed seed (sampling, noise, init); default OS entropy.")
    flags.DEFINE_string("output_dir", None, "Where results.json and the checkpoint go.")
    flags.DEFINE_bool("resume", False, "Continue from the checkpoint in --output_dir.")
    flags.DEFINE_integer(
        "stop_after_epochs", None, "End this invocation after N epochs (continue with --resume)."
    )
    flags.DEFINE_integer("verbose", defaults.verbose, "0: quiet, 1: one line per epoch.")
    flags.DEFINE_integer(
        "validation_examples",
        0,
        "Hold out the last N training examples and report accuracy on them instead of the test "
        "set (for tuning; the 'test_accuracy' fields then hold validation accuracy).",
    )
    flags.DEFINE_string(
        "feature_cache", None, "scatter_linear: .npz file to keep the scattering features in."
    )


def settings_from_flags() -> TrainSettings:
    from absl import flags

    f = flags.FLAGS
    return TrainSettings(
        dataset=f.dataset,
        data_dir=f.data_dir,
        model=f.model,
        optimizer=f.optimizer,
        learning_rate=f.learning_rate,
        momentum=f.momentum,
        epochs=f.epochs,
        batch_size=f.batch_size,
        l2_norm_clip=f.l2_norm_clip,
        noise_multiplier=f.noise_multiplier,
        target_epsilon=None if f.noise_multiplier is not None else f.target_epsilon,
        target_delta=f.delta,
        sampling=f.sampling,
        privacy_unit=f.privacy_unit,
        max_rows_per_user=f.max_rows_per_user,
        num_users=f.num_users,
        dp=f.dp,
        seed=f.seed,
        output_dir=f.output_dir,
        resume=f.resume,
        stop_after_epochs=f.stop_after_epochs,
        verbose=f.verbose,
        validation_examples=f.validation_examples,
        feature_cache=f.feature_cache,
    )


HELP = """dpcore-train: trains a small image classifier with DP-SGD and reports ε.

Without flags: a short DP run on the 8x8 digits that ship with scikit-learn (no download),
an MLP, Poisson sampling, σ calibrated for ε = 3 at δ = 1e-5. It prints the test accuracy and
the ε spent, and writes results.json (settings, ε, per-epoch metrics) and a checkpoint to
--output_dir (default runs/train-<date>-<time>/).

Examples:
  dpcore-train
  dpcore-train --dataset=fashion_mnist --model=cnn --epochs=40 --batch_size=2048 \\
      --learning_rate=4 --l2_norm_clip=0.1 --target_epsilon=3 --output_dir=runs/fmnist
  dpcore-train --output_dir=runs/fmnist --resume       # continue a stopped run
  dpcore-train --privacy_unit=user                      # ε per (synthetic) user
  dpcore-train --nodp                                   # non-private baseline
"""


def prepare(argv: list[str]) -> TrainSettings:
    """The run's settings from the flags, with the data and output folder checked."""
    from absl import flags

    cli.check_no_arguments(argv)
    f = flags.FLAGS
    with cli.user_errors(ValueError):
        settings = settings_from_flags()
    cli.check_dataset(f.dataset, f.data_dir)
    if f.resume:
        if not f.output_dir:
            raise cli.UserError("--resume needs --output_dir (the folder of the run to continue).")
        if not os.path.isfile(os.path.join(f.output_dir, RESULTS_FILE)):
            raise cli.UserError(
                f"--resume: {os.path.join(f.output_dir, RESULTS_FILE)} does not exist; give "
                "--output_dir of a run that finished at least one epoch."
            )
    if os.environ.get("TF_CONFIG") and not f.output_dir:
        raise cli.UserError(
            "as a cluster worker (TF_CONFIG is set) give --output_dir, the same for every worker."
        )
    return dataclasses.replace(settings, output_dir=cli.output_dir(f.output_dir, "train"))


def execute(settings: TrainSettings) -> None:
    """Trains and prints the summary; the last line names results.json."""
    results = run_training(settings)
    privacy = results["privacy"]
    print(f"dataset: {settings.dataset} ({results['dataset']['num_train']} train examples)")
    if "users" in results:
        u = results["users"]
        print(
            f"privacy unit: user ({u['num_users']} SYNTHETIC users, Zipf-like rows per user, "
            f"at most {u['max_rows_per_user']} rows each; {u['rows_dropped_by_cap']} rows dropped)"
        )
    print(f"test accuracy: {results['test_accuracy']:.4f}")
    if settings.dp:
        print(
            f"epsilon spent{' per user' if settings.privacy_unit == 'user' else ''}: "
            f"{privacy['epsilon']:.3f} (PLD; RDP {privacy['epsilon_rdp']:.3f}) "
            f"at delta={settings.target_delta:g}, noise_multiplier="
            f"{results['plan']['noise_multiplier']:.4f}, sampling={settings.sampling}"
        )
    else:
        print("epsilon: inf (non-private baseline)")
    print(f"results: {os.path.join(settings.output_dir or '', RESULTS_FILE)}")


def run() -> None:
    """Console-script entry point (`dpcore-train`)."""
    cli.run_program(prepare=prepare, execute=execute, define_flags=_define_flags, help_text=HELP)


if __name__ == "__main__":
    run()
