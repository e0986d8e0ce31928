"""Rules for ``keras.layers.Dense`` and ``keras.layers.EinsumDense``.

Contract: ``forward`` recomputes ``z = x @ kernel + bias`` (``einsum(equation, x, kernel) + bias``)
exactly as the layer does, with the layer's own variables; ``activate`` applies its activation.
Per-example norms use the ghost identity or the materialized ``[B, D, P]`` product, whichever is
cheaper for the static shapes (see :mod:`dpcore.rules.linear`); the clipped sum is one weighted
matmul (einsum) over the whole batch. Several uses of one layer are concatenated along the
position axis, so cross terms between uses are counted.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence
from typing import Any, SupportsInt

import keras
import tensorflow as tf

from dpcore.rules import linear
from dpcore.rules.base import (
    LayerRule,
    Use,
    VariableGrad,
    cast_input,
    from_per_example,
    unsupported_variant,
)

# ----------------------------------------------------------------------------------------- Dense


def _dense_forward(layer: Any, args: tuple, kwargs: dict) -> tuple[tf.Tensor, dict]:
    a = cast_input(layer, args[0])
    z = keras.ops.matmul(a, layer.kernel)
    if layer.bias is not None:
        z = keras.ops.add(z, layer.bias)
    return z, {"a": a}


def _dense_grads(layer: Any, uses: Sequence[Use]) -> list[VariableGrad]:
    a = tf.concat([linear.as_sequence(u.capture["a"]) for u in uses], axis=1)
    g = tf.concat([linear.as_sequence(u.grad) for u in uses], axis=1)
    d, p = a.shape[-1], g.shape[-1]
    path, _ = linear.choose_path(a.shape[1], d, p)
    kernel = layer.kernel
    if path == "materialized":  # the [B, D, P] grads serve the norm and the clipped sum
        out = [from_per_example(kernel, linear.materialize(a, g), path=path)]
    else:

        def kernel_sum(w: tf.Tensor) -> tf.Tensor:
            return tf.cast(linear.weighted_outer(a, g, w), kernel.dtype)

        sq = linear.sq_norm(a, g, path)
        out = [VariableGrad(variable=kernel, sq_norm=sq, weighted_sum=kernel_sum, path=path)]
    if layer.bias is not None:
        gb = tf.reduce_sum(tf.cast(g, tf.float32), axis=1)  # [B, P]
        out.append(from_per_example(layer.bias, gb, path="ghost"))
    return out


def _dense_plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    d, p = int(layer.kernel.shape[0]), int(layer.kernel.shape[1])
    positions = [linear.static_positions(s) if s is not None else None for s in input_shapes]
    known = [n for n in positions if n is not None]
    t = sum(known) if positions and len(known) == len(positions) else None
    path, why = linear.choose_path(t, d, p)
    if len(input_shapes) > 1:
        why = f"used {len(input_shapes)} times, uses concatenated; {why}"
    return path, why


DENSE = LayerRule(
    name="dense",
    check=unsupported_variant,
    forward=_dense_forward,
    grads=_dense_grads,
    plan=_dense_plan,
)


# ----------------------------------------------------------------------------------- EinsumDense


def _einsum_check(layer: Any) -> str | None:
    reason = unsupported_variant(layer)
    if reason:
        return reason
    try:
        lhs, out = layer.equation.replace(" ", "").split("->")
        x_spec, w_spec = lhs.split(",")
    except ValueError:
        return f"EinsumDense equation {layer.equation!r} is not of the form 'x,w->out'"
    if "..." in w_spec:
        return f"EinsumDense equation {layer.equation!r} has an ellipsis in the kernel spec"
    if x_spec.startswith("..."):
        pass
    elif x_spec[:1] in w_spec or x_spec[:1] not in out:
        return f"EinsumDense equation {layer.equation!r}: first input axis is not a batch axis"
    if set(w_spec) - set(x_spec) - set(out):
        return f"EinsumDense equation {layer.equation!r} sums over a kernel-only axis"
    return None


def _resolve(equation: str, x_rank: int) -> tuple[str, str, str]:
    """Replaces ``...`` with explicit letters for an input of rank ``x_rank``."""
    lhs, out = equation.replace(" ", "").split("->")
    x_spec, w_spec = lhs.split(",")
    if "..." in x_spec:
        used = set(x_spec + w_spec + out)
        free = [c for c in string.ascii_letters if c not in used]
        n = x_rank - (len(x_spec) - 3)
        fill = "".join(free[:n])
        x_spec, out = x_spec.replace("...", fill), out.replace("...", fill)
    return x_spec, w_spec, out


def _einsum_forward(layer: Any, args: tuple, kwargs: dict) -> tuple[tf.Tensor, dict]:
    a = cast_input(layer, args[0])
    z = keras.ops.einsum(layer.equation, a, layer.kernel)
    if layer.bias is not None:
        z = keras.ops.add(z, layer.bias)
    return z, {"a": a}


def _einsum_structure(layer: Any, x_rank: int) -> dict:
    x_spec, w_spec, out = _resolve(layer.equation, x_rank)
    b = x_spec[0]
    positions = "".join(c for c in out if c in x_spec and c not in w_spec and c != b)
    contracted = "".join(c for c in x_spec if c in w_spec and c not in out)
    free = "".join(c for c in w_spec if c in out and c not in x_spec)
    shared = "".join(c for c in w_spec if c in x_spec and c in out)
    return dict(x=x_spec, w=w_spec, out=out, b=b, t=positions, d=contracted, p=free, s=shared)


def _einsum_grads(layer: Any, uses: Sequence[Use]) -> list[VariableGrad]:
    s = _einsum_structure(layer, uses[0].capture["a"].shape.rank)
    xs = [tf.cast(u.capture["a"], tf.float32) for u in uses]
    gs = [tf.cast(u.grad, tf.float32) for u in uses]
    b, kernel = s["b"], layer.kernel

    def kernel_sum(w: tf.Tensor) -> tf.Tensor:
        eq = f"{s['x']},{s['out']}->{s['w']}"
        total = 0.0
        for x, g in zip(xs, gs):
            wg = g * tf.reshape(tf.cast(w, tf.float32), [-1] + [1] * (g.shape.rank - 1))
            total = total + tf.einsum(eq, x, wg)
        return tf.cast(total, kernel.dtype)

    d = int(_prod(kernel.shape[s["w"].index(c)] for c in s["d"]))
    p = int(_prod(kernel.shape[s["w"].index(c)] for c in s["p"]))
    if s["s"]:
        path = "materialized"
    else:
        t = sum(
            int(_prod(g.shape[s["out"].index(c)] for c in s["t"]))
            if all(g.shape[s["out"].index(c)] is not None for c in s["t"])
            else 10**9
            for g in gs
        )
        path, _ = linear.choose_path(t if t < 10**9 else None, d, p)
    if path == "ghost":
        a = tf.concat(
            [
                tf.reshape(tf.einsum(f"{s['x']}->{b}{s['t']}{s['d']}", x), [tf.shape(x)[0], -1, d])
                for x in xs
            ],
            axis=1,
        )
        gg = tf.concat(
            [
                tf.reshape(
                    tf.einsum(f"{s['out']}->{b}{s['t']}{s['p']}", g), [tf.shape(g)[0], -1, p]
                )
                for g in gs
            ],
            axis=1,
        )
        sq = linear.sq_norm(a, gg, "ghost")
        out = [VariableGrad(variable=kernel, sq_norm=sq, weighted_sum=kernel_sum, path=path)]
    else:
        # The clipped sum is formed from the materialized gradients themselves, so the certified
        # norm of what is stored bounds what each example contributes.
        eq = f"{s['x']},{s['out']}->{b}{s['w']}"
        per_example = tf.add_n([tf.einsum(eq, x, g) for x, g in zip(xs, gs)])
        out = [from_per_example(kernel, per_example, path=path)]
    if layer.bias is not None:
        bias_letters = "".join(c for c in s["out"] if c in layer.bias_axes)
        gb = tf.add_n([tf.einsum(f"{s['out']}->{b}{bias_letters}", g) for g in gs])
        gb = tf.reshape(gb, [-1, *layer.bias.shape])
        out.append(from_per_example(layer.bias, gb, path="ghost"))
    return out


def _prod(values: Iterable[SupportsInt]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def _einsum_plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    if not input_shapes or input_shapes[0] is None:
        return "ghost", "input shape unknown"
    s = _einsum_structure(layer, len(input_shapes[0]))
    if s["s"]:
        return "materialized", f"axes {s['s']!r} are shared by input, kernel and output"
    kernel = layer.kernel
    d = _prod(kernel.shape[s["w"].index(c)] for c in s["d"])
    p = _prod(kernel.shape[s["w"].index(c)] for c in s["p"])
    t = 0
    for shape in input_shapes:
        dims = [shape[s["x"].index(c)] for c in s["t"] if c in s["x"]]
        if None in dims:
            return linear.choose_path(None, d, p)
        t += _prod(dims)
    return linear.choose_path(t, d, p)


EINSUM_DENSE = LayerRule(
    name="einsum_dense",
    check=_einsum_check,
    forward=_einsum_forward,
    grads=_einsum_grads,
    plan=_einsum_plan,
)
