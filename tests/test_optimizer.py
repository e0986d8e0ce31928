"""DPOptimizer and the custom-loop DP step, checked against plain Keras steps and references."""

import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpcore import aggregation
from dpcore.optimizer import DPOptimizer
from dpcore.options import ExecutionOptions
from dpcore.step import dp_step, dp_train_step
from dpcore.testing import (
    reference_clipped_mean,
    reference_input_gradients,
    reference_per_example_gradients,
)
from tests.helpers import make_opt, weights
from tests.models import small_mlp

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batch(rng, b=6, d=5, classes=3, scale=1.0):
    x = (scale * rng.normal(size=(b, d))).astype("float32")
    return x, rng.integers(0, classes, b).astype("int32")


def step_fn(model, opt, **kw):
    @tf.function
    def step(x, y, mask=None, step_end=None):
        return dp_train_step(model, LOSS, x, y, optimizer=opt, mask=mask, step_end=step_end, **kw)

    return step


def test_custom_loop_step_is_traced_as_written(rng):
    """Inside a user's ``tf.function`` (AutoGraph on, the default), the DP step is not rewritten
    by AutoGraph, as in ``fit``: no operation of the traced step was created by converted code,
    and the step still trains (one clipped, noiseless SGD step matches the reference)."""
    model = small_mlp()
    opt = make_opt()
    opt.build(model.trainable_variables)
    x, y = batch(rng)
    step = step_fn(model, opt)
    graph = step.get_concrete_function(tf.constant(x), tf.constant(y)).graph
    converted = [
        op.name
        for op in graph.get_operations()
        if any("__autograph_generated" in frame.filename for frame in op.traceback)
    ]
    assert not converted, converted[:5]
    grads = reference_per_example_gradients(model, LOSS, x, y)
    mean = reference_clipped_mean(grads, l2_norm_clip=1.0, expected_batch_size=6)
    want = [w - g for w, g in zip(weights(model), mean)]
    step(tf.constant(x), tf.constant(y))
    for got, expected in zip(weights(model), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize(
    "kw, name",
    [
        ({"l2_norm_clip": 0.0}, "l2_norm_clip"),
        ({"l2_norm_clip": -1.0}, "l2_norm_clip"),
        ({"noise_multiplier": -0.5}, "noise_multiplier"),
        ({"expected_batch_size": 0}, "expected_batch_size"),
        ({"accumulation_steps": 0}, "accumulation_steps"),
        ({"noise_multiplier": math.inf}, "noise_multiplier"),
        ({"noise_multiplier": math.nan}, "noise_multiplier"),
        ({"expected_batch_size": math.inf}, "expected_batch_size"),
        ({"l2_norm_clip": math.nan}, "l2_norm_clip"),
        ({"l2_norm_clip": math.inf, "noise_multiplier": 1.0}, "l2_norm_clip"),
    ],
)
def test_bad_privacy_args_name_argument_and_value(kw, name):
    with pytest.raises(ValueError, match=name) as err:
        make_opt(**kw)
    assert repr(list(kw.values())[0]) in str(err.value) or str(list(kw.values())[0]) in str(
        err.value
    )


def test_refuses_inner_gradient_accumulation_and_says_what_to_do():
    inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match=r"accumulation_steps=4"):
        make_opt(inner)


@pytest.mark.parametrize(
    "inner",
    [
        lambda: keras.optimizers.SGD(0.1, loss_scale_factor=128.0),
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
        lambda: make_opt(),
    ],
)
def test_refuses_inner_settings_that_rescale_or_double_noise(inner):
    with pytest.raises(ValueError):
        make_opt(inner())


def test_base_arguments_belong_on_inner_optimizer():
    with pytest.raises(ValueError, match="clipnorm"):
        make_opt(clipnorm=1.0)


def test_inner_clipnorm_warns_but_is_accepted():
    with pytest.warns(UserWarning, match="post-processing"):
        make_opt(keras.optimizers.SGD(0.1, clipnorm=1.0))


def test_raw_gradients_are_refused(rng):
    model = small_mlp()
    opt = make_opt()
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    with pytest.raises(ValueError, match="dp_train_step"):
        opt.apply_gradients(zip(grads, model.trainable_variables))
    with pytest.raises(ValueError, match="make_private"):
        opt.apply(grads, model.trainable_variables)


def test_step_input_errors_before_any_update(rng):
    model = small_mlp()
    opt = make_opt()
    w0 = weights(model)
    x, y = batch(rng)
    with pytest.raises(ValueError, match="scalar"):
        dp_train_step(model, lambda yt, yp: tf.reduce_mean(yp), x, y, optimizer=opt)
    with pytest.raises(ValueError, match="batch size"):
        dp_train_step(model, LOSS, x, y[:4], optimizer=opt)
    with pytest.raises(TypeError, match="DPOptimizer"):
        dp_train_step(model, LOSS, x, y, optimizer=keras.optimizers.SGD(0.1))
    frozen = small_mlp()
    frozen.trainable = False
    with pytest.raises(ValueError, match="no trainable variables"):
        dp_train_step(frozen, LOSS, x, y, optimizer=opt)
    with pytest.raises(ValueError, match="step_end"):
        dp_train_step(model, LOSS, x, y, optimizer=opt, step_end=np.ones((6, 1), bool))
    # One flag per row is the multi-replica copy of one flag: rows that disagree fail the step.
    with pytest.raises(tf.errors.InvalidArgumentError, match="step_end per row"):
        dp_train_step(model, LOSS, x, y, optimizer=opt, step_end=np.arange(6) == 5)
    with pytest.raises(ValueError, match="accumulation_steps=2"):
        dp_train_step(model, LOSS, x, y, optimizer=make_opt(accumulation_steps=2), step_end=True)
    for w, v in zip(w0, model.trainable_variables):
        np.testing.assert_array_equal(w, v.numpy())
    assert int(opt.dp_steps) == 0


def test_nonfinite_inputs_raise_before_any_update(rng):
    x, y = batch(rng)
    x[2, 1] = np.nan
    model = small_mlp()
    opt = make_opt()
    w0 = weights(model)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="^dpcore: NaN or Inf in x at row 2 of"
    ):
        dp_train_step(model, LOSS, x, y, optimizer=opt)  # eager: compiled error paths are slow
    for w, v in zip(w0, model.trainable_variables):
        np.testing.assert_array_equal(w, v.numpy())
    assert int(opt.dp_steps) == 0


@pytest.mark.slow  # graph optimization of the skip path takes ~20 s on 2 cores
def test_nonfinite_skip_equals_masking_the_example(rng):
    x, y = batch(rng)
    x[2, 1] = np.nan
    skip_model, mask_model = small_mlp(), small_mlp()
    step_fn(skip_model, make_opt(seed=1), options=ExecutionOptions(nonfinite="skip"))(x, y)
    mask = np.ones(6, "float32")
    mask[2] = 0
    x_clean = np.nan_to_num(x)
    step_fn(mask_model, make_opt(seed=1))(x_clean, y, mask=mask)
    for a, b in zip(weights(skip_model), weights(mask_model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert np.all(np.isfinite(a))


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize(
    "make_inner",
    [
        lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        lambda: keras.optimizers.Adam(0.01),
        lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
        lambda: keras.optimizers.RMSprop(0.01),
    ],
)
def test_noise0_clip_inf_equals_plain_keras_step(rng, make_inner):
    dp_model, plain_model = small_mlp(), small_mlp()
    opt = DPOptimizer(
        make_inner(), l2_norm_clip=math.inf, noise_multiplier=0.0, expected_batch_size=6
    )
    plain_opt = make_inner()
    step = step_fn(dp_model, opt)

    @tf.function
    def plain_step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, plain_model(x, training=True))
        grads = tape.gradient(loss, plain_model.trainable_variables)
        plain_opt.apply_gradients(zip(grads, plain_model.trainable_variables))
        return loss

    for _ in range(3):
        x, y = batch(rng)
        loss_dp = step(x, y)
        loss_plain = plain_step(x, y)
        np.testing.assert_allclose(loss_dp, loss_plain, rtol=1e-5)
    for a, b in zip(weights(dp_model), weights(plain_model)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert int(opt.dp_steps) == 3 and int(opt.iterations) == 3


def test_noise0_finite_clip_equals_reference_clipped_mean(rng):
    model = small_mlp()
    x, y = batch(rng, b=6, scale=4.0)
    sw = np.array([1.0, 0.5, 2.0, 1.0, 1.0, 3.0], "float32")
    mask = np.array([1, 1, 1, 0, 1, 1], "float32")
    ref = reference_per_example_gradients(
        model, LOSS, x, y, sample_weight=sw, mask=mask, training=True
    )
    c, ebs = 0.3, 10.0
    expected = reference_clipped_mean(ref, l2_norm_clip=c, expected_batch_size=ebs)
    w0 = weights(model)
    opt = make_opt(l2_norm_clip=c, expected_batch_size=ebs)  # SGD(lr=1): delta = -grad
    result = dp_step(model, LOSS, x, y, optimizer=opt, sample_weight=sw, mask=mask)
    for w, v, e in zip(w0, model.trainable_variables, expected):
        np.testing.assert_allclose(w - v.numpy(), e, rtol=1e-4, atol=1e-6)
    norms = np.sqrt(sum(np.sum(g.reshape(6, -1) ** 2, axis=1) for g in ref))
    np.testing.assert_allclose(result.per_example_norms, norms, rtol=1e-4, atol=1e-6)
    assert (norms[mask > 0] > c).sum() >= 3  # the test actually clips


def test_clipped_update_never_exceeds_clip(rng):
    c = 0.25
    model = small_mlp()
    opt = make_opt(l2_norm_clip=c, expected_batch_size=1.0)
    step = step_fn(model, opt)
    clipped = 0
    for _ in range(6):
        x, y = batch(rng, b=1, scale=5.0)
        raw = reference_per_example_gradients(model, LOSS, x, y, training=True)
        raw_norm = math.sqrt(sum(float(np.sum(g**2)) for g in raw))
        before = weights(model)
        step(x, y)
        delta = math.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(before, weights(model))))
        assert delta <= c * (1 + 1e-5)
        np.testing.assert_allclose(delta, min(raw_norm, c), rtol=1e-4)
        clipped += raw_norm > c
    assert clipped >= 3


def test_input_gradients_match_reference(rng):
    model = small_mlp()
    x, y = batch(rng)
    ref = reference_input_gradients(model, LOSS, x, y, training=True)
    loss, in_grads = dp_train_step(
        model, LOSS, x, y, optimizer=make_opt(), options=ExecutionOptions(wrt_inputs=True)
    )
    np.testing.assert_allclose(in_grads, ref, rtol=1e-4, atol=1e-6)
    assert loss.shape == ()


# ----------------------------------------------------------------------------- noise
def noise_only_delta(opt, model, step_end=None, b=4):
    """One step on an all-padding batch: the update is -lr * noise / expected_batch_size."""
    x = np.ones((b, model.input_shape[-1]), "float32")
    y = np.zeros(b, "int32")
    before = weights(model)
    dp_train_step(model, LOSS, x, y, optimizer=opt, mask=np.zeros(b, "float32"), step_end=step_end)
    return np.concatenate(
        [(a - v.numpy()).ravel() for a, v in zip(before, model.trainable_variables)]
    )


def wide_model():
    init = keras.initializers.GlorotUniform(seed=0)
    return keras.Sequential([keras.Input((100,)), keras.layers.Dense(40, kernel_initializer=init)])


def test_noise_std_matches_sigma_c_over_expected_batch_size():
    sigma, c, ebs = 1.3, 0.7, 5.0
    model = wide_model()
    opt = make_opt(l2_norm_clip=c, noise_multiplier=sigma, expected_batch_size=ebs, seed=11)
    delta = noise_only_delta(opt, model)
    n = delta.size
    target = sigma * c / ebs
    assert abs(delta.std() - target) < 4 * target / math.sqrt(2 * n)
    assert abs(delta.mean()) < 4 * target / math.sqrt(n)
    assert int(opt.dp_steps) == 1  # an all-padding batch is a valid step


def test_empty_batch_is_a_noise_only_step():
    model = small_mlp()
    opt = make_opt(noise_multiplier=1.0, seed=5)
    before = weights(model)
    loss = dp_train_step(
        model, LOSS, np.zeros((0, 5), "float32"), np.zeros((0,), "int32"), optimizer=opt
    )
    assert float(loss) == 0.0 and int(opt.dp_steps) == 1
    assert any(np.any(a != v.numpy()) for a, v in zip(before, model.trainable_variables))


def test_steps_draw_fresh_noise_and_seed_reproduces():
    model = wide_model()
    opt = make_opt(noise_multiplier=1.0, seed=123)
    d1, d2 = noise_only_delta(opt, model), noise_only_delta(opt, model)
    assert abs(np.corrcoef(d1, d2)[0, 1]) < 0.1
    again = make_opt(noise_multiplier=1.0, seed=123)
    m2 = wide_model()
    np.testing.assert_array_equal(noise_only_delta(again, m2), d1)
    np.testing.assert_array_equal(noise_only_delta(again, m2), d2)
    other = noise_only_delta(make_opt(noise_multiplier=1.0, seed=124), wide_model())
    assert not np.allclose(other, d1)


def test_default_seed_comes_from_os_entropy():
    a, b = make_opt(noise_multiplier=1.0), make_opt(noise_multiplier=1.0)
    assert not np.array_equal(a.noise_seed.numpy(), b.noise_seed.numpy())
    assert a.get_config()["seed"] is None


# ----------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("use_step_end", [False, True])
def test_accumulation_equals_one_step_on_concatenated_batch(rng, use_step_end):
    k, c = 3, 0.5
    x, y = batch(rng, b=9, scale=3.0)
    acc_model, big_model = small_mlp(), small_mlp()
    acc_opt = make_opt(
        keras.optimizers.Adam(0.05),
        l2_norm_clip=c,
        expected_batch_size=9,
        accumulation_steps=1 if use_step_end else k,
    )
    big_opt = make_opt(keras.optimizers.Adam(0.05), l2_norm_clip=c, expected_batch_size=9)
    step = step_fn(acc_model, acc_opt)
    w0 = weights(acc_model)
    for i in range(k):
        sl = slice(3 * i, 3 * i + 3)
        step_end = tf.constant(i == k - 1) if use_step_end else None
        step(x[sl], y[sl], step_end=step_end)
        if i < k - 1:  # nothing applied mid-step
            for a, v in zip(w0, acc_model.trainable_variables):
                np.testing.assert_array_equal(a, v.numpy())
            assert int(acc_opt.dp_steps) == 0 and int(acc_opt.micro_steps) == i + 1
    step_fn(big_model, big_opt)(x, y)
    for a, b in zip(weights(acc_model), weights(big_model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(acc_opt.dp_steps) == 1 and int(acc_opt.micro_steps) == 0
    assert all(np.all(a.numpy() == 0) for a in acc_opt._accumulators)


def test_accumulated_step_adds_noise_once():
    """k noise-only micro-steps draw exactly the single noise draw of one step with that seed."""
    acc, single = wide_model(), wide_model()
    acc_opt = make_opt(noise_multiplier=1.0, accumulation_steps=3, seed=9)
    one_opt = make_opt(noise_multiplier=1.0, seed=9)
    deltas = [noise_only_delta(acc_opt, acc) for _ in range(3)]
    assert not deltas[0].any() and not deltas[1].any()
    np.testing.assert_array_equal(deltas[2], noise_only_delta(one_opt, single))


@pytest.mark.parametrize("prebuild", [True, False])
def test_training_loop_traces_once(rng, prebuild):
    model = small_mlp()
    opt = make_opt(noise_multiplier=0.5, seed=1)
    if prebuild:  # otherwise tf.function retraces once after the first call creates variables
        opt.build(model.trainable_variables)
    traces = []

    @tf.function
    def step(x, y, mask, step_end):
        traces.append(1)
        return dp_train_step(model, LOSS, x, y, optimizer=opt, mask=mask, step_end=step_end)

    for i in range(6):
        x, y = batch(rng)
        mask = tf.constant(rng.integers(0, 2, 6).astype("float32"))
        step(tf.constant(x), tf.constant(y), mask, tf.constant(i % 2 == 1))
        if i == 0:
            first = len(traces)
    assert len(traces) == first  # no retrace after the first step
    if prebuild:
        assert first == 1
    assert int(opt.dp_steps) == 3


# ----------------------------------------------------------------------------- state
def test_get_config_from_config_round_trip():
    opt = DPOptimizer(
        keras.optimizers.Adam(0.003, beta_1=0.8),
        l2_norm_clip=[0.5, 1.5],
        variable_groups=[0, 1, 0, 1],
        noise_multiplier=1.1,
        expected_batch_size=256,
        accumulation_steps=4,
        seed=42,
    )
    config = opt.get_config()
    clone = DPOptimizer.from_config(config)
    assert clone.get_config() == config
    assert isinstance(clone.inner_optimizer, keras.optimizers.Adam)
    assert clone.inner_optimizer.beta_1 == 0.8
    np.testing.assert_array_equal(clone.noise_seed.numpy(), opt.noise_seed.numpy())
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert isinstance(revived, DPOptimizer) and revived.get_config() == config


@pytest.mark.parametrize("build_first", [True, False])
def test_checkpoint_keeps_noise_state(tmp_path, build_first):
    model = wide_model()
    opt = make_opt(keras.optimizers.SGD(1.0, momentum=0.5), noise_multiplier=1.0)  # OS entropy
    earlier = [noise_only_delta(opt, model) for _ in range(2)]
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    original_next = noise_only_delta(opt, model)

    fresh_model = wide_model()
    fresh = make_opt(keras.optimizers.SGD(1.0, momentum=0.5), noise_multiplier=1.0)
    assert not np.array_equal(fresh.noise_seed.numpy(), opt.noise_seed.numpy())
    if build_first:
        fresh.build(fresh_model.trainable_variables)
        tf.train.Checkpoint(model=fresh_model, optimizer=fresh).restore(path).assert_consumed()
    else:  # deferred restoration: slots are filled when the first step builds the optimizer
        tf.train.Checkpoint(model=fresh_model, optimizer=fresh).restore(path)
    assert int(fresh.dp_steps) == 2
    restored_next = noise_only_delta(fresh, fresh_model)
    np.testing.assert_array_equal(restored_next, original_next)
    # The deltas mix in momentum (delta_t = noise_t / ebs + 0.5 * delta_{t-1}, correlation ~0.49
    # between consecutive deltas), so undo the recursion and compare the fresh draws themselves:
    # independent N(0, 1) vectors of size n have correlation ~ N(0, 1/n); 6/sqrt(n) never trips.
    draws = [earlier[0], earlier[1] - 0.5 * earlier[0], restored_next - 0.5 * earlier[1]]
    bound = 6 / math.sqrt(restored_next.size)
    for d in draws[:2]:
        assert abs(np.corrcoef(d, draws[2])[0, 1]) < bound  # the restored draw is a new one
    np.testing.assert_allclose(np.std(draws[2]), 1.0 / 6, rtol=6 / math.sqrt(2 * draws[2].size))


def test_fork_noise_gives_a_continuation_its_own_noise(tmp_path):
    """Two continuations of one checkpoint draw the same noise at the same step (the difference
    of their releases would be noise-free); fork_noise re-keys one of them: a new draw,
    uncorrelated with the other continuation's, of the same scale."""
    model = wide_model()
    opt = make_opt(keras.optimizers.SGD(1.0), noise_multiplier=1.0)
    noise_only_delta(opt, model)
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))

    def continuation(fork):
        m, o = wide_model(), make_opt(keras.optimizers.SGD(1.0), noise_multiplier=1.0)
        o.build(m.trainable_variables)
        tf.train.Checkpoint(model=m, optimizer=o).restore(path).assert_consumed()
        if fork:
            o.fork_noise()
        assert int(o.dp_steps) == 1
        return noise_only_delta(o, m)

    first, second, forked = continuation(False), continuation(False), continuation(True)
    np.testing.assert_array_equal(first, second)  # what fork_noise exists for
    assert abs(np.corrcoef(first, forked)[0, 1]) < 6 / math.sqrt(first.size)
    np.testing.assert_allclose(np.std(forked), np.std(first), rtol=6 / math.sqrt(2 * first.size))


def test_noise_multiplier_schedule_takes_effect_without_retracing_and_is_checked():
    """σ is optimizer state read when the step runs: changing it between steps changes the
    noise of the following steps in an already compiled loop (what the callbacks record)."""
    model = wide_model()
    opt = make_opt(noise_multiplier=1.0, seed=5)
    opt.build(model.trainable_variables)  # else the first call's variable creation retraces
    traces = []
    b = 4
    x, y, mask = np.ones((b, 100), "float32"), np.zeros(b, "int32"), np.zeros(b, "float32")

    @tf.function
    def step():
        traces.append(1)
        dp_train_step(model, LOSS, x, y, optimizer=opt, mask=mask)

    def noise_std():
        before = weights(model)
        step()
        return np.concatenate(
            [(a - v.numpy()).ravel() for a, v in zip(before, model.trainable_variables)]
        ).std()

    n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    tol = 4 / math.sqrt(2 * n)
    for sigma in (1.0, 3.0, 0.5):
        opt.noise_multiplier = sigma
        assert opt.noise_multiplier == sigma and opt.get_config()["noise_multiplier"] == sigma
        target = sigma * 1.0 / 6  # sigma * C / expected_batch_size
        assert abs(noise_std() - target) < tol * target
    assert len(traces) == 1
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="noise_multiplier"):
            opt.noise_multiplier = bad
    assert opt.noise_multiplier == 0.5  # a refused value changes nothing


def test_checkpoint_restores_the_noise_multiplier_that_ran(tmp_path):
    model = wide_model()
    opt = make_opt(noise_multiplier=1.0, seed=2)
    noise_only_delta(opt, model)
    opt.noise_multiplier = 2.5
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    fresh_model = wide_model()
    fresh = make_opt(noise_multiplier=1.0, seed=2)
    fresh.build(fresh_model.trainable_variables)
    tf.train.Checkpoint(model=fresh_model, optimizer=fresh).restore(path).assert_consumed()
    assert fresh.noise_multiplier == 2.5


def test_per_group_clipping_uses_group_sensitivity():
    opt = make_opt(l2_norm_clip=[3.0, 4.0], variable_groups=[0, 1], noise_multiplier=1.0, seed=3)
    model = wide_model()
    delta = noise_only_delta(opt, model)
    target = 5.0 / 6.0  # sigma * sqrt(3^2 + 4^2) / expected_batch_size
    assert abs(delta.std() - target) < 4 * target / math.sqrt(2 * delta.size)


def test_apply_clipped_sum_rejects_changed_sensitivity():
    model = wide_model()
    opt = make_opt()
    variables = model.trainable_variables
    zeros = tuple(tf.zeros_like(v) for v in variables)

    def clipped(s):
        return aggregation.ClippedSum(zeros, s, tf.constant(0.0), tf.zeros([0]), None, None)

    opt.apply_clipped_sum(clipped(1.0), variables)
    with pytest.raises(ValueError, match="l2_sensitivity"):
        opt.apply_clipped_sum(clipped(2.0), variables)
    # A tensor bound could change between micro-batches at run time, which no trace-time
    # comparison sees, while the noise follows the last one: refused without adaptive_clip.
    before = [v.numpy().copy() for v in variables]
    for bound in (tf.constant(1.0, tf.float64), tf.Variable(1.0, dtype=tf.float64)):
        with pytest.raises(ValueError, match="must be a Python number"):
            opt.apply_clipped_sum(clipped(bound), variables)
        with pytest.raises(ValueError, match="must be a Python number"):
            tf.function(lambda b=bound: opt.apply_clipped_sum(clipped(b), variables))()
    for v, b in zip(variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def _with_entries(variables, entries):
    """Zero sums shaped like ``variables``, with ``{(variable index, flat index): value}`` set."""
    out = [np.zeros(v.shape, np.float32) for v in variables]
    for (j, i), value in entries.items():
        out[j].reshape(-1)[i] = value
    return tuple(tf.constant(a) for a in out)


NONFINITE_SUMS = {
    "all NaN": None,
    "one NaN, last variable": {(-1, 0): np.nan},
    "one +Inf, last entry of the first": {(0, -1): np.inf},
    "one -Inf": {(1, 3): -np.inf},
    "+Inf and -Inf in two variables": {(0, 0): np.inf, (-1, -1): -np.inf},
}


@pytest.mark.parametrize("accumulation_steps", [1, 2])
@pytest.mark.parametrize("pattern", list(NONFINITE_SUMS))
def test_nonfinite_clipped_sum_never_reaches_the_weights(accumulation_steps, pattern):
    model = wide_model()
    opt = make_opt(accumulation_steps=accumulation_steps)
    variables = model.trainable_variables
    opt.build(variables)
    before = weights(model)
    entries = NONFINITE_SUMS[pattern]
    if entries is None:
        bad = tuple(tf.fill(v.shape, np.float32(np.nan)) for v in variables)
    else:
        bad = _with_entries(variables, entries)

    @tf.function
    def apply(grads):
        opt.apply_clipped_sum(
            aggregation.ClippedSum(grads, 1.0, tf.constant(1.0), tf.zeros([1]), None, None),
            variables,
        )

    with pytest.raises(tf.errors.InvalidArgumentError, match="not finite"):
        apply(bad)
    for a, v in zip(before, variables):
        np.testing.assert_array_equal(a, v.numpy())
    assert all(np.all(a.numpy() == 0) for a in opt._accumulators)
    assert int(opt.dp_steps) == 0 and int(opt.micro_steps) == 0


def test_warning_free_default_construction():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # σ > 0: σ = 0 warns that the run is not private
        make_opt(keras.optimizers.Adam(), noise_multiplier=1.0)


_DISTRIBUTED_SCRIPT = r"""
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import numpy as np
from dpcore.optimizer import DPOptimizer
from dpcore.step import dp_train_step
from dpcore.testing import reference_clipped_mean, reference_per_example_gradients

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def model_fn(d=5):
    init = keras.initializers.GlorotUniform(seed=0)
    return keras.Sequential([keras.Input((d,)), keras.layers.Dense(3, kernel_initializer=init)])


def run(model, opt, elements):
    w0 = [v.numpy() for v in model.trainable_variables]

    @tf.function
    def step(x, y, m):
        return strategy.run(
            lambda a, b, c: dp_train_step(model, LOSS, a, b, optimizer=opt, mask=c), args=(x, y, m)
        )

    ds = tf.data.Dataset.from_tensor_slices(elements).batch(len(elements[0]) // opt.accumulation_steps)
    for batch in strategy.experimental_distribute_dataset(ds):
        step(*batch)
    return [a - v.numpy() for a, v in zip(w0, model.trainable_variables)]


rng = np.random.default_rng(0)
x = (3 * rng.normal(size=(8, 5))).astype("float32")
y = rng.integers(0, 3, 8).astype("int32")
ref = reference_clipped_mean(
    reference_per_example_gradients(model_fn(), LOSS, x, y, training=True),
    l2_norm_clip=0.5,
    expected_batch_size=8,
)
with strategy.scope():
    model = model_fn()
    opt = DPOptimizer(
        keras.optimizers.SGD(1.0), l2_norm_clip=0.5, noise_multiplier=0.0, expected_batch_size=8,
        accumulation_steps=2,
    )
    opt.build(model.trainable_variables)
got = run(model, opt, (x, y, np.ones(8, "float32")))
err = max(float(np.abs(g - r).max()) for g, r in zip(got, ref))

with strategy.scope():
    wide = model_fn(300)
    noisy = DPOptimizer(
        keras.optimizers.SGD(1.0), l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=4,
        seed=1,
    )
    noisy.build(wide.trainable_variables)
delta = np.concatenate(
    [d.ravel() for d in run(wide, noisy, (np.ones((4, 300), "float32"), np.zeros(4, "int32"),
                                           np.zeros(4, "float32")))]
)
same = all(
    np.array_equal(*[t.numpy() for t in v.value.values]) for v in wide.trainable_variables
)
print("RESULT", err, float(delta.std()), delta.size, same, int(opt.dp_steps.numpy()))
"""


@pytest.mark.slow
@pytest.mark.replica_script(_DISTRIBUTED_SCRIPT)
def test_two_replicas_sum_clipped_grads_and_add_noise_once(replica_run):
    lines = [line for line in replica_run["stdout"].splitlines() if line.startswith("RESULT")]
    assert lines, replica_run["error"][-3000:]
    err, std, n, same, steps = lines[0].split()[1:]
    assert float(err) < 1e-6  # accumulated, all-reduced clipped mean equals the reference
    target = 1.0 * 1.0 / 4  # sigma * C / expected_batch_size: noise added once, not per replica
    assert abs(float(std) - target) < 4 * target / math.sqrt(2 * int(n))
    assert same == "True" and steps == "1"


@pytest.mark.parametrize("restored_sigma", [2.0**-50, 2.0**110])
def test_a_noise_std_that_float32_cannot_carry_fails_the_step(restored_sigma):
    """With σ C below 2^-40 float32 can flush noise values to zero (the release is then the
    clipped sum without noise), above 2^100 they overflow: the constructor and the setter refuse
    such a σ, and one restored from a checkpoint fails the step before any state changes."""
    with pytest.raises(ValueError, match=r"noise std of .* outside \[2\^-40, 2\^100\]"):
        make_opt(l2_norm_clip=1e-36, noise_multiplier=1.0)
    model = wide_model()
    opt = make_opt(noise_multiplier=1.0, seed=3)
    with pytest.raises(ValueError, match="noise std"):
        opt.noise_multiplier = restored_sigma
    opt.build(model.trainable_variables)
    step = step_fn(model, opt)
    x = np.random.default_rng(0).normal(size=(4, 100)).astype("float32")
    y = np.zeros(4, "int32")
    step(x, y)
    before, state = weights(model), opt.dp_state
    opt._noise_multiplier.assign(restored_sigma)  # what restoring a checkpoint does
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"noise std .* 0 or within"):
        step(x, y)
    for a, b in zip(weights(model), before):
        np.testing.assert_array_equal(a, b)
    assert int(opt.dp_steps) == state.dp_steps == 1


def test_a_step_whose_sigma_fails_its_check_changes_no_state():
    """σ is a variable that a checkpoint restore assigns without the setter's check. A logical
    step that ends with a σ that is not finite fails, and every state change of that step waits
    for the checked noise: the weights, the accumulated micro-batch, dp_steps and the pending
    count all stay as they were (before, only the weights were sure to)."""
    model = wide_model()
    opt = make_opt(noise_multiplier=1.0, accumulation_steps=2, seed=3)
    opt.build(model.trainable_variables)
    step = step_fn(model, opt)
    x = np.random.default_rng(0).normal(size=(4, 100)).astype("float32")
    y = np.zeros(4, "int32")
    step(x, y)  # the first micro-batch: accumulated, nothing applied
    state = opt.dp_state
    assert state.pending_micro_steps == 1 and state.dp_steps == 0
    before = weights(model)
    accumulated = [a.numpy().copy() for a in opt._accumulators]
    opt._noise_multiplier.assign(float("nan"))  # what restoring a corrupted checkpoint does
    with pytest.raises(tf.errors.InvalidArgumentError, match="noise_multiplier"):
        step(x, y)
    for a, b in zip(weights(model), before):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(opt._accumulators, accumulated):
        np.testing.assert_array_equal(a.numpy(), b)
    after = opt.dp_state
    assert (after.dp_steps, after.pending_micro_steps) == (0, 1)
