"""Quantile-adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive
Clipping"): the clip bound C follows a target quantile of the per-example gradient norms.

Contract:
- :class:`AdaptiveClip` is the keyword-only configuration ``DPOptimizer(..., adaptive_clip=...)``
  takes: target quantile γ, learning rate η and the count noise std σ_b.
- Each logical step also releases the noised fraction of unclipped examples
  ``b̃ = (sum_i (1[||g_i|| <= C] - 1/2) + N(0, σ_b^2)) / expected_batch_size + 1/2``, where the
  indicator uses the same certified norm bounds that decide the clip factors and masked rows add
  nothing. Centring the indicator at 1/2 (the paper's estimator, as in TF Privacy's
  ``QuantileAdaptiveClipSumQuery``) gives the count sensitivity 1/2 under add/remove-one
  adjacency; with ``n`` real rows it estimates the unclipped fraction exactly when
  ``n = expected_batch_size``.
- The next bound is the geometric update ``C <- C * exp(-η (b̃ - γ))``, a function of the noised
  fraction only, kept within ``[MIN_CLIP, MAX_CLIP] = [2^-30, 2^60]``. With the σ_Δ
  :func:`check_noise_range` accepts, the gradient noise std ``σ_Δ C`` then stays within
  ``[2^-40, 2^100]`` (:data:`dpcore.aggregation.MIN_NOISE_STDDEV`, ``MAX_NOISE_STDDEV``): float32
  neither flushes a noise value to zero nor overflows. The initial bound must lie in that range
  too, and the step checks C (restored from a checkpoint without a check) when it runs.
- The step's noised gradient sum (sensitivity C) and noised count (sensitivity 1/2) release one
  example's contribution through one Gaussian mechanism of noise multiplier σ with
  ``σ^-2 = σ_Δ^-2 + (2 σ_b)^-2``: the gradient noise multiplier is
  :func:`gradient_noise_multiplier` of the σ a run accounts for (its ``noise_multiplier``), so the
  ledger, the ``DpEvent`` and ``DPConfig`` carry that effective σ unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import tensorflow as tf

from dpcore import aggregation

__all__ = [
    "MAX_CLIP",
    "MIN_CLIP",
    "AdaptiveClip",
    "check_noise_range",
    "effective_noise_multiplier",
    "gradient_noise_multiplier",
    "noised_unclipped_fraction",
    "updated_clip",
]

# The count noise is drawn from fold_in(step seed, int64(_COUNT_STREAM)); the gradient noise of
# variable group g uses fold_in(step seed, int64(g)) (dpcore.aggregation.standard_normal), g < the number of
# variables.
_COUNT_STREAM = 2**31 - 1
# The update keeps C within [MIN_CLIP, MAX_CLIP], and DPOptimizer accepts adaptive clipping only
# with σ_Δ = 0 or MIN_NOISE_STDDEV / MIN_CLIP <= σ_Δ <= MAX_NOISE_STDDEV / MAX_CLIP, i.e. σ_Δ in
# [2^-10, 2^40] (check_noise_range): at every C the update can reach, the gradient noise std
# σ_Δ C is then within [2^-40, 2^100] (dpcore.aggregation.MIN_NOISE_STDDEV, MAX_NOISE_STDDEV), so
# float32 never flushes a noise value to zero (a std near 2^-126 released the un-noised sum with
# probability 0.01 per step) and never overflows (σ_Δ 2^127 did). σ_Δ >= σ, so the lower limit
# asks σ >= 2^-10, far below any σ with a meaningful guarantee. The step checks C and the noise
# std again when it runs: a checkpoint restores σ and C without these checks.
MIN_CLIP = 2.0**-30
MAX_CLIP = 2.0**60
_MIN_GRADIENT_NOISE = aggregation.MIN_NOISE_STDDEV / MIN_CLIP
_MAX_GRADIENT_NOISE = aggregation.MAX_NOISE_STDDEV / MAX_CLIP


def _finite_at_least(name: str, value: object, low: float, *, strict: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    v = float(value)
    if not math.isfinite(v) or v < low or (strict and v == low):
        sign = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {sign} {low}, got {value!r}.")
    return v


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptiveClip:
    """Settings of quantile-adaptive clipping (frozen, keyword-only).

    The initial bound is the optimizer's ``l2_norm_clip``; flat clipping only (one bound).

    Attributes:
      target_quantile: γ in (0, 1): the fraction of examples that should be left unclipped.
      learning_rate: η >= 0 of the geometric update ``C <- C exp(-η (b̃ - γ))`` (the paper uses
        0.2); 0 keeps C fixed while still releasing the count.
      count_stddev: σ_b >= 0, the std of the Gaussian noise on the centred count of unclipped
        examples (the paper suggests ``expected_batch_size / 20``). It must exceed half the
        run's ``noise_multiplier`` (unless that is 0); larger values leave more of the privacy
        budget to the gradient.
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float

    def __post_init__(self) -> None:
        gamma = _finite_at_least("target_quantile", self.target_quantile, 0.0, strict=True)
        if gamma >= 1.0:
            raise ValueError(f"target_quantile must be in (0, 1), got {self.target_quantile!r}.")
        object.__setattr__(self, "target_quantile", gamma)
        object.__setattr__(
            self,
            "learning_rate",
            _finite_at_least("learning_rate", self.learning_rate, 0.0, strict=False),
        )
        object.__setattr__(
            self,
            "count_stddev",
            _finite_at_least("count_stddev", self.count_stddev, 0.0, strict=False),
        )

    def gradient_noise_multiplier(self, *, noise_multiplier: float) -> float:
        """σ_Δ for a run accounted with ``noise_multiplier`` (see :func:`gradient_noise_multiplier`)."""
        return gradient_noise_multiplier(
            noise_multiplier=noise_multiplier, count_stddev=self.count_stddev
        )

    def to_dict(self) -> dict[str, float]:
        """The fields, JSON-ready (``AdaptiveClip(**d)`` rebuilds it)."""
        return dataclasses.asdict(self)


def gradient_noise_multiplier(*, noise_multiplier: float, count_stddev: float) -> float:
    """σ_Δ, the gradient's noise multiplier, with ``σ_Δ^-2 + (2 σ_b)^-2 = σ^-2``.

    Args:
      noise_multiplier: σ, the noise multiplier the run is accounted with.
      count_stddev: σ_b, the std of the count noise (the centred count has sensitivity 1/2).

    Returns:
      σ_Δ >= σ (0 when σ = 0: a run without privacy).

    Raises:
      ValueError: when ``2 σ_b <= σ`` and σ > 0: the count alone would spend the whole budget.

    Privacy:
      The gradient sum (sensitivity C, noise std σ_Δ C) and the count (sensitivity 1/2, noise std
      σ_b) of one step together are one Gaussian mechanism of noise multiplier σ.
    """
    sigma = _finite_at_least("noise_multiplier", noise_multiplier, 0.0, strict=False)
    sigma_b = _finite_at_least("count_stddev", count_stddev, 0.0, strict=False)
    if sigma == 0.0:
        return 0.0
    if not 2.0 * sigma_b > sigma:
        raise ValueError(
            f"count_stddev={count_stddev!r} is too small for noise_multiplier={noise_multiplier!r}: "
            "adaptive clipping needs 2 * count_stddev > noise_multiplier (the count's noise "
            "multiplier 2 * count_stddev must exceed the run's); raise count_stddev (e.g. "
            "expected_batch_size / 20) or lower noise_multiplier."
        )
    return sigma / math.sqrt(1.0 - (sigma / (2.0 * sigma_b)) ** 2)


def check_noise_range(
    *, noise_multiplier: float, count_stddev: float, l2_norm_clip: float | None = None
) -> float:
    """σ_Δ of ``noise_multiplier``, checked against the range of C the update keeps.

    Args:
      noise_multiplier: σ, the noise multiplier the run is accounted with.
      count_stddev: σ_b, the std of the count noise.
      l2_norm_clip: the initial bound C, or None to check σ alone (a σ set between steps).

    Returns:
      σ_Δ (:func:`gradient_noise_multiplier`).

    Raises:
      ValueError: when ``2 σ_b <= σ`` (σ > 0); when σ > 0 and σ_Δ is outside ``[2^-10, 2^40]``,
        so that ``σ_Δ C`` could leave ``[MIN_NOISE_STDDEV, MAX_NOISE_STDDEV]`` at some C in
        ``[MIN_CLIP, MAX_CLIP]``; when ``l2_norm_clip`` is outside ``[MIN_CLIP, MAX_CLIP]``.

    Privacy:
      Within these ranges the gradient noise std is never flushed to zero by float32 (which
      would release the clipped sum without noise) and never overflows.
    """
    sigma_delta = gradient_noise_multiplier(
        noise_multiplier=noise_multiplier, count_stddev=count_stddev
    )
    if sigma_delta > 0.0 and not _MIN_GRADIENT_NOISE <= sigma_delta <= _MAX_GRADIENT_NOISE:
        raise ValueError(
            f"noise_multiplier={noise_multiplier!r} with count_stddev={count_stddev!r} gives a "
            f"gradient noise multiplier of {sigma_delta!r}, outside [2^-10, 2^40]: adaptive "
            "clipping moves C within [2^-30, 2^60] (MIN_CLIP, MAX_CLIP), and the noise std "
            "sigma_delta * C must stay within [2^-40, 2^100] there (float32 flushes smaller noise "
            "values to zero and overflows on larger). Use noise_multiplier=0 for a non-private "
            "run."
        )
    if l2_norm_clip is not None:
        c = float(l2_norm_clip)
        if not MIN_CLIP <= c <= MAX_CLIP:
            raise ValueError(
                f"adaptive clipping needs an initial l2_norm_clip within [2^-30, 2^60] "
                f"(MIN_CLIP, MAX_CLIP, the range the bound is kept in), got {l2_norm_clip!r}; "
                "rescale the loss if the gradient norms are outside it."
            )
    return sigma_delta


def effective_noise_multiplier(*, gradient_noise_multiplier: float, count_stddev: float) -> float:
    """σ with ``σ^-2 = σ_Δ^-2 + (2 σ_b)^-2``: what one adaptive step costs, as one Gaussian.

    Args:
      gradient_noise_multiplier: σ_Δ, the noise multiplier on the clipped gradient sum.
      count_stddev: σ_b, the std of the count noise.

    Returns:
      σ <= min(σ_Δ, 2 σ_b) (0 when either is 0).

    Privacy:
      Account the run with this σ (``DPConfig(noise_multiplier=σ)``).
    """
    s_grad = _finite_at_least(
        "gradient_noise_multiplier", gradient_noise_multiplier, 0.0, strict=False
    )
    s_count = 2.0 * _finite_at_least("count_stddev", count_stddev, 0.0, strict=False)
    if s_grad == 0.0 or s_count == 0.0:
        return 0.0
    return 1.0 / math.sqrt(s_grad**-2 + s_count**-2)


def gradient_noise_multiplier_tensor(sigma: Any, *, count_stddev: float) -> tf.Tensor:
    """:func:`gradient_noise_multiplier` of a float64 σ tensor; the step fails unless
    ``2 * count_stddev > σ`` when it runs (σ restored from a checkpoint skips the setter)."""
    sigma = tf.cast(tf.convert_to_tensor(sigma), tf.float64)
    # σ restored from a checkpoint bypasses the setter's check, and an undefined σ_Δ (2 σ_b <= σ,
    # or σ_b = 0 with σ > 0) must never become noise of std 0.
    if count_stddev == 0.0:  # only σ = 0 passes the setter's check: no noise
        ok = tf.equal(sigma, 0.0)
        sigma_delta = tf.zeros_like(sigma)
    else:
        ratio = sigma / (2.0 * float(count_stddev))
        ok = ratio < 1.0
        sigma_delta = sigma / tf.sqrt(1.0 - tf.square(ratio))
    check = tf.debugging.Assert(
        ok,
        [
            "adaptive clipping needs 2 * count_stddev > noise_multiplier (or both 0); got "
            "noise_multiplier",
            sigma,
            "and count_stddev",
            float(count_stddev),
        ],
    )
    with tf.control_dependencies([check]):  # NaN (no release) where XLA drops the check
        return tf.where(ok, sigma_delta, sigma * float("nan"))


def noised_unclipped_fraction(
    centred_count: Any, *, count_stddev: float, expected_batch_size: float, seed: tf.Tensor
) -> tf.Tensor:
    """``b̃ = (centred_count + N(0, σ_b^2)) / expected_batch_size + 1/2`` as a float64 scalar.

    Args:
      centred_count: the logical step's ``sum_i mask_i (1[||g_i|| <= C] - 1/2)`` (sensitivity 1/2).
      count_stddev: σ_b.
      expected_batch_size: the divisor (not the realized batch size).
      seed: the logical step's ``[2]`` noise seed; the count uses its own stream of it.

    Returns:
      The noised estimate of the unclipped fraction.

    Privacy:
      The Gaussian mechanism on the count; call it once per logical step.
    """
    count = tf.cast(centred_count, tf.float64)
    if count_stddev > 0.0:
        stream = tf.random.experimental.stateless_fold_in(
            tf.cast(seed, tf.int64), tf.constant(_COUNT_STREAM, tf.int64)
        )
        # The gradient noise's sampler (support up to 9.42 standard deviations), not
        # tf.random.stateless_normal, which stops at 5.68 in float64 too.
        z = tf.cast(aggregation.standard_normal([tf.zeros([])], seed=stream)[0], tf.float64)
        count = count + float(count_stddev) * z
    return count / float(expected_batch_size) + 0.5


def updated_clip(
    *, l2_norm_clip: Any, unclipped_fraction: Any, target_quantile: float, learning_rate: float
) -> tf.Tensor:
    """The geometric update ``C exp(-η (b̃ - γ))``, kept within ``[MIN_CLIP, MAX_CLIP]``.

    Privacy:
      A function of the previous bound and the noised fraction only (post-processing).
    """
    c = tf.cast(l2_norm_clip, tf.float64)
    step = -float(learning_rate) * (
        tf.cast(unclipped_fraction, tf.float64) - float(target_quantile)
    )
    return tf.clip_by_value(c * tf.exp(step), MIN_CLIP, MAX_CLIP)
