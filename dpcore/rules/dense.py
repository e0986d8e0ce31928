"""Rules for ``keras.layers.Dense`` and ``keras.layers.EinsumDense``, LoRA-enabled ones included.

Contract: ``forward`` recomputes ``z = x @ kernel + bias`` (``einsum(equation, x, kernel) + bias``)
exactly as the layer does, with the layer's own variables; ``activate`` applies its activation.
Per-example norms use the ghost identity or the materialized ``[B, D, P]`` product, whichever is
cheaper for the static shapes (see :mod:`dpcore.rules.linear`); the clipped sum is one weighted
matmul (einsum) over the whole batch. Several uses of one layer are concatenated along the
position axis, so cross terms between uses are counted.

LoRA (``layer.enable_lora(rank)``): Keras computes with ``kernel + s * A @ B``, ``s = lora_alpha /
lora_rank``, the base kernel frozen. The rule recomputes ``z`` the same way and does no gradient
work for the base kernel. The adapters are two linear maps of their own: with ``h = s * x @ A``
(rank ``r``) the per-example gradient of ``B`` is ``sum_t h_t g_t^T``, and with ``u = s * g @ B^T``
that of ``A`` is ``sum_t x_t u_t^T``; each takes the ghost or the materialized form by the same
cost rule, and the norm and the clipped sum are computed from the same ``h`` or ``u`` tensors, so
the certified norm bounds what each example adds. For EinsumDense the same holds axis by axis when
the kernel's last axis (the one ``B`` maps to) is an output-only axis. A LoRA layer that trains
anything besides the adapters and the bias (an unfrozen base kernel) is left to the fallback.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence
from typing import Any, SupportsInt

import keras
import tensorflow as tf

from dpcore import norms
from dpcore.rules import linear
from dpcore.rules.base import (
    LayerRule,
    Use,
    VariableGrad,
    cast_input,
    from_per_example,
    quantized_variant,
    weighted_rows,
)

# ------------------------------------------------------------------------------- shared pieces


def outer_grad(variable: Any, a: tf.Tensor, g: tf.Tensor) -> VariableGrad:
    """A ``[D, P]`` variable whose per-example gradient is ``A_i^T G_i`` (``a [B, T, D]``,
    ``g [B, T, P]``): ghost or materialized, whichever is cheaper.

    Privacy:
      Row ``i`` of the norms depends on example ``i`` only; the clipped sum is formed from ``a``
      and ``g`` themselves, which is what the certified norm bounds.
    """
    path, _ = linear.choose_path(a.shape[1], a.shape[-1], g.shape[-1])
    if path == "materialized":  # the [B, D, P] grads serve the norm and the clipped sum
        return from_per_example(variable, linear.materialize(a, g), path=path)

    def weighted_sum(w: tf.Tensor) -> tf.Tensor:
        return tf.cast(linear.weighted_outer(a, g, w), variable.dtype)

    sq, err = linear.bounds(a, g, path)
    return VariableGrad(
        variable=variable, sq_norm=sq, weighted_sum=weighted_sum, path=path, sum_error=err
    )


def _lora_scale(layer: Any) -> float:
    return float(layer.lora_alpha) / float(layer.lora_rank)


def _check_variant(layer: Any) -> str | None:
    """None for a plain or LoRA-enabled layer whose trainable variables the rule knows."""
    reason = quantized_variant(layer)
    if reason or not getattr(layer, "lora_enabled", False):
        return reason
    known = {id(v) for v in (layer.lora_kernel_a, layer.lora_kernel_b, layer.bias) if v is not None}
    extra = [v.path for v in layer.trainable_variables if id(v) not in known]
    if extra:
        return (
            f"{type(layer).__name__} {layer.name!r} has LoRA enabled and also trains {extra[0]!r} "
            "(the LoRA rule covers the adapters and the bias over a frozen kernel)"
        )
    return None


def _first_trainable_path(layer: Any, choices: Sequence[tuple[Any, tuple[str, str]]]) -> str:
    """The path ``grads`` reports first: that of the first trainable variable in ``choices``."""
    for variable, (path, _) in choices:
        if variable is not None and variable.trainable:
            return path
    return "ghost"  # only the bias: a [B, P] reduction


# ----------------------------------------------------------------------------------------- Dense


def _dense_forward(layer: Any, args: tuple, kwargs: dict) -> tuple[tf.Tensor, dict]:
    a = cast_input(layer, args[0])
    z = keras.ops.matmul(a, layer.kernel)  # with LoRA: kernel + s * A @ B, as Keras computes it
    if layer.bias is not None:
        z = keras.ops.add(z, layer.bias)
    return z, {"a": a}


def _dense_lora_grads(layer: Any, a: tf.Tensor, g: tf.Tensor) -> list[VariableGrad]:
    """The adapters' gradients for ``a [B, T, D]``, ``g [B, T, P]`` (the base kernel: none)."""
    s = _lora_scale(layer)
    lora_a, lora_b = layer.lora_kernel_a, layer.lora_kernel_b
    a32, g32 = tf.cast(a, tf.float32), tf.cast(g, tf.float32)
    out = []
    if lora_a.trainable:
        u = s * tf.einsum("btp,rp->btr", g32, tf.cast(lora_b, tf.float32))
        out.append(outer_grad(lora_a, a32, u))
    if lora_b.trainable:
        h = s * tf.einsum("btd,dr->btr", a32, tf.cast(lora_a, tf.float32))
        out.append(outer_grad(lora_b, h, g32))
    return out


def _dense_grads(layer: Any, uses: Sequence[Use]) -> list[VariableGrad]:
    a = tf.concat([linear.as_sequence(u.capture["a"]) for u in uses], axis=1)
    g = tf.concat([linear.as_sequence(u.grad) for u in uses], axis=1)
    bias = layer.bias if layer.bias is not None and layer.bias.trainable else None
    if a.shape[1] == 1 and bias is not None and not layer.lora_enabled:
        return _one_position_grads(layer.kernel, bias, a[:, 0], g[:, 0])
    if layer.lora_enabled:
        out = _dense_lora_grads(layer, a, g)
    else:
        out = [outer_grad(layer.kernel, a, g)]
    if bias is not None:
        gb = tf.reduce_sum(tf.cast(g, tf.float32), axis=1)  # [B, P]
        out.append(from_per_example(bias, gb, path="ghost"))
    return out


def _one_position_grads(kernel: Any, bias: Any, a: tf.Tensor, g: tf.Tensor) -> list[VariableGrad]:
    """Kernel and bias of a layer with one position per example (``a [B, D]``, ``g [B, P]``): the
    bias's per-example gradient is ``g`` itself, so both bounds share ``g``'s row sums of squares
    (:func:`dpcore.norms.rows_sq_norm`).

    Privacy:
      Row ``i`` of the norms depends on example ``i`` only; each bound is the one its variable
      would get alone (:func:`dpcore.norms.outer_sq_norm_bound`, :func:`dpcore.norms.sq_norm_bound`).
    """
    g = tf.cast(g, tf.float32)
    g_rows = norms.rows_sq_norm(g)
    kernel_grad = VariableGrad(
        variable=kernel,
        sq_norm=norms.outer_sq_norm_bound(a, g, g_rows=g_rows),
        weighted_sum=lambda w: tf.cast(
            linear.weighted_outer(a[:, None], g[:, None], w), kernel.dtype
        ),
        path="ghost",
    )
    bias_grad = VariableGrad(
        variable=bias,
        sq_norm=norms.sq_norm_bound(g, rows=g_rows),
        weighted_sum=lambda w: tf.cast(weighted_rows(g, w), bias.dtype),
        path="ghost",
    )
    return [kernel_grad, bias_grad]


def _dense_plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    d, p = int(layer.kernel.shape[0]), int(layer.kernel.shape[1])
    positions = [linear.static_positions(s) if s is not None else None for s in input_shapes]
    known = [n for n in positions if n is not None]
    t = sum(known) if positions and len(known) == len(positions) else None
    uses = f"used {len(input_shapes)} times, uses concatenated; " if len(input_shapes) > 1 else ""
    if layer.lora_enabled:
        r = int(layer.lora_rank)
        choices = [
            (layer.lora_kernel_a, linear.choose_path(t, d, r)),
            (layer.lora_kernel_b, linear.choose_path(t, r, p)),
        ]
        return _first_trainable_path(layer, choices), uses + _lora_why(layer, choices)
    path, why = linear.choose_path(t, d, p)
    return path, uses + why


def _lora_why(layer: Any, choices: Sequence[tuple[Any, tuple[str, str]]]) -> str:
    parts = [
        f"{name} {path if v.trainable else 'frozen'} ({why})"
        for name, (v, (path, why)) in zip(("lora A", "lora B"), choices)
    ]
    return f"LoRA rank {layer.lora_rank}, base kernel frozen (no work): " + "; ".join(parts)


DENSE = LayerRule(
    name="dense",
    check=_check_variant,
    forward=_dense_forward,
    grads=_dense_grads,
    plan=_dense_plan,
    units_as_positions=True,
)


# ----------------------------------------------------------------------------------- EinsumDense


def _split(equation: str) -> tuple[str, str, str]:
    lhs, out = equation.replace(" ", "").split("->")
    x_spec, w_spec = lhs.split(",")
    return x_spec, w_spec, out


def _einsum_check(layer: Any) -> str | None:
    reason = _check_variant(layer)
    if reason:
        return reason
    try:
        x_spec, w_spec, out = _split(layer.equation)
    except ValueError:
        return f"EinsumDense equation {layer.equation!r} is not of the form 'x,w->out'"
    if "..." in w_spec:
        return f"EinsumDense equation {layer.equation!r} has an ellipsis in the kernel spec"
    if x_spec.startswith("..."):
        if not out.startswith("..."):
            return (
                f"EinsumDense equation {layer.equation!r}: the batch axes ('...') are not first "
                "in the output"
            )
    elif x_spec[:1] in w_spec or x_spec[:1] not in out:
        return f"EinsumDense equation {layer.equation!r}: first input axis is not a batch axis"
    elif out[:1] != x_spec[:1]:
        # The clipped sum weights output-gradient rows by example, so the batch axis must lead
        # the output too: with 'btd,de->tbe' the weights fell on positions (T == B ran, and one
        # record moved the sum by 1.9e9 C).
        return f"EinsumDense equation {layer.equation!r}: the batch axis is not first in the output"
    if set(w_spec) - set(x_spec) - set(out):
        return f"EinsumDense equation {layer.equation!r} sums over a kernel-only axis"
    if getattr(layer, "lora_enabled", False):
        k = w_spec[-1]
        if k in x_spec or k not in out or out[:1] != x_spec[:1]:
            return (
                f"EinsumDense {layer.name!r} has LoRA enabled on equation {layer.equation!r}: the "
                "rule needs the kernel's last axis to be an output-only axis and the batch axis "
                "first in the output"
            )
    return None


def _resolve(equation: str, x_rank: int) -> tuple[str, str, str]:
    """Replaces ``...`` with explicit letters for an input of rank ``x_rank``."""
    x_spec, w_spec, out = _split(equation)
    if "..." in x_spec:
        used = set(x_spec + w_spec + out)
        free = [c for c in string.ascii_letters if c not in used]
        n = x_rank - (len(x_spec) - 3)
        fill = "".join(free[:n])
        x_spec, out = x_spec.replace("...", fill), out.replace("...", fill)
    return x_spec, w_spec, out


def _einsum_forward(layer: Any, args: tuple, kwargs: dict) -> tuple[tf.Tensor, dict]:
    a = cast_input(layer, args[0])
    z = keras.ops.einsum(layer.equation, a, layer.kernel)  # with LoRA: the merged kernel
    if layer.bias is not None:
        z = keras.ops.add(z, layer.bias)
    return z, {"a": a}


def _structure(x_spec: str, w_spec: str, out: str) -> dict:
    """The roles of the letters of ``x,w->out``: batch, positions, contracted, free, shared."""
    b = x_spec[0]
    positions = "".join(c for c in out if c in x_spec and c not in w_spec and c != b)
    contracted = "".join(c for c in x_spec if c in w_spec and c not in out)
    free = "".join(c for c in w_spec if c in out and c not in x_spec)
    shared = "".join(c for c in w_spec if c in x_spec and c in out)
    return dict(x=x_spec, w=w_spec, out=out, b=b, t=positions, d=contracted, p=free, s=shared)


def _lora_specs(x_spec: str, w_spec: str, out: str) -> tuple[str, str, str, str]:
    """``(r, wa, out_a, k)``: the rank letter, A's spec, the spec of ``h = x . A`` (``out`` with
    the kernel's last axis ``k`` replaced by ``r``) and ``k``. B's spec is ``r + k``."""
    r = next(c for c in string.ascii_letters if c not in x_spec + w_spec + out)
    k = w_spec[-1]
    return r, w_spec[:-1] + r, out.replace(k, r), k


def _kernel_choice(s: dict, dims: dict[str, int | None], t: int | None) -> tuple[str, str]:
    if s["s"]:
        return "materialized", f"axes {s['s']!r} are shared by input, kernel and output"
    d = _prod(dims[c] or 1 for c in s["d"])
    p = _prod(dims[c] or 1 for c in s["p"])
    return linear.choose_path(t, d, p)


def _einsum_kernel_grad(
    variable: Any, x_spec: str, w_spec: str, out: str, xs: list, gs: list
) -> VariableGrad:
    """A variable used as ``einsum(x_spec,w_spec->out)(x, variable)`` (one ``x``, ``g = dL/dout``
    per use; explicit letters, batch axis first in ``x_spec`` and ``out``).

    Privacy:
      Row ``i`` of the norms depends on example ``i`` only; the clipped sum is formed from the same
      ``xs`` and ``gs`` the norm bounds.
    """
    s = _structure(x_spec, w_spec, out)
    b = s["b"]
    dims: dict[str, int | None] = {c: int(n) for c, n in zip(w_spec, variable.shape)}

    def kernel_sum(w: tf.Tensor) -> tf.Tensor:
        eq = f"{x_spec},{out}->{w_spec}"
        total = 0.0
        for x, g in zip(xs, gs):
            wg = g * tf.reshape(tf.cast(w, tf.float32), [-1] + [1] * (g.shape.rank - 1))
            total = total + tf.einsum(eq, x, wg)
        return tf.cast(total, variable.dtype)

    t: int | None = 0
    for g in gs:
        sizes = [g.shape[out.index(c)] for c in s["t"]]
        t = None if t is None or None in sizes else t + _prod(sizes)
    path, _ = _kernel_choice(s, dims, t)
    d = _prod(variable.shape[w_spec.index(c)] for c in s["d"])
    p = _prod(variable.shape[w_spec.index(c)] for c in s["p"])
    if path == "ghost":
        a = tf.concat(
            [
                tf.reshape(tf.einsum(f"{x_spec}->{b}{s['t']}{s['d']}", x), [tf.shape(x)[0], -1, d])
                for x in xs
            ],
            axis=1,
        )
        gg = tf.concat(
            [
                tf.reshape(tf.einsum(f"{out}->{b}{s['t']}{s['p']}", g), [tf.shape(g)[0], -1, p])
                for g in gs
            ],
            axis=1,
        )
        sq, err = linear.bounds(a, gg, "ghost")
        return VariableGrad(
            variable=variable, sq_norm=sq, weighted_sum=kernel_sum, path=path, sum_error=err
        )
    # The clipped sum is formed from the materialized gradients themselves, so the certified norm
    # of what is stored bounds what each example contributes.
    eq = f"{x_spec},{out}->{b}{w_spec}"
    per_example = tf.add_n([linear.per_example_einsum(eq, x, g) for x, g in zip(xs, gs)])
    return from_per_example(variable, per_example, path=path)


def _einsum_grads(layer: Any, uses: Sequence[Use]) -> list[VariableGrad]:
    x_spec, w_spec, out_spec = _resolve(layer.equation, uses[0].capture["a"].shape.rank)
    xs = [tf.cast(u.capture["a"], tf.float32) for u in uses]
    gs = [tf.cast(u.grad, tf.float32) for u in uses]
    if not layer.lora_enabled:
        out = [_einsum_kernel_grad(layer.kernel, x_spec, w_spec, out_spec, xs, gs)]
    else:
        r, wa, out_a, k = _lora_specs(x_spec, w_spec, out_spec)
        sc = _lora_scale(layer)
        lora_a, lora_b = layer.lora_kernel_a, layer.lora_kernel_b
        out = []
        if lora_a.trainable:
            b32 = tf.cast(lora_b, tf.float32)
            us = [sc * tf.einsum(f"{out_spec},{r}{k}->{out_a}", g, b32) for g in gs]
            out.append(_einsum_kernel_grad(lora_a, x_spec, wa, out_a, xs, us))
        if lora_b.trainable:
            a32 = tf.cast(lora_a, tf.float32)
            hs = [sc * tf.einsum(f"{x_spec},{wa}->{out_a}", x, a32) for x in xs]
            out.append(_einsum_kernel_grad(lora_b, out_a, r + k, out_spec, hs, gs))
    if layer.bias is not None and layer.bias.trainable:
        b = x_spec[0]
        bias_letters = "".join(c for c in out_spec if c in layer.bias_axes)
        gb = tf.add_n([tf.einsum(f"{out_spec}->{b}{bias_letters}", g) for g in gs])
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
    x_spec, w_spec, out = _resolve(layer.equation, len(input_shapes[0]))
    kernel_shape = tuple(layer.kernel.shape)
    dims: dict[str, int | None] = {c: int(n) for c, n in zip(w_spec, kernel_shape)}

    def positions(s: dict) -> int | None:
        t = 0
        for shape in input_shapes:
            known = dict(zip(x_spec, shape))
            sizes = [known[c] if c in known else dims.get(c) for c in s["t"]]
            static = [int(n) for n in sizes if n is not None]
            if len(static) < len(sizes):
                return None
            t += _prod(static)
        return t

    if not layer.lora_enabled:
        s = _structure(x_spec, w_spec, out)
        return _kernel_choice(s, dims, positions(s))
    r, wa, out_a, k = _lora_specs(x_spec, w_spec, out)
    dims[r] = int(layer.lora_rank)
    sa, sb = _structure(x_spec, wa, out_a), _structure(out_a, r + k, out)
    choices = [
        (layer.lora_kernel_a, _kernel_choice(sa, dims, positions(sa))),
        (layer.lora_kernel_b, _kernel_choice(sb, dims, positions(sb))),
    ]
    return _first_trainable_path(layer, choices), _lora_why(layer, choices)


EINSUM_DENSE = LayerRule(
    name="einsum_dense",
    check=_einsum_check,
    forward=_einsum_forward,
    grads=_einsum_grads,
    plan=_einsum_plan,
)
