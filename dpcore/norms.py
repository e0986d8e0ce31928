"""Certified upper bounds of per-example gradient norms in floating point.

Contract: a clip factor ``min(1, C / norm)`` keeps an example's contribution within ``C`` only if
``norm`` is at least the norm of what the example really contributes. Every function here returns,
per example, a **float64 upper bound of the squared norm** that holds for every finite input, in
the precision the hardware really computes in:

- sums of squares of long rows are float32 partial sums of 16 (8, 4) squares added in float64,
  widened by ``gamma_16`` and by an absolute term for squares that flush to zero; a row whose
  float32 partial sums overflow, short rows and float64 tensors are summed in float64, where the
  square of any float32 (or float16/bfloat16) value is exact and can neither overflow nor
  underflow; the float64 summation error ``gamma_n`` (``n * 2^-53``) is added;
- the ghost identity ``||A^T G||_F^2 = sum_{s,t} (a_s . a_t)(g_s . g_t)`` is evaluated on the
  operands as they are where an example's Gram diagonal shows magnitudes that cannot overflow,
  else divided by their largest magnitude per example, and the rounding error of
  its float32 matmuls is added explicitly:
  ``gamma_D sum |a_s||a_t| |g_s . g_t| + gamma_P sum |a_s . a_t| |g_s||g_t| + gamma_D gamma_P E``,
  with ``E = (sum_t |a_t| |g_t|)^2`` (Higham's bound for dot products of length D and P), plus
  ``3 D 2^-126`` (``3 P 2^-126``) per Gram entry for products and sums that flush to zero (a
  position 2^64 times smaller than the example's largest has a Gram diagonal of exactly 0); the
  bound is capped by the triangle inequality ``sqrt(E)``, which always holds;
- a book-keeping product ``A^T diag(w) G`` also has an error that does not shrink with ``w``: a
  flushed ``w g`` loses up to ``2^-126 |a|``. :func:`outer_sum_error` bounds it per example; the
  clip factor is taken against ``C`` minus it (:func:`dpcore.aggregation.clip`);
- where the released clipped sum is computed from other tensors than the norm (book-keeping
  products ``A^T diag(w) G`` instead of the materialized per-example gradient), the rounding of
  that product over the example's own ``T`` positions, ``gamma_T sqrt(E)``, is added to the norm,
  so that the example's contribution, and not only its exact gradient, is bounded;
- matmul roundoff is that of float32, or of TensorFloat-32 (10 explicit mantissa bits:
  ``2^-11`` per input) when TF32 execution is enabled and a GPU is present, or of bfloat16
  (``2^-8``) when oneDNN is told to compute float32 matmuls in bfloat16.

Non-finite inputs give non-finite bounds (never a finite underestimate), so callers can detect and
skip them. Everything is plain TensorFlow and runs inside the caller's compiled step; inside a graph
the per-example Gram matrices of large enough operands (:func:`gram`) are compiled by XLA, whose
batched matmul is faster on CPU, and the error model above covers it as it covers any float32
summation order. In a large traced step, a bound called again with the same shapes (a
transformer's repeated layers), and every large Gram-matrix bound, is a call of one shared traced
function instead of a fresh copy of its operations (:data:`SHARED_MIN_OPS`,
:data:`SHARED_MIN_WORK`): the same operations, so the same values, in a smaller program.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import tensorflow as tf

F32_ROUNDOFF = 2.0**-24
F64_ROUNDOFF = 2.0**-53
TF32_ROUNDOFF = 2.0**-11
BF16_ROUNDOFF = 2.0**-8
# Smallest positive normal float32: values rescaled to magnitude <= 1 lose at most this much each
# when they flush to zero.
_F32_TINY = 2.0**-126

__all__ = [
    "F32_ROUNDOFF",
    "ORDINARY_DIAGONAL",
    "SHARED_MIN_OPS",
    "SHARED_MIN_WORK",
    "TF32_ROUNDOFF",
    "XLA_MIN_WORK",
    "abs_max",
    "compile_batched_product",
    "dim",
    "dot_gamma",
    "ghost_sq_norm_bound",
    "gram",
    "gram_magnitudes",
    "gram_sq_norm_bound",
    "inline_bounds",
    "matmul_input_roundoff",
    "outer_sq_norm_bound",
    "outer_sum_error",
    "row_scale",
    "rows_sq_norm",
    "scaled_gram",
    "sq_norm_bound",
    "sum_of_norms",
    "triangle_bound",
]


# ------------------------------------------------------------------ one traced body per signature
# A DP step calls the bounds below once per layer, and a transformer's layers repeat the same
# shapes. Inside a graph, the Gram-matrix bound of a ghost norm of at least SHARED_MIN_WORK
# per-example multiply-adds, and any bound whose signature (static shapes, dtypes, Python
# arguments) was already used in a graph of SHARED_MIN_OPS operations or more, is a call of one
# traced, non-inlined function (``_noinline``): the runtime then holds one copy of its operations
# per signature instead of one per layer, a smaller program and less memory for a large model's
# step. A call has a fixed cost, so small programs keep every bound inline. The body is the same
# operations either way; the matmul input roundoff (read at trace time) is part of the
# signature. The Gram matrices themselves stay in the caller's graph: an XLA-compiled function
# called from a non-inlined one is not compiled.

SHARED_MIN_WORK = 1 << 20
SHARED_MIN_OPS = 2000
_F = TypeVar("_F", bound=Callable[..., Any])
_SHARED = threading.local()
_SEEN: weakref.WeakKeyDictionary[Any, set[Any]] = weakref.WeakKeyDictionary()
_BODIES: dict[Any, Any] = {}
_LOCK = threading.Lock()


def _signature(value: Any) -> Any:
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return ("tensor", tuple(tf.TensorShape(value.shape).as_list() or ()), value.dtype.name)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    # The type too: True == 1 == 1.0 as keys, but a body traced for one is not the other's.
    return ("value", type(value).__name__, value)


def _shared(work: Callable[..., int | None] | None = None) -> Callable[[_F], _F]:
    """Runs the decorated bound as a shared function call inside a graph (see above).

    ``work(*args, **kwargs)`` gives the per-example multiply-adds from which the first call is
    shared already (``None``: unknown, inline). Each signature gets its own ``tf.function``,
    traced once: one function retraced for every layer shape would log retracing warnings.
    """

    def decorate(fn: _F) -> _F:
        def body(*args: Any, **kwargs: Any) -> Any:
            with inline_bounds():
                return fn(*args, **kwargs)

        body.__name__ = f"shared_{fn.__name__}"

        @tf.autograph.experimental.do_not_convert
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if tf.executing_eagerly() or getattr(_SHARED, "inside", False):
                return fn(*args, **kwargs)
            key = (
                fn.__name__,
                matmul_input_roundoff(),
                _signature(args),
                tuple(sorted((k, _signature(v)) for k, v in kwargs.items())),
            )
            try:
                hash(key)
            except TypeError:  # an argument that is neither a tensor nor a plain value
                return fn(*args, **kwargs)
            graph = tf.compat.v1.get_default_graph()
            seen = _SEEN.setdefault(graph, set())
            repeated = key in seen and len(graph.get_operations()) >= SHARED_MIN_OPS
            seen.add(key)
            big = work is not None and (work(*args, **kwargs) or 0) >= SHARED_MIN_WORK
            if not (repeated or big):
                return fn(*args, **kwargs)
            with _LOCK:
                traced = _BODIES.get(key)
                if traced is None:
                    traced = tf.function(
                        body, autograph=False, experimental_attributes={"_noinline": True}
                    )
                    _BODIES[key] = traced
            return traced(*args, **kwargs)

        return call

    return decorate


@contextlib.contextmanager
def inline_bounds() -> Iterator[None]:
    """Within this block, bounds traced into a graph are inlined, never shared calls (the
    reference the shared calls are tested against)."""
    before = getattr(_SHARED, "inside", False)
    _SHARED.inside = True
    try:
        yield
    finally:
        _SHARED.inside = before


def _ghost_work(a: Any, g: Any, *args: Any, **kwargs: Any) -> int | None:
    """``T^2 (D + P)`` for ``[B, T, D]`` / ``[B, T, P]`` operands (or Gram matrices with ``d`` and
    ``p`` given), ``None`` when a dimension is not static."""
    t = a.shape[1]
    d, p = kwargs.get("d", a.shape[-1]), kwargs.get("p", g.shape[-1])
    if t is None or d is None or p is None:
        return None
    return int(t) ** 2 * (int(d) + int(p))


def matmul_input_roundoff() -> float:
    """Relative rounding of a float32 matmul's *inputs* on this machine (0 when exact).

    TensorFlow runs float32 matmuls and convolutions in TensorFloat-32 on Ampere and later GPUs
    unless ``tf.config.experimental.enable_tensor_float_32_execution(False)`` was called; oneDNN
    may run them in bfloat16 when ``ONEDNN_DEFAULT_FPMATH_MODE`` asks for it. Read at trace time.
    """
    mode = os.environ.get("ONEDNN_DEFAULT_FPMATH_MODE", "").upper()
    if mode in ("BF16", "ANY"):
        return BF16_ROUNDOFF
    if (
        tf.config.experimental.tensor_float_32_execution_enabled()
        and tf.config.list_logical_devices("GPU")
    ):
        return TF32_ROUNDOFF
    return 0.0


def dot_gamma(
    n: Any, *, roundoff: float = F32_ROUNDOFF, input_roundoff: float | None = None
) -> Any:
    """Relative error bound of a float32 dot product of length ``n``, as float64.

    ``|fl(x . y) - x . y| <= dot_gamma(n) * sum |x_k y_k|`` for any summation order: Higham's
    ``gamma_n = n u / (1 - n u)``, widened by the rounding of the inputs (TF32/bfloat16 matmuls).
    ``n`` may be a Python number (the result is then a Python float, computed at trace time by the
    same float64 operations, so the traced program holds no operations for it) or a scalar tensor
    (dynamic lengths); infinite when ``n u >= 1/2``.
    """
    u_in = matmul_input_roundoff() if input_roundoff is None else input_roundoff
    if isinstance(n, numbers.Real):
        nu = float(n) * roundoff
        gamma = nu / (1.0 - nu) if nu < 0.5 else float("inf")
        return (1.0 + u_in) ** 2 * (1.0 + gamma) - 1.0
    nu = tf.cast(n, tf.float64) * roundoff
    gamma = tf.where(nu < 0.5, nu / (1.0 - nu), tf.constant(float("inf"), tf.float64))
    return (1.0 + u_in) ** 2 * (1.0 + gamma) - 1.0


def round_down_f32(w: tf.Tensor) -> tf.Tensor:
    """float64 -> float32 rounded toward zero, so a clip factor never grows when cast."""
    w32 = tf.cast(w, tf.float32)
    return tf.where(tf.cast(w32, tf.float64) > w, tf.math.nextafter(w32, tf.zeros_like(w32)), w32)


def dim(t: tf.Tensor, axis: int) -> Any:
    """The length of ``t`` along ``axis``: a Python int when static, else a scalar tensor."""
    n = t.shape[axis]
    return int(n) if n is not None else tf.shape(t)[axis]


def _sum64_inflation(n: Any) -> Any:
    """``1 + gamma_n`` for a float64 sum of ``n`` non-negative terms (plus a few roundings); a
    Python float for a Python number ``n`` (the same float64 operations, at trace time)."""
    if isinstance(n, numbers.Real):
        return 1.0 + (float(n) + 4.0) * (2.0 * F64_ROUNDOFF)
    return 1.0 + (tf.cast(n, tf.float64) + 4.0) * (2.0 * F64_ROUNDOFF)


# Rows of at least this many float32 entries are summed in chunks (below); shorter rows, and rows
# whose length no chunk size divides, are summed in float64 directly (fewer operations in the
# traced step, and the float64 traffic of short rows is small).
_CHUNKED_MIN_LENGTH = 256


def _chunk_size(n: Any) -> int:
    """Entries per float32 partial sum for rows of static length ``n`` (1: no chunking)."""
    if not isinstance(n, int) or n < _CHUNKED_MIN_LENGTH:
        return 1
    return next((k for k in (16, 8, 4) if n % k == 0), 1)


def _inverse_complement(gamma: float) -> float:
    """``1 / (1 - gamma)`` (infinite for ``gamma >= 1``): a non-negative float32 sum computed as
    ``c`` is at most ``c / (1 - gamma)`` exactly."""
    return 1.0 / (1.0 - gamma) if gamma < 1.0 else float("inf")


def _as_float(n: Any) -> Any:
    """A length as a Python float (static) or a float64 scalar tensor (dynamic)."""
    return float(n) if isinstance(n, int) else tf.cast(n, tf.float64)


def _float64_sq_sums(t: tf.Tensor) -> tf.Tensor:
    """Upper bounds of the sums of squares of the rows of ``t [M, n]``, summed in float64.

    The square of a float32 (float16, bfloat16) value is exact in float64, but a flush-to-zero
    CPU reads an input below ``2^-126`` as zero (TensorFlow's casts included): such an input's
    square is below ``2^-252``. A float64 input's square, or a partial sum, below ``2^-1022`` may
    flush to zero. A row holding any non-zero bit pattern gets that absolute term per entry (a
    bit test, which flushing cannot hide); a row of zeros keeps its exact bound, zero.
    """
    n = dim(t, 1)
    if t.dtype == tf.float64:
        wide, lost = t, 2.0 * 2.0**-1022
        bits = tf.bitwise.bitwise_and(tf.bitcast(t, tf.int64), 0x7FFFFFFFFFFFFFFF)
    else:
        t32 = tf.cast(t, tf.float32)
        wide, lost = tf.cast(t32, tf.float64), 2.0**-252
        bits = tf.bitwise.bitwise_and(tf.bitcast(t32, tf.int32), 0x7FFFFFFF)
    nonzero = tf.reduce_any(tf.not_equal(bits, 0), axis=1)
    sums = tf.reduce_sum(tf.square(wide), axis=1)
    return (sums + tf.cast(nonzero, tf.float64) * (_as_float(n) * lost)) * _sum64_inflation(n)


def _sq_sums(t: tf.Tensor) -> tf.Tensor:
    """``[M]`` float64 upper bounds of the sums of squares of the rows of ``t [M, n]``.

    Rows of a static length ``n >= 256`` that 16, 8 or 4 (``k``) divides are summed in float32, in
    ``n / k`` partial sums of ``k`` adjacent entries each, and the partial sums are then added in
    float64: half the memory traffic of widening every entry to float64. A float32 square is off
    by at most ``u = 2^-24`` relative, or ``2^-126`` absolute when it flushes to zero; a float32
    sum of ``k`` non-negative terms, in any order, by at most ``gamma_k`` relative in all (squares
    included) and ``2^-126`` per flushed addition. So the exact sum is at most ``(S + 2 n
    2^-126)(1 + gamma_k)``, ``S`` the sum of the partial sums, widened by the float64 sum's own
    ``gamma``: ``gamma_16 ~ 1e-6`` relative on the squared norm. A row whose float32 partial sums
    overflow (an entry above about ``1.8e19``, or Inf) or are all zero (a row of zeros, or of
    entries below ``2^-63``) is summed again by :func:`_float64_sq_sums`, that row alone, so that
    no row's bound depends on another row and a row of zeros gets zero. Other rows (and float64
    tensors) are summed by :func:`_float64_sq_sums`.
    """
    n = dim(t, 1)
    k = _chunk_size(n)
    if k == 1 or t.dtype == tf.float64:
        return _float64_sq_sums(t)
    t32 = tf.cast(t, tf.float32)  # exact for float16 and bfloat16
    # Adjacent entries: TensorFlow's order of a row's middle-axis sums can depend on the number
    # of rows (so on the other examples); its innermost sums of a row do not.
    partial = tf.reduce_sum(tf.reshape(tf.square(t32), [-1, n // k, k]), axis=2)
    sums = tf.reduce_sum(tf.cast(partial, tf.float64), axis=1)
    # The float64 sum of n / k terms, the addition of the absolute term and the product (whose
    # factor is itself rounded once): _sum64_inflation's spare roundings cover the last three.
    factor = (1.0 + dot_gamma(k, input_roundoff=0.0)) * _sum64_inflation(n // k)
    bound = (sums + 2.0 * n * _F32_TINY) * factor
    again = tf.where(tf.math.is_inf(sums) | tf.equal(sums, 0.0))
    return tf.tensor_scatter_nd_update(bound, again, _float64_sq_sums(tf.gather_nd(t32, again)))


@_shared()
def rows_sq_norm(t: tf.Tensor) -> tf.Tensor:
    """``[B]`` float64 upper bounds of the sums of squares of each row of ``t [B, ...]``.

    Never below the exact sum, for every input and whatever the summation order (NaN or Inf for
    a row holding NaN or Inf); see :func:`_sq_sums`.

    Privacy:
      Row ``i`` bounds row ``i`` of ``t`` alone: the float64 summation order may vary with the
      batch size, but the bound holds for every order, so other examples can never push it
      below the row's true sum.
    """
    row = t.shape[1:]
    if row.is_fully_defined() and row.num_elements() == 0:
        return tf.zeros([tf.shape(t)[0]], tf.float64)
    if row.is_fully_defined():
        return _sq_sums(tf.reshape(t, [-1, row.num_elements()]))
    return _sq_sums(tf.reshape(t, [tf.shape(t)[0], -1]))


@_shared()
def sq_norm_bound(
    per_example: tf.Tensor, *, weighted_by_matmul: bool = True, rows: tf.Tensor | None = None
) -> tf.Tensor:
    """Upper bound of ``||per_example[i]||^2`` (and of its clip-weighted contribution), ``[B]``.

    Args:
      per_example: ``[B, ...]`` per-example gradients as stored (any float dtype).
      weighted_by_matmul: the clipped sum is formed from this very tensor by a weighted matmul
        (``tensordot``): on hardware that rounds matmul inputs (TF32) the contribution of a row can
        exceed its stored norm by that rounding, which is added.
      rows: :func:`rows_sq_norm` of ``per_example``, when the caller already has it.

    Returns:
      float64 ``[B]``: non-finite where the row holds NaN/Inf.

    Privacy:
      Row ``i`` depends on example ``i`` only; the bound is never below the true squared norm.
    """
    sq = rows_sq_norm(per_example) if rows is None else rows
    if weighted_by_matmul:
        sq = sq * (1.0 + 2.0 * matmul_input_roundoff() + 2.0 * F32_ROUNDOFF) ** 2
    return sq


def _position_norms(t: tf.Tensor) -> tf.Tensor:
    """``[B, T, K] -> [B, T]`` float64 upper bounds of each position's norm."""
    return tf.reshape(tf.sqrt(_sq_sums(tf.reshape(t, [-1, dim(t, -1)]))), tf.shape(t)[:-1])


@_shared()
def sum_of_norms(t: tf.Tensor) -> tf.Tensor:
    """``[B, T, K] -> [B]`` float64 upper bound of ``sum_t ||t[i, t]||``."""
    return tf.reduce_sum(_position_norms(t), axis=1) * _sum64_inflation(dim(t, 1))


@_shared()
def triangle_bound(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """``[B]`` float64 upper bound of ``sum_t ||a_t|| ||g_t||`` for ``a [B,T,D]``, ``g [B,T,P]``:
    the triangle-inequality bound of ``||A^T G||_F`` and the scale of its rounding errors.

    Privacy:
      Row ``i`` depends on example ``i``'s ``a`` and ``g`` only and is never below
      ``||A_i^T G_i||_F``: the cap of the ghost bound, which holds whatever the data.
    """
    prods = _position_norms(a) * _position_norms(g)
    return tf.reduce_sum(prods, axis=1) * _sum64_inflation(dim(a, 1))


@_shared()
def outer_sq_norm_bound(
    a: tf.Tensor, g: tf.Tensor, *, g_rows: tf.Tensor | None = None
) -> tf.Tensor:
    """Bound for one position: ``||a_i g_i^T||^2 = ||a_i||^2 ||g_i||^2`` for ``a [B, D]``, ``g [B, P]``.

    Includes the rounding of the book-keeping product ``a_i (w_i g_i)^T`` that forms the clipped
    sum (one product per entry, inputs possibly rounded to TF32).

    Args:
      a: ``[B, D]`` layer inputs.
      g: ``[B, P]`` output gradients.
      g_rows: :func:`rows_sq_norm` of ``g``, when the caller already has it (a bias's bound
        needs the same sums).

    Returns:
      float64 ``[B]``.

    Privacy:
      Row ``i`` depends on example ``i`` only and is never below its ``||a_i||^2 ||g_i||^2``
      with the product's relative rounding; the flush error that does not shrink with the clip
      factor is bounded separately (:func:`outer_sum_error`).
    """
    g_rows = rows_sq_norm(g) if g_rows is None else g_rows
    return rows_sq_norm(a) * g_rows * (1.0 + dot_gamma(2)) ** 2


@_shared()
def outer_sum_error(t: Any, d: int, p: int, a_max: tf.Tensor, g_max: tf.Tensor) -> tf.Tensor:
    """``[B]`` float64 bound of the error, beyond relative rounding, of what an example adds to
    a book-keeping product ``sum_t a_t (w g_t)^T`` (``A^T diag(w) G``, a convolution's filter
    gradient, a scatter of ``w g``) for any weight ``0 <= w <= 1``: the flush to zero of
    ``w g`` below ``2^-126``, of subnormal inputs, and of products and sums.

    A flushed ``w g_{t,p}`` moves entry ``(k, p)`` by up to ``2^-126 |a_{t,k}|`` whatever ``w``
    is, so this error does not shrink with the clip factor: with ``|a| ~ 1e38`` and a factor that
    puts ``w g`` at the edge of the normal range, a record of norm ``C`` could add ``4 C``
    without this term.
    It is ``2 T sqrt(D P) 2^-126 (a_max + g_max + 2)``: ``2^-126 sqrt(P) sum_t |a_t|`` for the
    flushed weighted entries, ``2^-126 sqrt(D) sum_t |g_t|`` for subnormal inputs read as zero,
    ``2 T sqrt(D P) 2^-126`` for the flushed products and sums, doubled for their own rounding.
    :func:`dpcore.aggregation.clip` spends it out of ``C``.

    Args:
      t: positions per example (a Python int or a scalar tensor).
      d: entries of each ``a_t`` (static).
      p: entries of each ``g_t`` (static).
      a_max: ``[B]`` an upper bound of each example's largest ``|a|`` (NaN/Inf when non-finite).
      g_max: ``[B]`` an upper bound of each example's largest ``|g|`` as read; 0 (allowed only
        when every ``g`` entry reads as zero, whose weighted terms are then all exactly zero)
        makes the error 0.

    Returns:
      float64 ``[B]``; about ``1e-37`` times the magnitudes for ordinary data.

    Privacy:
      Row ``i`` depends on example ``i``'s magnitudes and the static sizes only. The clip spends
      it out of ``C`` because a larger norm bound would not cover it: dropping it could let one
      example add more than ``C``.
    """
    per_position = 2.0 * (float(d) * float(p)) ** 0.5 * _F32_TINY
    g_max = tf.cast(g_max, tf.float64)
    magnitudes = tf.cast(a_max, tf.float64) + g_max + 2.0
    err = _as_float(t) * per_position * magnitudes * (1.0 + 8.0 * F64_ROUNDOFF)
    return tf.where(g_max > 0, err, tf.zeros_like(err))


def row_scale(t: tf.Tensor) -> tf.Tensor:
    """``[B]`` float32 largest magnitude of each row of ``t`` (1 for an all-zero row; NaN or Inf
    for a row holding NaN or Inf): the ``a_scale`` of :func:`ghost_sq_norm_bound`."""
    m = abs_max(tf.reshape(tf.cast(t, tf.float32), [tf.shape(t)[0], -1]), axis=[1])
    return tf.where((m > 0) | tf.math.is_nan(m), m, tf.ones_like(m))


def abs_max(t: tf.Tensor, axis: list[int]) -> tf.Tensor:
    """``max |t|`` over ``axis`` as ``max(max t, -min t)``: the same value (NaN where TensorFlow's
    maxima propagate it) without a copy of ``|t|`` the size of ``t``."""
    return tf.maximum(tf.reduce_max(t, axis=axis), -tf.reduce_min(t, axis=axis))


def ghost_sq_norm_bound(
    a: tf.Tensor,
    g: tf.Tensor,
    *,
    contribution: bool = True,
    a_scale: tf.Tensor | None = None,
    with_sum_error: bool = False,
) -> Any:
    """Certified bound of ``||A_i^T G_i||_F^2`` by the ghost identity, ``a [B,T,D]``, ``g [B,T,P]``.

    Args:
      a: layer inputs per position.
      g: output gradients per position.
      contribution: also bound the rounding of a book-keeping product over the example's ``T``
        positions (``A^T diag(w) G``, or a convolution's filter gradient), which is how the clipped
        sum is formed when the per-example gradient is never materialized.
      a_scale: ``[B]``: when given, ``a`` was already divided by ``a_scale`` (in float32),
        with ``a_scale`` the row's largest magnitude (1 for an all-zero
        row, NaN/Inf for a non-finite one). A convolution scales its input this way before
        unfolding it, on a tensor ``window`` times smaller than the patches.
      with_sum_error: also return :func:`outer_sum_error` for the book-keeping product.

    Returns:
      float64 ``[B]``; non-finite when a row of ``a`` or ``g`` is. With ``with_sum_error``, the
      pair ``(bound, sum_error)``.

    Privacy:
      Row ``i`` depends on example ``i`` only; the bound is never below the true squared norm.
    """
    d, p = a.shape[-1], g.shape[-1]
    # Each operand's Gram matrices as it is, or divided per example by its largest magnitude where
    # that Gram's diagonal says the example is tiny, huge or non-finite (scaled_gram): nothing
    # below overflows, and what flushes to zero is bounded relative to the example.
    if a_scale is None:
        aa, sa, ma = scaled_gram(a)
    else:
        ma = sa = tf.cast(a_scale, tf.float32)
        aa = gram(tf.cast(a, tf.float32))  # [B, T, T] float32
    gg, sg, mg = scaled_gram(g)
    sq = gram_sq_norm_bound(
        aa, gg, d=d, p=p, a_scale=sa, g_scale=sg, a_max=ma, g_max=mg, contribution=contribution
    )
    if not with_sum_error:
        return sq
    # An upper bound of a's largest magnitude (sa where a was divided by it; 1 for a NaN row).
    ma64, sa64 = tf.cast(ma, tf.float64), tf.cast(sa, tf.float64)
    a_big = tf.where(tf.math.is_finite(ma64), tf.maximum(ma64, sa64), sa64)
    return sq, outer_sum_error(dim(a, 1), d, p, a_big, mg)


# Per-example multiply-adds from which a batched product is compiled by XLA inside a graph
# (smaller products gain nothing from it and would only add a compilation per shape).
XLA_MIN_WORK = 1 << 14


def compile_batched_product(*per_example_dims: Any) -> bool:
    """Whether a batched product is compiled by XLA: inside a graph, every static per-example
    dimension known, and their product (its multiply-adds per example) at least
    :data:`XLA_MIN_WORK`."""
    if tf.executing_eagerly():
        return False
    work = 1
    for n in per_example_dims:
        if n is None:
            return False
        work *= int(n)
    return work >= XLA_MIN_WORK


@tf.function(jit_compile=True, autograph=False)
def _compiled_gram(x: tf.Tensor) -> tf.Tensor:
    return tf.matmul(x, x, transpose_b=True)


def gram(x: tf.Tensor) -> tf.Tensor:
    """``x_i x_i^T`` for every example of ``x [B, T, K]`` (float32): ``[B, T, T]``.

    Inside a graph (``tf.function``, Keras ``fit``), for static ``T`` and ``K`` with
    ``T^2 K >= XLA_MIN_WORK``, the batched product is compiled by XLA: on CPU, TensorFlow's own
    batched-matmul kernel is slower for the small ``[T, K] x [K, T]`` products of ghost norms.
    Otherwise (eagerly, small or dynamic shapes) it is TensorFlow's matmul. Either way every entry
    is a float32 dot product of length ``K`` in some summation order, which is all the error model
    of :func:`gram_sq_norm_bound` assumes, and a NaN or Inf in a row reaches that row's entries.

    Privacy:
      Example ``i``'s matrix depends on ``x_i`` only; whether XLA compiles the product depends
      on static shapes, never on values.
    """
    t, k = x.shape[1], x.shape[2]
    if compile_batched_product(t, t, k):
        return _compiled_gram(x)
    return tf.matmul(x, x, transpose_b=True)


# An example whose Gram diagonal, computed from its operand as it is, peaks in [2^-40, 2^80] keeps
# that operand and that Gram matrix: every entry is then at most 2^40 in magnitude, so no float32
# product or sum of its Gram matrix can overflow (d 2^80 < 2^127 for d < 2^47), and the absolute
# flush term of each entry (3 d 2^-126) is at most 3 d 2^-86 times its largest squared row norm.
ORDINARY_DIAGONAL = (2.0**-40, 2.0**80)


@_shared()
def gram_magnitudes(xx: tf.Tensor, *, d: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """``(m, ordinary, zero)`` from ``xx [B, T, T]``, the float32 Gram matrices of an operand of
    rows of length ``d`` as it is (undivided).

    ``ordinary[i]``: example ``i``'s diagonal peaks in :data:`ORDINARY_DIAGONAL` (False for a NaN
    or infinite entry). ``zero[i]``: its diagonal is all 0 (an all-zero operand, or one whose
    squares all flush to zero). ``m[i]`` (float64): an upper bound of example ``i``'s largest
    magnitude where it is ordinary: the largest magnitude is at most the largest row norm, and a
    diagonal entry computed as ``c`` is a sum of squares of at most ``(c + 3 d 2^-126) / (1 -
    gamma_d)`` (:func:`gram_sq_norm_bound`'s error model).

    Privacy:
      Row ``i`` depends on example ``i``'s Gram matrix only.
    """
    low, high = ORDINARY_DIAGONAL
    diag = tf.linalg.diag_part(xx)  # [B, T]
    ordinary = tf.reduce_all(diag <= high, axis=1) & tf.reduce_any(diag >= low, axis=1)
    zero = tf.reduce_all(tf.equal(diag, 0.0), axis=1)
    top = tf.reduce_max(tf.maximum(tf.cast(diag, tf.float64), 0.0), axis=1)
    inv = _inverse_complement(dot_gamma(d)) * (1.0 + 2.0**-50)
    return tf.sqrt((top + 3.0 * d * _F32_TINY) * inv) * (1.0 + 2.0**-50), ordinary, zero


def scaled_gram(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """``(xx, s, m)`` for ``x [B, T, K]``, as :func:`gram_sq_norm_bound` expects its operands:
    ``xx [B, T, T]`` the Gram matrices of ``x / s``, ``s [B]`` (float32) each example's divisor and
    ``m [B]`` (float64) an upper bound of its largest magnitude (0 for an all-zero example, NaN or
    Inf for a non-finite one).

    The Gram matrices are first computed from ``x`` as it is. An example that
    :func:`gram_magnitudes` calls ordinary keeps its matrix (``s = 1``, ``m`` from its diagonal),
    and so does an all-zero one (``m = 0``; only the examples whose diagonal is all 0 are read
    again to tell them from examples whose squares flush to zero). Any other example (tiny, huge,
    NaN or Inf) is divided by its largest magnitude (``s = m``; NaN rows stay NaN, infinite rows
    become NaN) and its matrix recomputed from ``x / s``, in a branch taken only for a batch
    holding one. A kept
    example's values are the same in either branch, so they never depend on the other examples
    of its batch; a batch of ordinary and all-zero examples needs no pass over ``x`` besides its
    Gram matrices and a read of its all-zero examples.

    Privacy:
      Row ``i`` depends on example ``i`` only.
    """
    x = tf.cast(x, tf.float32)
    return _kept_or_divided(x, gram(x))


@_shared()
def _kept_or_divided(x: tf.Tensor, xx: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """:func:`scaled_gram` after its first Gram matrices ``xx`` (one shared body per shape in a
    large program; the Gram products themselves stay in the caller's graph, compiled)."""
    m_ordinary, ordinary, zero_diagonal = gram_magnitudes(xx, d=int(x.shape[-1]))
    # The largest magnitude of the examples whose diagonal is all 0 (typically padding), read from
    # those examples only.
    which = tf.where(zero_diagonal)
    m_zero = tf.scatter_nd(
        which, abs_max(tf.gather_nd(x, which), axis=[1, 2]), tf.shape(zero_diagonal, tf.int64)
    )
    zero = zero_diagonal & tf.equal(m_zero, 0.0)
    kept = ordinary | zero
    m_kept = tf.where(zero, tf.zeros_like(m_ordinary), m_ordinary)
    ones = tf.ones_like(m_ordinary, tf.float32)

    def divided() -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        # A division, not a product with 1 / m: that reciprocal is subnormal for m > 2^126 and
        # flushes to zero (every scaled entry with it).
        m = abs_max(x, axis=[1, 2])
        s = tf.where(kept, ones, m)
        again = gram(x / s[:, None, None])
        return (
            tf.where(kept[:, None, None], xx, again),
            s,
            tf.where(kept, m_kept, tf.cast(m, tf.float64)),
        )

    return tf.cond(tf.reduce_all(kept), lambda: (xx, ones, m_kept), divided)


@_shared(_ghost_work)
def gram_sq_norm_bound(
    aa: tf.Tensor,
    gg: tf.Tensor,
    *,
    d: int,
    p: int,
    a_scale: tf.Tensor,
    g_scale: tf.Tensor,
    a_max: tf.Tensor,
    g_max: tf.Tensor,
    contribution: bool = True,
) -> tf.Tensor:
    """The certified bound of :func:`ghost_sq_norm_bound`, from the Gram matrices themselves.

    For a layer whose Gram matrices are cheaper to form from structure than by a matmul (e.g. a
    tied embedding, whose lookup rows are one-hot): ``aa [B, T, T]`` and ``gg [B, T, T]`` are the
    float32 Gram matrices of the example's operands as :func:`scaled_gram` makes them (divided by
    ``a_scale`` and ``g_scale``), each entry computed from those
    scaled operands with an error of at most ``dot_gamma(d)`` (``dot_gamma(p)``) times the product
    of the two rows' norms, as a float32 dot product of length ``d`` (``p``) has in any summation
    order (an entry that is one rounded product, or exact, qualifies).

    Args:
      aa: ``[B, T, T]`` Gram of the scaled inputs ``A_i / a_scale_i`` (rows of length ``d``).
      gg: ``[B, T, T]`` Gram of the scaled output gradients ``G_i / g_scale_i`` (length ``p``).
      d: length of the input rows (static).
      p: length of the output-gradient rows (static).
      a_scale: ``[B]`` float32 divisor of each example's inputs (their largest magnitude, or 1
        where they were left as they are: see :func:`scaled_gram`).
      g_scale: ``[B]`` float32 divisor of its output gradients.
      a_max: ``[B]`` an upper bound of the inputs' largest magnitude (NaN or Inf for a non-finite
        example); 0 only for an example whose inputs are all zero.
      g_max: ``[B]`` the same for the output gradients.
      contribution: also bound the rounding of the book-keeping product over the example's
        ``T`` positions that forms the clipped sum.

    Returns:
      float64 ``[B]``; non-finite when an example's operands are.

    Privacy:
      Row ``i`` depends on example ``i`` only; the bound is never below the true squared norm.
    """
    t = dim(aa, 1)
    ma, mg, sa, sg = a_max, g_max, a_scale, g_scale
    ga, gp_ = dot_gamma(d), dot_gamma(p)
    tt = _as_float(t)
    t2 = tt**2
    # Underflow: a float32 product or partial sum below 2^-126 may flush to zero, so each Gram
    # entry is also off by up to 3 n 2^-126 absolute (2n - 1 flushed operations, each error carried
    # through the later roundings), which no relative bound covers: a row whose scaled entries are
    # all below 2^-63 has a Gram diagonal of 0 however large its gradient.
    # An example whose operand is zero has exact zeros (no flushed operation): no term.
    eps_a = tf.cast(tf.cast(ma, tf.float64) > 0, tf.float64) * (3.0 * d * _F32_TINY)  # [B]
    eps_g = tf.cast(tf.cast(mg, tf.float64) > 0, tf.float64) * (3.0 * p * _F32_TINY)
    # Upper bounds of the scaled rows' norms ([B, T]): a non-negative sum computed as c is at most
    # (c + eps) / (1 - gamma) exactly; the float64 additions, product and root round up by 2^-50.
    inv_a, inv_g = (_inverse_complement(gamma) * (1.0 + 2.0**-50) for gamma in (ga, gp_))
    diag_a = tf.maximum(tf.cast(tf.linalg.diag_part(aa), tf.float64), 0.0)
    diag_g = tf.maximum(tf.cast(tf.linalg.diag_part(gg), tf.float64), 0.0)
    na = tf.sqrt((diag_a + eps_a[:, None]) * inv_a)
    ng = tf.sqrt((diag_g + eps_g[:, None]) * inv_g)
    # The identity's value in float64 (its T^2 terms are what may cancel).
    s = tf.reduce_sum(tf.cast(aa, tf.float64) * tf.cast(gg, tf.float64), axis=[1, 2])
    root_e = tf.reduce_sum(na * ng, axis=1)  # >= sum_t |a_t||g_t| (scaled): triangle bound
    sum_na, sum_ng = tf.reduce_sum(na, axis=1), tf.reduce_sum(ng, axis=1)
    # Each computed entry is off by at most gamma |a_s||a_t| + eps (and |aa_st| <= (1 + gamma)
    # |a_s||a_t| + eps), so sum |d(aa) gg| + |aa d(gg)| + |d(aa) d(gg)| is at most the relative
    # terms (err_a, err_g, ga gp E) plus the absolute ones below. Summed in float64, where none of
    # these products of float32 values and norms >= 2^-63 can underflow.
    abs_gg, abs_aa = tf.abs(tf.cast(gg, tf.float64)), tf.abs(tf.cast(aa, tf.float64))
    err_a = tf.einsum("bs,bst,bt->b", na, abs_gg, na)
    err_g = tf.einsum("bs,bst,bt->b", ng, abs_aa, ng)
    err = (
        ga * err_a
        + gp_ * err_g
        + ga * gp_ * tf.square(root_e)
        + eps_a * (1.0 + 2.0 * gp_) * tf.square(sum_ng)
        + eps_g * (1.0 + 2.0 * ga) * tf.square(sum_na)
        + 3.0 * t2 * eps_a * eps_g
    )
    # The float64 [B, T, T] products and sum add at most gamma_{T^2 + 3} (float64) of sum |.|,
    # and sum |aa * gg| <= (1 + ga)(1 + gp) E + the absolute terms, E = (sum_t |a_t||g_t|)^2.
    abs_sum = (
        tf.square(root_e) * (1.0 + ga) * (1.0 + gp_)
        + eps_a * (1.0 + gp_) * tf.square(sum_ng)
        + eps_g * (1.0 + ga) * tf.square(sum_na)
        + t2 * eps_a * eps_g
    )
    err = err + (t2 + 3.0) * 2.0 * F64_ROUNDOFF * abs_sum
    root = tf.sqrt(tf.maximum(s + err * _sum64_inflation(3.0 * t2 + 8.0), 0.0))
    root = tf.minimum(root * _sum64_inflation(4.0), root_e * (1.0 + 4.0 * F64_ROUNDOFF))
    # Rescaling (a division, or a reciprocal then a product) moves each scaled entry by <= 2u + u^2,
    # or by <= 2^-126 when it flushes to zero: |a_t - a'_t| <= 2^-126 sqrt(D) per position, against
    # |g_t| <= r sqrt(P), and the same for g; a and g both: (1 + u)^4 - 1 <= 4u + 7u^2. Here r >= 1
    # bounds the operands' entries: 1 for a divided operand, an upper bound of its largest
    # magnitude for one left as it is (which moves nothing, but may face a divided one).
    flushed = 3.0 * (float(d) * float(p)) ** 0.5 + 4.0 * (float(d) ** 0.5 + float(p) ** 0.5 + 1.0)
    sa64, sg64 = tf.cast(sa, tf.float64), tf.cast(sg, tf.float64)
    r = tf.maximum(
        tf.maximum(tf.cast(ma, tf.float64) / sa64, tf.cast(mg, tf.float64) / sg64)
        * (1.0 + 2.0**-50),
        1.0,
    )
    lam = (4.0 * F32_ROUNDOFF + 7.0 * F32_ROUNDOFF**2) * root_e + tt * (flushed * _F32_TINY) * r
    if contribution:
        lam = lam + dot_gamma(tt) * root_e * (1.0 + 2.0 * F32_ROUNDOFF)
    scale = sa64 * sg64
    bound = (root + lam) * scale
    # A NaN anywhere in a row must surface (tf.minimum above could otherwise drop it).
    bad = tf.logical_not(
        tf.math.is_finite(tf.cast(ma, tf.float64)) & tf.math.is_finite(tf.cast(mg, tf.float64))
    )
    bound = tf.where(bad, tf.constant(float("nan"), tf.float64), bound)
    return tf.square(bound) * _sum64_inflation(2.0)
