"""Rules for ``keras.layers.LayerNormalization`` (``rms_scaling`` too),
``keras.layers.GroupNormalization`` and ``keras.layers.RMSNormalization``.

Contract: ``forward`` recomputes the normalized input ``x_hat`` (per example, per group for
GroupNormalization; ``x * rsqrt(mean(x^2) + epsilon)`` for RMSNormalization, whose ``scale`` plays
the part of ``gamma`` and which has no offset) the way the layer does and returns
``z = x_hat * gamma + beta``. The output is
linear in ``gamma`` and ``beta``, so with ``g = dL_i/dz`` each example's gradients are the cheap
reductions ``sum(g * x_hat)`` and ``sum(g)`` over the non-parameter axes: ``[B, C]`` tensors, no
larger than the parameters times the batch. Norms and clipped sums are computed from them directly;
several uses of one layer add their per-example gradients before the norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from dpcore.rules.base import LayerRule, Use, VariableGrad, from_per_example


def _as_float32(x: Any) -> tf.Tensor:
    x = tf.convert_to_tensor(x)
    return tf.cast(x, tf.float32) if x.dtype != tf.float32 else x


def _ln_axes(layer: Any, rank: int) -> list[int]:
    axis = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    return sorted(int(a) % rank for a in axis)


def _param(layer: Any, name: str) -> Any:
    return getattr(layer, name, None)


def _broadcast(v: Any, rank: int, axes: Sequence[int], shape: Any) -> tf.Tensor:
    target = [1] * rank
    for a in axes:
        target[a] = shape[a]
    return tf.reshape(_as_float32(v), target)


def _ln_forward(layer: Any, args: tuple, kwargs: dict) -> tuple[tf.Tensor, dict]:
    x = _as_float32(args[0])
    rank = x.shape.rank
    axes = _ln_axes(layer, rank)
    shape = tf.shape(x)
    if layer.rms_scaling:
        var = keras.ops.var(x, axis=axes, keepdims=True)
        x_hat = x * tf.math.rsqrt(var + layer.epsilon)
    else:
        mean, var = keras.ops.moments(x, axes=axes, keepdims=True)
        inv = tf.math.rsqrt(var + layer.epsilon)
        x_hat = x * inv + (-mean * inv)
    z = x_hat
    gamma, beta = _param(layer, "gamma"), _param(layer, "beta")
    if gamma is not None:
        z = z * _broadcast(gamma, rank, axes, shape)
    if beta is not None and not layer.rms_scaling:
        z = z + _broadcast(beta, rank, axes, shape)
    return z, {"x_hat": x_hat, "axes": axes}


def _cast_out(layer: Any, z: tf.Tensor) -> tf.Tensor:
    return keras.ops.cast(z, layer.compute_dtype)


def _affine_grads(
    uses: Sequence[Use], param_axes: Sequence[int], gamma: Any, beta: Any, beta_used: bool
) -> list[VariableGrad]:
    """Per-example grads of ``z = x_hat * gamma + beta`` with params along ``param_axes``."""
    out = []
    for var, with_x_hat in ((gamma, True), (beta, False)):
        if var is None or not var.trainable:
            continue
        per_example = 0.0
        if with_x_hat or beta_used:
            for u in uses:
                g = tf.cast(u.grad, tf.float32)
                t = g * u.capture["x_hat"] if with_x_hat else g
                reduce = [a for a in range(1, g.shape.rank) if a not in param_axes]
                per_example = per_example + tf.reduce_sum(t, axis=reduce)
            per_example = tf.reshape(per_example, [-1, *var.shape])
        else:  # rms_scaling ignores beta: its gradient is zero
            b = tf.shape(uses[0].grad)[0]
            per_example = tf.zeros(tf.concat([[b], tf.constant(var.shape, tf.int32)], 0))

        out.append(from_per_example(var, per_example, path="ghost"))
    return out


def _ln_grads(layer: Any, uses: Sequence[Use]) -> list[VariableGrad]:
    gamma, beta = _param(layer, "gamma"), _param(layer, "beta")
    return _affine_grads(uses, uses[0].capture["axes"], gamma, beta, not layer.rms_scaling)


def _plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    return "ghost", "per-example grads are reductions of g*x_hat and g ([B, C])"


LAYER_NORMALIZATION = LayerRule(
    name="layer_normalization",
    forward=_ln_forward,
    activate=_cast_out,
    grads=_ln_grads,
    plan=_plan,
)


def _gn_forward(layer: Any, args: tuple, kwargs: dict) -> tuple[tf.Tensor, dict]:
    x = _as_float32(args[0])
    rank = x.shape.rank
    axis = int(layer.axis) % rank
    shape = tf.shape(x)
    channels = x.shape[axis]
    grouped_shape = tf.concat(
        [shape[:axis], [layer.groups, channels // layer.groups], shape[axis + 1 :]], 0
    )
    xr = tf.reshape(x, grouped_shape)
    reduce = [a for a in range(1, rank + 1) if a != axis]
    mean, var = keras.ops.moments(xr, axes=reduce, keepdims=True)
    inv = tf.math.rsqrt(var + layer.epsilon)
    x_hat = tf.reshape(xr * inv + (-mean * inv), shape)
    z = x_hat
    gamma, beta = _param(layer, "gamma"), _param(layer, "beta")
    if gamma is not None:
        z = z * _broadcast(gamma, rank, [axis], shape)
    if beta is not None:
        z = z + _broadcast(beta, rank, [axis], shape)
    return z, {"x_hat": x_hat, "axes": [axis]}


def _gn_grads(layer: Any, uses: Sequence[Use]) -> list[VariableGrad]:
    gamma, beta = _param(layer, "gamma"), _param(layer, "beta")
    return _affine_grads(uses, uses[0].capture["axes"], gamma, beta, beta_used=True)


GROUP_NORMALIZATION = LayerRule(
    name="group_normalization",
    forward=_gn_forward,
    activate=_cast_out,
    grads=_gn_grads,
    plan=_plan,
)


def _rms_forward(layer: Any, args: tuple, kwargs: dict) -> tuple[tf.Tensor, dict]:
    x = _as_float32(args[0])
    axes = _ln_axes(layer, x.shape.rank)
    x_hat = x * tf.math.rsqrt(
        tf.reduce_mean(tf.square(x), axis=axes, keepdims=True) + layer.epsilon
    )
    # Keras multiplies by ``scale`` with NumPy broadcasting (trailing axes), and so does the rule:
    # the axes ``scale`` spans are those it broadcasts over, whatever ``axis`` says.
    scale = _as_float32(layer.scale)
    param_axes = list(range(x.shape.rank - scale.shape.rank, x.shape.rank))
    return x_hat * scale, {"x_hat": x_hat, "axes": param_axes}


def _rms_grads(layer: Any, uses: Sequence[Use]) -> list[VariableGrad]:
    return _affine_grads(uses, uses[0].capture["axes"], layer.scale, None, beta_used=False)


RMS_NORMALIZATION = LayerRule(
    name="rms_normalization",
    forward=_rms_forward,
    activate=_cast_out,
    grads=_rms_grads,
    plan=_plan,
)
