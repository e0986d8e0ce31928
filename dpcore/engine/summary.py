"""The engine's output type and batch preparation shared by every engine path.

Contract: an engine path (vectorized or fast) turns one batch into a :class:`GradientSummary`:
per-example squared gradient norms for each variable, and a way to form weighted sums of the
per-example gradients without the caller ever seeing them. Masked examples have zero loss, zero
norm and zero weight. Everything here runs inside the caller's compiled step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

NONFINITE_MODES = ("raise", "skip")


@dataclasses.dataclass(frozen=True)
class GradientSummary:
    """Per-example gradient information for one batch.

    Attributes:
      variables: the variables the gradients are taken with respect to, in order.
      sq_norms: ``[B, V]`` float32: squared L2 norm of example ``i``'s gradient for variable ``v``
        (zero for masked examples).
      per_example_loss: ``[B]`` loss of each example, sample weight applied, zero where masked.
      mask: ``[B]`` float32, 1.0 for real examples and 0.0 for padding or skipped examples.
      y_pred: the model's output on the batch.
      weighted_sum: ``weights [B, V] -> [sum_i weights[i, v] * grad_i[v] for v]``. Callers pass
        clip factors here; no per-example gradient leaves the engine.
      input_gradients: per-example gradients of each example's loss w.r.t. the inputs (same
        structure as ``x``), or None when not requested.
      paths: for reporting, a mapping from layer (or variable) name to the path that computed it.
    """

    variables: tuple[Any, ...]
    sq_norms: tf.Tensor
    per_example_loss: tf.Tensor
    mask: tf.Tensor
    y_pred: Any
    weighted_sum: Callable[[tf.Tensor], list[tf.Tensor]]
    input_gradients: Any = None
    paths: dict[str, str] = dataclasses.field(default_factory=dict)


def batch_size_of(x: Any) -> tf.Tensor:
    """The dynamic batch size of a (possibly nested) input."""
    return tf.shape(tf.nest.flatten(x)[0])[0]


def _all_finite_rows(t: tf.Tensor) -> tf.Tensor:
    t = tf.convert_to_tensor(t)
    if not (t.dtype.is_floating or t.dtype.is_complex):
        return tf.ones([tf.shape(t)[0]], tf.bool)
    flat = tf.reshape(t, [tf.shape(t)[0], -1])
    return tf.reduce_all(tf.math.is_finite(flat), axis=1)


def _zero_rows(t: tf.Tensor, keep: tf.Tensor) -> tf.Tensor:
    t = tf.convert_to_tensor(t)
    if not t.dtype.is_floating:
        return t
    shape = tf.concat([tf.shape(keep), tf.ones([tf.rank(t) - 1], tf.int32)], 0)
    return tf.where(tf.reshape(keep, shape), t, tf.zeros_like(t))


def prepare_batch(
    x: Any,
    y: Any,
    sample_weight: Any = None,
    mask: Any = None,
    *,
    nonfinite: str = "raise",
) -> tuple[Any, Any, tf.Tensor, tf.Tensor]:
    """Validates a batch and returns ``(x, y, sample_weight [B], mask [B])``.

    Args:
      x: model inputs, a tensor or nested structure with a leading batch axis.
      y: labels with the same leading batch axis.
      sample_weight: optional ``[B]`` weights (default 1).
      mask: optional ``[B]`` booleans or 0/1 floats; False/0 marks a padding example.
      nonfinite: ``"raise"`` fails the step on NaN/Inf in ``x``, ``y`` or ``sample_weight``;
        ``"skip"`` masks such examples out (their inputs and weights are zeroed so nothing
        non-finite reaches the weights).

    Returns:
      The batch with float32 ``sample_weight`` and ``mask`` of shape ``[B]``.

    Privacy:
      Skipping is decided per example from that example's own values, so it does not change the
      sensitivity of the clipped sum.
    """
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite={nonfinite!r}; expected one of {NONFINITE_MODES}.")
    b = batch_size_of(x)
    static_b = tf.convert_to_tensor(tf.nest.flatten(x)[0]).shape[0]
    for t in tf.nest.flatten(y):
        shape = tf.convert_to_tensor(t).shape
        label_b = shape[0] if shape.rank else None
        if static_b is not None and label_b is not None and label_b != static_b:
            raise ValueError(
                f"labels y have batch size {label_b} but inputs x have batch size {static_b}."
            )
    mask = tf.ones([b], tf.float32) if mask is None else tf.cast(tf.reshape(mask, [-1]), tf.float32)
    sample_weight = (
        tf.ones([b], tf.float32)
        if sample_weight is None
        else tf.cast(tf.reshape(sample_weight, [-1]), tf.float32)
    )
    leaves = tf.nest.flatten(x) + tf.nest.flatten(y)
    finite = tf.reduce_all(tf.stack([_all_finite_rows(t) for t in leaves], 0), 0)
    finite = finite & tf.math.is_finite(sample_weight)
    if nonfinite == "raise":
        check = tf.debugging.Assert(
            tf.reduce_all(finite | (mask <= 0)),
            [
                "dpcore: NaN or Inf in the batch inputs, labels or sample weights; pass "
                "nonfinite='skip' to drop such examples instead"
            ],
        )
        # Everything downstream (and so every weight update) depends on the check having passed.
        with tf.control_dependencies([check]):
            mask = tf.identity(mask)
    else:
        mask = mask * tf.cast(finite, tf.float32)
    # Padded and skipped rows are zeroed so that their (zero-weighted) gradients stay finite.
    keep = mask > 0
    x = tf.nest.map_structure(lambda t: _zero_rows(t, keep), x)
    y = tf.nest.map_structure(lambda t: _zero_rows(t, keep), y)
    sample_weight = tf.where(keep, sample_weight, tf.zeros_like(sample_weight))
    return x, y, sample_weight, mask


def check_variables(variables: Sequence[Any]) -> tuple[Any, ...]:
    """Rejects an empty variable list with a clear message."""
    variables = tuple(variables)
    if not variables:
        raise ValueError(
            "the model has no trainable variables (or variables=[] was passed): there is "
            "nothing to privatize."
        )
    return variables
