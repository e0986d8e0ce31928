"""Per-example losses.

Contract: every loss that enters the DP pipeline is a callable ``(y_true, y_pred) -> [B]`` that
returns one loss per example and never reduces over the batch. :func:`per_example_loss_fn` turns
what users write (a Keras loss name, a ``keras.losses.Loss`` instance, a plain function) into such
a callable, and rejects losses whose output cannot be attributed to single examples.

Keras masks: when the model's output carries a Keras mask (``return_sequences`` after ``Masking``
or ``Embedding(mask_zero=True)``), masked positions contribute zero loss, as in Keras's
``compile``d loss, which (for a ``keras.losses.Loss`` and for a plain function alike, wrapped in
``LossFunctionWrapper``) turns the output mask into 0/1 weights on the per-position losses. Keras
then divides the batch's sum by the number of unmasked positions in the whole *batch*, a count
that depends on the other examples and so has no place in a per-example loss. Here each example's
loss is the sum of its unmasked positions' losses divided by the padded length ``T`` (the mean over
trailing axes of the masked per-position losses): a function of that example alone, with every
unmasked position weighted ``1/T`` as Keras weights it ``1/N``; averaged over the ``B`` examples it
is Keras's loss times the batch's fraction of unmasked positions ``N / (B T)``: the same gradient
direction.
A fully masked example has loss 0 and gradient 0.

Several outputs: a dict or list of losses and ``loss_weights`` give each example the weighted sum
of its outputs' per-example losses, whose batch mean is Keras's total loss.

Keras's other loss terms (``model.losses``): :func:`regularization` returns the terms that are
functions of the weights alone (weight regularizers, ``add_loss`` of the weights), which the DP
step adds to the privatized gradient as Keras adds them, and refuses the ``add_loss`` terms
computed from the batch. Activity regularizers' penalties are per example: the engine adds them to
each example's loss (:mod:`dpcore.engine.activity`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

PerExampleLoss = Callable[[Any, Any], tf.Tensor]
_PER_EXAMPLE = "_dpcore_per_example_loss"  # marks what per_example_loss_fn returns
_PER_OUTPUT = "_dpcore_per_output_losses"  # each output's losses, on a loss of several outputs


def _unreduced_copy(loss: keras.losses.Loss) -> keras.losses.Loss:
    if loss.reduction is None or loss.reduction == "none":
        return loss
    config = loss.get_config()
    config["reduction"] = None
    try:
        return loss.__class__.from_config(config)
    except Exception as err:  # pragma: no cover - depends on user loss classes
        raise ValueError(
            f"loss={loss!r} reduces over the batch (reduction={loss.reduction!r}) and cannot be "
            "rebuilt with reduction=None from its config; pass a loss created with reduction=None "
            "that returns one value per example."
        ) from err


def per_example_loss_fn(
    loss: Any, *, loss_weights: Any = None, output_names: Sequence[str] | None = None
) -> PerExampleLoss:
    """Returns a callable computing one loss value per example, shape ``[B]``.

    Several outputs are combined as Keras's ``compile(loss=..., loss_weights=...)`` combines them:
    each output's per-example loss (as for a single output, its Keras mask applied), times its
    weight, summed over the outputs. Averaged over a batch this is Keras's total loss (each
    output's ``"sum_over_batch_size"`` reduction, weighted and summed), and a ``[B]`` sample
    weight multiplies every output's loss of its example, as Keras applies one sample weight to
    every output.

    Args:
      loss: a Keras loss identifier (``"sparse_categorical_crossentropy"``), a
        ``keras.losses.Loss`` instance (rebuilt with ``reduction=None`` when it reduces), or a
        callable ``(y_true, y_pred) -> [B]``. Outputs with trailing axes (e.g. per-token losses
        ``[B, T]``) are averaged over those axes, matching Keras' own mean reduction, after the
        Keras mask of ``y_pred`` (if any) zeroes the masked positions (see the module docstring).
        For a model with several outputs: a dict keyed like a dict output (or by
        ``output_names`` for a list output), a list in the order of the outputs (None: no loss
        for that output), or one Keras loss (identifier or ``keras.losses.Loss``) for every
        output; a plain callable is given the outputs and labels as they are (it combines them
        itself).
      loss_weights: optional weight of each output's loss: a dict keyed like ``loss`` (or by
        ``output_names``), a list in the order of the outputs, or a number for a single output.
      output_names: the model's output names (``model.output_names``), which key a dict of
        losses or weights for a model whose outputs are a list.

    Returns:
      ``fn(y_true, y_pred) -> tf.Tensor`` of shape ``[B]``.

    Raises:
      ValueError: if ``loss`` is None, or (when called) the loss returns a scalar, or fewer axes
        than the Keras mask of ``y_pred`` (the mask could not be applied per position), or the
        losses, weights or labels do not match the model's outputs.

    Privacy:
      Per-example clipping is only meaningful when each returned value depends on one example
      alone; a loss that mixes examples (e.g. a contrastive loss over the batch) breaks the
      sensitivity bound and must not be used.
    """
    if loss is None:
        raise ValueError("loss=None: a per-example loss is required (reduction=None, shape [B]).")
    if getattr(loss, _PER_EXAMPLE, False):  # already one of ours: its mask is applied once
        if loss_weights is not None:
            raise ValueError(
                "loss_weights was given with a loss that per_example_loss_fn already built; give "
                "the weights when building it."
            )
        return loss
    if isinstance(loss, (dict, list, tuple)) or loss_weights is not None:
        return _structured_loss_fn(loss, loss_weights, output_names)
    single = _single_loss_fn(loss)
    if not isinstance(loss, (str, keras.losses.Loss)):
        return single  # a plain callable sees the outputs and labels as they are
    every_output = _structured_loss_fn(loss, None, output_names)

    def fn(y_true: Any, y_pred: Any) -> tf.Tensor:
        return every_output(y_true, y_pred) if _nested(y_pred) else single(y_true, y_pred)

    setattr(fn, _PER_EXAMPLE, True)
    return fn


def _single_loss_fn(loss: Any) -> PerExampleLoss:
    """The per-example form of one loss for one output (see :func:`per_example_loss_fn`)."""
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        loss = _unreduced_copy(loss)
    if not callable(loss):
        raise ValueError(f"loss={loss!r} is neither a Keras loss identifier nor a callable.")
    name = getattr(loss, "name", getattr(loss, "__name__", repr(loss)))

    def fn(y_true: Any, y_pred: Any) -> tf.Tensor:
        mask = output_mask(y_pred)
        values = tf.convert_to_tensor(loss(y_true, y_pred))
        if values.shape.rank == 0:
            raise ValueError(
                f"loss {name!r} returned a scalar (shape {values.shape}); dpcore needs one loss "
                "per example, shape [B]. Create the loss with reduction=None."
            )
        if mask is not None:
            values = apply_output_mask(values, mask, name=name)
        if values.shape.rank is not None and values.shape.rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        return values

    setattr(fn, _PER_EXAMPLE, True)
    return fn


def _nested(y_pred: Any) -> bool:
    return isinstance(y_pred, (dict, list, tuple))


def _is_leaf(value: Any) -> bool:
    return not isinstance(value, (dict, list, tuple))


def _output_keys(y_pred: Any) -> list[Any]:
    """The keys of the outputs: dict keys, list positions, or ``[None]`` for one tensor."""
    if isinstance(y_pred, dict):
        return list(y_pred)
    if isinstance(y_pred, (list, tuple)):
        return list(range(len(y_pred)))
    return [None]


def _per_output(
    spec: Any, y_pred: Any, names: Sequence[str] | None, what: str, default: Any
) -> dict[Any, Any]:
    """``spec`` (a loss or weight structure) resolved to ``{output key: value}``."""
    keys = _output_keys(y_pred)
    if _is_leaf(spec):
        if what == "loss_weights" and spec is not None and len(keys) > 1:
            raise ValueError(
                f"loss_weights={spec!r} is one number for a model with {len(keys)} outputs; give "
                "a dict keyed by output (or a list in output order)."
            )
        return {k: default if spec is None else spec for k in keys}
    if isinstance(spec, dict):
        if isinstance(y_pred, dict):
            known = set(keys)
            by_key = dict(spec)
        elif names is not None and len(names) == len(keys):
            known = set(names)
            by_key = {keys[names.index(n)]: v for n, v in spec.items() if n in known}
        elif keys == [None] and len(spec) == 1:
            known = set(spec)
            by_key = {None: next(iter(spec.values()))}
        else:
            raise ValueError(
                f"{what} is a dict ({sorted(map(str, spec))}) but the model's outputs are "
                f"{'a list' if len(keys) > 1 else 'one tensor'} without output names; give "
                "output_names=model.output_names, or a list in output order."
            )
        unknown = [k for k in spec if k not in known]
        if unknown:
            raise ValueError(
                f"{what} names {unknown}, which are not outputs of the model "
                f"(outputs: {sorted(map(str, known))})."
            )
        return {k: by_key.get(k, default) for k in keys}
    if isinstance(y_pred, dict):
        raise ValueError(
            f"{what} is a list but the model's outputs are a dict "
            f"({sorted(map(str, keys))}); give a dict keyed by output."
        )
    if len(spec) != len(keys):
        raise ValueError(
            f"{what} has {len(spec)} entries but the model has {len(keys)} outputs; give one "
            "per output, in output order."
        )
    return dict(zip(keys, spec))


def _labels(y_true: Any, y_pred: Any, names: Sequence[str] | None) -> dict[Any, Any]:
    """The labels of each output, keyed like :func:`_output_keys`."""
    keys = _output_keys(y_pred)
    if keys == [None]:
        if isinstance(y_true, (list, tuple)) and len(y_true) == 1:
            y_true = y_true[0]
        elif isinstance(y_true, dict) and len(y_true) == 1:
            y_true = next(iter(y_true.values()))
        return {None: y_true}
    if isinstance(y_pred, dict):
        if not isinstance(y_true, dict):
            raise ValueError(
                f"the model's outputs are a dict ({sorted(map(str, keys))}) but the labels are "
                f"{type(y_true).__name__}; give the labels as a dict keyed by output."
            )
        return {k: y_true.get(k) for k in keys}
    if isinstance(y_true, dict):
        if names is None or len(names) != len(keys):
            raise ValueError(
                "the labels are a dict but the model's outputs are a list without output names; "
                "give the labels as a list in output order."
            )
        return {k: y_true.get(n) for k, n in zip(keys, names)}
    if len(keys) == 1 and not isinstance(y_true, (list, tuple)):
        return {keys[0]: y_true}
    if not isinstance(y_true, (list, tuple)) or len(y_true) != len(keys):
        raise ValueError(
            f"the model has {len(keys)} outputs; give its labels as a list of {len(keys)}, one "
            "per output in output order (or a dict keyed by output name)."
        )
    return dict(zip(keys, y_true))


def _structured_loss_fn(
    loss: Any, loss_weights: Any, output_names: Sequence[str] | None
) -> PerExampleLoss:
    """The weighted sum over outputs of each output's per-example loss (Keras's total)."""
    names = None if output_names is None else list(output_names)
    leaves: dict[int, PerExampleLoss] = {}

    def leaf_fn(value: Any) -> PerExampleLoss:
        if id(value) not in leaves:
            leaves[id(value)] = per_example_loss_fn(value)
        return leaves[id(value)]

    for value in loss.values() if isinstance(loss, dict) else loss if not _is_leaf(loss) else []:
        if value is not None and not _is_leaf(value):
            raise ValueError(
                f"loss={loss!r} nests losses more than one level deep; give one loss per output."
            )

    def parts(y_true: Any, y_pred: Any) -> list[tuple[Any, tf.Tensor, Any]]:
        """``(output key, its unweighted per-example loss, its weight)`` per output with a loss."""
        per_loss = _per_output(loss, y_pred, names, "loss", None)
        weights = _per_output(loss_weights, y_pred, names, "loss_weights", 1.0)
        labels = _labels(y_true, y_pred, names)
        out = []
        for key, value in per_loss.items():
            if value is None:
                continue
            if labels[key] is None:
                raise ValueError(f"no labels for output {key!r}, which has a loss.")
            pred = y_pred if key is None else y_pred[key]
            out.append((key, tf.cast(leaf_fn(value)(labels[key], pred), tf.float32), weights[key]))
        if not out:
            raise ValueError(f"loss={loss!r} gives no output a loss.")
        return out

    def fn(y_true: Any, y_pred: Any) -> tf.Tensor:
        total = None
        for _, values, weight in parts(y_true, y_pred):
            if weight is not None and not (isinstance(weight, (int, float)) and weight == 1):
                values = values * tf.cast(weight, tf.float32)
            total = values if total is None else total + values
        return total

    def by_name(y_true: Any, y_pred: Any) -> dict[str, tf.Tensor]:
        found = {}
        for key, values, weight in parts(y_true, y_pred):
            if _KERAS_LOGS_WEIGHTED_OUTPUT_LOSSES and weight is not None:
                values = values * tf.cast(weight, tf.float32)
            name = key if isinstance(key, str) else None
            if isinstance(key, int) and names is not None and len(names) == len(y_pred):
                name = names[key]
            if name is not None:
                found[name] = values
        return found

    setattr(fn, _PER_EXAMPLE, True)
    setattr(fn, _PER_OUTPUT, by_name)
    return fn


def _keras_logs_weighted_output_losses() -> bool:
    """Keras before 3.7 logs each output's loss times its ``loss_weights`` entry; 3.7 and later
    log it unweighted. dpcore's ``<name>_loss`` logs follow the installed Keras."""
    major, minor = (int(part) for part in keras.__version__.split(".")[:2])
    return (major, minor) < (3, 7)


_KERAS_LOGS_WEIGHTED_OUTPUT_LOSSES = _keras_logs_weighted_output_losses()


def output_loss_names(loss: Any, output_names: Sequence[str] | None) -> list[str]:
    """The outputs that a dict or list of losses gives a loss, by the names Keras logs them under
    (``"<name>_loss"``): the dict's keys, or the output names of a list's entries; empty for one
    loss (Keras logs no output's loss apart then)."""
    if isinstance(loss, dict):
        return [str(k) for k, v in loss.items() if v is not None]
    if isinstance(loss, (list, tuple)) and output_names is not None:
        if len(loss) == len(output_names) > 1:
            return [n for n, v in zip(output_names, loss) if v is not None]
    return []


def per_output_losses(loss_fn: Any, y_true: Any, y_pred: Any) -> dict[str, tf.Tensor]:
    """Each named output's per-example loss (``[B]``) under ``loss_fn``, as Keras logs it
    (weighted by ``loss_weights`` before Keras 3.7, unweighted since), for a
    :func:`per_example_loss_fn` of several losses; empty for any other loss.

    Privacy:
      Computed from the raw batch: not private.
    """
    by_name = getattr(loss_fn, _PER_OUTPUT, None)
    return {} if by_name is None else dict(by_name(y_true, y_pred))


def output_mask(y_pred: Any) -> tf.Tensor | None:
    """The Keras mask carried by a single-tensor model output (None for none, or nested outputs)."""
    if not tf.is_tensor(y_pred):
        return None
    from dpcore.engine import graph  # the one module reading Keras's mask storage (lazy: cycle)

    return graph.keras_mask(y_pred)


def apply_output_mask(values: tf.Tensor, mask: Any, *, name: str = "loss") -> tf.Tensor:
    """Per-position losses ``values`` with the positions where ``mask`` is False set to 0.

    ``mask`` is the ``[B, T, ...]`` Keras mask of the model output; ``values`` has at least its
    axes (extra trailing axes are masked alike). A select, not a product, so a non-finite loss at
    a masked position (e.g. ``log(0)`` on a padded step) does not reach the example's loss.

    Raises:
      ValueError: if ``values`` has fewer axes than ``mask``.
    """
    mask = tf.cast(mask, tf.bool)
    if values.shape.rank is not None and mask.shape.rank is not None:
        if values.shape.rank < mask.shape.rank:
            raise ValueError(
                f"loss {name!r} returned shape {values.shape} for an output carrying a Keras mask "
                f"of shape {mask.shape}: the mask cannot be applied per position. Return the "
                "per-position losses (a keras.losses.Loss with reduction=None does) so that "
                "masked positions contribute nothing, as in Keras's compiled loss."
            )
        for _ in range(values.shape.rank - mask.shape.rank):
            mask = mask[..., None]
    mask = tf.broadcast_to(mask, tf.shape(values))
    return tf.where(mask, values, tf.zeros_like(values))


class Regularization:
    """The terms Keras adds to a model's compiled loss that are functions of the weights alone.

    Keras's training loss is the compiled loss plus every entry of ``model.losses``: the weight
    regularizers' penalties (``kernel_regularizer``, ``bias_regularizer``, ... of the trainable
    weights) and what layers add with ``add_loss`` during the call. Build it with
    :func:`regularization`, which keeps only terms that depend on no example (and refuses the
    others); :meth:`value_and_gradients` evaluates them at the current weights.

    The ``add_loss`` terms are evaluated on a fixed synthetic batch (standard normal floats, zero
    integers; its values never come from the data), in a ``keras.StatelessScope`` so that the
    call changes no variable. For a term that is a function of the weights alone this is the
    value Keras adds on any batch; for any other term it is still a function of the weights and
    public constants only.

    Privacy:
      What it returns is a function of the (already privatized) weights and of public constants,
      never of an example: adding its gradient to the privatized update is post-processing.
    """

    def __init__(self, model: Any, weighted: Sequence[Any], inputs: Any, *, training: Any) -> None:
        self.model = model
        self.weighted = tuple(weighted)  # trainable weights with a regularizer
        self.inputs = inputs  # the synthetic batch for add_loss terms, or None (there are none)
        self.training = training

    def value(self) -> tf.Tensor:
        """The sum of the terms at the current weights (float32 scalar), as Keras adds them."""
        terms = [tf.cast(tf.reduce_sum(v.regularizer(v)), tf.float32) for v in self.weighted]
        if self.inputs is not None:
            terms += [
                tf.cast(tf.reduce_sum(t), tf.float32)
                for t in _added_losses(self.model, self.inputs, self.training)
            ]
        return tf.add_n(terms) if terms else tf.zeros([], tf.float32)

    def value_and_gradients(
        self, variables: Sequence[Any]
    ) -> tuple[tf.Tensor, list[tf.Tensor | None]]:
        """The value and its gradient for each of ``variables`` (None where it has none)."""
        with tf.GradientTape() as tape:
            value = self.value()
        return value, list(tape.gradient(value, list(variables)))


# Per model: ((anchors), synthetic inputs or None) per (anchor ids, input signature, mode).
_REGULARIZATION: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_KEYS_PER_MODEL = 16


def regularization(model: Any, x: Any, *, training: Any) -> Regularization | None:
    """The model's data-independent loss terms, or None when it has none; refuses the others.

    Keras adds to the compiled loss the weight regularizers' penalties, the activity
    regularizers' penalties and the ``add_loss`` terms of the call. Weight regularizers see only
    their variable: they are kept. Activity regularizers penalise each example's activations:
    the engine adds each example's penalty to its loss, before clipping
    (:mod:`dpcore.engine.activity`, whose :func:`~dpcore.engine.activity.check` this runs first,
    so that a penalty it cannot split by example is refused before any step); they are not
    among the terms returned here.

    ``add_loss`` terms are detected, and their data dependence checked, by calling the model
    eagerly (outside the caller's trace) in a ``keras.StatelessScope`` that collects them, on
    synthetic batches shaped like ``x``: batch A (standard normal floats, zero integers) twice,
    batch B (other normals, another number of rows) and, where the model accepts it, batch C
    (integers all one). A term is accepted only if A, its repetition, B and C give the same
    number of terms with bit-for-bit equal values and its gradient with respect to A's floating
    inputs is zero or absent: a term that reads the batch's values, its size or its integer ids
    changes between them (a change of the rows count catches a division by the batch size), and
    a term that is differentiable in the inputs shows a gradient even where the values happen to
    agree. A term that depends on the data only at values no probe hits (``tf.where(x == c,
    ...)``) would pass this check; it is then evaluated on batch A at every step, never on the
    data (see :class:`Regularization`), so it cannot carry information about the examples: the
    check keeps the update equal to Keras's, the synthetic evaluation keeps it private. A model
    that fails on batch A (e.g. it asserts its inputs are non-negative) is traced instead
    (nothing runs): without ``add_loss`` terms there is nothing to evaluate; with some, it is
    refused, since they could be neither checked nor evaluated without the data, and leaving
    them out would train on another loss than Keras's. Results are cached per model, layers,
    variables, input signature and mode.

    Args:
      model: the Keras model being trained.
      x: the batch's inputs (only shapes and dtypes are read).
      training: the mode the step calls the model in.

    Returns:
      A :class:`Regularization`, or None when the model has no such term.

    Raises:
      ValueError: for an activity regularizer that cannot be split by example, an ``add_loss``
        term that depends on the batch or is not deterministic, or a model whose ``add_loss``
        terms could not be checked.

    Privacy:
      Only terms evaluated without any example reach the update; every term Keras computes from
      the batch is refused rather than dropped or added unclipped.
    """
    from dpcore import validation  # lazily: the engine imports this module
    from dpcore.engine import activity
    from dpcore.engine.summary import batch_signature

    mode = True if tf.is_tensor(training) else bool(training)
    walked = validation.walk_layers(model)
    layers = [layer for _, layer in walked]
    activity.check(model, x, training=training)  # enters each example's loss in the engine
    weights = list(model.trainable_weights)
    weighted = [v for v in weights if getattr(v, "regularizer", None) is not None]
    anchors = (*layers[1:], *weights)  # not the model itself: the entry must not keep its key
    key = (tuple(map(id, anchors)), batch_signature(x), mode)
    cache = _REGULARIZATION.setdefault(model, {})
    hit = cache.get(key)
    if hit is None or not all(a is b for a, b in zip(hit[0], anchors, strict=True)):
        if len(cache) >= _MAX_KEYS_PER_MODEL:
            cache.clear()
        hit = (anchors, _added_loss_inputs(model, x, mode, weights))
        cache[key] = hit
    inputs = hit[1]
    if not weighted and inputs is None:
        return None
    return Regularization(model, weighted, inputs, training=training)


def _added_losses(model: Any, inputs: Any, training: Any) -> list[tf.Tensor]:
    """The ``add_loss`` terms of one call of ``model`` on ``inputs``, changing no variable.

    The activity regularizers' penalties, which Keras adds alike, are left out: the engine adds
    them to each example's loss (:mod:`dpcore.engine.activity`).
    """
    from dpcore.engine import activity

    with keras.StatelessScope(collect_losses=True, initialize_variables=False) as scope:
        with activity.capture(model, scope=scope) as sink:
            model(inputs, training=training)
    skip = set(sink.keras_indices)
    return [t for i, t in enumerate(scope.losses) if i not in skip]


def _synthetic_inputs(x: Any, rows: int, seed: int, *, fill: int) -> Any:
    """``rows`` synthetic rows shaped like ``x``: normals (floats), ``fill`` (integers, bools)."""
    rng = np.random.default_rng(seed)

    def leaf(t: Any) -> Any:
        if t is None or not hasattr(t, "shape") or not hasattr(t, "dtype"):
            return t
        dtype = tf.as_dtype(t.dtype)
        shape = [rows] + [4 if d is None else d for d in tf.TensorShape(t.shape)[1:]]
        if dtype.is_floating:
            return rng.standard_normal(shape).astype(dtype.as_numpy_dtype)
        if dtype.is_bool:
            return np.full(shape, bool(fill))
        return np.full(shape, fill, dtype.as_numpy_dtype)

    return tf.nest.map_structure(leaf, x)


def _traced_added_loss_count(model: Any, x: Any, training: bool) -> int:
    """How many ``add_loss`` terms one call of ``model`` on inputs like ``x`` adds (activity
    penalties left out), found by tracing the call on inputs of ``x``'s shapes and dtypes in a
    scratch graph (nothing runs).

    Raises:
      ValueError: if the call cannot be traced, so whether it adds terms is unknown.
    """
    from dpcore.engine import activity

    leaves = tf.nest.flatten(x)
    shaped = [hasattr(t, "shape") and hasattr(t, "dtype") for t in leaves]
    specs = [
        tf.TensorSpec(tf.TensorShape(t.shape), tf.as_dtype(t.dtype))
        for t, s in zip(leaves, shaped)
        if s
    ]
    counts: list[int] = []

    def trace(*flat: tf.Tensor) -> tf.Tensor:
        it = iter(flat)
        inputs = tf.nest.pack_sequence_as(x, [next(it) if s else t for t, s in zip(leaves, shaped)])
        with keras.StatelessScope(collect_losses=True, initialize_variables=False) as scope:
            with activity.capture(model, scope=scope) as sink:
                model(inputs, training=training)
        counts.append(len(scope.losses) - len(set(sink.keras_indices)))
        return tf.zeros([])

    try:
        with tf.init_scope():
            tf.function(trace, autograph=False).get_concrete_function(*specs)
    except Exception as err:  # noqa: BLE001 - any failure leaves the question open
        raise ValueError(
            f"dpcore: model {getattr(model, 'name', model)!r} could be neither called on synthetic "
            f"inputs nor traced ({type(err).__name__}), so whether it adds losses with add_loss "
            "cannot be checked; make it run on any inputs of its input shapes."
        ) from err
    return counts[0]


def _added_loss_inputs(model: Any, x: Any, training: bool, variables: Sequence[Any]) -> Any:
    """The synthetic batch to evaluate the model's ``add_loss`` terms on, or None if it has none.

    Raises ValueError for terms that depend on the batch (see :func:`regularization`).
    """
    from dpcore.engine.summary import probe_rows

    name = getattr(model, "name", model)
    rows = probe_rows([x], variables, start=3)
    a = _synthetic_inputs(x, rows, 0, fill=0)
    with tf.init_scope():  # eager, outside whatever graph the caller is tracing
        try:
            floats = [
                tf.convert_to_tensor(t)
                for t in tf.nest.flatten(a)
                if hasattr(t, "dtype") and tf.as_dtype(t.dtype).is_floating
            ]
            it = iter(floats)
            watched = tf.nest.map_structure(
                lambda t: (
                    next(it) if hasattr(t, "dtype") and tf.as_dtype(t.dtype).is_floating else t
                ),
                a,
            )
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(floats)
                first = _added_losses(model, watched, training)
                total = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in first] or [0.0])
        except Exception as err:  # noqa: BLE001 - the model may not run on synthetic rows
            if _traced_added_loss_count(model, x, training) == 0:
                return None  # no add_loss term to evaluate: nothing is left out
            raise ValueError(
                f"dpcore: model {name!r} adds losses with add_loss, and calling it on synthetic "
                f"inputs failed ({type(err).__name__}), so whether they depend on the batch "
                "cannot be checked and they cannot be evaluated without the data; make the model "
                "run on any inputs of its input shapes, or move the terms into the per-example "
                "loss."
            ) from err
        if not first:
            return None
        grads = tape.gradient(total, floats) if floats else []
        reads_inputs = any(g is not None and bool(tf.reduce_any(g != 0)) for g in grads)
        values = [np.asarray(t) for t in first]
        other = probe_rows([x], variables, start=rows + 2)
        probes = [
            (a, False),
            (_synthetic_inputs(x, other, 1, fill=0), False),
            (_synthetic_inputs(x, rows, 2, fill=1), True),  # skipped where 1 is not a valid id
        ]
        differs = reads_inputs
        for inputs, optional in probes:
            if differs:
                break
            try:
                again = [np.asarray(t) for t in _added_losses(model, inputs, training)]
            except Exception as err:  # noqa: BLE001
                if optional:
                    continue
                raise ValueError(
                    f"dpcore: model {name!r} adds losses with add_loss, and calling it on another "
                    f"synthetic batch failed ({type(err).__name__}), so whether "
                    "they depend on the batch cannot be checked; make them functions of the "
                    "weights only, or move them into the per-example loss."
                ) from err
            differs = len(again) != len(values) or not all(
                u.shape == v.shape and np.array_equal(u, v, equal_nan=u.dtype.kind == "f")
                for u, v in zip(values, again)
            )
    if differs:
        raise ValueError(
            f"dpcore: model {name!r} adds a loss with add_loss that depends on the batch (its "
            "value changes with the inputs, their number or a random draw), so no example's "
            "share of it can be clipped; compute it per example inside the loss, or make it a "
            "function of the weights only."
        )
    return a


def one_sample_weight(sample_weight: Any) -> Any:
    """``sample_weight`` as one ``[B]`` weight per example (None stays None).

    Keras's data adapters copy one ``sample_weight`` array to every output of a model with
    several outputs (a list or dict of equal arrays); dpcore weights each example's whole loss
    once, so the copies must agree: the step fails when they do not (per-output weights are not
    supported; put them into the loss).
    """
    if sample_weight is None or not isinstance(sample_weight, (dict, list, tuple)):
        return sample_weight
    leaves = [t for t in tf.nest.flatten(sample_weight) if t is not None]
    if not leaves:
        return None
    first = tf.reshape(tf.cast(leaves[0], tf.float32), [-1])
    if len(leaves) == 1:
        return first
    same = tf.reduce_all(
        [
            tf.reduce_all(tf.equal(first, tf.reshape(tf.cast(t, tf.float32), [-1])))
            for t in leaves[1:]
        ]
    )
    check = tf.debugging.Assert(
        same,
        [
            "dpcore: the sample weights of the outputs differ; dpcore weights the loss of each "
            "example once. Give one sample_weight per example, or weight the outputs in the loss"
        ],
    )
    with tf.control_dependencies([check]):
        return tf.identity(first)
