"""Shared math for layers whose weight gradient is ``A_i^T G_i`` (Dense, EinsumDense, Conv).

Contract: for an example with inputs ``A_i [T, D]`` and output gradients ``G_i [T, P]`` the
per-example weight gradient is ``A_i^T G_i [D, P]``. Its squared Frobenius norm is computed either
as ``<A_i A_i^T, G_i G_i^T>`` ("ghost", cost ``O(T^2 (D + P))``, never forms ``[B, D, P]``) or by
materializing ``A_i^T G_i`` (cost ``O(T D P)``); :func:`choose_path` picks the cheaper one from
static shapes. ``T = 1`` uses ``||a_i||^2 ||g_i||^2``. All functions are pure tensor math;
packing per-example gradients as a :class:`~dpcore.rules.base.VariableGrad` is
:func:`dpcore.rules.base.from_per_example`.
"""

from __future__ import annotations

from collections.abc import Iterable

import tensorflow as tf

from dpcore import norms


def choose_path(t: int | None, d: int, p: int) -> tuple[str, str]:
    """Ghost or materialized for ``T`` positions, ``D`` inputs, ``P`` outputs, and why.

    Returns:
      ``("ghost" | "materialized", reason)``.
    """
    if t is None:
        return "ghost", f"unknown length T, D={d}, P={p}: ghost keeps memory O(T^2)"
    if t == 1:
        return "ghost", f"one position: ||a||^2*||g||^2 (D={d}, P={p})"
    ghost, mat = t * t * (d + p), t * d * p
    if ghost <= mat:
        return "ghost", f"T={t}: T^2(D+P)={ghost} <= TDP={mat}"
    return "materialized", f"T={t}: TDP={mat} < T^2(D+P)={ghost}"


def sq_norm(a: tf.Tensor, g: tf.Tensor, path: str) -> tf.Tensor:
    """Certified bound of ``||A_i^T G_i||_F^2`` for ``a [B, T, D]``, ``g [B, T, P]``: ``[B]``
    float64, never below the true value, and covering the rounding of the book-keeping product
    that forms the clipped sum (see :mod:`dpcore.norms`). The first of :func:`bounds`.

    Privacy:
      Row ``i`` depends on example ``i`` only.
    """
    return bounds(a, g, path)[0]


def bounds(a: tf.Tensor, g: tf.Tensor, path: str) -> tuple[tf.Tensor, tf.Tensor]:
    """``(sq_norm, sum_error)`` for a variable whose clipped sum is the book-keeping product
    ``A^T diag(w) G`` (:func:`weighted_outer`): the certified squared-norm bound of
    :func:`sq_norm` and :func:`dpcore.norms.outer_sum_error`, the error of that product that does
    not shrink with ``w`` (zero for one position, where a flushed term only shrinks an entry).

    Privacy:
      Row ``i`` of both depends on example ``i`` only.
    """
    if a.shape[1] == 1:
        sq = norms.outer_sq_norm_bound(a[:, 0], g[:, 0])
        return sq, tf.zeros_like(sq)
    if path == "ghost":
        return norms.ghost_sq_norm_bound(a, g, contribution=True, with_sum_error=True)
    # The materialized product is not what the book-keeping sum multiplies: bound both. Each
    # differs from the exact product by relative rounding (gamma_T of the triangle bound) and by
    # flushed terms (at most the sum error, which the stored product also has, with w = 1).
    a_max = norms.abs_max(tf.cast(a, tf.float32), axis=[1, 2])
    g_max = norms.abs_max(tf.cast(g, tf.float32), axis=[1, 2])
    err = norms.outer_sum_error(norms.dim(a, 1), a.shape[-1], g.shape[-1], a_max, g_max)
    mat = tf.sqrt(norms.sq_norm_bound(materialize(a, g), weighted_by_matmul=False))
    slack = 2.0 * norms.dot_gamma(norms.dim(a, 1)) * norms.triangle_bound(a, g)
    return tf.square(mat + slack + err), err


@tf.function(jit_compile=True, autograph=False)
def _compiled_materialize(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    return tf.matmul(a, g, transpose_a=True)


def materialize(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """Per-example ``A_i^T G_i``, shape ``[B, D, P]`` (float32).

    Inside a graph, for static shapes with ``T D P >= dpcore.norms.XLA_MIN_WORK``, the batched
    product is compiled by XLA, as :func:`dpcore.norms.gram` is (on CPU TensorFlow's
    batched-matmul kernel is slower for these shapes); otherwise it is TensorFlow's.

    Privacy:
      Unclipped per-example gradients: clip before aggregating.
    """
    a, g = tf.cast(a, tf.float32), tf.cast(g, tf.float32)
    if norms.compile_batched_product(*a.shape[1:], g.shape[-1]):
        return _compiled_materialize(a, g)
    return tf.matmul(a, g, transpose_a=True)


@tf.function(jit_compile=True, autograph=False)
def _compiled_einsum(equation: str, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    return tf.einsum(equation, x, y)


def per_example_einsum(equation: str, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    """``tf.einsum(equation, x, y)`` for a per-example product (batch axis first in ``x``),
    compiled by XLA inside a graph when :func:`materialize` would be; else TensorFlow's einsum.

    Privacy:
      Unclipped per-example gradients: clip before aggregating.
    """
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes = {c: n for spec, t in zip(lhs, (x, y)) for c, n in zip(spec, t.shape)}
    sizes.pop(lhs[0][0])  # the batch axis
    if norms.compile_batched_product(*sizes.values()):
        return _compiled_einsum(equation, x, y)
    return tf.einsum(equation, x, y)


def weighted_outer(a: tf.Tensor, g: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    """``sum_i w_i A_i^T G_i`` as one ``[D, P]`` matmul over all positions of all examples.

    Privacy:
      With ``w_i`` the clip factors this is the clipped sum (sensitivity ``C``).
    """
    d, p = a.shape[-1], g.shape[-1]
    g = tf.cast(g, tf.float32) * tf.reshape(tf.cast(w, tf.float32), [-1, 1, 1])
    return tf.matmul(
        tf.reshape(tf.cast(a, tf.float32), [-1, d]), tf.reshape(g, [-1, p]), transpose_a=True
    )


def as_sequence(t: tf.Tensor) -> tf.Tensor:
    """``[B, ..., C] -> [B, T, C]`` (``[B, C] -> [B, 1, C]``)."""
    return tf.reshape(t, [tf.shape(t)[0], -1, t.shape[-1]])


def static_positions(shape: Iterable[int | None]) -> int | None:
    """``T`` from a static ``[B, ..., C]`` shape (None if any middle dimension is unknown)."""
    dims = list(shape)[1:-1]
    t = 1
    for d in dims:
        if d is None:
            return None
        t *= int(d)
    return t
