"""Privacy units of several rows (``ExecutionOptions.group_size``) in the engine.

Every path (fast rules, the per-layer fallback, the vectorized whole-model path, chunked or not)
is compared with the slow exact reference :func:`dpcore.testing.reference_unit_gradients` (one
unit at a time), with padding rows, an all-padding unit, sample weights and both reductions.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpcore import engine
from dpcore.options import ExecutionOptions
from dpcore.rules import default_registry
from dpcore.testing import assert_sq_norm_bound, reference_unit_gradients
from tests.models import BUILDERS, batch_for
from tests.test_ghost import Scale  # a trainable layer without a rule

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")

RTOL = 1e-5
K = 3
UNITS = 4
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def _layout(rows):
    """Sample weights and a mask: one padding row in unit 0, the last unit all padding."""
    sw = np.linspace(0.5, 2.0, rows).astype("float32")
    mask = np.ones(rows, "float32")
    mask[1] = 0.0
    mask[-K:] = 0.0
    return sw, mask


def _summaries(model, x, y, sw, mask, weights, methods, **opts):
    out = {}
    for method in methods:
        options = ExecutionOptions(method=method, training=False, group_size=K, **opts)

        @tf.function
        def step(x, y, sw, mask, weights, options=options):
            s = engine.summarize(model, LOSS, x, y, sample_weight=sw, mask=mask, options=options)
            return s.sq_norms, s.weighted_sum(weights), s.mask, s.per_example_loss, s.row_mask

        out[method] = tf.nest.map_structure(np.asarray, step(x, y, sw, mask, weights))
    return out


def check_units(model, x, y, *, reduction="sum", methods=("fast", "vectorized"), **opts):
    """Norms (certified, tight) and clipped sums of every path match the per-unit reference."""
    rows = tf.nest.flatten(x)[0].shape[0]
    units = rows // K
    sw, mask = _layout(rows)
    ref = reference_unit_gradients(
        model, LOSS, x, y, group_size=K, group_reduction=reduction, sample_weight=sw, mask=mask
    )
    ref_sq = np.stack([np.sum(g.reshape(units, -1).astype(np.float64) ** 2, 1) for g in ref], 1)
    weights = np.random.default_rng(1).uniform(0.1, 1.0, (units, len(ref))).astype("float32")
    ref_sums = [np.tensordot(weights[:, j], g, axes=1) for j, g in enumerate(ref)]
    scale = max(np.abs(s).max() for s in ref_sums)
    got = _summaries(model, x, y, sw, mask, weights, methods, group_reduction=reduction, **opts)
    for method, (sq, sums, unit_mask, loss, row_mask) in got.items():
        assert sq.shape == ref_sq.shape, method
        assert_sq_norm_bound(sq, ref_sq, rtol=RTOL, atol=1e-7 * ref_sq.max(), err_msg=method)
        for j, (s, want) in enumerate(zip(sums, ref_sums)):
            np.testing.assert_allclose(
                s, want, rtol=RTOL, atol=1e-6 * scale, err_msg=f"{method} var {j}"
            )
        np.testing.assert_array_equal(unit_mask, [1.0] * (units - 1) + [0.0])
        np.testing.assert_array_equal(row_mask, mask)
        assert np.all(sq[-1] == 0) and loss[-1] == 0
    if len(got) > 1:
        losses = [v[3] for v in got.values()]
        np.testing.assert_allclose(losses[0], losses[1], rtol=RTOL)
    return got


@pytest.mark.parametrize("name", ["mlp", "tanh_cnn", "text", "norms", "two_input"])
def test_zoo_models_units(name, rng):
    """Dense, Conv1D/2D (ghost and offset routes), Embedding, LayerNorm, GroupNorm, two inputs."""
    model = BUILDERS[name]()
    x, y = batch_for(name, UNITS * K, rng)
    check_units(model, x, y)


def test_mean_over_real_rows(rng):
    """``group_reduction="mean"``: the unit's gradient is the average of its real rows'."""
    model = BUILDERS["norms"]()
    x, y = batch_for("norms", UNITS * K, rng)
    check_units(model, x, y, reduction="mean")


def test_einsum_dense_and_materialized_conv(rng):
    """EinsumDense with and without a position axis, a wide Conv1D on its materialized route."""
    inputs = keras.Input((5, 9))
    h = keras.layers.Conv1D(12, 2, activation="tanh")(inputs)  # C_in >= 8: offset route
    h = keras.layers.EinsumDense("abc,cd->abd", output_shape=(4, 4), bias_axes="d")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.EinsumDense("ab,bc->ac", output_shape=6, bias_axes="c")(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    x = rng.normal(size=(UNITS * K, 5, 9)).astype("float32")
    y = rng.integers(0, 3, UNITS * K)
    got = check_units(model, x, y, methods=("fast",))
    assert "fast" in got


@pytest.mark.parametrize("shape", [(5,), (2, 5), (2, 3, 5)])
def test_units_as_positions_is_the_concatenation_of_split_uses(shape, rng):
    """One use reshaped to ``[U, K, ...]`` is, after ``as_sequence``, the split uses concatenated
    along positions: the same tensor, in the same order, for two uses of a layer."""
    from dpcore.rules import linear
    from dpcore.rules.base import Use, unit_uses

    rows = UNITS * K

    def t(*dims):
        return tf.constant(rng.normal(size=(rows, *dims)).astype("float32"))

    uses = [Use(capture={"a": t(*shape), "n": 7}, grad=t(*shape[:-1], 4)) for _ in range(2)]
    split = unit_uses(uses, K)
    merged = unit_uses(uses, K, as_positions=True)
    assert len(split) == 2 * K and len(merged) == 2
    assert merged[0].capture["n"] == 7
    for key in ("a", "grad"):

        def get(u, key=key):
            return u.grad if key == "grad" else u.capture["a"]

        want = tf.concat([linear.as_sequence(get(u)) for u in split], axis=1)
        got = tf.concat([linear.as_sequence(get(u)) for u in merged], axis=1)
        assert got.shape == want.shape
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    # A rank-1 tensor (one value per row) keeps the split form.
    ranked = [Use(capture={"a": t(5), "w": t()}, grad=t(4))]
    assert len(unit_uses(ranked, K, as_positions=True)) == K


def test_dense_units_as_positions_match_split_uses(rng):
    """The Dense rule (units as positions) gives the same norms and sums as with split uses, on a
    layer applied twice to sequences and on a plain one."""
    import dataclasses

    from dpcore.rules.dense import DENSE

    inputs = keras.Input((4, 5))
    shared = keras.layers.Dense(6, activation="tanh", name="shared")
    h = shared(shared(inputs)[..., :5])
    h = keras.layers.Flatten()(h)
    model = keras.Model(inputs, keras.layers.Dense(3, name="last")(h))
    x = rng.normal(size=(UNITS * K, 4, 5)).astype("float32")
    y = rng.integers(0, 3, UNITS * K)
    assert DENSE.units_as_positions
    merged = check_units(model, x, y, methods=("fast",))["fast"]
    registry = {
        **default_registry(),
        keras.layers.Dense: dataclasses.replace(DENSE, units_as_positions=False),
    }
    split = check_units(model, x, y, methods=("fast",), registry=registry)["fast"]
    for a, b in zip(tf.nest.flatten(merged), tf.nest.flatten(split)):
        np.testing.assert_array_equal(a, b)


def test_fallback_layer_and_ungroupable_rule(rng):
    """A layer without a rule, and a rule that declines units, both take the fallback."""
    import dataclasses

    from dpcore.rules.dense import DENSE

    inputs = keras.Input((5,))
    h = Scale(name="wave")(keras.layers.Dense(6, name="first")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3, name="last")(h))
    x, y = rng.normal(size=(UNITS * K, 5)).astype("float32"), rng.integers(0, 3, UNITS * K)
    check_units(model, x, y, methods=("fast",))
    registry = {
        **default_registry(),
        keras.layers.Dense: dataclasses.replace(DENSE, groupable=False),
    }
    check_units(model, x, y, methods=("fast",), registry=registry)
    sw, mask = _layout(UNITS * K)

    @tf.function
    def paths(x, y):
        for reg in (None, registry):
            options = ExecutionOptions(method="fast", group_size=K, registry=reg)
            s = engine.summarize(model, LOSS, x, y, sample_weight=sw, mask=mask, options=options)
            found.append(dict(s.paths))
        return 0

    found: list = []
    paths(x, y)
    assert found[0]["wave"] == "fallback:vectorized"
    assert found[0]["first"] in ("ghost", "materialized")  # the Dense rule, units as positions
    assert found[0]["last"] in ("ghost", "materialized")
    assert found[1]["first"] == found[1]["last"] == "fallback:vectorized"


def test_chunked_vectorized_counts_units(rng):
    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", UNITS * K, rng)
    check_units(model, x, y, methods=("vectorized",), chunk_size=3)


def test_one_row_units_are_the_default(rng):
    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", 6, rng)
    a = engine.per_example_norms(model, LOSS, x, y)
    b = engine.per_example_norms(model, LOSS, x, y, options=ExecutionOptions(group_size=1))
    np.testing.assert_array_equal(a, b)


def test_per_unit_gradients_and_norms_entry_points(rng):
    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", UNITS * K, rng)
    sw, mask = _layout(UNITS * K)
    options = ExecutionOptions(group_size=K, training=False)
    ref = reference_unit_gradients(model, LOSS, x, y, group_size=K, sample_weight=sw, mask=mask)
    grads = engine.per_example_gradients(
        model, LOSS, x, y, sample_weight=sw, mask=mask, options=options
    )
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=1e-7)
    norms = engine.per_example_norms(
        model, LOSS, x, y, sample_weight=sw, mask=mask, options=options
    )
    ref_norms = np.sqrt(sum(np.sum(r.reshape(UNITS, -1).astype(np.float64) ** 2, 1) for r in ref))
    assert_sq_norm_bound(np.square(np.asarray(norms, np.float64)), ref_norms**2, rtol=1e-5)


def test_nonfinite_skip_drops_the_whole_unit(rng):
    """A unit whose loss overflows is dropped as a whole; other units are untouched."""
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    x, y = rng.normal(size=(UNITS * K, 4)).astype("float32"), rng.integers(0, 3, UNITS * K)
    x[4] = 3e38  # unit 1: finite input, non-finite logits
    options = ExecutionOptions(group_size=K, nonfinite="skip", training=False)

    @tf.function
    def run(x, y):
        s = engine.summarize(model, LOSS, x, y, options=options)
        return s.mask, s.row_mask, s.num_skipped, s.weighted_sum(tf.ones_like(s.sq_norms))

    unit_mask, row_mask, skipped, sums = run(x, y)
    np.testing.assert_array_equal(unit_mask, [1, 0, 1, 1])
    np.testing.assert_array_equal(row_mask, np.repeat([1, 0, 1, 1], K))
    assert float(skipped) == 1.0
    keep = np.repeat([1, 0, 1, 1], K).astype("float32")
    ref = reference_unit_gradients(model, LOSS, x * keep[:, None], y, group_size=K, mask=keep)
    for s, r in zip(sums, ref):
        np.testing.assert_allclose(s, r.sum(0), rtol=RTOL, atol=1e-6)


def test_batch_must_hold_whole_units(rng):
    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", 7, rng)
    with pytest.raises(ValueError, match="multiple of group_size"):
        engine.summarize(model, LOSS, x, y, options=ExecutionOptions(group_size=K))
    with pytest.raises(ValueError, match="group_size"):
        ExecutionOptions(group_size=0)
    with pytest.raises(ValueError, match="group_reduction"):
        ExecutionOptions(group_reduction="max")


# ------------------------------------------------------------------------ through the DP step

C = 0.5


def _linear_loss(y, y_pred):
    """A loss linear in the outputs: gradients as large as the inputs, never an overflowing loss."""
    return tf.reduce_sum(tf.cast(y, tf.float32) * y_pred, axis=-1)


def _deltas(model, before):
    return [v.numpy() - b for v, b in zip(model.trainable_variables, before)]


@pytest.mark.parametrize("method", ["fast", "vectorized"])
def test_dp_train_step_clips_units_and_divides_by_expected_units(method, rng):
    """Noise-free update == sum of per-unit clipped gradients / expected number of units."""
    from dpcore import DPOptimizer, dp_train_step
    from dpcore.testing import reference_clipped_mean

    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", UNITS * K, rng)
    sw, mask = _layout(UNITS * K)
    options = ExecutionOptions(method=method, group_size=K)
    opt = DPOptimizer(
        keras.optimizers.SGD(1.0),
        l2_norm_clip=C,
        noise_multiplier=0.0,
        expected_batch_size=3.0,
    )
    ref = reference_unit_gradients(
        model, LOSS, x, y, group_size=K, sample_weight=sw, mask=mask, training=True
    )
    want = reference_clipped_mean(ref, l2_norm_clip=C, expected_batch_size=3.0)
    before = [v.numpy() for v in model.trainable_variables]

    @tf.function
    def step(x, y, sw, mask):
        return dp_train_step(
            model, LOSS, x, y, optimizer=opt, sample_weight=sw, mask=mask, options=options
        )

    loss = step(x, y, sw, mask)
    for got, w in zip(_deltas(model, before), want):
        np.testing.assert_allclose(-got, w, rtol=RTOL, atol=1e-7)
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("method", ["fast", "vectorized"])
def test_adversarial_units_contribute_at_most_c(method, rng):
    """Huge values and rows that cancel inside a unit: each unit's clipped contribution <= C."""
    from dpcore import aggregation

    inputs = keras.Input((5, 4))  # a sequence: the ghost identity over the unit's K*5 positions
    h = keras.layers.Dense(6, name="seq")(inputs)
    h = keras.layers.Flatten()(h)
    model = keras.Model(inputs, keras.layers.Dense(3, name="out")(h))
    rows = UNITS * K
    x = rng.normal(size=(rows, 5, 4)).astype("float32")
    y = rng.normal(size=(rows, 3)).astype("float32")
    x[0:K] *= np.float32(1e17)  # unit 0: huge (squares overflow float32)
    x[K + 1] = -x[K] * np.float32(1 + 2**-20)  # unit 1: two rows that almost cancel
    x[2 * K + 1] = -x[2 * K]  # unit 2: rows that cancel exactly (same labels)
    y[K + 1], y[2 * K + 1] = y[K], y[2 * K]
    x[3 * K :] *= np.float32(1e-30)  # unit 3: tiny (flushes to zero when squared)
    options = ExecutionOptions(method=method, group_size=K)

    @tf.function
    def contribution(x, y, mask):
        s = engine.summarize(model, _linear_loss, x, y, mask=mask, options=options)
        clipped = aggregation.clip(s, l2_norm_clip=C)
        return tf.sqrt(sum(tf.reduce_sum(tf.cast(g, tf.float64) ** 2) for g in clipped.grads))

    ref = reference_unit_gradients(model, _linear_loss, x, y, group_size=K)
    for u in range(UNITS):
        mask = np.zeros(rows, "float32")
        mask[u * K : (u + 1) * K] = 1.0
        norm = float(contribution(x, y, mask))
        assert norm <= C * (1 + aggregation.CONTRIBUTION_TOLERANCE), (u, norm)
        exact = np.sqrt(sum(np.sum(g[u].astype(np.float64) ** 2) for g in ref))
        if exact > 2 * C:  # a unit far above the bound is clipped to (almost) exactly C
            assert norm >= C * (1 - 1e-3), (u, norm, exact)


def _fit_once(model, x, y, **kw):
    """One noise-free ``make_private(...).fit`` step on the whole batch: (weight deltas, logs)."""
    from dpcore import make_private

    before = [v.numpy() for v in model.trainable_variables]
    dp_model = make_private(
        model,
        optimizer=keras.optimizers.SGD(1.0),
        loss=LOSS,
        l2_norm_clip=C,
        noise_multiplier=0.0,
        expected_batch_size=kw.pop("expected_batch_size", len(x)),
        **kw,
    )
    history = dp_model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    return _deltas(model, before), history.history


def test_make_private_fit_with_units(rng):
    """``make_private(..., options=ExecutionOptions(group_size=K)).fit`` on unit-aligned batches."""
    from dpcore.testing import reference_clipped_mean

    model = BUILDERS["mlp"]()
    x, y = batch_for("mlp", UNITS * K, rng)
    ref = reference_unit_gradients(model, LOSS, x, y, group_size=K, training=True)
    want = reference_clipped_mean(ref, l2_norm_clip=C, expected_batch_size=UNITS)
    got, logs = _fit_once(
        model,
        x,
        y,
        metrics=["accuracy"],
        expected_batch_size=UNITS,
        options=ExecutionOptions(group_size=K),
        sampling="shuffle",  # Keras's fixed unit-aligned batch (Poisson units: unit_batches)
    )
    for g, w in zip(got, want):
        np.testing.assert_allclose(-g, w, rtol=RTOL, atol=1e-7)
    assert np.isfinite(logs["loss"][0]) and "accuracy" in logs


# ---------------------------------------------------------------- augmentation multiplicity


def test_identity_views_give_the_single_view_update(rng):
    """K identical views averaged: exactly the single-view clipped update."""
    x, y = batch_for("mlp", 6, rng)
    model = BUILDERS["mlp"]()
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    single, _ = _fit_once(model, x, y)
    views, _ = _fit_once(twin, x, y, augmentations=4, augment_fn=lambda t: t)
    # Float32 round-off is relative to the update's overall scale (entries that nearly cancel).
    scale = max(np.abs(b).max() for b in single)
    for a, b in zip(views, single):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6 * scale)


def test_views_are_averaged_then_clipped(rng):
    """With distinct views the example's gradient is the mean over its views, clipped once."""
    from dpcore.testing import reference_clipped_mean

    k = 3
    x, y = batch_for("mlp", 5, rng)
    scales = np.float32(1.0) + np.float32(0.5) * np.arange(k, dtype=np.float32)

    def augment(t):  # view v of every example scaled by 1 + v/2
        view = tf.range(tf.shape(t)[0]) % k
        return t * tf.gather(tf.constant(scales), view)[:, None]

    model = BUILDERS["mlp"]()
    xv = np.repeat(x, k, axis=0) * np.tile(scales, len(x))[:, None]
    ref = reference_unit_gradients(
        model, LOSS, xv, np.repeat(y, k), group_size=k, group_reduction="mean", training=True
    )
    want = reference_clipped_mean(ref, l2_norm_clip=C, expected_batch_size=len(x))
    got, _ = _fit_once(model, x, y, augmentations=k, augment_fn=augment)
    for g, w in zip(got, want):
        np.testing.assert_allclose(-g, w, rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize(
    "name, augment",
    [
        ("batch centring", lambda t: t - tf.reduce_mean(t, 0, keepdims=True)),
        ("roll over the batch", lambda t: tf.roll(t, 3, axis=0)),
        ("mixup with the reversed batch", lambda t: 0.8 * t + 0.2 * tf.reverse(t, [0])),
    ],
)
def test_an_augment_fn_that_mixes_examples_is_refused(name, augment, rng):
    """augment_fn makes the K views of each example from the repeated batch; one whose views of
    an example depend on other examples' rows let one example move every other example's clipped
    gradient (batch centring: the update moved by 4.6 C when one example was added). fit refuses
    it before any step; functions of each row (and of the view index) pass."""
    x, y = batch_for("mlp", 6, rng)
    model = BUILDERS["mlp"]()
    before = [v.numpy().copy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match="augment_fn mixes examples"):
        _fit_once(model, x, y, augmentations=3, augment_fn=augment)
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_row_wise_augment_fns_pass_the_mixing_check():
    from dpcore.model import check_augment_fn_rows

    spec = tf.TensorSpec([None, 4, 4, 1], tf.float32)
    k = 4
    view = lambda t: tf.range(tf.shape(t)[0]) % k  # noqa: E731
    for augment in (
        lambda t: t,
        lambda t: tf.image.flip_left_right(t),
        lambda t: t * tf.cast(1 + view(t), t.dtype)[:, None, None, None],
        lambda t: tf.nn.relu(t) + tf.random.normal(tf.shape(t)),
        lambda t: tf.where(t > 0, t, 0.1 * t),
    ):
        check_augment_fn_rows(augment, spec, k)
    with pytest.raises(ValueError, match="mixes examples"):
        check_augment_fn_rows(lambda t: t - tf.reduce_mean(t, 0), spec, k)


def test_augmentations_are_checked():
    from dpcore import DPModel

    model = BUILDERS["mlp"]()
    with pytest.raises(ValueError, match="augmentations"):
        DPModel(model, augmentations=0)
    with pytest.raises(ValueError, match="group_size"):
        DPModel(model, augmentations=2, options=ExecutionOptions(group_size=2))


def test_fit_on_arrays_refuses_a_layout_that_mixes_units(rng):
    from dpcore import make_private

    x, y = batch_for("mlp", UNITS * K, rng)
    dp_model = make_private(
        BUILDERS["mlp"](),
        optimizer=keras.optimizers.SGD(1.0),
        loss=LOSS,
        l2_norm_clip=C,
        noise_multiplier=0.0,
        expected_batch_size=UNITS,
        options=ExecutionOptions(group_size=K),
        sampling="shuffle",
    )
    with pytest.raises(ValueError, match="shuffle=False"):
        dp_model.fit(x, y, batch_size=UNITS * K, verbose=0)  # Keras shuffles rows by default
    with pytest.raises(ValueError, match="batch_size=4"):  # not the 12 rows of 4 units
        dp_model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    # fit's own Poisson sampler draws single rows: units on arrays are refused there.
    poisson = make_private(
        BUILDERS["mlp"](),
        optimizer=keras.optimizers.SGD(1.0),
        loss=LOSS,
        l2_norm_clip=C,
        noise_multiplier=0.0,
        expected_batch_size=UNITS,
        options=ExecutionOptions(group_size=K),
    )
    with pytest.raises(ValueError, match="group_size=.*unit_batches"):
        poisson.fit(x, y, verbose=0)
