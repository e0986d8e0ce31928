"""Rule for ``keras.layers.MultiHeadAttention``.

Contract: the layer is a composition: its query/key/value/output projections are ``EinsumDense``
layers and the attention itself has no variables. The rule replays the layer's call
(:func:`dpcore.engine.graph.replay_multi_head_attention`) so that each projection is recorded by
the engine with the ``EinsumDense`` rule (ghost or materialized by cost) and the attention runs once,
dropout included, exactly as in a plain forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from dpcore.engine import graph
from dpcore.engine.registry import LayerRule
from dpcore.rules.dense import EINSUM_DENSE


def _check(layer: Any) -> str | None:
    for sub in graph.attention_sublayers(layer):
        if type(sub) is not keras.layers.EinsumDense:
            return f"projection {sub.name!r} is a {type(sub).__name__}, not an EinsumDense"
        reason = EINSUM_DENSE.check(sub)
        if reason:
            return reason
    return None


def _unused(*args: Any) -> Any:
    raise NotImplementedError("MultiHeadAttention is summarized through its projections")


def _plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    parts = []
    paths = set()
    for sub in graph.attention_sublayers(layer):
        shape = None
        if input_shapes and input_shapes[0] is not None:
            if sub is layer._output_dense:
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
    forward=_unused,
    activate=_unused,
    grads=_unused,
    plan=_plan,
    compose=graph.replay_multi_head_attention,
)
