"""Rule for ``keras.layers.MultiHeadAttention``.

Contract: the layer is a composition: its query/key/value/output projections (and gate, when
used) are ``EinsumDense`` layers and the attention itself has no variables. The rule's
``compose`` (:func:`replay_multi_head_attention`) replays the layer's call so that each projection
is recorded by the engine with the ``EinsumDense`` rule (ghost or materialized by cost) and the
attention runs once, dropout included, exactly as in a plain forward pass. The layer's private
parts (projections, mask merge, attention core) and Keras mask storage are reached through the
accessors of :mod:`dpcore.engine.graph`, the one module that touches Keras internals.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import keras

from dpcore.engine import graph
from dpcore.rules.base import LayerRule
from dpcore.rules.dense import EINSUM_DENSE


def replay_multi_head_attention(
    layer: Any, args: tuple, kwargs: dict, call: Callable[[Any, tuple, dict], Any]
) -> Any:
    """``layer(*args, **kwargs)`` for a ``MultiHeadAttention``, projections through ``call``.

    Mirrors ``MultiHeadAttention.call`` (Keras 3): Keras masks of the inputs and the explicit
    masks are merged by the layer's own mask computation; its attention core does the softmax
    attention (and its dropout) exactly once, as in a plain forward pass.
    """
    bound = inspect.signature(layer.call).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    query, value = a["query"], a["value"]
    key = value if a.get("key") is None else a["key"]
    training = a.get("training")
    query_mask = graph.keras_mask(query)
    value_mask = a.get("value_mask")
    if value_mask is None:
        value_mask = graph.keras_mask(value)
    key_mask = a.get("key_mask")
    if key_mask is None and a.get("key") is not None:
        key_mask = graph.keras_mask(key)
    attention_mask = graph.attention_mask(
        layer,
        query,
        value,
        query_mask=query_mask,
        value_mask=value_mask,
        key_mask=key_mask,
        attention_mask=a.get("attention_mask"),
        use_causal_mask=a.get("use_causal_mask", False),
    )
    proj = graph.attention_projections(layer)
    gate = call(proj["gate"], (query,), {}) if "gate" in proj else None
    q = call(proj["query"], (query,), {})
    k = call(proj["key"], (key,), {})
    v = call(proj["value"], (value,), {})
    for t in (q, k, v):
        graph.set_mask(t, None)
    return_scores = a.get("return_attention_scores", False)
    output, scores = graph.attend(layer, q, k, v, attention_mask, training, return_scores)
    if gate is not None:
        output = output * gate
    output = call(proj["output"], (output,), {})
    graph.set_mask(output, None)
    if query_mask is not None:
        graph.set_mask(output, query_mask)
    if return_scores:
        return output, scores
    return output


def _check(layer: Any) -> str | None:
    for sub in graph.attention_projections(layer).values():
        if type(sub) is not keras.layers.EinsumDense:
            return f"projection {sub.name!r} is a {type(sub).__name__}, not an EinsumDense"
        reason = EINSUM_DENSE.check(sub)
        if reason:
            return reason
    return None


def _plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    parts = []
    paths = set()
    for role, sub in graph.attention_projections(layer).items():
        shape = None
        if input_shapes and input_shapes[0] is not None:
            if role == "output":
                shape = (*input_shapes[0][:-1], layer.num_heads, layer.value_dim)
            else:
                shape = input_shapes[0]
        path, _ = EINSUM_DENSE.plan(sub, [shape])
        paths.add(path)
        parts.append(f"{sub.name}: {path}")
    path = "ghost" if paths == {"ghost"} else "materialized"
    return path, "projections by the EinsumDense rule (" + ", ".join(parts) + ")"


MULTI_HEAD_ATTENTION = LayerRule(
    name="multi_head_attention",
    check=_check,
    plan=_plan,
    compose=replay_multi_head_attention,
)
