"""Replaying a Keras model's layer graph with an interceptor (the only module using Keras internals).

Contract:
- :func:`walk_reason` says whether a model's forward pass can be replayed layer by layer: built
  ``Sequential`` and ``Functional`` models (and subclasses that keep their ``call``) can; any other
  model's ``call`` is arbitrary Python and cannot (the reason is returned, for warnings).
- :func:`run` computes ``model(inputs, training=training)`` but routes every call of a leaf layer
  (a layer that is not itself a replayable model) through ``layer_fn(layer, args, kwargs)``, which
  must return the layer's outputs. Nested replayable models are entered recursively; Keras ops in
  the graph are called as they are. ``training`` is injected exactly as Keras does, and Keras masks
  are propagated for outputs that ``layer_fn`` computed without calling the layer.
- :func:`leaf_calls` lists the same leaf layer calls statically, with their input shapes.
- :func:`trainable_weights` is what the engine differentiates through a layer: the variables of
  the layer and its sub-layers whose own flag is set, as ``Model.trainable_weights`` collects them
  (KerasHub's ``enable_lora`` freezes containers but not their LoRA projections).
- :func:`attention_projections`, :func:`attention_mask`, :func:`attend`, :func:`keras_mask` and
  :func:`set_mask` name ``MultiHeadAttention``'s private parts and Keras's mask storage for the
  attention rule (:mod:`dpcore.rules.attention`), which replays the layer's call from them, so
  this module stays the only one touching Keras internals. :func:`transformer_parts`,
  :func:`padding_attention_mask` and :func:`decoder_self_attention_mask` do the same for KerasHub's
  ``TransformerEncoder``/``TransformerDecoder``, and :func:`masked_lm_head_parts` for its
  ``MaskedLMHead`` (:mod:`dpcore.rules.keras_hub`; KerasHub is imported only when one of them is
  called). It imports nothing from dpcore.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask
from keras.src.models.functional import Functional
from keras.src.models.sequential import Sequential

LayerFn = Callable[[Any, tuple, dict], Any]


def walk_reason(model: Any) -> str | None:
    """None when ``model`` can be replayed layer by layer, else a human-readable reason."""
    name = type(model).__name__
    if isinstance(model, Sequential):
        if type(model).call is not Sequential.call:
            return f"{name} subclasses Sequential with its own call()"
        if not model.built:
            return f"Sequential model {model.name!r} is not built yet"
        return None
    if isinstance(model, Functional):
        if type(model).call is not Functional.call:
            return f"{name} subclasses a functional model with its own call()"
        return None
    if isinstance(model, keras.Model):
        return (
            f"{name} is a subclassed model: its call() is arbitrary Python, so its layer graph "
            "cannot be replayed"
        )
    return f"{name} is not a Keras model"


def _is_walkable(op: Any) -> bool:
    return isinstance(op, (Sequential, Functional)) and walk_reason(op) is None


def _inject_training(op: Any, kwargs: dict, training: Any) -> dict:
    if training is not None and "training" in getattr(op, "_call_context_args", {}):
        kwargs = dict(kwargs)
        kwargs["training"] = training
    return kwargs


def _dispatch(op: Any, args: tuple, kwargs: dict, training: Any, layer_fn: LayerFn) -> Any:
    if _is_walkable(op):
        inner_training = kwargs.get("training", training)
        return run(op, args[0], training=inner_training, layer_fn=layer_fn)
    if isinstance(op, keras.layers.Layer):
        return layer_fn(op, args, kwargs)
    return op(*args, **kwargs)


def run(model: Any, inputs: Any, *, training: Any, layer_fn: LayerFn) -> Any:
    """``model(inputs, training=training)`` with every leaf layer call routed through ``layer_fn``.

    Raises:
      ValueError: if the model cannot be replayed (see :func:`walk_reason`).
    """
    reason = walk_reason(model)
    if reason:
        raise ValueError(reason)
    if isinstance(model, Sequential):
        if model._functional is not None:
            return run(model._functional, inputs, training=training, layer_fn=layer_fn)
        x, mask = inputs, None
        for layer in model.layers:
            kwargs: dict[str, Any] = {}
            if getattr(layer, "_call_has_mask_arg", False) and mask is not None:
                kwargs["mask"] = mask
            kwargs = _inject_training(layer, kwargs, training)
            x = _dispatch(layer, (x,), kwargs, training, layer_fn)
            mask = get_keras_mask(x) if not isinstance(x, (list, tuple, dict)) else None
        return x
    flat = model._standardize_inputs(inputs)

    def operation_fn(op: Any) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            return _dispatch(op, args, _inject_training(op, kwargs, training), training, layer_fn)

        return call

    outputs = model._run_through_graph(flat, operation_fn=operation_fn)
    if isinstance(outputs, list) and len(outputs) == 1:
        return outputs[0]
    return outputs


def trainable_weights(layer: Any) -> list[Any]:
    """The variables of ``layer`` and its sub-layers that training updates (their own flag set).

    ``layer.trainable_variables`` is empty for a layer marked non-trainable even when a sub-layer's
    variables are trainable, yet ``Model.trainable_weights`` (what optimizers update) filters the
    model's variables by their own flags: KerasHub's ``Backbone.enable_lora`` freezes every layer
    and then unfreezes the LoRA projections inside the (still non-trainable) transformer layers.
    """
    return [v for v in layer.weights if v.trainable]


def sublayers(layer: Any) -> list[Any]:
    """The direct sub-layers of ``layer`` (tracked attributes), in creation order."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def propagate_mask(layer: Any, args: tuple, outputs: Any) -> None:
    """Sets the Keras mask ``layer.compute_mask`` gives on ``outputs`` (what ``__call__`` does)."""
    if not getattr(layer, "supports_masking", False) or not args:
        return
    first = args[0]
    previous = None
    try:
        previous = get_keras_mask(first)
    except Exception:  # noqa: BLE001 - non-tensor inputs carry no mask
        previous = None
    mask = layer.compute_mask(first, previous)
    if mask is not None and get_keras_mask(outputs) is None:
        set_keras_mask(outputs, mask)


def _leaf_nodes(model: Any) -> Iterator[tuple[Any, Any]]:
    """``(operation, node)`` for each leaf call of a replayable model, nested models expanded,
    in graph order; ``node`` is None for the layers of a Sequential without a graph."""
    if isinstance(model, Sequential) and walk_reason(model) is None:
        if model._functional is not None:
            yield from _leaf_nodes(model._functional)
            return
        for layer in model.layers:
            if _is_walkable(layer):
                yield from _leaf_nodes(layer)
            else:
                yield layer, None
        return
    if not isinstance(model, Functional) or walk_reason(model) is not None:
        return
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            op = node.operation
            if not op or node.is_input:
                continue
            if _is_walkable(op):
                yield from _leaf_nodes(op)
            else:
                yield op, node


def leaf_calls(model: Any) -> Iterator[tuple[Any, list[Any]]]:
    """``(layer, [input shape per input])`` for each leaf layer call, in graph order.

    Layers of a model that cannot be replayed are not listed (the caller reports the model).
    """
    for op, node in _leaf_nodes(model):
        if isinstance(op, keras.layers.Layer):
            yield op, [None] if node is None else [tuple(t.shape) for t in node.input_tensors]


def op_variables(model: Any) -> Iterator[tuple[str, Any]]:
    """``(op name, variable)`` for each variable passed directly to a non-layer op of the graph.

    E.g. ``keras.ops.matmul(h, dense.kernel)`` in a Functional model reads ``dense.kernel``
    outside ``dense``'s call, where no per-layer rule sees it.
    """
    for op, node in _leaf_nodes(model):
        if isinstance(op, keras.layers.Layer) or node is None:
            continue
        arguments = getattr(node, "arguments", None)
        values = tf.nest.flatten((getattr(arguments, "args", ()), getattr(arguments, "kwargs", {})))
        for v in values:
            if isinstance(v, (keras.Variable, tf.Variable)):
                yield getattr(op, "name", type(op).__name__), v


# MultiHeadAttention internals, for the attention rule (dpcore.rules.attention), which replays the
# layer's call from these accessors: the private attributes and methods are named here only.


def keras_mask(x: Any) -> Any:
    """The Keras mask carried by tensor ``x`` (None when it has none)."""
    return get_keras_mask(x)


def set_mask(x: Any, mask: Any) -> None:
    """Sets (or, with None, clears) the Keras mask carried by tensor ``x``."""
    set_keras_mask(x, mask)


def attention_projections(layer: Any) -> dict[str, Any]:
    """The projection sub-layers of a ``MultiHeadAttention``, in call order:
    ``{"gate": ..., "query": ..., "key": ..., "value": ..., "output": ...}`` (``"gate"`` only when
    the layer uses a gate)."""
    names = {"query": "_query_dense", "key": "_key_dense", "value": "_value_dense"}
    if getattr(layer, "_use_gate", False):
        names = {"gate": "_gate_dense", **names}
    names["output"] = "_output_dense"
    return {role: getattr(layer, attr) for role, attr in names.items()}


def attention_mask(layer: Any, query: Any, value: Any, **masks: Any) -> Any:
    """``MultiHeadAttention._compute_attention_mask``: the layer's own merge of Keras and explicit
    masks (``query_mask``, ``value_mask``, ``key_mask``, ``attention_mask``, ``use_causal_mask``)."""
    return layer._compute_attention_mask(query, value, **masks)


def attend(
    layer: Any,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    training: Any,
    return_attention_scores: bool,
) -> tuple[Any, Any]:
    """``MultiHeadAttention._compute_attention`` on projected ``query``/``key``/``value``: the
    softmax attention, its dropout included; returns ``(output, scores)``."""
    return layer._compute_attention(query, key, value, mask, training, return_attention_scores)


# KerasHub transformer layers, for dpcore.rules.keras_hub (private attributes named here only).

_TRANSFORMER_PARTS = (
    "self_attention_layer",
    "self_attention_layer_norm",
    "self_attention_dropout",
    "cross_attention_layer",
    "cross_attention_layer_norm",
    "cross_attention_dropout",
    "feedforward_layer_norm",
    "feedforward_intermediate_dense",
    "feedforward_output_dense",
    "feedforward_dropout",
)


def transformer_parts(layer: Any) -> dict[str, Any]:
    """The sub-layers of a KerasHub ``TransformerEncoder``/``TransformerDecoder`` by role
    (``"self_attention_layer"``, ..., ``"feedforward_dropout"``); a role the layer does not have
    (cross-attention of an encoder, or of a decoder built without an encoder sequence) is None."""
    return {role: getattr(layer, "_" + role, None) for role in _TRANSFORMER_PARTS}


def padding_attention_mask(inputs: Any, padding_mask: Any, attention_mask: Any) -> Any:
    """KerasHub's merge of a ``[B, T]`` padding mask (or the Keras mask of ``inputs``) with a
    ``[B, T, S]`` attention mask, as its transformer layers compute it (None when neither)."""
    from keras_hub.src.layers.modeling.transformer_layer_utils import (
        merge_padding_and_attention_mask,
    )

    return merge_padding_and_attention_mask(inputs, padding_mask, attention_mask)


def decoder_self_attention_mask(layer: Any, **masks: Any) -> Any:
    """``TransformerDecoder._compute_self_attention_mask``: padding, custom and causal masks of the
    self-attention (``decoder_sequence``, ``decoder_padding_mask``, ``decoder_attention_mask``,
    ``use_causal_mask``, ``self_attention_cache``, ``self_attention_cache_update_index``)."""
    return layer._compute_self_attention_mask(**masks)


def masked_lm_head_parts(layer: Any) -> dict[str, Any]:
    """The parts of a KerasHub ``MaskedLMHead`` by role: ``"intermediate_dense"`` and
    ``"intermediate_layer_norm"`` (sub-layers), ``"token_embedding"`` (the tied
    ``ReversibleEmbedding`` whose reverse call projects to the vocabulary, or None), ``"kernel"``
    (the head's own output kernel when it has no token embedding, else None) and ``"bias"``."""
    return {
        "intermediate_dense": layer._intermediate_dense,
        "intermediate_layer_norm": layer._intermediate_layer_norm,
        "token_embedding": layer.token_embedding,
        "kernel": getattr(layer, "_kernel", None) if layer.token_embedding is None else None,
        "bias": layer._bias,
    }
