"""Rule for ``keras.layers.Embedding``.

Contract: ``forward`` gathers rows of the layer's embedding table for the (int-cast) ids, as the
layer does (negative ids wrap around, as in ``keras.ops.take``). An example's gradient of the table has one row per distinct id, the sum of that id's
output gradients, so its squared norm is ``sum over ids of ||sum_{t: id_t = id} g_t||^2``. It is
computed by sorting each example's ids and segment-summing the gradients of equal ids: cost
``O(B T log T + B T dim)``, static shapes (XLA friendly), never a ``[B, vocab, dim]`` tensor.
The clipped sum is one ``unsorted_segment_sum`` of the clip-weighted output gradients into a dense
``[vocab, dim]`` tensor. Several uses of one layer are concatenated along the position axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from dpcore import norms
from dpcore.rules.base import LayerRule, Use, VariableGrad, unsupported_variant


def embedding_forward(layer: Any, args: tuple, kwargs: dict) -> tuple[tf.Tensor, dict]:
    """``z = layer.embeddings[ids]`` (ids cast to int, negative ids wrapped) and ``{"ids": ids}``."""
    ids = tf.convert_to_tensor(args[0])
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int32)
    # Keras's take wraps negative ids as numpy does (-1 is the last row); the norm groups equal
    # ids and the clipped sum scatters by id, so both need the row actually used.
    vocab = tf.cast(tf.shape(layer.embeddings)[0], ids.dtype)
    ids = tf.where(ids < 0, ids + vocab, ids)
    z = keras.ops.take(layer.embeddings, ids, axis=0)
    return keras.ops.cast(z, layer.compute_dtype), {"ids": ids}


def same_id_sq_norm(ids: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """``[B]`` float64 squared norms of the same-id sums of ids ``[B, T]``, g ``[B, T, E]`` (a
    certified bound of the sums as computed; see :func:`_grads` for their rounding).

    Privacy:
      Row ``i`` depends on example ``i`` only.
    """
    b, t = tf.shape(ids)[0], tf.shape(ids)[1]
    order = tf.argsort(ids, axis=1, stable=True)
    sorted_ids = tf.gather(ids, order, batch_dims=1)
    first = tf.ones([b, 1], tf.int32)
    new = tf.cast(sorted_ids[:, 1:] != sorted_ids[:, :-1], tf.int32)
    local = tf.cumsum(tf.concat([first, new], axis=1), axis=1) - 1  # [B, T] segment within row
    # Segment of each position in its original order (only int ids are permuted, never the
    # [B, T, E] gradients: no sorted copy of them is made).
    local = tf.gather(local, tf.argsort(order, axis=1), batch_dims=1)
    segments = local + tf.range(b)[:, None] * t
    sums = tf.math.unsorted_segment_sum(
        tf.reshape(g, [-1, g.shape[-1]]), tf.reshape(segments, [-1]), b * t
    )
    return norms.sq_norm_bound(tf.reshape(sums, [b, -1]))


def _grads(layer: Any, uses: Sequence[Use]) -> list[VariableGrad]:
    return [id_rows_grad(layer.embeddings, *id_uses(uses, int(layer.embeddings.shape[-1])))]


def id_uses(uses: Sequence[Use], dim: int) -> tuple[tf.Tensor, tf.Tensor]:
    """The ids ``[B, T]`` (``capture["ids"]``) and output gradients ``[B, T, dim]`` (float32) of
    several table lookups, their positions concatenated."""
    ids = tf.concat(
        [tf.reshape(u.capture["ids"], [tf.shape(u.capture["ids"])[0], -1]) for u in uses], 1
    )
    g = tf.concat(
        [tf.reshape(tf.cast(u.grad, tf.float32), [tf.shape(u.grad)[0], -1, dim]) for u in uses], 1
    )
    return ids, g


def id_rows_grad(table: Any, ids: tf.Tensor, g: tf.Tensor) -> VariableGrad:
    """The gradient info of a ``[vocab, dim]`` table read at rows ``ids [B, T]`` (in range) whose
    outputs got the gradients ``g [B, T, dim]``: certified same-id norms, the clipped sum as one
    segment sum. Shared by every layer that gathers rows of a table (embeddings, positions).

    Privacy:
      Row ``i`` of the norms depends on example ``i`` only.
    """
    dim = int(table.shape[-1])
    sum_error = None
    if ids.shape[1] == 1:
        sq = norms.sq_norm_bound(g[:, 0])
    else:
        # The same-id sums and the clipped sum's scatter add the same terms in different orders:
        # each differs from the exact sums by at most gamma_T * sum_t ||g_t|| (dpcore.norms), and
        # by 2^-126 per flushed term or sum: T sqrt(dim) 2^-126 each (one-hot rows: |a_t| = 1).
        t = norms.dim(ids, 1)
        norm_sum = norms.sum_of_norms(g)  # 0 only for an example whose g is all zeros
        slack = 2.0 * norms.dot_gamma(t) * norm_sum
        # a_t is one-hot (max 1, never subnormal); of g only whether it is all zeros matters.
        ones = tf.ones([tf.shape(ids)[0]], tf.float32)
        sum_error = norms.outer_sum_error(t, 1, dim, ones, tf.cast(norm_sum > 0, tf.float32))
        sq = tf.square(tf.sqrt(same_id_sq_norm(ids, g)) + slack + sum_error)
    vocab = int(table.shape[0])

    def weighted_sum(w: tf.Tensor) -> tf.Tensor:
        wg = g * tf.reshape(tf.cast(w, tf.float32), [-1, 1, 1])
        total = tf.math.unsorted_segment_sum(
            tf.reshape(wg, [-1, dim]), tf.reshape(ids, [-1]), vocab
        )
        return tf.cast(total, table.dtype)

    return VariableGrad(
        variable=table, sq_norm=sq, weighted_sum=weighted_sum, path="ghost", sum_error=sum_error
    )


def _plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    return "ghost", "same-id sums of output gradients (sorted segments), no [B, vocab, dim]"


EMBEDDING = LayerRule(
    name="embedding",
    check=unsupported_variant,
    forward=embedding_forward,
    grads=_grads,
    plan=_plan,
)
