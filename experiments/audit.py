"""One-run empirical privacy audit of dpcore training (Steinke, Nasr & Jagielski, 2023).

Draws m random-label canaries from the training split (each keeps its input and gets a wrong,
uniformly drawn label), includes each in the training set with probability 1/2, trains once
with `dpcore.make_private` on Poisson-sampled batches, scores every canary by its loss under
the canary label (lower loss = guess "included"), and reports the empirical ε lower bound
(`dpcore.audit`) at the run's δ next to the claimed ε (dp-accounting, PLD).

Contract:
  * Flags live here only; `run_audit(settings)` takes a plain `AuditSettings` and returns the
    results dict, so tests can call it without absl flags.
  * Sampling (`sampling_plan`): q = batch_size / N' and steps = `steps_for_epochs(epochs)`, with
    N' = (train split - m) + m the pool of every record that could be trained on, so q, the
    steps and the claimed ε do not depend on the coins. The realized training set (N' minus
    the excluded canaries, N records) is Poisson-sampled with that q and, as dpcore requires,
    its noisy sum is divided by q * N; the DPConfig says the same (num_examples = N,
    expected_batch_size = q * N). That divisor moves by q per included canary, the usual
    treatment of the dataset size as public, which the audit tests along with the rest.
  * `--nodp` trains the same pipeline with noise_multiplier = 0 and l2_norm_clip = inf (no
    clipping, no noise): claimed ε = inf; the audit should then find a clearly positive bound.
  * `<output_dir>/audit.json` holds the settings, the claimed ε, the audit (best bound, and per
    number of guesses: guesses, correct, bound), canary loss statistics and test accuracy;
    `<output_dir>/audit.png` plots the bound against the number of guesses with the claimed ε.

Example (two of the acceptance runs recorded in PRIVACY.md):

  dpcore-audit --target_epsilon=2 --output_dir=runs/audit_eps2
  dpcore-audit --nodp --epochs=300 --log_every=100 --output_dir=runs/audit_nodp
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from typing import Any

import numpy as np
from dpcore_experiments.lib import cli, common
from dpcore_experiments.lib.train_model import build_model
from dpcore_experiments.lib.train_plan import DATASETS, MODELS

SCORES = ("loss", "loss_decrease")
RESULTS_FILE = "audit.json"
PLOT_FILE = "audit.png"


@dataclasses.dataclass(frozen=True)
class AuditSettings:
    """Everything one audit run depends on (mirrors the command-line flags)."""

    dataset: str = "digits"
    data_dir: str | None = None
    model: str = "mlp"
    num_canaries: int = 1000
    epochs: int = 30
    batch_size: int = 128
    learning_rate: float = 0.1
    momentum: float = 0.9
    l2_norm_clip: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = 8.0
    target_delta: float = 1e-5
    dp: bool = True
    score: str = "loss"
    beta: float = 0.05
    seed: int = 0
    max_train_examples: int | None = None
    log_every: int = 10
    output_dir: str | None = None
    verbose: int = 1

    def __post_init__(self) -> None:
        # Messages name the command-line flag (--delta is the field target_delta).
        checks = [
            (self.dataset in DATASETS, f"--dataset must be one of {DATASETS}"),
            (self.model in MODELS, f"--model must be one of {MODELS}"),
            (self.score in SCORES, f"--score must be one of {SCORES}"),
            (self.num_canaries >= 2, "--num_canaries must be >= 2"),
            (self.epochs >= 1, "--epochs must be >= 1"),
            (self.batch_size >= 1, "--batch_size must be >= 1"),
            (self.learning_rate > 0, "--learning_rate must be > 0"),
            (0 < self.target_delta < 1, "--delta must be in (0, 1)"),
            (0 < self.beta < 1, "--beta must be in (0, 1)"),
            (self.seed >= 0, "--seed must be >= 0"),
            (self.log_every >= 1, "--log_every must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                field = message.split()[0][2:]
                value = getattr(self, "target_delta" if field == "delta" else field)
                raise ValueError(f"{message}, got {value!r}.")
        if self.dp:
            if not (math.isfinite(self.l2_norm_clip) and self.l2_norm_clip > 0):
                raise ValueError(f"--l2_norm_clip must be finite and > 0, got {self.l2_norm_clip}.")
            if (self.noise_multiplier is None) == (self.target_epsilon is None):
                raise ValueError(
                    "A DP audit needs exactly one of --noise_multiplier, --target_epsilon."
                )


# ------------------------------------------------------------------------------ data
def build_audit_data(settings: AuditSettings) -> dict[str, Any]:
    """Canaries, the audited training set and the test split ([n, h, w, 1] images)."""
    from dpcore import audit, data

    with cli.user_errors(FileNotFoundError, ValueError):  # the user's data files
        (x, y), (x_test, y_test) = data.load_dataset(settings.dataset, settings.data_dir)
    if settings.max_train_examples is not None:
        x, y = x[: settings.max_train_examples], y[: settings.max_train_examples]
    x, x_test = x[..., None], x_test[..., None]
    if settings.num_canaries >= len(y):
        raise cli.UserError(
            f"--num_canaries={settings.num_canaries} must be below the {len(y)} training examples."
        )
    canaries = audit.random_label_canaries(
        x, y, num_canaries=settings.num_canaries, num_classes=10, seed=settings.seed
    )
    x_base, y_base = canaries.non_canary(x, y)
    x_train, y_train = canaries.insert(x_base, y_base)
    return {
        "canaries": canaries,
        "x_train": x_train,
        "y_train": y_train,
        "x_test": x_test,
        "y_test": y_test,
        "pool_size": len(y_base) + canaries.num_canaries,
    }


@dataclasses.dataclass(frozen=True)
class SamplingPlan:
    """Poisson sampling of the audited run, fixed before the coins are looked at.

    Attributes:
      sampling_prob: q = min(batch_size, pool_size) / pool_size.
      steps: ceil(epochs / q) logical steps.
      num_examples: the realized training set (non-canary data + included canaries).
      expected_batch_size: q * num_examples, the divisor of the noisy sum.
    """

    sampling_prob: float
    steps: int
    num_examples: int
    expected_batch_size: float


def sampling_plan(settings: AuditSettings, pool_size: int, num_examples: int) -> SamplingPlan:
    """q and the steps from the pool (coin-independent); the divisor from the realized set."""
    from dpcore.config import DPConfig

    batch = min(settings.batch_size, pool_size)
    steps = DPConfig.from_epochs(  # the library's steps for E epochs: ceil(E · ceil(N / B))
        epochs=settings.epochs,
        l2_norm_clip=settings.l2_norm_clip,
        noise_multiplier=0.0,
        expected_batch_size=batch,
        num_examples=pool_size,
    ).steps
    q = batch / pool_size
    return SamplingPlan(
        sampling_prob=q,
        steps=steps,
        num_examples=num_examples,
        expected_batch_size=q * num_examples,
    )


def dp_config(settings: AuditSettings, plan: SamplingPlan) -> Any:
    """The DPConfig of the audited run (None for --nodp), with the plan's q and steps."""
    from dpcore.config import DPConfig

    if not settings.dp:
        return None
    fields = dict(
        l2_norm_clip=settings.l2_norm_clip,
        expected_batch_size=plan.expected_batch_size,
        num_examples=plan.num_examples,
        steps=plan.steps,
        target_delta=settings.target_delta,
    )
    if settings.target_epsilon is not None:
        return DPConfig.calibrated(target_epsilon=settings.target_epsilon, **fields)
    return DPConfig(noise_multiplier=settings.noise_multiplier, **fields)


# -------------------------------------------------------------------------- training
def _make_model(settings: AuditSettings, input_shape: tuple[int, ...], plan: SamplingPlan) -> Any:
    import keras

    import dpcore

    model = build_model(settings.model, input_shape)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    inner = keras.optimizers.SGD(settings.learning_rate, momentum=settings.momentum)
    metrics = [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
    config = dp_config(settings, plan)
    if config is not None:
        dp_model = dpcore.make_private(
            model, config=config, optimizer=inner, loss=loss, metrics=metrics, seed=settings.seed
        )
    else:  # the same pipeline with no clipping and no noise: a non-private reference.
        dp_model = dpcore.make_private(
            model,
            optimizer=inner,
            loss=loss,
            metrics=metrics,
            l2_norm_clip=math.inf,
            noise_multiplier=0.0,
            expected_batch_size=plan.expected_batch_size,
            seed=settings.seed,
        )
    return model, dp_model, config


def _canary_losses(model: Any, canaries: Any) -> np.ndarray:
    from dpcore.audit import softmax_cross_entropy

    logits = model.predict(canaries.inputs, batch_size=1024, verbose=0)
    return softmax_cross_entropy(logits, canaries.labels)


def _train(settings: AuditSettings, dp_model: Any, data: dict[str, Any], plan: SamplingPlan) -> int:
    """Trains for the plan's Poisson-sampled logical steps; returns the steps taken."""
    import tensorflow as tf

    from dpcore import sampling

    steps_per_epoch = plan.steps / settings.epochs  # for chunking and progress only
    done, start = 0, time.perf_counter()
    # One tensor copy shared by every chunk's sampler (see `poisson_batches`).
    x_feed, y_feed = tf.convert_to_tensor(data["x_train"]), tf.convert_to_tensor(data["y_train"])
    while done < plan.steps:
        chunk = min(max(1, math.ceil(settings.log_every * steps_per_epoch)), plan.steps - done)
        batches = sampling.poisson_batches(
            x_feed,
            y_feed,
            sampling_prob=plan.sampling_prob,
            steps=chunk,
            seed=settings.seed,
            start_step=done,
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            dp_model.fit(batches, epochs=1, verbose=0, shuffle=False)
        done += chunk
        if settings.verbose:
            print(
                f"  trained {done}/{plan.steps} steps (~{done / steps_per_epoch:.0f} epochs, "
                f"{time.perf_counter() - start:.0f}s)",
                flush=True,
            )
    return done


def run_audit(settings: AuditSettings) -> dict[str, Any]:
    """Trains with canaries, audits, and writes audit.json / audit.png when `output_dir` is set.

    Returns:
      The results dict (also written to `<output_dir>/audit.json`).

    Privacy:
      The trained model is (ε, δ)-DP for the claimed ε (PLD) over the pool of records; the
      audit output (canary losses, guesses, test accuracy) is computed from the model and the
      coins and is a diagnostic, not a DP release.
    """
    import keras

    from dpcore import audit

    start = time.perf_counter()
    keras.utils.set_random_seed(settings.seed)
    data = build_audit_data(settings)
    canaries = data["canaries"]
    plan = sampling_plan(settings, data["pool_size"], len(data["y_train"]))
    model, dp_model, config = _make_model(settings, data["x_train"].shape[1:], plan)
    if settings.verbose:
        claimed = "inf (non-private)" if config is None else f"{config.epsilon():.3f}"
        print(
            f"audit: {settings.dataset}, {canaries.num_canaries} canaries "
            f"({canaries.num_included} included), {len(data['y_train'])} training examples, "
            f"{plan.steps} steps, claimed epsilon {claimed}",
            flush=True,
        )
    losses_before = _canary_losses(model, canaries)
    steps_done = _train(settings, dp_model, data, plan)
    losses_after = _canary_losses(model, canaries)
    scores = audit.loss_scores(
        losses_after, losses_before if settings.score == "loss_decrease" else None
    )
    result = audit.audit_scores(
        scores, canaries.included, delta=settings.target_delta, beta=settings.beta
    )
    test = dp_model.evaluate(
        data["x_test"], data["y_test"], batch_size=1024, verbose=0, return_dict=True
    )
    inc = canaries.included
    results: dict[str, Any] = {
        "settings": dataclasses.asdict(settings),
        "dataset": {
            "name": settings.dataset,
            "num_train": int(len(data["y_train"])),
            "pool_size": int(data["pool_size"]),
            "num_test": int(len(data["y_test"])),
        },
        "privacy": _privacy(config, settings, steps_done),
        "audit": result.as_dict(),
        "epsilon_lower_bound": result.epsilon_lower_bound,
        "canaries": {
            "kind": "random_label",
            "num_canaries": canaries.num_canaries,
            "num_included": canaries.num_included,
            "mean_loss_included": float(losses_after[inc].mean()) if inc.any() else None,
            "mean_loss_excluded": float(losses_after[~inc].mean()) if (~inc).any() else None,
            "score": settings.score,
        },
        "test_accuracy": float(test["accuracy"]),
        "wall_time_s": time.perf_counter() - start,
    }
    results["claimed_epsilon"] = results["privacy"]["epsilon"]
    if settings.output_dir:
        common.write_json_atomic(
            os.path.join(settings.output_dir, RESULTS_FILE), results, sort_keys=True, default=str
        )
        plot(results, os.path.join(settings.output_dir, PLOT_FILE))
    return results


def _privacy(config: Any, settings: AuditSettings, steps: int) -> dict[str, Any]:
    if config is None:
        return {
            "dp": False,
            "epsilon": math.inf,
            "note": "non-private: noise_multiplier=0, l2_norm_clip=inf",
            "steps": steps,
        }
    ran = dataclasses.replace(config, steps=steps)
    return {
        "dp": True,
        "epsilon": float(ran.epsilon(accountant="pld")),
        "accountant": "pld",
        "target_delta": settings.target_delta,
        "noise_multiplier": float(ran.noise_multiplier),
        "l2_norm_clip": float(ran.l2_norm_clip),
        "sampling_prob": float(ran.sampling_prob),
        "steps": steps,
        "dp_event": str(ran.dp_event()),
    }


def plot(results: dict[str, Any], path: str) -> None:
    """The ε lower bound against the number of guesses, with the claimed ε as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["audit"]["per_guess_count"]
    guesses = [row["num_guesses"] for row in rows]
    bounds = [row["epsilon_lower_bound"] for row in rows]
    claimed = results["claimed_epsilon"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(guesses, bounds, "o-", label="empirical ε lower bound (per k, Bonferroni)")
    if math.isfinite(claimed):
        ax.axhline(claimed, color="red", linestyle="--", label=f"claimed ε = {claimed:.2f}")
    ax.set_xscale("log")
    ax.set_xlabel("number of guesses r = 2k (k 'in', k 'out')")
    ax.set_ylabel("ε")
    audit = results["audit"]
    ax.set_title(
        f"{results['dataset']['name']}: m = {audit['num_canaries']}, "
        f"δ = {audit['delta']:g}, β = {audit['beta']:g}; best ε_lb = "
        f"{audit['epsilon_lower_bound']:.2f}"
    )
    ax.set_ylim(bottom=0)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- flags
def _define_flags() -> None:
    from absl import flags

    d = AuditSettings()
    flags.DEFINE_enum("dataset", d.dataset, DATASETS, "Dataset (digits is embedded).")
    flags.DEFINE_string("data_dir", None, "Directory of IDX files for fashion_mnist / mnist.")
    flags.DEFINE_enum("model", d.model, MODELS, "Model architecture (experiments/train.py).")
    flags.DEFINE_integer("num_canaries", d.num_canaries, "m, random-label canaries.")
    flags.DEFINE_integer("epochs", d.epochs, "Epochs (expected passes over the pool).")
    flags.DEFINE_integer("batch_size", d.batch_size, "Expected (Poisson) batch size.")
    flags.DEFINE_float("learning_rate", d.learning_rate, "SGD learning rate.")
    flags.DEFINE_float("momentum", d.momentum, "SGD momentum.")
    flags.DEFINE_float("l2_norm_clip", d.l2_norm_clip, "Per-example clipping bound C.")
    flags.DEFINE_float(
        "noise_multiplier", None, "Noise multiplier σ; when set, --target_epsilon is ignored."
    )
    flags.DEFINE_float(
        "target_epsilon", d.target_epsilon, "Calibrate σ (PLD) to reach this ε at --delta."
    )
    flags.DEFINE_float("delta", d.target_delta, "δ of the claimed (ε, δ) and of the audit.")
    flags.DEFINE_bool("dp", d.dp, "--nodp: σ = 0 and C = inf (shows the audit has power).")
    flags.DEFINE_enum("score", d.score, SCORES, "Canary score: loss after, or its decrease.")
    flags.DEFINE_float("beta", d.beta, "The bound holds with confidence 1 - beta.")
    flags.DEFINE_integer("seed", d.seed, "Seed of canaries, coins, sampling, noise and init.")
    flags.DEFINE_integer("max_train_examples", None, "Use only the first N training examples.")
    flags.DEFINE_integer("log_every", d.log_every, "Print progress every N epochs.")
    flags.DEFINE_string(
        "output_dir", None, "Where audit.json and audit.png go (default runs/audit-<time>/)."
    )
    flags.DEFINE_alias("out_dir", "output_dir")
    flags.DEFINE_integer("verbose", d.verbose, "0: quiet, 1: progress.")


def settings_from_flags() -> AuditSettings:
    from absl import flags

    f = flags.FLAGS
    return AuditSettings(
        dataset=f.dataset,
        data_dir=f.data_dir,
        model=f.model,
        num_canaries=f.num_canaries,
        epochs=f.epochs,
        batch_size=f.batch_size,
        learning_rate=f.learning_rate,
        momentum=f.momentum,
        l2_norm_clip=f.l2_norm_clip,
        noise_multiplier=f.noise_multiplier if f.dp else None,
        target_epsilon=None if (f.noise_multiplier is not None or not f.dp) else f.target_epsilon,
        target_delta=f.delta,
        dp=f.dp,
        score=f.score,
        beta=f.beta,
        seed=f.seed,
        max_train_examples=f.max_train_examples,
        log_every=f.log_every,
        output_dir=f.output_dir,
        verbose=f.verbose,
    )


HELP = """dpcore-audit: measures how much a DP training run leaks, next to the ε it claims.

Trains once with random-label canaries, each included with probability 1/2, guesses from
the canaries' losses which ones were trained on, and prints an empirical lower bound on ε
(one-run audit, Steinke, Nasr & Jagielski 2023) next to the claimed ε. A correct DP
implementation gives a lower bound at or below the claimed ε. Writes audit.json and audit.png
to --output_dir (default runs/audit-<date>-<time>/).

Examples:
  dpcore-audit --target_epsilon=2
  dpcore-audit --nodp --epochs=300 --log_every=100   # no noise: the bound should be large
"""


def prepare(argv: list[str]) -> AuditSettings:
    """The audit's settings from the flags, with the data and output folder checked."""
    from absl import flags

    cli.check_no_arguments(argv)
    f = flags.FLAGS
    with cli.user_errors(ValueError):
        settings = settings_from_flags()
    cli.check_dataset(f.dataset, f.data_dir)
    return dataclasses.replace(settings, output_dir=cli.output_dir(f.output_dir, "audit"))


def execute(settings: AuditSettings) -> None:
    """Audits and prints the summary; the last line names audit.json."""
    from absl import flags, logging

    if not flags.FLAGS["verbosity"].present:
        # Quiet dp-accounting's notes on RDP orders it skips while calibrating σ.
        logging.set_verbosity(logging.ERROR)
    results = run_audit(settings)
    best = results["audit"]["best"]
    claimed = results["claimed_epsilon"]
    print(f"dataset: {settings.dataset}; test accuracy {results['test_accuracy']:.4f}")
    print(
        f"claimed epsilon: {claimed:.3f} at delta={settings.target_delta:g}"
        if math.isfinite(claimed)
        else "claimed epsilon: inf (non-private: sigma=0, C=inf)"
    )
    print(
        f"empirical epsilon lower bound: {results['epsilon_lower_bound']:.3f} "
        f"(confidence {1 - settings.beta:g}; m={results['audit']['num_canaries']}, "
        f"best k={best['k']}: {best['num_correct']}/{best['num_guesses']} guesses correct)"
    )
    print(f"results: {os.path.join(settings.output_dir or '', RESULTS_FILE)}")


def run() -> None:
    """Console-script entry point (`dpcore-audit`)."""
    cli.run_program(prepare=prepare, execute=execute, define_flags=_define_flags, help_text=HELP)


if __name__ == "__main__":
    run()
