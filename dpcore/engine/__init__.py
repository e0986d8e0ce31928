"""The per-example gradient engine.

Contract: :func:`summarize` turns one batch into a
:class:`~dpcore.engine.summary.GradientSummary` (per-example squared norms per variable and a
weighted-sum function), by one of two paths:

- ``"vectorized"``: per-example gradients for any model via ``tf.vectorized_map``;
- ``"fast"``: per-layer rules (ghost norms, book-keeping clipped sums) that never materialize
  ``[B, *var.shape]`` tensors where a cheaper form exists; layers without a rule fall back to
  vectorized gradients for their own variables only.

``"auto"`` picks the fast path when the model is a graph-structured Keras model (Sequential or
Functional), else the vectorized path. Everything runs inside the caller's compiled step.
:func:`per_example_gradients` and :func:`per_example_norms` are the public entry points for users
who want the per-example quantities themselves; called eagerly they compile once per model and
options and reuse the compiled function on later calls (no retrace per step).
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from dpcore import validation
from dpcore.engine import activity
from dpcore.engine.independence import check_rows_independent, warn_whole_model_fallback
from dpcore.engine.summary import (
    GradientSummary,
    batch_size_of,
    check_group_layout,
    check_variables,
    drop_nonfinite,
    drop_rows,
    prepare_batch,
    unit_mask,
    unit_weights,
)
from dpcore.engine.vectorized import materialize, vectorized_summary
from dpcore.losses import per_example_loss_fn
from dpcore.options import METHODS, ExecutionOptions, resolve

__all__ = [
    "ExecutionOptions",
    "GradientSummary",
    "METHODS",
    "per_example_gradients",
    "per_example_norms",
    "summarize",
]


def _fast_available(model: Any) -> bool:
    try:
        from dpcore.engine import ghost
    except ImportError:
        return False
    supports = getattr(ghost, "supports", None)
    return bool(supports(model)) if supports is not None else False


@tf.autograph.experimental.do_not_convert
def summarize(
    model: Any,
    loss: Any,
    x: Any,
    y: Any,
    *,
    sample_weight: Any = None,
    mask: Any = None,
    variables: Sequence[Any] | None = None,
    options: ExecutionOptions | None = None,
) -> GradientSummary:
    """Per-example gradient summary of one batch (call inside a compiled step).

    Args:
      model: a Keras model.
      loss: a per-example loss (see :func:`dpcore.losses.per_example_loss_fn`).
      x: inputs with a leading batch axis (tensor or nested structure).
      y: labels.
      sample_weight: optional ``[B]`` weights multiplying each example's loss.
      mask: optional ``[B]`` 0/1 (or bool); 0 marks padding examples, which contribute nothing.
      variables: defaults to ``model.trainable_variables``.
      options: how to compute (:class:`dpcore.ExecutionOptions`: engine path, training mode,
        chunking, non-finite handling, input gradients, layer rules); defaults when None.

    Returns:
      A :class:`GradientSummary`; with ``options.group_size = K`` its per-example quantities are
      per privacy unit (rows ``[u*K, (u+1)*K)``), see :class:`dpcore.ExecutionOptions`.

    Raises:
      ValueError: for a model without trainable variables, a scalar loss or a batch-size
        mismatch (or a batch size that is not a multiple of ``group_size``); TypeError for options
        that are not an ``ExecutionOptions``; ValueError inside an XLA-compiled function
        (see :func:`dpcore.validation.check_not_compiled_by_xla`); ValueError for a model or
        loss that mixes examples (:func:`dpcore.engine.independence.check_rows_independent`).

    Privacy:
      Every per-example quantity depends on one example (one unit) only; masked and skipped
      examples have zero norm and zero weight. The model is validated
      (:func:`dpcore.validation.check_model`) and probed for rows that reach other rows' losses
      (:mod:`dpcore.engine.independence`); where that probe cannot decide, the whole model
      takes the vectorized path.
    """
    validation.check_not_compiled_by_xla("dpcore.summarize")
    options = resolve(options)
    group = options.group_size
    variables = check_variables(model.trainable_variables if variables is None else variables)
    loss_fn = per_example_loss_fn(loss)
    check_group_layout(x, group)
    requested = tf.reduce_sum(
        unit_mask(
            tf.ones([batch_size_of(x)], tf.float32)
            if mask is None
            else tf.cast(tf.cast(tf.reshape(mask, [-1]), tf.float32) != 0, tf.float32),
            group,
        )
    )
    x, y, sample_weight, mask = prepare_batch(
        x, y, sample_weight, mask, nonfinite=options.nonfinite
    )
    sample_weight = unit_weights(
        sample_weight, mask, group_size=group, group_reduction=options.group_reduction
    )
    validation.check_model(model, x, training=options.training, require_variables=False)
    activity.check(model, x, training=options.training)  # refuses penalties it cannot split
    unverified = check_rows_independent(
        model,
        loss,
        loss_fn,
        x,
        y,
        training=options.training,
        variables=variables,
        registry=options.layer_rules(),
    )
    use_fast = options.method == "fast" or (
        options.method == "auto" and options.chunk_size is None and _fast_available(model)
    )
    warn_whole_model_fallback(model, None)  # the fast path below may record its own reason
    if use_fast and unverified is not None:
        warn_whole_model_fallback(
            model,
            "whether each example's loss and gradients depend on that example alone could not "
            f"be verified ({unverified})",
        )
        use_fast = False
    if use_fast:
        from dpcore.engine.ghost import fast_summary as path
    else:
        path = vectorized_summary

    def run(x: Any, y: Any, sample_weight: tf.Tensor, mask: tf.Tensor) -> GradientSummary:
        return path(model, loss_fn, x, y, sample_weight, mask, variables, options=options)

    def recompute(keep: tf.Tensor) -> GradientSummary:
        # The batch without its non-finite rows (units), as prepare_batch drops a padding row.
        return run(*drop_rows(x, y, sample_weight, mask, tf.repeat(keep, group)))

    summary = drop_nonfinite(
        run(x, y, sample_weight, mask), recompute, nonfinite=options.nonfinite, group_size=group
    )
    row_mask = None
    if group > 1:  # the rows of dropped units are out too
        row_mask = mask * tf.repeat(summary.mask, group)
    return dataclasses.replace(
        summary, num_skipped=requested - tf.reduce_sum(summary.mask), row_mask=row_mask
    )


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Compiled eager entry points kept per model (least recently used dropped first): a caller that
# passes a new loss object on every call must not grow the cache without bound.
_MAX_COMPILED_PER_MODEL = 16


def _compiled(model: Any, key: tuple, build: Callable[..., Any]) -> Any:
    per_model = _COMPILED.setdefault(model, collections.OrderedDict())
    if key in per_model:
        per_model.move_to_end(key)
    else:
        per_model[key] = tf.function(build, reduce_retracing=True)
        while len(per_model) > _MAX_COMPILED_PER_MODEL:
            per_model.popitem(last=False)
    return per_model[key]


def _run(model: Any, key: tuple, build: Callable[..., Any], *args: Any) -> Any:
    if tf.inside_function():
        return build(*args)
    return _compiled(model, key, build)(*args)


def per_example_gradients(
    model: Any,
    loss: Any,
    x: Any,
    y: Any,
    *,
    sample_weight: Any = None,
    mask: Any = None,
    variables: Sequence[Any] | None = None,
    options: ExecutionOptions | None = None,
) -> Any:
    """Per-example gradients, one ``[B, *var.shape]`` tensor per variable.

    Always by the vectorized path (they are materialized by definition); ``options.chunk_size``
    computes them that many examples at a time (bounding the memory of the intermediate
    per-example activations; the result is still ``[B, ...]``), and ``options.wrt_inputs`` also
    returns gradients w.r.t. the inputs from the same compiled step.

    Args:
      model: any Keras model.
      loss: a per-example loss (``reduction=None``, shape ``[B]``).
      x: inputs with a leading batch axis.
      y: labels.
      sample_weight: optional ``[B]`` weights.
      mask: optional ``[B]`` padding mask (masked rows are all-zero).
      variables: defaults to ``model.trainable_variables``.
      options: :class:`dpcore.ExecutionOptions` (``method`` and ``registry`` are not used).

    Returns:
      A list of per-example gradients, or ``(list, input_grads)`` with ``options.wrt_inputs``,
      where ``input_grads`` has the structure of ``x`` (None for non-floating leaves). With
      ``options.group_size = K`` the gradients are per unit, ``[B / K, *var.shape]``.

    Privacy:
      Returns unclipped per-example gradients: sensitive data. Clip and noise them before release.
    """
    options = resolve(options)
    variables = check_variables(model.trainable_variables if variables is None else variables)
    loss_fn = per_example_loss_fn(loss)

    def build(x: Any, y: Any, sample_weight: Any, mask: Any) -> Any:
        check_group_layout(x, options.group_size)
        xp, yp, sw, mk = prepare_batch(x, y, sample_weight, mask, nonfinite=options.nonfinite)
        sw = unit_weights(
            sw, mk, group_size=options.group_size, group_reduction=options.group_reduction
        )
        validation.check_model(model, xp, training=options.training, require_variables=False)
        grads, in_grads, _, _ = materialize(
            model,
            loss_fn,
            xp,
            yp,
            sw * mk,
            variables,
            options=options,
            penalty_weights=activity.weights_for(model, xp, mk, options),
        )
        if not options.wrt_inputs:
            return grads
        it = iter(in_grads)
        leaves = [next(it) if t.dtype.is_floating else None for t in tf.nest.flatten(xp)]
        return grads, tf.nest.pack_sequence_as(xp, leaves)

    key = _key("grads", loss, variables, options, sample_weight, mask)
    return _run(model, key, build, x, y, sample_weight, mask)


def per_example_norms(
    model: Any,
    loss: Any,
    x: Any,
    y: Any,
    *,
    sample_weight: Any = None,
    mask: Any = None,
    variables: Sequence[Any] | None = None,
    options: ExecutionOptions | None = None,
) -> tf.Tensor:
    """Per-example global L2 gradient norms, shape ``[B]`` (0 for masked examples).

    Args: as :func:`summarize`.

    Returns:
      ``[B]`` float32 norms: the certified upper bounds that clipping uses (:mod:`dpcore.norms`);
      on the fast path they exceed the exact norms by at most a few float32 roundoffs times the
      layer widths for typical data, more for examples whose positions nearly cancel.

    Privacy:
      Unclipped norms are sensitive: do not release them without privatization.
    """
    options = resolve(options)
    variables = check_variables(model.trainable_variables if variables is None else variables)

    def build(x: Any, y: Any, sample_weight: Any, mask: Any) -> tf.Tensor:
        s = summarize(
            model,
            loss,
            x,
            y,
            sample_weight=sample_weight,
            mask=mask,
            variables=variables,
            options=options,
        )
        from dpcore.aggregation import total_norm_bound  # aggregation imports the engine

        norms = total_norm_bound(s.sq_norms)
        # float32, rounded up: still an upper bound of the gradient's norm.
        n32 = tf.cast(norms, tf.float32)
        return tf.where(tf.cast(n32, tf.float64) < norms, tf.math.nextafter(n32, np.inf), n32)

    key = _key("norms", loss, variables, options, sample_weight, mask)
    return _run(model, key, build, x, y, sample_weight, mask)


def _key(
    kind: str, loss: Any, variables: Sequence[Any], options: ExecutionOptions, *opt: Any
) -> tuple:
    """Cache key of a compiled eager entry point: what changes the traced program."""
    return (
        kind,
        id(loss),
        tuple(id(v) for v in variables),
        options.cache_key,
        *(a is None for a in opt),
    )
