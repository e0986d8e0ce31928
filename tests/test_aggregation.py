"""Clipping and noise aggregation: bounds, sensitivity, noise scale, reproducibility."""

import dataclasses
import math

import numpy as np
import pytest
import tensorflow as tf

from dpcore import aggregation
from dpcore.engine.summary import GradientSummary


def _summary(per_example):
    """A GradientSummary over explicit per-example gradients (list of [B, ...] arrays)."""
    grads = [tf.constant(g, tf.float32) for g in per_example]
    b = grads[0].shape[0]
    sq = tf.stack([tf.reduce_sum(tf.reshape(g * g, [b, -1]), 1) for g in grads], 1)

    def weighted_sum(w):
        return [tf.tensordot(w[:, v], g, axes=1) for v, g in enumerate(grads)]

    return GradientSummary(
        variables=tuple(range(len(grads))),
        sq_norms=sq,
        per_example_loss=tf.zeros([b]),
        mask=tf.ones([b]),
        y_pred=None,
        weighted_sum=weighted_sum,
    )


def test_flat_clipping_bounds_each_example(rng):
    per_example = [rng.normal(size=(8, 3, 2)) * 5, rng.normal(size=(8, 4))]
    s = _summary(per_example)
    clipped = aggregation.clip(s, l2_norm_clip=1.5)
    w = clipped.clip_weights.numpy()
    norms = np.sqrt(sum(np.sum(g.reshape(8, -1) ** 2, 1) for g in per_example))
    assert np.all(norms * w[:, 0] <= 1.5 + 1e-5)
    np.testing.assert_allclose(w[:, 0], np.minimum(1, 1.5 / norms), rtol=1e-6)
    assert clipped.l2_sensitivity == 1.5
    expected = [np.tensordot(w[:, 0], g, axes=1) for g in per_example]
    for a, b in zip(clipped.grads, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_per_group_clipping_sensitivity_and_bounds(rng):
    per_example = [rng.normal(size=(6, 5)) * 3, rng.normal(size=(6, 2)), rng.normal(size=(6, 4))]
    s = _summary(per_example)
    clipped = aggregation.clip(s, l2_norm_clip=[0.5, 2.0], variable_groups=[0, 1, 0])
    assert clipped.l2_sensitivity == pytest.approx(math.sqrt(0.25 + 4.0))
    w = clipped.clip_weights.numpy()
    g0 = np.sqrt(np.sum(per_example[0] ** 2, 1) + np.sum(per_example[2] ** 2, 1))
    g1 = np.sqrt(np.sum(per_example[1] ** 2, 1))
    assert np.all(g0 * w[:, 0] <= 0.5 + 1e-5) and np.all(g1 * w[:, 1] <= 2.0 + 1e-5)
    np.testing.assert_allclose(w[:, 0], w[:, 2])
    with pytest.raises(ValueError, match="variable_groups"):
        aggregation.clip(s, l2_norm_clip=[0.5, 2.0], variable_groups=[0, 0, 0])


def test_masked_examples_contribute_nothing(rng):
    per_example = [rng.normal(size=(4, 3))]
    s = _summary(per_example)
    s = GradientSummary(**{**s.__dict__, "mask": tf.constant([1.0, 0.0, 1.0, 0.0])})
    clipped = aggregation.clip(s, l2_norm_clip=100.0)
    np.testing.assert_allclose(clipped.grads[0], per_example[0][0] + per_example[0][2], rtol=1e-5)
    assert float(clipped.num_examples) == 2.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(l2_norm_clip=0.0, noise_multiplier=1.0, expected_batch_size=4), "l2_norm_clip"),
        (dict(l2_norm_clip=-1.0, noise_multiplier=1.0, expected_batch_size=4), "l2_norm_clip"),
        (dict(l2_norm_clip=1.0, noise_multiplier=-0.1, expected_batch_size=4), "noise_multiplier"),
        (
            dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=0),
            "expected_batch_size",
        ),
        (dict(l2_norm_clip=1.0, noise_multiplier=float("inf"), expected_batch_size=4), "noise"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=float("inf")), "batch"),
        (dict(l2_norm_clip=float("inf"), noise_multiplier=1.0, expected_batch_size=4), "clip"),
        (dict(l2_norm_clip=[1.0, float("nan")], noise_multiplier=0.0, expected_batch_size=4), "cl"),
    ],
)
def test_bad_privacy_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        aggregation.check_privacy_args(**kwargs)


def test_an_infinite_bound_is_only_for_non_private_runs():
    aggregation.check_privacy_args(
        l2_norm_clip=float("inf"), noise_multiplier=0.0, expected_batch_size=4
    )  # no clipping, no noise: accepted (it claims no privacy)


def test_noise_std_and_normalization():
    zeros = aggregation.ClippedSum(
        grads=(tf.zeros([200, 100]),),
        l2_sensitivity=0.7,
        num_examples=tf.constant(0.0),
        per_example_norms=tf.zeros([0]),
        clip_weights=tf.zeros([0, 1]),
        per_example_loss=tf.zeros([0]),
    )
    out = aggregation.privatize(
        zeros, noise_multiplier=1.3, expected_batch_size=10.0, seed=tf.constant([1, 2])
    )[0].numpy()
    expected = 1.3 * 0.7 / 10.0
    # 20000 draws: the sample std is within ~1% (5 sigma ~ 2.5%) of the true std.
    assert abs(out.std() / expected - 1) < 0.025
    assert abs(out.mean()) < 5 * expected / math.sqrt(out.size)
    again = aggregation.privatize(
        zeros, noise_multiplier=1.3, expected_batch_size=10.0, seed=tf.constant([1, 2])
    )[0].numpy()
    other = aggregation.privatize(
        zeros, noise_multiplier=1.3, expected_batch_size=10.0, seed=tf.constant([1, 3])
    )[0].numpy()
    np.testing.assert_array_equal(out, again)
    assert not np.allclose(out, other)


def _sum_of_two(grads):
    """A clipped sum of two examples (bound 1) with the given per-variable sums."""
    return aggregation.ClippedSum(
        grads=tuple(grads),
        l2_sensitivity=1.0,
        num_examples=tf.constant(2.0),
        per_example_norms=tf.ones([2]),
        clip_weights=tf.ones([2, len(grads)]),
        per_example_loss=tf.zeros([2]),
    )


def test_pre_drawn_noise_must_match_the_gradients():
    """A draw made for other variables is refused rather than applied: with fewer tensors a
    variable would get no noise; with a scalar where a vector is expected, one noise value would
    be broadcast over every coordinate."""
    grads = [tf.ones([3]), tf.ones([2, 2])]
    s = _sum_of_two(grads)
    seed = tf.constant([1, 2])
    good = aggregation.standard_normal(grads, seed=seed)
    out = aggregation.privatize(
        s, noise_multiplier=1.0, expected_batch_size=2.0, seed=seed, unit_noise=good
    )
    want = aggregation.privatize(s, noise_multiplier=1.0, expected_batch_size=2.0, seed=seed)
    for a, b in zip(out, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    bad_draws = {
        "fewer": good[:1],
        "scalar": [tf.zeros([]), good[1]],
        "swapped": good[::-1],
        "transposed": [good[0], tf.transpose(tf.reshape(good[1], [2, 2]))[:, :1]],
    }
    for bad in bad_draws.values():
        with pytest.raises(ValueError, match="same variables"):
            aggregation.privatize(
                s, noise_multiplier=1.0, expected_batch_size=2.0, seed=seed, unit_noise=bad
            )
        with pytest.raises(ValueError, match="same variables"):  # the tensor-sigma path too
            aggregation.privatize(
                s,
                noise_multiplier=tf.constant(1.0),
                expected_batch_size=2.0,
                seed=seed,
                unit_noise=bad,
            )


@pytest.mark.parametrize("sigma", [float("nan"), -1.0, float("inf")])
def test_a_tensor_noise_multiplier_that_is_not_finite_and_non_negative_fails_the_step(sigma):
    """A σ tensor is read when the step runs (a variable restored from a checkpoint was never
    checked by a setter): NaN or a negative σ would mean std 0, an un-noised release, so the step
    fails instead, eagerly and in a graph. σ = 0 (a non-private run) still passes."""
    s = _sum_of_two([tf.ones([3])])

    def run(value):
        return aggregation.privatize(
            s, noise_multiplier=value, expected_batch_size=1.0, seed=tf.constant([1, 2])
        )

    with pytest.raises(tf.errors.InvalidArgumentError, match="finite and >= 0"):
        run(tf.constant(sigma))
    with pytest.raises(tf.errors.InvalidArgumentError, match="finite and >= 0"):
        tf.function(run)(tf.constant(sigma))
    np.testing.assert_array_equal(run(tf.constant(0.0))[0].numpy(), [1.0, 1.0, 1.0])
    # XLA drops assertions: there the release must be NaN, never the un-noised sum.
    try:
        out = tf.function(run, jit_compile=True)(tf.constant(sigma))[0].numpy()
    except tf.errors.InvalidArgumentError:
        pass
    else:
        assert np.all(np.isnan(out)) or (sigma == float("inf") and not np.any(np.isfinite(out)))


@pytest.mark.parametrize(
    "clip, sigma",
    [(1e-36, 1.0), (2.0**-41, 1.0), (1.0, 2.0**-41), ([2.0**-42, 2.0**-42], 1.0), (2.0**127, 3.0)],
)
def test_a_noise_std_that_float32_flushes_to_zero_or_overflows_is_refused(clip, sigma):
    """CPU kernels flush float32 subnormals to zero: with σ C near 2^-126 a noise value z σ C
    below 2^-126 was exactly 0 and the release the clipped sum without noise (1 % of steps at
    C = 2^-120); σ C above float32's range made the noise infinite. σ C must lie in
    [2^-40, 2^100] (σ = 0, a non-private run, takes any bound)."""
    kw = {"expected_batch_size": 1.0}
    with pytest.raises(ValueError, match=r"noise std of .* outside \[2\^-40, 2\^100\]"):
        aggregation.check_privacy_args(l2_norm_clip=clip, noise_multiplier=sigma, **kw)
    aggregation.check_privacy_args(l2_norm_clip=clip, noise_multiplier=0.0, **kw)
    limits = (aggregation.MIN_NOISE_STDDEV, aggregation.MAX_NOISE_STDDEV)
    for c in limits:
        aggregation.check_privacy_args(l2_norm_clip=c, noise_multiplier=1.0, **kw)


@pytest.mark.parametrize(
    "bound, sigma", [(2.0**-120, 1.0), (1.0, 1e-13), (2.0**-130, 1.0), (1e10, 1e21)]
)
def test_a_noise_std_out_of_range_when_the_step_runs_fails_the_step(bound, sigma):
    """A σ or bound read when the step runs (restored from a checkpoint, so never checked by a
    setter) whose noise std would flush to zero (below 2^-40) or overflow (above 2^100) fails
    the step, eagerly and in a graph; under XLA, which drops assertions, the release is NaN."""
    s = dataclasses.replace(_sum_of_two([tf.fill([64], 2.0**-100)]), l2_sensitivity=bound)

    def run(sigma, bound=bound):
        clipped = dataclasses.replace(s, l2_sensitivity=bound)
        return aggregation.privatize(
            clipped, noise_multiplier=sigma, expected_batch_size=1.0, seed=tf.constant([1, 2])
        )

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"noise std .* 0 or within"):
        run(tf.constant(sigma))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"noise std .* 0 or within"):
        tf.function(run)(tf.constant(sigma))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"noise std .* 0 or within"):
        run(sigma, tf.constant(bound, tf.float64))  # a tensor bound, a Python σ
    np.testing.assert_array_equal(run(tf.constant(0.0))[0].numpy(), np.full(64, 2.0**-100))
    out = tf.function(run, jit_compile=True)(tf.constant(sigma))[0].numpy()
    assert np.all(np.isnan(out))


def test_zero_noise_is_the_clipped_mean():
    s = aggregation.ClippedSum(
        grads=(tf.constant([2.0, 4.0]),),
        l2_sensitivity=float("inf"),
        num_examples=tf.constant(2.0),
        per_example_norms=tf.zeros([2]),
        clip_weights=tf.ones([2, 1]),
        per_example_loss=tf.zeros([2]),
    )
    out = aggregation.privatize(s, noise_multiplier=0.0, expected_batch_size=2.0, seed=[0, 0])
    np.testing.assert_allclose(out[0], [1.0, 2.0])


def _documented_draw(seed, n, g):
    """``n`` values of group ``g``'s stream as the docstrings state it, written out again (in
    NumPy for the bits, TensorFlow for the transcendental functions)."""
    half = (n + 1) // 2
    s = tf.random.experimental.stateless_fold_in(tf.cast(seed, tf.int64), tf.constant(g, tf.int64))
    bits = tf.random.stateless_uniform(
        [3, half], seed=s, dtype=tf.int32, minval=None, maxval=None
    ).numpy()
    high, low, angle_bits = bits.view(np.uint32)
    top = (high >> 8).astype(np.float32)
    rest = (
        (high & 255).astype(np.float32) * np.float32(2.0**32)
        + low.astype(np.float32)
        + np.float32(1.0)
    )
    w = np.minimum((top + rest * np.float32(2.0**-40)) * np.float32(2.0**-24), 1 - 2**-24)
    radius = tf.sqrt(-2.0 * tf.math.log(tf.constant(w.astype(np.float32))))
    angle = tf.constant(
        ((angle_bits >> 8).astype(np.float32) + np.float32(0.5))
        * np.float32(2.0 * math.pi * 2.0**-24)
    )
    return tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], 0).numpy()[:n]


def test_no_two_steps_share_a_noise_key():
    """Each noise group of step ``t`` is keyed by ``[r_t, g]`` with ``r_t`` a draw from the step
    seed ``fold_in(noise_seed, t)`` (the stream ``_documented_draw`` writes out, which the
    seeding test holds ``standard_normal`` to). ``r_t`` is 64 bits: as an int32, two of 200,000
    steps shared their whole noise draw with probability 0.99 (4.7 pairs expected), and the
    difference of two such releases is noise-free."""
    noise_seed = tf.constant([123456789, -987654321], tf.int64)
    steps = tf.range(200_000, dtype=tf.int64)

    @tf.function
    def keys(ts):
        def one(t):
            step_seed = tf.random.experimental.stateless_fold_in(noise_seed, t)
            group_seed = tf.random.experimental.stateless_fold_in(
                step_seed, tf.constant(0, tf.int64)
            )
            return group_seed[0]

        return tf.map_fn(one, ts, fn_output_signature=tf.int64, parallel_iterations=64)

    r = keys(steps).numpy()
    assert np.unique(r).size == r.size
    assert np.abs(r).max() > 2**40  # 64-bit keys, not int32 values widened


def test_noise_support_reaches_9_4_standard_deviations():
    """Box-Muller's radius ``sqrt(-2 log w)`` is bounded by the smallest ``w`` its uniform bits can
    give. With 23-bit uniforms (``tf.random.stateless_uniform`` float32) that was 5.65, a support
    so narrow that outputs a neighbouring dataset cannot produce had about 2e-4 probability per
    step (PRIVACY.md). The radius now takes 64 bits: all-zero bits give NOISE_RADIUS_MAX = 9.42,
    all-one bits the smallest radius 2^-11.5 (never 0: a zero value would release its coordinate
    without noise), and no bit pattern gives NaN, Inf or a radius outside [2^-11.5, 9.42]."""
    r_max = aggregation.NOISE_RADIUS_MAX
    assert abs(r_max - math.sqrt(128 * math.log(2))) < 1e-12 and r_max > 9.4
    edge = np.array(
        [0, 1, 255, 256, 2**8 - 1, 2**24, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1], np.uint64
    ).astype(np.uint32)
    rng = np.random.default_rng(0)
    high = np.concatenate([np.repeat(edge, edge.size), rng.integers(0, 2**32, 10000)])
    low = np.concatenate([np.tile(edge, edge.size), rng.integers(0, 2**32, 10000)])
    as_int32 = lambda b: tf.constant(np.asarray(b, np.uint32).view(np.int32))  # noqa: E731
    radius, angle = aggregation._polar_from_bits(as_int32(high), as_int32(low), as_int32(high))
    radius, angle = radius.numpy(), angle.numpy()
    assert np.all(np.isfinite(radius)) and np.all(np.isfinite(angle))
    smallest = math.sqrt(-2.0 * math.log1p(-(2.0**-24)))  # 2^-11.5
    assert radius.min() >= np.float32(smallest) * (1 - 2**-20)
    assert radius.max() <= np.float32(r_max) * (1 + 2**-22)
    assert angle.min() > 0.0 and angle.max() < np.float32(2 * math.pi) * (1 + 2**-22)
    # All-zero radius bits: w = 2^-64. All-one bits: w = 1 - 2^-24, not 1.
    np.testing.assert_allclose(radius[0], r_max, rtol=1e-6)
    np.testing.assert_allclose(radius[edge.size * edge.size - 1], smallest, rtol=1e-3)
    # The radius is the float64 formula of the 64-bit integer, up to float32 roundings: the tail
    # where w is tiny (high < 2^8) is as fine as the rest.
    k = high.astype(np.float64) * 2.0**32 + low.astype(np.float64)
    want = np.sqrt(-2.0 * np.log(np.minimum((k + 1.0) * 2.0**-64, 1 - 2**-24)))
    tail = high < 2**8
    np.testing.assert_allclose(radius[tail], want[tail], rtol=1e-6)
    np.testing.assert_allclose(radius, want, rtol=1e-3, atol=1e-3)


def test_no_noise_value_is_exactly_zero():
    """A noise value of exactly 0 releases its coordinate of the clipped sum without noise. Before,
    the angle bits 0 gave sine 0 (2^-24 of the pairs) and a float32 ``w`` rounded to 1 gave radius
    0 (2^-25 of them): about 2 % of a 500k-weight model's steps released one coordinate
    un-noised. Every one of the 2^24 angles has a non-zero sine and cosine, and the radius bits
    that rounded ``w`` to 1 give a non-zero radius; so no bit pattern gives a 0."""
    top = np.arange(2**24, dtype=np.uint32) << np.uint32(8)
    ones = np.full(top.size, 2**32 - 1, np.uint32)
    as_int32 = lambda b: tf.constant(np.asarray(b, np.uint32).view(np.int32))  # noqa: E731
    radius, angle = aggregation._polar_from_bits(as_int32(ones), as_int32(ones), as_int32(top))
    assert np.all(radius.numpy() > 0.0)
    assert np.all(tf.sin(angle).numpy() != 0.0) and np.all(tf.cos(angle).numpy() != 0.0)
    # The bits that used to round w to 1 (top 24 bits all ones, then t >= 1/2), and their draw.
    high = np.full(4, 2**32 - 1, np.uint32)
    low = np.array([2**31, 2**31 + 7, 2**32 - 2, 2**32 - 1], np.uint32)
    radius, _ = aggregation._polar_from_bits(as_int32(high), as_int32(low), as_int32(np.zeros(4)))
    assert np.all(radius.numpy() > 0.0)
    z = aggregation._box_muller(8, seed=tf.constant([1, 2], tf.int64)).numpy()
    assert np.all(z != 0.0)


@pytest.mark.parametrize("seed", [[5, 6], [-3, 2**40]], ids=["int32", "int64"])
@pytest.mark.parametrize("cap", [None, 16], ids=["one_group", "cap16"])
def test_standard_normal_follows_the_documented_seeding(seed, cap, monkeypatch):
    """A step's draw is, bit for bit, the documented stream, eagerly and in a graph: tensors in
    groups of consecutive tensors of at most ``NOISE_GROUP_ELEMENTS`` elements (a larger one
    alone); group ``g`` is Box-Muller (cosine half, then sine half) of the Philox bits
    ``stateless_uniform([3, ceil(n / 2)], seed=fold_in(seed, g), dtype=int32)``, cut into its tensors in
    order. A stated stream that other code (and users reproducing a run) can rely on."""
    if cap is not None:
        monkeypatch.setattr(aggregation, "NOISE_GROUP_ELEMENTS", cap)
    seed = tf.constant(seed, tf.int64 if max(map(abs, seed)) >= 2**31 else tf.int32)
    like = [tf.zeros([3, 5]), tf.zeros([4]), tf.zeros([]), tf.zeros([2, 0]), tf.zeros([5, 5])]
    # Sizes 15, 4, 1, 0, 25: one group without a cap; with 16: {15}, {4, 1, 0}, {25}.
    groups = [[0, 1, 2, 3, 4]] if cap is None else [[0], [1, 2, 3], [4]]
    assert aggregation.noise_groups([15, 4, 1, 0, 25]) == groups
    want = {}
    for g, members in enumerate(groups):
        sizes = [int(np.prod(like[j].shape)) for j in members]
        z = _documented_draw(seed, sum(sizes), g)
        for j, piece in zip(members, np.split(z, np.cumsum(sizes)[:-1])):
            want[j] = piece.reshape(like[j].shape)
    eager = aggregation.standard_normal(like, seed=seed)
    graph = tf.function(lambda s: aggregation.standard_normal(like, seed=s))(seed)
    for j in range(len(like)):
        np.testing.assert_array_equal(eager[j].numpy(), want[j])
        np.testing.assert_array_equal(graph[j].numpy(), want[j])


def test_noise_groups_are_consecutive_and_capped():
    """Every tensor is in exactly one group, in order; a group exceeds the cap only when it is a
    single tensor; a tensor starts a new group only when the current one could not take it."""
    cap = aggregation.NOISE_GROUP_ELEMENTS
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = [int(v) for v in rng.choice([0, 1, 7, cap // 3, cap // 2, cap, 2 * cap], 12)]
        groups = aggregation.noise_groups(sizes)
        assert [j for members in groups for j in members] == list(range(len(sizes)))
        totals = [sum(sizes[j] for j in members) for members in groups]
        for members, total in zip(groups, totals):
            assert total <= cap or len(members) == 1
        for k in range(1, len(groups)):
            assert totals[k - 1] + sizes[groups[k][0]] > cap
    assert aggregation.noise_groups([]) == []


def test_standard_normal_is_standard_normal():
    """The noise draw (Box-Muller on Philox uniforms) against N(0, 1): shape, moments, tails,
    the Kolmogorov-Smirnov distance, and no correlation between the halves of a pair, between
    variables of one step or between steps. Every threshold is a 5-sigma (or smaller) band."""
    from scipy import stats

    # 1,101,100 values: more than NOISE_GROUP_ELEMENTS, so the first tensor is a group alone and
    # its values are one whole Box-Muller draw (cosine half, then sine half).
    big = [1100, 1001]
    assert big[0] * big[1] > aggregation.NOISE_GROUP_ELEMENTS
    like = [tf.zeros(big), tf.zeros([7]), tf.zeros([]), tf.zeros([0, 3])]
    draws = aggregation.standard_normal(like, seed=tf.constant([5, 6]))
    assert [d.shape for d in draws] == [t.shape for t in like]
    assert all(d.dtype == tf.float32 for d in draws)
    z = draws[0].numpy().astype(np.float64).ravel()
    n = z.size
    assert np.all(np.isfinite(z)) and np.abs(z).max() <= aggregation.NOISE_RADIUS_MAX
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / n)
    assert abs(stats.skew(z)) < 5 * math.sqrt(6 / n)
    assert abs(stats.kurtosis(z)) < 5 * math.sqrt(24 / n)
    p4 = 2 * stats.norm.sf(4.0)  # 6.3e-5: about 63 values beyond 4 sigma
    beyond = np.sum(np.abs(z) > 4.0)
    assert abs(beyond - n * p4) < 5 * math.sqrt(n * p4)
    assert stats.kstest(z, "norm").statistic < 1.63 / math.sqrt(n) * 2  # p ~ 1e-9 band
    half = n // 2  # the cosine and sine halves of each Box-Muller pair
    assert abs(np.corrcoef(z[:half], z[half : 2 * half])[0, 1]) < 5 / math.sqrt(half)
    assert abs(np.corrcoef(z[:half] ** 2, z[half : 2 * half] ** 2)[0, 1]) < 5 / math.sqrt(half)
    other_var = aggregation.standard_normal([tf.zeros(big)] * 2, seed=tf.constant([5, 6]))
    other_step = aggregation.standard_normal(like[:1], seed=tf.constant([5, 7]))[0].numpy()
    np.testing.assert_array_equal(other_var[0].numpy().ravel(), z.astype(np.float32))
    for w in (other_var[1].numpy().ravel(), other_step.ravel()):
        assert abs(np.corrcoef(z, w)[0, 1]) < 5 / math.sqrt(n)
    assert draws[1].shape == (7,) and np.isfinite(draws[2].numpy())
