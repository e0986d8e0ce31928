"""Rules for ``keras.layers.Conv1D`` and ``keras.layers.Conv2D``.

Contract: ``forward`` recomputes the layer's pre-activation output with ``keras.ops.conv`` and the
layer's own kernel and bias (causal padding applied to the input first, as the layer does).
Per-example norms apply the ``A^T G`` math of :mod:`dpcore.rules.linear` (ghost or materialized
by cost) with ``A`` the input patches, one row of ``kh*kw*C_in/groups`` values per output
position. Materialized kernels of ungrouped convolutions are formed without unfolding the input
where a faster route applies: with at least ``_MIN_OFFSET_CHANNELS`` input channels, stride 1
and static spatial shapes, one kernel-window offset at a time from slices of the input; with
fewer input channels and at most ``_MAX_DEPTHWISE_CHANNELS_OUT`` filters (no dilation, equal
strides, not under XLA, on a processor where that kernel is fast:
:func:`depthwise_route_is_fast`), from one depthwise filter gradient per input channel with the
examples as channels. Otherwise the input is unfolded with ``tf.image.extract_patches``. Strides,
``same``/``valid``/``causal`` padding, dilation, groups and both data formats are supported. The
clipped kernel sum is a weighted sum of the materialized per-example kernels when they exist,
else the convolution's own filter gradient (TensorFlow's backprop-filter kernel) with the
clip-weighted output gradients as cotangent;
several uses of one layer add their position sets together.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

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
    tracing_for_xla,
    unsupported_variant,
    weighted_rows,
)


def _check(layer: Any) -> str | None:
    reason = unsupported_variant(layer)
    if reason:
        return reason
    if str(layer.padding).lower() not in ("valid", "same", "causal"):
        return f"padding {layer.padding!r} is not supported"
    return None


def _padding(layer: Any) -> str:
    return "valid" if layer.padding == "causal" else layer.padding


def _forward(layer: Any, args: tuple, kwargs: dict) -> tuple[tf.Tensor, dict]:
    a = cast_input(layer, args[0])
    if layer.padding == "causal":
        left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
        pad = [[0, 0], [left, 0], [0, 0]]
        if layer.data_format == "channels_first":
            pad = [[0, 0], [0, 0], [left, 0]]
        a = keras.ops.pad(a, pad)
    # The layer's own compute dtype (Keras autocasts the float32 kernel under mixed precision).
    z = _conv(layer, a, keras.ops.cast(layer.kernel, a.dtype))
    if layer.use_bias:
        if layer.data_format == "channels_last":
            shape = (1,) * (layer.rank + 1) + (layer.filters,)
        else:
            shape = (1, layer.filters) + (1,) * layer.rank
        z = keras.ops.add(z, keras.ops.reshape(keras.ops.cast(layer.bias, z.dtype), shape))
    return z, {"a": a}


def _conv(layer: Any, a: tf.Tensor, kernel: Any) -> tf.Tensor:
    return keras.ops.conv(
        a,
        kernel,
        strides=list(layer.strides),
        padding=_padding(layer),
        dilation_rate=layer.dilation_rate,
        data_format=layer.data_format,
    )


def _channels_last(layer: Any, t: tf.Tensor) -> tf.Tensor:
    if layer.data_format == "channels_first":
        perm = [0] + list(range(2, layer.rank + 2)) + [1]
        t = tf.transpose(t, perm)
    return t


def _patches(layer: Any, a: tf.Tensor) -> tf.Tensor:
    """``[B, T, kh*kw*C_in]`` input patches, one row per output position (channels last)."""
    a = tf.cast(_channels_last(layer, a), tf.float32)
    if layer.rank == 1:
        a = a[:, None]
        ks, st, dl = [1, *layer.kernel_size], [1, *layer.strides], [1, *layer.dilation_rate]
    else:
        ks, st, dl = layer.kernel_size, layer.strides, layer.dilation_rate
    p = tf.image.extract_patches(
        a,
        sizes=[1, *ks, 1],
        strides=[1, *st, 1],
        rates=[1, *dl, 1],
        padding=_padding(layer).upper(),
    )
    return tf.reshape(p, [tf.shape(p)[0], -1, p.shape[-1]])


def _dims(layer: Any) -> tuple[int, int, int, int]:
    """``(kernel window size, C_in/groups, groups, C_out/groups)``."""
    window = 1
    for k in layer.kernel_size:
        window *= int(k)
    cin_g = int(layer.kernel.shape[-2])
    groups = int(layer.groups)
    return window, cin_g, groups, int(layer.filters) // groups


# Below this many input channels (per group) the window-offset products are too thin to beat one
# matmul over unfolded patches. Strided convolutions are left to the patches as well, since
# TensorFlow copies strided slices slowly on CPU.
_MIN_OFFSET_CHANNELS = 8


def _same_pad(size: int, out: int, k: int, stride: int, dilation: int) -> tuple[int, int]:
    """TensorFlow's ``SAME`` padding (before, after) of one spatial axis."""
    total = max((out - 1) * stride + (k - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def _offset_per_example(layer: Any, uses: Sequence[Use]) -> list[tf.Tensor] | None:
    """Per-example kernel gradients without unfolding patches, one ``[B, C_in, P]`` per offset.

    The list runs over kernel-window offsets in the kernel's own (row-major) order, so stacking it
    on axis 1 and reshaping gives ``[B, *kernel.shape]``; it is kept as a list so that no stacked
    copy is ever made. None when the route does not apply.

    One batched ``[C_in, P]`` product per kernel-window offset: the strided slice of the (padded)
    input that this offset sees at every output position, times the output gradients. It costs the
    same multiply-adds as the patch matmul but never holds the ``[B, T, window * C_in]`` patches
    (the largest tensor of the patch route). Needs static spatial shapes and ``groups == 1``.

    Privacy:
      Unclipped per-example gradients: clip before aggregating.
    """
    if int(layer.groups) != 1:
        return None
    total = None
    for u in uses:
        a = tf.cast(_channels_last(layer, u.capture["a"]), tf.float32)
        g = tf.cast(_channels_last(layer, u.grad), tf.float32)
        sizes, outs = a.shape[1:-1], g.shape[1:-1]
        if None in sizes or None in outs:
            return None
        if _padding(layer) == "same":
            pads = [
                _same_pad(int(n), int(o), int(k), int(s), int(d))
                for n, o, k, s, d in zip(
                    sizes, outs, layer.kernel_size, layer.strides, layer.dilation_rate
                )
            ]
            a = tf.pad(a, [[0, 0], *pads, [0, 0]])
        b, c_in = tf.shape(a)[0], a.shape[-1]
        g2 = tf.reshape(g, [b, -1, g.shape[-1]])
        # Channels first once, so that each offset's slice is a [C_in, T] matrix per example and
        # its product with the [T, P] output gradients needs no transposed operand.
        a = tf.transpose(a, [0, layer.rank + 1, *range(1, layer.rank + 1)])
        offsets: list[tuple[int, ...]] = [()]
        for k in layer.kernel_size:
            offsets = [o + (i,) for o in offsets for i in range(int(k))]
        per_offset: list[tf.Tensor] = []
        for off in offsets:
            index = [slice(None), slice(None)]
            for i, o, s, d in zip(off, outs, layer.strides, layer.dilation_rate):
                start = i * int(d)
                index.append(slice(start, start + (int(o) - 1) * int(s) + 1, int(s)))
            # One offset at a time: each slice is a [B, T, C_in] copy, so letting them all be
            # made at once would cost as much memory as the patches.
            with tf.control_dependencies(per_offset[-1:]):
                seen = tf.reshape(a[tuple(index)], [b, c_in, -1])  # [B, C_in, T]
            per_offset.append(tf.matmul(seen, g2))  # [B, C_in, P]
        total = per_offset if total is None else [t + p for t, p in zip(total, per_offset)]
    return total


def _depthwise_per_example(layer: Any, uses: Sequence[Use]) -> tf.Tensor | None:
    """Per-example kernel gradients ``[B, *kernel.shape]`` from TensorFlow's depthwise filter
    gradient, with the examples side by side as the channels of one image; None when the route
    does not apply (groups or dilation above 1, unequal strides of a 2-D convolution).

    For input channel ``c`` the batch becomes one image ``[1, H, W, B]`` whose channel ``i`` is
    example ``i``'s channel ``c``, and the output gradients one image of ``B * C_out`` channels
    (example-major). A depthwise convolution with channel multiplier ``C_out`` maps image channel
    ``i`` to output channels ``i * C_out + m``, so its filter gradient ``[kh, kw, B, C_out]`` holds
    each example's ``[kh, kw, C_out]`` kernel gradient for channel ``c``. The multiply-adds are
    those of the patch matmul, without unfolding the patches (``window`` times the input).

    Privacy:
      Unclipped per-example gradients: clip before aggregating.
    """
    ks, st = [int(k) for k in layer.kernel_size], [int(s) for s in layer.strides]
    if layer.rank == 1:  # one row of height 1: any stride along it leaves one output row
        ks, st = [1, *ks], [st[0], *st]
    if int(layer.groups) != 1 or any(int(d) != 1 for d in layer.dilation_rate) or st[0] != st[1]:
        return None  # (TensorFlow's depthwise filter gradient needs equal strides)
    a_uses = [tf.cast(_channels_last(layer, u.capture["a"]), tf.float32) for u in uses]
    g_uses = [tf.cast(_channels_last(layer, u.grad), tf.float32) for u in uses]
    shapes = {(tuple(a.shape[1:]), tuple(g.shape[1:])) for a, g in zip(a_uses, g_uses)}
    stacked = len(uses) > 1 and len(shapes) == 1 and None not in sum(shapes.pop(), ())
    if stacked:
        # Uses of one shape (e.g. the rows of privacy units) run as one batch of len(uses) * B
        # examples; each example's kernel gradient is then the sum over its uses.
        a_uses, g_uses = [tf.concat(a_uses, 0)], [tf.concat(g_uses, 0)]
    padding = _padding(layer).upper()
    total = None
    for a, g in zip(a_uses, g_uses):
        if layer.rank == 1:
            a, g = a[:, None], g[:, None]
        c_out = int(g.shape[-1])
        # TensorFlow's kernel costs more per example past _DEPTHWISE_CHANNELS image channels
        # (CPU): batches of a known size run in chunks of at most that many channels.
        chunk = max(1, _DEPTHWISE_CHANNELS // c_out)
        size = a.shape[0]
        if size is None or size <= chunk:
            m = _depthwise_kernels(a, g, ks, st, padding)
        else:
            m = tf.concat(
                [
                    _depthwise_kernels(a[i : i + chunk], g[i : i + chunk], ks, st, padding)
                    for i in range(0, size, chunk)
                ],
                0,
            )
        m = tf.reshape(m, [-1, *layer.kernel.shape])
        total = m if total is None else total + m
    if stacked:
        total = tf.reduce_sum(tf.reshape(total, [len(uses), -1, *layer.kernel.shape]), axis=0)
    return total


def _depthwise_kernels(
    a: tf.Tensor, g: tf.Tensor, ks: Sequence[int], st: Sequence[int], padding: str
) -> tf.Tensor:
    """``[B, kh, kw, C_in, C_out]`` kernel gradients of a 2-D convolution, one per example, for
    channels-last ``a [B, H, W, C_in]`` and ``g [B, H', W', C_out]`` (see
    :func:`_depthwise_per_example`)."""
    b, c_in, c_out = tf.shape(a)[0], int(a.shape[-1]), int(g.shape[-1])
    gs = tf.shape(g)
    g_image = tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, gs[1], gs[2], b * c_out])
    parts = []
    for c in range(c_in):
        a_image = tf.transpose(a[..., c], [1, 2, 0])[None]  # [1, H, W, B]
        f = tf.nn.depthwise_conv2d_backprop_filter(
            a_image,
            tf.stack([ks[0], ks[1], b, c_out]),
            g_image,
            strides=[1, *st, 1],
            padding=padding,
        )
        parts.append(tf.reshape(f, [ks[0], ks[1], b, c_out]))
    return tf.transpose(tf.stack(parts, axis=3), [2, 0, 1, 3, 4])


# Image channels (examples x C_out) per depthwise filter gradient: past this many, the CPU
# kernel's cost per example grows several-fold.
_DEPTHWISE_CHANNELS = 4096

# The depthwise route above beats unfolding patches for few input and output channels; with
# more output channels the outcome is mixed. Not under XLA, whose own lowering of the patches is
# the fast one there.
_MAX_DEPTHWISE_CHANNELS_OUT = 32


@functools.lru_cache(maxsize=1)
def depthwise_route_is_fast() -> bool:
    """Whether this machine's depthwise filter gradient is the fast route (read once).

    The route is much faster than the patches on a CPU with AVX-512 and several times *slower*
    on one with AVX2 only, so on a CPU it is taken only where the processor reports AVX-512
    (``avx512f`` in ``/proc/cpuinfo``); with a GPU always. Both routes give the same per-example
    kernels up to float32 rounding, and the norm is always that of what is stored.
    """
    if tf.config.list_logical_devices("GPU"):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "avx512f" in line.split() for line in f)
    except OSError:
        return False


def _grads(layer: Any, uses: Sequence[Use]) -> list[VariableGrad]:
    window, cin_g, groups, cout_g = _dims(layer)
    g_last = [tf.cast(_channels_last(layer, u.grad), tf.float32) for u in uses]
    g = tf.concat([tf.reshape(t, [tf.shape(t)[0], -1, t.shape[-1]]) for t in g_last], axis=1)
    path, _ = linear.choose_path(g.shape[1], window * cin_g, cout_g)
    kernel = layer.kernel
    per_example = None  # [B, *kernel.shape], or a list of [B, C_in, P] (one per offset)
    sum_error = None  # the book-keeping product's flush error (ghost routes)
    if groups == 1 and path == "materialized":
        if cin_g >= _MIN_OFFSET_CHANNELS:
            if all(int(st) == 1 for st in layer.strides):
                per_example = _offset_per_example(layer, uses)
        elif (
            cout_g <= _MAX_DEPTHWISE_CHANNELS_OUT
            and not tracing_for_xla()
            and depthwise_route_is_fast()
        ):
            # (XLA on CPU turns a depthwise convolution of B * C_out channels into a dense one,
            # far slower than its own lowering of the patches, which it compiles well.)
            per_example = _depthwise_per_example(layer, uses)
    # Certified norms (dpcore.norms): where the clipped sum is a weighted sum of materialized
    # per-example kernels, their stored norm; where it is the convolution's own filter gradient,
    # the ghost bound including that product's rounding.
    if isinstance(per_example, list):
        sq = tf.add_n([norms.sq_norm_bound(t) for t in per_example])
    elif per_example is not None:
        sq = norms.sq_norm_bound(per_example)
    elif groups == 1 and path == "materialized":
        # Patch rows are ordered (kernel window, C_in), the kernel's own layout: the [B, D, P]
        # per-example grads reshape to [B, *kernel.shape] and also give the clipped sum directly.
        a = tf.concat([_patches(layer, u.capture["a"]) for u in uses], axis=1)
        per_example = tf.reshape(linear.materialize(a, g), [-1, *kernel.shape])
        sq = norms.sq_norm_bound(per_example)
    elif groups == 1 and path == "ghost" and g.shape[1] != 1:
        # Scale each example's input to magnitude 1 before unfolding it (the patches hold the
        # same values, window times over), then bound the ghost identity on the scaled patches.
        raw = [tf.cast(u.capture["a"], tf.float32) for u in uses]
        scale = norms.row_scale(tf.concat([tf.reshape(r, [tf.shape(r)[0], -1]) for r in raw], 1))
        # Divided, not multiplied by 1 / scale: that reciprocal flushes to zero above 2^126.
        a = tf.concat(
            [_patches(layer, r / tf.reshape(scale, [-1] + [1] * (r.shape.rank - 1))) for r in raw],
            axis=1,
        )
        sq, sum_error = norms.ghost_sq_norm_bound(
            a, g, contribution=True, a_scale=scale, with_sum_error=True
        )
    elif groups == 1:
        a = tf.concat([_patches(layer, u.capture["a"]) for u in uses], axis=1)
        sq, sum_error = linear.bounds(a, g, path)
    else:
        a = tf.concat([_patches(layer, u.capture["a"]) for u in uses], axis=1)
        b = tf.shape(a)[0]
        a5 = tf.reshape(a, [b, -1, window, groups, cin_g])
        g4 = tf.reshape(g, [b, -1, groups, cout_g])
        if path == "ghost":
            # The kernel is block diagonal over groups: one ghost bound per (example, group).
            t = tf.shape(a5)[1]
            ag = tf.reshape(tf.transpose(a5, [0, 3, 1, 2, 4]), [b * groups, t, window * cin_g])
            gg = tf.reshape(tf.transpose(g4, [0, 2, 1, 3]), [b * groups, t, cout_g])
            sq, err = norms.ghost_sq_norm_bound(ag, gg, contribution=True, with_sum_error=True)
            sq = tf.reduce_sum(tf.reshape(sq, [b, groups]), 1)
            sum_error = tf.reduce_sum(tf.reshape(err, [b, groups]), 1)
        else:
            # [B, groups, window, C_in/g, C_out/g] -> the kernel's layout, filters group-major.
            m = linear.per_example_einsum("btkgc,btgo->bkcgo", a5, g4)
            per_example = tf.reshape(m, [-1, *kernel.shape])
            sq = norms.sq_norm_bound(per_example)

    def kernel_sum(w: tf.Tensor) -> tf.Tensor:
        if isinstance(per_example, list):
            summed = tf.stack([weighted_rows(t, w) for t in per_example])
            return tf.cast(tf.reshape(summed, kernel.shape), kernel.dtype)
        if per_example is not None:
            return tf.cast(weighted_rows(per_example, w), kernel.dtype)
        k = tf.cast(tf.convert_to_tensor(kernel), tf.float32)
        total = tf.zeros(k.shape, tf.float32)
        for u in uses:  # in float32, whatever the layer's compute dtype
            g32 = tf.cast(u.grad, tf.float32)
            cot = g32 * tf.reshape(tf.cast(w, tf.float32), [-1] + [1] * (g32.shape.rank - 1))
            a32 = tf.cast(tf.stop_gradient(u.capture["a"]), tf.float32)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(k)
                z = _conv(layer, a32, k)
            total += tape.gradient(z, k, output_gradients=cot)
        return tf.cast(total, kernel.dtype)

    out = [
        VariableGrad(
            variable=kernel, sq_norm=sq, weighted_sum=kernel_sum, path=path, sum_error=sum_error
        )
    ]
    if layer.use_bias:
        gb = tf.reduce_sum(g, axis=1)  # [B, C_out]
        out.append(from_per_example(layer.bias, gb, path="ghost"))
    return out


def _output_positions(layer: Any, input_shapes: Sequence[Any]) -> int | None:
    """``T``: output positions summed over the layer's uses (None if any is unknown)."""
    t = 0
    for shape in input_shapes:
        if shape is None:
            return None
        out_shape = layer.compute_output_shape(tuple(shape))
        spatial = out_shape[1:-1] if layer.data_format == "channels_last" else out_shape[2:]
        if None in spatial:
            return None
        n = 1
        for s in spatial:
            n *= int(s)
        t += n
    return t


def _plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    window, cin_g, groups, cout_g = _dims(layer)
    t = _output_positions(layer, input_shapes)
    path, why = linear.choose_path(t, window * cin_g, cout_g)
    if groups > 1:
        why = f"{groups} groups; {why}"
    return path, f"patches, {why}"


CONV = LayerRule(
    name="conv",
    check=_check,
    forward=_forward,
    grads=_grads,
    plan=_plan,
)
