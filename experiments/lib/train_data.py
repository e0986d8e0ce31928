"""The data of a `dpcore-train` run: images or scattering features, synthetic users, batches.

Contract:
  * `load_data` gives (x_train, y_train), (x_eval, y_eval) of a dataset `dpcore.data` reads
    from local files (nothing is downloaded); `scatter_features` maps images to scattering
    features for `scatter_linear`.
  * `synthetic_users` assigns the training rows to SYNTHETIC users (the datasets have no user
    column), the same in every run.
  * `train_batches` is one epoch of the sampler that is accounted (Poisson, sharded Poisson,
    per-user Poisson, or shuffled), continuing the run's step numbering; `baseline_batches`
    feeds the same batches to a plain Keras step with the DP step's normalization.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from dpcore_experiments.lib import scatternet
from dpcore_experiments.lib.train_plan import Plan, TrainSettings


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
