"""Activity regularizers' penalties, per example, as Keras adds them.

Contract: Keras's ``Layer.__call__`` adds, for every tensor output ``h`` of a layer that has an
``activity_regularizer`` ``r``, the loss ``r(h)`` divided by the batch size ``h.shape[0]`` to
``model.losses``, which its training loss adds to the compiled loss. For ``r`` an exact
``keras.regularizers.L1``, ``L2`` or ``L1L2`` (a sum over every entry of ``h``), ``r(h)`` is the
sum over the rows ``h_i`` of ``r(h_i)``, so the batch's term is the mean over the examples of
``r(h_i)``, and plain Keras's training loss is the mean over the examples of ``loss_i + sum of
r(h_i)`` over the regularized outputs: that sum is what this module adds to each example's loss,
before clipping. As in Keras, it is not multiplied by the example's sample weight (Keras weights
the compiled loss only); padding rows (mask 0) get none, and with privacy units of several rows
a unit gets the sum of its real rows' penalties (``group_reduction="sum"``) or their mean
(``"mean"``), as it gets its rows' losses.

The engine paths bypass ``Layer.__call__`` for the layers a rule computes (:mod:`dpcore.engine.
ghost`), and on a batch of one row (:mod:`dpcore.engine.vectorized`) they must not take Keras's
scalar for a per-example one; so, while a path runs the forward pass inside :func:`capture`, each
regularized layer's ``activity_regularizer`` is a stand-in that records ``r(h_i)`` per row and
hands Keras a zero (it then adds a zero to ``model.losses``), and a rule's output is recorded with
:meth:`Sink.add_outputs`. Outside :func:`capture` (and on threads without one) the stand-in is the
regularizer itself; it is swapped back when the last capture of the layer ends.

:func:`check` refuses, before any step, what cannot be split by example: a regularizer that is
not one of the three classes above (a custom callable or a subclass could penalize, say, the batch
mean of ``h``), a regularized output whose leading axis is not the batch (checked by tracing the
model on a batch of an unusual size), a regularizer on a whole ``Sequential`` or ``Functional``
model (the fast path replays its layers, not its ``__call__``), and a Keras that adds ``r(h)``
undivided by the batch size (Keras 3.6 does: each example's share would then be the realized
batch size times ``r(h_i)``, which depends on the other examples).

Privacy:
  Each example's penalty is a function of its own rows of the layer outputs, added to its own
  loss before its gradient is clipped: it changes no sensitivity. A penalty that could mix
  examples is refused, never trusted.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from dpcore import validation
from dpcore.engine.summary import batch_signature, probe_rows, unit_weights

__all__ = [
    "Sink",
    "activity_weights",
    "add_penalties",
    "capture",
    "check",
    "penalty_factors",
    "regularized_layers",
    "regularizer_of",
    "weights_for",
]

# Sums over every entry of their argument, hence over its rows: the only regularizers split.
_PER_ROW = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)
_LOCK = threading.Lock()
_LOCAL = threading.local()  # .sinks: this thread's captures, innermost last
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_KEYS_PER_MODEL = 16


class _StandIn:
    """A layer's ``activity_regularizer`` while a capture of it is open (see the module)."""

    def __init__(self, layer: Any, original: Any) -> None:
        self.layer = weakref.ref(layer)
        self.original = original
        self.users = 0

    def __call__(self, output: Any) -> Any:
        sinks = getattr(_LOCAL, "sinks", None)
        if not sinks:
            return self.original(output)
        return sinks[-1].keras_call(self.layer(), output)


def _original(layer: Any) -> Any:
    regularizer = getattr(layer, "activity_regularizer", None)
    return regularizer.original if isinstance(regularizer, _StandIn) else regularizer


def regularizer_of(layer: Any) -> Any:
    """``layer``'s ``activity_regularizer`` as its user set it (never the stand-in of an open
    :func:`capture`), or None."""
    return _original(layer)


def regularized_layers(model: Any) -> list[tuple[str, Any]]:
    """``(path, layer)`` for every layer under ``model`` (itself included) with an
    ``activity_regularizer``."""
    return [
        (p, layer) for p, layer in validation.walk_layers(model) if _original(layer) is not None
    ]


def penalty_factors(regularizer: Any) -> tuple[float, float]:
    """``(l1, l2)`` of an exact L1, L2 or L1L2 (0 for a factor it lacks), as the penalty reads."""
    l1 = float(getattr(regularizer, "l1", 0.0) or 0.0)
    l2 = float(getattr(regularizer, "l2", 0.0) or 0.0)
    return l1, l2


def per_row_penalty(regularizer: Any, output: Any) -> tf.Tensor:
    """``[rows]`` float32: ``regularizer`` (an exact L1, L2 or L1L2) of each row of ``output``."""
    h = tf.cast(output, tf.float32)
    axes = list(range(1, h.shape.rank))
    total = tf.zeros(tf.shape(h)[:1], tf.float32)
    l1, l2 = penalty_factors(regularizer)
    if l1:
        total += l1 * tf.reduce_sum(tf.abs(h), axis=axes)
    if l2:
        total += l2 * tf.reduce_sum(tf.square(h), axis=axes)
    return total


class Sink:
    """The per-row activity penalties recorded during one forward pass (see :func:`capture`)."""

    def __init__(self, scope: Any = None) -> None:
        self.terms: list[tf.Tensor] = []
        self.shapes: list[tuple[Any, tf.TensorShape]] = []  # (layer, output shape)
        self.scope = scope  # a keras.StatelessScope collecting losses, or None
        self.keras_indices: list[int] = []  # where Keras put our zeros in scope.losses

    def keras_call(self, layer: Any, output: Any) -> Any:
        """What ``Layer.__call__`` gets from the stand-in: a zero (the penalty is recorded)."""
        if self.scope is not None:
            self.keras_indices.append(len(self.scope.losses))  # Keras adds our term next
        self.add(layer, output)
        dtype = output.dtype if output.dtype.is_floating else tf.float32
        return tf.zeros([], dtype)

    def add(self, layer: Any, output: Any) -> None:
        self.shapes.append((layer, output.shape))
        if output.shape.rank:
            self.terms.append(per_row_penalty(_original(layer), output))

    def add_outputs(self, layer: Any, outputs: Any) -> None:
        """Records the penalty of ``layer``'s outputs computed without its ``__call__``."""
        if _original(layer) is None:
            return
        for t in tf.nest.flatten(outputs):
            if tf.is_tensor(t):
                self.add(layer, t)

    def per_row(self, rows: Any) -> tf.Tensor | None:
        """``[rows]`` float32: each row's summed penalty, or None when nothing was recorded.

        Raises:
          ValueError: for a penalty whose static row count is not ``rows`` (:func:`check`
            refuses such outputs before a step; this guards a caller that did not check).
        """
        if not self.terms:
            return None
        static = tf.get_static_value(rows)
        for t in self.terms:
            if static is not None and t.shape[0] is not None and t.shape[0] != int(static):
                raise ValueError(
                    f"dpcore: an activity-regularized output has {t.shape[0]} rows in a batch of "
                    f"{int(static)}; its penalty cannot be split by example."
                )
        return tf.add_n(self.terms)


@contextlib.contextmanager
def capture(model: Any, *, scope: Any = None) -> Iterator[Sink]:
    """Records the activity penalties of the forward passes run inside it, on this thread.

    Args:
      model: the model whose regularized layers are captured.
      scope: a ``keras.StatelessScope(collect_losses=True)`` the forward pass runs in, if any:
        the sink then lists where Keras put the zeros it was handed (``keras_indices``), so that
        the caller can leave them out of ``scope.losses``.

    Yields:
      A :class:`Sink`.
    """
    sink = Sink(scope)
    layers = [layer for _, layer in regularized_layers(model)]
    if not layers:
        yield sink
        return
    with _LOCK:
        for layer in layers:
            current = layer.activity_regularizer
            if not isinstance(current, _StandIn):
                current = _StandIn(layer, current)
                layer.activity_regularizer = current
            current.users += 1
    stack = _LOCAL.__dict__.setdefault("sinks", [])
    stack.append(sink)
    try:
        yield sink
    finally:
        stack.pop()
        with _LOCK:
            for layer in layers:
                current = layer.activity_regularizer
                if isinstance(current, _StandIn):
                    current.users -= 1
                    if current.users <= 0:
                        layer.activity_regularizer = current.original


def activity_weights(mask: tf.Tensor, *, group_size: int, group_reduction: str) -> tf.Tensor:
    """``[B]`` float32 weight of each row's penalty: 1 for a real row, 0 for padding, divided by
    the unit's number of real rows for ``group_reduction="mean"`` (as its rows' losses are)."""
    real = tf.cast(tf.cast(mask, tf.float32) > 0, tf.float32)
    return unit_weights(real, real, group_size=group_size, group_reduction=group_reduction)


@functools.cache
def _keras_divides_by_batch_size() -> bool:
    """Whether this Keras divides an activity penalty by the batch size (3.6 does not)."""
    with tf.init_scope():
        # Named, so that it takes no automatic layer name from the user's models.
        layer = keras.layers.Activation(
            "linear",
            activity_regularizer=keras.regularizers.L1(1.0),
            name="dpcore_activity_division_probe",
        )
        with keras.StatelessScope(collect_losses=True) as scope:
            layer(tf.ones([2, 1]))
        return bool(abs(float(tf.add_n(list(scope.losses))) - 1.0) < 1e-6)


def check(model: Any, x: Any, *, training: Any) -> bool:
    """Whether ``model`` has activity regularizers (True), after refusing those that cannot be
    split by example (see the module contract). Cached per model, layers, inputs and mode.

    Raises:
      ValueError: one line naming the layer and the way out.
    """
    found = regularized_layers(model)
    if not found:
        return False
    for path, layer in found:
        regularizer = _original(layer)
        if type(regularizer) not in _PER_ROW:
            raise ValueError(
                f"dpcore: layer {path!r} has activity_regularizer={regularizer!r}, which dpcore "
                "cannot split by example (it could mix the examples of a batch); use "
                "keras.regularizers.L1, L2 or L1L2, or add the penalty to each example's loss."
            )
        if isinstance(layer, keras.Model):
            raise ValueError(
                f"dpcore: model {path!r} has an activity_regularizer of its own; set it on the "
                "layer that computes the output instead."
            )
    if not _keras_divides_by_batch_size():
        raise ValueError(
            f"dpcore: layer {found[0][0]!r} has an activity_regularizer, and this Keras "
            f"({keras.version()}) adds its penalty of the whole batch without dividing it by the "
            "batch size, so an example's share depends on the other examples; use a Keras that "
            "divides it (3.15 does) or remove the activity_regularizer."
        )
    mode = True if tf.is_tensor(training) else bool(training)
    layers = [layer for _, layer in validation.walk_layers(model)]
    key = (tuple(map(id, layers[1:])), batch_signature(x), mode)
    cache = _CHECKED.setdefault(model, {})
    if cache.get(key) is not None and all(a is b for a, b in zip(cache[key], layers[1:])):
        return True
    _check_rows_first(model, x, mode, found)
    if len(cache) >= _MAX_KEYS_PER_MODEL:
        cache.clear()
    cache[key] = tuple(layers[1:])
    return True


def _check_rows_first(model: Any, x: Any, training: bool, found: list[tuple[str, Any]]) -> None:
    """Traces the model (nothing runs) on a batch of an unusual size ``R``: every regularized
    output must have ``R`` as its first dimension and as no other."""
    rows = probe_rows([x], model.trainable_variables, start=1_000_003)
    leaves = tf.nest.flatten(x)
    specs = [tf.TensorSpec([rows, *tf.TensorShape(t.shape).as_list()[1:]], t.dtype) for t in leaves]
    names = {id(layer): path for path, layer in found}
    seen: list[tuple[Any, tf.TensorShape]] = []

    def trace(*flat: tf.Tensor) -> tf.Tensor:
        with capture(model) as sink:
            model(tf.nest.pack_sequence_as(x, list(flat)), training=training)
        seen.extend(sink.shapes)
        return tf.zeros([])

    try:
        with tf.init_scope():
            tf.function(trace, autograph=False).get_concrete_function(*specs)
    except Exception as err:  # noqa: BLE001 - a model that cannot be traced so is not verified
        raise ValueError(
            f"dpcore: the model has activity regularizers (layer {found[0][0]!r}) and whether "
            "each example's penalty comes from its own rows could not be checked (tracing it "
            f"on {rows} rows failed: {type(err).__name__}); remove the activity_regularizer or "
            "add the penalty to each example's loss."
        ) from err
    for layer, shape in seen:
        dims = shape.as_list() if shape.rank is not None else None
        if not dims or dims[0] != rows or rows in dims[1:]:
            shown = None if dims is None else ["B" if d == rows else d for d in dims]
            raise ValueError(
                f"dpcore: layer {names.get(id(layer), layer.name)!r} has an activity_regularizer "
                f"on an output whose first axis is not the batch (shape {shown}, B the batch), "
                "so its penalty cannot be split by example; regularize an output with one row "
                "per example, or add the penalty to each example's loss."
            )


def weights_for(model: Any, x: Any, mask: tf.Tensor, options: Any) -> tf.Tensor | None:
    """The ``[B]`` weights of the rows' penalties (:func:`activity_weights` under ``options``,
    an :class:`~dpcore.ExecutionOptions`), or None for a model without activity regularizers.

    Raises:
      ValueError: for what :func:`check` refuses.
    """
    if not check(model, x, training=options.training):
        return None
    return activity_weights(
        mask, group_size=options.group_size, group_reduction=options.group_reduction
    )


def add_penalties(per_example_loss: tf.Tensor, sink: Sink, weights: tf.Tensor | None) -> tf.Tensor:
    """``[B]`` losses plus each row's recorded penalty times its weight (exactly 0 at weight 0)."""
    if weights is None:
        return per_example_loss
    penalty = sink.per_row(tf.shape(weights)[0])
    if penalty is None:
        return per_example_loss
    return per_example_loss + tf.where(weights != 0, weights * penalty, tf.zeros_like(penalty))
