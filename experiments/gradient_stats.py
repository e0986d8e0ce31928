"""Per-example gradient statistics while training a small model with DP-SGD.

Contract: trains a small model for ``--steps`` DP-SGD steps on local data (by default the
embedded scikit-learn digits, no download) and, at every step, before the update and on that
step's batch, records for each example its gradient norm, the cosine similarity of its gradient
with the batch gradient, and the fraction of examples clipped at ``--l2_norm_clip``. It checks
on every step that the mean of the per-example gradients equals the batch gradient (the gradient
of the mean loss) within float32 tolerance, writes everything to
``<output_dir>/gradient_stats.json``, a PNG plot to ``<output_dir>/gradient_stats.png`` when
matplotlib is installed, and prints a short table. The run fails (after writing its outputs)
if the check fails on any step.

These statistics are computed from unclipped, un-noised per-example gradients: they are a
debugging aid for choosing ``l2_norm_clip`` and are not differentially private.

Usage:
  dpcore-gradient-stats --steps=5 --batch_size=64 --l2_norm_clip=1.0 --output_dir=stats
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import flags
from dpcore_experiments.lib import cli, common, zoo

FLAGS = flags.FLAGS
RESULTS_FILE = "gradient_stats.json"
PLOT_FILE = "gradient_stats.png"


def _define_flags() -> None:
    """Defines the command-line flags (called only when run as a program).

    Keeping flag definitions out of import time lets the experiment modules be imported
    together (tests, other binaries) without duplicate-flag errors.
    """
    flags.DEFINE_enum("dataset", "digits", ["digits", "fashion_mnist", "mnist"], "Local dataset.")
    flags.DEFINE_string("data_dir", None, "Directory of the IDX files (fashion_mnist / mnist).")
    flags.DEFINE_integer("steps", 5, "Training steps (statistics are taken at every step).")
    flags.DEFINE_integer("batch_size", 64, "Examples per step.")
    flags.DEFINE_integer("hidden", 32, "Hidden units of the MLP.")
    flags.DEFINE_float("l2_norm_clip", 1.0, "Clip bound C (for the clipped fraction and training).")
    flags.DEFINE_float("noise_multiplier", 1.0, "Noise multiplier of the DP-SGD training steps.")
    flags.DEFINE_float("learning_rate", 0.5, "SGD learning rate.")
    flags.DEFINE_integer("seed", 0, "Seed of initialization, batch order and noise.")
    flags.DEFINE_float("rtol", 1e-5, "Relative tolerance of the mean == batch gradient check.")
    flags.DEFINE_float("atol", 1e-7, "Absolute tolerance of the mean == batch gradient check.")
    flags.DEFINE_string(
        "output_dir",
        None,
        f"Where {RESULTS_FILE} and {PLOT_FILE} go (default runs/gradient_stats-<time>/).",
    )
    flags.DEFINE_bool("plot", True, f"Also draw {PLOT_FILE} (needs matplotlib).")


def build_mlp(input_shape: Sequence[int], classes: int, *, hidden: int, seed: int) -> Any:
    """A small tanh MLP on flattened inputs."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        zoo.tanh_mlp_layers(keras, input_shape, classes, hidden=hidden), name="mlp"
    )


def make_stats_fn(model: Any, loss: Any) -> Any:
    """A compiled ``fn(x, y) -> (per_example_grads, batch_grads, per_example_losses)``.

    ``batch_grads`` is the gradient of the mean loss over the batch, from one ordinary backward
    pass; ``per_example_grads`` come from :func:`dpcore.engine.per_example_gradients`.

    Privacy:
      Returns unclipped per-example gradients (sensitive): for diagnostics only.
    """
    import tensorflow as tf

    from dpcore import engine
    from dpcore.options import ExecutionOptions

    variables = list(model.trainable_variables)
    inference = ExecutionOptions(training=False)  # as the batch gradient below

    @tf.function
    def fn(x, y):
        per_example = engine.per_example_gradients(
            model, loss, x, y, variables=variables, options=inference
        )
        with tf.GradientTape() as tape:
            losses = loss(y, model(x, training=False))
            mean_loss = tf.reduce_mean(losses)
        return per_example, tape.gradient(mean_loss, variables), losses

    return fn


def step_stats(
    per_example: Sequence[np.ndarray],
    batch: Sequence[np.ndarray],
    *,
    l2_norm_clip: float,
    rtol: float,
    atol: float,
) -> dict:
    """Statistics of one batch's per-example gradients.

    Args:
      per_example: one ``[B, *var.shape]`` array per variable.
      batch: the batch gradient (of the mean loss), one array per variable.
      l2_norm_clip: C, for the fraction clipped (norm > C).
      rtol: relative tolerance of the check, relative to the largest batch-gradient entry.
      atol: absolute tolerance of the check.

    Returns:
      ``norms``, ``cosine`` (per example), ``fraction_clipped``, summaries, and the check:
      ``mean_grad_max_abs_diff``, ``mean_equals_batch``.

    Privacy:
      Unprivatized statistics of individual examples: do not publish them for sensitive data.
    """
    b = per_example[0].shape[0]
    flat = np.concatenate([np.reshape(g, (b, -1)) for g in per_example], axis=1).astype(np.float64)
    batch_flat = np.concatenate([np.ravel(g) for g in batch]).astype(np.float64)
    norms = np.linalg.norm(flat, axis=1)
    batch_norm = np.linalg.norm(batch_flat)
    denom = np.maximum(norms * batch_norm, 1e-30)
    cosine = np.where(norms * batch_norm > 0, flat @ batch_flat / denom, 0.0)
    diff = float(np.max(np.abs(flat.mean(axis=0) - batch_flat)))
    scale = float(np.max(np.abs(batch_flat)))
    return {
        "norms": norms.tolist(),
        "cosine": cosine.tolist(),
        "fraction_clipped": float(np.mean(norms > l2_norm_clip)),
        "norm_median": float(np.median(norms)),
        "norm_p90": float(np.percentile(norms, 90)),
        "cosine_mean": float(np.mean(cosine)),
        "batch_grad_norm": float(batch_norm),
        "mean_grad_max_abs_diff": diff,
        "batch_grad_max_abs": scale,
        "mean_equals_batch": bool(diff <= atol + rtol * scale),
    }


def make_dp_step(
    model: Any,
    loss: Any,
    *,
    l2_norm_clip: float,
    noise_multiplier: float,
    expected_batch_size: float,
    learning_rate: float,
    seed: int,
) -> Any:
    """A compiled DP-SGD step ``step(x, y)`` from the engine and aggregation APIs.

    Privacy:
      Clips each example to ``l2_norm_clip`` and adds ``N(0, (noise_multiplier * C)^2)`` once per
      step; this script does no accounting (it is a diagnostic).
    """
    import keras
    import tensorflow as tf

    from dpcore import aggregation, engine
    from dpcore.options import ExecutionOptions

    variables = list(model.trainable_variables)
    opt = keras.optimizers.SGD(learning_rate=learning_rate)
    opt.build(variables)
    noise_seed = tf.Variable([seed, 0], dtype=tf.int64, trainable=False)

    @tf.function
    def step(x, y):
        s = engine.summarize(
            model, loss, x, y, variables=variables, options=ExecutionOptions(method="vectorized")
        )
        clipped = aggregation.clip(s, l2_norm_clip=l2_norm_clip)
        current = noise_seed.read_value()
        noise_seed.assign_add(tf.constant([0, 1], tf.int64))
        grads = aggregation.privatize(
            clipped,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=current,
        )
        opt.apply(grads, variables)

    return step


def run(
    x_train: np.ndarray,
    y_train: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    l2_norm_clip: float,
    noise_multiplier: float,
    learning_rate: float,
    hidden: int = 32,
    seed: int = 0,
    rtol: float = 1e-5,
    atol: float = 1e-7,
) -> dict:
    """Trains for ``steps`` steps, taking gradient statistics before each update.

    Returns:
      ``{"config", "steps": [per-step stats with "step" and "loss"], "check_passed"}``.

    Privacy:
      The statistics are not private (see the module docstring); the training steps are DP-SGD
      steps without accounting.
    """
    import keras
    import tensorflow as tf

    if batch_size > len(x_train):
        raise ValueError(f"batch_size={batch_size} exceeds the {len(x_train)} training examples.")
    classes = int(np.max(y_train)) + 1
    model = build_mlp(x_train.shape[1:], classes, hidden=hidden, seed=seed)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    stats_fn = make_stats_fn(model, loss)
    dp_step = make_dp_step(
        model,
        loss,
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=noise_multiplier,
        expected_batch_size=batch_size,
        learning_rate=learning_rate,
        seed=seed,
    )
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x_train))
    records = []
    for k in range(steps):
        start = (k * batch_size) % (len(order) - batch_size + 1)
        idx = order[start : start + batch_size]
        x = tf.constant(x_train[idx], tf.float32)
        y = tf.constant(y_train[idx], tf.int32)
        per_example, batch_grads, losses = stats_fn(x, y)
        rec = step_stats(
            [g.numpy() for g in per_example],
            [g.numpy() for g in batch_grads],
            l2_norm_clip=l2_norm_clip,
            rtol=rtol,
            atol=atol,
        )
        rec = {"step": k, "loss": float(np.mean(losses.numpy())), **rec}
        records.append(rec)
        dp_step(x, y)
    return {
        "config": {
            "steps": steps,
            "batch_size": batch_size,
            "l2_norm_clip": l2_norm_clip,
            "noise_multiplier": noise_multiplier,
            "learning_rate": learning_rate,
            "hidden": hidden,
            "seed": seed,
            "rtol": rtol,
            "atol": atol,
            "params": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)),
        },
        "steps": records,
        "check_passed": all(r["mean_equals_batch"] for r in records),
    }


def format_table(result: dict) -> str:
    """A short text table: one line per step."""
    lines = [
        f"{'step':>4} {'loss':>7} {'norm med':>9} {'norm p90':>9} {'cos mean':>9} "
        f"{'clipped':>8} {'|mean-batch|':>13} ok"
    ]
    for r in result["steps"]:
        lines.append(
            f"{r['step']:>4} {r['loss']:>7.4f} {r['norm_median']:>9.4f} {r['norm_p90']:>9.4f} "
            f"{r['cosine_mean']:>9.4f} {r['fraction_clipped']:>8.2%} "
            f"{r['mean_grad_max_abs_diff']:>13.2e} {'yes' if r['mean_equals_batch'] else 'NO'}"
        )
    return "\n".join(lines)


def plot(result: dict, path: str) -> bool:
    """Writes a PNG (norm distribution per step; cosine vs norm). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    c = result["config"]["l2_norm_clip"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.boxplot([r["norms"] for r in result["steps"]])
    ax1.set_xticks(range(1, len(result["steps"]) + 1), [str(r["step"]) for r in result["steps"]])
    ax1.axhline(c, color="red", linestyle="--", label=f"C = {c:g}")
    ax1.set_xlabel("step")
    ax1.set_ylabel("per-example gradient L2 norm")
    ax1.set_yscale("log")
    ax1.legend()
    for r in result["steps"]:
        ax2.scatter(r["norms"], r["cosine"], s=8, label=f"step {r['step']}")
    ax2.axvline(c, color="red", linestyle="--")
    ax2.set_xscale("log")
    ax2.set_xlabel("per-example gradient L2 norm")
    ax2.set_ylabel("cosine with the batch gradient")
    ax2.legend(fontsize="small")
    fig.suptitle(f"Per-example gradients ({result.get('dataset', '')})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


HELP = """dpcore-gradient-stats: per-example gradient norms, to choose the clip bound C.

Trains a small MLP for --steps DP-SGD steps (default: the 8x8 digits that ship with
scikit-learn) and, at every step, records each example's gradient norm, its cosine with the
batch gradient and the fraction of examples clipped at --l2_norm_clip; prints a table and
writes gradient_stats.json and gradient_stats.png to --output_dir (default
runs/gradient_stats-<date>-<time>/). The statistics come from unclipped, un-noised gradients:
a debugging aid, not differentially private.

Example:
  dpcore-gradient-stats --steps=5 --batch_size=64 --l2_norm_clip=1.0
"""


def prepare(argv: list[str]) -> str:
    """Checks the flags and the data; returns the output folder."""
    cli.check_no_arguments(argv)
    for name, ok in (
        ("steps", FLAGS.steps >= 1),
        ("batch_size", FLAGS.batch_size >= 1),
        ("hidden", FLAGS.hidden >= 1),
        ("l2_norm_clip", FLAGS.l2_norm_clip > 0),
        ("noise_multiplier", FLAGS.noise_multiplier >= 0),
        ("learning_rate", FLAGS.learning_rate > 0),
        ("rtol", FLAGS.rtol >= 0),
        ("atol", FLAGS.atol >= 0),
    ):
        if not ok:
            raise cli.UserError(f"--{name}={FLAGS[name].value} is out of range (see --help).")
    cli.check_dataset(FLAGS.dataset, FLAGS.data_dir)
    return cli.output_dir(FLAGS.output_dir, "gradient_stats")


def execute(output_dir: str) -> int:
    """Trains, prints the table and writes the outputs; 1 when the check failed."""
    from dpcore import data

    with cli.user_errors(FileNotFoundError, ValueError):  # the user's data files
        (x_train, y_train), _ = data.load_dataset(FLAGS.dataset, data_dir=FLAGS.data_dir)
    if FLAGS.batch_size > len(x_train):
        raise cli.UserError(
            f"--batch_size={FLAGS.batch_size} exceeds the {len(x_train)} training examples."
        )
    result = run(
        x_train,
        y_train,
        steps=FLAGS.steps,
        batch_size=FLAGS.batch_size,
        l2_norm_clip=FLAGS.l2_norm_clip,
        noise_multiplier=FLAGS.noise_multiplier,
        learning_rate=FLAGS.learning_rate,
        hidden=FLAGS.hidden,
        seed=FLAGS.seed,
        rtol=FLAGS.rtol,
        atol=FLAGS.atol,
    )
    result["dataset"] = FLAGS.dataset
    print(f"dataset: {FLAGS.dataset} ({len(x_train)} training examples)")
    print(format_table(result))
    if FLAGS.plot and plot(result, os.path.join(output_dir, PLOT_FILE)):
        print(f"plot: {os.path.join(output_dir, PLOT_FILE)}")
    if not result["check_passed"]:
        print(
            "FAILED: the mean of the per-example gradients != the batch gradient on some step "
            "(see the table).",
            file=sys.stderr,
        )
    results_path = os.path.join(output_dir, RESULTS_FILE)
    common.write_json_atomic(results_path, result, indent=1)
    print(f"results: {results_path}")
    return 0 if result["check_passed"] else 1


def run_program() -> None:
    """Console-script entry point (`dpcore-gradient-stats`)."""
    cli.run_program(prepare=prepare, execute=execute, define_flags=_define_flags, help_text=HELP)


if __name__ == "__main__":
    run_program()
