"""``model.fit`` integration: a Keras model whose ``train_step`` is the DP-SGD step.

Contract:
- :class:`DPModel` wraps a built Keras model without modifying it: ``call`` delegates to the
  wrapped model (so ``predict`` and ``evaluate`` behave as usual and share its weights), and
  ``train_step`` runs :func:`dpcore.step.dp_step` with the compiled :class:`DPOptimizer` and the
  model's :class:`~dpcore.ExecutionOptions`.
- Accepted batches: ``(x, y)``, ``(x, y, sample_weight)`` and the sampler's
  ``(x, y, mask, step_end)``. Padding rows (mask 0) contribute nothing to the update, the loss or
  any metric; an all-padding batch is a valid step (noise only).
- The ``loss`` log is the mean per-example loss of the real examples (weighted by their count
  across batches) plus the model's data-independent loss terms (weight regularizers), and a
  dict or list of losses adds each output's ``<name>_loss``, as Keras logs them; compiled
  metrics see only real rows.
- Layers that mix examples (trainable BatchNormalization, stateful RNNs) are refused when the
  model is wrapped and again when the step is traced (see :mod:`dpcore.validation`).
- ``fit`` runs the sampling the model accounts for (``DPModel.sampling``, from
  ``make_private(config=...)``; Poisson by default): arrays and unbatched examples go through
  :func:`dpcore.sampling.poisson_batches` at q = ``expected_batch_size`` / N, ceil(N / B)
  logical steps per Keras epoch (``steps_for_epochs(1)``), N the config's ``num_examples``;
  fixed-size batches only under ``sampling="shuffle"``. A batched dataset without a
  ``SamplingSpec`` under Poisson, a ``batch_size`` other than ``expected_batch_size`` or another N
  than the config's is refused before the first step.
- A sampler's dataset with a spec has a known epoch length in logical steps (``spec.steps``).
- :func:`make_private` builds the :class:`DPOptimizer` when needed and compiles the wrapper.
- Under a multi-replica ``tf.distribute`` strategy, ``fit``/``evaluate`` pad the sampler's
  batches with masked rows to a multiple of the replicas (times ``group_size``: every replica
  gets whole units) and copy ``step_end`` to every row, so Keras can split them; the update
  equals the single-device one (tested with 2 replicas). Construct the :class:`DPOptimizer`
  (or call :func:`make_private`) inside ``strategy.scope()``: its DP state is created with it.
- Fed ``(x, y, mask, step_end)`` batches, ``fit`` counts one Keras batch per LOGICAL step (all
  its chunks, up to ``step_end``): an epoch, a ``steps_per_epoch`` limit or a callback's stop can
  only fall between steps, so a step never spans two passes over the data and the optimizer's
  ``dp_steps`` equals the sampled steps. A pass that ends inside a step is refused, and an
  unfinished step found at the start of ``fit`` (an interrupted run, a checkpoint saved mid-step)
  is dropped, never merged with the new pass's first step.
- The sampler's :class:`~dpcore.sampling.SamplingSpec` is read from the dataset (before ``fit``
  re-wraps it) and kept as ``sampling_spec``; ``fit`` refuses one whose expected batch size is
  not the optimizer's ``expected_batch_size`` or whose units (``group_size``) are not the
  model's, and the privacy callbacks check it against their ``DPConfig``. Under
  ``ExecutionOptions(group_size>1)`` sampler batches without a spec are refused (their chunks
  might split a unit between two micro-batches of a step).
- ε spent is what the model reports: ``fit`` keeps a ledger of the logical steps its optimizer
  applies (each with the σ it ran with and the q of the sampling that ran), saved with the
  optimizer's variables (``.keras``, ``.weights.h5``) so a resumed model keeps it;
  :meth:`DPModel.epsilon` and the ``epsilon`` entry of every epoch's logs (History, progress
  bar, CSVLogger, TensorBoard) are its ε at the model's ``target_delta``. ``epsilon_budget``
  stops ``fit`` before a step would take it past the budget.
- Under a multi-worker strategy, or with a :class:`dpcore.backup.StepBackup` among the
  callbacks (one replica per worker), ``fit`` runs dpcore's own epoch loop; with a backup the
  epoch and step to resume at come from the restored ``dp_steps`` and ``steps_per_epoch``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from dpcore import distribute, losses, sampling, validation
from dpcore.accounting import events as _events
from dpcore.accounting import steps_for_epochs
from dpcore.accounting.ledger import PrivacyLedger
from dpcore.backup import StepBackup
from dpcore.callbacks import model_callbacks
from dpcore.engine.summary import prepare_batch, readable_error
from dpcore.losses import PerExampleLoss, per_example_loss_fn
from dpcore.optimizer import DPOptimizer
from dpcore.options import ExecutionOptions, resolve
from dpcore.sampling import SamplingSpec
from dpcore.step import dp_step

__all__ = ["DPModel", "make_private"]


class _WeightedLabels(NamedTuple):
    """Labels and per-example weights carried together through ``fit``'s own sampler."""

    y: Any
    sample_weight: Any


def _unpack(data: Any) -> tuple[Any, Any, Any, Any, Any]:
    """``(x, y, sample_weight, mask, step_end)`` from any accepted batch layout."""
    batch = sampling.as_sampled_batch(data)
    if batch is not None:
        # A copy per row after multi-replica splitting: dp_step folds it back to one flag.
        if isinstance(batch.y, _WeightedLabels):
            return batch.x, batch.y.y, batch.y.sample_weight, batch.mask, batch.step_end
        return batch.x, batch.y, None, batch.mask, batch.step_end
    if isinstance(data, list):
        data = tuple(data)
    if not isinstance(data, tuple) or len(data) not in (2, 3) or data[1] is None:
        raise ValueError(
            "DP training needs labels: batches must be (x, y), (x, y, sample_weight) or the "
            "sampler's SampledBatch(x, y, mask, step_end)."
        )
    x, y, sample_weight = (*data, None)[:3]
    return x, y, sample_weight, None, None


def _bind(method: Any, x: Any, y: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Keras ``fit``/``evaluate`` arguments by name, as the signature of ``method`` binds them."""
    signature = inspect.signature(method)
    arguments = dict(signature.bind(x, y, *args, **kwargs).arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
    return arguments


def _readable_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """``fit``/``evaluate`` raising a failed dpcore check of a batch (NaN in ``x``, ...) as a
    one-line ValueError (:func:`~dpcore.engine.summary.readable_error`), TensorFlow's error as its
    cause. The outermost call translates (``fit``'s, around its validation ``evaluate``)."""

    @functools.wraps(method)
    def wrapper(self: Any, x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_dpcore_in_call"):
            return method(self, x, y, *args, **kwargs)
        self.__dict__["_dpcore_in_call"] = True
        try:
            return method(self, x, y, *args, **kwargs)
        except tf.errors.InvalidArgumentError as error:
            keras_method = getattr(keras.Model, method.__name__).__get__(self)
            arguments = _bind(keras_method, x, y, args, kwargs)
            readable = readable_error(error, method.__name__, arguments)
            if readable is None:
                raise
            raise readable from error
        finally:
            self.__dict__["_dpcore_in_call"] = False

    return wrapper


@contextlib.contextmanager
def _quiet_end_of_data(data: Any, steps_given: bool) -> Iterator[None]:
    """Silences Keras's "Your input ran out of data" for a dataset of unknown length read to
    its end (no ``steps``/``steps_per_epoch`` asked for): there, running out is the epoch's end.
    """
    with warnings.catch_warnings():
        if (
            isinstance(data, tf.data.Dataset)
            and int(data.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
            and not steps_given
        ):
            warnings.filterwarnings("ignore", message="Your input ran out of data")
        yield


def _validation_rows(data: Any) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` of ``fit``'s ``validation_data`` (a tuple or a dataset)."""
    if isinstance(data, (tuple, list)):
        return (*data, None, None)[:3]
    return data, None, None


def _examples_of(dataset: tf.data.Dataset) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` arrays of a finite dataset of unbatched examples."""
    element = dataset.element_spec
    if not isinstance(element, (tuple, list)) or len(element) not in (2, 3):
        raise ValueError(
            "DP training needs labels: a dataset of examples must yield (x, y) or "
            f"(x, y, sample_weight), got {element}."
        )
    if int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        raise ValueError(
            "fit samples from a dataset of examples, which must be finite (N examples, "
            "q = expected_batch_size / N): drop the .repeat()."
        )
    parts = list(dataset.batch(4096).as_numpy_iterator())
    if not parts:
        raise ValueError("The dataset is empty.")
    merged = tf.nest.map_structure(lambda *rows: np.concatenate(rows, axis=0), *parts)
    return (*merged, None)[:3]


def _sample_weights(sample_weight: Any, class_weight: Any, y: Any, n: int) -> Any:
    """float32 ``[N]`` weights of ``fit``'s ``sample_weight`` or ``class_weight`` (Keras's rule:
    the weight of each example's class), or None."""
    if sample_weight is not None and class_weight:
        raise ValueError("give sample_weight or class_weight, not both.")
    if sample_weight is not None:
        weights = np.asarray(sample_weight, np.float32)
        if weights.shape not in ((n,), (n, 1)):
            raise ValueError(f"sample_weight must have shape [{n}], got {weights.shape}.")
        return weights.reshape(n)
    if not class_weight:
        return None
    labels = np.asarray(y) if not isinstance(y, (dict, list, tuple)) else None
    if labels is None or labels.ndim > 2:
        raise ValueError("class_weight needs one array of labels (class indices or one-hot).")
    classes = labels.argmax(-1) if labels.ndim == 2 and labels.shape[1] > 1 else labels.reshape(n)
    missing = sorted({int(c) for c in np.unique(classes)} - {int(k) for k in class_weight})
    if missing:
        raise ValueError(f"class_weight has no weight for class(es) {missing}.")
    return np.array([class_weight[int(c)] for c in classes], np.float32)


def _class_weighted(data: tf.data.Dataset, class_weight: Any) -> tf.data.Dataset:
    """A sampler's ``(x, y, mask, step_end)`` batches with each row's ``class_weight`` carried
    with its labels, as ``fit``'s own sampler carries weights (Keras's rule for the class: the
    label itself, or the argmax of a one-hot label; keys must be ``0 .. K-1``, as Keras asks).

    Privacy:
      A row's weight is a function of that row's label alone; it multiplies the row's loss
      before its gradient is clipped.
    """
    spec = sampling.as_sampled_batch(data.element_spec)
    assert spec is not None
    y_spec = spec.y
    if isinstance(y_spec, (dict, list, tuple)) or y_spec.shape.rank not in (1, 2):
        raise ValueError(
            "class_weight needs one array of labels (class indices or one-hot) per batch; for "
            "other labels, weight the examples in the loss."
        )
    keys = sorted(int(k) for k in class_weight)
    if keys != list(range(len(keys))):
        raise ValueError(
            f"class_weight keys must be the classes 0 .. K-1 (got {keys}); give every class a "
            "weight."
        )
    table = tf.constant([float(class_weight[k]) for k in keys], tf.float32)

    def attach(*element: Any) -> sampling.SampledBatch:
        # A SampledBatch element comes as one argument, a plain 4-tuple as four.
        batch = sampling.as_sampled_batch(element[0] if len(element) == 1 else element)
        assert batch is not None
        y = tf.convert_to_tensor(batch.y)
        if y.shape.rank == 2 and y.shape[-1] != 1:
            classes = tf.argmax(y, axis=-1, output_type=tf.int32)
        else:
            classes = tf.cast(tf.round(tf.cast(tf.reshape(y, [-1]), tf.float64)), tf.int32)
        real = tf.cast(batch.mask, tf.float32) > 0
        known = tf.reduce_all((classes >= 0) & (classes < len(keys)) | tf.logical_not(real))
        check = tf.debugging.Assert(
            known,
            [f"dpcore: a label of the batch is not a class of class_weight (0 .. {len(keys) - 1})"],
        )
        with tf.control_dependencies([check]):
            weights = tf.gather(table, tf.clip_by_value(classes, 0, len(keys) - 1))
        return sampling.SampledBatch(
            batch.x, _WeightedLabels(batch.y, weights), batch.mask, batch.step_end
        )

    return data.map(attach, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _split_validation(arguments: dict[str, Any]) -> dict[str, Any]:
    """Arrays' ``validation_split`` done before sampling: Keras's split, the last rows."""
    split = arguments.get("validation_split") or 0.0
    if not split or arguments.get("validation_data") is not None:
        return {k: v for k, v in arguments.items() if k != "validation_split"}
    x, y, sw = arguments["x"], arguments["y"], arguments.get("sample_weight")
    n = sampling.num_examples(x, y)
    cut = int(np.floor(n * (1.0 - float(split))))
    if not 0 < cut < n:
        raise ValueError(f"validation_split={split} leaves no training or no validation rows.")

    def rows(tree: Any, sl: slice) -> Any:
        return None if tree is None else tf.nest.map_structure(lambda t: t[sl], tree)

    head, tail = slice(0, cut), slice(cut, n)
    validation = (rows(x, tail), rows(y, tail), *(() if sw is None else (rows(sw, tail),)))
    rest = {k: v for k, v in arguments.items() if k != "validation_split"}
    return {
        **rest,
        "x": rows(x, head),
        "y": rows(y, head),
        "sample_weight": rows(sw, head),
        "validation_data": validation,
    }


def _step_backup(callbacks: Any) -> StepBackup | None:
    """The ``StepBackup`` among ``fit``'s callbacks (at most one), or None."""
    found = [c for c in callbacks or [] if isinstance(c, StepBackup)]
    if len(found) > 1:
        raise ValueError("fit takes at most one dpcore.backup.StepBackup.")
    return found[0] if found else None


def _rows(structure: Any, keep: tf.Tensor) -> Any:
    return tf.nest.map_structure(lambda t: tf.boolean_mask(t, keep), structure)


class _EndStepsAtEpochs(keras.callbacks.Callback):
    """Starts every epoch of fixed-size batches at a logical-step boundary (see ``DPModel.fit``).

    Privacy:
      The micro-batches of one noised update then come from one pass over the data, so no example
      is in two of them; the dropped micro-batches were never released.
    """

    def __init__(self, dp_model: DPModel) -> None:
        super().__init__()
        self._dp_model = dp_model

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._dp_model._end_open_step_at_epoch()


def _inputs_spec(x: Any) -> Any:
    """The structure of ``TensorSpec`` s of one batch of inputs ``x`` (arrays or a dataset)."""
    if isinstance(x, tf.data.Dataset):
        element = x.element_spec
        batch = sampling.as_sampled_batch(element)
        if batch is not None:
            return batch.x
        return element[0] if isinstance(element, (tuple, list)) else element

    def spec(t: Any) -> tf.TensorSpec:
        if not (hasattr(t, "shape") and hasattr(t, "dtype")):
            t = np.asarray(t)
        return tf.TensorSpec(tf.TensorShape(t.shape), tf.as_dtype(t.dtype))

    return tf.nest.map_structure(spec, x)


_PROBE_EXAMPLES = 3  # example 0 and two others, each repeated `views` times
_PROBE_SEED = 20240613  # graph-level seed of the probe's traces (tf.random ops replay)


def _probe_leaf(spec: Any, examples: int, views: int, variant: int, leaf: int) -> tf.Tensor:
    """One input leaf of the probe: ``examples`` examples, each repeated ``views`` times.

    Example 0 is the same in every variant; the other examples differ in every entry between
    variants 0 and 1 (floating: other normal draws; integers: 0 and 1 swapped, values any
    vocabulary holds; bool: negated; strings: other bytes).
    """
    shape = [examples, *[3 if d is None else int(d) for d in tf.TensorShape(spec.shape)[1:]]]
    dtype = tf.as_dtype(spec.dtype)
    seed = [leaf, 13]
    if dtype.is_floating or dtype.is_complex:
        base = tf.random.stateless_normal(shape, seed=seed, dtype=tf.float32)
        other = tf.random.stateless_normal(shape, seed=[leaf, 29], dtype=tf.float32) * 3.0 + 5.0
        values = tf.cast(tf.concat([base[:1], (base if variant == 0 else other)[1:]], 0), dtype)
    else:
        bits = tf.random.stateless_uniform(shape, seed=seed, maxval=2, dtype=tf.int32)
        flipped = tf.concat([bits[:1], 1 - bits[1:]], 0) if variant else bits
        if dtype == tf.bool:
            values = tf.cast(flipped, tf.bool)
        elif dtype == tf.string:
            values = tf.where(flipped > 0, "b", "a")
        else:
            values = tf.cast(flipped, dtype)
    return tf.repeat(values, views, axis=0)


def _views_of_example_0(augment_fn: Callable[[Any], Any], probe: Any, views: int) -> list[Any]:
    """``augment_fn(probe)``'s rows of example 0 (the first ``views`` rows of every output).

    A fresh trace with a fixed graph-level seed, so that TensorFlow's stateful random ops draw
    the same numbers on every probe; the variables it reads (random generators' states, e.g.
    a Keras ``RandomFlip``'s) are put back afterwards, so that every probe starts from the same
    state and the user's state is unchanged.
    """

    def traced(batch: Any) -> Any:
        tf.random.set_seed(_PROBE_SEED)  # inside a trace: this function graph's seed only
        return augment_fn(batch)

    function = tf.function(traced, autograph=False).get_concrete_function(probe)
    saved = [(v, tf.identity(v.read_value())) for v in function.variables]
    try:
        out = function(probe)
    finally:
        for variable, value in saved:
            variable.assign(value)
    return [np.asarray(o[:views]) for o in tf.nest.flatten(out)]


def _same_bits(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(a, b)
    )


def check_augment_fn_rows(augment_fn: Callable[[Any], Any], inputs: Any, views: int) -> None:
    """Refuses an ``augment_fn`` whose views of one example depend on another example's rows.

    Checked by values, on every input leaf whatever its dtype: a probe batch of three examples
    (each repeated ``views`` times, shaped like ``inputs``: a structure of ``TensorSpec`` s or
    arrays with a batch axis) goes through ``augment_fn``; then the two other examples are
    changed in every entry (floating, integer, bool and string leaves, dicts included) and
    example 0's views must come out bit-for-bit equal. Random augmentations replay the same
    draws on both probes (a fixed seed for TensorFlow's random ops, random generators' states
    restored), so per-example randomness passes; a function that gives other views of the same
    batch under those conditions is refused, since its rows cannot be checked. This catches
    batch statistics whatever their gradient (a batch mean or standard deviation, also through
    ``tf.stop_gradient``), mixup, ``tf.roll`` over the batch and tokens copied across examples.

    Raises:
      ValueError: naming the dependence and the fix.

    Privacy:
      A row-mixing augmentation makes every example's clipped gradient depend on the others, so
      one example could move the update by more than C (batch centring, a ``stop_gradient``
      batch standardization and a token copied from another example all do).
    """
    specs = tf.nest.flatten(inputs)
    probes = [
        tf.nest.pack_sequence_as(
            inputs,
            [_probe_leaf(s, _PROBE_EXAMPLES, views, variant, j) for j, s in enumerate(specs)],
        )
        for variant in (0, 1)
    ]
    first = _views_of_example_0(augment_fn, probes[0], views)
    if not _same_bits(first, _views_of_example_0(augment_fn, probes[0], views)):
        raise ValueError(
            "augment_fn cannot be checked: the same batch gave other views under a fixed "
            "TensorFlow seed with its random generators' states restored (randomness from "
            "Python or NumPy?), so whether it mixes examples is unknown. Draw its randomness "
            "with tf.random / keras.random ops (per example), or precompute the views."
        )
    if not _same_bits(first, _views_of_example_0(augment_fn, probes[1], views)):
        raise ValueError(
            "augment_fn mixes examples: the views it makes of one example change when other "
            "examples' rows change (e.g. batch statistics such as a batch mean or standard "
            "deviation, also under tf.stop_gradient; mixup, tf.roll over the batch, tokens "
            "copied from another example), so one example could move every other example's "
            "clipped gradient. Use per-example statistics, or statistics of the training set "
            "computed beforehand (constants), and treat each example's rows (rows "
            "i*K .. i*K+K-1 of the repeated batch) on their own."
        )


class _CheckSamplerStart(keras.callbacks.Callback):
    """Refuses, before the first step, a fixed-seed Poisson sampler that would replay earlier
    steps' samples (``SamplingSpec.check_start_step``). Listed last, so that it sees the step
    count after every callback that restores state (``StepBackup``) has run."""

    def __init__(self, dp_model: DPModel, spec: sampling.SamplingSpec, passes: int | None) -> None:
        super().__init__()
        self._dp_model, self._spec, self._passes = dp_model, spec, passes

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        optimizer = getattr(self._dp_model, "optimizer", None)
        if isinstance(optimizer, DPOptimizer) and not self._passes:  # its first pass
            self._spec.check_start_step(optimizer.dp_state.dp_steps)


@keras.saving.register_keras_serializable(package="dpcore")
class DPModel(keras.Model):
    """A Keras model that trains its wrapped model with DP-SGD under ``fit``.

    Args:
      model: the Keras model to train (built, with trainable variables).
      options: how the step computes (:class:`dpcore.ExecutionOptions`): engine path, chunking,
        layer rules, and non-finite handling (with ``nonfinite="skip"`` the dropped examples are
        counted in the logs as ``skipped``). A custom ``registry`` is not saved with the model.
      name: the wrapper's name (default ``"dp_<model name>"``).
      augmentations: augmentation multiplicity ``K`` (De et al. 2022): each example of a batch
        is repeated ``K`` times, ``augment_fn`` makes the views, and the example's gradient is
        the MEAN of its views' gradients, clipped once (a privacy unit of ``K`` rows, see
        ``ExecutionOptions.group_size``). The privacy unit stays the example, so sampling and
        ``expected_batch_size`` are unchanged; memory grows with ``K`` on activations only (the
        fast path never forms per-view gradients). Metrics and the loss see every view.
      augment_fn: ``x -> x`` applied to the repeated batch (rows ``i*K .. i*K+K-1`` are the
        views of example ``i``), inside the compiled step; it must treat examples independently
        (``fit`` refuses one whose views of one example change with another example's rows,
        checked by values: :func:`check_augment_fn_rows`). None keeps the views identical. Not
        saved with the model.
      target_delta: δ of the ε the model reports (:meth:`epsilon`, the ``epsilon`` log).
      neighboring: the adjacency of that ε, ``"add_remove"`` (default) or ``"replace_one"``.
      epsilon_budget: None, or an ε that ``fit`` must not exceed: it stops before a logical step
        would take the ε spent past it (a :class:`~dpcore.callbacks.PrivacyBudgetGuard` on the
        model's own ledger, for the sampling each ``fit`` runs).
      sampling: how ``fit`` batches arrays and examples, and the sampling the model's data must
        have: ``"poisson"`` (default: ``fit`` samples Poisson batches itself; batched datasets
        without a ``SamplingSpec`` are refused) or ``"shuffle"`` (fixed-size shuffled batches,
        opted into; accounted without amplification). See :meth:`fit`.
      num_examples: N that the accounting assumes (``DPConfig.num_examples``); ``fit`` refuses
        to sample from another number of examples. None: the examples ``fit`` is given.

    Compile it with a :class:`DPOptimizer` and a per-example-capable loss (any Keras loss; it is
    rebuilt with ``reduction=None``), or use :func:`make_private`.

    Privacy:
      Each logical step's update is the Gaussian mechanism on per-example-clipped gradients; the
      logged loss and metrics are computed from the raw batches and are not private.
    """

    def __init__(
        self,
        model: keras.Model,
        *,
        options: ExecutionOptions | None = None,
        name: str | None = None,
        augmentations: int = 1,
        augment_fn: Callable[[Any], Any] | None = None,
        target_delta: float = 1e-5,
        neighboring: str = "add_remove",
        epsilon_budget: float | None = None,
        sampling: str = "poisson",
        num_examples: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"model must be a Keras model, got {type(model).__name__}.")
        if isinstance(model, DPModel):
            raise ValueError("model is already a DPModel; wrap the plain Keras model once.")
        validation.check_model(model, require_variables=model.built)
        super().__init__(name=name or f"dp_{model.name}", **kwargs)
        self.model = model
        self.options = resolve(options)
        if not self.options.training:
            raise ValueError(
                "DPModel trains: ExecutionOptions(training=False) would run its layers in "
                "inference mode during fit. Use training=True (the default)."
            )
        k = augmentations
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"augmentations must be a positive integer, got {k!r}.")
        if k > 1 and self.options.group_size != 1:
            raise ValueError(
                f"augmentations={k} makes each example a unit of {k} views; it cannot be combined "
                f"with ExecutionOptions(group_size={self.options.group_size})."
            )
        if augment_fn is not None and not callable(augment_fn):
            raise TypeError(f"augment_fn must be callable, got {augment_fn!r}.")
        self.augmentations = k
        self.augment_fn = augment_fn
        self.target_delta = _events.check_delta(target_delta)
        self.neighboring = _events.check_choice(
            neighboring, _events.NEIGHBORING_RELATIONS, "neighboring"
        )
        self.epsilon_budget = (
            None
            if epsilon_budget is None
            else _events.check_epsilon(epsilon_budget, "epsilon_budget")
        )
        if sampling not in ("poisson", "shuffle"):
            raise ValueError(f"sampling must be 'poisson' or 'shuffle', got {sampling!r}.")
        if num_examples is not None and (
            isinstance(num_examples, bool) or int(num_examples) != num_examples or num_examples < 1
        ):
            raise ValueError(
                f"num_examples must be a positive integer or None, got {num_examples!r}."
            )
        self.sampling = sampling
        self.num_examples = None if num_examples is None else int(num_examples)
        # The step's options: views of one example form one unit, their gradients averaged.
        self._step_options = (
            self.options.replace(group_size=k, group_reduction="mean") if k > 1 else self.options
        )
        self.loss_tracker = keras.metrics.Mean(name="loss")
        # With nonfinite="skip", how many real examples the steps dropped (in the logs).
        self.skipped_tracker = (
            keras.metrics.Sum(name="skipped") if self.options.nonfinite == "skip" else None
        )
        # How the last fit was fed ("arrays", "dataset" or "masked_batches"): the privacy
        # callbacks check it against the sampling their config accounts for.
        self.data_feed: str | None = None
        # The sampling the last fit's data carried (fit's own sampler's too; None: plain or
        # untagged datasets, or arrays under sampling="shuffle").
        self.sampling_spec: SamplingSpec | None = None
        self._sampler_passes: int | None = None
        self._whole_steps = False  # a train-function call runs whole logical steps
        self._per_example_loss: PerExampleLoss | None = None
        self._keras_loss_trackers = {"loss"}
        self._output_loss_trackers: list[Any] = []
        if model.built:  # the wrapper owns no variables of its own
            self.built = True

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return self.model(inputs, training=training)

    @_readable_errors
    def fit(self, x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Keras ``fit``, with the sampling the model accounts for (``self.sampling``).

        How the data is fed decides what runs:

        - Arrays ``fit(x, y, epochs=E)`` and a ``tf.data.Dataset`` of unbatched ``(x, y)``
          examples, under ``sampling="poisson"`` (the default): ``fit`` samples by itself, with
          :func:`dpcore.sampling.poisson_batches` at ``sampling_prob = expected_batch_size / N``
          (N the examples given, after ``validation_split``), one Keras epoch being
          ``dpcore.accounting.steps_for_epochs(1)`` = ceil(N / B) logical steps (or
          ``steps_per_epoch``), each of a fresh Poisson sample: E epochs run
          ``steps_for_epochs(E)`` steps. ``batch_size`` may only repeat ``expected_batch_size``;
          ``sample_weight`` and ``class_weight`` travel with the sampled rows;
          ``accumulation_steps > 1`` and units of several rows are refused there (they need
          ``sampling="shuffle"`` or a sampler of your own).
        - The same under ``sampling="shuffle"``: Keras's shuffled fixed-size batches of
          ``expected_batch_size / accumulation_steps`` rows (``batch_size`` defaults to it and
          may not contradict it), accounted without amplification.
        - A sampler's dataset (``(x, y, mask, step_end)``, e.g. ``poisson_batches``) is used as
          given: its batches are the sampled ones, never reshuffled; ``class_weight`` weights
          each row by its label's class, as on arrays (keys ``0 .. K-1``). Its ``SamplingSpec`` gives
          Keras the epoch's length in logical steps (``spec.steps``, unless ``steps_per_epoch``
          is given), so the progress bar has a total from the first epoch; each epoch is a new
          pass over it (fresh samples).
        - A dataset of batches without a ``SamplingSpec`` is refused under ``"poisson"`` (its
          fixed-size batches are not the sampling the Poisson ε assumes) and trains as given
          under ``"shuffle"``.

        ``num_examples`` (from ``make_private(config=...)``) must be the N that fit samples
        from: q = expected_batch_size / N is what the config accounts for.

        The sampler's ``(x, y, mask, step_end)`` batches also work under a multi-replica
        ``tf.distribute`` strategy: each batch is padded with masked rows to a multiple of the
        replicas (times ``group_size``, so that units stay whole) and split across them; every
        replica clips its rows and the clipped sums are all-reduced before the one noise draw of
        the step (see :class:`DPOptimizer`).

        On ``(x, y, mask, step_end)`` batches one Keras batch is one logical step (every chunk
        up to ``step_end``): progress bars, ``steps_per_epoch`` and batch-level callbacks count
        logical steps, and an epoch ends only between steps. A sampler without a spec has no
        known length (overflow chunks, astronomically rare, add elements), so an epoch ends
        when it is exhausted; Keras's "Your input ran out of data" warning, spurious there, is
        silenced when no ``steps_per_epoch`` was asked for.

        Raises:
          ValueError: before the first step, for data whose sampling is not the model's (a
            batched dataset without a ``SamplingSpec`` under ``"poisson"``, a ``batch_size``
            that contradicts ``expected_batch_size``, N other than ``num_examples``, a
            ``SamplingSpec`` whose expected batch size is not the optimizer's); during
            training, if a pass over ``(x, y, mask, step_end)`` data ends inside a logical step,
            or (one line, TensorFlow's error as its cause) if a dpcore check of a batch fails,
            e.g. NaN or Inf in ``x``: it names the field and the row of the arrays given (of
            the batch, for a dataset).

        Privacy:
          The sampling that runs is the one ``self.sampling`` names, so a ``DPConfig`` with the
          same sampling, N and q accounts for it. An unfinished logical step left in the
          optimizer (interrupted run, checkpoint saved mid-step) is dropped with a warning when
          a fit on sampler batches starts: a new pass never joins a step of the previous one,
          so each noised update sums one sample.
        """
        arguments = _bind(super().fit, x, y, args, kwargs)
        arguments["callbacks"] = model_callbacks(self, arguments)  # ε record, budget guard
        if distribute.worker_info(self.distribute_strategy).num_workers > 1 or _step_backup(
            arguments.get("callbacks")
        ):
            return self._fit_workers(**arguments)
        arguments, own_sampler = self._own_sampling(arguments)
        x = arguments["x"]
        if self.augment_fn is not None:
            check_augment_fn_rows(self.augment_fn, _inputs_spec(x), self.augmentations)
        self.sampling_spec = sampling.sampling_spec(x)
        self._sampler_passes = sampling.passes_started(x)
        masked = (
            isinstance(x, tf.data.Dataset) and sampling.as_sampled_batch(x.element_spec) is not None
        )
        if not masked:
            # Fixed-size batches with accumulation: a logical step must not span two epochs
            # (Keras reshuffles arrays between them, so one example could be in both parts).
            callbacks = list(arguments.get("callbacks") or [])
            arguments["callbacks"] = [_EndStepsAtEpochs(self), *callbacks]
        if not isinstance(x, tf.data.Dataset):
            self._check_unit_layout(arguments)
            self.data_feed = "arrays"
            return super().fit(**arguments)
        self.data_feed = "arrays" if own_sampler else "masked_batches" if masked else "dataset"
        if masked and arguments.get("class_weight"):
            x = _class_weighted(x, arguments.pop("class_weight"))
        if masked:
            self._start_pass_at_step_boundary()
            if self.sampling_spec is not None:
                arguments["callbacks"] = [
                    *list(arguments.get("callbacks") or []),
                    _CheckSamplerStart(self, self.sampling_spec, self._sampler_passes),
                ]
            if int(x.cardinality()) >= 0:
                # Its length counts chunks; Keras counts logical steps here (see
                # make_train_function), so let the end of the data end the epoch.
                x = x.filter(lambda *element: True)
            spec = self.sampling_spec
            if spec is not None and spec.steps > 0 and arguments.get("steps_per_epoch") is None:
                # Keras's epoch is one pass of spec.steps logical steps: one iterator over as
                # many passes as epochs (each draws fresh samples), cut every spec.steps calls
                # of the train function, which consume whole steps whatever their chunks.
                passes = int(arguments.get("epochs", 1)) - int(arguments.get("initial_epoch", 0))
                x = x.repeat(max(passes, 1))
                arguments["steps_per_epoch"] = spec.steps
        arguments.setdefault("shuffle", False)
        replicas = self.distribute_strategy.num_replicas_in_sync
        if "validation_data" in arguments:
            arguments["validation_data"] = distribute.for_replicas(
                arguments["validation_data"], replicas
            )
        steps_given = arguments.get("steps_per_epoch") is not None
        self._build_compiled_state(x)
        self._whole_steps = masked
        # Whole units per replica: the spec (which .filter above dropped) agrees with the model.
        arguments["x"] = distribute.for_replicas(x, replicas, group_size=self.options.group_size)
        try:
            with _quiet_end_of_data(x, steps_given):
                return super().fit(**arguments)
        finally:
            self._whole_steps = False

    def epsilon(
        self,
        accountant: str = "pld",
        *,
        target_delta: float | None = None,
        max_examples_per_user: int = 1,
    ) -> float:
        """ε spent: the ε of the logical steps this model's optimizer has applied under ``fit``.

        Each step is accounted with the σ it ran with and the sampling that ran (the data's
        ``SamplingSpec``), from the ledger ``fit`` keeps (:attr:`privacy_ledger`), with
        dp-accounting. Unlike ``DPConfig.planned_epsilon()`` (the plan), this counts every step
        applied, however many ``fit`` calls ran them.

        Args:
          accountant: ``"pld"`` (default) or ``"rdp"``.
          target_delta: δ; default the model's ``target_delta`` (the ``DPConfig``'s under
            ``make_private(config=...)``).
          max_examples_per_user: k > 1: the ε per user for users with at most k examples each
            (group privacy, ``dpcore.accounting.compute_group_epsilon``).

        Returns:
          ε (0.0 before any step).

        Raises:
          ValueError: if the model is not compiled with a ``DPOptimizer``, or if the optimizer
            applied steps its ledger lacks (run outside ``fit``, or restored without the
            ledger): give the ledger back through :attr:`privacy_ledger`.

        Privacy:
          The figure holds for the steps recorded; steps whose sampling was unknown refuse it.
        """
        optimizer = self._dp_optimizer()
        optimizer.record_applied_steps()
        return optimizer.step_recorder.epsilon(
            applied=optimizer.dp_state.dp_steps,
            target_delta=self.target_delta if target_delta is None else target_delta,
            accountant=accountant,
            max_examples_per_user=max_examples_per_user,
        )

    @property
    def privacy_ledger(self) -> PrivacyLedger | None:
        """The ledger of the logical steps applied under ``fit`` (None before any), saved with
        the model; assign a restored one (``PrivacyLedger.from_json(text)``) to continue it."""
        return self._dp_optimizer().privacy_ledger

    @privacy_ledger.setter
    def privacy_ledger(self, ledger: PrivacyLedger | None) -> None:
        self._dp_optimizer().privacy_ledger = ledger

    def _dp_optimizer(self) -> DPOptimizer:
        optimizer = getattr(self, "optimizer", None)
        if not isinstance(optimizer, DPOptimizer):
            raise ValueError(
                "this DPModel has no dpcore.DPOptimizer yet: compile it (or use "
                "dpcore.make_private) before asking for its epsilon or ledger."
            )
        return optimizer

    def _own_sampling(self, arguments: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """``fit``'s arguments with arrays (or unbatched examples) replaced by the sampling the
        model accounts for; True when ``fit`` built the sampler itself.

        Raises:
          ValueError: for data whose sampling would not be ``self.sampling`` (see :meth:`fit`).
        """
        x = arguments.get("x")
        if isinstance(x, tf.data.Dataset):
            if sampling.as_sampled_batch(x.element_spec) is not None:
                return arguments, False
            batched = self._is_batched(x)
            if batched is not False:
                if self.sampling == "poisson":
                    raise ValueError(self._batched_refusal(x, known=batched is not None))
                self._check_fixed_batch_size(x)
                return arguments, False
            x, y, sample_weight = _examples_of(x)
            arguments = {**arguments, "x": x, "y": y, "sample_weight": sample_weight}
        elif arguments.get("y") is None:
            raise ValueError(
                "DP training needs labels: call fit(x, y, ...) or feed (x, y) examples, or the "
                "sampler's SampledBatch(x, y, mask, step_end)."
            )
        optimizer = getattr(self, "optimizer", None)
        if not isinstance(optimizer, DPOptimizer):
            raise ValueError("DPModel is not compiled: call compile() or use dpcore.make_private.")
        arguments = _split_validation(arguments)
        n = sampling.num_examples(arguments["x"], arguments["y"])
        b = float(optimizer.expected_batch_size)
        if self.num_examples is not None and n != self.num_examples:
            raise ValueError(
                f"fit got {n} training examples but the model accounts for num_examples="
                f"{self.num_examples} (sampling_prob = expected_batch_size / num_examples = "
                f"{b / self.num_examples:.6g}): the sampling would not be the accounted one. "
                f"Build the DPConfig with num_examples={n} (the rows fit trains on, after any "
                "validation_split), or fit on the dataset it was built for."
            )
        if self.sampling == "shuffle":
            return self._fixed_batches(arguments, n, optimizer), False
        return self._poisson_arguments(arguments, n, optimizer), True

    def _poisson_arguments(
        self, arguments: dict[str, Any], n: int, optimizer: DPOptimizer
    ) -> dict[str, Any]:
        """Arrays replaced by ``poisson_batches`` at q = expected_batch_size / N."""
        b = float(optimizer.expected_batch_size)
        batch_size = arguments.get("batch_size")
        if batch_size is not None and not sampling._same(batch_size, b):
            raise ValueError(
                f"fit(batch_size={batch_size}) contradicts the optimizer's expected_batch_size="
                f"{b:.6g}: under sampling='poisson' fit draws Poisson batches of expected size "
                f"{b:.6g} itself. Omit batch_size (or feed dpcore.sampling.poisson_batches), or "
                f"for fixed-size shuffled batches of {batch_size} use DPConfig(sampling='shuffle', "
                f"expected_batch_size={batch_size}, ...) in make_private (accounted without "
                "amplification)."
            )
        refused = {
            f"accumulation_steps={optimizer.accumulation_steps}": optimizer.accumulation_steps != 1,
            f"ExecutionOptions(group_size={self.options.group_size})": self.options.group_size > 1,
        }
        given = [name for name, bad in refused.items() if bad]
        if given:
            raise ValueError(
                f"fit's own Poisson sampling does not take {', '.join(given)}: its batches are "
                "(x, y, mask, step_end) chunks of single examples. Use sampling='shuffle' "
                "(fixed-size batches, accounted as such), or feed a sampler (units: "
                "dpcore.units.unit_batches; memory: poisson_batches(..., padded_batch_size=...) "
                "with accumulation_steps=1)."
            )
        if b > n:
            raise ValueError(
                f"expected_batch_size={b:.6g} is larger than the {n} examples fit got: "
                "sampling_prob = expected_batch_size / N must be at most 1."
            )
        steps = arguments.get("steps_per_epoch") or steps_for_epochs(
            1, num_examples=n, expected_batch_size=b
        )
        labels = arguments["y"]
        weights = _sample_weights(
            arguments.get("sample_weight"), arguments.get("class_weight"), labels, n
        )
        if weights is not None:
            labels = _WeightedLabels(labels, weights)
        data = sampling.poisson_batches(
            arguments["x"], labels, sampling_prob=b / n, steps=int(steps)
        )
        dropped = ("y", "batch_size", "sample_weight", "class_weight", "shuffle", "steps_per_epoch")
        return {**{k: v for k, v in arguments.items() if k not in dropped}, "x": data}

    def _fixed_batches(
        self, arguments: dict[str, Any], n: int, optimizer: DPOptimizer
    ) -> dict[str, Any]:
        """Arrays under ``sampling="shuffle"``: Keras's batches of expected_batch_size examples
        (per micro-batch; rows: times ``group_size``)."""
        rows = self._fixed_batch_rows(optimizer)
        batch_size = arguments.get("batch_size")
        if rows != int(rows) or (batch_size is not None and batch_size != rows):
            raise ValueError(
                f"fit(batch_size={batch_size}) contradicts the optimizer's expected_batch_size="
                f"{optimizer.expected_batch_size:.6g} (/ accumulation_steps="
                f"{optimizer.accumulation_steps}, x group_size={self.options.group_size} rows "
                f"per unit = {rows:.6g} rows): under sampling='shuffle' each batch has that "
                "fixed size. Omit batch_size (or pass that size), or let fit sample Poisson "
                "batches itself with sampling='poisson'."
            )
        if rows > n:
            raise ValueError(
                f"batches of {int(rows)} rows under sampling='shuffle' need at least that many "
                f"rows; fit got {n}."
            )
        return {**arguments, "batch_size": int(rows)}

    def _fixed_batch_rows(self, optimizer: DPOptimizer) -> float:
        """Rows of one fixed-size micro-batch under ``sampling="shuffle"``."""
        units = float(optimizer.expected_batch_size) / optimizer.accumulation_steps
        return units * self.options.group_size

    def _is_batched(self, dataset: tf.data.Dataset) -> bool | None:
        """Whether a dataset's elements are batches (True), examples (False) or unknown (None):
        its inputs' ranks against the wrapped model's inputs'."""
        element = dataset.element_spec
        x_spec = element[0] if isinstance(element, (tuple, list)) else element
        try:
            inputs = self.model.inputs
        except (AttributeError, ValueError):
            return None
        model_ranks = [len(t.shape) for t in tf.nest.flatten(inputs or [])]
        data_ranks = [s.shape.rank for s in tf.nest.flatten(x_spec)]
        if not model_ranks or len(model_ranks) != len(data_ranks) or None in data_ranks:
            return None
        if data_ranks == model_ranks:
            return True
        if data_ranks == [r - 1 for r in model_ranks]:
            return False
        return None

    def _batched_refusal(self, dataset: tf.data.Dataset, *, known: bool) -> str:
        what = (
            "a dataset of batches"
            if known
            else "a dataset whose elements may be batches (the model has no known input shape)"
        )
        return (
            f"fit was given {what} without a dpcore.sampling.SamplingSpec, but the model "
            "accounts for Poisson sampling (sampling='poisson'): fixed-size batches would be "
            "reported with the Poisson epsilon. Feed the examples unbatched (arrays "
            "fit(x, y), or the dataset before .batch) so that fit samples Poisson batches "
            "itself, or dpcore.sampling.poisson_batches(...); or opt in to fixed-size batches "
            "with DPConfig(sampling='shuffle', ...) in make_private (accounted as such)."
        )

    def _check_fixed_batch_size(self, dataset: tf.data.Dataset) -> None:
        """Under ``sampling="shuffle"``: a batched dataset's static batch size, when it has one,
        is ``expected_batch_size / accumulation_steps``."""
        optimizer = getattr(self, "optimizer", None)
        if not isinstance(optimizer, DPOptimizer):
            return
        micro = self._fixed_batch_rows(optimizer)
        element = dataset.element_spec
        sizes = {
            s.shape[0] for s in tf.nest.flatten(element) if s.shape.rank and s.shape[0] is not None
        }
        if sizes and sizes != {micro}:
            raise ValueError(
                f"the dataset's batches have {sorted(sizes)} rows but the optimizer's "
                f"expected_batch_size={optimizer.expected_batch_size:.6g} / accumulation_steps="
                f"{optimizer.accumulation_steps} (x group_size={self.options.group_size}) is "
                f"{micro:.6g} rows: the noised sum would be "
                "normalized for another batch size. Batch it by that size, or feed unbatched "
                "examples and let fit batch them."
            )

    def _start_pass_at_step_boundary(self) -> None:
        """Checks the data's sampling against the optimizer and drops an unfinished step.

        Raises:
          ValueError: if the data's ``SamplingSpec`` has another expected batch size than the
            optimizer's ``expected_batch_size``, another sampling mode than the model's
            ``sampling``, other units than the model's ``group_size`` or another N than the
            model's ``num_examples``, or if the model groups rows into units and the data has
            no spec.
        """
        optimizer = getattr(self, "optimizer", None)
        if not isinstance(optimizer, DPOptimizer):
            return  # not compiled: Keras says so
        if self.sampling_spec is not None:
            self.sampling_spec.check_expected_batch_size(
                expected_batch_size=optimizer.expected_batch_size
            )
            if self.sampling_spec.sampling != self.sampling:
                raise ValueError(
                    f"the data comes from {self.sampling_spec._describe()} (sampling="
                    f"{self.sampling_spec.sampling!r}), but the model accounts for sampling="
                    f"{self.sampling!r}: its epsilon would assume another sampling than the "
                    f"one that runs. Build the model with DPConfig(sampling="
                    f"{self.sampling_spec.sampling!r}, ...) (or make_private(..., sampling="
                    f"{self.sampling_spec.sampling!r})), or feed the sampling it accounts for."
                )
            self.sampling_spec.check_group_size(self.options.group_size)
            if (
                self.num_examples is not None
                and self.sampling_spec.num_examples != self.num_examples
            ):
                raise ValueError(
                    f"the data comes from {self.sampling_spec._describe()}, but the model "
                    f"accounts for num_examples={self.num_examples}: the sampling would not be "
                    "the accounted one. Sample the dataset the DPConfig was built for, or build "
                    f"it with num_examples={self.sampling_spec.num_examples}."
                )
        elif self.options.group_size > 1:
            raise ValueError(
                f"ExecutionOptions(group_size={self.options.group_size}) on (x, y, mask, "
                "step_end) batches that carry no SamplingSpec: whether their chunks keep each "
                "unit's rows together (a unit split across two micro-batches of a step would be "
                "clipped twice) is unknown. Feed dpcore.units.unit_batches(...) as returned, or "
                "re-attach its spec after a per-element .map (dpcore.sampling.with_sampling_spec)."
            )
        dropped = optimizer.discard_open_step()
        if dropped:
            warnings.warn(
                f"dpcore: the optimizer held {dropped} micro-batch(es) of a logical step that "
                "never ended (an interrupted fit, or a checkpoint saved mid-step). A new pass "
                "over the data starts a new step, so they were dropped: nothing of them was "
                "released. With a fixed sampler seed, resume with poisson_batches(..., "
                "start_step=int(optimizer.dp_steps)) to draw that step again.",
                UserWarning,
                stacklevel=3,
            )

    def _end_open_step_at_epoch(self) -> None:
        """Drops micro-batches of a logical step left open by the previous epoch (with a warning)."""
        optimizer = getattr(self, "optimizer", None)
        if not isinstance(optimizer, DPOptimizer):
            return
        dropped = optimizer.discard_open_step()
        if dropped:
            warnings.warn(
                f"dpcore: {dropped} micro-batch(es) of the previous epoch did not complete a "
                f"logical step of accumulation_steps={optimizer.accumulation_steps}; they were "
                "dropped (nothing of them was released), since a step spanning two epochs could "
                "hold one example twice. Make the batches per epoch a multiple of "
                "accumulation_steps to use every batch.",
                UserWarning,
                stacklevel=2,
            )

    def make_train_function(self, force: bool = False) -> Any:
        """Keras's train function; under ``fit`` on ``(x, y, mask, step_end)`` batches each call
        runs whole logical steps (it goes on until the optimizer's step has ended).

        Keras learns an epoch's length from the first pass over a dataset of unknown size and
        cuts later passes at that count. A pass of the sampler holds a fixed number of logical
        steps but a random number of chunks, so counting chunks would cut a pass inside a step
        and carry that step into the next pass. Counting steps makes every cut a step boundary.

        Raises:
          ValueError: (when called) if the data ends inside a logical step; the unfinished
            step is dropped first.
        """
        if self.train_function is not None and not force:
            return self.train_function
        self._build_optimizer_before_tracing()
        super().make_train_function(force=force)
        self.train_function: Callable[[Any], Any] = self._in_whole_steps(self.train_function)
        return self.train_function

    def _build_optimizer_before_tracing(self) -> None:
        """Creates the optimizer's variables eagerly, before the train function is traced.

        Without a distribution strategy Keras defers this to the first trace. A
        ``tf.function`` whose first trace creates variables is traced a second time, and both
        traced programs stay in memory: for the DP step that doubles the memory its program holds
        and lengthens the time to the first step.
        """
        if self.optimizer is None or self.optimizer.built or tf.inside_function():
            return
        variables = self.trainable_variables
        if variables:  # an unbuilt model is built by the first trace, and the optimizer with it
            with self.distribute_strategy.scope():
                self.optimizer.build(variables)

    def _in_whole_steps(self, run_chunk: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``run_chunk(iterator)`` (one batch), called until the logical step has ended while
        ``fit`` runs on ``(x, y, mask, step_end)`` batches (see :meth:`make_train_function`)."""

        def whole_steps(iterator: Any) -> Any:
            logs = run_chunk(iterator)
            while self._whole_steps and self._step_open():
                try:
                    logs = run_chunk(iterator)
                except (StopIteration, tf.errors.OutOfRangeError) as end:
                    dropped = self.optimizer.discard_open_step()
                    raise ValueError(
                        f"the data ended inside a logical step ({dropped} chunk(s) without "
                        "step_end=True): a pass over the data must end at a step boundary (its "
                        "last element has step_end=True). dpcore.sampling's datasets do; cutting "
                        "one (e.g. .take(n)) does not. The unfinished step was dropped."
                    ) from end
            return logs

        return whole_steps

    def _worker_function(self, name: str) -> Callable[..., Any]:
        """The compiled multi-worker ``"train"``, ``"test"`` or ``"metrics"`` function.

        ``train``/``test``: ``strategy.run(step, next batch)``, returning this worker's logs, in
        place of Keras's train and test functions, whose reduction of the logs fails under a
        multi-worker strategy (nothing in them communicates except what the step does).
        ``metrics``: the metrics summed over every worker (a collective). Each is traced once
        per compile (kept outside Keras's attribute tracking).
        """
        cache = self.__dict__.setdefault("_dpcore_worker_functions", {})
        if name in cache:
            return cache[name]
        strategy = self.distribute_strategy
        if name == "metrics":
            cache[name] = tf.function(self.get_metrics_result)
            return cache[name]
        step = self.train_step if name == "train" else self.test_step

        @tf.function(reduce_retracing=True)
        def run(iterator: Any) -> Any:
            logs = strategy.run(step, args=(iterator.get_next(),))
            return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], logs)

        cache[name] = self._in_whole_steps(run) if name == "train" else run
        return cache[name]

    def _step_open(self) -> bool:
        """Whether the optimizer holds micro-batches of a logical step that has not ended."""
        return int(keras.ops.convert_to_numpy(self.optimizer.micro_steps)) > 0

    @_readable_errors
    def evaluate(self, x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Keras ``evaluate``; also takes the sampler's datasets (padding rows are ignored),
        under a multi-replica strategy too (see :meth:`fit`). Rows with NaN or Inf fail as in
        :meth:`fit` (one line naming the field and the row), or are left out under
        ``ExecutionOptions(nonfinite="skip")``.

        Privacy:
          The results are exact, un-noised statistics of the evaluated data (see
          :meth:`test_step`): not private for those examples, and not covered by the run's ε
          when they are training examples. Only the weights they use come from private training.
        """
        arguments = _bind(super().evaluate, x, y, args, kwargs)
        if distribute.worker_info(self.distribute_strategy).num_workers > 1:
            return self._evaluate_workers(**arguments)
        x = arguments["x"]
        steps_given = arguments.get("steps") is not None
        self._build_compiled_state(x)
        arguments["x"] = distribute.for_replicas(x, self.distribute_strategy.num_replicas_in_sync)
        with _quiet_end_of_data(x, steps_given):
            return super().evaluate(**arguments)

    def _fit_workers(
        self,
        x: Any,
        *,
        epochs: int = 1,
        verbose: Any = "auto",
        callbacks: Any = None,
        validation_data: Any = None,
        validation_freq: int = 1,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        shuffle: Any = None,
        **unsupported: Any,
    ) -> Any:
        """``fit`` under a multi-worker strategy (Keras's own ``fit`` fails there).

        dpcore runs the epochs: each worker iterates its shard of the sampler
        (``strategy.distribute_datasets_from_function``, no re-sharding or re-batching) and
        calls the train function (``strategy.run`` of :meth:`train_step`, whole logical steps
        per call), with Keras's callbacks, ``History`` and progress bar (on the chief only).
        Epoch logs and validation are the metrics summed over every worker's real rows. A stop
        asked by a callback on any worker stops every worker after the same step.

        With ``steps_per_epoch`` one iterator runs through the epochs (Keras's rule), and
        running out of data ends the training. With a :class:`~dpcore.backup.StepBackup` (on
        one worker too) ``steps_per_epoch`` is required, the backup's callbacks run first, and
        the epoch and the step within it come from the optimizer's ``dp_steps`` after the
        backup restored it: a run restarted after step ``t`` resumes in epoch
        ``t // steps_per_epoch`` at its step ``t % steps_per_epoch``.
        """
        given = {k: v for k, v in unsupported.items() if v not in (None, 0.0)}
        if given:
            raise ValueError(
                f"DPModel.fit under a multi-worker strategy does not take {sorted(given)}: feed "
                "each worker its shard of dpcore.sampling.sharded_poisson_batches."
            )
        strategy = self.distribute_strategy
        info = distribute.worker_info(strategy)
        backup = _step_backup(callbacks)
        if backup is not None:
            if steps_per_epoch is None:
                raise ValueError(
                    "fit with a StepBackup needs steps_per_epoch: a restarted run finds its "
                    "epoch from the logical steps it applied."
                )
            if int(initial_epoch):
                raise ValueError(
                    "fit with a StepBackup takes its epoch from the restored state; do not pass "
                    f"initial_epoch={initial_epoch}."
                )
            if strategy.num_replicas_in_sync != info.num_workers:
                raise ValueError(
                    f"fit with a StepBackup runs one replica per worker; this strategy has "
                    f"{strategy.num_replicas_in_sync} replicas on {info.num_workers} worker(s)."
                )
            callbacks = [backup, *(c for c in callbacks if c is not backup)]
        distribute.check_sharding(x, strategy)
        if not isinstance(x, tf.data.Dataset) or sampling.as_sampled_batch(x.element_spec) is None:
            raise ValueError(
                "a multi-worker fit, or one with a StepBackup, needs the sampler's "
                "(x, y, mask, step_end) dataset."
            )
        if self.augment_fn is not None:
            check_augment_fn_rows(self.augment_fn, _inputs_spec(x), self.augmentations)
        self.sampling_spec = sampling.sampling_spec(x)
        self._sampler_passes = sampling.passes_started(x)
        self.data_feed = "masked_batches"
        self._start_pass_at_step_boundary()
        self._build_compiled_state(x)
        data = strategy.distribute_datasets_from_function(lambda _: x)
        verbose = 1 if verbose == "auto" else verbose
        assert self.sampling_spec is not None
        callbacks = [
            *list(callbacks or []),
            _CheckSamplerStart(self, self.sampling_spec, self._sampler_passes),
        ]
        callback_list = keras.callbacks.CallbackList(
            callbacks,
            add_history=True,
            add_progbar=bool(verbose) and info.is_chief,
            verbose=verbose,
            epochs=epochs,
            steps=steps_per_epoch or self.sampling_spec.steps,
            model=self,
        )
        any_stop = distribute.any_worker(strategy)
        self.stop_training = False
        epoch_logs: dict[str, Any] = {}
        self._whole_steps = True
        try:
            with strategy.scope():
                train = self._worker_function("train")
                callback_list.on_train_begin()
                first, skip = int(initial_epoch), 0
                if backup is not None:  # restored by now
                    applied = int(keras.ops.convert_to_numpy(self.optimizer.dp_steps))
                    first, skip = divmod(applied, int(steps_per_epoch))  # type: ignore[arg-type]
                iterator, ran_out = None, False
                for epoch in range(first, int(epochs)):
                    self.reset_metrics()
                    callback_list.on_epoch_begin(epoch)
                    if iterator is None or steps_per_epoch is None:
                        iterator = iter(data)
                    step = skip if epoch == first else 0
                    while steps_per_epoch is None or step < steps_per_epoch:
                        callback_list.on_train_batch_begin(step)
                        try:
                            logs = train(iterator)
                        except (StopIteration, tf.errors.OutOfRangeError):
                            ran_out = steps_per_epoch is not None
                            break
                        callback_list.on_train_batch_end(step, logs)
                        step += 1
                        if any_stop(self.stop_training):
                            self.stop_training = True
                            break
                    epoch_logs = self._worker_metrics()
                    if validation_data is not None and (epoch + 1) % validation_freq == 0:
                        val = self._evaluate_workers(
                            *_validation_rows(validation_data), verbose=0, return_dict=True
                        )
                        epoch_logs.update({f"val_{k}": v for k, v in val.items()})
                    callback_list.on_epoch_end(epoch, epoch_logs)
                    if ran_out:
                        warnings.warn(
                            f"dpcore: the data ran out in epoch {epoch} before its "
                            f"steps_per_epoch={steps_per_epoch} steps; training stopped. Feed "
                            "epochs * steps_per_epoch logical steps (minus those already "
                            "applied when resuming).",
                            UserWarning,
                            stacklevel=3,
                        )
                    if self.stop_training or ran_out:
                        break
                callback_list.on_train_end(epoch_logs)
        finally:
            self._whole_steps = False
        return self.history

    def _evaluate_workers(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        batch_size: int | None = None,
        verbose: Any = "auto",
        steps: int | None = None,
        callbacks: Any = None,
        return_dict: bool = False,
        **unsupported: Any,
    ) -> Any:
        """``evaluate`` under a multi-worker strategy: each worker evaluates its shard.

        A worker's own sampler shard is used as it is; other data is split between the workers
        (rows of arrays, elements of a dataset). Evaluation has no collective operation until
        the metrics, summed over every worker, are read at the end, so the shards may differ
        in length.
        """
        if unsupported:
            raise ValueError(
                f"DPModel.evaluate under a multi-worker strategy does not take {sorted(unsupported)}."
            )
        strategy = self.distribute_strategy
        info = distribute.worker_info(strategy)
        spec = sampling.sampling_spec(x)
        if spec is not None and spec.num_workers == info.num_workers > 1:
            spec.check_workers(info.num_workers, info.worker_index)
            data = x
        elif isinstance(x, tf.data.Dataset):
            data = x.shard(info.num_workers, info.worker_index)
        else:
            rows = (x, y) if sample_weight is None else (x, y, sample_weight)
            data = (
                tf.data.Dataset.from_tensor_slices(rows)
                .shard(info.num_workers, info.worker_index)
                .batch(batch_size or 32)
            )
        if steps is not None:
            data = data.take(int(steps))
        self._build_compiled_state(data)
        verbose = 1 if verbose == "auto" else verbose
        callback_list = keras.callbacks.CallbackList(
            callbacks,
            add_progbar=bool(verbose) and info.is_chief,
            verbose=verbose,
            epochs=1,
            steps=steps,
            model=self,
        )
        with strategy.scope():
            test = self._worker_function("test")
            self.reset_metrics()
            callback_list.on_test_begin()
            iterator, step = iter(data), 0
            while True:
                callback_list.on_test_batch_begin(step)
                try:
                    logs = test(iterator)
                except (StopIteration, tf.errors.OutOfRangeError):
                    break
                callback_list.on_test_batch_end(step, logs)
                step += 1
            results = self._worker_metrics()
            callback_list.on_test_end(results)
        if return_dict:
            return results
        values = list(results.values())
        return values[0] if len(values) == 1 else values

    def _worker_metrics(self) -> dict[str, float]:
        """The metrics summed over every worker's rows (a collective: all workers call it)."""
        results = self._worker_function("metrics")()
        return {k: float(keras.ops.convert_to_numpy(v)) for k, v in results.items()}

    def compile(
        self,
        optimizer: DPOptimizer,
        loss: Any = None,
        loss_weights: Any = None,
        metrics: Any = None,
        weighted_metrics: Any = None,
        **kwargs: Any,
    ) -> None:
        """Keras ``compile``, restricted to what a DP step supports.

        Args:
          optimizer: a :class:`DPOptimizer`.
          loss: the loss (name, ``keras.losses.Loss`` or a callable ``(y_true, y_pred) -> [B]``);
            for several outputs a dict (keyed by output name) or list of them, as in Keras.
          loss_weights: optional weight of each output's loss, as in Keras: each example's loss
            is the weighted sum of its outputs' losses (:func:`dpcore.losses.per_example_loss_fn`).
          metrics: Keras metrics, evaluated on the real (unmasked) rows only.
          weighted_metrics: Keras metrics weighted by ``sample_weight``, real rows only.
          **kwargs: other ``keras.Model.compile`` arguments (``run_eagerly``,
            ``steps_per_execution``, ...). ``auto_scale_loss`` is always False.

        Raises:
          TypeError: if ``optimizer`` is not a :class:`DPOptimizer`.
          ValueError: for a missing loss.
        """
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(
                f"DPModel needs a dpcore.DPOptimizer, got optimizer={optimizer!r}; wrap it: "
                "dpcore.DPOptimizer(keras.optimizers.SGD(...), l2_norm_clip=..., "
                "noise_multiplier=..., expected_batch_size=...), or use dpcore.make_private."
            )
        if loss is None:
            raise ValueError("loss=None: DP training needs a loss (one value per example).")
        names = getattr(self.model, "output_names", None)
        if names is not None:  # Keras's compiled losses and metrics key dicts by them
            self.output_names = list(names)
        self._per_example_loss = per_example_loss_fn(
            loss, loss_weights=loss_weights, output_names=names
        )
        keys = [*(names or []), *(loss if isinstance(loss, dict) else [])]
        # Each named output's loss in the logs, as Keras logs it ("<name>_loss").
        self._output_loss_trackers = [
            keras.metrics.Mean(name=f"{n}_loss") for n in losses.output_loss_names(loss, names)
        ]
        self._keras_loss_trackers = {
            *self._keras_loss_trackers,
            *(f"{k}_loss" for k in keys),
            *(m.name for m in self._output_loss_trackers),
        }
        self.__dict__.pop("_dpcore_worker_functions", None)  # traced for the previous compile
        kwargs["auto_scale_loss"] = False
        kwargs.setdefault("jit_compile", False)
        super().compile(
            optimizer=optimizer,
            loss=loss,
            loss_weights=loss_weights,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
            **kwargs,
        )

    def get_compile_config(self) -> dict[str, Any] | None:
        return super().get_compile_config()

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Re-compiles from a saved compile config (used by ``keras.saving.load_model``)."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)

    @property
    def metrics(self) -> list[Any]:
        own = [self.loss_tracker, *self._output_loss_trackers]
        if self.skipped_tracker is not None:
            own.append(self.skipped_tracker)
        rest = [
            m
            for m in super().metrics
            if all(m is not o for o in own)
            # Keras's total and per-output loss trackers: its compiled loss never runs here.
            and not (m.name in self._keras_loss_trackers and isinstance(m, keras.metrics.Mean))
        ]
        return [*own, *rest]

    def _build_compiled_state(self, dataset: Any) -> None:
        """Builds the compiled metrics and loss from a zero row of the sampler's element spec.

        Under a ``tf.distribute`` strategy Keras builds them from the first batch, which it
        expects to be ``(x, y[, sample_weight])``; for ``(x, y, mask, step_end)`` batches they
        are built here instead (the metrics are then reset: no data is involved).
        """
        if not isinstance(dataset, tf.data.Dataset):
            return
        spec = sampling.as_sampled_batch(dataset.element_spec)
        if spec is None or self._per_example_loss is None:
            return

        def zero_row(s: tf.TensorSpec) -> tf.Tensor:
            return tf.zeros([1, *s.shape[1:]], s.dtype)

        y_spec = spec.y.y if isinstance(spec.y, _WeightedLabels) else spec.y
        x0, y0 = tf.nest.map_structure(zero_row, (spec.x, y_spec))
        with self.distribute_strategy.scope():
            # The zero row is no data: a layer that writes state in its call (refused when the
            # step is traced) must not keep what this call wrote.
            state = [(v, keras.ops.copy(v.value)) for v in self.model.non_trainable_variables]
            y_pred = self(x0, training=False)
            for variable, value in state:
                variable.assign(value)
            self.compute_metrics(x0, y0, y_pred)
            self.compute_loss(x0, y0, y_pred)
            self.reset_metrics()

    def _check_ready(self) -> None:
        validation.check_model(self.model)
        if self._per_example_loss is None:
            raise ValueError("DPModel is not compiled: call compile() or use dpcore.make_private.")

    def _metric_results(self, x: Any, y: Any, y_pred: Any, sample_weight: Any, mask: Any) -> Any:
        keep = mask > 0
        sw = (
            None
            if sample_weight is None
            else tf.boolean_mask(tf.reshape(tf.cast(sample_weight, tf.float32), [-1]), keep)
        )
        if self._output_loss_trackers:
            parts = losses.per_output_losses(self._per_example_loss, y, y_pred)
            weights = tf.cast(mask, tf.float32)
            if sample_weight is not None:
                weights = weights * tf.reshape(tf.cast(sample_weight, tf.float32), [-1])
            num = tf.reduce_sum(tf.cast(keep, tf.float32))
            for tracker in self._output_loss_trackers:
                values = parts[tracker.name[: -len("_loss")]]
                total = tf.reduce_sum(tf.where(keep, values * weights, 0.0))
                tracker.update_state(total / tf.maximum(num, 1.0), sample_weight=num)
        return self.compute_metrics(x, _rows(y, keep), _rows(y_pred, keep), sample_weight=sw)

    def train_step(self, data: Any) -> dict[str, Any]:
        """One DP-SGD micro-step on a batch (see the module contract for batch layouts).

        Privacy:
          Only the weight update is private (:func:`dpcore.step.dp_step`: clipped, noised once
          per logical step). The returned loss, metrics and ``skipped`` count come from the raw
          batch and are not private; the adaptive-clipping logs are functions of noised values.
        """
        self._check_ready()
        x, y, sample_weight, mask, step_end = _unpack(data)
        sample_weight = losses.one_sample_weight(sample_weight)
        x, y, sample_weight, mask = self._views(x, y, sample_weight, mask)
        result = dp_step(
            self.model,
            self._per_example_loss,
            x,
            y,
            optimizer=self.optimizer,
            sample_weight=sample_weight,
            mask=mask,
            step_end=step_end,
            options=self._step_options,
        )
        self.loss_tracker.update_state(
            result.loss + result.regularization_loss, sample_weight=result.num_examples
        )
        if self.skipped_tracker is not None:
            self.skipped_tracker.update_state(result.num_skipped)
        logs = self._metric_results(x, y, result.y_pred, sample_weight, result.mask)
        # Adaptive clipping: the bound C and the noised unclipped fraction (released values).
        return {**logs, **self.optimizer.adaptive_logs()}

    def _check_unit_layout(self, arguments: dict[str, Any]) -> None:
        """Arrays under units of several rows: Keras must neither shuffle rows nor cut a unit."""
        k = self.options.group_size
        batch_size = arguments.get("batch_size") or 32
        if k > 1 and (arguments.get("shuffle", True) or batch_size % k):
            raise ValueError(
                f"ExecutionOptions(group_size={k}) on arrays needs fit(shuffle=False) and a "
                f"batch_size that is a multiple of {k} (got batch_size={batch_size}): Keras "
                "would otherwise mix the rows of different units. Feed a dataset of whole units "
                "to sample them."
            )

    def _views(self, x: Any, y: Any, sample_weight: Any, mask: Any) -> tuple[Any, Any, Any, Any]:
        """The batch with each example repeated ``augmentations`` times, then ``augment_fn``."""
        k = self.augmentations
        if k > 1:

            def repeat(t: Any) -> Any:
                return None if t is None else tf.repeat(t, k, axis=0)

            x, y = tf.nest.map_structure(repeat, (x, y))
            sample_weight, mask = repeat(sample_weight), repeat(mask)
        if self.augment_fn is not None:
            x = self.augment_fn(x)
        return x, y, sample_weight, mask

    def test_step(self, data: Any) -> dict[str, Any]:
        """Evaluation on a batch: loss and metrics over the real rows.

        The loss is the mean per-example loss of the real rows plus ``model.losses`` of the call
        (regularizers and ``add_loss`` terms, those of the batch included), as Keras evaluates.

        Privacy:
          No clipping or noise: the loss and metrics are exact statistics of the batch (padding
          rows excluded), so they are not private for its examples, and on training examples they
          leak beyond the run's ε. No weight changes.
        """
        if self._per_example_loss is None:
            raise ValueError("DPModel is not compiled: call compile() or use dpcore.make_private.")
        x, y, sample_weight, mask, _ = _unpack(data)
        sample_weight = losses.one_sample_weight(sample_weight)
        # Non-finite rows fail (or are skipped) as in training; weights are 0 where mask is.
        x, y, weights, mask = prepare_batch(
            x, y, sample_weight, mask, nonfinite=self.options.nonfinite
        )
        y_pred = self(x, training=False)
        values = tf.cast(self._per_example_loss(y, y_pred), tf.float32)
        num = tf.reduce_sum(mask)
        mean = tf.reduce_sum(tf.where(mask > 0, values * weights, 0.0)) / tf.maximum(num, 1.0)
        # Keras's evaluate adds model.losses of this call: regularizers, add_loss terms.
        for term in self.model.losses:
            mean += tf.cast(tf.reduce_sum(term), tf.float32)
        self.loss_tracker.update_state(mean, sample_weight=num)
        return self._metric_results(x, y, y_pred, sample_weight, mask)

    def predict_step(self, data: Any) -> Any:
        """The wrapped model's output (inference mode) on a batch's ``x``, padding rows included.

        Takes the sampler's batches too; their ``y``, mask and ``step_end`` are ignored.

        Privacy:
          For the training data the predictions are post-processing of the private weights;
          for the inputs given they are a plain function of those inputs, not private.
        """
        batch = sampling.as_sampled_batch(data)
        if batch is not None:
            x = batch.x
        else:
            x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self(x, training=False)

    def get_config(self) -> dict[str, Any]:
        return {
            "model": keras.saving.serialize_keras_object(self.model),
            "options": {
                "method": self.options.method,
                "nonfinite": self.options.nonfinite,
                "chunk_size": self.options.chunk_size,
            },
            "name": self.name,
            "augmentations": self.augmentations,
            "target_delta": self.target_delta,
            "neighboring": self.neighboring,
            "epsilon_budget": self.epsilon_budget,
            "sampling": self.sampling,
            "num_examples": self.num_examples,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> DPModel:
        config = dict(config)
        model = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects
        )
        options = ExecutionOptions(**config.pop("options", {}))
        return cls(model, options=options, **config)


def make_private(
    model: keras.Model,
    *,
    optimizer: Any,
    loss: Any,
    metrics: Any = None,
    weighted_metrics: Any = None,
    l2_norm_clip: float | list[float] | tuple[float, ...] | None = None,
    noise_multiplier: float | None = None,
    expected_batch_size: float | None = None,
    accumulation_steps: int | None = None,
    seed: int | Sequence[int] | None = None,
    config: Any = None,
    options: ExecutionOptions | None = None,
    augmentations: int = 1,
    augment_fn: Callable[[Any], Any] | None = None,
    target_delta: float | None = None,
    epsilon_budget: float | None = None,
    sampling: str | None = None,
    **compile_kwargs: Any,
) -> DPModel:
    """Wraps ``model`` for DP-SGD training with ``fit`` and compiles it.

    Args:
      model: a built Keras model; it is not modified and keeps sharing its weights.
      optimizer: a :class:`DPOptimizer`, or a plain Keras optimizer (or name) together with the
        privacy parameters (keywords or ``config``), which then get wrapped.
      loss: the training loss (any Keras loss; it is evaluated per example).
      metrics: Keras metrics (computed on real rows only).
      weighted_metrics: Keras weighted metrics (real rows only).
      l2_norm_clip: per-example clipping bound (with a plain ``optimizer``).
      noise_multiplier: σ (with a plain ``optimizer``).
      expected_batch_size: the noised sum's divisor (with a plain ``optimizer``).
      accumulation_steps: micro-steps per logical step (with a plain ``optimizer``; default 1).
      seed: fixed noise seed, tests/reproducibility only (with a plain ``optimizer``).
      config: an object with ``l2_norm_clip``, ``noise_multiplier``, ``expected_batch_size`` and
        optionally ``accumulation_steps``, ``sampling`` and ``num_examples`` (e.g.
        ``dpcore.DPConfig``), instead of the keywords: ``fit`` then runs the sampling the
        config accounts for, over its N examples.
      options: how the step computes (:class:`dpcore.ExecutionOptions`: engine path, chunking,
        non-finite handling, layer rules); training mode is always on.
      augmentations: augmentation multiplicity ``K``: each example's gradient is the mean of
        its ``K`` views' gradients, clipped once (see :class:`DPModel`).
      augment_fn: makes the views from the repeated batch (see :class:`DPModel`).
      target_delta: δ of the ε the model reports (:meth:`DPModel.epsilon`, the ``epsilon``
        entry of ``fit``'s logs); default ``config.target_delta``, else 1e-5.
      epsilon_budget: None, or the ε that training must not exceed: ``fit`` stops before a
        logical step would take the ε spent (at ``target_delta``) past it, e.g.
        ``make_private(..., config=config, epsilon_budget=3.0)``.
      sampling: ``"poisson"`` (default) or ``"shuffle"``: how ``fit`` batches arrays (see
        :meth:`DPModel.fit`); taken from ``config`` when it has one.
      **compile_kwargs: further ``keras.Model.compile`` arguments.

    Returns:
      A compiled :class:`DPModel`.

    Raises:
      ValueError: for missing or out-of-range privacy parameters, batch-mixing layers, a model
        without trainable variables, or privacy parameters given twice.

    Privacy:
      Training the returned model with ``fit`` releases only Gaussian-privatized updates; the
      model accounts for them itself (:meth:`DPModel.epsilon`: the steps applied, with the
      sampling that ran), whatever ``config.planned_epsilon()`` planned. Fed arrays,
      ``fit`` runs the sampling ``config`` (or ``sampling``) names, at
      q = expected_batch_size / N.
    """
    params: dict[str, Any] = {
        "l2_norm_clip": l2_norm_clip,
        "noise_multiplier": noise_multiplier,
        "expected_batch_size": expected_batch_size,
        "accumulation_steps": accumulation_steps,
    }
    if config is not None:
        for key in params:
            value = getattr(config, key, None)
            if value is None:
                continue
            if params[key] is not None and params[key] != value:
                raise ValueError(
                    f"{key}={params[key]!r} conflicts with config.{key}={value!r}; give it once."
                )
            params[key] = value
    given = {k: v for k, v in params.items() if v is not None}
    if isinstance(optimizer, DPOptimizer):
        if seed is not None:
            raise ValueError("seed= only applies when make_private wraps a plain optimizer.")
        for key, value in given.items():
            current = getattr(optimizer, key)
            if key == "l2_norm_clip" and isinstance(value, (list, tuple)):
                value = tuple(float(c) for c in value)
            if current != value:
                raise ValueError(
                    f"{key}={value!r} conflicts with the DPOptimizer's {key}={current!r}; set the "
                    "privacy parameters in one place."
                )
        dp_optimizer = optimizer
    else:
        missing = [
            k for k in ("l2_norm_clip", "noise_multiplier", "expected_batch_size") if k not in given
        ]
        if missing:
            raise ValueError(
                f"optimizer={optimizer!r} is not a DPOptimizer, so make_private needs "
                f"{', '.join(missing)} (as keywords or via config=)."
            )
        dp_optimizer = DPOptimizer(
            optimizer,
            l2_norm_clip=given["l2_norm_clip"],
            noise_multiplier=given["noise_multiplier"],
            expected_batch_size=given["expected_batch_size"],
            accumulation_steps=given.get("accumulation_steps", 1),
            seed=seed,
        )
    delta = getattr(config, "target_delta", None)
    if target_delta is not None and delta is not None and target_delta != delta:
        raise ValueError(
            f"target_delta={target_delta!r} conflicts with config.target_delta={delta!r}; give it "
            "once."
        )
    config_sampling = getattr(config, "sampling", None)
    if sampling is not None and config_sampling is not None and sampling != config_sampling:
        raise ValueError(
            f"sampling={sampling!r} conflicts with config.sampling={config_sampling!r}; give it once."
        )
    num_examples = getattr(config, "num_examples", None)
    dp_model = DPModel(
        model,
        options=options,
        augmentations=augmentations,
        augment_fn=augment_fn,
        target_delta=next((d for d in (target_delta, delta) if d is not None), 1e-5),
        neighboring=getattr(config, "neighboring", "add_remove"),
        epsilon_budget=epsilon_budget,
        sampling=sampling or config_sampling or "poisson",
        num_examples=None if num_examples is None else int(num_examples),
    )
    dp_model.compile(
        optimizer=dp_optimizer,
        loss=loss,
        metrics=metrics,
        weighted_metrics=weighted_metrics,
        **compile_kwargs,
    )
    return dp_model
