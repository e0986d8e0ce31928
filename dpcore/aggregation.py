"""Clipping and noise aggregation.

Contract:
- :func:`clip` turns a :class:`~dpcore.engine.summary.GradientSummary` into a :class:`ClippedSum`:
  each example's gradient scaled by ``min(1, C / ||g_i||)`` (flat) or per variable group, then
  summed. Its ``l2_sensitivity`` is the largest L2 norm one example can contribute: ``C`` for flat
  clipping, ``sqrt(sum_g C_g^2)`` for per-group clipping, under add/remove-one adjacency.
- Nothing rescales a ``ClippedSum`` before noise. :func:`privatize` adds Gaussian noise of std
  ``noise_multiplier * l2_sensitivity`` to every coordinate of the sum, exactly once, and then
  divides by ``expected_batch_size`` (never by the realized batch size). That std is 0 (σ = 0) or
  within ``[MIN_NOISE_STDDEV, MAX_NOISE_STDDEV] = [2^-40, 2^100]``, checked where σ and the bound
  are given and again when the step runs: below, float32 flushes noise values to zero (the
  release would be the clipped sum without noise); above, they overflow.
- Noise is standard normal by the Box-Muller transform of ``tf.random.stateless_uniform`` (Philox)
  draws, with a seed the caller owns (the optimizer keeps it as checkpointed state), so the same
  seed reproduces the same noise and a resumed run draws fresh noise.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any, SupportsFloat

import tensorflow as tf

from dpcore.engine.summary import GradientSummary
from dpcore.norms import round_down_f32
from dpcore_accounting import events

_TINY = 1e-12
# An example's contribution to a clipped sum has norm at most C * (1 + CONTRIBUTION_TOLERANCE):
# its certified norm bound (dpcore.norms) covers the rounding of the weighted sum over the example's
# own terms; this covers the final float32 roundings of the factor and of each weighted term.
CONTRIBUTION_TOLERANCE = 1e-6


# The noise std σ·Δ of a release is 0 (σ = 0: a run that claims no privacy) or within
# [MIN_NOISE_STDDEV, MAX_NOISE_STDDEV]; privatize checks it when the step runs, the optimizer's
# constructor and setter when σ and C are given.
# The lower limit: TensorFlow's CPU kernels flush float32 subnormals (below 2^-126) to zero, so a
# noise value z·std below 2^-126 would be exactly 0 while the clipped sum it is added to stays a
# normal float: the release would be the un-noised sum (probability 0.01 per step at std 2^-120).
# A standard normal of standard_normal is never 0 and at least 2^-38 in magnitude (radius >=
# 2^-11.5, the sine/cosine of its float32 angle >= 2^-26.4; _polar_from_bits), so with std >=
# 2^-40 every noise value is at least 2^-78: normal, never flushed.
MIN_NOISE_STDDEV = 2.0**-40
# The upper limit: a standard normal is at most NOISE_RADIUS_MAX < 2^4, so every noise value is
# below 2^104, finite in float32 (largest 2^128), with room for the clipped sum it is added to.
MAX_NOISE_STDDEV = 2.0**100


def _check_clip(name: str, value: object) -> float:
    """A clip bound: a number > 0, inf included (no clipping, accepted only with σ = 0)."""
    return events.check_number(
        value,
        name,
        low=0.0,
        low_open=True,
        allow_inf=True,
        expected="a number > 0 (inf only with noise_multiplier=0)",
    )


def check_privacy_args(
    *,
    l2_norm_clip: float | list[float] | tuple[float, ...],
    noise_multiplier: SupportsFloat,
    expected_batch_size: float,
) -> None:
    """Raises ValueError naming the argument for a missing, mistyped or out-of-range privacy
    parameter (:func:`dpcore_accounting.events.check_number`: None, bools, strings and NaN are
    refused).

    ``noise_multiplier`` must be finite and >= 0, ``expected_batch_size`` finite and > 0, every
    ``l2_norm_clip`` > 0. An infinite clip bound (no clipping: unbounded sensitivity) is only
    accepted with ``noise_multiplier == 0``, i.e. for a run that claims no privacy. With
    ``noise_multiplier`` σ > 0 the noise std ``σ * l2_sensitivity`` (``C``, or ``sqrt(sum C_g^2)``
    for per-group bounds) must lie in ``[MIN_NOISE_STDDEV, MAX_NOISE_STDDEV]``: below, float32
    flushes noise values to zero; above, they overflow.
    """
    if isinstance(l2_norm_clip, (list, tuple)):
        if not l2_norm_clip:
            raise ValueError("l2_norm_clip=[]: give one bound, or one per variable group.")
        clips = [_check_clip(f"l2_norm_clip[{i}]", c) for i, c in enumerate(l2_norm_clip)]
    else:
        clips = [_check_clip("l2_norm_clip", l2_norm_clip)]
    sigma = events.check_noise_multiplier(noise_multiplier)
    events.check_number(expected_batch_size, "expected_batch_size", low=0.0, low_open=True)
    if sigma > 0 and not all(math.isfinite(c) for c in clips):
        raise ValueError(
            f"l2_norm_clip={l2_norm_clip!r} with noise_multiplier={noise_multiplier!r}: an infinite "
            "clip bound has unbounded sensitivity, so no noise makes the step private; use a "
            "finite l2_norm_clip (an infinite one only with noise_multiplier=0, a non-private run)."
        )
    if sigma > 0:
        stddev = sigma * math.hypot(*clips)
        if not MIN_NOISE_STDDEV <= stddev <= MAX_NOISE_STDDEV:
            raise ValueError(
                f"l2_norm_clip={l2_norm_clip!r} with noise_multiplier={noise_multiplier!r} gives a "
                f"noise std of {stddev!r}, outside [2^-40, 2^100] (MIN_NOISE_STDDEV, "
                "MAX_NOISE_STDDEV): float32 flushes smaller noise values to zero, which would "
                "release the clipped sum without noise, and overflows on larger ones. Rescale the "
                "loss or the bound so that noise_multiplier * l2_norm_clip is in that range (or "
                "use noise_multiplier=0 for a non-private run)."
            )


@dataclasses.dataclass(frozen=True)
class ClippedSum:
    """The sum of clipped per-example gradients of one (micro-)batch.

    Attributes:
      grads: one tensor per variable: ``sum_i w_i * grad_i``.
      l2_sensitivity: the most one example can change ``grads`` in L2 norm (a Python float).
      num_examples: realized number of unmasked examples (for logging; never for normalization).
      per_example_norms: ``[B]`` unclipped per-example gradient norms (zero where masked).
      clip_weights: ``[B, V]`` the factors applied to each example's gradient for each variable.
      per_example_loss: ``[B]`` the examples' losses (zero where masked).
      unclipped_count: with ``count_unclipped=True``, the float64 scalar
        ``sum_i mask_i (1[example i was not clipped] - 1/2)`` (sensitivity 1/2, for adaptive
        clipping, :mod:`dpcore.adaptive`); None otherwise. It must be noised before release too.

    ``l2_sensitivity`` is a scalar float64 tensor when the bound is (adaptive clipping reads it from
    the optimizer's ``l2_norm_clip`` variable).

    Privacy:
      ``grads`` has L2 sensitivity ``l2_sensitivity`` (add or remove one example) but is not
      private until :func:`privatize` noises it once, unrescaled; ``unclipped_count`` needs its
      own noise too. The other fields (norms, factors, losses, the realized
      ``num_examples``) are raw per-example data: never release them or normalize by them.
    """

    grads: tuple[tf.Tensor, ...]
    l2_sensitivity: float | tf.Tensor
    num_examples: tf.Tensor
    per_example_norms: tf.Tensor
    clip_weights: tf.Tensor
    per_example_loss: tf.Tensor
    unclipped_count: tf.Tensor | None = None


def clip_factors(norms: tf.Tensor, *, l2_norm_clip: float | tf.Tensor) -> tf.Tensor:
    """``min(1, l2_norm_clip / norm)`` elementwise (1 for a zero norm), in float64.

    ``l2_norm_clip`` is a Python number (checked here) or a tensor (scalar, or one budget per
    example) holding a bound checked where it was set (the adaptive bound variable).

    Privacy:
      A gradient of norm at most ``norm`` scaled by the factor has norm at most ``l2_norm_clip``.
    """
    if isinstance(l2_norm_clip, numbers.Real):
        l2_norm_clip = _check_clip("l2_norm_clip", float(l2_norm_clip))
    else:
        l2_norm_clip = tf.cast(l2_norm_clip, tf.float64)
    norms = tf.cast(norms, tf.float64)
    return tf.minimum(tf.constant(1.0, tf.float64), l2_norm_clip / tf.maximum(norms, _TINY))


def _sum_inflation(num_terms: int) -> float:
    """``1 + gamma`` for a float64 sum of ``num_terms`` non-negative squared-norm bounds."""
    return 1.0 + 2.0 * (num_terms + 2) * 2.0**-53


def total_norm_bound(sq_norms: tf.Tensor) -> tf.Tensor:
    """``[B, V]`` float64 squared-norm bounds per variable -> ``[B]`` bound of the total norm.

    Privacy:
      An upper bound of each example's whole-gradient norm when every column is one.
    """
    sq = tf.cast(sq_norms, tf.float64)
    return tf.sqrt(tf.reduce_sum(sq, axis=1) * _sum_inflation(sq.shape[-1] or 1))


@tf.autograph.experimental.do_not_convert
def clip(
    summary: GradientSummary,
    *,
    l2_norm_clip: float | list[float] | tuple[float, ...] | tf.Tensor,
    variable_groups: Sequence[int] | None = None,
    count_unclipped: bool = False,
) -> ClippedSum:
    """Clips every example's gradient and sums them.

    The norms are the engine's certified upper bounds (:mod:`dpcore.norms`), combined and turned
    into factors in float64; the factors are rounded toward zero to float32. So each example's
    contribution to ``grads`` has norm at most ``C * (1 + CONTRIBUTION_TOLERANCE)`` whatever its
    values, the tolerance covering the float32 products of the weighted sum itself. Where the
    weighted sum has an error that does not shrink with the factor (``summary.sum_errors``: a
    flushed ``w g`` in a product with activations near float32's limit), the factor clips to
    ``C`` minus that error (to zero if the error exceeds ``C``).

    Args:
      summary: the engine's per-example norms and weighted-sum function for one batch.
      l2_norm_clip: a single bound ``C`` (flat clipping over all variables), or one bound per
        variable group.
      variable_groups: with a list of bounds, the group index of each variable in
        ``summary.variables`` (default: one group per variable, in order).
      count_unclipped: flat clipping only: also count the examples left unclipped (certified
        norm bound <= C, the same bound that decides the factor) into ``unclipped_count``.

    Returns:
      A :class:`ClippedSum` with ``l2_sensitivity`` C, or ``sqrt(sum C_g^2)`` per group.

    Privacy:
      Each example's contribution to each group is scaled to norm ``<= C_g``; masked examples get
      weight 0. The result must receive noise before it leaves the trusted step.
    """
    sq = tf.cast(summary.sq_norms, tf.float64)
    num_vars = len(summary.variables)
    mask = tf.cast(summary.mask, tf.float64)
    unclipped_count = None
    if isinstance(l2_norm_clip, (list, tuple)):
        if count_unclipped:
            raise ValueError("count_unclipped needs one flat l2_norm_clip, not per-group bounds.")
        bounds = [_check_clip("l2_norm_clip", c) for c in l2_norm_clip]
        groups = list(range(num_vars)) if variable_groups is None else list(variable_groups)
        if len(groups) != num_vars:
            raise ValueError(
                f"variable_groups has {len(groups)} entries but there are {num_vars} variables."
            )
        if sorted(set(groups)) != list(range(len(bounds))):
            raise ValueError(
                f"variable_groups={groups} must use every group index 0..{len(bounds) - 1} "
                f"(one per l2_norm_clip bound, got {len(bounds)} bounds)."
            )
        one_hot = tf.one_hot(groups, len(bounds), dtype=tf.float64)  # [V, G]
        # Summing float64 squares adds at most gamma_V: keep the result an upper bound.
        group_norms = tf.sqrt(tf.matmul(sq, one_hot) * _sum_inflation(num_vars))  # [B, G]
        budget = tf.constant(bounds, tf.float64)[None, :]
        if summary.sum_errors is not None:
            errors = tf.matmul(tf.cast(summary.sum_errors, tf.float64), one_hot)
            budget = tf.maximum(budget - errors * _sum_inflation(num_vars), 0.0)
        factors = tf.minimum(tf.constant(1.0, tf.float64), budget / tf.maximum(group_norms, _TINY))
        weights = tf.matmul(factors, one_hot, transpose_b=True)  # [B, V]
        sensitivity = math.sqrt(sum(c * c for c in bounds))
    else:
        c = (
            _check_clip("l2_norm_clip", float(l2_norm_clip))
            if isinstance(l2_norm_clip, numbers.Real)
            else tf.cast(l2_norm_clip, tf.float64)
        )
        budget = c
        if summary.sum_errors is not None:
            errors = tf.reduce_sum(tf.cast(summary.sum_errors, tf.float64), axis=1)
            budget = tf.maximum(c - errors * _sum_inflation(num_vars), 0.0)
        factors = clip_factors(total_norm_bound(sq), l2_norm_clip=budget)
        weights = tf.tile(factors[:, None], [1, num_vars])
        sensitivity = c
        if count_unclipped:
            unclipped = tf.cast(tf.equal(factors, 1.0), tf.float64)
            unclipped_count = tf.reduce_sum((unclipped - 0.5) * mask)
    weights = round_down_f32(weights * mask[:, None])
    grads = tuple(summary.weighted_sum(weights))
    return ClippedSum(
        grads=grads,
        l2_sensitivity=sensitivity,
        num_examples=tf.cast(tf.reduce_sum(mask), tf.float32),
        per_example_norms=tf.cast(tf.sqrt(tf.reduce_sum(sq, axis=1)) * mask, tf.float32),
        clip_weights=weights,
        per_example_loss=summary.per_example_loss,
        unclipped_count=unclipped_count,
    )


# Tensors are drawn in groups of consecutive tensors of at most this many elements together (a
# larger tensor forms a group alone): one draw per group instead of one per tensor keeps the
# traced step small (a transformer has dozens of small variables). The cap keeps each group's
# split into its tensors (a copy) small beside the draw, and its temporaries no larger than the
# largest variable's: a large kernel drawn together with small variables is slower than drawn
# alone.
NOISE_GROUP_ELEMENTS = 2**18


def noise_groups(sizes: Sequence[int]) -> list[list[int]]:
    """Indices of ``sizes`` (element counts, in order) grouped for :func:`standard_normal`.

    Consecutive tensors share a group while their total stays at most :data:`NOISE_GROUP_ELEMENTS`;
    a tensor that would take a non-empty group past it starts the next group. Depends on the sizes
    only.
    """
    groups: list[list[int]] = []
    total = 0
    for j, n in enumerate(sizes):
        if not groups or (groups[-1] and total + n > NOISE_GROUP_ELEMENTS):
            groups.append([])
            total = 0
        groups[-1].append(j)
        total += n
    return groups


def standard_normal(like: Sequence[Any], *, seed: tf.Tensor) -> list[tf.Tensor]:
    """Independent float32 ``N(0, 1)`` draws shaped like each of ``like`` (tensors or variables).

    The stream: the tensors are grouped by :func:`noise_groups` (from their static sizes); group
    ``g`` draws the Box-Muller transform (:func:`_box_muller`) of as many values as its tensors
    have elements with seed ``fold_in(seed, int64(g))`` (a 64-bit draw from ``seed``, then
    ``g``), and its tensors take consecutive slices of it in order, each reshaped to its shape. Each value is at most :data:`NOISE_RADIUS_MAX` (9.42) in
    magnitude, a support wide enough that no output a neighbouring dataset cannot produce has
    more than about ``1e-12`` probability per step (PRIVACY.md, "Noise support").

    Args:
      like: tensors (or variables) giving the shapes.
      seed: an int32/int64 tensor of shape ``[2]``.

    Returns:
      One float32 tensor per input. The draw depends on ``seed`` and the shapes only, never on
      data, so a step may make it before its forward pass.

    Privacy:
      This is the Gaussian mechanism's noise, a function of ``seed``: the seed must be secret
      and fresh for every logical step, since a reused seed repeats the draw and the difference
      of the two releases is then noise-free.
    """
    seed = tf.cast(seed, tf.int64)
    shapes = [tf.TensorShape(t.shape) for t in like]
    sizes = [s.num_elements() for s in shapes]
    # fold_in(seed, g) for an int64 g is [r, g] with r one 64-bit draw from seed, the same for
    # every g: drawn once here. 64 bits, not 32: with an int32 r, two steps of a run of 10^5
    # steps would share their whole noise draw with probability 0.69 (birthday bound), and the
    # difference of those two releases would be noise-free.
    r = tf.random.stateless_uniform([], seed=seed, dtype=tf.int64, minval=None, maxval=None)
    out: list[tf.Tensor] = []
    for g, members in enumerate(noise_groups(sizes)):
        z = _box_muller(
            sum(sizes[j] for j in members), seed=tf.stack([r, tf.constant(g, tf.int64)])
        )
        if len(members) == 1:
            out.append(tf.reshape(z, shapes[members[0]]))
            continue
        parts = tf.split(z, [sizes[j] for j in members])
        out.extend(tf.reshape(part, shapes[j]) for part, j in zip(parts, members))
    return out


# Each Box-Muller pair's radius is sqrt(-2 log w), w uniform on (0, 1] in steps as fine as 2^-64
# near 0, so the largest radius is sqrt(128 ln 2) = 9.42. A bounded support lets an output fall
# where a neighbouring dataset's cannot (probability mass outside the Gaussian mechanism's
# accounting): with 23-bit uniforms (radius at most 5.65, TensorFlow's normal stops at 5.68) that
# mass reached 2e-4 per step for a 500k-weight model at σ = 1.6 (PRIVACY.md, "Noise support").
NOISE_RADIUS_MAX = math.sqrt(128.0 * math.log(2.0))


def _box_muller(n: int, *, seed: tf.Tensor) -> tf.Tensor:
    """``n`` float32 ``N(0, 1)`` values (``[n]``) by the Box-Muller transform of Philox bits.

    The bits are ``stateless_uniform([3, ceil(n / 2)], seed, dtype=int32, minval=None,
    maxval=None)``: per pair two words for the radius and one for the angle
    (:func:`_polar_from_bits`). The values are the cosine half, then the sine half, cut to ``n``.
    Written with whole-tensor ops: ``tf.random.stateless_normal`` evaluates the logarithm, root
    and sine/cosine one scalar at a time, and stops at radius 5.68.
    """
    half = (n + 1) // 2
    bits = tf.random.stateless_uniform(
        [3, half], seed=seed, dtype=tf.int32, minval=None, maxval=None
    )
    radius, angle = _polar_from_bits(*tf.unstack(bits))
    z = tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], 0)
    return z[:n] if 2 * half != n else z


def _polar_from_bits(
    high: tf.Tensor, low: tf.Tensor, angle_bits: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """Box-Muller radius and angle (float32) from three int32 words of random bits per pair.

    The radius is ``sqrt(-2 log w)`` with ``w = min((h + t) 2^-24, 1 - 2^-24)``: ``h`` the top 24
    bits of ``high`` (exact in float32) and ``t = (l + 1) 2^-40`` in ``(0, 1]`` from the other 40
    bits (``high``'s low 8, then ``low``), so ``w`` is uniform on ``(0, 1)`` down to ``2^-64`` and
    the radius lies in ``[2^-11.5, NOISE_RADIUS_MAX]`` (never NaN or infinite, for any bits). The
    angle is ``2 pi (a + 1/2) 2^-24``, ``a`` the top 24 bits of ``angle_bits``.

    No value is 0: without the cap, the float32 sum ``h + t`` rounds to ``2^24`` (``w = 1``,
    radius 0) for 2^-25 of the pairs, and without the half step the angle 0 has sine 0 for 2^-24
    of them; a value of exactly 0 releases its coordinate of the clipped sum without noise (in
    about 2 % of the steps of a 500k-weight model). The smallest magnitude is about
    ``2^-11.5 * 2^-26.4 = 2^-38``, so with a noise std of at least :data:`MIN_NOISE_STDDEV`
    every noise value is a normal float32.
    """
    high, low, angle_bits = (tf.bitcast(b, tf.uint32) for b in (high, low, angle_bits))
    eight = tf.constant(8, tf.uint32)
    top = tf.cast(tf.bitwise.right_shift(high, eight), tf.float32)
    # float32 rounding keeps this sum in [1, 2^40] (2^40 + 1 rounds to 2^40), so t <= 1 and w <= 1.
    rest = (
        tf.cast(tf.bitwise.bitwise_and(high, tf.constant(255, tf.uint32)), tf.float32) * 2.0**32
        + tf.cast(low, tf.float32)
        + 1.0
    )
    w = tf.minimum((top + rest * 2.0**-40) * 2.0**-24, 1.0 - 2.0**-24)
    radius = tf.sqrt(-2.0 * tf.math.log(w))
    angle = (tf.cast(tf.bitwise.right_shift(angle_bits, eight), tf.float32) + 0.5) * (
        2.0 * math.pi * 2.0**-24
    )
    return radius, angle


def _static_shape(t: Any) -> tuple[int | None, ...] | None:
    shape = tf.TensorShape(t.shape)
    return None if shape.rank is None else tuple(shape.as_list())


def gaussian_noise(
    like: Sequence[tf.Tensor],
    *,
    stddev: float | tf.Tensor,
    seed: tf.Tensor,
    unit: Sequence[tf.Tensor] | None = None,
) -> list[tf.Tensor]:
    """Independent ``N(0, stddev^2)`` noise shaped like each tensor of ``like``.

    Args:
      like: tensors giving shapes and dtypes.
      stddev: the standard deviation.
      seed: an int32/int64 tensor of shape ``[2]`` (the stream of :func:`standard_normal`).
      unit: the :func:`standard_normal` draw for ``seed``, if already made.

    Returns:
      One noise tensor per input.

    Raises:
      ValueError: if ``unit`` does not have one tensor of each input's static shape, in order (a
        draw for other variables would leave a variable without noise, or broadcast one noise
        value over many coordinates).

    Privacy:
      Data-independent: scaled :func:`standard_normal` values, with that stream's needs (a
      secret seed, fresh per logical step). Only the shapes of a pre-drawn ``unit`` are checked;
      it must be the draw for this ``seed``, and ``stddev`` must be σ times the sensitivity.
    """
    if unit is None:
        unit = standard_normal(like, seed=seed)
    else:
        want, got = ([_static_shape(t) for t in ts] for ts in (like, unit))
        if want != got:
            raise ValueError(
                f"The pre-drawn noise has shapes {got}, the gradients {want}: draw it for the "
                "same variables, in the same order."
            )
    return [tf.cast(z * tf.cast(stddev, tf.float32), t.dtype) for z, t in zip(unit, like)]


def as_float64(value: Any) -> tf.Tensor:
    """``value`` as a float64 tensor; a Python number directly, not through float32 (where 1e-50
    is 0 and 1e50 infinite)."""
    if isinstance(value, numbers.Real):
        return tf.constant(float(value), tf.float64)
    return tf.cast(value, tf.float64)


def checked_noise_stddev(stddev: tf.Tensor) -> tf.Tensor:
    """The float64 noise std ``stddev``, once the step has checked that it is 0 or within
    ``[MIN_NOISE_STDDEV, MAX_NOISE_STDDEV]`` (it fails otherwise).

    For a std read when the step runs (σ or a bound restored from a checkpoint skips the checks
    of the constructor and the setter). Where the assertion does not run (XLA drops it), the
    returned std is NaN, so the release is NaN rather than un-noised.

    Privacy:
      A smaller non-zero std is flushed to zero noise by float32 (the release would be the
      un-noised clipped sum); a larger one overflows.
    """
    stddev = as_float64(stddev)
    ok = tf.equal(stddev, 0.0) | ((stddev >= MIN_NOISE_STDDEV) & (stddev <= MAX_NOISE_STDDEV))
    check = tf.debugging.Assert(
        ok,
        [
            "dpcore: the noise std (noise_multiplier * l2_sensitivity) must be 0 or within "
            "[2^-40, 2^100] when the step runs (float32 flushes smaller noise to zero and "
            "overflows on larger); the step was not applied. Got",
            stddev,
        ],
    )
    with tf.control_dependencies([check]):
        return tf.where(ok, stddev, stddev * float("nan"))


@tf.autograph.experimental.do_not_convert
def privatize(
    clipped: ClippedSum,
    *,
    noise_multiplier: float | tf.Tensor,
    expected_batch_size: float,
    seed: tf.Tensor,
    unit_noise: Sequence[tf.Tensor] | None = None,
) -> list[tf.Tensor]:
    """Adds Gaussian noise once to a clipped sum and normalizes by the expected batch size.

    Args:
      clipped: the (possibly accumulated) clipped sum of one logical step.
      noise_multiplier: σ; noise std is ``σ * clipped.l2_sensitivity``. A Python number (with
        a Python bound) is checked here (and σ = 0 skips the noise draw), against the same
        range as below. A scalar tensor (the optimizer's ``noise_multiplier`` variable, so that
        a σ schedule takes effect without retracing), or a tensor bound, is read when the step
        runs: the step fails unless σ is finite and at least 0 and the noise std is 0 or within
        ``[MIN_NOISE_STDDEV, MAX_NOISE_STDDEV]`` (:func:`checked_noise_stddev`); a variable
        restored from a checkpoint, or a σ derived from it, was never checked by a setter.
      expected_batch_size: the divisor (``sampling_prob * num_examples`` under Poisson sampling).
      seed: ``[2]`` integer tensor; a fresh one per logical step.
      unit_noise: ``standard_normal(clipped.grads, seed=seed)`` when it was drawn earlier (to
        overlap the draw with the forward pass); it must be exactly that draw.

    Returns:
      The privatized average gradient, one tensor per variable.

    Privacy:
      This is the Gaussian mechanism on a sum of L2 sensitivity ``clipped.l2_sensitivity``. Call it
      exactly once per logical step; dividing by a data-independent constant keeps the guarantee.
    """
    scale = 1.0 / float(expected_batch_size)
    # A tensor σ or bound (a variable, restored from a checkpoint) is checked when the step runs.
    if not (
        isinstance(noise_multiplier, numbers.Real)
        and isinstance(clipped.l2_sensitivity, numbers.Real)
    ):
        sigma = as_float64(noise_multiplier)
        # A NaN or negative σ would otherwise mean std 0 below: no noise, and no error.
        valid = tf.math.is_finite(sigma) & (sigma >= 0.0)
        check = tf.debugging.Assert(
            valid, ["noise_multiplier must be finite and >= 0 when the step runs; got", sigma]
        )
        with tf.control_dependencies([check]):
            sigma = tf.identity(sigma)
        sensitivity = as_float64(clipped.l2_sensitivity)
        # sigma == 0 with an infinite bound (a non-private run) is std 0, not 0 * inf = NaN. Any
        # other sigma that is not > 0 is NaN noise: where the assertion above does not run (XLA
        # drops it), the release is NaN rather than un-noised.
        stddev = tf.where(
            sigma > 0,
            sigma * sensitivity,
            tf.where(tf.equal(sigma, 0.0), tf.zeros_like(sigma), sigma * float("nan")),
        )
        noise = gaussian_noise(
            clipped.grads, stddev=checked_noise_stddev(stddev), seed=seed, unit=unit_noise
        )
        return [(g + n) * scale for g, n in zip(clipped.grads, noise)]
    bound = float(clipped.l2_sensitivity)
    check_privacy_args(
        l2_norm_clip=bound,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
    )
    if float(noise_multiplier) == 0.0:  # no noise requested (tests, non-private baselines)
        return [g * scale for g in clipped.grads]
    stddev = float(noise_multiplier) * bound
    noise = gaussian_noise(clipped.grads, stddev=stddev, seed=seed, unit=unit_noise)
    return [(g + n) * scale for g, n in zip(clipped.grads, noise)]
