"""Refusing models and losses that mix examples, by a probe on a few synthetic rows.

Contract: per-example clipping bounds one example's influence on the update only when example
``i``'s loss depends on example ``i`` alone. :mod:`dpcore.validation` refuses the layers known to
break this (a trainable ``BatchNormalization``, batch-axis settings); this module catches the
rest, whatever their form: a ``Lambda`` or Keras op that centres over the batch, a custom layer
without weights that rolls or sorts rows, a loss with in-batch negatives.

:func:`mixing_probe` runs the model eagerly, outside the caller's trace (``tf.init_scope``), on
``R`` synthetic rows (``R`` >= 3, odd, unlike any static dimension of the batch or of the
variables), in the caller's ``training`` mode, each call inside a fresh
:class:`keras.StatelessScope` (no variable changes; seed generators start from the same state,
so Dropout draws the same masks in every call):

1. twice as it is: row 0 of the outputs must come out bit for bit the same (else "not verified");
2. with some rows changed at every *site* the batch flows through (the model's inputs and the
   output of every leaf layer call, :func:`dpcore.engine.graph.run`; a model that cannot be
   replayed layer by layer has its inputs as the only site), in two directions: rows ``1..R-1``
   changed, row 0 of the outputs must come out bit for bit the same; row 0 changed, rows
   ``1..R-1`` must (a cumulative sum over the batch shows only in the second). A model that
   treats rows independently computes each row from that row alone, with the same operations on
   the same values, whatever the other rows hold, and so whatever the weights. Any difference is
   mixing; a bisection over the sites names the last one whose changed rows reach the others
   (the mixing is downstream of it);
3. the loss on the first call's outputs and labels, then on both with rows changed in the same
   two directions: the other examples' losses must stay bit for bit the same, else the loss
   mixes examples.

Changing a row: floating entries move past every value of their tensor
(``±(max |x| + 1) (2 + |N(0, 1)|)``), integers move by one, booleans flip. All of it runs from
three bases of synthetic rows, so that a maximum, minimum, "any" or "all" over the batch moves
too: integers all 0 moved up (floats up), integers all 1 moved down (floats down), integers all
1 moved up to 2 (skipped where 2 is not a valid id, e.g. a segment id of a vocabulary of two).
Floating leaves are standard normal; booleans start as the integers' ``bool``; an unknown
non-batch dimension is 4 everywhere, so inputs and labels of one length stay alike.

It is a probe, not a proof: mixing that happens only for particular values stays unseen, e.g. a
layer that imputes a sentinel (``-1``) with the batch mean, or a loss normalised by the number of
labels in the batch that are not an "ignore" value (``-100``), or by a count of positions a
``Masking(0.0)`` keeps. Such models and losses mix examples and are outside the contract.

:func:`check_rows_independent` raises on mixing. When the probe cannot run (an input the
synthetic rows do not fit, a layer that fails eagerly) or the model or loss is not deterministic
(e.g. unseeded ``tf.random`` inside a layer), it returns the reason instead: the fast path then
computes the whole model by the vectorized path, which builds each example's gradient from that
example alone. Results are cached per model, loss object, layers (a layer without weights added
to a ``Sequential`` changes the model), variables, input and label signature and mode, so inside
a ``tf.function`` the probe runs when the step is traced.
"""

from __future__ import annotations

import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from dpcore import validation
from dpcore.engine import graph
from dpcore.engine.summary import batch_signature, probe_rows

__all__ = ["check_rows_independent", "mixing_probe"]

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_KEYS_PER_MODEL = 16
_UNKNOWN_DIM = 4


def _synthetic(tree: Any, rows: int, rng: np.random.Generator, *, fill: int) -> Any:
    """Rows of standard normals (floating leaves), of ``fill`` (integers) or ``bool(fill)``."""

    def leaf(t: Any) -> Any:
        if t is None or not (tf.is_tensor(t) or hasattr(t, "shape")):
            return t
        dtype = tf.as_dtype(t.dtype)
        shape = [rows] + [_UNKNOWN_DIM if d is None else d for d in tf.TensorShape(t.shape)[1:]]
        if dtype.is_floating:
            return tf.cast(rng.standard_normal(shape), dtype)
        if dtype.is_bool:
            return tf.fill(shape, bool(fill))
        return tf.fill(shape, tf.constant(fill, dtype))

    return tf.nest.map_structure(leaf, tree)


def _changed(rows: int, x: Any, site: int, changed: tuple[int, ...], sign: int) -> Any:
    """``x`` with the rows in ``changed`` moved in direction ``sign`` (every entry differs).

    Floating entries move by ``sign * (max |x| + 1) * (2 + |N(0, 1)|)``, past every value of the
    tensor, so a maximum or minimum over the batch moves too; integers by ``sign`` (a 0 moves up
    to 1); booleans flip.
    """
    if not changed or not tf.is_tensor(x) or not x.shape.rank or x.shape[0] != rows:
        return x
    picked = np.zeros([rows] + [1] * (x.shape.rank - 1), bool)
    picked[list(changed)] = True
    if x.dtype.is_floating:
        noise = np.abs(np.random.default_rng(site + 3).standard_normal(x.shape.as_list())) + 2
        scale = tf.reduce_max(tf.where(tf.math.is_finite(x), tf.abs(x), tf.zeros_like(x))) + 1
        new = x + tf.where(picked, sign * scale * tf.cast(noise, x.dtype), tf.zeros_like(x))
    elif x.dtype.is_bool:
        new = tf.where(picked, tf.logical_not(x), x)
    elif x.dtype.is_integer:
        step = tf.ones_like(x) if sign > 0 else tf.where(x == 0, tf.ones_like(x), -tf.ones_like(x))
        new = tf.where(picked, x + step, x)
    else:
        return x
    mask = graph.keras_mask(x)
    if mask is not None:
        graph.set_mask(new, mask)
    return new


def _rows_of(tree: Any, rows: int, kept: tuple[int, ...]) -> list[np.ndarray]:
    return [
        np.asarray(t)[list(kept)]
        for t in tf.nest.flatten(tree)
        if tf.is_tensor(t) and t.shape.rank and t.shape[0] == rows
    ]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        u.shape == v.shape and np.array_equal(u, v, equal_nan=u.dtype.kind in "fc")
        for u, v in zip(a, b)
    )


def mixing_probe(
    model: Any, loss_fn: Any, x: Any, y: Any, *, training: bool, variables: Any = ()
) -> tuple[str | None, str | None]:
    """``(mixing, unverified)``: why rows are not independent, or why that could not be checked.

    Args:
      model: a built Keras model.
      loss_fn: a per-example loss ``(y_true, y_pred) -> [B]``.
      x: the batch's inputs (tensors, arrays or symbolic tensors; only shapes and dtypes are used).
      y: its labels (likewise).
      training: the mode the step calls the model in.
      variables: the differentiated variables (their dimensions are avoided for ``R``).

    Returns:
      ``mixing`` is a sentence naming where other rows reach example 0 (None when nothing
      does); ``unverified`` is the reason the probe could not decide (None when it could).

    Privacy:
      Runs the model on synthetic rows only; nothing of the batch but its shapes is read.
    """
    rows = probe_rows([x, y], variables, start=3)
    labels: list[str] = []
    # Two directions: the other rows must not reach row 0, and row 0 must not reach the others
    # (a cumulative sum over the batch only shows in the second).
    directions = [(tuple(range(1, rows)), (0,)), ((0,), tuple(range(1, rows)))]
    # Three bases, so that a maximum, minimum, "any" or "all" over the batch moves: integers all
    # 0 moved up to 1 (booleans False flipped) with floats moved up; integers all 1 moved down to
    # 0 (booleans True flipped) with floats moved down; integers all 1 moved up to 2, past a
    # floor of 1 (a vocabulary of two has no id 2: a change that fails to run is skipped).
    bases = [(0, 1, False), (1, -1, False), (1, 1, True)]

    def forward(xs: Any, changed: Any, sign: int) -> Any:
        """The model on ``xs``; at site ``i`` the rows ``changed(i)`` move by ``sign``."""
        count = [0]

        def site(t: Any, label: str) -> Any:
            i = count[0]
            count[0] += 1
            if len(labels) <= i:
                labels.append(label)
            return _changed(rows, t, i, changed(i), sign)

        def layer_fn(layer: Any, args: tuple, kwargs: dict) -> Any:
            outputs = layer(*args, **kwargs)
            return tf.nest.map_structure(lambda t: site(t, f"layer {layer.name!r}"), outputs)

        with keras.StatelessScope(initialize_variables=False):
            xs = tf.nest.map_structure(lambda t: site(t, "the model's inputs"), xs)
            if graph.walk_reason(model) is None:
                return graph.run(model, xs, training=training, layer_fn=layer_fn)
            return model(xs, training=training)

    def losses(ys: Any, pred: Any) -> np.ndarray:
        return np.asarray(tf.reshape(loss_fn(ys, pred), [rows]))

    everything = tuple(range(rows))
    try:
        with tf.init_scope():  # eager, outside whatever graph the caller is tracing
            for fill, sign, optional in bases:
                rng = np.random.default_rng(fill)
                xs = _synthetic(x, rows, rng, fill=fill)
                ys = _synthetic(y, rows, rng, fill=fill)
                base = forward(xs, lambda i: (), sign)
                if fill == 0 and not _same(
                    _rows_of(base, rows, everything),
                    _rows_of(forward(xs, lambda i: (), sign), rows, everything),
                ):
                    return None, "the model's outputs differ between two identical calls"
                for changed, kept in directions:
                    expected = _rows_of(base, rows, kept)
                    try:
                        moved = forward(xs, lambda i, c=changed: c, sign)
                    except Exception:  # noqa: BLE001 - only the optional base may skip
                        if optional:
                            break
                        raise
                    if _same(expected, _rows_of(moved, rows, kept)):
                        continue
                    # The last site whose changed rows reach the kept ones: changing sites k..
                    # reaches them for every k up to it and for none after it.
                    low, high = 0, len(labels) - 1
                    while low < high:
                        mid = (low + high + 1) // 2
                        again = forward(xs, lambda i, m=mid, c=changed: c if i >= m else (), sign)
                        if _same(expected, _rows_of(again, rows, kept)):
                            high = mid - 1
                        else:
                            low = mid
                    return (
                        f"the model mixes examples downstream of {labels[low]}: values of some "
                        "examples there change other examples' outputs (batch statistics, a "
                        "mean, maximum, sort, roll or cumulative sum over the batch axis, a layer "
                        "that combines rows)",
                        None,
                    )
                first = losses(ys, base)
                if fill == 0 and not np.array_equal(first, losses(ys, base), equal_nan=True):
                    return None, "the loss differs between two identical calls"
                for changed, kept in directions:
                    pred = tf.nest.map_structure(
                        lambda t, c=changed, s=sign: _changed(rows, t, -1, c, s), base
                    )
                    labels_ = tf.nest.map_structure(
                        lambda t, c=changed, s=sign: _changed(rows, t, -2, c, s), ys
                    )
                    try:
                        after = losses(labels_, pred)
                    except Exception:  # noqa: BLE001 - only the optional base may skip
                        if optional:
                            break
                        raise
                    if not np.array_equal(first[list(kept)], after[list(kept)], equal_nan=True):
                        return (
                            "the loss mixes examples: some examples' predictions or labels "
                            "change other examples' losses (e.g. a contrastive loss with "
                            "in-batch negatives, or a normalisation by a count over the batch)",
                            None,
                        )
    except Exception as e:  # noqa: BLE001 - any failure means "not verified", never "verified"
        return None, f"the probe on {rows} synthetic rows failed ({type(e).__name__}: {e})"
    return None, None


def check_rows_independent(
    model: Any, loss: Any, loss_fn: Any, x: Any, y: Any, *, training: Any, variables: Any = ()
) -> str | None:
    """Refuses a model or loss that mixes examples; returns why that was not verified, or None.

    Cached per model, ``loss`` object, layers, variables, input and label signature and mode (the
    entry holds the objects, so their ids cannot be reused), so inside a
    ``tf.function`` it runs when the step is traced (see :func:`mixing_probe`).

    Args:
      model: a built Keras model.
      loss: what the user passed as the loss (the cache key).
      loss_fn: its per-example form.
      x: the batch's inputs (only shapes and dtypes are used).
      y: its labels.
      training: the mode of the step (a tensor counts as ``True``).
      variables: the differentiated variables.

    Returns:
      None when every example's loss was shown to depend on that example alone; else the reason
      it could not be shown (the caller must then compute each example on its own).

    Raises:
      ValueError: when another example reaches example 0's loss.

    Privacy:
      Enforces the premise of per-example clipping: removing one example leaves every other
      example's loss, and so its clipped gradient, unchanged.
    """
    training = True if tf.is_tensor(training) else bool(training)
    # The objects the result is about, held by the cache entry so that their ids stay theirs:
    # the loss, the variables and every layer (a layer without weights added to or removed from
    # a Sequential changes the model while leaving its variables as they were).
    layers = [layer for _, layer in validation.walk_layers(model) if layer is not model]
    anchors = (*variables, *layers)  # not the model itself: the entry must not keep its key alive
    loss_key = loss if isinstance(loss, str) else id(loss)
    key = (loss_key, tuple(map(id, anchors)), batch_signature(x), batch_signature(y), training)
    cache = _CACHE.setdefault(model, {})
    hit = cache.get(key)
    if hit is None or not (
        (isinstance(loss, str) or hit[0] is loss)
        and all(a is b for a, b in zip(hit[1], anchors, strict=True))
    ):
        if len(cache) >= _MAX_KEYS_PER_MODEL:
            cache.clear()
        probed = mixing_probe(model, loss_fn, x, y, training=training, variables=variables)
        hit = (loss, anchors, *probed)
        cache[key] = hit
    _, _, mixing, unverified = hit
    if mixing is not None:
        raise ValueError(
            f"dpcore: model {getattr(model, 'name', model)!r} with this loss cannot be trained "
            f"privately: {mixing}. Per-example clipping bounds one example's influence only when "
            "each example's loss depends on that example alone."
        )
    return unverified
