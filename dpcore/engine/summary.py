"""The engine's output type and batch preparation shared by every engine path.

Contract: an engine path (vectorized or fast) turns one batch into a :class:`GradientSummary`:
per-example squared gradient norms for each variable, and a way to form weighted sums of the
per-example gradients without the caller ever seeing them. Masked examples have zero loss, zero
norm and zero weight. Everything here runs inside the caller's compiled step.

Privacy units of several rows (``ExecutionOptions.group_size = K``): rows ``[u*K, (u+1)*K)`` form
unit ``u``; the summary's per-example quantities (norms, losses, mask, weights) are then per unit,
while predictions and input gradients stay per row. :func:`to_units`, :func:`unit_mask` and
:func:`unit_weights` are the shared layout helpers.
"""

from __future__ import annotations

import codecs
import dataclasses
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from dpcore import norms
from dpcore.engine import graph
from dpcore.options import NONFINITE_MODES


@dataclasses.dataclass(frozen=True)
class GradientSummary:
    """Per-example gradient information for one batch.

    Attributes:
      variables: the variables the gradients are taken with respect to, in order.
      sq_norms: ``[B, V]`` float64: a certified upper bound (:mod:`dpcore.norms`) of the squared
        L2 norm of example ``i``'s gradient for variable ``v``, covering what the example adds
        through ``weighted_sum`` (zero for masked examples).
      per_example_loss: ``[B]`` loss of each example, sample weight applied, zero where masked.
      mask: ``[B]`` float32, 1.0 for real examples and 0.0 for padding or skipped examples.
      y_pred: the model's output on the batch.
      weighted_sum: ``weights [B, V] -> [sum_i weights[i, v] * grad_i[v] for v]``. Callers pass
        clip factors here; no per-example gradient leaves the engine.
      input_gradients: per-example gradients of each example's loss w.r.t. the inputs (same
        structure as ``x``), or None when not requested.
      paths: for reporting, a mapping from layer (or variable) name to the path that computed it.
      num_skipped: float32 count of real (unmasked) examples dropped by ``nonfinite="skip"``
        (non-finite inputs, labels, weights, loss or gradient); set by
        :func:`dpcore.engine.summarize`.
      row_mask: with privacy units of several rows, the ``[rows]`` mask of the rows that took part
        (``mask`` is then per unit); None when every row is its own unit.
      sum_errors: ``[B, V]`` float64, or None for zeros: how far what example ``i`` adds through
        ``weighted_sum`` for variable ``v`` with a weight ``w <= 1`` can be from ``w`` times a
        gradient within ``sq_norms``, an absolute error that does not shrink with ``w`` (a
        flushed ``w g`` inside a product, :func:`dpcore.norms.outer_sum_error`; ~1e-37 times the
        activations). :func:`dpcore.aggregation.clip` subtracts it from ``C``.

    With ``group_size = K`` every "example" above is a unit of ``K`` rows: ``sq_norms`` is
    ``[U, V]``, ``per_example_loss`` and ``mask`` are ``[U]`` and ``weighted_sum`` takes ``[U, V]``.

    Privacy:
      Nothing here is private: it is the raw batch's per-example data. Row ``i`` of ``sq_norms``,
      ``sum_errors``, ``per_example_loss`` and ``mask`` depends on example (unit) ``i`` alone,
      which lets a clip factor bound each example's contribution; only clip-weighted sums from
      ``weighted_sum``, once noised (:func:`dpcore.aggregation.privatize`), may leave the step.
    """

    variables: tuple[Any, ...]
    sq_norms: tf.Tensor
    per_example_loss: tf.Tensor
    mask: tf.Tensor
    y_pred: Any
    weighted_sum: Callable[[tf.Tensor], list[tf.Tensor]]
    input_gradients: Any = None
    paths: dict[str, str] = dataclasses.field(default_factory=dict)
    num_skipped: Any = None
    row_mask: Any = None
    sum_errors: Any = None


def to_units(t: tf.Tensor, group_size: int) -> tf.Tensor:
    """``[U*K, ...] -> [U, K, ...]``: the rows of each privacy unit along axis 1."""
    t = tf.convert_to_tensor(t)
    return tf.reshape(t, tf.concat([[-1, group_size], tf.shape(t)[1:]], 0))


def from_units(t: tf.Tensor) -> tf.Tensor:
    """``[U, K, ...] -> [U*K, ...]`` (the inverse of :func:`to_units`)."""
    return tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))


def unit_mask(mask: tf.Tensor, group_size: int) -> tf.Tensor:
    """``[U]`` float32: 1 for a unit with at least one real row, 0 for an all-padding unit."""
    if group_size == 1:
        return tf.cast(mask, tf.float32)
    return tf.reduce_max(to_units(tf.cast(mask, tf.float32), group_size), axis=1)


def unit_weights(
    sample_weight: tf.Tensor, mask: tf.Tensor, *, group_size: int, group_reduction: str
) -> tf.Tensor:
    """Row sample weights that make each unit's loss the sum or the mean of its rows' losses.

    ``"mean"`` divides the weights of unit ``u``'s rows by its number of real rows ``n_u`` (1 for
    an all-padding unit), so the unit's gradient is the average of its real rows' gradients.

    Privacy:
      ``n_u`` depends on unit ``u`` alone, and the unit's gradient is clipped as a whole.
    """
    if group_size == 1 or group_reduction == "sum":
        return sample_weight
    real = tf.reduce_sum(to_units(tf.cast(mask > 0, tf.float32), group_size), axis=1)
    return sample_weight / tf.repeat(tf.maximum(real, 1.0), group_size)


def check_group_layout(x: Any, group_size: int) -> None:
    """Refuses a batch whose size is not a multiple of ``group_size`` (statically when known)."""
    if group_size == 1:
        return
    static_b = tf.convert_to_tensor(tf.nest.flatten(x)[0]).shape[0]
    if static_b is not None and static_b % group_size:
        raise ValueError(
            f"batch size {static_b} is not a multiple of group_size={group_size}: units of "
            "several rows are contiguous blocks of exactly group_size rows (pad with masked rows)."
        )
    if static_b is None:
        tf.debugging.assert_equal(
            batch_size_of(x) % group_size,
            0,
            message=f"dpcore: the batch size must be a multiple of group_size={group_size}",
        )


def batch_size_of(x: Any) -> tf.Tensor:
    """The dynamic batch size of a (possibly nested) input."""
    return tf.shape(tf.nest.flatten(x)[0])[0]


def _shaped(t: Any) -> bool:
    return t is not None and (tf.is_tensor(t) or hasattr(t, "shape"))


def batch_signature(x: Any) -> tuple:
    """Each leaf's shape without the batch axis and its dtype (other leaves by ``repr``): the
    key of checks that run once per input signature, whatever the batch size."""
    return tuple(
        (tuple(tf.TensorShape(t.shape).as_list()[1:]), tf.as_dtype(t.dtype).name)
        if _shaped(t)
        else repr(t)
        for t in tf.nest.flatten(x)
    )


def probe_rows(trees: Sequence[Any], variables: Sequence[Any], *, start: int) -> int:
    """The first of ``start, start + 2, ...`` equal to no static non-batch dimension of the
    leaves of ``trees`` and to no dimension of ``variables``: a batch size for a probe run whose
    batch axis cannot be mistaken for another axis."""
    static = {
        d
        for t in tf.nest.flatten(list(trees))
        if _shaped(t)
        for d in tf.TensorShape(t.shape).as_list()[1:]
        if d is not None
    }
    static |= {d for v in variables for d in v.shape if d is not None}
    rows = start
    while rows in static:
        rows += 2
    return rows


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


# The one-line error of a batch with NaN or Inf in a real row, as the step raises it (also the
# assertion message inside a compiled step, where TensorFlow escapes quotes: hence none here).
# :func:`readable_error` reads the field and the row back from it.
NONFINITE_INPUT = (
    "dpcore: NaN or Inf in {field} at row {row} of the batch: fix or remove that example, or "
    "pass ExecutionOptions with nonfinite set to skip to drop such examples"
)
_NONFINITE_INPUT_RE = re.compile(
    r"dpcore: NaN or Inf in (?P<field>.+?) at row (?P<row>\d+) of the batch"
)


def _leaves_with_paths(structure: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(path, leaf)`` for each leaf of ``structure`` in ``tf.nest.flatten`` order (dict keys
    sorted, namedtuple fields and sequence items in order). Written here because
    ``keras.tree.flatten_with_path`` is missing from the oldest Keras that dpcore supports."""
    if isinstance(structure, Mapping):
        keys = sorted(structure)
        children = [structure[key] for key in keys]
    elif isinstance(structure, tuple) and hasattr(structure, "_fields"):
        keys, children = list(structure._fields), list(structure)
    elif isinstance(structure, (list, tuple)):
        keys, children = list(range(len(structure))), list(structure)
    else:
        return [((), structure)]
    return [
        ((key, *path), leaf)
        for key, child in zip(keys, children)
        for path, leaf in _leaves_with_paths(child)
    ]


def field_names(structure: Any, name: str) -> list[str]:
    """The name of each leaf of ``structure`` in ``tf.nest.flatten`` order, for errors: ``name``
    itself for a tensor, ``name[key]`` / ``name[0]`` for the leaves of dicts and sequences."""
    return [name + "".join(f"[{key}]" for key in path) for path, _ in _leaves_with_paths(structure)]


def _check_rows(
    bad: tf.Tensor, fields: Sequence[str], template: str, value: tf.Tensor
) -> tf.Tensor:
    """``value``, once no row is bad; else the step fails with ``template`` formatted with the
    first field (in ``fields`` order) that has a bad row and that field's first bad row.

    ``bad`` is ``[len(fields), B]`` bool. Eagerly the error is raised at once; in a graph an
    assertion that every later op depends on fails the step, its message formatted only then.
    Traced for XLA, which drops assertions, nothing is checked.
    """
    if tf.executing_eagerly():
        flags = bad.numpy()
        if flags.any():
            field = int(flags.any(axis=1).argmax())
            row = int(flags[field].argmax())
            message = template.format(field=fields[field], row=row)
            raise tf.errors.InvalidArgumentError(None, None, message)
        return value

    from dpcore.rules.base import tracing_for_xla  # at trace time: rules import the engine

    if tracing_for_xla():
        # XLA drops assertions (the public entry points refuse it, see
        # dpcore.validation.check_not_compiled_by_xla) and compiles no string ops.
        return value

    def fail() -> tf.Tensor:
        field = tf.argmax(tf.cast(tf.reduce_any(bad, 1), tf.int32), output_type=tf.int32)
        row = tf.argmax(tf.cast(tf.gather(bad, field), tf.int32), output_type=tf.int32)
        values = {
            "{field}": lambda: tf.gather(tf.constant(list(fields)), field),
            "{row}": lambda: tf.strings.as_string(row),
        }
        pieces = re.split(r"(\{field\}|\{row\})", template)
        message = tf.strings.join([values[p]() if p in values else p for p in pieces if p])
        check = tf.debugging.Assert(False, [message])
        with tf.control_dependencies([check]):
            return tf.constant(False)

    checked = tf.cond(tf.reduce_any(bad), fail, lambda: tf.constant(True))
    # A control dependency, not a data one: a constant value (the all-ones mask of a batch
    # without one) stays constant for the graph optimizer, as it was behind a plain assertion.
    with tf.control_dependencies([checked]):
        return tf.identity(value)


def readable_error(error: Exception, call: str, arguments: dict[str, Any]) -> ValueError | None:
    """The one-line ``ValueError`` for a step that a dpcore check failed, else None.

    ``error`` is what ``fit``/``evaluate`` raised (a ``tf.errors.InvalidArgumentError`` whose
    message carries a dpcore assertion, e.g. TensorFlow's multi-line graph error); ``arguments``
    are that call's arguments by name. For NaN or Inf in a batch, the row is looked up in the
    arrays given to ``call`` (``x``, ``y``, ``sample_weight``, then ``validation_data``) and named
    as a row of that data; for a dataset it stays the row of the batch.

    Privacy:
      The message names a row of the training data and the field that is not finite: an output
      of the data for the operator who runs the training, not part of the released model (no
      privacy guarantee covers it, as none covers the logged loss).
    """
    message = getattr(error, "message", str(error))
    found = re.search(r"assertion failed: \[(dpcore: [^\n]*)\]", message)
    if found is not None:  # a graph's assertion: TensorFlow escaped its text
        sentence = codecs.escape_decode(found.group(1).encode())[0].decode("utf-8", "replace")
    elif message.startswith("dpcore: "):  # raised eagerly
        sentence = message.splitlines()[0]
    else:
        return None
    nonfinite = _NONFINITE_INPUT_RE.search(sentence)
    if nonfinite is None:
        return ValueError(sentence)
    field, row = nonfinite.group("field"), int(nonfinite.group("row"))
    validation = arguments.get("validation_data")
    sources = [(f"the data given to {call}", arguments)]
    if isinstance(validation, (tuple, list)):
        sources.append(("validation_data", dict(zip(("x", "y", "sample_weight"), validation))))
    for source, given in sources:
        located = _locate(field, given)
        if located is not None:
            field, where = located[0], f"row {located[1]} of {source}"
            break
    else:  # keys as Python writes them (the assertion's text has no quotes)
        field = re.sub(r"\[([^\]\d][^\]]*)\]", lambda key: f"[{key.group(1)!r}]", field)
        where = f"row {row} of a batch"
    return ValueError(
        f"dpcore: NaN or Inf in {field} at {where}: fix or remove that example, or pass "
        "options=dpcore.ExecutionOptions(nonfinite='skip') (to make_private or DPModel) to drop "
        "such examples."
    )


def _locate(field: str, given: dict[str, Any]) -> tuple[str, int] | None:
    """``(field as Python writes it, first row with NaN or Inf)`` in the arrays ``given`` by
    name, for the leaf that :func:`field_names` calls ``field``; None where it is not found there
    or has no such row (a dataset, or a value that overflowed only when cast)."""
    for name in ("x", "y", "sample_weight"):
        if given.get(name) is None or not field.startswith(name):
            continue
        for path, leaf in _leaves_with_paths(given[name]):
            if name + "".join(f"[{key}]" for key in path) != field:
                continue
            try:
                values = np.asarray(leaf)
            except Exception:  # not an array (a dataset, a generator)
                return None
            if values.ndim == 0 or values.dtype.kind not in "fc":
                return None
            bad = ~np.isfinite(values.reshape(values.shape[0], -1)).all(axis=1)
            if not bad.any():
                return None
            return name + "".join(f"[{key!r}]" for key in path), int(bad.argmax())
    return None


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
      nonfinite: ``"raise"`` fails the step on NaN/Inf in a real row of ``x``, ``y`` or
        ``sample_weight`` (:data:`NONFINITE_INPUT`: one line naming the field, e.g. ``x[image]``
        for a dict input, and the first such row of the batch; raised at once when eager, else
        by an assertion that every later op, and so every update, depends on); ``"skip"`` masks
        such examples out (their inputs and weights are zeroed so nothing non-finite reaches the
        weights).

    Returns:
      The batch with float32 ``sample_weight`` and ``mask`` of shape ``[B]``.

    Privacy:
      Skipping is decided per example from that example's own values, so it does not change the
      sensitivity of the clipped sum. The error of ``"raise"`` names a field and a row of the
      (sensitive) batch: a data-dependent output to the operator running the step, like the
      logged loss, not part of the released model, and no privacy guarantee covers it.
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
    mask = _check_mask(mask, b)
    sample_weight = (
        tf.ones([b], tf.float32)
        if sample_weight is None
        else tf.cast(tf.reshape(sample_weight, [-1]), tf.float32)
    )
    fields = [*field_names(x, "x"), *field_names(y, "y"), "sample_weight"]
    leaves = tf.nest.flatten(x) + tf.nest.flatten(y)
    finite_by_field = tf.stack(
        [*(_all_finite_rows(t) for t in leaves), tf.math.is_finite(sample_weight)], 0
    )
    if nonfinite == "raise":
        # Everything downstream (and so every weight update) depends on the check having passed.
        mask = _check_rows(
            tf.logical_not(finite_by_field) & (mask > 0)[None, :],
            fields,
            NONFINITE_INPUT,
            mask,
        )
    else:
        mask = mask * tf.cast(tf.reduce_all(finite_by_field, 0), tf.float32)
    # Padded and skipped rows are zeroed so that their (zero-weighted) gradients stay finite.
    return drop_rows(x, y, sample_weight, mask, mask > 0)


def drop_rows(
    x: Any, y: Any, sample_weight: tf.Tensor, mask: tf.Tensor, keep: tf.Tensor
) -> tuple[Any, Any, tf.Tensor, tf.Tensor]:
    """The batch with the rows where ``keep`` is False zeroed (inputs, labels, weight) and masked."""
    x = tf.nest.map_structure(lambda t: _zero_rows(t, keep), x)
    y = tf.nest.map_structure(lambda t: _zero_rows(t, keep), y)
    sample_weight = tf.where(keep, sample_weight, tf.zeros_like(sample_weight))
    return x, y, sample_weight, mask * tf.cast(keep, mask.dtype)


def weighted_loss(loss_fn: Callable, y: Any, y_pred: Any, weights: tf.Tensor) -> tf.Tensor:
    """``[B]`` per-example losses times ``weights``, exactly 0 (value and gradient) where a weight is 0.

    A zero-weight row (padding, or a row dropped as non-finite) may still have a non-finite loss on
    its zeroed inputs (``log(0)``); ``0 * inf`` would put NaN into its value and, through the
    backward pass, into its gradients. The row's predictions are cut from the backward pass and
    its loss replaced by 0 instead. The Keras mask of a prediction (masked sequence outputs) is
    kept, so the loss applies it as Keras's compiled loss does (:mod:`dpcore.losses`).
    """
    keep = weights != 0
    y_pred = tf.nest.map_structure(lambda t: _cut_rows(keep, t), y_pred)
    loss = tf.cast(loss_fn(y, y_pred), tf.float32)
    return tf.where(keep, loss * weights, tf.zeros_like(loss))


def _cut_rows(keep: tf.Tensor, t: Any) -> Any:
    """``t`` with the rows where ``keep`` is False cut from the backward pass, its mask kept."""
    if not t.dtype.is_floating:
        return t
    out = _select_rows(keep, t, tf.stop_gradient(t))
    mask = graph.keras_mask(t)
    if mask is not None:
        graph.set_mask(out, mask)
    return out


def zero_rows(structure: Any, keep: tf.Tensor, *, finite: Collection[int] = ()) -> Any:
    """``structure`` with every floating tensor of rank >= 1 selected to 0 where ``keep`` is False.

    For the rows of a batch that contribute nothing (padding, zero weight, dropped): a select, not
    a product, so a row whose values are not finite (e.g. ``0/0`` from a masked average over a
    fully masked padding row) becomes exactly 0 and cannot reach a sum as ``0 * NaN``. Every
    tensor of rank >= 1 must have the rows as its leading axis; other values pass through, and so
    do the tensors whose ``id`` is in ``finite`` (finite on every row, e.g. the batch as
    :func:`prepare_batch` returns it: a product with the zero output gradients of those rows is
    then 0, and the select would only cost time).
    """

    def zero(t: Any) -> Any:
        if not (tf.is_tensor(t) and t.shape.rank and t.dtype.is_floating) or id(t) in finite:
            return t
        rows = tf.reshape(keep, [-1] + [1] * (t.shape.rank - 1))  # static rank: two ops a tensor
        return tf.where(rows, t, tf.zeros([], t.dtype))

    return tf.nest.map_structure(zero, structure)


def _select_rows(keep: tf.Tensor, t: tf.Tensor, other: tf.Tensor) -> tf.Tensor:
    shape = tf.concat([tf.shape(keep), tf.ones([tf.rank(t) - 1], tf.int32)], 0)
    return tf.where(tf.reshape(keep, shape), t, other)


def _check_mask(mask: Any, b: tf.Tensor) -> tf.Tensor:
    """``[B]`` float32 0/1 mask; any other value fails the step (a mask of 2 would double a row),
    or, under XLA, which drops the assertion, makes the row padding."""
    if mask is None:
        return tf.ones([b], tf.float32)
    mask = tf.reshape(tf.convert_to_tensor(mask), [-1])
    if mask.dtype == tf.bool:
        return tf.cast(mask, tf.float32)
    mask = tf.cast(mask, tf.float32)
    check = tf.debugging.Assert(
        tf.reduce_all((mask == 0.0) | (mask == 1.0)),
        [
            "dpcore: mask must hold only 0 (padding) and 1 (a real example); real-valued weights "
            "belong in sample_weight, whose effect is clipped with the example"
        ],
    )
    with tf.control_dependencies([check]):
        # The same 0/1 values; where the assertion does not run (XLA drops assertions), any other
        # value is padding rather than a weight on the row's clipped gradient.
        return tf.where(tf.equal(mask, 1.0), tf.ones_like(mask), tf.zeros_like(mask))


def drop_nonfinite(
    summary: GradientSummary,
    recompute: Callable[[tf.Tensor], GradientSummary],
    *,
    nonfinite: str,
    group_size: int = 1,
) -> GradientSummary:
    """Handles examples whose loss or gradient is not finite although their inputs are.

    An example is *bad* when its loss or any of its (certified) squared norms is NaN/Inf. With
    ``nonfinite="raise"`` a bad real example fails the step before anything that depends on the
    summary runs; with ``"skip"`` it is dropped: zero norm, zero loss, mask 0, and the clipped sums
    of a batch with bad rows (padding rows included) are recomputed by ``recompute`` on the batch
    with those rows zeroed and masked, so that no ``0 * Inf`` reaches a sum; batches without bad
    rows never run it (a ``tf.cond``).

    Args:
      summary: the engine path's summary of the batch.
      recompute: ``keep [B] bool -> GradientSummary`` of the batch with ``~keep`` rows zeroed and
        masked (only its ``weighted_sum`` is used).
      nonfinite: ``"raise"`` or ``"skip"``.
      group_size: rows per privacy unit (the summary's rows are then units; the input gradients
        stay per row).

    Returns:
      The summary with bad rows dropped (``"skip"``), or checked (``"raise"``).

    Privacy:
      Whether an example is dropped depends on that example alone, so dropping does not change the
      sensitivity of the clipped sum; a dropped example contributes exactly zero.
    """
    sq = summary.sq_norms
    loss = summary.per_example_loss
    ok = tf.math.is_finite(tf.cast(loss, tf.float32)) & tf.reduce_all(tf.math.is_finite(sq), 1)
    real = summary.mask > 0
    if nonfinite == "raise":
        where = "row {row}" if group_size == 1 else "privacy unit {row}"
        ok = _check_rows(
            (tf.logical_not(ok) & real)[None, :],
            ["loss"],
            f"dpcore: the loss or the gradient of an example is NaN/Inf ({where} of the batch) "
            "although its inputs are finite (e.g. log(0) in the loss, or activations that "
            "overflow float32); the step was not applied. Make the loss finite, or pass "
            "ExecutionOptions with nonfinite set to skip to drop such examples",
            ok,
        )
    any_bad = tf.logical_not(tf.reduce_all(ok))
    keep = ok[:, None]
    kept_sq = tf.where(keep, sq, tf.zeros_like(sq))  # the returned norms: dropped rows are 0

    def weighted_sum(weights: tf.Tensor) -> list[tf.Tensor]:
        if nonfinite == "raise":
            # No real row is bad (checked above); a bad padding row (a layer that is not finite on
            # zeroed inputs) surfaces as a non-finite sum, which the optimizer refuses before any
            # update. The default path thus pays no branch.
            return list(summary.weighted_sum(weights))

        def again() -> list[tf.Tensor]:
            second = recompute(ok)  # a new forward pass: its own norms bound its own sums
            return list(second.weighted_sum(second_pass_weights(weights, kept_sq, second.sq_norms)))

        return tf.cond(any_bad, again, lambda: list(summary.weighted_sum(weights)))

    input_gradients = summary.input_gradients
    if input_gradients is not None:
        ok_rows = tf.repeat(ok, group_size) if group_size > 1 else ok
        input_gradients = tf.nest.map_structure(lambda t: _zero_rows(t, ok_rows), input_gradients)
    sum_errors = summary.sum_errors
    if sum_errors is not None:
        sum_errors = tf.where(keep, sum_errors, tf.zeros_like(sum_errors))
    return dataclasses.replace(
        summary,
        sq_norms=kept_sq,
        sum_errors=sum_errors,
        per_example_loss=tf.where(ok, loss, tf.zeros_like(loss)),
        mask=summary.mask * tf.cast(ok, summary.mask.dtype),
        weighted_sum=weighted_sum,
        input_gradients=input_gradients,
    )


def second_pass_weights(weights: tf.Tensor, sq_first: tf.Tensor, sq_second: tf.Tensor) -> tf.Tensor:
    """Clip weights for a clipped sum formed in a second pass over the batch.

    ``weights [B, V]`` were set from the first pass's certified squared norms ``sq_first [B, V]``;
    a second pass (the chunked vectorized path's sums, the non-finite recompute) may compute
    other gradients: random layers (Dropout) draw again, and reductions may round otherwise. Each
    weight is scaled by ``min(1, sqrt(sq_first / sq_second))``, ``sq_second`` the second pass's
    certified squared norms, rounded toward zero to float32, so that every example's contribution
    per variable is at most what the first pass bounded. A weight of 0 stays 0; a NaN
    ``sq_second`` under a non-zero weight gives a NaN weight (the sum is then not finite, and the
    optimizer refuses it).

    Privacy:
      Without it, Dropout redrawn in the second pass let one example's contribution reach 8e8 C:
      the factor ``C / N1`` was applied to a gradient of norm ``N2``.
    """
    sq1 = tf.cast(sq_first, tf.float64)
    sq2 = tf.cast(sq_second, tf.float64)
    ratio = tf.where(sq2 <= sq1, tf.ones_like(sq2), tf.sqrt(sq1 / sq2) * (1.0 - 2.0**-50))
    w = tf.cast(weights, tf.float64)
    # A weight of 0 (padding, a dropped record, whose first-pass norm may be NaN) stays 0.
    return norms.round_down_f32(tf.where(tf.equal(w, 0.0), w, w * ratio))


def check_variables(variables: Sequence[Any]) -> tuple[Any, ...]:
    """Rejects an empty variable list with a clear message."""
    variables = tuple(variables)
    if not variables:
        raise ValueError(
            "the model has no trainable variables (or variables=[] was passed): there is "
            "nothing to privatize."
        )
    low = [v for v in variables if tf.as_dtype(v.dtype) not in (tf.float32, tf.float64)]
    if low:
        # The clipped sum would be rounded to the variables' precision before the noise: one
        # example then moves it by C plus an ulp of the whole sum (1.033 C in bfloat16 at batch 8,
        # growing with the sum), beyond the sensitivity the noise is scaled to.
        raise ValueError(
            f"variable {low[0].path!r} is {tf.as_dtype(low[0].dtype).name}: dpcore needs float32 "
            "(or float64) trainable variables, because a clipped sum held in lower precision "
            "exceeds its sensitivity C by the rounding of the sum. Use a mixed-precision policy "
            "instead (keras.mixed_precision.set_dtype_policy('mixed_bfloat16') or "
            "'mixed_float16'): float32 variables, low-precision compute."
        )
    return variables
