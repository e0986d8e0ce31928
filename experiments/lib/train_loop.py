"""The training loop of `dpcore-train`: epochs of the accounted sampler, results, checkpoints.

Contract:
  * `run_training(settings)` trains per a plain `TrainSettings` (no flags) and returns the
    results dict, also written to `<output_dir>/results.json` after every epoch with the
    checkpoint (model and optimizer state, the noise seed and step counter included).
  * Every epoch trains exactly the logical steps `DPConfig.steps_for_epochs` counts; the run
    stops with an error if the optimizer applied a different number (the accounting would not
    match what ran). `--resume` continues the same run from its last finished epoch.
  * With `TF_CONFIG` set the process is one worker of a `MultiWorkerMirroredStrategy` cluster
    (`cluster_strategy`): every worker Poisson-samples its shard of the one global sample and
    only the chief's results.json and checkpoint are kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import warnings
from typing import Any

import numpy as np
from dpcore_experiments.lib import cli, common
from dpcore_experiments.lib.train_data import (
    baseline_batches,
    load_data,
    synthetic_users,
    train_batches,
    user_summary,
)
from dpcore_experiments.lib.train_model import (
    build_model,
    build_training_model,
    evaluate,
    versions,
)
from dpcore_experiments.lib.train_plan import (
    CHECKPOINT_DIR,
    RESULTS_FILE,
    Plan,
    TrainSettings,
    dp_config,
    make_plan,
    privacy_report,
)


def cluster_strategy(settings: TrainSettings) -> Any:
    """`MultiWorkerMirroredStrategy` when `TF_CONFIG` is set (this process is one worker of
    that cluster, e.g. under `dpcore-launch-local`), else None. Call it before any
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
    """A `ValueError` naming the settings that differ from the checkpointed run's."""
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


@dataclasses.dataclass(frozen=True)
class _Data:
    """The run's arrays; `users` (a user id per training row) under --privacy_unit=user."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    users: np.ndarray | None
    num_examples: int  # privacy units: rows, or users


@dataclasses.dataclass
class _Run:
    """What the epochs work with: the model, the ε log, where results and checkpoints go."""

    train_model: Any
    epoch_var: Any  # the checkpointed count of finished epochs
    shard: tuple[int, int, int] | None = None  # (workers, this worker's index, shared seed)
    epsilon_log: Any = None  # the DP run's ε per epoch, from the steps the optimizer applied
    results_path: str | None = None
    checkpoint: Any = None
    manager: Any = None


def _load(settings: TrainSettings) -> _Data:
    with cli.user_errors(FileNotFoundError, ValueError):  # the user's data files
        (x_train, y_train), (x_test, y_test) = load_data(settings)
    users = None
    num_examples = int(x_train.shape[0])
    if settings.privacy_unit == "user":
        users = synthetic_users(num_examples, settings.num_users)
        num_examples = len(np.unique(users))
    return _Data(x_train, y_train, x_test, y_test, users, num_examples)


def _first_results(settings: TrainSettings, plan: Plan, data: _Data) -> dict[str, Any]:
    """results.json before the first epoch: settings, plan, dataset, versions."""
    results: dict[str, Any] = {
        "settings": dataclasses.asdict(settings),
        "plan": {**dataclasses.asdict(plan), "epoch_end_steps": list(plan.epoch_end_steps)},
        "dataset": {
            "name": settings.dataset,
            "num_train": int(data.x_train.shape[0]),
            "num_test": int(data.x_test.shape[0]),
            "input_shape": list(data.x_train.shape[1:]),
            "evaluated_on": (
                f"validation: the last {settings.validation_examples} training examples"
                if settings.validation_examples
                else "test"
            ),
        },
        "versions": versions(),
        "epochs": [],
    }
    if data.users is not None:
        results["users"] = user_summary(settings, data.users)
    return results


def _add_outputs(
    run: _Run, settings: TrainSettings, model: Any, optimizer: Any, strategy: Any
) -> None:
    """results.json's path and the checkpoint manager (this worker's copies in a cluster)."""
    import tensorflow as tf

    from dpcore import distribute

    os.makedirs(settings.output_dir, exist_ok=True)
    results_path = os.path.join(settings.output_dir, RESULTS_FILE)
    if strategy is not None:  # every worker writes; the chief's copy is the one kept
        results_path = distribute.worker_path(results_path, strategy)
    # Model variables are listed explicitly: a Keras 3 model object is not tracked by
    # tf.train.Checkpoint, its variables are.
    checkpoint = tf.train.Checkpoint(
        model_variables=list(model.variables), optimizer=optimizer, epoch=run.epoch_var
    )
    checkpoint_dir = os.path.join(settings.output_dir, CHECKPOINT_DIR)
    if strategy is not None:
        checkpoint_dir = distribute.worker_path(checkpoint_dir, strategy)
    run.results_path = results_path
    run.checkpoint = checkpoint
    run.manager = tf.train.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=1)


def _resume(run: _Run, settings: TrainSettings, results: dict[str, Any]) -> int:
    """Restores the checkpoint and the finished epochs' results; returns the next epoch."""
    from dpcore.accounting import PrivacyLedger

    if run.manager.latest_checkpoint is None or not os.path.exists(run.results_path):
        raise FileNotFoundError(f"--resume: no checkpoint/results in {settings.output_dir!r}.")
    run.checkpoint.read(run.manager.latest_checkpoint).assert_existing_objects_matched()
    with open(run.results_path) as f:
        previous = json.load(f)
    _check_same_run(previous["settings"], dataclasses.asdict(settings))
    start_epoch = int(run.epoch_var.numpy())
    results["epochs"] = previous["epochs"][:start_epoch]
    results["resumed_from_epoch"] = start_epoch
    if run.epsilon_log is not None and "ledger" in previous:
        run.epsilon_log.ledger = PrivacyLedger.from_dict(previous["ledger"])
    return start_epoch


def _prepare_run(
    settings: TrainSettings, plan: Plan, data: _Data, strategy: Any
) -> tuple[_Run, dict[str, Any], int]:
    """The model, outputs and ε log of the run, resumed when asked: (run, results, epoch)."""
    import tensorflow as tf

    from dpcore import distribute

    if settings.seed is not None:
        tf.keras.utils.set_random_seed(settings.seed)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build_model(settings.model, tuple(data.x_train.shape[1:]))
        train_model, optimizer = build_training_model(settings, plan, model)
        optimizer.build(model.trainable_variables)
    shard = None
    if strategy is not None:  # every worker samples its shard with the chief's seed
        info = distribute.worker_info(strategy)
        seed = settings.seed if settings.seed is not None else distribute.shared_seed(strategy)
        shard = (info.num_workers, info.worker_index, seed)
    results = _first_results(settings, plan, data)
    run = _Run(train_model, tf.Variable(0, dtype=tf.int64, trainable=False), shard)
    if settings.output_dir:
        _add_outputs(run, settings, model, optimizer, strategy)
    if settings.dp:
        from dpcore.callbacks import EpsilonCallback

        config = dp_config(settings, data.num_examples, plan.noise_multiplier)
        run.epsilon_log = EpsilonCallback(config, ledger=config.new_ledger())
    start_epoch = _resume(run, settings, results) if settings.resume else 0
    return run, results, start_epoch


def _fit_epoch(
    settings: TrainSettings, plan: Plan, run: _Run, feed: tuple[Any, Any], users: Any, epoch: int
) -> float:
    """Trains one epoch of the accounted sampler; returns its wall time in seconds."""
    batches = train_batches(settings, plan, *feed, epoch, users, run.shard)
    if not settings.dp:
        batches = baseline_batches(batches, expected_batch_size=plan.expected_batch_size)
    callbacks = [] if run.epsilon_log is None else [run.epsilon_log]
    start = time.perf_counter()
    with warnings.catch_warnings():
        # The epoch's dataset is finite with unknown cardinality (a rare overflow adds
        # chunks), so Keras warns when it ends; that end is intended.
        warnings.filterwarnings("ignore", message="Your input ran out of data")
        run.train_model.fit(batches, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    train_time = time.perf_counter() - start
    steps_done = plan.epoch_end_steps[epoch]
    if run.epsilon_log is not None and run.epsilon_log.ledger.steps != steps_done:
        raise RuntimeError(
            f"epoch {epoch + 1} should end at logical step {steps_done}, but the optimizer "
            f"has applied {run.epsilon_log.ledger.steps}; the run's accounting would not match."
        )
    return train_time


def _epoch_record(
    settings: TrainSettings, run: _Run, data: _Data, epoch: int, steps: int, train_time: float
) -> dict[str, Any]:
    """The epoch's line of results.json; train metrics use a fixed subset (the first rows)."""
    n_eval = min(data.num_examples, settings.train_eval_examples)
    train_loss, train_acc = evaluate(
        run.train_model, data.x_train[:n_eval], data.y_train[:n_eval], settings.eval_batch_size
    )
    test_loss, test_acc = evaluate(
        run.train_model, data.x_test, data.y_test, settings.eval_batch_size
    )
    record = {
        "epoch": epoch + 1,
        "train_loss": train_loss,
        "train_accuracy": train_acc,
        "test_loss": test_loss,
        "test_accuracy": test_acc,
        "wall_time_s": train_time,
        "steps": steps,
    }
    if run.epsilon_log is not None:
        record["epsilon"] = run.epsilon_log.history[-1]["epsilon"]
    if settings.verbose:
        eps = f" eps={record['epsilon']:.3f}" if "epsilon" in record else ""
        print(
            f"epoch {epoch + 1}/{settings.epochs}: train_acc={train_acc:.4f} "
            f"test_acc={test_acc:.4f} test_loss={test_loss:.4f}{eps} ({train_time:.1f}s)",
            flush=True,
        )
    return record


def _save(run: _Run, results: dict[str, Any], epoch: int) -> None:
    """The checkpoint of the finished epoch and results.json with the ledger so far."""
    run.manager.save(checkpoint_number=epoch + 1)
    if run.epsilon_log is not None:
        results["ledger"] = run.epsilon_log.ledger.to_dict()
    common.write_json_atomic(run.results_path, results, sort_keys=True, default=str)


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
    from dpcore import sampling as _sampling  # noqa: F401  (fail early if dpcore is broken)

    data = _load(settings)
    plan = make_plan(settings, data.num_examples)
    run, results, start_epoch = _prepare_run(settings, plan, data, strategy)
    steps_done = plan.epoch_start(start_epoch)
    end_epoch = settings.epochs
    if settings.stop_after_epochs is not None:
        end_epoch = min(end_epoch, start_epoch + settings.stop_after_epochs)
    # One tensor copy of the training data for every epoch's sampler: converting the arrays per
    # epoch would keep a copy per finished epoch until Python's cycle collector frees Keras's
    # datasets (on Fashion-MNIST scattering features, about 1 GB per epoch).
    feed = (tf.convert_to_tensor(data.x_train), tf.convert_to_tensor(data.y_train))
    for epoch in range(start_epoch, end_epoch):
        train_time = _fit_epoch(settings, plan, run, feed, data.users, epoch)
        steps_done = plan.epoch_end_steps[epoch]
        results["epochs"].append(_epoch_record(settings, run, data, epoch, steps_done, train_time))
        run.epoch_var.assign(epoch + 1)
        if run.manager is not None:
            _save(run, results, epoch)

    results["privacy"] = privacy_report(
        settings, None if run.epsilon_log is None else run.epsilon_log.ledger
    )
    results["completed"] = steps_done == plan.total_steps
    last = results["epochs"][-1] if results["epochs"] else {}
    results["test_accuracy"] = last.get("test_accuracy")
    results["total_train_time_s"] = float(sum(e["wall_time_s"] for e in results["epochs"]))
    if run.results_path:
        common.write_json_atomic(run.results_path, results, sort_keys=True, default=str)
    return results
