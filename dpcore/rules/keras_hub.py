"""Rules for KerasHub's transformer layers and embeddings (registered only when KerasHub imports).

Contract:
- :func:`keras_hub_rules` returns ``{layer class: LayerRule}`` for ``keras_hub.layers``
  ``TransformerEncoder``, ``TransformerDecoder``, ``CachedMultiHeadAttention`` (the decoder's
  attention), ``ReversibleEmbedding``, ``PositionEmbedding``, ``TokenAndPositionEmbedding`` and
  ``MaskedLMHead`` once ``keras_hub`` is imported, else an empty mapping: KerasHub is an optional dependency that
  dpcore never imports itself (a model with KerasHub layers has imported it). ``keras.layers.ReversibleEmbedding`` (the Keras class
  KerasHub's subclasses) has its rule in :func:`dpcore.rules.builtin_rules` either way.
- The transformer layers and ``TokenAndPositionEmbedding`` are compositions: their rules'
  ``compose`` replay the layer's call (masks, residuals, dropout and, for the decoder, the key/value
  cache exactly as KerasHub 0.32 computes them), routing every sub-layer through the engine's
  ``call``, so each ``Dense``, ``LayerNormalization`` and attention projection is recorded with its
  own rule (and a sub-layer without one falls back alone). The layers' private parts are reached
  through :mod:`dpcore.engine.graph`.
- ``ReversibleEmbedding`` is one variable with two uses: the lookup ``E[ids]`` and, with
  ``reverse=True``, the output projection ``h @ E^T`` (tied weights). An example's gradient of
  ``E`` is the *sum* of both: the lookup adds ``onehot(ids)^T G`` and the projection
  ``dlogits^T H``, i.e. ``A^T G`` with the positions of both uses stacked (``A = [onehot(ids);
  dlogits]``, ``G = [G; H]``), so the ghost identity or the materialized product of
  :mod:`dpcore.rules.linear` counts the cross terms between the uses and the clipped sum is one
  weighted product. With only lookups it is the ``Embedding`` rule's same-id sums (no one-hot);
  with untied weights the reverse kernel is a plain linear map of its own. ``logit_soft_cap`` is
  the activation of the reverse use.
- ``MaskedLMHead`` (``BertMaskedLM``'s head) is a composition that owns variables itself: its
  rule's ``compose`` gathers the masked positions and routes the intermediate ``Dense`` and
  ``LayerNormalization`` through ``call``, and the reverse call of its tied ``token_embedding``
  too, so that projection is one more use of the backbone's ``ReversibleEmbedding`` (whose rule
  sums it with the lookups, cross terms included); it then calls the head itself through ``call``,
  which records the head's own ``output_bias`` (and, untied, ``output_kernel``) with the rule's
  ``forward``/``grads``.
- ``PositionEmbedding`` reads rows ``start_index .. start_index + T`` (or ``positions``) of its
  table for every example: the ``Embedding`` rule's same-id sums with those ids.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from dpcore import norms
from dpcore.engine import graph
from dpcore.rules import linear
from dpcore.rules.attention import MULTI_HEAD_ATTENTION
from dpcore.rules.base import LayerRule, Use, VariableGrad, from_per_example, unsupported_variant
from dpcore.rules.dense import DENSE, EINSUM_DENSE, outer_grad
from dpcore.rules.embedding import embedding_forward, id_rows_grad, id_uses
from dpcore.rules.normalization import LAYER_NORMALIZATION

__all__ = [
    "CACHED_MULTI_HEAD_ATTENTION",
    "MASKED_LM_HEAD",
    "POSITION_EMBEDDING",
    "REVERSIBLE_EMBEDDING",
    "TOKEN_AND_POSITION_EMBEDDING",
    "TRANSFORMER_DECODER",
    "TRANSFORMER_ENCODER",
    "keras_hub_rules",
]

Call = Callable[[Any, tuple, dict], Any]


def _arguments(layer: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, defaults applied; context arguments the ``call`` does not
    take (``training`` injected for every layer) are dropped, as ``Layer.__call__`` does."""
    signature = inspect.signature(layer.call)
    kwargs = {k: v for k, v in kwargs.items() if k in signature.parameters}
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


# ---------------------------------------------------------------------- ReversibleEmbedding


def _reverse(args: tuple, kwargs: dict) -> bool:
    return bool(kwargs.get("reverse", args[1] if len(args) > 1 else False))


def _reversible_forward(layer: Any, args: tuple, kwargs: dict) -> tuple[Any, dict]:
    if not _reverse(args, kwargs):
        z, capture = embedding_forward(layer, args[:1], {})
        if layer.mask_zero:  # the layer's call sets the Embedding mask itself
            graph.set_mask(z, tf.not_equal(tf.convert_to_tensor(args[0]), 0))
        return z, {**capture, "reverse": False}
    h = tf.convert_to_tensor(args[0])
    kernel = tf.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
    kernel = tf.convert_to_tensor(kernel)
    if layer.reverse_dtype is not None:
        h, kernel = tf.cast(h, layer.reverse_dtype), tf.cast(kernel, layer.reverse_dtype)
    elif h.dtype != kernel.dtype:
        h = tf.cast(h, kernel.dtype)
    # A dict marks the reverse use for ``activate`` (the soft cap applies to logits only).
    return {"logits": keras.ops.matmul(h, kernel)}, {"h": h, "reverse": True}


def _reversible_activate(layer: Any, z: Any) -> Any:
    if not isinstance(z, dict):
        return z
    logits = z["logits"]
    cap = layer.logit_soft_cap
    return logits if cap is None else keras.ops.tanh(logits / cap) * cap


def _reversible_grads(layer: Any, uses: Sequence[Use]) -> list[VariableGrad]:
    dim = int(layer.output_dim)
    lookups = [u for u in uses if not u.capture["reverse"]]
    projections = [u for u in uses if u.capture["reverse"]]
    ids = g = h = dlogits = None
    if lookups:
        ids, g = id_uses(lookups, dim)
    if projections:
        h = tf.concat(
            [linear.as_sequence(tf.cast(u.capture["h"], tf.float32)) for u in projections], 1
        )
        dlogits = tf.concat(
            [linear.as_sequence(tf.cast(u.grad["logits"], tf.float32)) for u in projections], 1
        )
    table = layer.embeddings
    if not layer.tie_weights:
        out = [] if ids is None else [id_rows_grad(table, ids, g)]
        if h is not None:
            # [dim, vocab] = H^T dlogits
            out.append(outer_grad(layer.reverse_embeddings, h, dlogits))
        return out
    if h is None:
        return [id_rows_grad(table, ids, g)]
    if ids is None:
        return [outer_grad(table, dlogits, h)]  # [vocab, dim] = dlogits^T H
    return [_tied_grad(table, ids, g, dlogits, h)]


def _tied_costs(lookups: int, projections: int, vocab: int, dim: int) -> tuple[int, int]:
    """Multiply-adds per example of the Gram-block ghost norm (``P^2 V + T^2 D``) and of the
    materialized kernels (``T V D``), ``T = L + P``."""
    t = lookups + projections
    return projections * projections * vocab + t * t * dim, t * vocab * dim


def _tied_path(lookups: int | None, projections: int | None, vocab: int, dim: int) -> str:
    """Ghost (Gram blocks, :func:`_tied_grad`) or materialized ``[B, vocab, dim]``, by cost."""
    if lookups is None or projections is None:
        return "ghost"
    ghost, mat = _tied_costs(lookups, projections, vocab, dim)
    return "ghost" if ghost <= mat else "materialized"


def _tied_grad(
    table: Any, ids: tf.Tensor, g: tf.Tensor, dlogits: tf.Tensor, h: tf.Tensor
) -> VariableGrad:
    """The tied table's gradient info: lookups at ``ids [B, L]`` with output gradients
    ``g [B, L, dim]`` and the projection of ``h [B, P, dim]`` with logit gradients
    ``dlogits [B, P, vocab]``.

    The example's gradient is ``A^T [G; H]`` with ``A = [onehot(ids); dlogits]`` (cross terms
    between the uses included), never formed: on the ghost path the Gram matrix of ``A``'s
    (scaled) rows is assembled from blocks, the one-hot block by comparing ids, the cross block by
    gathering the logit gradients at the ids (one rounded product each) and only the logit block
    by a matmul over the vocabulary; :func:`dpcore.norms.gram_sq_norm_bound` certifies the norm.
    The materialized path forms ``[B, vocab, dim]`` as ``dlogits^T H`` plus the lookups' rows
    added at their ids. Neither holds a ``[B, L + P, vocab]`` one-hot operand; the clipped sum is a
    segment sum of the weighted lookup gradients plus one weighted product over the positions.

    Privacy:
      Row ``i`` of the norms depends on example ``i`` only, and bounds what the clipped sum adds.
    """
    vocab, dim = int(table.shape[0]), int(table.shape[1])
    b = tf.shape(ids)[0]
    path = _tied_path(ids.shape[1], dlogits.shape[1], vocab, dim)
    if path == "materialized":
        per_example = linear.materialize(dlogits, h)  # [B, vocab, dim]
        rows = tf.broadcast_to(tf.range(b, dtype=ids.dtype)[:, None], tf.shape(ids))
        per_example = tf.tensor_scatter_nd_add(per_example, tf.stack([rows, ids], -1), g)
        return from_per_example(table, per_example, path=path)
    # Scale each example to magnitude 1 as dpcore.norms.scaled_gram divides a dense operand: the
    # one-hot entries are 1, so the scale is max(1, max |dlogits|) and the lookup rows become
    # r * onehot.
    m = norms.abs_max(dlogits, axis=[1, 2])  # no [B, P, vocab] copy of |dlogits|
    ma = tf.where(tf.math.is_nan(m), m, tf.maximum(m, 1.0))
    # Scaled by division (a reciprocal of a scale above 2^126 would flush to zero and take every
    # scaled entry with it): the one-hot rows become 1 / ma, which may flush like any Gram entry.
    r = 1.0 / ma  # [B]
    ma1 = ma[:, None, None]
    same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), tf.float32) * (r * r)[:, None, None]
    # Gathered first, then scaled: the same float32 values as gathering the scaled logits.
    cross = tf.transpose(tf.gather(dlogits, ids, axis=2, batch_dims=1) / ma1, [0, 2, 1]) / ma1
    logits_block = _scaled_gram(dlogits, ma1)  # [B, P, P]
    aa = tf.concat(
        [
            tf.concat([same, cross], 2),
            tf.concat([tf.transpose(cross, [0, 2, 1]), logits_block], 2),
        ],
        1,
    )
    gg, sg, mg = norms.scaled_gram(tf.concat([g, h], 1))
    sq = norms.gram_sq_norm_bound(
        aa, gg, d=vocab, p=dim, a_scale=ma, g_scale=sg, a_max=ma, g_max=mg, contribution=True
    )
    err = norms.outer_sum_error(norms.dim(aa, 1), vocab, dim, ma, mg)

    def weighted_sum(w: tf.Tensor) -> tf.Tensor:
        w = tf.reshape(tf.cast(w, tf.float32), [-1, 1, 1])
        looked_up = tf.math.unsorted_segment_sum(
            tf.reshape(g * w, [-1, dim]), tf.reshape(ids, [-1]), vocab
        )
        projected = tf.matmul(
            tf.reshape(dlogits, [-1, vocab]), tf.reshape(h * w, [-1, dim]), transpose_a=True
        )
        return tf.cast(looked_up + projected, table.dtype)

    return VariableGrad(
        variable=table, sq_norm=sq, weighted_sum=weighted_sum, path="ghost", sum_error=err
    )


# Vocabulary columns per piece of the logit block's Gram matrix (see _scaled_gram). Each piece's
# product is an XLA program whose buffers add to the step's peak memory: wider pieces raise the
# peak, narrower ones gain no speed.
_GRAM_COLUMNS = 1024


def _scaled_gram(x: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
    """``(x / scale)(x / scale)^T`` for ``x [B, P, V]`` and ``scale [B, 1, 1]``, over ``V`` in pieces of
    ``_GRAM_COLUMNS`` columns, one after another: only one piece of the scaled operand exists at a
    time, never a second ``[B, P, V]`` tensor (at GPT-2's vocabulary, a copy the size of the
    logits, the step's largest tensors). The pieces' products are summed in float32, which is one
    more summation order of each entry's dot product of length ``V``: the error model of
    :func:`dpcore.norms.gram_sq_norm_bound` holds as for one matmul."""
    v = int(x.shape[-1])
    total = None
    for start in range(0, v, _GRAM_COLUMNS):
        after: list[tf.Tensor] = [] if total is None else [total]
        with tf.control_dependencies(after):  # the next piece is cut once the last one is used
            piece = x[:, :, start : start + _GRAM_COLUMNS] / scale
        product = norms.gram(piece)
        total = product if total is None else total + product
    return total


def _is_reverse_shape(layer: Any, shape: Any) -> bool:
    # Static shapes only (for reports): the lookup takes ids, the projection [..., output_dim].
    return shape is not None and len(shape) >= 3 and shape[-1] == layer.output_dim


def _reversible_plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    reverse = [s for s in input_shapes if _is_reverse_shape(layer, s)]
    if not reverse:
        return "ghost", "same-id sums of output gradients (sorted segments), no [B, vocab, dim]"
    t: int | None = 0
    for s in reverse:
        n = linear.static_positions(s)
        t = None if (t is None or n is None) else t + n
    if not layer.tie_weights:
        path, why = linear.choose_path(t, layer.output_dim, layer.input_dim)
        return path, f"lookups: same-id sums; untied reverse kernel: {why}"
    looked: int | None = 0
    for s in input_shapes:  # the lookups' positions (every id of each)
        if not _is_reverse_shape(layer, s):
            n = None if s is None or None in s[1:] else math.prod(s[1:])
            looked = None if (looked is None or n is None) else looked + n
    if looked == 0:
        path, why = linear.choose_path(t, layer.input_dim, layer.output_dim)
        return path, f"tied table, reverse projection only: {why}"
    vocab, dim = int(layer.input_dim), int(layer.output_dim)
    path = _tied_path(looked, t, vocab, dim)
    if looked is None or t is None:
        sizes = "unknown T: ghost keeps memory O(T^2)"
    else:
        ghost, mat = _tied_costs(looked, t, vocab, dim)
        sizes = (
            f"T={looked + t} ({looked} looked up, {t} projected): P^2 V + T^2 D={ghost}, TVD={mat}"
        )
    how = (
        "Gram blocks: one-hot rows by id equality, cross terms by gathers, logits by a matmul"
        if path == "ghost"
        else "[B, vocab, dim] as dlogits^T H plus the lookups' rows"
    )
    return path, f"tied table, lookup and reverse projection as one A^T G ({how}; {sizes})"


def _reversible_check(layer: Any) -> str | None:
    return unsupported_variant(layer) or _built(layer)


REVERSIBLE_EMBEDDING = LayerRule(
    name="reversible_embedding",
    check=_reversible_check,
    forward=_reversible_forward,
    activate=_reversible_activate,
    grads=_reversible_grads,
    plan=_reversible_plan,
)


# ------------------------------------------------------------------------ PositionEmbedding


def _position_forward(layer: Any, args: tuple, kwargs: dict) -> tuple[tf.Tensor, dict]:
    a = _arguments(layer, args, kwargs)
    inputs = tf.convert_to_tensor(a["inputs"])
    shape = tf.shape(inputs)
    positions = a.get("positions")
    if positions is None:
        start = tf.cast(a.get("start_index", 0), tf.int32)
        ids = start + tf.range(shape[-2], dtype=tf.int32)
    else:
        ids = tf.cast(positions, tf.int32)
    ids = tf.broadcast_to(ids, shape[:-1])  # one row of the table per position of every example
    z = keras.ops.take(layer.position_embeddings, ids, axis=0)
    return keras.ops.cast(z, layer.compute_dtype), {"ids": ids}


def _position_grads(layer: Any, uses: Sequence[Use]) -> list[VariableGrad]:
    table = layer.position_embeddings
    return [id_rows_grad(table, *id_uses(uses, int(table.shape[-1])))]


def _position_plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    return "ghost", "rows read per position: same-id sums of output gradients, no [B, T, dim] table"


POSITION_EMBEDDING = LayerRule(
    name="position_embedding",
    forward=_position_forward,
    activate=lambda layer, z: z,
    grads=_position_grads,
    plan=_position_plan,
)


# ------------------------------------------------------------------- TokenAndPositionEmbedding


def replay_token_and_position_embedding(layer: Any, args: tuple, kwargs: dict, call: Call) -> Any:
    """``TokenAndPositionEmbedding.call`` with its two embeddings routed through ``call``."""
    a = _arguments(layer, args, kwargs)
    extra = {k: a[k] for k in ("start_index", "positions") if k in a}
    tokens = call(layer.token_embedding, (a["inputs"],), {})
    positions = call(layer.position_embedding, (tokens,), extra)
    outputs = tokens + positions
    mask = graph.keras_mask(tokens)
    if mask is not None:
        graph.set_mask(outputs, mask)
    return outputs


def _built(layer: Any) -> str | None:
    return None if layer.built else f"{type(layer).__name__} {layer.name!r} is not built"


def _embeddings_plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    return "ghost", "token and position rows: same-id sums of output gradients"


TOKEN_AND_POSITION_EMBEDDING = LayerRule(
    name="token_and_position_embedding",
    check=_built,
    plan=_embeddings_plan,
    compose=replay_token_and_position_embedding,
)


# --------------------------------------------------------------------- CachedMultiHeadAttention


def replay_cached_attention(layer: Any, args: tuple, kwargs: dict, call: Call) -> Any:
    """``CachedMultiHeadAttention.call`` with its projections routed through ``call``: the key/value
    cache is read and updated as the layer does; the attention core (softmax, dropout) runs once.

    The update (``keras.ops.slice_update``) has no TensorFlow gradient, as in the layer itself: a
    step that writes the cache is differentiable only where nothing trainable feeds the new keys
    and values (reading a cache, ``cache_update_index=None``, is differentiable)."""
    a = _arguments(layer, args, kwargs)
    query, value = a["query"], a["value"]
    key = value if a.get("key") is None else a["key"]
    cache, index = a.get("cache"), a.get("cache_update_index")
    return_scores = a.get("return_attention_scores", False)
    proj = graph.attention_projections(layer)
    q = call(proj["query"], (query,), {})
    if cache is not None:
        key_cache, value_cache = cache[:, 0, ...], cache[:, 1, ...]
        if index is None:
            k, v = key_cache, value_cache
        else:
            start = [0, index, 0, 0]
            k = keras.ops.slice_update(key_cache, start, call(proj["key"], (key,), {}))
            v = keras.ops.slice_update(value_cache, start, call(proj["value"], (value,), {}))
            cache = keras.ops.stack((k, v), axis=1)
    else:
        if index is not None:
            raise ValueError(
                f"`cache_update_index` should not be set if `cache` is `None`. Received: "
                f"cache={cache}, cache_update_index={index}"
            )
        k = call(proj["key"], (key,), {})
        v = call(proj["value"], (value,), {})
    for t in (q, k, v):
        graph.set_mask(t, None)
    output, scores = graph.attend(
        layer, q, k, v, a.get("attention_mask"), a.get("training"), return_scores
    )
    output = call(proj["output"], (output,), {})
    graph.set_mask(output, graph.keras_mask(query))
    if return_scores and cache is not None:
        return output, scores, cache
    if return_scores:
        return output, scores
    if cache is not None:
        return output, cache
    return output


def _attention_plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    shape = input_shapes[0] if input_shapes else None
    parts = {}
    for role, sub in graph.attention_projections(layer).items():
        if role == "gate":
            continue
        sub_shape = shape
        if role == "output" and shape is not None:
            sub_shape = (*shape[:-1], layer.num_heads, layer.value_dim)
        parts[sub.name] = _sub_plan(EINSUM_DENSE, sub, sub_shape)
    return _combine(parts)


CACHED_MULTI_HEAD_ATTENTION = LayerRule(
    name="cached_multi_head_attention",
    check=MULTI_HEAD_ATTENTION.check,  # the same projections, all EinsumDense
    plan=_attention_plan,
    compose=replay_cached_attention,
)


# ------------------------------------------------------------ TransformerEncoder / Decoder


def _sublayer(call: Call, layer: Any, x: Any, **kwargs: Any) -> Any:
    return call(layer, (x,), kwargs)


def _feedforward(layer: Any, parts: dict, x: Any, training: Any, call: Call) -> Any:
    residual = x
    if layer.normalize_first:
        x = _sublayer(call, parts["feedforward_layer_norm"], x)
    x = _sublayer(call, parts["feedforward_intermediate_dense"], x)
    x = _sublayer(call, parts["feedforward_output_dense"], x)
    x = _sublayer(call, parts["feedforward_dropout"], x, training=training)
    x = x + residual
    if not layer.normalize_first:
        x = _sublayer(call, parts["feedforward_layer_norm"], x)
    return x


def replay_transformer_encoder(layer: Any, args: tuple, kwargs: dict, call: Call) -> Any:
    """``TransformerEncoder.call`` with every sub-layer routed through ``call``."""
    a = _arguments(layer, args, kwargs)
    inputs, training = a["inputs"], a.get("training")
    return_scores = a.get("return_attention_scores", False)
    parts = graph.transformer_parts(layer)
    mask = graph.padding_attention_mask(inputs, a.get("padding_mask"), a.get("attention_mask"))
    x = residual = inputs
    if layer.normalize_first:
        x = _sublayer(call, parts["self_attention_layer_norm"], x)
    attend = {"query": x, "value": x, "attention_mask": mask, "training": training}
    if return_scores:
        attend["return_attention_scores"] = True
        x, scores = call(parts["self_attention_layer"], (), attend)
    else:
        x = call(parts["self_attention_layer"], (), attend)
    x = _sublayer(call, parts["self_attention_dropout"], x, training=training)
    x = x + residual
    if not layer.normalize_first:
        x = _sublayer(call, parts["self_attention_layer_norm"], x)
    x = _feedforward(layer, parts, x, training, call)
    graph.propagate_mask(layer, (inputs,), x)
    return (x, scores) if return_scores else x


def _attention_block(
    layer: Any,
    parts: dict,
    kind: str,
    *,
    x: Any,
    value: Any,
    mask: Any,
    cache: Any,
    index: Any,
    training: Any,
    call: Call,
) -> tuple[Any, Any]:
    """A decoder's residual ``kind`` ("self" or "cross") attention block: ``(x, updated cache)``.
    ``value`` None attends to ``x`` itself (after the pre-normalization, if any)."""
    norm = parts[f"{kind}_attention_layer_norm"]
    residual = x
    if layer.normalize_first:
        x = _sublayer(call, norm, x)
    attend = {"query": x, "value": x if value is None else value, "attention_mask": mask}
    attend.update(cache=cache, cache_update_index=index, training=training)
    out = call(parts[f"{kind}_attention_layer"], (), attend)
    x, cache = (out, None) if cache is None else out
    x = _sublayer(call, parts[f"{kind}_attention_dropout"], x, training=training)
    x = x + residual
    if not layer.normalize_first:
        x = _sublayer(call, norm, x)
    return x, cache


def replay_transformer_decoder(layer: Any, args: tuple, kwargs: dict, call: Call) -> Any:
    """``TransformerDecoder.call`` with every sub-layer routed through ``call`` (self- and
    cross-attention, causal and padding masks, key/value caches as the layer handles them)."""
    a = _arguments(layer, args, kwargs)
    decoder, encoder = a["decoder_sequence"], a.get("encoder_sequence")
    training = a.get("training")
    parts = graph.transformer_parts(layer)
    cross = parts["cross_attention_layer"]
    self_cache, cross_cache = a.get("self_attention_cache"), a.get("cross_attention_cache")
    if (cross is None) != (encoder is None) or (
        cross is not None and (self_cache is None) != (cross_cache is None)
    ):
        return layer.call(*args, **kwargs)  # the layer raises its own error for this misuse
    self_mask = graph.decoder_self_attention_mask(
        layer,
        decoder_sequence=decoder,
        decoder_padding_mask=a.get("decoder_padding_mask"),
        decoder_attention_mask=a.get("decoder_attention_mask"),
        use_causal_mask=a.get("use_causal_mask", True),
        self_attention_cache=self_cache,
        self_attention_cache_update_index=a.get("self_attention_cache_update_index"),
    )
    x, self_cache = _attention_block(
        layer,
        parts,
        "self",
        x=decoder,
        value=None,
        mask=self_mask,
        cache=self_cache,
        index=a.get("self_attention_cache_update_index"),
        training=training,
        call=call,
    )
    if cross is not None:
        x, cross_cache = _attention_block(
            layer,
            parts,
            "cross",
            x=x,
            value=encoder,
            mask=graph.padding_attention_mask(
                encoder, a.get("encoder_padding_mask"), a.get("encoder_attention_mask")
            ),
            cache=cross_cache,
            index=a.get("cross_attention_cache_update_index"),
            training=training,
            call=call,
        )
    x = _feedforward(layer, parts, x, training, call)
    graph.propagate_mask(layer, (decoder,), x)
    if self_cache is None:
        return x
    return (x, self_cache, cross_cache) if cross is not None else (x, self_cache)


_ATTENTION_ROLES = ("self_attention_layer", "cross_attention_layer")


def _transformer_check(layer: Any) -> str | None:
    if not layer.built:
        return _built(layer)
    for role, sub in graph.transformer_parts(layer).items():
        if role in _ATTENTION_ROLES and sub is not None:
            known = (keras.layers.MultiHeadAttention, _hub().layers.CachedMultiHeadAttention)
            if type(sub) not in known:
                return f"{role} {sub.name!r} is a {type(sub).__name__}"
    return None


def _sub_plan(rule: LayerRule, sub: Any, shape: Any) -> tuple[str, str]:
    if not graph.trainable_weights(sub):
        return "frozen", ""
    reason = rule.check(sub)
    if reason:
        return "fallback:vectorized", reason
    return rule.plan(sub, [shape])


def _combine(parts: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """One report row for a composition: its slowest part's path and every part's path."""
    paths = {path for path, _ in parts.values()}
    path = next(
        (p for p in ("fallback:vectorized", "materialized", "ghost") if p in paths), "frozen"
    )
    return path, "sub-layers by their rules (" + ", ".join(
        f"{name}: {p}" for name, (p, _) in parts.items()
    ) + ")"


def _transformer_plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    shape = input_shapes[0] if input_shapes else None
    inner = None if shape is None else (*shape[:-1], layer.intermediate_dim)
    parts: dict[str, tuple[str, str]] = {}
    for role, sub in graph.transformer_parts(layer).items():
        if sub is None or not sub.weights:
            continue
        if role in _ATTENTION_ROLES:
            rule = MULTI_HEAD_ATTENTION
            if type(sub) is not keras.layers.MultiHeadAttention:
                rule = CACHED_MULTI_HEAD_ATTENTION
            parts[sub.name] = _sub_plan(rule, sub, shape)
        elif role.endswith("layer_norm"):
            parts[sub.name] = _sub_plan(LAYER_NORMALIZATION, sub, shape)
        else:
            sub_shape = inner if role == "feedforward_output_dense" else shape
            parts[sub.name] = _sub_plan(DENSE, sub, sub_shape)
    return _combine(parts)


TRANSFORMER_ENCODER = LayerRule(
    name="transformer_encoder",
    check=_transformer_check,
    plan=_transformer_plan,
    compose=replay_transformer_encoder,
)

TRANSFORMER_DECODER = LayerRule(
    name="transformer_decoder",
    check=_transformer_check,
    plan=_transformer_plan,
    compose=replay_transformer_decoder,
)


# ------------------------------------------------------------------------------ MaskedLMHead


def replay_masked_lm_head(layer: Any, args: tuple, kwargs: dict, call: Call) -> Any:
    """``MaskedLMHead.call`` with its parts routed through ``call``: the gather at
    ``mask_positions``, the intermediate ``Dense`` and ``LayerNormalization`` by their rules, the
    tied ``ReversibleEmbedding``'s reverse call as one more use of that layer (its rule sums it with
    the lookups, cross terms included), then the head itself for its own bias (and output kernel
    when untied): ``call(layer, (x, logits), {})`` runs :data:`MASKED_LM_HEAD`'s ``forward``."""
    a = _arguments(layer, args, kwargs)
    parts = graph.masked_lm_head_parts(layer)
    positions = keras.ops.expand_dims(a["mask_positions"], axis=-1)
    x = keras.ops.take_along_axis(a["inputs"], positions, axis=1)
    x = call(parts["intermediate_dense"], (x,), {})
    x = call(parts["intermediate_layer_norm"], (x,), {})
    logits = None
    if parts["token_embedding"] is not None:
        logits = call(parts["token_embedding"], (x,), {"reverse": True})
    return call(layer, (x, logits), {})


def _head_forward(layer: Any, args: tuple, kwargs: dict) -> tuple[tf.Tensor, dict]:
    """The head's own variables: ``z = logits + bias``, ``logits = x @ kernel`` when untied."""
    x, logits = args
    parts = graph.masked_lm_head_parts(layer)
    capture: dict[str, Any] = {}
    if logits is None:
        x = tf.convert_to_tensor(x)
        logits = keras.ops.matmul(x, parts["kernel"])
        capture["x"] = x
    z = keras.ops.cast(logits, layer.compute_dtype) + parts["bias"]
    return z, capture


def _head_grads(layer: Any, uses: Sequence[Use]) -> list[VariableGrad]:
    parts = graph.masked_lm_head_parts(layer)
    g = tf.concat([linear.as_sequence(tf.cast(u.grad, tf.float32)) for u in uses], 1)
    out = [from_per_example(parts["bias"], tf.reduce_sum(g, axis=1), path="ghost")]
    if parts["kernel"] is not None:
        x = tf.concat([linear.as_sequence(tf.cast(u.capture["x"], tf.float32)) for u in uses], 1)
        out.append(outer_grad(parts["kernel"], x, g))  # [dim, vocab] = X^T dlogits
    return [vg for vg in out if vg.variable.trainable]


def _head_plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    parts = graph.masked_lm_head_parts(layer)
    shape = input_shapes[0] if input_shapes else None
    gathered = None if shape is None else (shape[0], None, shape[-1])  # mask positions: dynamic
    dim = int(parts["intermediate_dense"].units)
    rows = {
        parts["intermediate_dense"].name: _sub_plan(DENSE, parts["intermediate_dense"], gathered),
        parts["intermediate_layer_norm"].name: _sub_plan(
            LAYER_NORMALIZATION, parts["intermediate_layer_norm"], gathered
        ),
    }
    if parts["bias"].trainable:
        rows["output_bias"] = ("ghost", "")
    if parts["kernel"] is not None and parts["kernel"].trainable:
        rows["output_kernel"] = linear.choose_path(None, dim, int(layer.vocabulary_size))
    path, why = _combine(rows)
    if parts["token_embedding"] is not None:
        why += f"; output projection: a use of the tied {parts['token_embedding'].name!r} table"
    return path, why


MASKED_LM_HEAD = LayerRule(
    name="masked_lm_head",
    check=_built,
    forward=_head_forward,
    grads=_head_grads,
    plan=_head_plan,
    compose=replay_masked_lm_head,
)


# ---------------------------------------------------------------------------------- registry


def _hub() -> Any:
    import keras_hub

    return keras_hub


def keras_hub_rules() -> dict[type, LayerRule]:
    """``{KerasHub layer class: rule}`` once ``keras_hub`` has been imported (a model holding its
    layers imported it), else empty: dpcore never imports KerasHub (an optional dependency that
    takes seconds to import) for a model that does not use it."""
    hub = sys.modules.get("keras_hub")
    if hub is None:
        return {}
    layers = hub.layers
    return {
        layers.TransformerEncoder: TRANSFORMER_ENCODER,
        layers.TransformerDecoder: TRANSFORMER_DECODER,
        layers.CachedMultiHeadAttention: CACHED_MULTI_HEAD_ATTENTION,
        layers.ReversibleEmbedding: REVERSIBLE_EMBEDDING,
        layers.PositionEmbedding: POSITION_EMBEDDING,
        layers.TokenAndPositionEmbedding: TOKEN_AND_POSITION_EMBEDDING,
        layers.MaskedLMHead: MASKED_LM_HEAD,
    }
