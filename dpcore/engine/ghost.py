"""The fast path: per-layer ghost norms and book-keeping clipped sums.

Contract: :func:`fast_summary` has the signature of the vectorized path (minus ``chunk_size``) and
returns the same :class:`~dpcore.engine.summary.GradientSummary`, computed with

1. one forward pass that replays the model's layer graph (:mod:`dpcore.engine.graph`); each layer
   with a rule (:mod:`dpcore.rules`) is recomputed by its rule from the layer's own
   variables, recording its input and its pre-activation output ``z``;
2. one backward pass of ``sum_i w_i L_i`` (``w`` = sample weight times mask; ``L_i`` plus the
   penalties of example ``i``'s activity-regularized outputs, :mod:`dpcore.engine.activity`,
   recorded for rule-computed outputs too) to every recorded ``z`` (never to the weights),
   giving ``dL_i/dz_i`` row by row;
3. per layer, cheap per-example norms and a book-keeping weighted sum ``sum_i c_i grad_i`` (one
   weighted product per layer, no second backward pass).

Trainable layers without a rule (or whose rule declines the instance) fall back to vectorized
per-example gradients of that layer alone, from its recorded inputs and output gradients. Models
whose graph cannot be replayed (subclassed models) fall back as a whole to the vectorized path with
a warning saying why. A layer called several times contributes the norm of the *sum* of its
per-example gradients over all calls. Masked examples have zero loss, zero norms and zero weight;
the recorded inputs and output gradients of rows that contribute nothing (padding, zero weight)
are selected to zero before any rule sees them, so such a row adds exactly zero to every norm and
sum even where the model is not finite on it (a fully masked average is ``0/0``).
With privacy units of several rows (``options.group_size = K``) the forward and backward passes
run on rows as always; each layer's rule (or fallback) then sees unit ``u`` as one example that
called the layer ``K`` times (:func:`dpcore.rules.base.unit_uses`), so norms and clipped sums are
per unit with the cross terms between the unit's rows counted, never per row.
Everything is plain TensorFlow, traceable once inside the caller's compiled step (XLA included).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from dpcore.engine import activity, graph
from dpcore.engine.summary import (
    GradientSummary,
    batch_signature,
    check_variables,
    probe_rows,
    to_units,
    unit_mask,
    weighted_loss,
    zero_rows,
)
from dpcore.engine.vectorized import map_examples
from dpcore.options import ExecutionOptions, resolve
from dpcore.rules import default_registry, lookup
from dpcore.rules.base import (
    LayerRule,
    Registry,
    Use,
    VariableGrad,
    from_per_example,
    unit_uses,
)

__all__ = ["fast_summary", "supports", "fallback_reason"]


def fallback_reason(
    model: Any, variables: Sequence[Any] | None = None, registry: Registry | None = None
) -> str | None:
    """Why ``model`` cannot take the fast path as a whole (None when it can).

    A variable read by two layers (tied weights) is fine when both reads reach the engine as uses
    of one layer, whose rule sums them: e.g. a ``TokenAndPositionEmbedding`` (a composition whose
    rule routes its ``token_embedding`` through the engine) and a later
    ``token_embedding(h, reverse=True)`` call are two uses of the ``token_embedding`` layer.

    Args:
      model: a Keras model.
      variables: the variables to differentiate (default: ``model.trainable_variables``).
      registry: the layer rules (default :func:`~dpcore.rules.default_registry`): a layer whose
        rule composes sub-layers owns no variables itself; its sub-layers do.
    """
    reason = graph.walk_reason(model)
    if reason:
        return reason
    variables = list(model.trainable_variables if variables is None else variables)
    registry = default_registry() if registry is None else registry
    owner: dict[int, Any] = {}
    seen_layers: set[int] = set()
    for leaf, _ in graph.leaf_calls(model):
        if id(leaf) in seen_layers:
            continue
        seen_layers.add(id(leaf))
        for layer, owned in _owners(leaf, registry):
            for v in owned:
                if id(v) in owner and owner[id(v)] is not layer:
                    return (
                        f"variable {v.path!r} is used by layers {owner[id(v)].name!r} and "
                        f"{layer.name!r} (tied weights need cross-layer terms the per-layer rules "
                        "do not compute)"
                    )
                owner[id(v)] = layer
    wanted = {id(v) for v in variables}
    for op_name, v in graph.op_variables(model):
        if id(v) in wanted:
            return _outside_use_reason(v, f"the op {op_name!r}")
    missing = [v for v in variables if id(v) not in owner]
    if missing:
        return (
            f"variable {missing[0].path!r} does not belong to any layer in the model graph, so "
            "its use cannot be traced layer by layer"
        )
    return None


def _owners(layer: Any, registry: Registry) -> list[tuple[Any, list[Any]]]:
    """``(layer, trainable variables it records)`` for ``layer``: itself, or, when its rule composes
    sub-layers (each recorded as a layer of its own), its sub-layers, recursively; variables a
    composition holds outside its sub-layers stay with it."""
    rule, _ = lookup(registry, layer)
    if rule is None or rule.compose is None:
        return [(layer, graph.trainable_weights(layer))]
    out: list[tuple[Any, list[Any]]] = []
    for sub in graph.sublayers(layer):
        out.extend(_owners(sub, registry))
    inner = {id(v) for _, owned in out for v in owned}
    own = [v for v in graph.trainable_weights(layer) if id(v) not in inner]
    return [(layer, own), *out] if own else out


def _outside_use_reason(variable: Any, reader: str) -> str:
    return (
        f"variable {variable.path!r} is also read by {reader}, outside the layer that owns it; "
        "the per-layer rules would miss that part of its gradient"
    )


class _OutsideUse(Exception):
    """A wanted variable was read by a call that does not own it (seen while tracing)."""


# The probe batch size of batch_axis_reason: odd and larger than any dimension a model is
# likely to have, so that a tensor's batch axis is the one axis of this size.
_PROBE_ROWS = 1_000_003
_BATCH_AXIS_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def batch_axis_reason(model: Any, x: Any, variables: Sequence[Any], *, training: Any) -> str | None:
    """Why a layer's rule could not hold rows first (None when every one can).

    The per-layer rules and the per-layer fallback take a captured input or output's leading
    axis as the batch: a Functional model that hands a layer a transposed tensor (``[T, B, D]``)
    or an EinsumDense whose output moves the batch axis would have its clip factors applied to
    positions (with ``T == B`` nothing fails, and one record moved the clipped sum by 2.6 C, or
    1.9e9 C through an EinsumDense ``'btd,de->tbe'``). The model is traced once (nothing runs)
    on inputs whose batch size is :data:`_PROBE_ROWS`; every tensor going into or out of a layer
    that owns a differentiated variable must have that size on its first axis and on no other.
    Cached per model, input signature and variables.

    Privacy:
      A layer whose tensors do not hold one example per leading row sends the whole model to the
      vectorized path, which computes each example's gradient from that example alone.
    """
    leaves = tf.nest.flatten(x)
    key = (
        batch_signature(x),
        bool(training) if isinstance(training, bool) else None,
        tuple(id(v) for v in variables),
    )
    cache = _BATCH_AXIS_CACHE.setdefault(model, {})
    if key in cache:
        return cache[key]
    wanted = {id(v) for v in variables}
    rows = probe_rows([x], variables, start=_PROBE_ROWS)
    problems: list[str] = []

    def layer_fn(layer: Any, args: tuple, kwargs: dict) -> Any:
        outputs = layer(*args, **kwargs)
        if any(id(v) in wanted for v in graph.trainable_weights(layer)):
            first = [t for t in tf.nest.flatten(args) if tf.is_tensor(t)][:1]
            checked = [
                ("input", t, any(t is f for f in first)) for t in tf.nest.flatten((args, kwargs))
            ]
            checked += [("output", t, True) for t in tf.nest.flatten(outputs)]
            for role, t, batched in checked:
                if not tf.is_tensor(t) or t.shape.rank is None:
                    continue
                dims = t.shape.as_list()
                if rows not in dims and not batched:
                    continue  # a tensor without examples (e.g. a constant passed in)
                if not dims or dims[0] != rows or rows in dims[1:]:
                    shown = ["B" if d == rows else d for d in dims]
                    problems.append(
                        f"layer {layer.name!r} has an {role} whose first axis is not the batch "
                        f"(shape {shown}, B the batch)"
                    )
        return outputs

    def trace(*flat: tf.Tensor) -> tf.Tensor:
        graph.run(
            model, tf.nest.pack_sequence_as(x, list(flat)), training=training, layer_fn=layer_fn
        )
        return tf.zeros([])

    specs = [tf.TensorSpec([rows, *tf.TensorShape(t.shape).as_list()[1:]], t.dtype) for t in leaves]
    try:
        tf.function(trace, autograph=False).get_concrete_function(*specs)
    except Exception as e:  # noqa: BLE001 - a model that cannot be traced so is not verified
        problems.append(f"its layers' batch axes could not be verified ({type(e).__name__}: {e})")
    reason = problems[0] if problems else None
    cache[key] = reason
    return reason


def supports(model: Any) -> bool:
    """True when :func:`fast_summary` can run ``model`` without a whole-model fallback."""
    try:
        return fallback_reason(model) is None
    except Exception:  # noqa: BLE001 - anything odd about the model means "not supported"
        return False


class _Recorder:
    """Intercepts leaf layer calls during the forward pass (state for one trace only)."""

    def __init__(
        self,
        tape: tf.GradientTape,
        registry: Registry,
        wanted: set[int],
        training: Any,
        group_size: int = 1,
        sink: activity.Sink | None = None,
    ) -> None:
        self.tape = tape
        self.sink = sink  # records the activity penalties of outputs computed by rules
        self.group_size = group_size
        self.registry = registry
        self.wanted = wanted
        self.training = training
        self.layers: dict[int, tuple[Any, LayerRule | None, str]] = {}
        self.calls: dict[int, list[tuple[Any, dict]]] = {}  # layer id -> [(z structure, capture)]
        self.names: dict[int, str] = {}  # layer id -> report name ("mha/query" for sub-layers)
        self.prefix = ""
        self.composing: set[int] = set()  # compositions whose ``compose`` is running
        self.wanted_values: dict[int, Any] = {}  # id(backing tf.Variable) -> wanted variable

    def want(self, variables: Sequence[Any]) -> None:
        for v in variables:
            self.wanted_values[id(getattr(v, "value", v))] = v

    def __call__(self, layer: Any, args: tuple, kwargs: dict) -> Any:
        # Which variables the call reads (trace-time bookkeeping only): a wanted variable read by
        # a layer that does not own it (e.g. a Lambda closing over another layer's kernel) would
        # get none of that use's gradient from the per-layer rules.
        with tf.GradientTape(watch_accessed_variables=True) as reads:
            outputs = self._call(layer, args, kwargs)
        owned = {id(getattr(v, "value", v)) for v in graph.trainable_weights(layer)}
        for v in reads.watched_variables():
            if id(v) not in owned and id(v) in self.wanted_values:
                raise _OutsideUse(
                    _outside_use_reason(self.wanted_values[id(v)], f"layer {layer.name!r}")
                )
        return outputs

    def _call(self, layer: Any, args: tuple, kwargs: dict) -> Any:
        if not any(id(v) in self.wanted for v in graph.trainable_weights(layer)):
            return layer(*args, **kwargs)
        key = id(layer)
        if key not in self.layers:
            rule, reason = lookup(self.registry, layer)
            if rule is not None and self.group_size > 1 and not rule.groupable:
                reason = f"rule {rule.name!r} cannot split units of several rows"
                rule = None
            self.layers[key] = (layer, rule, reason)
            self.names[key] = self.prefix + layer.name
        _, rule, _ = self.layers[key]
        if rule is not None and rule.compose is not None and key not in self.composing:
            outer, self.prefix = self.prefix, self.prefix + layer.name + "/"
            self.composing.add(key)
            try:
                outputs = rule.compose(layer, args, kwargs, self)
            finally:
                self.prefix = outer
                self.composing.discard(key)
            if self.sink is not None:  # Layer.__call__ would have added it
                self.sink.add_outputs(layer, outputs)
            return outputs
        # A composition calling itself from its ``compose`` records its own variables (those
        # outside its sub-layers, e.g. a bias) with its rule's ``forward`` and ``grads``.
        if rule is not None:
            z, capture = rule.forward(layer, args, kwargs)
            self.tape.watch(z)
            outputs = rule.activate(layer, z)
            graph.propagate_mask(layer, args, outputs)
            if self.sink is not None and key not in self.composing:
                self.sink.add_outputs(layer, outputs)  # Layer.__call__ would have added it
        else:
            outputs = layer(*args, **kwargs)
            z = [t for t in tf.nest.flatten(outputs) if tf.is_tensor(t) and t.dtype.is_floating]
            self.tape.watch(z)
            capture = {"args": args, "kwargs": kwargs}
        self.calls.setdefault(key, []).append((z, capture))
        return outputs


def _fallback_grads(
    layer: Any, uses: Sequence[Use], wanted: set[int], live: tf.Tensor
) -> list[VariableGrad]:
    """Per-example gradients of one layer's variables by a vectorized per-example VJP
    (:func:`dpcore.engine.vectorized.map_examples`); those of the examples where ``live`` is
    False are selected to zero (padding rows contribute nothing, even where the layer's Jacobian
    is not finite on their zeroed inputs)."""
    variables = [v for v in graph.trainable_weights(layer) if id(v) in wanted]

    def split(structure: Any) -> tuple[list, list, Any]:
        leaves = tf.nest.flatten(structure)
        batched = [tf.is_tensor(t) and t.shape.rank and t.shape.rank > 0 for t in leaves]
        return leaves, batched, structure

    packed = []
    for u in uses:
        leaves, batched, structure = split((u.capture["args"], u.capture["kwargs"]))
        packed.append((leaves, batched, structure, u.grad))
    elems = [
        ([t for t, b in zip(leaves, batched) if b], list(grad))
        for leaves, batched, _, grad in packed
    ]

    def one(example: Any) -> list[tf.Tensor]:
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch([_watchable(v) for v in variables])
            total = 0.0
            for (leaves, batched, structure, _), (xs, gs) in zip(packed, example):
                it = iter(xs)
                filled = [tf.expand_dims(next(it), 0) if b else t for t, b in zip(leaves, batched)]
                args, kwargs = tf.nest.pack_sequence_as(structure, filled)
                out = layer(*args, **kwargs)
                outs = [t for t in tf.nest.flatten(out) if tf.is_tensor(t) and t.dtype.is_floating]
                for o, g in zip(outs, gs):
                    total += tf.reduce_sum(tf.cast(o, tf.float32) * tf.cast(g[None], tf.float32))
        grads = tape.gradient(
            total,
            [_watchable(v) for v in variables],
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        return [tf.convert_to_tensor(g) for g in grads]

    per_example = zero_rows(map_examples(one, elems), live)
    return [
        from_per_example(v, g, path="fallback:vectorized") for v, g in zip(variables, per_example)
    ]


def _watchable(variable: Any) -> Any:
    return getattr(variable, "value", variable)


def _zero_grad(variable: Any, batch: tf.Tensor) -> VariableGrad:
    return VariableGrad(
        variable=variable,
        sq_norm=tf.zeros([batch], tf.float64),
        weighted_sum=lambda w: tf.zeros(variable.shape, variable.dtype),
        path="unused",
    )


def fast_summary(
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
    """Per-example gradient summary from per-layer rules (ghost norms, book-keeping sums).

    Args:
      model: a Keras model; Sequential and Functional (nested too) take the fast path, other models
        fall back to :func:`dpcore.engine.vectorized.vectorized_summary` with a warning.
      loss_fn: per-example loss ``(y_true, y_pred) -> [B]``.
      x: prepared inputs (see :func:`~dpcore.engine.summary.prepare_batch`).
      y: prepared labels.
      sample_weight: ``[B]`` float32.
      mask: ``[B]`` float32 (0 for padding).
      variables: variables to differentiate.
      options: ``training`` (passed to every layer call), ``wrt_inputs`` (also per-example
        gradients w.r.t. the floating inputs, same pass), ``registry`` (layer rules, default
        :func:`~dpcore.rules.default_registry`) and ``group_size`` (privacy units of several
        rows; norms, losses and the mask are then per unit) are used.

    Returns:
      A :class:`GradientSummary` whose ``paths`` maps each differentiated layer's name to its
      path (``"outer/inner"`` for the projections of a MultiHeadAttention), as in
      :func:`dpcore.explain.explain`.

    Privacy:
      Row ``i`` of every per-example quantity depends on example ``i`` alone (layers must not mix
      examples, see :mod:`dpcore.validation`); masked examples get zero norm and weight.
    """
    options = resolve(options)
    training, wrt_inputs = options.training, options.wrt_inputs
    group = options.group_size
    variables = check_variables(variables)

    def whole_model_fallback(reason: str) -> GradientSummary:
        from dpcore.engine.independence import warn_whole_model_fallback
        from dpcore.engine.vectorized import vectorized_summary

        warn_whole_model_fallback(model, reason, stacklevel=4)
        return vectorized_summary(
            model, loss_fn, x, y, sample_weight, mask, variables, options=options
        )

    registry = options.layer_rules()
    reason = fallback_reason(model, variables, registry) or batch_axis_reason(
        model, x, variables, training=training
    )
    if reason is not None:
        return whole_model_fallback(reason)
    wanted = {id(v) for v in variables}
    weights = tf.cast(sample_weight, tf.float32) * tf.cast(mask, tf.float32)
    penalty_weights = activity.weights_for(model, x, mask, options)
    x_leaves = tf.nest.flatten(x)
    float_inputs = [t for t in x_leaves if t.dtype.is_floating] if wrt_inputs else []
    try:
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(float_inputs)
            with activity.capture(model) as sink:
                recorder = _Recorder(tape, registry, wanted, training, group, sink)
                recorder.want(variables)
                y_pred = graph.run(model, x, training=training, layer_fn=recorder)
            per_example_loss = weighted_loss(loss_fn, y, y_pred, weights)
            per_example_loss = activity.add_penalties(per_example_loss, sink, penalty_weights)
            total = tf.reduce_sum(per_example_loss)
    except _OutsideUse as outside:  # raised while tracing, before anything ran
        return whole_model_fallback(str(outside))
    keys = list(recorder.calls)
    zs = [[z for z, _ in recorder.calls[k]] for k in keys]
    grads_z, grads_x = tape.gradient(
        total, (zs, float_inputs), unconnected_gradients=tf.UnconnectedGradients.ZERO
    )
    batch = tf.shape(weights)[0] // group
    live = weights != 0  # rows that contribute: the others are zeroed below, NaN or not
    if penalty_weights is not None:
        live = live | (penalty_weights != 0)
    prepared = {id(t) for t in x_leaves}  # finite on every row (prepare_batch): left as they are
    by_variable: dict[int, VariableGrad] = {}
    found_paths: dict[int, str] = {}
    # Layers in reverse call order, each one's norm ops made to wait for the previous layer's
    # norms: the last layers' gradients arrive first in the backward pass, and only one layer's
    # norm temporaries (scaled operands, Gram matrices, float64 terms) exist at a time instead of
    # every layer's at once, which lowers the step's peak memory.
    # The clipped sums (``weighted_sum``) are made later and are not ordered.
    previous: list[tf.Tensor] = []
    for key, gz in reversed(list(zip(keys, grads_z))):
        layer, rule, why = recorder.layers[key]
        # A capture holds rows along its leading axis unless the rule says otherwise (groupable).
        rows_first = rule is None or rule.groupable
        uses = [
            Use(
                capture=zero_rows(c, live, finite=prepared) if rows_first else c,
                grad=zero_rows(g, live),
            )
            for (_, c), g in zip(recorder.calls[key], gz)
        ]
        # Unit u: one example that called the layer K times.
        uses = unit_uses(uses, group, as_positions=rule is not None and rule.units_as_positions)
        with tf.control_dependencies(previous):
            if rule is not None:
                found = [vg for vg in rule.grads(layer, uses) if id(vg.variable) in wanted]
            else:
                found = _fallback_grads(layer, uses, wanted, unit_mask(live, group) > 0)
        previous = [vg.sq_norm for vg in found] or previous
        found_paths[key] = found[0].path if found else "no variables"
        for vg in found:
            by_variable[id(vg.variable)] = vg
    paths = {recorder.names[key]: found_paths[key] for key in keys}
    per_var = [by_variable.get(id(v)) or _zero_grad(v, batch) for v in variables]
    sq_norms = tf.stack([tf.cast(vg.sq_norm, tf.float64) for vg in per_var], axis=1)
    units = unit_mask(mask, group)
    sq_norms = tf.where(units[:, None] > 0, sq_norms, tf.zeros_like(sq_norms))
    sum_errors = None
    if any(vg.sum_error is not None for vg in per_var):
        zeros = tf.zeros_like(sq_norms[:, 0])
        sum_errors = tf.stack(
            [
                zeros if vg.sum_error is None else tf.cast(vg.sum_error, tf.float64)
                for vg in per_var
            ],
            axis=1,
        )
        sum_errors = tf.where(units[:, None] > 0, sum_errors, tf.zeros_like(sum_errors))
    row_mask = None
    if group > 1:
        row_mask = tf.cast(mask, tf.float32)
        per_example_loss = tf.reduce_sum(to_units(per_example_loss, group), axis=1)

    def weighted_sum(clip_weights: tf.Tensor) -> list[tf.Tensor]:
        clip_weights = tf.cast(clip_weights, tf.float32)
        return [vg.weighted_sum(clip_weights[:, j]) for j, vg in enumerate(per_var)]

    input_gradients = None
    if wrt_inputs:
        it = iter(zero_rows(grads_x, live))
        input_gradients = tf.nest.pack_sequence_as(
            x, [next(it) if t.dtype.is_floating else None for t in x_leaves]
        )
    return GradientSummary(
        variables=tuple(variables),
        sq_norms=sq_norms,
        per_example_loss=per_example_loss,
        mask=units,
        y_pred=y_pred,
        weighted_sum=weighted_sum,
        input_gradients=input_gradients,
        paths=paths,
        row_mask=row_mask,
        sum_errors=sum_errors,
    )
