"""Vectorized per-example gradients for any Keras model.

Contract: :func:`vectorized_summary` computes each example's gradient by running the model on that
example alone inside ``tf.vectorized_map`` (one compiled program for the whole batch, no Python
loop). When TensorFlow cannot vectorize some op of the model (stateful random ops, some control
flow), it falls back to ``tf.map_fn`` over examples and warns once per model (the attempt is traced
in a function graph of its own, so a conversion failing part-way leaves nothing behind). With
``chunk_size``, the batch is processed ``chunk_size`` examples at a time: norms in a first pass and
the weighted sum in a second, so peak memory is bounded by one chunk's gradients; every example is
still clipped on its own. With privacy units of several rows (``options.group_size = K``) the mapped
element is a unit: the model runs on the unit's ``K`` rows as one small batch and the gradient is
that of the unit's summed (weighted) loss, so only ``[U, *var.shape]`` gradients are formed.
Each example's loss includes the penalties of its activity-regularized outputs
(:mod:`dpcore.engine.activity`), recorded in the per-example call.

Every vectorized conversion of dpcore runs under :func:`folded_products`: a batched matmul of a
per-example operand and a shared one (an ``EinsumDense``'s or ``MultiHeadAttention``'s
``[1, T, D] x [D, E]``, which ``tf.vectorized_map`` would turn into ``[B, 1, T, D] x [D, E]``) is
converted by moving the examples into the rows (``[B*T, D] x [D, E]``), so the vectorized program
holds no batched matmul whose batch shapes differ beyond those of the per-example program.
TensorFlow 2.21's oneDNN CPU kernels, on by default on CPUs with AVX-512 VNNI/BF16, AVX-VNNI or
AMX, corrupt the heap on that broadcast rank-4 product (the process aborts, or a gradient comes
back NaN or wrong; TensorFlow issues 117700 and 123109); :func:`broadcast_batch_matmul` finds
such products.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from dpcore import norms
from dpcore.engine import activity
from dpcore.engine.summary import (
    GradientSummary,
    from_units,
    second_pass_weights,
    to_units,
    unit_mask,
    weighted_loss,
    zero_rows,
)
from dpcore.options import ExecutionOptions, resolve

_WARNED: weakref.WeakSet = weakref.WeakSet()


def _per_example_fn(
    model: Any,
    loss_fn: Callable,
    variables: Sequence[Any],
    *,
    training: bool,
    wrt_inputs: bool,
    group_size: int = 1,
) -> Callable:
    def fn(
        args: tuple[Any, ...],
    ) -> tuple[list[tf.Tensor], list[tf.Tensor], tf.Tensor, Any]:
        xi, yi, wi, *penalty_weights = args  # and the rows' activity penalty weights, if any
        if group_size == 1:  # one example: a batch of one row
            xb = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), xi)
            yb = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), yi)
            wb = tf.reshape(wi, [1])
            pb = [tf.reshape(p, [1]) for p in penalty_weights]
        else:  # one unit: a batch of its K rows
            xb, yb, wb, pb = xi, yi, wi, penalty_weights
        with tf.GradientTape() as tape:
            if wrt_inputs:
                tape.watch([t for t in tf.nest.flatten(xb) if t.dtype.is_floating])
            with activity.capture(model) as sink:
                y_pred = model(xb, training=training)
            per_row = weighted_loss(loss_fn, yb, y_pred, wb)
            loss = tf.reduce_sum(activity.add_penalties(per_row, sink, pb[0] if pb else None))
        sources = list(variables)
        floats = [t for t in tf.nest.flatten(xb) if t.dtype.is_floating] if wrt_inputs else []
        grads = tape.gradient(
            loss, sources + floats, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        grads = [tf.convert_to_tensor(g) for g in grads]
        # An example (unit) of zero weight (padding) contributes exactly zero, selected rather
        # than multiplied: its gradient may be NaN where the model is not finite on its zeroed
        # inputs (a fully masked average is 0/0), and 0 * NaN would poison the sums.
        live = wb != 0
        if pb:
            live = live | (pb[0] != 0)
        any_live = tf.reduce_any(live)
        weight_grads = [tf.where(any_live, g, tf.zeros_like(g)) for g in grads[: len(sources)]]
        input_grads = zero_rows(grads[len(sources) :], live)
        if group_size == 1:
            input_grads = [g[0] for g in input_grads]
            y_pred = tf.nest.map_structure(lambda t: t[0], y_pred)
        return weight_grads, input_grads, loss, y_pred

    return fn


def _unvectorizable_layer(model: Any) -> str | None:
    """A layer whose vectorized gradient TensorFlow builds but cannot run, if the model has one.

    Grouped convolutions: pfor converts their filter gradient at trace time, and the converted
    ``Conv2DBackpropFilter`` then fails at run time ("filter_size does not have enough
    elements"), too late for the trace-time fallback below.
    """
    from dpcore.validation import walk_layers

    for path, layer in walk_layers(model):
        if isinstance(layer, keras.layers.Layer) and int(getattr(layer, "groups", 1) or 1) > 1:
            if hasattr(layer, "kernel_size"):
                return f"{path} is a grouped convolution (groups={layer.groups})"
    return None


def _map(fn: Callable, elems: Any, model: Any) -> Any:
    """vectorized_map, or a map_fn loop (with a one-time warning) where pfor cannot convert."""
    reason = _unvectorizable_layer(model) if isinstance(model, keras.layers.Layer) else None
    if reason is None:
        try:
            return _vectorized(fn, elems)
        except Exception as err:  # pfor raises various errors at trace time
            # Errors that are not about vectorization (bad loss shape, ...) surface here,
            # unwrapped, when one example is traced on its own.
            reason = f"{type(err).__name__}: {_first_line(err)}"
    signature = _signature(fn, elems)
    if model not in _WARNED:
        _WARNED.add(model)
        warnings.warn(
            f"dpcore: tf.vectorized_map cannot vectorize model {getattr(model, 'name', model)!r} "
            f"({reason}); per-example gradients fall back to a loop over examples (tf.map_fn), "
            "which is slower.",
            RuntimeWarning,
            stacklevel=3,
        )
    return tf.map_fn(fn, elems, fn_output_signature=signature, parallel_iterations=8)


def _vectorized(fn: Callable, elems: Any) -> Any:
    """``tf.vectorized_map(fn, elems)``, converted in a function graph of its own and then called.

    A conversion that fails part-way (e.g. pfor on the ``TensorList`` ops of a masked LSTM's while
    loop) would otherwise leave its converted ops in the caller's graph, where a stateful one still
    runs, and fails, after the fallback below was chosen; in a graph of its own, a failed attempt
    leaves nothing behind. It also keeps a second pass over the batch (the non-finite recompute,
    inside a ``tf.cond``) bit-for-bit equal to the first on the rows both keep, as a skipped unit
    must add exactly nothing: each pass calls a function optimized on its own, whereas the same
    ops inlined into the caller's graph and into the branch get rewritten differently by
    grappler's arithmetic optimizer (a ``tf.map_fn`` loop over attention differed in the last bits).
    """
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), elems)

    def vectorized(elems: Any) -> Any:
        return map_examples(fn, elems)

    return tf.function(vectorized, autograph=False).get_concrete_function(specs)(elems)


def map_examples(fn: Callable, elems: Any) -> Any:
    """``tf.vectorized_map(fn, elems, fallback_to_while_loop=False)`` converted under
    :func:`folded_products`; conversion errors propagate."""
    with folded_products():
        return tf.vectorized_map(fn, elems, fallback_to_while_loop=False)


_FOLD_LOCK = threading.Lock()
_FOLD_DEPTH = 0


@contextlib.contextmanager
def folded_products() -> Iterator[None]:
    """Within it, ``tf.vectorized_map`` converts a ``BatchMatMulV2`` of one per-example operand and
    one shared operand with the examples folded into the rows (or columns) of the product.

    The converted product has the batch shape of the per-example product or less:
    ``[1, T, D] x [D, E]`` becomes one rank-2 ``[B*T, D] x [D, E]`` matmul instead of
    TensorFlow's ``[B, 1, T, D] x [D, E]`` with broadcast batch axes. Each output entry is the
    same dot product of one row and one column (up to the kernel's order of summation), so the
    result is each example's product. Products of two per-example operands keep TensorFlow's
    conversion (both then carry the examples' axis, so their batch shapes are those of the
    per-example product with that axis in front). Conversion happens when the vectorized function
    is traced; TensorFlow's converter is restored on exit. Without TensorFlow's converter registry
    (another TensorFlow version) it does nothing.
    """
    global _FOLD_DEPTH
    try:
        from tensorflow.python.ops.parallel_for import pfor
    except ImportError:  # pragma: no cover - a TensorFlow without it
        yield
        return
    registry = getattr(pfor, "_pfor_converter_registry", None)
    if not isinstance(registry, dict) or "BatchMatMulV2" not in registry:  # pragma: no cover
        yield
        return
    with _FOLD_LOCK:
        if _FOLD_DEPTH == 0:
            original = registry["BatchMatMulV2"]
            registry["BatchMatMulV2"] = _folding_converter(original, pfor.wrap)
        _FOLD_DEPTH += 1
    try:
        yield
    finally:
        with _FOLD_LOCK:
            _FOLD_DEPTH -= 1
            if _FOLD_DEPTH == 0:
                registry["BatchMatMulV2"] = getattr(
                    registry["BatchMatMulV2"], "original", registry["BatchMatMulV2"]
                )


def _folding_converter(original: Callable, wrap: Callable) -> Callable:
    def convert(pfor_input: Any) -> Any:
        x, x_stacked, _ = pfor_input.input(0)
        y, y_stacked, _ = pfor_input.input(1)
        if x_stacked == y_stacked or x.shape.rank is None or y.shape.rank is None:
            return original(pfor_input)
        adj_x = pfor_input.get_attr("adj_x")
        adj_y = pfor_input.get_attr("adj_y")
        if x_stacked:
            out = _fold_rows(x, y, adj_x=adj_x, adj_y=adj_y)
        else:
            out = _fold_columns(x, y, adj_x=adj_x, adj_y=adj_y)
        return wrap(out, True)

    convert.original = original  # type: ignore[attr-defined]
    return convert


def _fold_rows(x: tf.Tensor, y: tf.Tensor, *, adj_x: bool, adj_y: bool) -> tf.Tensor:
    """``matmul(x[i], y)`` for every example ``i`` of ``x [N, *xb, M, K]``; ``y [*yb, K, L]``
    shared: one product ``[*xb, N*M, K] x [*yb, K, L]`` (``[N*prod(xb)*M, K] x [K, L]`` for a
    rank-2 ``y``), reshaped to ``[N, *batch, M, L]``."""
    if adj_x:
        x = tf.linalg.adjoint(x)
    if y.shape.rank == 2:  # every leading axis folds into the rows: one rank-2 MatMul
        shape = tf.shape(x)
        prod = tf.matmul(tf.reshape(x, [-1, shape[-1]]), y, adjoint_b=adj_y)
        out = tf.reshape(prod, tf.concat([shape[:-1], tf.shape(prod)[-1:]], 0))
        out.set_shape(x.shape[:-1].concatenate(prod.shape[-1:]))
        return out
    p = x.shape.rank - 3  # the per-example operand's batch axes
    if p:  # [N, *xb, M, K] -> [*xb, N, M, K]
        x = _permute(x, [*range(1, p + 1), 0, p + 1, p + 2])
    shape = tf.shape(x)
    n, m, k = shape[p], shape[p + 1], shape[p + 2]
    prod = tf.matmul(tf.reshape(x, tf.concat([shape[:p], [n * m, k]], 0)), y, adjoint_b=adj_y)
    q = prod.shape.rank - 2  # the product's batch axes (broadcast of xb and yb)
    out_shape = tf.shape(prod)
    prod = tf.reshape(prod, tf.concat([out_shape[:q], [n, m, out_shape[q + 1]]], 0))
    return _permute(prod, [q, *range(q), q + 1, q + 2])


def _fold_columns(x: tf.Tensor, y: tf.Tensor, *, adj_x: bool, adj_y: bool) -> tf.Tensor:
    """``matmul(x, y[i])`` for every example ``i`` of ``y [N, *yb, K, L]``; ``x [*xb, M, K]``
    shared: one product ``[*xb, M, K] x [*yb, K, N*L]``, reshaped to ``[N, *batch, M, L]``."""
    if adj_y:
        y = tf.linalg.adjoint(y)
    p = y.shape.rank - 3
    # [N, *yb, K, L] -> [*yb, K, N, L]
    y = _permute(y, [*range(1, p + 1), p + 1, 0, p + 2])
    shape = tf.shape(y)
    k, n, cols = shape[p], shape[p + 1], shape[p + 2]
    prod = tf.matmul(x, tf.reshape(y, tf.concat([shape[:p], [k, n * cols]], 0)), adjoint_a=adj_x)
    q = prod.shape.rank - 2
    out_shape = tf.shape(prod)
    prod = tf.reshape(prod, tf.concat([out_shape[:q], [out_shape[q], n, cols]], 0))
    # [*batch, M, N, L] -> [N, *batch, M, L]
    return _permute(prod, [q + 1, *range(q), q, q + 2])


def _permute(t: tf.Tensor, perm: list[int]) -> tf.Tensor:
    """``tf.transpose(t, perm)``; a reshape where only axes of static size 1 move (the common
    ``[N, 1, T, D]``), which keeps the order of the elements."""
    if perm == sorted(perm):
        return t
    moved = [a for a in perm if t.shape[a] != 1]
    if moved == sorted(moved):
        out = tf.reshape(t, tf.gather(tf.shape(t), perm))
        out.set_shape([t.shape[a] for a in perm])
        return out
    return tf.transpose(t, perm)


_BATCH_MATMULS = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})


def broadcast_batch_matmul(graph: Any) -> str | None:
    """A batched matmul in ``graph`` (or a function it calls) whose two operands have different
    batch shapes and whose result has rank 4 or more, described for a message; None if none.

    This is the product on which TensorFlow 2.21's oneDNN matmul corrupts the heap (a rank-4 left
    operand with a size-1 axis times a broadcast rank-2 right operand, ``[B, 1, T, D] x [D, E]``,
    as ``tf.vectorized_map`` makes of a ``[1, T, D] x [D, E]`` product without
    :func:`folded_products`). Products whose batch shapes are equal, rank-2 ``MatMul`` and
    rank-3 broadcasts (Keras's own ``[B, T, D] x [D, E]``) are not reported. An operand of unknown
    rank counts as broadcast.
    """
    seen: set[int] = set()
    pending = [graph]
    while pending:
        g = pending.pop()
        if id(g) in seen:
            continue
        seen.add(id(g))
        for op in g.get_operations():
            if op.type in _BATCH_MATMULS and _broadcast_rank4(op):
                a, b = (t.shape for t in op.inputs[:2])
                return f"{op.name} ({_dims(a)} x {_dims(b)})"
        # Functions the graph calls (while-loop bodies, conditionals) hold ops of their own.
        pending.extend(
            f.graph for f in getattr(g, "_functions", {}).values() if hasattr(f, "graph")
        )
    return None


def _broadcast_rank4(op: Any) -> bool:
    a, b = (t.shape for t in op.inputs[:2])
    if a.rank is None or b.rank is None:
        return True
    batch_a, batch_b = list(a)[:-2], list(b)[:-2]
    if max(len(batch_a), len(batch_b)) + 2 < 4:
        return False
    return len(batch_a) != len(batch_b) or any(x != y for x, y in zip(batch_a, batch_b))


def _dims(shape: Any) -> str:
    return "?" if shape.rank is None else "[" + ", ".join(str(d) for d in shape) + "]"


def _first_line(err: Exception) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]


def _signature(fn: Callable, elems: Any) -> Any:
    probe = tf.nest.map_structure(lambda t: t[0], elems)
    out = fn(probe)
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), out)


def _flat_sq_norms(grads: Sequence[tf.Tensor]) -> tf.Tensor:
    """``[B, V]`` float64 certified squared norms (:func:`dpcore.norms.sq_norm_bound`)."""
    return tf.stack([norms.sq_norm_bound(g) for g in grads], axis=1)


def _weighted(grads: Sequence[tf.Tensor], weights: tf.Tensor) -> list[tf.Tensor]:
    out = []
    for v, g in enumerate(grads):
        flat = tf.reshape(g, [tf.shape(g)[0], -1])
        out.append(
            tf.reshape(tf.linalg.matvec(flat, weights[:, v], transpose_a=True), tf.shape(g)[1:])
        )
    return out


def materialize(
    model: Any,
    loss_fn: Callable,
    x: Any,
    y: Any,
    weights: tf.Tensor,
    variables: Sequence[Any],
    *,
    options: ExecutionOptions | None = None,
    penalty_weights: tf.Tensor | None = None,
) -> tuple[list[tf.Tensor], list[tf.Tensor], tf.Tensor, Any]:
    """Per-example gradients ``[B, *var.shape]`` of ``weights[i] * loss_i``, plus
    ``penalty_weights[i]`` times row ``i``'s activity penalties (:mod:`dpcore.engine.activity`;
    the weights from :func:`~dpcore.engine.activity.weights_for`, None for a model without them).

    Uses ``options.training``, ``options.wrt_inputs``, ``options.chunk_size`` and
    ``options.group_size`` (then the gradients and losses are per unit, ``[U, ...]``, of the
    unit's summed weighted loss; chunks count units).

    Returns:
      ``(weight_grads, input_grads, per_example_loss, y_pred)``; ``input_grads`` holds one
      ``[B, ...]`` tensor per floating input leaf when ``wrt_inputs``; ``y_pred`` is per row.

    Privacy:
      Materializes every example's gradient; callers must clip before aggregating.
    """
    options = resolve(options)
    training, wrt_inputs, chunk_size = options.training, options.wrt_inputs, options.chunk_size
    group = options.group_size
    fn = _per_example_fn(
        model, loss_fn, variables, training=training, wrt_inputs=wrt_inputs, group_size=group
    )
    elems = _as_units(_elems(x, y, weights, penalty_weights), group)
    if chunk_size is None:
        out = _map(fn, elems, model)
    else:
        b = tf.shape(elems[2])[0]
        chunks = tf.nest.map_structure(lambda t: _pad_to_chunks(t, chunk_size), elems)

        def per_chunk(elems: Any) -> Any:
            return _map(fn, elems, model)

        out = tf.map_fn(
            per_chunk,
            chunks,
            fn_output_signature=_signature(per_chunk, chunks),
            parallel_iterations=1,
        )
        out = tf.nest.map_structure(lambda t: _unchunk(t, b), out)
    if group == 1:
        return out
    weight_grads, input_grads, loss, y_pred = out
    rows = [from_units(g) for g in input_grads]
    return weight_grads, rows, loss, tf.nest.map_structure(from_units, y_pred)


def _elems(x: Any, y: Any, weights: tf.Tensor, penalty_weights: tf.Tensor | None) -> tuple:
    """What is mapped over: ``(x, y, weights)``, and the penalty weights when there are any."""
    return (x, y, weights) if penalty_weights is None else (x, y, weights, penalty_weights)


def _as_units(elems: Any, group_size: int) -> Any:
    """The batch ``(x, y, weights)`` with each unit's rows along axis 1 (as is for one row)."""
    if group_size == 1:
        return elems
    return tf.nest.map_structure(lambda t: to_units(t, group_size), elems)


def _unchunk(t: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    return tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))[:b]


def _pad_to_chunks(t: tf.Tensor, chunk: int) -> tf.Tensor:
    b = tf.shape(t)[0]
    padded = (b + chunk - 1) // chunk * chunk
    pad = [[0, padded - b]] + [[0, 0]] * (t.shape.rank - 1)
    t = tf.pad(t, pad)
    return tf.reshape(t, tf.concat([[padded // chunk, chunk], tf.shape(t)[1:]], 0))


def _chunked_summary(
    model: Any,
    loss_fn: Callable,
    x: Any,
    y: Any,
    weights: tf.Tensor,
    variables: Sequence[Any],
    *,
    training: bool,
    chunk_size: int,
    group_size: int = 1,
    penalty_weights: tf.Tensor | None = None,
) -> tuple[tf.Tensor, tf.Tensor, Any, Callable[[tf.Tensor], list[tf.Tensor]]]:
    elems = _as_units(_elems(x, y, weights, penalty_weights), group_size)
    b = tf.shape(elems[2])[0]
    chunks = tf.nest.map_structure(lambda t: _pad_to_chunks(t, chunk_size), elems)
    fn = _per_example_fn(
        model, loss_fn, variables, training=training, wrt_inputs=False, group_size=group_size
    )

    def norms_of_chunk(elems: Any) -> tuple[tf.Tensor, tf.Tensor, Any]:
        grads, _, loss, y_pred = _map(fn, elems, model)
        return _flat_sq_norms(grads), loss, y_pred

    sq, loss, y_pred = tf.map_fn(
        norms_of_chunk,
        chunks,
        fn_output_signature=_signature(norms_of_chunk, chunks),
        parallel_iterations=1,
    )

    sq, loss = _unchunk(sq, b), _unchunk(loss, b)
    y_pred = tf.nest.map_structure(lambda t: _unchunk(t, b), y_pred)
    if group_size > 1:
        y_pred = tf.nest.map_structure(from_units, y_pred)

    def weighted_sum(clip_weights: tf.Tensor) -> list[tf.Tensor]:
        cw = _pad_to_chunks(clip_weights, chunk_size)
        sq_chunks = _pad_to_chunks(sq, chunk_size)
        acc = [tf.zeros(v.shape, tf.float32) for v in variables]

        def body(k: tf.Tensor, acc: list[tf.Tensor]) -> tuple[tf.Tensor, list[tf.Tensor]]:
            elems = tf.nest.map_structure(lambda t: t[k], chunks)
            grads, _, _, _ = _map(fn, elems, model)
            # A second forward pass (random layers draw again): weights bounded by its own norms.
            w = second_pass_weights(cw[k], sq_chunks[k], _flat_sq_norms(grads))
            return k + 1, [a + s for a, s in zip(acc, _weighted(grads, w))]

        _, acc = tf.while_loop(
            lambda k, acc: k < tf.shape(cw)[0], body, [tf.constant(0), acc], parallel_iterations=1
        )
        return acc

    return sq, loss, y_pred, weighted_sum


def vectorized_summary(
    model: Any,
    loss_fn: Callable,
    x: Any,
    y: Any,
    sample_weight: tf.Tensor,
    mask: tf.Tensor,
    variables: Sequence[Any],
    *,
    options: ExecutionOptions | None = None,
) -> GradientSummary:
    """Per-example gradient summary by vectorized per-example backward passes.

    Args:
      model: any Keras model (Sequential, Functional, subclassed) or callable.
      loss_fn: per-example loss ``(y_true, y_pred) -> [B]``.
      x: prepared inputs (see :func:`~dpcore.engine.summary.prepare_batch`).
      y: prepared labels.
      sample_weight: ``[B]`` float32.
      mask: ``[B]`` float32 (0 for padding).
      variables: variables to differentiate.
      options: ``training``, ``chunk_size`` (batch processed this many examples at a time: bounded
        memory, two passes), ``wrt_inputs`` (also per-example input gradients) and ``group_size``
        (privacy units of several rows: norms, losses and the mask are then per unit) are used.

    Returns:
      A :class:`GradientSummary`.

    Privacy:
      Each example's gradient is computed from that example alone; masked examples get weight 0.
    """
    options = resolve(options)
    training, wrt_inputs, chunk_size = options.training, options.wrt_inputs, options.chunk_size
    weights = sample_weight * mask
    penalty_weights = activity.weights_for(model, x, mask, options)
    if chunk_size is not None:  # validated by ExecutionOptions (positive; no wrt_inputs)
        sq, loss, y_pred, weighted_sum = _chunked_summary(
            model,
            loss_fn,
            x,
            y,
            weights,
            variables,
            training=training,
            chunk_size=chunk_size,
            group_size=options.group_size,
            penalty_weights=penalty_weights,
        )
        input_grads = None
    else:
        grads, in_grads, loss, y_pred = materialize(
            model,
            loss_fn,
            x,
            y,
            weights,
            variables,
            options=options.replace(chunk_size=None),
            penalty_weights=penalty_weights,
        )
        sq = _flat_sq_norms(grads)

        def weighted_sum(clip_weights: tf.Tensor) -> list[tf.Tensor]:
            return _weighted(grads, clip_weights)

        input_grads = None
        if wrt_inputs:
            leaves = tf.nest.flatten(x)
            it = iter(in_grads)
            input_grads = tf.nest.pack_sequence_as(
                x, [next(it) if t.dtype.is_floating else None for t in leaves]
            )
    units = unit_mask(mask, options.group_size)
    sq = tf.where(units[:, None] > 0, sq, tf.zeros_like(sq))
    return GradientSummary(
        variables=tuple(variables),
        sq_norms=sq,
        per_example_loss=loss,
        mask=units,
        row_mask=None if options.group_size == 1 else tf.cast(mask, tf.float32),
        y_pred=y_pred,
        weighted_sum=weighted_sum,
        input_gradients=input_grads,
        paths={
            getattr(v, "path", getattr(v, "name", str(i))): "vectorized"
            for i, v in enumerate(variables)
        },
    )
