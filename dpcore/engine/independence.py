"""Refusing models and losses that mix examples, by a probe on synthetic rows.

Contract: per-example clipping bounds one example's influence on the update only when example
``i``'s loss, and every per-example quantity the engine reads, depend on example ``i`` alone.
:mod:`dpcore.validation` refuses the layers known to break this (a trainable
``BatchNormalization``, batch-axis settings); this module catches the rest, whatever their form:
a ``Lambda`` or Keras op that centres over the batch, a custom layer without weights that rolls
or sorts rows, a loss with in-batch negatives, a layer whose value is its input but whose
gradient couples rows (``x + m - tf.stop_gradient(m)`` with ``m`` a batch mean, a
``tf.custom_gradient`` over the batch). Example ``i``'s loss here is what the engine clips: its
loss plus the penalties of its rows of the activity-regularized outputs
(:mod:`dpcore.engine.activity`), so rows mixed into a regularized layer are found even where
they never reach the model's outputs (a side branch, a gradient-only coupling).

:func:`mixing_probe` runs the model eagerly on a thread of its own (outside the caller's trace,
with gradient tapes of its own), in the caller's ``training`` mode, each call inside a fresh
:class:`keras.StatelessScope` (no variable changes; seed generators start from the same state,
so Dropout draws the same masks in every call), at two batch sizes: ``R`` rows (``R`` >= 3,
odd, unlike any static dimension of the batch or of the variables, so that a tensor's batch
axis is known: the one of size ``R`` first) and the batch's own static row count (the padded
batch that runs, so that a layer that mixes rows only at even sizes or above some size is
run as it runs; only the sites found rows-first at ``R`` are changed and checked there, so an
axis of the same size is never taken for the batch). At each size:

1. twice as it is: row 0 of the outputs, and of the activity penalties (recorded in each
   regularized layer's call, on its output before the site there changes it), must come out bit
   for bit the same (else "not verified");
2. with some rows changed at every *site* the batch flows through (the model's inputs and the
   output of every leaf layer call, :func:`dpcore.engine.graph.run`; a model that cannot be
   replayed layer by layer has its inputs as the only site), in two directions: rows ``1..R-1``
   changed, row 0 of the outputs and penalties must come out bit for bit the same; row 0
   changed, rows ``1..R-1`` must (a cumulative sum over the batch shows only in the second). A
   model that treats rows independently computes each row from that row alone, with the same
   operations on the same values, whatever the other rows hold, and so whatever the weights.
   Any difference is mixing; a bisection over the sites names the last one whose changed rows
   reach the others (the mixing is downstream of it);
3. the loss (with the penalties) on the first call's outputs and labels, then with rows changed
   in the same two directions (their predictions and penalties replaced by the model's own for
   changed inputs, their labels flipped between 0 and 1): the other examples' losses must stay
   bit for bit the same, else the loss mixes examples;
4. the backward pass, run as the fast path runs it (:mod:`dpcore.engine.ghost`'s recorder, which
   records the penalties of the outputs its rules compute): the loss with the penalties of each
   single row (of rows ``0`` and ``1..B-1`` together on the batch's own size) is
   differentiated to every floating input, every leaf layer output and every tensor whose
   output gradient the fast path reads (a rule's pre-activation output); on every other row
   the gradient must be exactly zero. A finite non-zero value is mixing (the fast path's
   per-example norms and clipped sums come from one batched backward pass, which would carry
   other rows' gradients); a non-finite one leaves the model unverified.

Values: floating inputs are standard normal and move past every value of their tensor
(``±(max |x| + 1) (2 + |N(0, 1)|)``); integer inputs run from three bases, all 0 moved up to 1,
all 1 moved down to 0, and all 1 moved up to 2 (skipped where 2 is not a valid id, e.g. a
segment id of a vocabulary of two), booleans flip, so that a maximum, minimum, "any" or "all"
over the batch moves too; an unknown non-batch dimension is 4 everywhere. Labels of every dtype
and structure (sparse, one-hot, binary, regression, dicts) are 0 in the first base and 1 in the
others and only ever flip between 0 and 1, values every classification or regression loss
takes (a sparse loss needs two classes); predictions fed to the loss are the model's own. The
probe's own runs print nothing (TensorFlow's C++ log lines and Python warnings are held back).
Sample weights are not probed: they multiply each example's loss from outside.

It is a probe, not a proof: mixing that happens only for particular values stays unseen, e.g. a
layer that imputes a sentinel (``-1``) with the batch mean, or a loss normalised by the number of
labels in the batch that are not an "ignore" value (``-100``), or by a count of positions a
``Masking(0.0)`` keeps; and with an unknown static batch size, a layer that branches on the
dynamic size is probed at ``R`` rows only. Such models and losses mix examples and are outside
the contract.

:func:`check_rows_independent` raises on mixing. When the probe cannot run (an input the
synthetic rows do not fit, a layer that fails eagerly), the model or loss is not deterministic
(e.g. unseeded ``tf.random`` inside a layer) or its backward pass is not finite on other rows,
it returns the reason instead: the fast path then computes the whole model by the vectorized
path, which builds each example's gradient from that example alone, and
:func:`warn_whole_model_fallback` says so once, with the cost, and records it for
:func:`dpcore.explain.explain`. Results are cached per model, loss object, layers (a layer
without weights added to a ``Sequential`` changes the model), variables, layer rules, activity
regularizers and their factors, input and label signature, static batch size and mode, so inside
a ``tf.function`` the probe runs when the step is traced.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from dpcore import validation
from dpcore.engine import activity, graph
from dpcore.engine.summary import batch_signature, probe_rows

__all__ = [
    "check_rows_independent",
    "mixing_probe",
    "warn_whole_model_fallback",
    "whole_model_fallback",
]

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FALLBACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_KEYS_PER_MODEL = 16
_UNKNOWN_DIM = 4


def _synthetic(tree: Any, rows: int, rng: np.random.Generator, *, fill: int) -> Any:
    """Inputs: rows of standard normals (floating leaves), of ``fill`` (integers) or
    ``bool(fill)``."""

    def leaf(t: Any) -> Any:
        if not _shaped(t):
            return t
        dtype = tf.as_dtype(t.dtype)
        shape = _shape(t, rows)
        if dtype.is_floating:
            return tf.cast(rng.standard_normal(shape), dtype)
        if dtype.is_bool:
            return tf.fill(shape, bool(fill))
        return tf.fill(shape, tf.constant(fill, dtype))

    return tf.nest.map_structure(leaf, tree)


def _labels(tree: Any, rows: int, *, fill: int) -> Any:
    """Labels with every entry ``fill`` (0 or 1) in each leaf's dtype (``bool(fill)``)."""

    def leaf(t: Any) -> Any:
        if not _shaped(t):
            return t
        dtype = tf.as_dtype(t.dtype)
        if dtype.is_bool:
            return tf.fill(_shape(t, rows), bool(fill))
        return tf.fill(_shape(t, rows), tf.constant(fill, dtype))

    return tf.nest.map_structure(leaf, tree)


def _shaped(t: Any) -> bool:
    return t is not None and (tf.is_tensor(t) or hasattr(t, "shape"))


def _shape(t: Any, rows: int) -> list[int]:
    return [rows] + [_UNKNOWN_DIM if d is None else d for d in tf.TensorShape(t.shape)[1:]]


def _batched(t: Any, rows: int) -> bool:
    return tf.is_tensor(t) and bool(t.shape.rank) and t.shape[0] == rows


def _picked(rows: int, rank: int, changed: tuple[int, ...]) -> np.ndarray:
    picked = np.zeros([rows] + [1] * (rank - 1), bool)
    picked[list(changed)] = True
    return picked


def _changed(rows: int, x: Any, site: int, changed: tuple[int, ...], sign: int) -> Any:
    """``x`` with the rows in ``changed`` moved in direction ``sign`` (every entry differs).

    Floating entries move by ``sign * (max |x| + 1) * (2 + |N(0, 1)|)``, past every value of the
    tensor, so a maximum or minimum over the batch moves too; integers by ``sign`` (a 0 moves up
    to 1); booleans flip.
    """
    if not changed or not _batched(x, rows):
        return x
    picked = _picked(rows, x.shape.rank, changed)
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


def _flipped(rows: int, y: Any, changed: tuple[int, ...]) -> Any:
    """Labels ``y`` (entries 0 or 1) with the rows in ``changed`` flipped: 0 <-> 1."""
    if not changed or not _batched(y, rows):
        return y
    picked = _picked(rows, y.shape.rank, changed)
    if y.dtype.is_bool:
        return tf.where(picked, tf.logical_not(y), y)
    return tf.where(picked, tf.ones_like(y) - y, y)


def _taken(rows: int, a: Any, b: Any, changed: tuple[int, ...]) -> Any:
    """``a`` with the rows in ``changed`` taken from ``b`` (Keras masks likewise)."""

    def leaf(u: Any, v: Any) -> Any:
        if not changed or not _batched(u, rows) or not _batched(v, rows):
            return u
        new = tf.where(_picked(rows, u.shape.rank, changed), v, u)
        mu, mv = graph.keras_mask(u), graph.keras_mask(v)
        if mu is not None and mv is not None and _batched(mu, rows):
            graph.set_mask(new, tf.where(_picked(rows, mu.shape.rank, changed), mv, mu))
        return new

    return tf.nest.map_structure(leaf, a, b)


def _rows_of(tree: Any, rows: int, kept: tuple[int, ...]) -> list[np.ndarray]:
    return [np.asarray(t)[list(kept)] for t in tf.nest.flatten(tree) if _batched(t, rows)]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        u.shape == v.shape and np.array_equal(u, v, equal_nan=u.dtype.kind in "fc")
        for u, v in zip(a, b)
    )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The probe's own runs print nothing: TensorFlow's C++ log lines (e.g. ``OP_REQUIRES
    failed``, written to file descriptor 2 by a changed row that an op rejects) and Python
    warnings (recorded and dropped, without marking them as already shown)."""
    with warnings.catch_warnings(record=True):
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (AttributeError, OSError, ValueError):  # no file descriptor 2 to silence
            yield
            return
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 2)
            yield
        finally:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            os.close(null)


def _eagerly(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a thread of its own: eager, outside whatever graph the caller is tracing,
    and with gradient tapes of its own (``tf.init_scope`` would pause them), none of the caller's
    recording it."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dpcore-probe") as pool:
        return pool.submit(fn, *args).result()


# Three bases, so that a maximum, minimum, "any" or "all" over the batch moves: integers all 0
# moved up to 1 (booleans False flipped) with floats moved up; integers all 1 moved down to 0
# (booleans True flipped) with floats moved down; integers all 1 moved up to 2, past a floor of
# 1 (a vocabulary of two has no id 2: a base whose changes fail to run is skipped). Labels are 0
# in the first base and 1 in the others, and only ever flip between 0 and 1.
_BASES = ((0, 1, False), (1, -1, False), (1, 1, True))


def _static_rows(x: Any) -> int | None:
    leaves = [t for t in tf.nest.flatten(x) if _shaped(t)]
    if not leaves or not tf.TensorShape(leaves[0].shape).rank:
        return None
    rows: int | None = tf.TensorShape(leaves[0].shape)[0]
    return rows


def mixing_probe(
    model: Any,
    loss_fn: Any,
    x: Any,
    y: Any,
    *,
    training: bool,
    variables: Any = (),
    registry: Any = None,
) -> tuple[str | None, str | None]:
    """``(mixing, unverified)``: why rows are not independent, or why that could not be checked.

    Args:
      model: a built Keras model.
      loss_fn: a per-example loss ``(y_true, y_pred) -> [B]``.
      x: the batch's inputs (tensors, arrays or symbolic tensors; only shapes and dtypes are used).
      y: its labels (likewise).
      training: the mode the step calls the model in.
      variables: the differentiated variables (their dimensions are avoided for the odd count;
        the backward check watches the tensors the fast path differentiates for them).
      registry: the fast path's layer rules (default :func:`dpcore.rules.default_registry`): the
        backward check reads the output gradients where they read them.

    Returns:
      ``mixing`` is a sentence naming where other rows reach example 0 (None when nothing
      does); ``unverified`` is the reason the probe could not decide (None when it could).

    Privacy:
      Reads nothing of the batch but the shapes (the static batch size included) and dtypes of
      ``x`` and ``y``: every value the model and the loss see is synthetic (see the module
      docstring), never a row of the batch, so whether a model is refused, or which path
      computes it, depends on no example's values and releases nothing about them (probe rows
      copied from the batch would make that decision, an observable outside the accounted
      noisy sums, a function of private data).
    """
    odd = probe_rows([x, y], variables, start=3)
    static = _static_rows(x)
    sizes: list[tuple[int, tuple[tuple[int, int, bool], ...]]] = [(odd, _BASES)]
    if static is not None and static >= 2 and static != odd:
        sizes.append((static, _BASES[:1]))  # the padded batch size that runs
    if registry is None:
        from dpcore.rules import default_registry

        registry = default_registry()
    rows = odd
    # The sites whose tensors hold the batch on their first axis, as the run on the odd count
    # (a size no other dimension has) shows them: on the batch's own size, which another axis
    # may share, only those are changed and checked.
    rows_first: set[tuple[int, str]] = set()
    try:
        with _quiet():
            for rows, bases in sizes:
                found = _eagerly(
                    _probe_at,
                    model,
                    loss_fn,
                    x,
                    y,
                    rows,
                    bases,
                    training,
                    variables,
                    registry,
                    rows_first,
                    rows != odd,
                )
                if found != (None, None):
                    return found
    except Exception as e:  # noqa: BLE001 - any failure means "not verified", never "verified"
        return None, f"the probe on {rows} synthetic rows failed ({type(e).__name__}: {e})"
    return None, None


def _probe_at(
    model: Any,
    loss_fn: Any,
    x: Any,
    y: Any,
    rows: int,
    bases: Any,
    training: bool,
    variables: Any,
    registry: Any,
    rows_first: set[tuple[int, str]],
    known: bool,
) -> tuple[str | None, str | None]:
    """The forward, loss and backward checks of :func:`mixing_probe` on ``rows`` rows.

    ``rows_first`` holds the ``(index, label)`` of the sites found rows first: filled when ``known``
    is False (``rows`` is then a size no other dimension has), read when it is True.
    """
    labels: list[str] = []
    at = f" (found on a batch of {rows} rows)"
    # Two directions: the other rows must not reach row 0, and row 0 must not reach the others
    # (a cumulative sum over the batch only shows in the second).
    directions = [(tuple(range(1, rows)), (0,)), ((0,), tuple(range(1, rows)))]
    inputs = len(tf.nest.flatten(x))  # sites 0 .. inputs - 1 are the model's inputs

    def forward(xs: Any, changed: Any, sign: int) -> tuple[Any, tf.Tensor | None]:
        """The model's outputs on ``xs`` and each row's activity penalties (None without
        regularizers); at site ``i`` the rows ``changed(i)`` move by ``sign``."""
        count = [0]

        def site(t: Any, label: str) -> Any:
            i = count[0]
            count[0] += 1
            if len(labels) <= i:
                labels.append(label)
            if not known and _batched(t, rows):
                rows_first.add((i, label))
            if known and (i, label) not in rows_first:
                return t
            return _changed(rows, t, i, changed(i), sign)

        def layer_fn(layer: Any, args: tuple, kwargs: dict) -> Any:
            outputs = layer(*args, **kwargs)
            return tf.nest.map_structure(lambda t: site(t, f"layer {layer.name!r}"), outputs)

        # A regularized layer records its penalty in its ``__call__``, on its output before the
        # site there changes it: a penalty reached by changed rows of an earlier site is mixing.
        with keras.StatelessScope(initialize_variables=False), activity.capture(model) as sink:
            xs = tf.nest.map_structure(lambda t: site(t, "the model's inputs"), xs)
            if graph.walk_reason(model) is None:
                pred = graph.run(model, xs, training=training, layer_fn=layer_fn)
            else:
                pred = model(xs, training=training)
        return pred, sink.per_row(rows)

    def losses(ys: Any, run: tuple[Any, tf.Tensor | None]) -> np.ndarray:
        """Each row's loss on the outputs of ``run``, plus its penalties: what the engine clips."""
        pred, penalty = run
        return np.asarray(_with_penalty(tf.reshape(loss_fn(ys, pred), [rows]), penalty))

    everything = tuple(range(rows))
    first_base: tuple[Any, Any] | None = None
    for fill, sign, optional in bases:
        rng = np.random.default_rng(fill)
        xs = _synthetic(x, rows, rng, fill=fill)
        ys = _labels(y, rows, fill=fill)
        base = forward(xs, lambda i: (), sign)
        if first_base is None:
            first_base = (xs, ys)
            if not _same(
                _rows_of(base, rows, everything),
                _rows_of(forward(xs, lambda i: (), sign), rows, everything),
            ):
                return None, "the model's outputs differ between two identical calls"
        try:
            for changed, kept in directions:
                expected = _rows_of(base, rows, kept)
                moved = forward(xs, lambda i, c=changed: c, sign)
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
                seen = "outputs"
                if _same(_rows_of(base[0], rows, kept), _rows_of(moved[0], rows, kept)):
                    seen = "activity regularizers' penalties (the outputs are unchanged)"
                return (
                    f"the model mixes examples downstream of {labels[low]}: values of some "
                    f"examples there change other examples' {seen} (batch statistics, a "
                    "mean, maximum, sort, roll or cumulative sum over the batch axis, a layer "
                    f"that combines rows){at}",
                    None,
                )
            # Predictions the model itself gives for other inputs (every input row changed).
            other = forward(xs, lambda i: everything if i < inputs else (), sign)
        except Exception:  # noqa: BLE001 - only the optional base may skip
            if optional:
                continue
            raise
        first = losses(ys, base)
        if fill == 0 and not np.array_equal(first, losses(ys, base), equal_nan=True):
            return None, "the loss differs between two identical calls"
        for changed, kept in directions:
            after = losses(_flipped_tree(rows, ys, changed), _taken(rows, base, other, changed))
            if not np.array_equal(first[list(kept)], after[list(kept)], equal_nan=True):
                return (
                    "the loss mixes examples: some examples' predictions or labels change "
                    "other examples' losses (e.g. a contrastive loss with in-batch negatives, "
                    f"or a normalisation by a count over the batch){at}",
                    None,
                )
    assert first_base is not None
    # Everything each example gets from the fast path's one backward pass must come from its own
    # loss: every single row's loss (on a few rows), or row 0's and the others' (on the batch
    # size that runs), differentiated to every site.
    groups: list[tuple[int, ...]] = (
        [(k,) for k in range(rows)] if rows <= _SINGLES else [(0,), tuple(range(1, rows))]
    )
    # On the first base whose losses are all finite: ids all 0 may mask every position of a
    # ``mask_zero`` embedding, and a masked average is then 0/0 on every row.
    chosen = first_base
    for fill in (0, 1):
        xs = _synthetic(x, rows, np.random.default_rng(fill), fill=fill)
        ys = _labels(y, rows, fill=fill)
        if np.isfinite(losses(ys, forward(xs, lambda i: (), 1))).all():
            chosen = (xs, ys)
            break
    mixing, unverified = _backward_probe(
        model, loss_fn, *chosen, rows, groups, training, variables, registry, rows_first, known
    )
    return (mixing + at if mixing else None), unverified


def _flipped_tree(rows: int, ys: Any, changed: tuple[int, ...]) -> Any:
    return tf.nest.map_structure(lambda t: _flipped(rows, t, changed), ys)


def _with_penalty(per_example: tf.Tensor, penalty: tf.Tensor | None) -> tf.Tensor:
    """``[rows]`` losses plus each row's activity penalties (float32, as the engine adds them,
    :func:`dpcore.engine.activity.add_penalties`); the losses as they are without penalties."""
    if penalty is None:
        return per_example
    return tf.cast(per_example, tf.float32) + penalty


# Up to this many probe rows, the backward check differentiates every row's loss on its own.
_SINGLES = 8


def _backward_probe(
    model: Any,
    loss_fn: Any,
    xs: Any,
    ys: Any,
    rows: int,
    groups: list[tuple[int, ...]],
    training: bool,
    variables: Any,
    registry: Any,
    rows_first: set[tuple[int, str]],
    known: bool,
) -> tuple[str | None, str | None]:
    """Where the loss of the rows in a group has a gradient on other rows, if anywhere.

    The model runs as the fast path runs it (:class:`dpcore.engine.ghost._Recorder`: rule layers
    recomputed by their rules), and every floating input, every tensor whose gradient the fast
    path reads (a rule's pre-activation output, a rule-less layer's outputs) and every leaf layer
    output is a site. For each group the summed loss of its rows (with their activity penalties,
    as the fast path adds them) is differentiated to every site:
    the other rows of each gradient must be exactly zero. A finite non-zero value is mixing (e.g.
    ``x + m - tf.stop_gradient(m)`` with ``m`` a batch mean, or a ``tf.custom_gradient`` that
    mixes rows); a non-finite one leaves the backward pass unverified. ``rows_first`` and ``known``
    as in :func:`_probe_at` (backward sites are keyed by a negative index).
    """
    from dpcore.engine import ghost  # the fast path's own recorder (ghost imports no probe)

    if graph.walk_reason(model) is not None:
        return None, None  # the fast path computes such a model by the vectorized path
    wanted = {id(v) for v in variables}
    sites: list[tuple[str, tf.Tensor]] = []
    seen: set[int] = set()

    def watch(tape: tf.GradientTape, t: Any, label: str) -> None:
        if not tf.is_tensor(t) or not t.dtype.is_floating or id(t) in seen:
            return
        seen.add(id(t))
        key = (-1 - len(seen), label)
        if not known and _batched(t, rows):
            rows_first.add(key)
        if _batched(t, rows) and (not known or key in rows_first):
            tape.watch(t)
            sites.append((label, t))

    try:
        tape = tf.GradientTape(persistent=True, watch_accessed_variables=False)

        def layer_fn(layer: Any, args: tuple, kwargs: dict) -> Any:
            outputs = recorder(layer, args, kwargs)
            flat = tf.nest.flatten(outputs)
            for key, calls in recorder.calls.items():
                for z, _ in calls:
                    for t in tf.nest.flatten(z):
                        if not any(t is o for o in flat):
                            name = recorder.names[key]
                            watch(tape, t, f"the pre-activation output of layer {name!r}")
            for t in flat:
                watch(tape, t, f"layer {layer.name!r}")
            return outputs

        # Each row's loss with its activity penalties, as the fast path records them: Keras's
        # calls in the capture's sink, the recorder those of the outputs its rules compute.
        with (
            keras.StatelessScope(initialize_variables=False),
            tape,
            activity.capture(model) as sink,
        ):
            recorder = ghost._Recorder(tape, registry, wanted, training, sink=sink)
            recorder.want(variables)
            for t in tf.nest.flatten(xs):
                watch(tape, t, "the model's inputs")
            pred = graph.run(model, xs, training=training, layer_fn=layer_fn)
            per_example = tf.reshape(loss_fn(ys, pred), [rows])
            per_example = _with_penalty(per_example, sink.per_row(rows))
            totals = [tf.reduce_sum(tf.gather(per_example, list(g))) for g in groups]
        leaks: set[int] = set()
        nonfinite: set[int] = set()
        tensors = [t for _, t in sites]
        for group, total in zip(groups, totals):
            others = [i for i in range(rows) if i not in group]
            grads = tape.gradient(
                total, tensors, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
            for i, g in enumerate(grads):
                rest = np.asarray(tf.gather(tf.convert_to_tensor(g), others))
                finite = np.isfinite(rest)
                if np.any(finite & (rest != 0)):
                    leaks.add(i)
                elif not finite.all():
                    nonfinite.add(i)
    except ghost._OutsideUse:
        return None, None  # the fast path computes such a model by the vectorized path
    except Exception as e:  # noqa: BLE001 - a backward pass that cannot run is not verified
        return None, (
            f"its backward pass could not be probed on {rows} synthetic rows "
            f"({type(e).__name__}: {e})"
        )
    if leaks:
        return (
            f"the model's backward pass mixes examples downstream of {sites[max(leaks)][0]}: "
            "the gradient of one example's loss there reaches other examples' rows (a gradient "
            "that couples rows, e.g. tf.stop_gradient of a batch statistic added to the "
            "outputs, or a tf.custom_gradient over the batch axis)",
            None,
        )
    if nonfinite:
        return None, (
            "the gradient of one example's loss is not finite on other examples' rows "
            f"downstream of {sites[max(nonfinite)][0]}, so its backward pass could not be "
            "verified"
        )
    return None, None


def check_rows_independent(
    model: Any,
    loss: Any,
    loss_fn: Any,
    x: Any,
    y: Any,
    *,
    training: Any,
    variables: Any = (),
    registry: Any = None,
) -> str | None:
    """Refuses a model or loss that mixes examples; returns why that was not verified, or None.

    Cached per model, ``loss`` object, layers, variables, layer rules, activity regularizers and
    their factors, input and label signature, static batch size and mode (the entry holds the
    objects, so their ids cannot be reused), so inside a ``tf.function`` it runs when the step is
    traced (see :func:`mixing_probe`).

    Args:
      model: a built Keras model.
      loss: what the user passed as the loss (the cache key).
      loss_fn: its per-example form.
      x: the batch's inputs (only shapes and dtypes are used).
      y: its labels.
      training: the mode of the step (a tensor counts as ``True``).
      variables: the differentiated variables.
      registry: the fast path's layer rules (default :func:`dpcore.rules.default_registry`).

    Returns:
      None when every example's loss was shown to depend on that example alone; else the reason
      it could not be shown (the caller must then compute each example on its own).

    Raises:
      ValueError: when another example reaches example 0's loss.

    Privacy:
      Enforces the premise of per-example clipping: removing one example leaves every other
      example's loss, and so its clipped gradient, unchanged, and the fast path's per-example
      norms and clipped sums, read from one batched backward pass, hold each example's own
      gradient only. Reads only shapes and dtypes (:func:`mixing_probe`).
    """
    training = True if tf.is_tensor(training) else bool(training)
    # The objects the result is about, held by the cache entry so that their ids stay theirs:
    # the loss, the variables and every layer (a layer without weights added to or removed from
    # a Sequential changes the model while leaving its variables as they were).
    layers = [layer for _, layer in validation.walk_layers(model) if layer is not model]
    if registry is None:
        from dpcore.rules import default_registry

        registry = default_registry()
    rules = [r for pair in registry.items() for r in pair]
    # The activity regularizers, and their factors (a factor of 0 records no penalty): one set
    # or changed after a step changes each example's loss.
    regularized = [layer for _, layer in activity.regularized_layers(model)]
    regularizers = [activity.regularizer_of(layer) for layer in regularized]
    factors = tuple(
        (id(layer), *activity.penalty_factors(r)) for layer, r in zip(regularized, regularizers)
    )
    # Not the model itself: the entry must not keep its key alive.
    anchors = (*variables, *layers, *rules, *regularizers)
    loss_key = loss if isinstance(loss, str) else id(loss)
    key = (
        loss_key,
        tuple(map(id, anchors)),
        factors,
        batch_signature(x),
        batch_signature(y),
        _static_rows(x),
        training,
    )
    cache = _CACHE.setdefault(model, {})
    hit = cache.get(key)
    if hit is None or not (
        (isinstance(loss, str) or hit[0] is loss)
        and all(a is b for a, b in zip(hit[1], anchors, strict=True))
    ):
        if len(cache) >= _MAX_KEYS_PER_MODEL:
            cache.clear()
        probed = mixing_probe(
            model, loss_fn, x, y, training=training, variables=variables, registry=registry
        )
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


def warn_whole_model_fallback(model: Any, reason: str | None, *, stacklevel: int = 3) -> None:
    """Warns, once per cause, that ``model`` takes the vectorized path as a whole, and records
    ``reason`` for :func:`dpcore.explain.explain` (None forgets an earlier one).

    Args:
      model: the model of the step.
      reason: why, as a clause completing "because ..."; None when the model takes its planned
        path.
      stacklevel: passed to :func:`warnings.warn`.
    """
    if reason is None:
        _FALLBACKS.pop(model, None)
        return
    with contextlib.suppress(TypeError):  # a model that cannot be weakly referenced
        _FALLBACKS[model] = reason
    warnings.warn(
        f"dpcore: model {getattr(model, 'name', model)!r} takes the vectorized path as a whole "
        f"because {reason}. Each example's gradient is then computed on its own for every "
        "variable, typically several times slower per step than the per-layer fast path, with "
        "memory growing with the batch size times the number of parameters; "
        "dpcore.explain(model) shows the same.",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


def whole_model_fallback(model: Any) -> str | None:
    """Why the last traced step of ``model`` took the vectorized path as a whole, if it did."""
    try:
        reason: str | None = _FALLBACKS.get(model)
    except TypeError:
        return None
    return reason
