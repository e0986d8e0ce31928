"""Clip factors come from certified norm bounds: adversarial records cannot escape clipping.

Each case crafts one record whose float32 norm computation used to fail (cancelling positions,
squares that underflow or overflow, non-finite losses, masks that are not 0/1) and checks the
privacy claim itself: with σ = 0, removing the record moves the clipped sum by at most
``C * (1 + TOLERANCE)``, on every engine path, and every norm bound is at least the exact norm.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dpcore
from dpcore import aggregation, norms
from dpcore.options import ExecutionOptions
from dpcore.testing import reference_per_example_gradients

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")

# Stated once for the whole suite: the batch-level float32 sums add rounding of the other records'
# terms on top of the per-record tolerance (dpcore.aggregation.CONTRIBUTION_TOLERANCE).
TOLERANCE = 1e-3
C = 1.0
MSE = keras.losses.MeanSquaredError(reduction=None)
PATHS = ("fast", "vectorized")


def _clipped_sum(model, loss, x, y, mask, method, nonfinite="raise"):
    @tf.function
    def run(x, y, mask):
        s = dpcore.summarize(
            model,
            loss,
            x,
            y,
            mask=mask,
            options=ExecutionOptions(method=method, training=False, nonfinite=nonfinite),
        )
        clipped = aggregation.clip(s, l2_norm_clip=C)
        return clipped.grads, s.sq_norms, s.mask

    grads, sq, kept = run(x, y, mask)
    return np.concatenate([g.numpy().ravel() for g in grads]), sq.numpy(), kept.numpy()


def _check_record(model, x, y, *, loss=MSE, index=0, methods=PATHS, exact_sq=None):
    """Removing record ``index`` moves the clipped sum by <= C(1+TOLERANCE); bounds >= exact.

    ``exact_sq`` is the record's squared gradient norm computed in float64, for a record whose
    gradient float32 cannot evaluate closely (positions that cancel): the float32 reference is
    then as far from it as float32 rounding of the cancelling sum goes, which differs between
    CPUs. Only the fast path, whose bound covers the exact product of its recorded operands plus
    the rounding of that product, is compared with it; the vectorized path's bound covers the
    float32 gradient it materializes and adds, which the ``moved`` check proves.
    """
    b = x.shape[0]
    with_it = np.ones(b, "float32")
    without = with_it.copy()
    without[index] = 0.0
    ref = reference_per_example_gradients(model, loss, x, y)
    ref_sq = np.stack([np.sum(np.asarray(g, np.float64).reshape(b, -1) ** 2, 1) for g in ref], 1)
    moved = {}
    for method in methods:
        full, sq, _ = _clipped_sum(model, loss, x, y, with_it, method)
        less, _, _ = _clipped_sum(model, loss, x, y, without, method)
        assert np.all(np.isfinite(full)), method
        moved[method] = float(np.linalg.norm(full.astype(np.float64) - less))
        assert moved[method] <= C * (1 + TOLERANCE), (method, moved[method])
        # The record's bound is never below its exact norm (the reference is float32 too).
        if exact_sq is None:
            assert np.sqrt(sq[index].sum()) >= np.sqrt(ref_sq[index].sum()) * (1 - 1e-5), method
        elif method == "fast":
            assert np.sqrt(sq[index].sum()) >= np.sqrt(exact_sq) * (1 - 1e-5), method
    return moved


def _cancelling_dense(d=64):
    inputs = keras.Input((2, d))
    h = keras.layers.Dense(64, use_bias=False, name="seq_dense")(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, keras.layers.Dense(1, use_bias=False)(h))


def _cancelling_batch(rng, b):
    """Record 0's two positions nearly cancel (``a`` and ``-a + 1e-3``, ``|a| ~ 1e3``); big label."""
    a = rng.normal(size=64).astype("float32") * 1e3
    x = rng.normal(size=(b, 2, 64)).astype("float32")
    x[0, 0], x[0, 1] = a, -a + 1e-3
    y = rng.normal(size=(b, 1)).astype("float32")
    y[0] = 1e6
    return x, y


def _cancelling_exact_sq(model, x, y):
    """Record 0's squared gradient norm for ``_cancelling_dense``, in float64 (closed form)."""
    w1, w2 = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
    a = np.asarray(x[0], np.float64)  # [2, d]
    pooled = (a @ w1).mean(0)
    d_out = 2.0 * (pooled @ w2 - np.asarray(y[0], np.float64))  # MSE over one output
    d_pooled = w2 @ d_out
    return np.sum(np.outer(a.sum(0) / 2.0, d_pooled) ** 2) + np.sum(np.outer(pooled, d_out) ** 2)


def test_cancelling_positions_are_clipped(rng):
    model = _cancelling_dense()
    assert dpcore.explain(model).paths()["seq_dense"] == "ghost"
    x, y = _cancelling_batch(rng, 4)
    exact_sq = _cancelling_exact_sq(model, x, y)
    # The closed form is the model's gradient: a well-conditioned record agrees with the reference.
    x_plain = x.copy()
    x_plain[0, 1] = x[0, 0]
    ref_plain = reference_per_example_gradients(model, MSE, x_plain, y)
    np.testing.assert_allclose(
        _cancelling_exact_sq(model, x_plain, y),
        sum(np.sum(np.asarray(g, np.float64)[0] ** 2) for g in ref_plain),
        rtol=1e-5,
    )
    _check_record(model, x, y, exact_sq=exact_sq)


def test_cancelling_record_through_dp_train_step(rng):
    """The custom-loop entry: with σ = 0 one crafted record moves the update by at most C."""
    model = _cancelling_dense()
    x, y = _cancelling_batch(rng, 4)
    start = [v.numpy() for v in model.trainable_variables]

    def update(mask):
        for v, s in zip(model.trainable_variables, start):
            v.assign(s)
        opt = dpcore.DPOptimizer(
            keras.optimizers.SGD(1.0), l2_norm_clip=C, noise_multiplier=0.0, expected_batch_size=1
        )
        tf.function(lambda: dpcore.dp_train_step(model, MSE, x, y, optimizer=opt, mask=mask))()
        return np.concatenate(
            [(v.numpy() - s).ravel() for v, s in zip(model.trainable_variables, start)]
        )

    moved = np.linalg.norm(
        update(np.ones(4, "float32")) - update(np.array([0, 1, 1, 1], "float32"))
    )
    assert moved <= C * (1 + TOLERANCE), moved


def test_underflowing_features_are_clipped():
    """||a||^2 of features ~1e-19 underflows in float32; the bound is taken in float64."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign(np.zeros((4, 1), "float32"))
    x = np.full((3, 4), 1e-19, "float32")
    x[1:] = 0.5
    y = np.array([[-1e19], [1.0], [2.0]], "float32")  # record 0: gradient 2 per feature, norm 4
    moved = _check_record(model, x, y)
    assert min(moved.values()) > 0.5 * C  # the record is clipped to C, not dropped


def test_overflowing_activations_are_clipped(rng):
    """Squares of activations ~1e20 overflow float32 (inf * 0 was NaN); the step still clips."""
    model = keras.Sequential(
        [
            keras.Input((3, 8)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    x = rng.normal(size=(3, 3, 8)).astype("float32")
    x[0] *= 1e20
    x[0, 0, 0] = 1e-3  # one unsaturated unit keeps a non-zero gradient at the first layer
    y = np.array([[1e15], [0.0], [1.0]], "float32")
    _check_record(model, x, y)


def _two_position_dense(out_kernel):
    """``[2, 4]`` inputs -> a trainable sequence Dense (kernel zeros, ghost path) -> a fixed
    projection of both positions to one output, so the output gradients per position are fixed
    multiples of ``dL/dout`` (``out_kernel [8]``)."""
    inputs = keras.Input((2, 4))
    seq = keras.layers.Dense(4, use_bias=False, name="seq_dense", kernel_initializer="zeros")
    head = keras.layers.Dense(1, use_bias=False, trainable=False, name="head")
    model = keras.Model(inputs, head(keras.layers.Flatten()(seq(inputs))))
    head.kernel.assign(np.asarray(out_kernel, "float32").reshape(8, 1))
    assert dpcore.explain(model).paths()["seq_dense"] == "ghost"
    return model


def test_record_whose_scaled_products_flush_is_clipped(rng):
    """Position 0 holds 2^64 x the features of position 1, and gets no gradient: after scaling
    to magnitude 1, position 1's entries are 2^-64 and their products flush to zero, so the Gram
    matrices said the gradient (that of position 1 alone, norm 2000) was ~0."""
    model = _two_position_dense([0, 0, 0, 0, 1, 0, 0, 0])  # only position 1 reaches the loss
    x = rng.normal(size=(3, 2, 4)).astype("float32")
    y = rng.normal(size=(3, 1)).astype("float32")
    x[0, 1] = 1000.0
    x[0, 0] = 1000.0 * 2.0**64
    y[0] = 0.5  # dL/dout = 2 (0 - 0.5) = -1: the record's gradient is x[0, 1] (x) (-1, 0, 0, 0)
    moved = _check_record(model, x, y)
    # Clipped, not dropped (the fast path's bound is loose for such a record, up to ~8x here:
    # the flushed entries are only known to be below 2^-126 each).
    assert moved["vectorized"] > 0.5 * C and moved["fast"] > 0.05 * C, moved


def test_weighted_terms_that_flush_cannot_exceed_the_clip_bound():
    """The clipped sum multiplies the factor into the output gradients, ``a^T (w g)``. With
    ``|a| = 3e38`` and ``g = (-1, 0.75)`` over two positions the exact gradient is ``0.25 |a|``,
    the factor ``4 / |a|`` puts ``w g_0`` just above the smallest normal float32 and ``w g_1``
    just below it, where it flushes to zero: the cancelling term was lost and the record added
    ``4 C``. Its flush error is now spent out of C (here all of it: the record adds nothing)."""
    model = _two_position_dense([1, 0, 0, 0, -0.75, 0, 0, 0])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 2, 4)).astype("float32")
    y = rng.normal(size=(3, 1)).astype("float32")
    x[0] = 0.0
    x[0, :, 0] = 3e38
    y[0] = 0.5  # dL/dout = -1: g = (-1, 0.75) on feature 0
    s = dpcore.summarize(model, MSE, x, y, options=ExecutionOptions(training=False))
    w = aggregation.round_down_f32(
        aggregation.clip_factors(aggregation.total_norm_bound(s.sq_norms), l2_norm_clip=C)
    )
    # The scenario holds: factor normal, one weighted term normal and the other one flushed.
    assert np.float32(w[0]) >= np.finfo(np.float32).tiny
    assert np.float32(w[0]) * np.float32(0.75) < np.finfo(np.float32).tiny <= np.float32(w[0])
    unbudgeted = np.linalg.norm(
        s.weighted_sum(tf.tensor_scatter_nd_update(tf.zeros([3, 1], tf.float32), [[0, 0]], [w[0]]))[
            0
        ].numpy()
    )
    assert unbudgeted > 3.0 * C  # what the record would add with the factor of its norm alone
    assert float(s.sum_errors.numpy()[0].sum()) > C
    _check_record(model, x, y)


def test_conv_cancelling_offsets_are_clipped(rng):
    inputs = keras.Input((4, 8))
    h = keras.layers.Conv1D(32, 2, name="conv")(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    x = rng.normal(size=(3, 4, 8)).astype("float32")
    a = rng.normal(size=8).astype("float32") * 1e4
    x[0] = np.stack([a, -a, a, -a + 1e-2])
    y = np.array([[1e5], [0.0], [1.0]], "float32")
    _check_record(model, x, y)


def test_conv_input_above_2_to_126_is_clipped(rng):
    """A convolution input of 1e38: its scale's reciprocal is subnormal, and multiplying by it
    flushed every scaled entry to zero (a bound of 0 for a gradient of ~1e37)."""
    inputs = keras.Input((4, 8))
    conv = keras.layers.Conv1D(16, 2, name="conv", kernel_initializer="zeros")
    h = keras.layers.GlobalAveragePooling1D()(conv(inputs))
    # A small head keeps the record's gradient (~1e35) and so its clip factor within float32.
    head = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(1e-3))
    model = keras.Model(inputs, head(h))
    assert dpcore.explain(model).paths()["conv"] == "ghost"
    x = rng.normal(size=(3, 4, 8)).astype("float32")
    x[0] = np.sign(x[0]) * 1e38
    y = np.array([[1.0], [0.0], [1.0]], "float32")
    moved = _check_record(model, x, y)
    # The vectorized path clips it to C. On the fast path the filter gradient's flush error
    # (2 T sqrt(D P) 2^-126 |a| ~ 113 here) exceeds C, so the record adds nothing.
    assert moved["vectorized"] > 0.5 * C and moved["fast"] == 0.0, moved


def test_conv_depthwise_route_extreme_record_is_clipped(rng, monkeypatch):
    """One input channel (the depthwise route): a huge, cancelling image with a tiny pixel."""
    from dpcore.rules import conv

    calls = []
    route = conv._depthwise_per_example
    monkeypatch.setattr(conv, "_depthwise_per_example", lambda *a: calls.append(1) or route(*a))
    monkeypatch.setattr(conv, "depthwise_route_is_fast", lambda: True)
    inputs = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(4, 3, strides=2, padding="same", name="conv")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(h)))
    x = rng.normal(size=(3, 6, 6, 1)).astype("float32")
    x[0] = 1e12 * np.where(np.indices((6, 6, 1)).sum(0) % 2, 1.0, -1.0)
    x[0, 0, 0, 0] = 1e-30
    y = np.array([[1e13], [0.0], [1.0]], "float32")
    _check_record(model, x, y)
    assert calls  # the fast path's conv kernel took the depthwise route


def test_embedding_repeated_ids_are_clipped(rng):
    model = keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(5, 8),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    x = rng.integers(0, 5, (3, 6)).astype("int32")
    x[0] = 2  # one id repeated at every position: the gradients of equal ids add up
    y = np.array([[1e7], [0.0], [1.0]], "float32")
    _check_record(model, x, y)


def test_layer_norm_extreme_label_is_clipped(rng):
    model = keras.Sequential(
        [
            keras.Input((5, 4)),
            keras.layers.LayerNormalization(),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    x = rng.normal(size=(3, 5, 4)).astype("float32") * 1e6
    y = np.array([[1e18], [0.0], [1.0]], "float32")
    _check_record(model, x, y)


def test_per_group_clipping_respects_each_bound(rng):
    model = _cancelling_dense()
    x, y = _cancelling_batch(rng, 3)
    bounds = [0.5, 2.0]

    @tf.function
    def run(mask):
        s = dpcore.summarize(model, MSE, x, y, mask=mask, options=ExecutionOptions(method="fast"))
        return aggregation.clip(s, l2_norm_clip=bounds, variable_groups=[0, 1]).grads

    def clipped(mask):
        return [g.numpy() for g in run(mask)]

    full, less = clipped(np.ones(3, "float32")), clipped(np.array([0, 1, 1], "float32"))
    for g_full, g_less, bound in zip(full, less, bounds):
        assert np.linalg.norm(g_full - g_less) <= bound * (1 + TOLERANCE)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_ghost_bound_covers_exact_norm_in_float64(rng, graph):
    """The bound is checked against float64 ground truth on cancelling and random operands,
    eagerly and in a graph (operands large enough that both Gram matrices come from XLA)."""
    t, d, p = (16, 64, 64) if graph else (5, 16, 8)
    a = rng.normal(size=(3, t, d)) * np.array([1e-20, 1.0, 1e20])[:, None, None]
    g = rng.normal(size=(3, t, p))
    a[1, 1] = -a[1, 0] + 1e-6
    g[1, 1] = g[1, 0]
    a32, g32 = a.astype("float32"), g.astype("float32")
    exact = np.sum(
        np.einsum("btd,btp->bdp", a32.astype(np.float64), g32.astype(np.float64)) ** 2, (1, 2)
    )
    fn = tf.function(norms.ghost_sq_norm_bound) if graph else norms.ghost_sq_norm_bound
    if graph:
        specs = (tf.TensorSpec(a32.shape, tf.float32), tf.TensorSpec(g32.shape, tf.float32))
        assert _xla_compiled(fn, *specs), "the Gram matrices are not compiled"
    bound = fn(tf.constant(a32), tf.constant(g32)).numpy()
    assert np.all(bound >= exact)
    assert np.all(np.isfinite(bound))
    # Tight on the random (non-cancelling) rows.
    np.testing.assert_array_less(bound[[0, 2]], exact[[0, 2]] * (1 + 1e-3))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_ghost_bound_covers_products_that_flush_and_scales_near_float32_max(rng, graph):
    """Operands whose scaled Gram products flush to zero (one position 2^64 times the others),
    and operands near float32's maximum (whose scale's reciprocal, below 2^-126, used to flush
    every scaled entry to zero): the bound still covers the float64 ground truth, eagerly and
    with the Gram matrices compiled by XLA; ordinary rows stay tight."""
    t, d, p = (16, 64, 64) if graph else (5, 16, 8)
    a = rng.normal(size=(5, t, d))
    g = rng.normal(size=(5, t, p))
    a[0, 0] *= 2.0**64  # a's position 0 dominates its scale; it gets no gradient
    g[0, 0] = 0.0
    g[1, 0] *= 2.0**64  # the same for g
    a[1, 0] = 0.0
    a[2] = np.clip(a[2], -1.0, 1.0) * 3e38  # scale above 2^126
    g[3, 1:] *= 2.0**-70  # g's other positions flush against position 0, which a has zero
    a[3, 0] = 0.0
    a32, g32 = a.astype("float32"), g.astype("float32")
    exact = np.sum(
        np.einsum("btd,btp->bdp", a32.astype(np.float64), g32.astype(np.float64)) ** 2, (1, 2)
    )
    assert np.all(np.isfinite(exact)) and np.all(exact > 0)
    fn = tf.function(norms.ghost_sq_norm_bound) if graph else norms.ghost_sq_norm_bound
    if graph:
        specs = (tf.TensorSpec(a32.shape, tf.float32), tf.TensorSpec(g32.shape, tf.float32))
        assert _xla_compiled(fn, *specs), "the Gram matrices are not compiled"
    bound = fn(tf.constant(a32), tf.constant(g32)).numpy()
    assert np.all(np.isfinite(bound))
    assert np.all(bound >= exact), bound / exact
    np.testing.assert_array_less(bound[[2, 4]], exact[[2, 4]] * (1 + 1e-3))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_ghost_bound_of_an_example_does_not_depend_on_the_other_examples(rng, graph):
    """Examples whose Gram diagonal peaks in ``norms.ORDINARY_DIAGONAL`` (or which are zero) are
    not divided by their largest magnitude; a batch holding any other example divides that one, by
    a pass the kept examples do not see. A kept example's bound is bitwise the same whether its
    batch needs that pass or not (the batch's shape fixed, as dpcore's padded batches are), and
    under XLA also alone; kept examples' bounds cover the float64 ground truth and are tight."""
    t, d, p = (16, 64, 64) if graph else (5, 16, 8)
    # A largest magnitude of at least 2^-20 puts the diagonal's peak at 2^-40 or more; one of at
    # most 2^37 keeps it at d 2^74 <= 2^80 (d <= 64).
    low, high = 2.0**-20, 2.0**40
    kept_magnitudes = [1.0, low, high / 8, 0.0]
    others = [low / 16, high * 4, 1e30, 1e-30]  # each needs the division (peak < 2^-40 or > 2^80)
    a = rng.normal(size=(8, t, d))
    a /= np.abs(a).max(axis=(1, 2), keepdims=True)  # largest magnitude exactly 1 ...
    a *= np.array(kept_magnitudes + others)[:, None, None]  # ... then the example's
    g = rng.normal(size=(8, t, p))
    a32, g32 = a.astype("float32"), g.astype("float32")
    fn = norms.ghost_sq_norm_bound
    if graph:
        fn = tf.function(
            fn, input_signature=[tf.TensorSpec([None, t, d]), tf.TensorSpec([None, t, p])]
        )

    def bounds(rows):
        return fn(tf.constant(a32[rows]), tf.constant(g32[rows])).numpy()

    mixed = bounds(list(range(8)))  # needs the division
    kept_only = bounds([0, 1, 2, 3, 0, 1, 2, 3])  # the same shape, no division
    np.testing.assert_array_equal(kept_only[:4], mixed[:4])
    if graph:  # XLA's batched product rounds a row alike whatever the batch size
        for i in range(8):
            np.testing.assert_array_equal(bounds([i]), mixed[i : i + 1])
    exact = np.sum(
        np.einsum("btd,btp->bdp", a32.astype(np.float64), g32.astype(np.float64)) ** 2, (1, 2)
    )
    assert np.all(mixed >= exact)
    assert mixed[3] < 1e-60  # zero inputs: only the absolute flush terms
    np.testing.assert_array_less(mixed[[0, 1, 2]], exact[[0, 1, 2]] * (1 + 1e-3))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_scaled_gram_keeps_ordinary_and_zero_examples_and_bounds_their_magnitude(rng, graph):
    """``scaled_gram`` keeps the undivided Gram matrix of an example whose diagonal lies in
    ``ORDINARY_DIAGONAL`` (``s = 1``, ``m`` a certified upper bound of its largest magnitude, no
    more than the largest row norm) and of an all-zero example (``m = 0``); every other example
    (squares that flush to zero, tiny, huge, NaN, Inf) is divided by its exact largest magnitude.
    A kept example's outputs are bitwise the same in a batch that takes the division branch and
    in one that does not."""
    t, k = (16, 64) if graph else (3, 8)
    x = rng.normal(size=(10, t, k))
    x /= np.abs(x).max(axis=(1, 2), keepdims=True)
    # kept: 1, 2^-18 (diagonal just above 2^-40), 2^36 with one dominant row, 0 ...
    x *= np.array([1.0, 2.0**-18, 2.0**36, 0.0, 1.0, 1e-30, 2.0**-30, 1e30, 1.0, 1.0])[
        :, None, None
    ]
    x[2, 1:] *= 2.0**-80  # one row dominates (its entries flush against it in the other rows)
    x[4, 1:] = 0.0  # ... and one non-zero row among zero rows; then divided:
    x[8, 0, 0] = np.nan
    x[9, 1, 2] = np.inf
    x32 = x.astype("float32")
    fn = norms.scaled_gram
    if graph:
        fn = tf.function(fn, input_signature=[tf.TensorSpec([None, t, k])])
    xx, s, m = (v.numpy() for v in fn(tf.constant(x32)))
    true_max = np.abs(x32.astype(np.float64)).max(axis=(1, 2))
    kept = [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(s[kept], 1.0)
    assert m[3] == 0.0 and np.all(xx[3] == 0.0)
    row_norms = np.sqrt(np.sum(x32.astype(np.float64) ** 2, axis=2)).max(axis=1)
    for i in (0, 1, 2, 4):
        assert true_max[i] <= m[i] <= row_norms[i] * (1 + 1e-5), i
    np.testing.assert_array_equal(s[[5, 6, 7]], true_max[[5, 6, 7]].astype("float32"))
    np.testing.assert_array_equal(m[[5, 6, 7]], true_max[[5, 6, 7]])
    assert not np.any(np.isfinite(m[[8, 9]]))
    scaled = x32[[5, 6, 7]] / s[[5, 6, 7], None, None]
    want = np.einsum("btk,bsk->bts", scaled.astype(np.float64), scaled.astype(np.float64))
    np.testing.assert_allclose(xx[[5, 6, 7]], want, rtol=1e-5, atol=1e-6)
    again = [v.numpy() for v in fn(tf.constant(x32[kept + kept]))]  # no division in this batch
    for got, first in zip(again, (xx, s, m)):
        np.testing.assert_array_equal(got[:5], first[kept])


def _adversarial_rows(rng, n):
    """Rows of length ``n`` whose sums of squares float32 (or float64) gets wrong in every way."""
    rows = rng.normal(size=(10, n))
    rows[1] *= 1e20  # every square overflows float32
    rows[2] = 0.0
    rows[2, n // 2] = 3e19  # one square overflows
    rows[3] = 1e-30  # every square flushes to zero
    rows[4] = 0.0
    rows[5, ::2] *= 1e-25  # half flush, half are normal
    rows[6] = np.where(np.arange(n) % 2, 1.7e19, -1.7e19)  # squares fit, their sum does not
    rows[7] *= 1e-19  # squares near the smallest normal float32
    rows[8] = np.float32(np.finfo(np.float32).max)
    rows[9] = 1e-160  # zero in float32; in float64 every square flushes to zero
    return rows


@pytest.mark.parametrize("n", [8, 97, 260, 264, 784, 1024])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_row_sums_of_squares_are_certified_and_tight(rng, n, dtype):
    """The sums of squares behind every norm bound (`rows_sq_norm`): never below the exact
    sum of squares (exact rational arithmetic), within 1e-5 of it unless the row's squares are
    below the float32 normal range, eagerly and in a graph of unknown batch size; a row's bound
    is the one it gets alone (an overflowing row is summed again by itself); non-finite rows give
    non-finite bounds."""
    from fractions import Fraction

    rows = tf.cast(tf.constant(_adversarial_rows(rng, n)), dtype)
    stored = rows.numpy().astype(np.float64)  # the values as the dtype holds them
    finite = np.isfinite(stored).all(axis=1)
    exact = np.array(
        [
            float(sum(Fraction(float(v)) ** 2 for v in row)) if ok else np.inf
            for row, ok in zip(stored, finite)
        ]
    )
    graph = tf.function(norms.rows_sq_norm, input_signature=[tf.TensorSpec([None, n], dtype)])
    bound = norms.rows_sq_norm(rows).numpy()
    np.testing.assert_array_equal(graph(rows).numpy(), bound)
    assert np.all(bound[finite] >= exact[finite]), (bound, exact)
    assert np.all(np.isfinite(bound[finite]))
    assert np.all(~np.isfinite(bound[~finite]))
    # Tight: the absolute term for squares that flush to zero is 2 n 2^-126 at most.
    slack = 2 * n * 2.0**-126 * (1 + 1e-5)
    np.testing.assert_array_less(bound[finite], exact[finite] * (1 + 1e-5) + slack)
    assert bound[4] == 0.0  # a row of zeros
    for i in range(len(stored)):
        alone = norms.rows_sq_norm(rows[i : i + 1]).numpy()[0]
        assert alone == bound[i] or (np.isnan(alone) and np.isnan(bound[i])), i
    poisoned = rows.numpy().copy()
    poisoned[0, 1], poisoned[4, 0] = np.nan, np.inf
    bad = norms.rows_sq_norm(tf.constant(poisoned)).numpy()
    assert np.isnan(bad[0]) and np.isinf(bad[4])
    np.testing.assert_array_equal(bad[5:], bound[5:])


def test_gram_in_a_graph_is_compiled_and_within_the_dot_product_model(rng):
    """``norms.gram`` in a graph runs XLA's batched matmul: every entry stays within the float32
    dot-product error the ghost bound assumes, and a NaN reaches its example's entries only."""
    k = 300
    x = (rng.normal(size=(4, 8, k)) * np.array([1e-15, 1.0, 1e15, 1.0])[:, None, None]).astype(
        "float32"
    )
    x[3, 2, 7] = np.nan
    fn = tf.function(norms.gram)
    assert 8 * 8 * k >= norms.XLA_MIN_WORK
    assert _xla_compiled(fn, tf.TensorSpec(x.shape, tf.float32)), "the Gram is not compiled"
    got = fn(tf.constant(x)).numpy().astype(np.float64)
    x64 = x.astype(np.float64)
    exact = np.einsum("btk,bsk->bts", x64, x64)
    scale = np.einsum("btk,bsk->bts", np.abs(x64), np.abs(x64))
    err = float(norms.dot_gamma(k)) * scale
    finite = [0, 1, 2]
    assert np.all(np.abs(got[finite] - exact[finite]) <= err[finite])
    assert np.all(np.isnan(got[3, 2, :])) and np.all(np.isnan(got[3, :, 2]))
    assert np.all(np.isfinite(np.delete(np.delete(got[3], 2, 0), 2, 1)))


def _xla_compiled(fn, *specs):
    graph = fn.get_concrete_function(*specs).graph
    return any(f.cached_definition.attr["_XlaMustCompile"].b for f in graph._functions.values())


@pytest.mark.parametrize("t,compiled", [(16, True), (2, False)], ids=["large", "small"])
def test_per_example_products_in_a_graph(rng, t, compiled):
    """Materialized per-example gradients (``A_i^T G_i``, and the einsum form EinsumDense and
    grouped convolutions use) are XLA-compiled in a graph from ``XLA_MIN_WORK`` multiply-adds per
    example, TensorFlow's kernels below it; both agree with float64 within the float32 error of
    a dot product of length ``T``."""
    from dpcore.rules import linear

    a = rng.normal(size=(5, t, 32)).astype("float32")
    g = rng.normal(size=(5, t, 40)).astype("float32")
    specs = (tf.TensorSpec(a.shape, tf.float32), tf.TensorSpec(g.shape, tf.float32))
    assert (t * 32 * 40 >= norms.XLA_MIN_WORK) == compiled
    exact = np.einsum("btd,btp->bdp", a.astype(np.float64), g.astype(np.float64))
    err = float(norms.dot_gamma(t)) * np.einsum("btd,btp->bdp", np.abs(a), np.abs(g))
    mat = tf.function(linear.materialize)
    ein = tf.function(lambda x, y: linear.per_example_einsum("btd,btp->bdp", x, y))
    for fn in (mat, ein):
        assert _xla_compiled(fn, *specs) == compiled
        got = fn(tf.constant(a), tf.constant(g)).numpy().astype(np.float64)
        assert np.all(np.abs(got - exact) <= err)


def test_mask_values_other_than_zero_one_are_refused(rng):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    x = rng.normal(size=(2, 3)).astype("float32")
    y = rng.normal(size=(2, 1)).astype("float32")
    with pytest.raises(tf.errors.InvalidArgumentError, match="sample_weight"):
        _clipped_sum(model, MSE, x, y, np.array([2.0, 1.0], "float32"), "fast")
    # Booleans and 0/1 floats are fine.
    _clipped_sum(model, MSE, x, y, np.array([0.0, 1.0], "float32"), "fast")


def _log_model():
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, activation="relu")])


def _log_loss(y_true, y_pred):  # log(0) for a prediction of exactly 0
    return -tf.reduce_sum(tf.math.log(y_pred), axis=-1)


@pytest.mark.parametrize("method", PATHS)
def test_nonfinite_loss_with_finite_inputs_is_skipped(method):
    model = _log_model()
    model.layers[0].kernel.assign([[1.0], [1.0]])
    model.layers[0].bias.assign([0.0])
    x = np.array([[0.0, 0.0], [1.0, 2.0], [0.5, 0.5]], "float32")  # row 0: relu(0) -> log(0)
    y = np.zeros((3, 1), "float32")
    grads, sq, kept = _clipped_sum(model, _log_loss, x, y, np.ones(3, "float32"), method, "skip")
    assert kept.tolist() == [0.0, 1.0, 1.0]
    assert np.all(np.isfinite(grads)) and np.all(sq[0] == 0)
    rest, _, _ = _clipped_sum(
        model, _log_loss, x, y, np.array([0, 1, 1], "float32"), method, "skip"
    )
    np.testing.assert_allclose(grads, rest, rtol=1e-6)  # exactly zero contribution


def test_nonfinite_loss_raises_before_any_update():
    model = _log_model()
    model.layers[0].kernel.assign([[1.0], [1.0]])
    x = np.array([[0.0, 0.0], [1.0, 2.0]], "float32")
    y = np.zeros((2, 1), "float32")
    opt = dpcore.DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=C, noise_multiplier=1.0, expected_batch_size=2
    )
    before = [v.numpy() for v in model.trainable_variables]
    step = tf.function(lambda: dpcore.dp_train_step(model, _log_loss, x, y, optimizer=opt))
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"NaN/Inf \(row 0 of the batch\) although its inputs are finite",
    ):
        step()
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    assert int(opt.dp_steps.numpy()) == 0


def _round_to_tf32(x):
    """float32 values rounded to TensorFloat-32's 10 explicit mantissa bits (nearest)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x1000) & 0xFFFFE000
    return bits.astype(np.uint32).view(np.float32)


def test_dot_gamma_covers_tf32_matmuls(rng):
    """The error model of the ghost bound under TF32: inputs rounded to 2^-11, float32 sums.

    TensorFlow runs float32 matmuls in TF32 on recent GPUs; the bound then uses
    ``dot_gamma(n, input_roundoff=TF32_ROUNDOFF)``. Emulated here on the CPU, on cancelling rows.
    """
    n = 256
    x = rng.normal(size=(200, n)).astype("float32") * 1e3
    y = (-x + rng.normal(size=(200, n)).astype("float32")).astype("float32")
    exact = np.sum(x.astype(np.float64) * y.astype(np.float64), axis=1)
    tf32 = np.sum(
        _round_to_tf32(x).astype(np.float32) * _round_to_tf32(y).astype(np.float32), axis=1
    ).astype(np.float64)
    scale = np.sum(np.abs(x.astype(np.float64) * y), axis=1)
    gamma = float(norms.dot_gamma(n, input_roundoff=norms.TF32_ROUNDOFF))
    assert np.all(np.abs(tf32 - exact) <= gamma * scale)
    # The float32 model alone would not cover TF32's rounding.
    assert np.any(np.abs(tf32 - exact) > float(norms.dot_gamma(n, input_roundoff=0.0)) * scale)


def test_dp_model_logs_skipped_examples():
    # No bias: the zero input predicts relu(0) = 0, so its loss is log(0) in every epoch.
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1, use_bias=False, activation="relu")]
    )
    model.layers[0].kernel.assign([[1.0], [1.0]])
    dp_model = dpcore.make_private(
        model,
        optimizer=keras.optimizers.SGD(0.01),
        loss=_log_loss,
        l2_norm_clip=C,
        noise_multiplier=0.0,
        expected_batch_size=4,
        options=ExecutionOptions(nonfinite="skip"),
    )
    x = np.array([[0.0, 0.0], [1.0, 2.0], [0.5, 0.5], [2.0, 1.0]], "float32")  # row 0: log(0)
    y = np.zeros((4, 1), "float32")
    history = dp_model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0, 1.0]
    assert all(np.isfinite(history.history["loss"]))


@pytest.mark.parametrize("n", [0, 1, 2, 784, 3 * 128**2 + 3, 2**22, 2**23 - 1, 2**23, 2**40])
def test_static_error_terms_equal_their_traced_form(n):
    """For a static length the error terms are Python floats computed at trace time (no ops in
    the traced step); they must equal, bit for bit, what the float64 ops give for a tensor."""
    tensor_n = tf.constant(n, tf.int64)
    for roundoff in (None, 0.0):
        kwargs = {} if roundoff is None else {"input_roundoff": roundoff}
        static = norms.dot_gamma(n, **kwargs)
        assert isinstance(static, float)
        assert static == float(norms.dot_gamma(tensor_n, **kwargs).numpy())
    static = norms._sum64_inflation(n)
    assert isinstance(static, float)
    assert static == float(norms._sum64_inflation(tensor_n).numpy())
    half = n + 0.5  # a non-integer length (the bound formulas pass T^2 + 2)
    assert norms.dot_gamma(half) == float(norms.dot_gamma(tf.constant(half, tf.float64)).numpy())


def _calls(graph):
    """Names of the functions a graph calls directly (PartitionedCall ops)."""
    return [
        op.get_attr("f").name
        for op in graph.get_operations()
        if op.type in ("PartitionedCall", "StatefulPartitionedCall")
    ]


def _flush_and_overflow_operands(rng, t, d, p):
    """Operands with cancelling, flushing, huge, zero and NaN examples."""
    a = rng.normal(size=(6, t, d))
    g = rng.normal(size=(6, t, p))
    a[0, 1] = -a[0, 0] + 1e-6  # cancelling positions
    g[0, 1] = g[0, 0]
    a[1, 0] *= 2.0**64  # products that flush against position 0
    g[1, 0] = 0.0
    a[2] = np.clip(a[2], -1.0, 1.0) * 3e38  # scale above 2^126
    g[3] *= 1e-30
    a[4] = 0.0
    a[5, 3, 2] = np.nan
    return a.astype("float32"), g.astype("float32")


def test_a_shared_ghost_bound_is_the_inline_bound(rng):
    """The Gram-matrix bound of a ghost norm of ``T^2 (D + P) >= SHARED_MIN_WORK`` runs inside a
    graph as a call of one shared, non-inlined function, while the Gram matrices stay XLA-compiled
    calls of the caller's graph (nested in the shared body XLA would not compile them): bitwise
    the same bounds as the same operations inlined, on adversarial examples (NaN where the
    example holds NaN), and every finite bound covers the float64 ground truth."""
    t, d, p = 128, 40, 24
    assert t**2 * (d + p) >= norms.SHARED_MIN_WORK
    a32, g32 = _flush_and_overflow_operands(rng, t, d, p)
    specs = (tf.TensorSpec(a32.shape, tf.float32), tf.TensorSpec(g32.shape, tf.float32))
    shared = tf.function(lambda a, g: norms.ghost_sq_norm_bound(a, g, with_sum_error=True))
    inline = tf.function(lambda a, g: norms.ghost_sq_norm_bound(a, g, with_sum_error=True))
    calls = _calls(shared.get_concrete_function(*specs).graph)
    assert any("shared_gram_sq_norm_bound" in f for f in calls), calls
    assert sum("_compiled_gram" in f for f in calls) == 2, calls
    with norms.inline_bounds():
        assert not any("shared" in f for f in _calls(inline.get_concrete_function(*specs).graph))
    got = [t.numpy() for t in shared(a32, g32)]
    want = [t.numpy() for t in inline(a32, g32)]
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)
    bound = got[0]
    assert np.isnan(bound[5]) and np.all(np.isfinite(bound[:5]))
    exact = np.sum(
        np.einsum("btd,btp->bdp", a32[:5].astype(np.float64), g32[:5].astype(np.float64)) ** 2,
        (1, 2),
    )
    assert np.all(bound[:5] >= exact)


def test_repeated_bounds_share_one_body_only_in_large_programs(rng):
    """In a graph of ``SHARED_MIN_OPS`` operations or more, a bound called again with the same
    signature is a call of one shared body (the same values as inline); in a small program
    (an MLP's step) every bound stays inline, so no call overhead is added there."""
    x1 = tf.constant(rng.normal(size=(8, 300)).astype("float32"))
    x2 = tf.constant((rng.normal(size=(8, 300)) * 1e20).astype("float32"))

    def bounds(pad):
        z = tf.zeros([])
        for _ in range(pad):
            z = z + 1.0
        return norms.rows_sq_norm(x1), norms.rows_sq_norm(x2), z

    large = tf.function(lambda: bounds(norms.SHARED_MIN_OPS))
    small = tf.function(lambda: bounds(0))
    calls = _calls(large.get_concrete_function().graph)
    assert len(calls) == 1 and "shared_rows_sq_norm" in calls[0]
    assert _calls(small.get_concrete_function().graph) == []
    for got, want in zip(large()[:2], small()[:2]):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_a_shared_bound_is_retraced_when_the_matmul_roundoff_changes(rng, monkeypatch):
    """The matmul input roundoff (TF32, oneDNN bfloat16) is read when a bound is traced; a
    shared body is keyed on it, so a program traced after the setting changed gets the wider
    bound instead of the body traced before."""
    t, d, p = 128, 40, 24
    a = tf.constant(rng.normal(size=(2, t, d)).astype("float32"))
    g = tf.constant(rng.normal(size=(2, t, p)).astype("float32"))
    exact_f32 = tf.function(lambda: norms.ghost_sq_norm_bound(a, g))().numpy()
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    assert norms.matmul_input_roundoff() == norms.BF16_ROUNDOFF
    bf16 = tf.function(lambda: norms.ghost_sq_norm_bound(a, g))().numpy()
    assert np.all(bf16 > exact_f32 * (1 + 1e-3))
