"""One-example-at-a-time eager references (see the package docstring)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from dpcore.losses import per_example_loss_fn
from dpcore.validation import walk_layers


def _example(structure: Any, i: int) -> Any:
    return tf.nest.map_structure(lambda t: tf.convert_to_tensor(t)[i : i + 1], structure)


class _Recorded:
    """A layer's activity regularizer that also keeps what it returns to Keras."""

    def __init__(self, regularizer: Any, kept: list[Any]) -> None:
        self.regularizer = regularizer
        self.kept = kept

    def __call__(self, output: Any) -> Any:
        value = self.regularizer(output)
        self.kept.append(value)
        return value


@contextlib.contextmanager
def _activity_penalties(model: Any) -> Iterator[list[Any]]:
    """The activity regularizers' penalties of the model calls inside it, as Keras computes them
    (one per regularized output, before Keras divides it by the batch size)."""
    kept: list[Any] = []
    swapped = []
    for _, layer in walk_layers(model):
        regularizer = getattr(layer, "activity_regularizer", None)
        if regularizer is not None:
            swapped.append((layer, regularizer))
            layer.activity_regularizer = _Recorded(regularizer, kept)
    try:
        yield kept
    finally:
        for layer, regularizer in swapped:
            layer.activity_regularizer = regularizer


def _loss_and_grads(
    model: Any,
    loss: Any,
    x: Any,
    y: Any,
    i: int,
    weight: float,
    variables: Sequence[Any],
    training: bool,
    wrt_inputs: bool,
) -> tuple[list[np.ndarray], Any]:
    loss_fn = per_example_loss_fn(loss)
    xi, yi = _example(x, i), _example(y, i)
    with tf.GradientTape() as tape:
        if wrt_inputs:
            tape.watch(tf.nest.flatten(xi))
        with _activity_penalties(model) as penalties:
            y_pred = model(xi, training=training)
        value = weight * tf.reduce_sum(loss_fn(yi, y_pred))
        # What Keras adds to model.losses for this call of one row: the penalties, unweighted.
        for penalty in penalties:
            value += tf.cast(penalty, value.dtype)
    if wrt_inputs:
        grads, xgrad = tape.gradient(value, (list(variables), xi))
    else:
        grads, xgrad = tape.gradient(value, list(variables)), None
    grads = [
        np.zeros(
            v.shape, v.dtype.as_numpy_dtype if hasattr(v.dtype, "as_numpy_dtype") else np.float32
        )
        if g is None
        else np.asarray(tf.convert_to_tensor(g))
        for v, g in zip(variables, grads)
    ]
    return grads, xgrad


def reference_per_example_gradients(
    model: Any,
    loss: Any,
    x: Any,
    y: Any,
    *,
    sample_weight: Any = None,
    mask: Any = None,
    variables: Sequence[Any] | None = None,
    training: bool = False,
) -> list[np.ndarray]:
    """Per-example gradients ``[B, *var.shape]`` for each variable, one eager tape per example.

    Example ``i``'s loss is its weighted loss plus the penalties of the model's activity
    regularizers on the call of that example alone, which Keras adds to ``model.losses`` (divided
    by the batch size of one) and does not weight; the weight regularizers and ``add_loss`` terms
    are not included (dpcore adds the terms of the weights alone once per step, after the noise).

    Args:
      model: any callable Keras model or layer.
      loss: anything :func:`dpcore.losses.per_example_loss_fn` accepts.
      x: inputs (tensor or nested structure) with a leading batch axis.
      y: labels.
      sample_weight: optional ``[B]`` weights multiplying each example's loss.
      mask: optional ``[B]``; masked examples get an all-zero gradient.
      variables: defaults to ``model.trainable_variables``.
      training: passed to the model call.

    Returns:
      A list of numpy arrays, one ``[B, *var.shape]`` per variable.

    Privacy:
      Test-only reference; it computes exactly what the engine must compute.
    """
    variables = list(model.trainable_variables if variables is None else variables)
    b = int(tf.shape(tf.nest.flatten(x)[0])[0])
    sw = np.ones(b, np.float32) if sample_weight is None else np.asarray(sample_weight, np.float32)
    mk = np.ones(b, bool) if mask is None else np.asarray(mask).astype(bool)
    out = [np.zeros((b, *v.shape), np.float32) for v in variables]
    for i in range(b):
        if not mk[i]:
            continue
        grads, _ = _loss_and_grads(model, loss, x, y, i, float(sw[i]), variables, training, False)
        for k, g in enumerate(grads):
            out[k][i] = g
    return out


def reference_unit_gradients(
    model: Any,
    loss: Any,
    x: Any,
    y: Any,
    *,
    group_size: int,
    group_reduction: str = "sum",
    sample_weight: Any = None,
    mask: Any = None,
    variables: Sequence[Any] | None = None,
    training: bool = False,
) -> list[np.ndarray]:
    """Per-unit gradients ``[U, *var.shape]``: unit ``u`` is rows ``[u*K, (u+1)*K)``.

    One unit at a time, one eager tape per real row: the gradient of the unit's loss, the sum of
    its real rows' weighted losses (``"sum"``) or their mean (``"mean"``: the sum divided by the
    number of real rows). An all-padding unit has an all-zero gradient.

    Args:
      model: any callable Keras model or layer.
      loss: anything :func:`dpcore.losses.per_example_loss_fn` accepts.
      x: inputs with a leading axis of ``U * group_size`` rows.
      y: labels.
      group_size: rows per unit ``K``.
      group_reduction: ``"sum"`` or ``"mean"``.
      sample_weight: optional ``[rows]`` weights multiplying each row's loss.
      mask: optional ``[rows]``; masked rows contribute nothing (nor count for the mean).
      variables: defaults to ``model.trainable_variables``.
      training: passed to the model call.

    Returns:
      A list of numpy arrays, one ``[U, *var.shape]`` per variable.

    Privacy:
      Test-only reference; it computes exactly what the engine must compute for units.
    """
    rows = reference_per_example_gradients(
        model,
        loss,
        x,
        y,
        sample_weight=sample_weight,
        mask=mask,
        variables=variables,
        training=training,
    )
    b = rows[0].shape[0]
    if b % group_size:
        raise ValueError(f"{b} rows are not a multiple of group_size={group_size}.")
    mk = np.ones(b, bool) if mask is None else np.asarray(mask).astype(bool)
    real = mk.reshape(-1, group_size).sum(axis=1)
    out = []
    for g in rows:
        units = g.reshape(-1, group_size, *g.shape[1:]).astype(np.float64).sum(axis=1)
        if group_reduction == "mean":
            units = units / np.maximum(real, 1).reshape(-1, *[1] * (units.ndim - 1))
        out.append(units.astype(np.float32))
    return out


def reference_per_example_norms(grads: Sequence[np.ndarray]) -> np.ndarray:
    """Global L2 norm of each example's gradient from ``reference_per_example_gradients``.

    Privacy:
      Test-only: row ``i`` depends on example ``i`` alone, but these are plain norms in the
      gradients' own precision, not certified upper bounds (:mod:`dpcore.norms`): never clip
      with them.
    """
    b = grads[0].shape[0]
    return np.sqrt(sum(np.sum(np.reshape(g, (b, -1)) ** 2, axis=1) for g in grads))


def reference_clipped_mean(
    grads: Sequence[np.ndarray], *, l2_norm_clip: float, expected_batch_size: float
) -> list[np.ndarray]:
    """``sum_i clip(g_i, C) / expected_batch_size`` with flat (global-norm) clipping.

    Privacy:
      Test-only reference for the noise-free part of a DP-SGD step.
    """
    norms = reference_per_example_norms(grads)
    factors = np.minimum(1.0, l2_norm_clip / np.maximum(norms, 1e-12))
    return [np.tensordot(factors, g, axes=1) / float(expected_batch_size) for g in grads]


def reference_input_gradients(
    model: Any,
    loss: Any,
    x: Any,
    y: Any,
    *,
    sample_weight: Any = None,
    training: bool = False,
) -> Any:
    """Per-example gradients of each example's loss w.r.t. its own input, same structure as ``x``.

    Privacy:
      Test-only reference.
    """
    b = int(tf.shape(tf.nest.flatten(x)[0])[0])
    sw = np.ones(b, np.float32) if sample_weight is None else np.asarray(sample_weight, np.float32)
    rows = []
    for i in range(b):
        _, xg = _loss_and_grads(model, loss, x, y, i, float(sw[i]), [], training, True)
        rows.append(tf.nest.map_structure(lambda t: np.asarray(t)[0], xg))
    return tf.nest.map_structure(lambda *r: np.stack(r), *rows)


# On typical (non-cancelling) data a certified bound exceeds the exact squared norm by a few float32
# roundoffs times the layer widths (see dpcore.norms); more than this is a loose bound worth a look.
NORM_BOUND_SLACK = 1e-3


def assert_sq_norm_bound(
    bound: Any,
    reference: Any,
    *,
    rtol: float = 1e-5,
    atol: float = 0.0,
    slack: float = NORM_BOUND_SLACK,
    err_msg: str = "",
) -> None:
    """Asserts that ``bound`` is a certified, tight bound of the exact squared norms ``reference``.

    ``bound >= reference * (1 - rtol) - atol`` (never an underestimate, up to the reference's own
    float32 error), and ``bound <= reference * (1 + slack) + atol`` (not loose on typical data).
    Use it to test a user rule's ``sq_norm`` against :func:`reference_per_example_gradients`.

    Raises:
      AssertionError: naming the worst entry.

    Privacy:
      A test aid, not a proof: passing on sample data does not certify a bound, which must hold
      for every finite input (:mod:`dpcore.norms`). An underestimate fails because a clip factor
      taken from it would let an example contribute more than ``C``.
    """
    bound = np.asarray(bound, np.float64)
    reference = np.asarray(reference, np.float64)
    low = reference * (1.0 - rtol) - atol
    high = reference * (1.0 + slack) + atol
    under = np.argwhere(bound < low)
    if under.size:
        i = tuple(under[0])
        raise AssertionError(
            f"{err_msg}: bound {bound[i]!r} is below the reference {reference[i]!r} at {i} "
            f"({len(under)} entries): not an upper bound"
        )
    over = np.argwhere(bound > high)
    if over.size:
        i = tuple(over[0])
        raise AssertionError(
            f"{err_msg}: bound {bound[i]!r} exceeds the reference {reference[i]!r} at {i} by more "
            f"than the slack {slack} ({len(over)} entries)"
        )
