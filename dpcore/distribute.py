"""DP training across workers (``tf.distribute.MultiWorkerMirroredStrategy``).

Contract:
- :func:`worker_info` says how many workers a strategy spans, which one this process is, and
  whether it is the chief (worker 0, or the "chief" task). Any other strategy is one worker.
- :func:`shared_seed` is a seed drawn from OS entropy on the chief and broadcast to every
  worker (a variable created under a multi-worker strategy takes the chief's initial value,
  :func:`chief_value`), so all workers draw the same sampling coins without a fixed, guessable
  seed. Every worker must call it at the same point of the program (it is a collective
  operation); :meth:`dpcore.DPOptimizer.fork_noise` takes its new noise seed the same way.
- :func:`distribute_sampled` feeds a sampler's dataset to ``strategy.run``: under a multi-worker
  strategy each worker's dataset must be its own shard
  (:func:`dpcore.sampling.sharded_poisson_batches`), and each worker's elements go to its one
  replica unchanged (no auto-sharding, no re-batching); under a single-worker strategy the
  batches are padded with masked rows (whole units of ``group_size`` rows) and split across the
  local replicas (:func:`for_replicas`). Data in privacy units of several rows
  (:func:`dpcore.units.unit_batches`) is refused unless the caller passes the step's
  ``ExecutionOptions`` with the data's ``group_size``. Either way every replica clips its own
  rows and
  :class:`dpcore.DPOptimizer` all-reduces the clipped sums and adds the noise once per global
  step, divided by the global ``expected_batch_size``.
- Only the chief keeps run outputs (ε ledgers, results, checkpoints): every worker runs the
  same callbacks (saving reads synchronized variables, a collective operation), and
  :func:`worker_path` sends the non-chief workers' copies to a temporary folder; test
  :func:`is_chief` before writing anything else.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from dpcore import sampling
from dpcore.options import ExecutionOptions

__all__ = [
    "WorkerInfo",
    "any_worker",
    "check_sharding",
    "chief_value",
    "distribute_sampled",
    "for_replicas",
    "is_chief",
    "shared_seed",
    "worker_info",
    "worker_path",
]


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """Where this process stands in a (possibly multi-worker) strategy.

    Attributes:
      num_workers: W, the processes that train together (1 for a single-machine strategy).
      worker_index: this process's index in [0, W); the chief is 0.
      is_chief: whether this process writes the run's outputs.
    """

    num_workers: int
    worker_index: int
    is_chief: bool


def worker_info(strategy: Any = None) -> WorkerInfo:
    """The workers of ``strategy`` (default: the current one) and this process's place.

    Under ``MultiWorkerMirroredStrategy`` the workers are the cluster's "chief" and "worker"
    tasks; the chief (or worker 0 where there is no chief task) is index 0, the others follow.
    """
    strategy = strategy or tf.distribute.get_strategy()
    resolver = getattr(strategy, "cluster_resolver", None)
    cluster = resolver.cluster_spec().as_dict() if resolver is not None else {}
    chiefs, workers = len(cluster.get("chief", [])), len(cluster.get("worker", []))
    if resolver is None or chiefs + workers <= 1:
        return WorkerInfo(num_workers=1, worker_index=0, is_chief=True)
    task_type, task_id = resolver.task_type, int(resolver.task_id or 0)
    if task_type == "chief":
        index = 0
    elif task_type == "worker":
        index = chiefs + task_id
    else:
        raise ValueError(f"a {task_type!r} task does not train; run it on chief/worker tasks.")
    return WorkerInfo(num_workers=chiefs + workers, worker_index=index, is_chief=index == 0)


def any_worker(strategy: Any = None) -> Callable[[bool], bool]:
    """A function ``agree(flag) -> bool``: True when ``flag`` is True on any worker.

    Under a multi-worker strategy each call is a collective operation (every worker calls it
    at the same point); on one worker it returns ``flag``. Used to stop every worker after the
    same step when a callback on one of them asks to stop.
    """
    strategy = strategy or tf.distribute.get_strategy()
    if worker_info(strategy).num_workers == 1:
        return bool

    @tf.function
    def reduce(flag: tf.Tensor) -> tf.Tensor:
        def replica(f: tf.Tensor) -> tf.Tensor:
            context = tf.distribute.get_replica_context()
            assert context is not None
            return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(f))

        return strategy.experimental_local_results(strategy.run(replica, args=(flag,)))[0]

    return lambda flag: bool(reduce(tf.constant(1.0 if flag else 0.0)) > 0)


def is_chief(strategy: Any = None) -> bool:
    """Whether this process writes the run's outputs (always True on one worker)."""
    return worker_info(strategy).is_chief


def worker_path(path: str, strategy: Any) -> str:
    """Where this worker writes an output that the chief alone should keep.

    Under a multi-worker strategy every worker must run the same callbacks: saving a model
    reads its synchronized variables (metrics), which is a collective operation, so a
    checkpoint written by the chief alone would leave it waiting for the others. Each worker
    writes, but only the chief to ``path``; the others write to a private temporary folder
    (removed when the process exits), so the run leaves one copy of each output. E.g.
    ``keras.callbacks.ModelCheckpoint(worker_path("ckpt.weights.h5", strategy))`` or
    ``EpsilonCallback(config, ledger_path=worker_path("ledger.json", strategy))``.

    Args:
      path: the output's file or folder path.
      strategy: the run's strategy (given explicitly: outside its scope the current strategy
        is the default one, which has one worker).

    Returns:
      ``path`` on the chief (and on a single worker); elsewhere a path with the same base name
      under a temporary folder of this process.
    """
    if is_chief(strategy):
        return path
    if not _SCRATCH:
        _SCRATCH.append(tempfile.mkdtemp(prefix="dpcore_worker_"))
        atexit.register(shutil.rmtree, _SCRATCH[0], ignore_errors=True)
    return os.path.join(_SCRATCH[0], os.path.basename(os.path.normpath(path)))


_SCRATCH: list[str] = []  # this process's folder for non-chief outputs


def shared_seed(strategy: Any = None) -> int:
    """A non-negative 63-bit seed from the chief's OS entropy, the same on every worker.

    Pass it to :func:`dpcore.sampling.sharded_poisson_batches` on every worker.

    Args:
      strategy: the run's strategy (default: the current one). All workers must call this at
        the same point of the program: under a multi-worker strategy it is a broadcast.

    Returns:
      The seed (each worker's own entropy on a single-worker strategy: there is no one to agree
      with).

    Privacy:
      The seed decides which examples each step samples; drawn from OS entropy per run it is
      unknown outside the run, as the single-machine sampler's default is.
    """
    entropy = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    return chief_value([entropy], strategy)[0]


def chief_value(values: list[int], strategy: Any = None) -> list[int]:
    """The chief's ``values`` (int64) on every worker of ``strategy``.

    Args:
      values: this worker's integers (e.g. its own OS entropy).
      strategy: the run's strategy (default: the current one). Under a multi-worker strategy
        this is a broadcast: every worker must call it at the same point of the program.

    Returns:
      The chief's ``values`` (this worker's own on a single-worker strategy).
    """
    strategy = strategy or tf.distribute.get_strategy()
    if worker_info(strategy).num_workers == 1:
        return [int(v) for v in values]
    with strategy.scope():
        # A variable's initial value is broadcast from the chief under a multi-worker strategy.
        shared = tf.Variable(tf.constant(values, tf.int64), trainable=False, name="chief_value")
    return [int(v) for v in np.ravel(shared.numpy())]


def for_replicas(dataset: Any, replicas: int, *, group_size: int | None = None) -> Any:
    """The sampler's ``(x, y, mask, step_end)`` dataset, made splittable across local replicas.

    A multi-replica strategy splits every component of a batch along its rows, so ``step_end``
    is copied to every row (as float32; :func:`dpcore.step.dp_step` and the other
    :func:`dpcore.sampling.as_sampled_batch` consumers fold it back) and the batch is padded
    with masked rows to a multiple of ``replicas * group_size``, so that every replica gets the
    same number of rows (at least one unit) and no replica's share cuts a privacy unit of
    ``group_size`` rows in two (padding is data-independent). Other inputs are returned
    unchanged.

    Args:
      dataset: the sampler's dataset (anything else is returned as it is).
      replicas: the strategy's replicas in sync.
      group_size: K, the rows of one privacy unit (``ExecutionOptions(group_size=K)``); None
        takes it from the dataset's :class:`~dpcore.sampling.SamplingSpec` (1 without one).

    Privacy:
      Only the layout changes: the added rows have mask 0 (they contribute nothing) and their
      number depends on the static batch size, ``replicas`` and ``group_size`` alone; units
      stay whole (each replica's rows start at a multiple of K); the copied ``step_end`` makes
      every replica end the same logical step, so the noise is still added once per step.
    """
    if replicas <= 1 or not isinstance(dataset, tf.data.Dataset):
        return dataset
    if group_size is None:
        spec = sampling.sampling_spec(dataset)
        group_size = 1 if spec is None else spec.group_size
    element = sampling.as_sampled_batch(dataset.element_spec)
    if element is None or element.step_end.shape.rank != 0:
        return dataset
    rows = element.mask.shape[0]
    if rows is None:
        raise ValueError(
            "a (x, y, mask, step_end) dataset under a multi-replica strategy needs a static "
            "batch size; use dpcore.sampling's batches (fixed padded_batch_size)."
        )
    multiple = replicas * int(group_size)
    extra = -rows % multiple if rows >= multiple else multiple - rows

    def pad(t: tf.Tensor) -> tf.Tensor:
        return tf.pad(t, [[0, extra]] + [[0, 0]] * (t.shape.rank - 1))

    def split(*element: Any) -> sampling.SampledBatch:
        # A SampledBatch reaches .map as one argument, a plain 4-tuple as four.
        batch = sampling.as_sampled_batch(element[0] if len(element) == 1 else element)
        assert batch is not None
        end = batch.step_end
        x, y, mask = tf.nest.map_structure(pad, (batch.x, batch.y, batch.mask))
        return sampling.SampledBatch(x, y, mask, tf.fill(tf.shape(mask), tf.cast(end, tf.float32)))

    return dataset.map(split)


def check_sharding(dataset: Any, strategy: Any = None) -> None:
    """Refuses sampler data that does not match the strategy's workers.

    Raises:
      ValueError: under a multi-worker strategy, for data whose
        :class:`~dpcore.sampling.SamplingSpec` is not this worker's shard (e.g. every worker
        sampling the whole dataset), for sampler batches without a spec, or for more than one
        replica per worker.

    Privacy:
      Disjoint shards keep an example in at most one replica of a global step, so the clipped
      sum's sensitivity stays C, the scale of the noise.
    """
    strategy = strategy or tf.distribute.get_strategy()
    info = worker_info(strategy)
    if info.num_workers == 1:
        return
    if strategy.num_replicas_in_sync != info.num_workers:
        raise ValueError(
            f"{strategy.num_replicas_in_sync} replicas on {info.num_workers} workers: dpcore "
            "supports one replica per worker under a multi-worker strategy."
        )
    spec = sampling.sampling_spec(dataset)
    if spec is None:
        raise ValueError(
            f"a {info.num_workers}-worker run needs each worker's shard of the sampling, from "
            "dpcore.sampling.sharded_poisson_batches (its SamplingSpec says which shard); this "
            "data carries no SamplingSpec, so nothing says its workers' samples are disjoint."
        )
    spec.check_workers(info.num_workers, info.worker_index)


def distribute_sampled(
    strategy: Any, dataset: tf.data.Dataset, *, options: ExecutionOptions | None = None
) -> Any:
    """A sampler's dataset as ``strategy``'s distributed dataset (see the module contract).

    Args:
      strategy: the ``tf.distribute`` strategy of the run.
      dataset: this worker's ``(x, y, mask, step_end)`` dataset; under a multi-worker strategy
        its shard from :func:`dpcore.sampling.sharded_poisson_batches`.
      options: the :class:`dpcore.ExecutionOptions` the step will run with (those passed to
        :func:`dpcore.dp_train_step`). Required for data in privacy units of several rows
        (:func:`dpcore.units.unit_batches`), whose ``group_size`` they must match; the
        batches are then padded in whole units (:func:`for_replicas`).

    Returns:
      A distributed dataset whose elements are ``strategy.run`` arguments.

    Raises:
      ValueError: see :func:`check_sharding`; for units of ``K > 1`` rows when ``options`` is
        not given or its ``group_size`` is not K; for ``options.group_size > 1`` on data
        without a :class:`~dpcore.sampling.SamplingSpec`.

    Privacy:
      Each example is in at most one replica's rows of a step (disjoint shards, or the rows of
      one batch split across local replicas). A unit of K rows is clipped as one only by a step
      with ``ExecutionOptions(group_size=K)``: clipped row by row, removing it would move the
      clipped sum by up to K C while the noise is scaled to C, so units are refused unless the
      caller states that group size here.
    """
    check_sharding(dataset, strategy)
    group_size = _check_group_size(dataset, options)
    if worker_info(strategy).num_workers > 1:
        return strategy.distribute_datasets_from_function(lambda _: dataset)
    return strategy.experimental_distribute_dataset(
        for_replicas(dataset, strategy.num_replicas_in_sync, group_size=group_size)
    )


def _check_group_size(dataset: Any, options: ExecutionOptions | None) -> int:
    """The rows per unit that the data and the step's ``options`` agree on (see
    :func:`distribute_sampled`)."""
    spec = sampling.sampling_spec(dataset)
    if options is None:
        if spec is not None and spec.group_size > 1:
            raise ValueError(
                f"the data comes in privacy units of {spec.group_size} rows "
                "(dpcore.units.unit_batches), which the step must clip as one: pass "
                f"options=ExecutionOptions(group_size={spec.group_size}) to dp_train_step and "
                f"the same options to distribute_sampled(..., options=...)."
            )
        return 1 if spec is None else spec.group_size
    k = options.group_size
    if spec is not None:
        spec.check_group_size(k)
    elif k > 1 and sampling.as_sampled_batch(getattr(dataset, "element_spec", None)) is not None:
        raise ValueError(
            f"ExecutionOptions(group_size={k}) on (x, y, mask, step_end) batches that carry no "
            "SamplingSpec: whether their chunks keep each unit's rows together is unknown. Feed "
            "dpcore.units.unit_batches(...) as returned, or re-attach its spec after a "
            "per-element .map (dpcore.sampling.with_sampling_spec)."
        )
    return k
