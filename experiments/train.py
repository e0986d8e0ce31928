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

import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import time
import warnings
from typing import Any

import numpy as np
from dpcore_experiments.lib import cli, common, zoo

DATASETS = ("digits", "fashion_mnist", "mnist")
MODELS = ("mlp", "cnn", "scatter_linear")
OPTIMIZERS = ("sgd", "adam")
SAMPLING = ("poisson", "shuffle")
PRIVACY_UNITS = ("example", "user")
RESULTS_FILE = "results.json"
CHECKPOINT_DIR = "checkpoint"


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Everything one training run depends on (mirrors the command-line flags)."""

    dataset: str = "digits"
    data_dir: str | None = None
    model: str = "mlp"
    optimizer: str = "sgd"
    learning_rate: float = 0.2
    momentum: float = 0.9
    epochs: int = 10
    batch_size: int = 128
    l2_norm_clip: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = 3.0
    target_delta: float = 1e-5
    sampling: str = "poisson"
    privacy_unit: str = "example"
    max_rows_per_user: int = 8
    num_users: int | None = None
    dp: bool = True
    seed: int | None = None
    output_dir: str | None = None
    resume: bool = False
    stop_after_epochs: int | None = None
    eval_batch_size: int = 1024
    train_eval_examples: int = 10000
    validation_examples: int = 0
    feature_cache: str | None = None
    verbose: int = 1

    def __post_init__(self) -> None:
        # Messages name the command-line flag (--delta is the field target_delta).
        checks = [
            (self.dataset in DATASETS, f"--dataset must be one of {DATASETS}"),
            (self.model in MODELS, f"--model must be one of {MODELS}"),
            (self.optimizer in OPTIMIZERS, f"--optimizer must be one of {OPTIMIZERS}"),
            (self.sampling in SAMPLING, f"--sampling must be one of {SAMPLING}"),
            (self.privacy_unit in PRIVACY_UNITS, f"--privacy_unit must be one of {PRIVACY_UNITS}"),
            (self.max_rows_per_user >= 1, "--max_rows_per_user must be >= 1"),
            (self.num_users is None or self.num_users >= 1, "--num_users must be >= 1"),
            (self.epochs >= 1, "--epochs must be >= 1"),
            (self.validation_examples >= 0, "--validation_examples must be >= 0"),
            (self.batch_size >= 1, "--batch_size must be >= 1"),
            (self.learning_rate > 0, "--learning_rate must be > 0"),
            (self.l2_norm_clip > 0, "--l2_norm_clip must be > 0"),
            (0 < self.target_delta < 1, "--delta must be in (0, 1)"),
        ]
        for ok, message in checks:
            if not ok:
                field = message.split()[0][2:]
                value = getattr(self, "target_delta" if field == "delta" else field)
                raise ValueError(f"{message}, got {value!r}.")
        if self.dp and self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("A DP run needs --noise_multiplier or --target_epsilon.")
        if self.noise_multiplier is not None and self.target_epsilon is not None:
            raise ValueError("Give --noise_multiplier or --target_epsilon, not both.")
        if self.dp and self.target_epsilon is not None and self.target_epsilon <= 0:
            raise ValueError(f"--target_epsilon must be > 0, got {self.target_epsilon}.")
        if self.resume and not self.output_dir:
            raise ValueError("--resume needs --output_dir (where the checkpoint is).")
        if self.privacy_unit == "user" and self.sampling != "poisson":
            raise ValueError("--privacy_unit=user samples users with Poisson sampling only.")


# --------------------------------------------------------------------------------------- data
def load_data(settings: TrainSettings) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """(x_train, y_train), (x_eval, y_eval): images [n, h, w, 1], or scattering features.

    With `validation_examples=K` the last K training examples are held out and returned as the
    evaluation set instead of the test set (tune on them, never on the test set). For
    `scatter_linear` the images become group-normalized scattering features, flattened.
    """
    from dpcore import data

    (x_train, y_train), (x_test, y_test) = data.load_dataset(settings.dataset, settings.data_dir)
    if settings.validation_examples:
        k = settings.validation_examples
        if k >= len(x_train):
            raise ValueError(f"validation_examples={k} leaves no training examples.")
        (x_train, y_train), (x_test, y_test) = (
            (x_train[:-k], y_train[:-k]),
            (x_train[-k:], y_train[-k:]),
        )
    if settings.model == "scatter_linear":
        return scatter_features(settings, x_train, x_test, y_train, y_test)
    return (x_train[..., None], y_train), (x_test[..., None], y_test)


def scatter_features(
    settings: TrainSettings, x_train: Any, x_eval: Any, y_train: Any, y_eval: Any
) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Scattering features (J = 2, L = 8) with per-example group normalization (27 groups).

    A fixed per-example map (no privacy cost); computed once and kept in `feature_cache` (an
    .npz path) when one is given, keyed by the images it was computed from.
    """
    from dpcore_experiments.lib import scatternet

    key = np.array(
        [
            len(x_train),
            len(x_eval),
            np.sum(x_train, dtype=np.float64),
            np.sum(x_eval, dtype=np.float64),
        ]
    )
    cache = settings.feature_cache
    if cache and os.path.exists(cache):
        stored = np.load(cache)
        if np.array_equal(stored["key"], key):
            return (stored["x_train"], y_train), (stored["x_eval"], y_eval)

    def progress(done: int, total: int) -> None:
        if settings.verbose:
            print(f"  scattering features: {done}/{total}", flush=True)

    features = []
    for images in (x_train, x_eval):
        f = scatternet.scattering(np.asarray(images, np.float32), J=2, L=8, progress=progress)
        f = scatternet.group_normalize(f, groups=f.shape[1] // 3)
        features.append(f.reshape(len(f), -1))
    if cache:
        np.savez(cache, key=key, x_train=features[0], x_eval=features[1])
    return (features[0], y_train), (features[1], y_eval)


USERS_SEED = 0  # the synthetic user assignment is part of the dataset: fixed, not --seed
ZIPF_EXPONENT = 1.1
ROWS_PER_USER = 5  # default number of users: training rows / 5


def synthetic_users(
    num_rows: int, num_users: int | None = None, *, exponent: float = ZIPF_EXPONENT
) -> np.ndarray:
    """A SYNTHETIC user id per training row (the datasets have no user column).

    Row r goes to user u with probability proportional to (u + 1) ** -exponent (a Zipf-like,
    heavily skewed number of rows per user: a few users own many rows, most own one or two),
    drawn once with a fixed seed, so the assignment is the same in every run. Users that draw
    no row do not exist.

    Args:
      num_rows: training rows.
      num_users: users to draw from; default num_rows // ROWS_PER_USER.
      exponent: the Zipf exponent.

    Returns:
      int64 ``[num_rows]`` user ids.
    """
    users = num_users or max(1, num_rows // ROWS_PER_USER)
    weights = (np.arange(users) + 1.0) ** -float(exponent)
    rng = np.random.default_rng(USERS_SEED)
    return rng.choice(users, size=num_rows, p=weights / weights.sum()).astype(np.int64)


def user_summary(settings: TrainSettings, users: np.ndarray) -> dict[str, Any]:
    """What results.json says about the synthetic users and the cap."""
    from dpcore import units

    table = units.unit_table(users, max_rows_per_unit=settings.max_rows_per_user)
    return {
        "synthetic": True,
        "assignment": f"{settings.dataset} training rows assigned to synthetic users, rows per "
        f"user Zipf-like (exponent {ZIPF_EXPONENT}), fixed seed {USERS_SEED}",
        "num_users": table.num_units,
        "max_rows_per_user": table.max_rows_per_unit,
        "rows_per_user_max": int(table.num_rows.max()),
        "rows_per_user_median": float(np.median(table.num_rows)),
        "rows_dropped_by_cap": table.dropped_rows,
    }


# -------------------------------------------------------------------------------------- model
def build_model(name: str, input_shape: tuple[int, ...], num_classes: int = 10) -> Any:
    """`mlp` (one tanh hidden layer), `cnn` (the end-to-end tanh CNN of Tramèr & Boneh) or
    `scatter_linear` (their linear model on scattering features, see `scatter_features`).

    The CNN is conv16 8x8 stride 2 -> tanh -> maxpool 2 stride 1 -> conv32 4x4 stride 2 ->
    tanh -> maxpool 2 stride 1 -> dense32 -> tanh -> dense10 (logits). The first convolution
    uses 'same' padding (the original pads by 2; on 28x28 inputs both give the same 5x5x32
    feature map before the last pooling and the same 26,010 parameters). On inputs smaller than
    28x28 (the 8x8 digits) the second convolution also uses 'same' padding so shapes stay valid.
    """
    import keras

    if name == "mlp":
        layers = zoo.tanh_mlp_layers(keras, input_shape, num_classes, hidden=128)
    elif name == "cnn":
        layers = zoo.cnn_layers(keras, input_shape, num_classes)
    elif name == "scatter_linear":  # a linear classifier on scattering features
        layers = [
            keras.Input(input_shape),
            keras.layers.Dense(num_classes, kernel_initializer="zeros"),
        ]
    else:
        raise ValueError(f"Unknown model {name!r}; expected one of {MODELS}.")
    return keras.Sequential(layers, name=name)


def build_optimizer(settings: TrainSettings) -> Any:
    import keras

    if settings.optimizer == "sgd":
        return keras.optimizers.SGD(settings.learning_rate, momentum=settings.momentum)
    return keras.optimizers.Adam(settings.learning_rate)


# ------------------------------------------------------------------------------- privacy plan
@dataclasses.dataclass(frozen=True)
class Plan:
    """Derived schedule and σ, all read off the run's DPConfig.

    Epoch k (from 0) runs logical steps ``[epoch_end_steps[k-1], epoch_end_steps[k])``; the ends
    are ``DPConfig.steps_for_epochs(k + 1)``, the library's one definition of "steps after E
    epochs", so the run trains exactly the steps the accountant and the epsilon CLI count.
    """

    num_examples: int  # privacy units: rows, or users under --privacy_unit=user
    epoch_end_steps: tuple[int, ...]
    total_steps: int
    expected_batch_size: float
    sampling_prob: float
    noise_multiplier: float | None

    def epoch_start(self, epoch: int) -> int:
        """The logical step the epoch starts at (0 for the first)."""
        return 0 if epoch == 0 else self.epoch_end_steps[epoch - 1]

    def epoch_steps(self, epoch: int) -> int:
        """Logical steps in the epoch: ceil(N / B), the library's steps per epoch."""
        return self.epoch_end_steps[epoch] - self.epoch_start(epoch)


def dp_config(settings: TrainSettings, num_examples: int, noise_multiplier: float) -> Any:
    """The frozen DPConfig describing the whole run (what is accounted is what runs)."""
    from dpcore.config import DPConfig

    return DPConfig.from_epochs(
        epochs=settings.epochs,
        l2_norm_clip=settings.l2_norm_clip,
        noise_multiplier=noise_multiplier,
        expected_batch_size=float(min(settings.batch_size, num_examples)),
        num_examples=num_examples,
        sampling=settings.sampling,
        target_delta=settings.target_delta,
        privacy_unit=settings.privacy_unit,
    )


def make_plan(settings: TrainSettings, num_examples: int) -> Plan:
    """The run's schedule and σ (calibrated by the accountant when --target_epsilon is given)."""
    from dpcore.config import DPConfig

    config = dp_config(settings, num_examples, settings.noise_multiplier or 0.0)
    noise = settings.noise_multiplier
    if settings.dp and settings.target_epsilon is not None:
        fields = config.to_dict()
        for derived in ("noise_multiplier", "sampling_prob", "epochs"):
            fields.pop(derived)
        noise = float(
            DPConfig.calibrated(target_epsilon=settings.target_epsilon, **fields).noise_multiplier
        )
    return Plan(
        num_examples=num_examples,
        epoch_end_steps=tuple(config.steps_for_epochs(k) for k in range(1, settings.epochs + 1)),
        total_steps=config.steps,
        expected_batch_size=config.expected_batch_size,
        sampling_prob=config.sampling_prob,
        noise_multiplier=noise if settings.dp else None,
    )


def privacy_report(settings: TrainSettings, ledger: Any) -> dict[str, Any]:
    """ε by PLD and RDP of the steps the ledger holds (those the optimizer applied)."""
    if not settings.dp:
        return {"dp": False, "epsilon": math.inf, "note": "non-private baseline"}
    delta = settings.target_delta
    report: dict[str, Any] = {
        "dp": True,
        "steps": ledger.steps,
        "target_delta": delta,
        "privacy_unit": settings.privacy_unit,
    }
    if ledger.steps == 0:
        report.update(epsilon=0.0, epsilon_pld=0.0, epsilon_rdp=0.0, dp_event=None)
        return report
    report["dp_event"] = str(ledger.dp_event())
    report["epsilon_pld"] = float(ledger.epsilon(target_delta=delta, accountant="pld"))
    report["epsilon_rdp"] = float(ledger.epsilon(target_delta=delta, accountant="rdp"))
    report["epsilon"] = report["epsilon_pld"]
    report["accounting"] = (
        "Poisson subsampled Gaussian (PoissonSampledDpEvent)"
        if settings.sampling == "poisson"
        else "shuffled batches: no-amplification bound (each epoch composes as Gaussian "
        "mechanisms; no Poisson amplification assumed)"
    )
    if settings.privacy_unit == "user":
        report["accounting"] += (
            "; over users: epsilon per user (add/remove one user with all their rows)"
        )
    return report


# ------------------------------------------------------------------------------------ batches
def train_batches(
    settings: TrainSettings,
    plan: Plan,
    x: Any,
    y: Any,
    epoch: int,
    users: np.ndarray | None = None,
    shard: tuple[int, int, int] | None = None,
) -> Any:
    """One epoch of `(x, y, mask, step_end)` elements, continuing the run's step numbering.

    With `shard` = (workers, this worker's index, shared seed), this worker's share of the
    cluster's Poisson sample (`dpcore.sampling.sharded_poisson_batches`).

    With `users` (``--privacy_unit=user``) each step Poisson-samples users, each with up to
    ``max_rows_per_user`` of their rows (`dpcore.units.unit_batches`).
    """
    from dpcore import sampling, units

    if users is not None:
        return units.unit_batches(
            x,
            y,
            unit_ids=users,
            sampling_prob=plan.sampling_prob,
            steps=plan.epoch_steps(epoch),
            max_rows_per_unit=settings.max_rows_per_user,
            seed=settings.seed,
            start_step=plan.epoch_start(epoch),
        )
    if shard is not None:
        workers, index, seed = shard
        return sampling.sharded_poisson_batches(
            x,
            y,
            sampling_prob=plan.sampling_prob,
            steps=plan.epoch_steps(epoch),
            num_workers=workers,
            worker_index=index,
            seed=seed,
            start_step=plan.epoch_start(epoch),
        )
    if settings.sampling == "poisson":
        return sampling.poisson_batches(
            x,
            y,
            sampling_prob=plan.sampling_prob,
            steps=plan.epoch_steps(epoch),
            seed=settings.seed,
            start_step=plan.epoch_start(epoch),
        )
    seed = None if settings.seed is None else settings.seed + epoch
    return sampling.shuffled_batches(x, y, batch_size=settings.batch_size, epochs=1, seed=seed)


# ----------------------------------------------------------------------------------- training
def cluster_strategy(settings: TrainSettings) -> Any:
    """`MultiWorkerMirroredStrategy` when `TF_CONFIG` is set (this process is one worker of
    that cluster, e.g. under `dpcore_experiments.launch_local`), else None. Call it before any
    other TensorFlow operation of the process."""
    if not os.environ.get("TF_CONFIG"):
        return None
    if not settings.dp or settings.sampling != "poisson" or settings.privacy_unit != "example":
        raise ValueError(
            "TF_CONFIG is set: a cluster run trains DP on Poisson-sampled examples (sharded "
            "across workers); --nodp, --sampling=shuffle and --privacy_unit=user are for one "
            "process."
        )
    if settings.resume:
        raise ValueError("--resume is for one process (the checkpoint is the chief's).")
    import tensorflow as tf

    return tf.distribute.MultiWorkerMirroredStrategy()


def _versions() -> dict[str, str]:
    import keras
    import tensorflow as tf

    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "dp_accounting": importlib.metadata.version("dp-accounting"),
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def _build_training_model(settings: TrainSettings, plan: Plan, model: Any) -> tuple[Any, Any]:
    """(trainable model, optimizer): a make_private DPModel, or the plain compiled model.

    The DP model is built from the same DPConfig that the accountant uses, so the optimizer's
    clip, noise and normalisation (expected batch size q * N) are exactly what is accounted.
    """
    import keras

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    metrics = [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
    inner = build_optimizer(settings)
    if not settings.dp:
        model.compile(optimizer=inner, loss=loss, metrics=metrics)
        return model, inner
    import dpcore.model
    from dpcore.options import ExecutionOptions

    group_size = settings.max_rows_per_user if settings.privacy_unit == "user" else 1
    dp_model = dpcore.model.make_private(
        model,
        optimizer=inner,
        loss=loss,
        metrics=metrics,
        config=dp_config(settings, plan.num_examples, plan.noise_multiplier),
        seed=settings.seed,
        options=ExecutionOptions(group_size=group_size),
    )
    return dp_model, dp_model.optimizer


def _evaluate(model: Any, x: np.ndarray, y: np.ndarray, batch_size: int) -> tuple[float, float]:
    out = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    return float(out["loss"]), float(out["accuracy"])


# Settings that may differ between an interrupted run and its --resume continuation.
_RESUME_FREE = (
    "resume",
    "stop_after_epochs",
    "verbose",
    "output_dir",
    "data_dir",
    "feature_cache",
)


def _check_same_run(previous: dict[str, Any], current: dict[str, Any]) -> None:
    diffs = {
        k: (previous.get(k), v)
        for k, v in current.items()
        if k not in _RESUME_FREE and previous.get(k) != v
    }
    if diffs:
        raise ValueError(
            "--resume must continue the same run; these settings differ from the checkpointed "
            f"run (previous, now): {diffs}."
        )


def baseline_batches(batches: Any, *, expected_batch_size: float) -> Any:
    """The sampler's ``(x, y, mask, step_end)`` as ``(x, y, sample_weight)`` for a plain Keras
    step with the DP step's normalization.

    Keras averages a weighted loss over all P rows of a padded batch; weights
    ``mask * P / expected_batch_size`` make it ``sum(real rows' losses) / expected_batch_size``,
    what the DP step divides by, so the non-private baseline differs only by clipping and noise.
    """
    import tensorflow as tf

    scale = 1.0 / float(expected_batch_size)

    def as_weights(*element: Any) -> tuple[Any, Any, Any]:
        # A SampledBatch (named tuple) arrives whole; a plain 4-tuple arrives unpacked.
        x, y, mask, _ = element[0] if len(element) == 1 else element
        rows = tf.cast(tf.shape(mask)[0], tf.float32)
        return x, y, mask * rows * scale

    return batches.map(as_weights)


def run_training(settings: TrainSettings) -> dict[str, Any]:
    """Trains per `settings`, writes results.json / checkpoint when `output_dir` is set.

    Returns:
      The results dict (also written to `<output_dir>/results.json`).

    Privacy:
      With `dp=True` the model and every checkpoint are (ε, δ)-DP for the ε reported (PLD; RDP
      also reported). Per-epoch train/test metrics are computed on the raw data and are NOT
      private: they are diagnostics for the experimenter and must not be released as DP.
    """
    import tensorflow as tf

    strategy = cluster_strategy(settings)  # before any other TensorFlow operation
    from dpcore import distribute
    from dpcore import sampling as _sampling  # noqa: F401  (fail early if dpcore is broken)

    with cli.user_errors(FileNotFoundError, ValueError):  # the user's data files
        (x_train, y_train), (x_test, y_test) = load_data(settings)
    users = None
    num_examples = int(x_train.shape[0])  # privacy units: rows, or users
    if settings.privacy_unit == "user":
        users = synthetic_users(num_examples, settings.num_users)
        num_examples = len(np.unique(users))
    plan = make_plan(settings, num_examples)
    if settings.seed is not None:
        tf.keras.utils.set_random_seed(settings.seed)

    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build_model(settings.model, tuple(x_train.shape[1:]))
        train_model, optimizer = _build_training_model(settings, plan, model)
        optimizer.build(model.trainable_variables)
    shard = None
    if strategy is not None:  # every worker samples its shard with the chief's seed
        info = distribute.worker_info(strategy)
        seed = settings.seed if settings.seed is not None else distribute.shared_seed(strategy)
        shard = (info.num_workers, info.worker_index, seed)

    results: dict[str, Any] = {
        "settings": dataclasses.asdict(settings),
        "plan": {**dataclasses.asdict(plan), "epoch_end_steps": list(plan.epoch_end_steps)},
        "dataset": {
            "name": settings.dataset,
            "num_train": int(x_train.shape[0]),
            "num_test": int(x_test.shape[0]),
            "input_shape": list(x_train.shape[1:]),
            "evaluated_on": (
                f"validation: the last {settings.validation_examples} training examples"
                if settings.validation_examples
                else "test"
            ),
        },
        "versions": _versions(),
        "epochs": [],
    }
    if users is not None:
        results["users"] = user_summary(settings, users)
    manager = None
    epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False)
    results_path = None
    if settings.output_dir:
        os.makedirs(settings.output_dir, exist_ok=True)
        results_path = os.path.join(settings.output_dir, RESULTS_FILE)
        if strategy is not None:  # every worker writes; the chief's copy is the one kept
            results_path = distribute.worker_path(results_path, strategy)
        # Model variables are listed explicitly: a Keras 3 model object is not tracked by
        # tf.train.Checkpoint, its variables are.
        checkpoint = tf.train.Checkpoint(
            model_variables=list(model.variables), optimizer=optimizer, epoch=epoch_var
        )
        checkpoint_dir = os.path.join(settings.output_dir, CHECKPOINT_DIR)
        if strategy is not None:
            checkpoint_dir = distribute.worker_path(checkpoint_dir, strategy)
        manager = tf.train.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=1)

    epsilon_log = None  # the DP run's ε per epoch, from the steps the optimizer applied
    if settings.dp:
        from dpcore.accounting import PrivacyLedger
        from dpcore.callbacks import EpsilonCallback

        config = dp_config(settings, num_examples, plan.noise_multiplier)
        epsilon_log = EpsilonCallback(config, ledger=config.new_ledger())
    start_epoch = 0
    if settings.resume:
        if manager.latest_checkpoint is None or not os.path.exists(results_path):
            raise FileNotFoundError(f"--resume: no checkpoint/results in {settings.output_dir!r}.")
        checkpoint.read(manager.latest_checkpoint).assert_existing_objects_matched()
        with open(results_path) as f:
            previous = json.load(f)
        _check_same_run(previous["settings"], dataclasses.asdict(settings))
        start_epoch = int(epoch_var.numpy())
        results["epochs"] = previous["epochs"][:start_epoch]
        results["resumed_from_epoch"] = start_epoch
        if epsilon_log is not None and "ledger" in previous:
            epsilon_log.ledger = PrivacyLedger.from_dict(previous["ledger"])

    # Train metrics use a fixed subset (the first examples) to keep evaluation cheap.
    n_eval = min(num_examples, settings.train_eval_examples)
    steps_done = plan.epoch_start(start_epoch)
    end_epoch = settings.epochs
    if settings.stop_after_epochs is not None:
        end_epoch = min(end_epoch, start_epoch + settings.stop_after_epochs)
    callbacks = [] if epsilon_log is None else [epsilon_log]
    # One tensor copy of the training data for every epoch's sampler: converting the arrays per
    # epoch would keep a copy per finished epoch until Python's cycle collector frees Keras's
    # datasets (on Fashion-MNIST scattering features, about 1 GB per epoch).
    x_feed, y_feed = tf.convert_to_tensor(x_train), tf.convert_to_tensor(y_train)
    for epoch in range(start_epoch, end_epoch):
        batches = train_batches(settings, plan, x_feed, y_feed, epoch, users, shard)
        if not settings.dp:
            batches = baseline_batches(batches, expected_batch_size=plan.expected_batch_size)
        start = time.perf_counter()
        with warnings.catch_warnings():
            # The epoch's dataset is finite with unknown cardinality (a rare overflow adds
            # chunks), so Keras warns when it ends; that end is intended.
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            train_model.fit(batches, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
        train_time = time.perf_counter() - start
        steps_done = plan.epoch_end_steps[epoch]
        if epsilon_log is not None and epsilon_log.ledger.steps != steps_done:
            raise RuntimeError(
                f"epoch {epoch + 1} should end at logical step {steps_done}, but the optimizer "
                f"has applied {epsilon_log.ledger.steps}; the run's accounting would not match."
            )
        train_loss, train_acc = _evaluate(
            train_model, x_train[:n_eval], y_train[:n_eval], settings.eval_batch_size
        )
        test_loss, test_acc = _evaluate(train_model, x_test, y_test, settings.eval_batch_size)
        record = {
            "epoch": epoch + 1,
            "train_loss": train_loss,
            "train_accuracy": train_acc,
            "test_loss": test_loss,
            "test_accuracy": test_acc,
            "wall_time_s": train_time,
            "steps": steps_done,
        }
        if epsilon_log is not None:
            record["epsilon"] = epsilon_log.history[-1]["epsilon"]
        results["epochs"].append(record)
        if settings.verbose:
            eps = f" eps={record['epsilon']:.3f}" if "epsilon" in record else ""
            print(
                f"epoch {epoch + 1}/{settings.epochs}: train_acc={train_acc:.4f} "
                f"test_acc={test_acc:.4f} test_loss={test_loss:.4f}{eps} ({train_time:.1f}s)",
                flush=True,
            )
        epoch_var.assign(epoch + 1)
        if manager is not None:
            manager.save(checkpoint_number=epoch + 1)
            if epsilon_log is not None:
                results["ledger"] = epsilon_log.ledger.to_dict()
            common.write_json_atomic(results_path, results, sort_keys=True, default=str)

    results["privacy"] = privacy_report(
        settings, None if epsilon_log is None else epsilon_log.ledger
    )
    results["completed"] = steps_done == plan.total_steps
    last = results["epochs"][-1] if results["epochs"] else {}
    results["test_accuracy"] = last.get("test_accuracy")
    results["total_train_time_s"] = float(sum(e["wall_time_s"] for e in results["epochs"]))
    if results_path:
        common.write_json_atomic(results_path, results, sort_keys=True, default=str)
    return results


# -------------------------------------------------------------------------------------- flags
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
