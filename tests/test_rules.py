"""Each fast-path rule against the slow exact reference: per-example norms and clipped sums.

Every case is one layer on its own (a model ``Input -> layer``) with an MSE loss against random
targets, a batch that includes an all-zero example, sample weights and a padding row, run eagerly,
under ``tf.function`` and under ``tf.function(jit_compile=True)``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpcore.engine.ghost import fast_summary
from dpcore.engine.summary import prepare_batch
from dpcore.explain import explain
from dpcore.losses import per_example_loss_fn
from dpcore.options import ExecutionOptions
from dpcore.rules import default_registry, linear, lookup
from dpcore.rules.embedding import same_id_sq_norm
from dpcore.testing import assert_sq_norm_bound, reference_per_example_gradients

RTOL = 1e-5
MODES = ("eager", "function", "jit")
FAST_MODES = ("eager", "function")  # XLA compiles are slow on 2 cores: one jit case per family
LOSS = keras.losses.MeanSquaredError(reduction=None)


def _summaries(model, x, y, sw, mask, weights, mode):
    loss_fn = per_example_loss_fn(LOSS)

    def step(x, y, sw, mask, weights):
        xp, yp, swp, mkp = prepare_batch(x, y, sw, mask)
        s = fast_summary(
            model,
            loss_fn,
            xp,
            yp,
            swp,
            mkp,
            model.trainable_variables,
            options=ExecutionOptions(training=False),
        )
        return s.sq_norms, s.weighted_sum(weights), s.per_example_loss, s.paths

    if mode == "eager":
        sq, sums, loss, paths = step(x, y, sw, mask, weights)
    else:
        paths_box = {}

        def traced(*args):
            sq, sums, loss, paths = step(*args)
            paths_box.update(paths)
            return sq, sums, loss

        fn = tf.function(traced, jit_compile=(mode == "jit"))
        sq, sums, loss = fn(x, y, sw, mask, weights)
        paths = paths_box
    return np.asarray(sq), [np.asarray(t) for t in sums], np.asarray(loss), paths


def check_rule(model, x, y, *, modes=MODES, expect_path=None, zero_row=True):
    """Fast norms and weighted sums == reference, with a zero example, weights and a pad row."""
    b = x.shape[0]
    x = np.array(x)
    if zero_row and b > 1:
        x[1] = 0
    sw = np.linspace(0.5, 1.5, b).astype("float32")
    mask = np.ones(b, "float32")
    if b > 2:
        mask[-1] = 0.0
    ref = reference_per_example_gradients(model, LOSS, x, y, sample_weight=sw, mask=mask)
    ref_sq = np.stack([np.sum(g.reshape(b, -1) ** 2, axis=1) for g in ref], axis=1)
    assert ref_sq[mask > 0].max() > 0, "degenerate case: all gradients are zero"
    weights = np.random.default_rng(0).uniform(0.1, 1.0, (b, len(ref))).astype("float32")
    ref_sums = [np.tensordot(weights[:, j], g, axes=1) for j, g in enumerate(ref)]
    for mode in modes:
        sq, sums, loss, paths = _summaries(model, x, y, sw, mask, weights, mode)
        scale = ref_sq.max()
        assert_sq_norm_bound(sq, ref_sq, rtol=RTOL, atol=1e-7 * scale, err_msg=mode)
        for j, (got, want) in enumerate(zip(sums, ref_sums)):
            np.testing.assert_allclose(
                got, want, rtol=RTOL, atol=1e-6 * np.abs(want).max(), err_msg=f"{mode} var {j}"
            )
        assert np.all(sq[mask == 0] == 0)
        assert loss[mask == 0].tolist() == [0.0] * int((mask == 0).sum())
        if expect_path is not None:
            assert expect_path in paths.values(), (paths, expect_path)
    return paths


def _single(layer, input_shape, dtype="float32"):
    return keras.Sequential([keras.Input(input_shape, dtype=dtype), layer])


def _data(model, b, rng, ints=None):
    shape = (b, *model.inputs[0].shape[1:])
    x = rng.integers(0, ints, shape).astype("int32") if ints else rng.normal(size=shape)
    x = x.astype("int32") if ints else x.astype("float32")
    y = rng.normal(size=model(x).shape).astype("float32")
    return x, y


DENSE_CASES = {
    "2d_bias_tanh": (lambda: keras.layers.Dense(3, activation="tanh"), (5,), "ghost"),
    "2d_no_bias": (lambda: keras.layers.Dense(4, use_bias=False), (3,), "ghost"),
    "seq_materialized": (lambda: keras.layers.Dense(3, activation="relu"), (6, 4), "materialized"),
    "seq_ghost": (lambda: keras.layers.Dense(16), (2, 16), "ghost"),
    "image_input": (lambda: keras.layers.Dense(3, activation="sigmoid"), (2, 3, 4), None),
}


@pytest.mark.parametrize("case", sorted(DENSE_CASES))
def test_dense(case, rng):
    make, shape, path = DENSE_CASES[case]
    model = _single(make(), shape)
    modes = MODES if case == "2d_bias_tanh" else FAST_MODES
    check_rule(model, *_data(model, 4, rng), modes=modes, expect_path=path)


def test_dense_batch_of_one(rng):
    model = _single(keras.layers.Dense(3, activation="tanh"), (4, 5))
    check_rule(model, *_data(model, 1, rng), modes=("eager", "function"))


EINSUM_CASES = {
    "matrix": ("ab,bc->ac", (5,), (3,), "c"),
    "sequence": ("abc,cd->abd", (4, 5), (4, 3), "d"),
    "heads_in": ("abc,cde->abde", (3, 6), (3, 2, 4), "de"),
    "heads_out": ("abcd,cde->abe", (3, 2, 4), (3, 5), "e"),
    "ellipsis": ("...b,bc->...c", (2, 3, 4), 3, "c"),
    "shared_axis": ("abc,bcd->abd", (3, 4), (3, 2), None),
    "no_bias": ("abc,cd->abd", (4, 5), (4, 3), None),
}


@pytest.mark.parametrize("case", sorted(EINSUM_CASES))
def test_einsum_dense(case, rng):
    eq, in_shape, out_shape, bias = EINSUM_CASES[case]
    layer = keras.layers.EinsumDense(eq, output_shape=out_shape, bias_axes=bias, activation="tanh")
    model = _single(layer, in_shape)
    modes = MODES if case in ("heads_in", "ellipsis") else FAST_MODES
    paths = check_rule(model, *_data(model, 4, rng), modes=modes)
    if case == "shared_axis":
        assert paths[layer.name] == "materialized"


CONV_CASES = {
    "conv1d_same": (lambda: keras.layers.Conv1D(3, 3, padding="same", activation="tanh"), (7, 2)),
    "conv1d_causal_dilated": (
        lambda: keras.layers.Conv1D(2, 3, padding="causal", dilation_rate=2),
        (8, 3),
    ),
    "conv1d_stride_groups": (
        lambda: keras.layers.Conv1D(4, 2, strides=2, groups=2, use_bias=False),
        (9, 4),
    ),
    "conv2d_same_stride": (
        lambda: keras.layers.Conv2D(3, 3, strides=2, padding="same", activation="relu"),
        (7, 6, 2),
    ),
    "conv2d_valid_dilated": (lambda: keras.layers.Conv2D(2, (2, 3), dilation_rate=2), (7, 8, 1)),
    "conv2d_groups": (lambda: keras.layers.Conv2D(4, 3, groups=2, padding="same"), (5, 5, 4)),
    "conv2d_ghost": (lambda: keras.layers.Conv2D(8, 3, padding="valid"), (4, 4, 8)),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv(case, rng):
    make, shape = CONV_CASES[case]
    model = _single(make(), shape)
    # (grouped convs already run through XLA inside Keras on CPU)
    modes = MODES if case in ("conv1d_causal_dilated", "conv2d_same_stride") else FAST_MODES
    check_rule(model, *_data(model, 4, rng), modes=modes)


def test_conv_paths_follow_cost():
    ghost = _single(keras.layers.Conv2D(8, 3), (4, 4, 8))  # T=4, D=72, P=8
    mat = _single(keras.layers.Conv2D(2, 3, padding="same"), (8, 8, 1))  # T=64, D=9, P=2
    rule = default_registry()[keras.layers.Conv2D]
    assert rule.plan(ghost.layers[0], [(None, 4, 4, 8)])[0] == "ghost"
    assert rule.plan(mat.layers[0], [(None, 8, 8, 1)])[0] == "materialized"


OFFSET_CASES = {  # >= 8 input channels, stride 1, the materialized path: window-offset products
    "conv1d_same": (lambda: keras.layers.Conv1D(4, 3, padding="same", activation="tanh"), (9, 8)),
    "conv1d_causal_dilated": (
        lambda: keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2),
        (9, 8),
    ),
    "conv2d_same": (
        lambda: keras.layers.Conv2D(3, 3, padding="same", activation="relu"),
        (7, 6, 8),
    ),
    "conv2d_valid_dilated": (lambda: keras.layers.Conv2D(3, (2, 3), dilation_rate=2), (7, 8, 8)),
}


def _no_patches(*args, **kwargs):
    raise AssertionError("the patch route ran where another route should have")


@pytest.mark.parametrize("case", sorted(OFFSET_CASES))
def test_conv_offset_route(case, rng, monkeypatch):
    from dpcore.rules import conv

    make, shape = OFFSET_CASES[case]
    model = _single(make(), shape)
    monkeypatch.setattr(conv, "_patches", _no_patches)
    modes = MODES if case == "conv2d_same" else FAST_MODES
    check_rule(model, *_data(model, 4, rng), modes=modes, expect_path="materialized")


def test_conv_strided_many_channels_unfold_patches(rng, monkeypatch):
    """Strided slices are slow to copy: >= 8 channels with a stride take the patches."""
    from dpcore.rules import conv

    seen = []
    monkeypatch.setattr(conv, "_offset_per_example", lambda *a: seen.append("offsets"))
    monkeypatch.setattr(conv, "_depthwise_per_example", lambda *a: seen.append("depthwise"))
    for layer, shape in [
        (keras.layers.Conv1D(4, 3, strides=3, padding="same"), (10, 8)),
        (keras.layers.Conv2D(3, 3, strides=2, padding="same", activation="relu"), (7, 6, 8)),
    ]:
        model = _single(layer, shape)
        check_rule(model, *_data(model, 4, rng), modes=FAST_MODES, expect_path="materialized")
    assert not seen


def test_conv_offset_route_shared_layer(rng, monkeypatch):
    from dpcore.rules import conv

    layer = keras.layers.Conv1D(8, 3, padding="same", activation="tanh")  # T=9, D=24, P=8
    inputs = keras.Input((9, 8))
    model = keras.Model(inputs, layer(layer(inputs)))
    monkeypatch.setattr(conv, "_patches", _no_patches)
    check_rule(model, *_data(model, 4, rng), modes=FAST_MODES, expect_path="materialized")


DEPTHWISE_CASES = {  # < 8 input channels, <= 32 filters, the materialized path, no dilation
    "conv1d_same": (lambda: keras.layers.Conv1D(3, 3, padding="same", activation="tanh"), (7, 2)),
    "conv1d_causal_stride2": (
        lambda: keras.layers.Conv1D(4, 3, strides=2, padding="causal"),
        (9, 1),
    ),
    # The benchmark CNN's first layer, smaller: 8x8 kernel, stride 2, one channel.
    "conv2d_same_stride": (
        lambda: keras.layers.Conv2D(4, 8, strides=2, padding="same", activation="tanh"),
        (12, 11, 1),
    ),
    "conv2d_valid_rect": (lambda: keras.layers.Conv2D(5, (2, 3), strides=2), (7, 8, 3)),
}


@pytest.mark.parametrize("case", sorted(DEPTHWISE_CASES))
def test_conv_depthwise_route(case, rng, monkeypatch):
    from dpcore.rules import conv

    make, shape = DEPTHWISE_CASES[case]
    model = _single(make(), shape)
    monkeypatch.setattr(conv, "_patches", _no_patches)
    monkeypatch.setattr(conv, "depthwise_route_is_fast", lambda: True)
    check_rule(model, *_data(model, 4, rng), modes=FAST_MODES, expect_path="materialized")


@pytest.mark.parametrize("fast", [True, False], ids=["depthwise_fast", "depthwise_slow"])
def test_conv_depthwise_route_only_where_the_kernel_is_fast(fast, rng, monkeypatch):
    """Where the processor's depthwise filter gradient is slow the patches are unfolded instead:
    the same exact per-example kernels either way."""
    from dpcore.rules import conv

    assert isinstance(conv.depthwise_route_is_fast(), bool)  # this machine's answer
    seen = []
    route = conv._depthwise_per_example
    monkeypatch.setattr(conv, "_depthwise_per_example", lambda *a: seen.append(1) or route(*a))
    monkeypatch.setattr(conv, "depthwise_route_is_fast", lambda: fast)
    make, shape = DEPTHWISE_CASES["conv2d_same_stride"]
    model = _single(make(), shape)
    check_rule(model, *_data(model, 4, rng), modes=("function",), expect_path="materialized")
    assert bool(seen) == fast


@pytest.mark.parametrize("examples_per_chunk", [1, 3])
def test_conv_depthwise_route_in_chunks(examples_per_chunk, rng, monkeypatch):
    """A batch larger than a chunk runs in chunks (the last one shorter): same result."""
    from dpcore.rules import conv

    make, shape = DEPTHWISE_CASES["conv2d_same_stride"]  # 4 filters
    monkeypatch.setattr(conv, "_DEPTHWISE_CHANNELS", 4 * examples_per_chunk)
    monkeypatch.setattr(conv, "depthwise_route_is_fast", lambda: True)
    calls = []
    kernels = conv._depthwise_kernels
    monkeypatch.setattr(
        conv, "_depthwise_kernels", lambda a, *r: calls.append(a.shape[0]) or kernels(a, *r)
    )
    monkeypatch.setattr(conv, "_patches", _no_patches)
    model = _single(make(), shape)
    check_rule(model, *_data(model, 4, rng), modes=("eager",), expect_path="materialized")
    assert calls and max(calls) <= examples_per_chunk, calls


def test_conv_depthwise_route_is_not_taken_under_xla(rng, monkeypatch):
    """XLA compiles the patches well and a depthwise gradient of B * C_out channels badly."""
    from dpcore.rules import base, conv

    seen = []
    monkeypatch.setattr(conv, "_depthwise_per_example", lambda *a: seen.append(1))
    make, shape = DEPTHWISE_CASES["conv2d_same_stride"]
    model = _single(make(), shape)
    check_rule(model, *_data(model, 4, rng), modes=("jit",))
    assert not seen
    flags = []
    tf.function(jit_compile=True)(lambda: flags.append(base.tracing_for_xla()) or 0.0)()
    tf.function(lambda: flags.append(base.tracing_for_xla()) or 0.0)()
    assert flags == [True, False] and not base.tracing_for_xla()


def test_conv_depthwise_route_shared_layer(rng, monkeypatch):
    """Uses of one shape run as one stacked batch; uses of different shapes one at a time."""
    from dpcore.rules import conv

    monkeypatch.setattr(conv, "_patches", _no_patches)
    monkeypatch.setattr(conv, "depthwise_route_is_fast", lambda: True)
    layer = keras.layers.Conv2D(2, 3, padding="same", activation="tanh")  # T=25, D=18, P=2
    inputs = keras.Input((5, 5, 2))
    model = keras.Model(inputs, layer(layer(inputs)))
    check_rule(model, *_data(model, 4, rng), modes=FAST_MODES, expect_path="materialized")
    shared = keras.layers.Conv2D(2, 3, strides=2, padding="valid")  # 7x7 and 9x9 inputs
    big = keras.Input((9, 9, 1))
    small = keras.layers.Lambda(lambda t: t[:, 1:-1, 1:-1])(big)
    pooled = [keras.layers.Flatten()(shared(t)) for t in (big, small)]
    model = keras.Model(big, keras.layers.Concatenate()(pooled))
    check_rule(model, *_data(model, 4, rng), modes=FAST_MODES, expect_path="materialized")


@pytest.mark.parametrize("ids_shape", [(6,), (), (2, 3)])
def test_embedding(ids_shape, rng):
    layer = keras.layers.Embedding(7, 3)
    model = _single(layer, ids_shape, dtype="int32")
    x, y = _data(model, 4, rng, ints=4)  # few distinct ids: many repeats within an example
    if ids_shape == (6,):
        x[0] = [2, 2, 2, 5, 2, 5]
    check_rule(model, x, y, zero_row=False, modes=MODES if ids_shape == (6,) else FAST_MODES)


def test_embedding_negative_ids_wrap_like_keras(rng):
    """Keras's take reads row vocab + id for a negative id: -1 and vocab - 1 are one row."""
    model = _single(keras.layers.Embedding(6, 3), (4,), dtype="int32")
    x = np.array([[-1, 5, 5, 1], [-1, -1, 5, 2], [0, 1, 2, 3], [-2, 4, -2, 4]], "int32")
    y = rng.normal(size=(4, 4, 3)).astype("float32")
    check_rule(model, x, y, zero_row=False, modes=FAST_MODES)


@pytest.mark.parametrize("rank", [1, 2])
def test_conv_under_mixed_precision(rank, rng):
    """The rule computes what the float16 layer computes; sums accumulate in float32."""
    from dpcore.engine import summarize

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        conv = keras.layers.Conv1D(3, 3) if rank == 1 else keras.layers.Conv2D(3, 3, strides=2)
        shape = (8, 2) if rank == 1 else (7, 7, 2)
        inputs = keras.Input(shape)
        out = keras.layers.Dense(2, dtype="float32")(keras.layers.Flatten()(conv(inputs)))
        model = keras.Model(inputs, out)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    x = rng.normal(size=(4, *shape)).astype("float32")
    y = np.array([0, 1, 1, 0])
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    summary = summarize(model, sce, x, y, options=ExecutionOptions(method="fast", training=False))
    assert summary.paths[conv.name] in ("ghost", "materialized")  # the conv rule ran
    ref = reference_per_example_gradients(model, sce, x, y)
    ref_sq = np.stack([np.sum(g.reshape(4, -1) ** 2, axis=1) for g in ref], axis=1)
    weights = np.linspace(0.2, 1.0, 4)[:, None] * np.ones((1, len(ref)), "float32")
    # float16 activations: agreement to float16 precision (unit roundoff ~5e-4), not 1e-5.
    np.testing.assert_allclose(summary.sq_norms.numpy(), ref_sq, rtol=1e-2, atol=1e-3)
    for got, g in zip(summary.weighted_sum(tf.constant(weights, tf.float32)), ref):
        want = np.tensordot(weights[:, 0], g, axes=1)
        assert got.dtype == tf.float32
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_embedding_norm_never_builds_vocab_tensor():
    ids = tf.constant([[1, 1, 3], [0, 2, 0]])
    g = tf.constant(np.arange(18, dtype="float32").reshape(2, 3, 3))
    got = same_id_sq_norm(ids, g).numpy()
    want = [
        np.sum((g[0, 0] + g[0, 1]) ** 2) + np.sum(g[0, 2] ** 2),
        np.sum((g[1, 0] + g[1, 2]) ** 2) + np.sum(g[1, 1] ** 2),
    ]
    assert_sq_norm_bound(got, want, rtol=RTOL)


NORM_CASES = {
    "ln_last": (lambda: keras.layers.LayerNormalization(), (4, 5)),
    "ln_two_axes": (lambda: keras.layers.LayerNormalization(axis=[1, 2]), (3, 4)),
    "ln_no_center": (lambda: keras.layers.LayerNormalization(center=False), (6,)),
    "ln_rms": (lambda: keras.layers.LayerNormalization(rms_scaling=True), (3, 4)),
    "ln_rms_two_axes": (
        lambda: keras.layers.LayerNormalization(axis=[1, 2], rms_scaling=True, epsilon=1e-2),
        (3, 4),
    ),
    "ln_rms_no_center": (
        lambda: keras.layers.LayerNormalization(rms_scaling=True, center=False),
        (5,),
    ),
    "rms_last": (lambda: keras.layers.RMSNormalization(), (3, 4)),
    "rms_vector": (lambda: keras.layers.RMSNormalization(epsilon=1e-2), (6,)),
    "rms_two_axes": (lambda: keras.layers.RMSNormalization(axis=[1, 2]), (3, 4)),
    # Keras multiplies by ``scale`` with NumPy broadcasting: along the last axis here.
    "rms_axis1_square": (lambda: keras.layers.RMSNormalization(axis=1), (4, 4)),
    "gn_sequence": (lambda: keras.layers.GroupNormalization(groups=2), (5, 6)),
    "gn_image": (lambda: keras.layers.GroupNormalization(groups=2, epsilon=1e-2), (3, 3, 4)),
    "gn_instance": (lambda: keras.layers.GroupNormalization(groups=-1, scale=False), (4, 3)),
}


@pytest.mark.parametrize("case", sorted(NORM_CASES))
def test_normalization(case, rng):
    make, shape = NORM_CASES[case]
    model = _single(make(), shape)
    # Random gamma/beta so that the rule cannot pass by relying on the initial values.
    for v in model.trainable_variables:
        v.assign(rng.normal(size=v.shape).astype("float32"))
    modes = MODES if case in ("ln_last", "gn_image", "rms_last") else FAST_MODES
    check_rule(model, *_data(model, 4, rng), modes=modes, expect_path="ghost")


def test_choose_path_prefers_cheaper_form():
    assert linear.choose_path(1, 100, 100)[0] == "ghost"
    assert linear.choose_path(4, 100, 100)[0] == "ghost"
    assert linear.choose_path(1000, 8, 8)[0] == "materialized"
    assert linear.choose_path(None, 8, 8)[0] == "ghost"


def test_ghost_and_materialized_norms_agree(rng):
    a = tf.constant(rng.normal(size=(3, 5, 4)).astype("float32"))
    g = tf.constant(rng.normal(size=(3, 5, 2)).astype("float32"))
    want = np.sum(np.einsum("btd,btp->bdp", a.numpy(), g.numpy()) ** 2, axis=(1, 2))
    assert_sq_norm_bound(linear.sq_norm(a, g, "ghost"), want, rtol=RTOL)
    assert_sq_norm_bound(linear.sq_norm(a, g, "materialized"), want, rtol=RTOL)


def test_registry_is_explicit_and_exact():
    reg = default_registry()
    assert reg is not default_registry()  # a fresh mapping every time

    class MyDense(keras.layers.Dense):
        pass

    rule, why = lookup(reg, MyDense(2))
    assert rule is None and "MyDense" in why
    rule, _ = lookup(reg, keras.layers.Dense(2))
    assert rule is not None and rule.name == "dense"


def _lora(layer, input_shape, rank, alpha, rng):
    """``layer`` built on ``input_shape`` with LoRA enabled, random adapters (B is zero at first)."""
    model = _single(layer, input_shape)
    layer.enable_lora(rank, lora_alpha=alpha)
    for v in (layer.lora_kernel_a, layer.lora_kernel_b):
        v.assign(rng.normal(size=v.shape).astype("float32"))
    return model


LORA_DENSE_CASES = {  # (layer, input shape, rank, alpha, path)
    "2d_tanh": (lambda: keras.layers.Dense(4, activation="tanh"), (5,), 2, 3, "ghost"),
    "seq_ghost": (lambda: keras.layers.Dense(16), (3, 16), 4, None, "ghost"),
    "seq_materialized": (lambda: keras.layers.Dense(3), (8, 4), 2, 5, "materialized"),
    "no_bias": (lambda: keras.layers.Dense(3, use_bias=False), (2, 3, 4), 1, 2, None),
}


@pytest.mark.parametrize("case", sorted(LORA_DENSE_CASES))
def test_dense_lora(case, rng):
    make, shape, rank, alpha, path = LORA_DENSE_CASES[case]
    layer = make()
    model = _lora(layer, shape, rank, alpha, rng)
    assert not layer._kernel.trainable  # noqa: SLF001 - the frozen base kernel
    modes = MODES if case == "2d_tanh" else FAST_MODES
    check_rule(model, *_data(model, 4, rng), modes=modes, expect_path=path)


LORA_EINSUM_CASES = dict(EINSUM_CASES)  # the kernel's last axis is output-only in each


@pytest.mark.parametrize("case", sorted(LORA_EINSUM_CASES))
def test_einsum_dense_lora(case, rng):
    eq, in_shape, out_shape, bias = LORA_EINSUM_CASES[case]
    layer = keras.layers.EinsumDense(eq, output_shape=out_shape, bias_axes=bias, activation="tanh")
    model = _lora(layer, in_shape, 2, 3, rng)
    modes = MODES if case in ("heads_in", "ellipsis") else FAST_MODES
    paths = check_rule(model, *_data(model, 4, rng), modes=modes)
    assert paths[layer.name] in ("ghost", "materialized")  # the rule, not the fallback
    assert explain(model).paths()[layer.name] == paths[layer.name]


def test_lora_rule_does_no_work_for_the_frozen_kernel(rng):
    from dpcore.rules.base import Use

    layer = keras.layers.Dense(3)
    _lora(layer, (4, 5), 2, None, rng)
    a = tf.constant(rng.normal(size=(2, 4, 5)).astype("float32"))
    g = tf.constant(rng.normal(size=(2, 4, 3)).astype("float32"))
    rule, why = lookup(default_registry(), layer)
    assert rule is not None, why
    got = [vg.variable.path for vg in rule.grads(layer, [Use(capture={"a": a}, grad=g)])]
    assert got == [layer.lora_kernel_a.path, layer.lora_kernel_b.path, layer.bias.path]


def test_lora_with_frozen_adapter_and_shared_layer(rng):
    """Only B trains (A frozen); the layer is called twice: uses concatenated, cross terms kept."""
    layer = keras.layers.Dense(4, activation="tanh")
    inputs = keras.Input((3, 4))
    model = keras.Model(inputs, layer(layer(inputs)))
    layer.enable_lora(2, lora_alpha=4)
    for v in (layer.lora_kernel_a, layer.lora_kernel_b):
        v.assign(rng.normal(size=v.shape).astype("float32"))
    layer.lora_kernel_a.trainable = False
    assert len(model.trainable_variables) == 2  # B and the bias
    paths = check_rule(model, *_data(model, 4, rng), modes=FAST_MODES)
    assert paths[layer.name] == "materialized"  # B: T = 2 * 3, r = 2, P = 4
    row = {r.name: r for r in explain(model).rows}[layer.name]
    assert row.path == "materialized" and "lora A frozen" in row.why, row


def test_lora_with_trainable_base_kernel_falls_back(rng):
    """A LoRA layer that also trains its base kernel is not the rule's case: exact fallback."""
    layer = keras.layers.Dense(3)
    model = _lora(layer, (5,), 2, None, rng)
    layer._kernel.trainable = True  # noqa: SLF001 - unfreeze the base kernel
    rule, why = lookup(default_registry(), layer)
    assert rule is None and "also trains" in why
    check_rule(model, *_data(model, 4, rng), modes=("eager",), expect_path="fallback:vectorized")


def test_lora_explain_reports_both_adapters(rng):
    dense = keras.layers.Dense(5, name="lora_dense")
    einsum = keras.layers.EinsumDense("abc,cde->abde", (6, 2, 4), bias_axes="de", name="lora_ed")
    for layer, shape, path in ((dense, (8,), "ghost"), (einsum, (6, 8), "materialized")):
        row = {r.name: r for r in explain(_lora(layer, shape, 2, None, rng)).rows}[layer.name]
        assert row.path == path and "LoRA rank 2, base kernel frozen" in row.why, row
        assert f"lora A {path}" in row.why and "lora B" in row.why, row
