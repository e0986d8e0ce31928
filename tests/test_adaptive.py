"""Quantile-adaptive clipping: the bound's update, its noise, its accounting and its state."""

import dataclasses
import math

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import dpcore
from dpcore import aggregation
from dpcore.adaptive import AdaptiveClip, effective_noise_multiplier, gradient_noise_multiplier
from dpcore.engine.summary import GradientSummary
from dpcore.optimizer import DPOptimizer
from dpcore.step import dp_train_step
from tests.helpers import make_opt

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")


def linear_model(d=4):
    """One bias-free Dense unit: with LOSS each example's gradient is its input row."""
    init = keras.initializers.Constant(0.1)
    return keras.Sequential(
        [keras.Input((d,)), keras.layers.Dense(1, use_bias=False, kernel_initializer=init)]
    )


def LOSS(y, p):  # noqa: N802  (a loss function, named like the Keras ones)
    return p[:, 0]


def adaptive_opt(*, lr=0.0, clip=0.1, sigma=0.0, count_stddev=0.0, quantile=0.5, eta=0.2, **kw):
    kw.setdefault("expected_batch_size", 8)
    return make_opt(
        keras.optimizers.SGD(lr),
        l2_norm_clip=clip,
        noise_multiplier=sigma,
        adaptive_clip=AdaptiveClip(
            target_quantile=quantile, learning_rate=eta, count_stddev=count_stddev
        ),
        **kw,
    )


def step_fn(model, opt):
    @tf.function
    def step(x, mask=None, step_end=None):
        y = tf.zeros([tf.shape(x)[0]])
        return dp_train_step(model, LOSS, x, y, optimizer=opt, mask=mask, step_end=step_end)

    return step


def clip_of(opt):
    return opt.dp_state.l2_norm_clip


# ------------------------------------------------------------------------------ configuration
def test_noise_multipliers_compose_into_the_accounted_one():
    sigma, sigma_b = 1.1, 3.0
    s_grad = gradient_noise_multiplier(noise_multiplier=sigma, count_stddev=sigma_b)
    assert s_grad > sigma
    assert s_grad**-2 + (2 * sigma_b) ** -2 == pytest.approx(sigma**-2, rel=1e-12)
    assert effective_noise_multiplier(
        gradient_noise_multiplier=s_grad, count_stddev=sigma_b
    ) == pytest.approx(sigma, rel=1e-12)

    # Independently of the formula: dp-accounting's RDP of the gradient (σ_Δ, sensitivity 1) and
    # the centred count (std σ_b, sensitivity 1/2, i.e. noise multiplier 2 σ_b) released
    # together equals that of one Gaussian of σ.
    def rdp(event):
        acc = dp_accounting.rdp.RdpAccountant(orders=[1.5, 2.0, 8.0, 64.0])
        acc.compose(event)
        return acc._rdp  # noqa: SLF001  (the per-order values, to compare exactly)

    pair = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(s_grad), dp_accounting.GaussianDpEvent(2 * sigma_b)]
    )
    np.testing.assert_allclose(rdp(pair), rdp(dp_accounting.GaussianDpEvent(sigma)), rtol=1e-12)
    assert gradient_noise_multiplier(noise_multiplier=0.0, count_stddev=0.0) == 0.0


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"target_quantile": 0.0}, "target_quantile"),
        ({"target_quantile": 1.0}, "target_quantile"),
        ({"learning_rate": -0.1}, "learning_rate"),
        ({"learning_rate": math.inf}, "learning_rate"),
        ({"count_stddev": -1.0}, "count_stddev"),
        ({"count_stddev": math.nan}, "count_stddev"),
    ],
)
def test_adaptive_clip_checks_its_fields(kw, match):
    kw.setdefault("count_stddev", 1.0)
    with pytest.raises(ValueError, match=match):
        AdaptiveClip(**kw)


def test_optimizer_refuses_count_noise_too_small_for_sigma_and_group_bounds():
    with pytest.raises(ValueError, match="count_stddev=0.5 is too small"):
        adaptive_opt(sigma=1.0, count_stddev=0.5)
    with pytest.raises(ValueError, match="one finite initial l2_norm_clip"):
        adaptive_opt(clip=[1.0, 2.0], variable_groups=[0, 1])
    opt = adaptive_opt(sigma=1.0, count_stddev=1.0)
    with pytest.raises(ValueError, match="too small"):
        opt.noise_multiplier = 2.5  # a schedule is checked against the count noise as well
    assert opt.noise_multiplier == 1.0


def fake_summary(sq_norms, mask, variable=None):
    """A summary of one scalar variable whose per-example gradients are all 1."""
    return GradientSummary(
        variables=(variable if variable is not None else tf.Variable([0.0]),),
        sq_norms=tf.constant(sq_norms, tf.float64),
        per_example_loss=tf.zeros([len(mask)]),
        mask=tf.constant(mask, tf.float32),
        y_pred=None,
        weighted_sum=lambda w: [tf.reduce_sum(w, axis=0)],
    )


def test_unclipped_count_uses_the_certified_bounds_that_decide_clipping():
    c = 2.0
    # Squared norms c^2 (the certified bound then exceeds c: clipped), c^2 / 4 (unclipped), and a
    # masked row, which adds nothing to the count.
    summary = fake_summary([[c * c], [c * c / 4], [0.0]], [1.0, 1.0, 0.0])
    clipped = aggregation.clip(
        summary, l2_norm_clip=tf.constant(c, tf.float64), count_unclipped=True
    )
    w = clipped.clip_weights.numpy()[:, 0]
    assert w[0] < 1.0 and w[1] == 1.0 and w[2] == 0.0
    assert float(clipped.unclipped_count) == (0 - 0.5) + (1 - 0.5)
    assert float(clipped.l2_sensitivity) == c


def test_fixed_clipping_unchanged_when_not_enabled():
    opt = DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=0.5, noise_multiplier=0.0, expected_batch_size=8
    )
    var = keras.Variable([0.0])
    summary = fake_summary([[1.0], [0.01]], [1.0, 1.0], var)
    opt.apply_clipped_sum(opt.clip(summary), [var])
    assert float(var.numpy()[0]) == pytest.approx(-0.1 * (0.5 + 1.0) / 8)
    names = [v.name for v in opt.variables]
    assert not {"l2_norm_clip", "unclipped_fraction", "dp_count"} & set(names)
    assert opt.adaptive_logs() == {} and opt.get_config()["adaptive_clip"] is None
    assert opt.dp_state.l2_norm_clip == 0.5
    with pytest.raises(ValueError, match="unclipped_count"):  # an adaptive sum for a fixed bound
        opt.apply_clipped_sum(aggregation.clip(summary, l2_norm_clip=0.5, count_unclipped=True))
    with pytest.raises(ValueError, match="unclipped_count"):  # and the other way round
        adaptive_opt().apply_clipped_sum(aggregation.clip(summary, l2_norm_clip=0.5), [var])


# -------------------------------------------------------------------------------- the update
def test_without_noise_the_update_is_the_deterministic_recursion(rng):
    b, lr, eta, gamma = 8, 0.5, 0.3, 0.4
    model = linear_model()
    opt = adaptive_opt(lr=lr, clip=0.5, quantile=gamma, eta=eta, expected_batch_size=b)
    step = step_fn(model, opt)
    c, w = 0.5, model.trainable_variables[0].numpy().astype(np.float64)
    for t in range(12):
        x = (rng.lognormal(size=(b, 1)) * rng.normal(size=(b, 4))).astype("float32")
        mask = np.ones(b, "float32")
        mask[t % b] = 0.0  # a padding row: neither clipped nor counted
        step(x, mask)
        norms, m = np.linalg.norm(x.astype(np.float64), axis=1), mask.astype(np.float64)
        fraction = np.sum(((norms <= c) - 0.5) * m) / b + 0.5
        factors = np.minimum(1.0, c / norms) * m
        w = w - lr * (factors[:, None] * x).sum(axis=0)[:, None] / b
        c = c * math.exp(-eta * (fraction - gamma))
        assert clip_of(opt) == pytest.approx(c, rel=1e-9)
        assert float(opt.adaptive_logs()["unclipped_fraction"]) == pytest.approx(fraction)
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), w, rtol=1e-5, atol=1e-6)


def test_noised_fraction_converges_to_the_target_quantile():
    b, gamma, steps = 64, 0.3, 150
    data = np.random.default_rng(1)
    # A stationary norm distribution (the gradient of each example is its input row).
    x = data.lognormal(0.0, 0.5, size=(b * steps, 1)) * data.normal(size=(b * steps, 4))
    x = x.astype("float32")
    model = linear_model()
    opt = adaptive_opt(
        clip=0.05, sigma=1.0, count_stddev=b / 20, quantile=gamma, expected_batch_size=b, seed=3
    )
    step = step_fn(model, opt)
    fractions, clips = [], []
    for t in range(steps):
        step(x[t * b : (t + 1) * b])
        fractions.append(float(opt.adaptive_logs()["unclipped_fraction"]))
        clips.append(clip_of(opt))
    quantile = np.quantile(np.linalg.norm(x, axis=1), gamma)
    assert clips[0] < 0.1 * quantile  # it started far below the target
    assert abs(np.mean(fractions[steps // 2 :]) - gamma) < 0.05
    assert abs(np.median(clips[steps // 2 :]) / quantile - 1) < 0.15
    assert np.std(fractions[steps // 2 :]) > 0  # the fraction is noised


@pytest.mark.parametrize("use_step_end", [False, True])
def test_accumulated_step_noises_the_count_once(rng, use_step_end):
    x = (3 * rng.normal(size=(3, 8, 4))).astype("float32")

    def run(split):
        model = linear_model()
        kw = {"accumulation_steps": split} if not use_step_end else {}
        opt = adaptive_opt(lr=0.5, clip=1.0, sigma=1.0, count_stddev=2.0, seed=7, **kw)
        step = step_fn(model, opt)
        for batch in x:
            for i, part in enumerate(np.split(batch, split)):
                end = tf.constant(i == split - 1) if use_step_end else None
                step(part, step_end=end)
        return clip_of(opt), model.trainable_variables[0].numpy(), int(opt.dp_steps)

    one, two = run(1), run(2)
    assert one[2] == two[2] == 3
    assert two[0] == pytest.approx(one[0], rel=1e-12)  # same noised counts: one draw per step
    np.testing.assert_allclose(two[1], one[1], rtol=1e-5, atol=1e-6)
    assert one[0] != pytest.approx(run_without_noise(x), rel=1e-6)  # the count was noised


def run_without_noise(x):
    model = linear_model()
    opt = adaptive_opt(lr=0.5, clip=1.0)
    step = step_fn(model, opt)
    for batch in x:
        step(batch)
    return clip_of(opt)


# ------------------------------------------------------------------------ state and accounting
def test_checkpoint_restores_the_bound(tmp_path, rng):
    x = rng.normal(size=(4, 8, 4)).astype("float32")
    model, opt = linear_model(), adaptive_opt(lr=0.1, sigma=1.0, count_stddev=2.0, seed=5)
    step = step_fn(model, opt)
    for batch in x[:2]:
        step(batch)
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    saved = clip_of(opt)
    step(x[2])

    fresh_model, fresh = linear_model(), adaptive_opt(lr=0.1, sigma=1.0, count_stddev=2.0, seed=5)
    fresh.build(fresh_model.trainable_variables)
    tf.train.Checkpoint(model=fresh_model, optimizer=fresh).restore(path).assert_consumed()
    assert clip_of(fresh) == saved != 0.1
    step_fn(fresh_model, fresh)(x[2])
    assert clip_of(fresh) == clip_of(opt)  # the resumed run continues the same trajectory


@pytest.mark.parametrize("count_stddev", [1.0, 0.0])
def test_a_restored_sigma_the_count_noise_cannot_carry_fails_the_step(tmp_path, rng, count_stddev):
    """σ restored from a checkpoint skips the setter's check. Restored into an optimizer whose
    count noise is too small for it (2 σ_b <= σ, or σ_b = 0 with σ > 0), the effective gradient
    noise multiplier is undefined; it used to come out NaN (or 0) and the step applied an update
    without noise while the accounting counted σ. Now the step fails and nothing of the
    optimizer's state moves: not the weights, and not C, the released unclipped fraction or
    dp_steps either (they used to move, releasing the count, un-noised with σ_b = 0)."""
    x = rng.normal(size=(8, 4)).astype("float32")
    model, opt = linear_model(), adaptive_opt(lr=1.0, sigma=3.0, count_stddev=2.0, seed=5)
    step_fn(model, opt)(x)
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))

    sigma = 1.0 if count_stddev else 0.0  # what the constructor's check accepts
    fresh_model = linear_model()
    fresh = adaptive_opt(lr=1.0, sigma=sigma, count_stddev=count_stddev, seed=5)
    fresh.build(fresh_model.trainable_variables)
    tf.train.Checkpoint(model=fresh_model, optimizer=fresh).restore(path).assert_consumed()
    assert fresh.noise_multiplier == 3.0
    before = fresh_model.trainable_variables[0].numpy().copy()
    state = fresh.dp_state
    fraction = float(fresh.adaptive_logs()["unclipped_fraction"])
    with pytest.raises(tf.errors.InvalidArgumentError, match="count_stddev|noise_multiplier"):
        step_fn(fresh_model, fresh)(x)
    np.testing.assert_array_equal(fresh_model.trainable_variables[0].numpy(), before)
    assert fresh.dp_state == state
    assert float(fresh.adaptive_logs()["unclipped_fraction"]) == fraction


def test_fit_logs_the_bound_saves_it_and_accounts_the_effective_sigma(tmp_path, rng):
    n, q, steps, sigma, sigma_b = 64, 0.125, 6, 0.8, 0.6
    x = rng.normal(size=(n, 4)).astype("float32")
    y = np.zeros(n, "float32")
    opt = adaptive_opt(
        lr=0.1, clip=0.2, sigma=sigma, count_stddev=sigma_b, expected_batch_size=n * q
    )
    dp_model = dpcore.make_private(linear_model(), optimizer=opt, loss=LOSS)
    config = dpcore.DPConfig(
        l2_norm_clip=0.2,
        noise_multiplier=sigma,
        expected_batch_size=n * q,
        num_examples=n,
        steps=steps,
        target_delta=1e-3,
    )
    eps_cb = dpcore.callbacks.EpsilonCallback(config)
    data = dpcore.sampling.poisson_batches(x, y, sampling_prob=q, steps=steps // 2, seed=0)
    history = dp_model.fit(data, epochs=2, callbacks=[eps_cb], verbose=0)
    assert history.history["l2_norm_clip"][-1] == pytest.approx(clip_of(opt), rel=1e-6)
    assert history.history["l2_norm_clip"][0] != pytest.approx(0.2)
    last = float(opt.adaptive_logs()["unclipped_fraction"])
    assert history.history["unclipped_fraction"][-1] == pytest.approx(last)
    assert int(opt.dp_steps) == steps

    # ε is dp-accounting's for one Poisson-sampled Gaussian of the effective σ per step.
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
        )
    )
    assert eps_cb.epsilon() == pytest.approx(accountant.get_epsilon(1e-3), rel=1e-9)
    assert eps_cb.ledger.segments[0]["noise_multiplier"] == sigma

    dp_model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras", custom_objects={"LOSS": LOSS})
    assert loaded.optimizer.adaptive_clip == opt.adaptive_clip
    assert loaded.optimizer.dp_state == opt.dp_state


_REPLICAS_SCRIPT = r"""
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import numpy as np
from dpcore.adaptive import AdaptiveClip
from dpcore.optimizer import DPOptimizer
from dpcore.step import dp_train_step


def loss(y, p):
    return p[:, 0]


def model_fn():
    init = keras.initializers.Constant(0.1)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, use_bias=False,
                                                                   kernel_initializer=init)])


def opt_fn():
    return DPOptimizer(keras.optimizers.SGD(0.5), l2_norm_clip=1.0, noise_multiplier=1.0,
                       expected_batch_size=8, seed=3,
                       adaptive_clip=AdaptiveClip(count_stddev=2.0))


x = (2 * np.random.default_rng(0).normal(size=(16, 4))).astype("float32")
y = np.zeros(16, "float32")

model, opt = model_fn(), opt_fn()
single = tf.function(lambda a, b: dp_train_step(model, loss, a, b, optimizer=opt))
for i in range(2):
    single(x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    dmodel, dopt = model_fn(), opt_fn()
    dopt.build(dmodel.trainable_variables)


@tf.function
def step(a, b):
    return strategy.run(lambda a, b: dp_train_step(dmodel, loss, a, b, optimizer=dopt), args=(a, b))


for batch in strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(8)):
    step(*batch)
w = np.abs(model.trainable_variables[0].numpy() - dmodel.trainable_variables[0].numpy()).max()
print("RESULT", repr(opt.dp_state.l2_norm_clip), repr(dopt.dp_state.l2_norm_clip), w,
      int(dopt.dp_steps.numpy()))
"""


@pytest.mark.slow
@pytest.mark.replica_script(_REPLICAS_SCRIPT)
def test_two_replicas_noise_the_all_reduced_count_once(replica_run):
    lines = [line for line in replica_run["stdout"].splitlines() if line.startswith("RESULT")]
    assert lines, replica_run["error"][-3000:]
    single, replicated, weight_error, steps = lines[0].split()[1:]
    assert float(single) != 1.0 and float(replicated) == pytest.approx(float(single), rel=1e-12)
    assert float(weight_error) < 1e-6 and steps == "2"


def test_the_count_noise_comes_from_the_gradient_noise_sampler():
    """The count release draws N(0, 1) from aggregation.standard_normal (support up to 9.42
    standard deviations, PRIVACY.md "Noise support") on its own stream of the step seed,
    fold_in(seed, int64(2^31 - 1)); tf.random.stateless_normal, used before, stops at 5.68."""
    from dpcore import adaptive

    for seed in ([5, 6], [-3, 2**40]):
        seed = tf.constant(seed, tf.int64)
        got = adaptive.noised_unclipped_fraction(
            tf.constant(0.0), count_stddev=2.5, expected_batch_size=1.0, seed=seed
        )
        stream = tf.random.experimental.stateless_fold_in(seed, tf.constant(2**31 - 1, tf.int64))
        z = aggregation.standard_normal([tf.zeros([])], seed=stream)[0]
        assert float(got) - 0.5 == pytest.approx(2.5 * float(z), rel=1e-12, abs=1e-12)


# ------------------------------------------------------------------- the bound's range at run time
def zero_kernel_releases(model, step, x, steps):
    """The released (noised, divided) sums of ``steps`` steps, each from a zero kernel."""
    kernel = model.trainable_variables[0]
    out = []
    for _ in range(steps):
        kernel.assign(tf.zeros(kernel.shape))
        step(x)
        out.append(-kernel.numpy().ravel())
    return np.concatenate(out)


def test_at_the_floor_of_the_bound_every_release_is_noised():
    """CPU kernels flush float32 subnormals to zero: with the floor at 2^-126, a noise value
    σ_Δ C z below 2^-126 was exactly 0 and the release the clipped sum without noise (at
    C = 2^-120, 1.2 % of the steps). At the floor 2^-30, with the σ_Δ >= 2^-10 that the
    optimizer accepts, the std is at least 2^-40 and no coordinate of 4096 draws equals the
    un-noised clipped sum. Below the floor an initial bound is refused; an update with a large η
    stops at the floor."""
    from dpcore import adaptive

    d, b = 1024, 2
    x = np.zeros((b, d), "float32")
    x[0] = 1.0  # norm 32, clipped to C: each coordinate C / 32 (a normal float32)

    def releases(sigma, count_stddev, steps, eta=0.0):
        model = linear_model(d)
        opt = adaptive_opt(
            lr=1.0,
            clip=adaptive.MIN_CLIP,
            sigma=sigma,
            count_stddev=count_stddev,
            eta=eta,
            expected_batch_size=b,
            seed=11,
        )
        return zero_kernel_releases(model, step_fn(model, opt), x, steps), opt

    exact, _ = releases(0.0, 0.0, 1)
    np.testing.assert_allclose(exact, adaptive.MIN_CLIP / 32 / b, rtol=1e-6)  # atol 0
    noised, _ = releases(1.0, 1.0, 4)  # σ_Δ = 1.155
    assert np.count_nonzero(noised == np.tile(exact, 4)) == 0
    assert np.std(noised) == pytest.approx(1.155 * adaptive.MIN_CLIP / b, rel=0.05)

    for clip in (2.0**-120, 2.0**-35, 2.0**61):
        with pytest.raises(ValueError, match="l2_norm_clip"):
            adaptive_opt(clip=clip, sigma=1.0, count_stddev=1.0)
    # The smallest σ_Δ the optimizer accepts is 2^-10, the largest 2^40 (σ_Δ C at the floor and
    # at the ceiling of C within [2^-40, 2^100]).
    with pytest.raises(ValueError, match=r"outside \[2\^-10, 2\^40\]"):
        adaptive_opt(clip=1.0, sigma=2.0**-11, count_stddev=1.0)
    with pytest.raises(ValueError, match=r"outside \[2\^-10, 2\^40\]"):
        adaptive_opt(clip=1.0, sigma=2.0**41, count_stddev=2.0**41)
    opt = adaptive_opt(clip=1.0, sigma=1.0, count_stddev=1.0)
    with pytest.raises(ValueError, match=r"outside \[2\^-10, 2\^40\]"):
        opt.noise_multiplier = 2.0**-11  # a schedule too
    assert opt.noise_multiplier == 1.0

    # η = 100 (C moves by up to e^50 per step) reaches the floor and stops there.
    model = linear_model(1)
    opt = adaptive_opt(clip=1.0, sigma=1.0, count_stddev=1.0, eta=100.0, expected_batch_size=b)
    step = step_fn(model, opt)
    clips = []
    for t in range(8):
        step(np.full((b, 1), float(t % 2), "float32"))
        clips.append(clip_of(opt))
    assert min(clips) == adaptive.MIN_CLIP and max(clips) <= adaptive.MAX_CLIP


@pytest.mark.parametrize("order", ["larger_bound_first", "larger_bound_last"])
def test_a_micro_batch_clipped_to_another_bound_fails_the_step(order):
    """The noise of a step is scaled to the optimizer's C. A micro-batch clipped to 100 while
    C = 1 (through aggregation.clip rather than DPOptimizer.clip) got noise std 1.02 for a
    contribution of 50; the fixed-bound optimizer refuses such a step, and the adaptive one now
    fails it when it runs, before anything of it is accumulated or applied."""
    var = keras.Variable([0.0])
    opt = adaptive_opt(
        lr=1.0, clip=1.0, sigma=1.0, count_stddev=10.0, eta=0.0, expected_batch_size=1,
        accumulation_steps=2, seed=3,
    )  # fmt: skip
    opt.build([var])

    @tf.function
    def micro(own_bound):
        summary = fake_summary([[2500.0]], [1.0], var)  # one example of norm 50
        if own_bound:
            clipped = opt.clip(summary)
        else:
            clipped = aggregation.clip(summary, l2_norm_clip=100.0, count_unclipped=True)
        opt.apply_clipped_sum(clipped, [var])

    if order == "larger_bound_last":
        micro(True)
    before = var.numpy().copy()
    state = opt.dp_state
    accumulated = [a.numpy().copy() for a in opt._accumulators]
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"l2_sensitivity\] \[100\] \[is not the optimizer.+s adaptive l2_norm_clip\] \[1\]",
    ):
        micro(False)
    np.testing.assert_array_equal(var.numpy(), before)
    assert opt.dp_state == state
    for a, want in zip(opt._accumulators, accumulated):
        np.testing.assert_array_equal(a.numpy(), want)


def test_a_restored_bound_out_of_range_fails_the_step(tmp_path, rng):
    """C is a variable a checkpoint restores without a check. C = 0 or -1 ran (and the next C was
    the floor), C = inf released -inf, a C above the ceiling overflows the noise std. The step now
    fails unless C is finite and within [MIN_CLIP, MAX_CLIP], and nothing of the optimizer's
    state moves: the weights, C, the released fraction, dp_steps."""
    x = rng.normal(size=(8, 4)).astype("float32")
    model, opt = linear_model(), adaptive_opt(lr=1.0, sigma=1.0, count_stddev=2.0, seed=5)
    step_fn(model, opt)(x)
    opt._adaptive_clip_var.assign(-1.0)  # what a corrupted or foreign checkpoint holds
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))

    fresh_model, fresh = linear_model(), adaptive_opt(lr=1.0, sigma=1.0, count_stddev=2.0, seed=5)
    fresh.build(fresh_model.trainable_variables)
    tf.train.Checkpoint(model=fresh_model, optimizer=fresh).restore(path).assert_consumed()
    assert clip_of(fresh) == -1.0
    step = step_fn(fresh_model, fresh)
    before = fresh_model.trainable_variables[0].numpy().copy()
    state = fresh.dp_state
    fraction = float(fresh.adaptive_logs()["unclipped_fraction"])
    for bad in (-1.0, 0.0, 2.0**-31, math.inf, math.nan, 2.0**61):
        fresh._adaptive_clip_var.assign(bad)
        with pytest.raises(
            tf.errors.InvalidArgumentError,
            match=r"adaptive l2_norm_clip must be finite and within \[2\^-30, 2\^60\]",
        ):
            step(x)
        np.testing.assert_array_equal(fresh_model.trainable_variables[0].numpy(), before)
        assert fresh.dp_state == dataclasses.replace(state, l2_norm_clip=bad) or math.isnan(bad)
        assert int(fresh.dp_steps) == state.dp_steps
        assert float(fresh.adaptive_logs()["unclipped_fraction"]) == fraction


def test_at_the_ceiling_of_the_bound_the_noise_is_finite():
    """At C = 2^127 the noise std σ_Δ C (σ = σ_b = 3: 5.9e38) overflowed float32 and the step
    released -inf. The ceiling is 2^60: with σ_Δ <= 2^40 the std stays below 2^100."""
    from dpcore import adaptive

    model = linear_model(1)
    opt = adaptive_opt(
        lr=1.0, clip=adaptive.MAX_CLIP, sigma=3.0, count_stddev=3.0, eta=0.0,
        expected_batch_size=2, seed=5,
    )  # fmt: skip
    releases = zero_kernel_releases(model, step_fn(model, opt), np.ones((2, 1), "float32"), 3)
    assert np.all(np.isfinite(releases)) and np.all(np.abs(releases) > 2.0**55)
