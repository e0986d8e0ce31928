"""dpcore.callbacks with a tiny plain Keras model (no DP optimizer needed)."""

import glob
import json
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpcore import accounting as acc
from dpcore.accounting import calibration
from dpcore.callbacks import EpsilonCallback, PrivacyBudgetGuard
from dpcore.config import DPConfig
from dpcore.optimizer import DPState

N, B = 32, 8
FAST = 1e-3


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 3)).astype("float32"), rng.normal(size=(N, 1)).astype("float32")


def _model(optimizer=None):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.01), loss="mse")
    return model


def _config(**kw):
    base = dict(
        l2_norm_clip=1.0,
        noise_multiplier=2.0,
        expected_batch_size=B,
        num_examples=N,
        steps=100,
        target_delta=1e-3,
    )
    return DPConfig(**{**base, **kw})


class CountingSGD(keras.optimizers.SGD):
    """Stands in for a DP optimizer: exposes `dp_steps` (one logical step per 2 applies)
    and a Python `noise_multiplier` through `dp_state`."""

    def __init__(self, noise_multiplier=2.0, **kw):
        super().__init__(learning_rate=0.01, **kw)
        self.noise_multiplier = noise_multiplier
        self.dp_steps = self.add_variable(shape=(), dtype="int64", name="dp_steps")

    def apply(self, grads, trainable_variables=None):
        super().apply(grads, trainable_variables)
        self.dp_steps.assign_add(tf.cast(tf.equal(self.iterations % 2, 0), tf.int64))

    @property
    def dp_state(self):  # the typed view the callbacks read (dpcore.optimizer.DPStateSource)
        return DPState(
            dp_steps=int(self.dp_steps.numpy()),
            pending_micro_steps=0,
            noise_multiplier=float(self.noise_multiplier),
        )


def _eps(event, accountant="pld"):
    return acc.compute_epsilon(
        event, target_delta=1e-3, accountant=accountant, pld_discretization=FAST
    )


def test_epsilon_in_logs_history_tensorboard_and_ledger_file(tmp_path):
    x, y = _data()
    cfg = _config()
    cb = EpsilonCallback(
        cfg,
        log_dir=str(tmp_path / "tb"),
        ledger_path=str(tmp_path / "ledger.json"),
        pld_discretization=FAST,
        also_rdp=True,
    )
    history = _model().fit(x, y, batch_size=B, epochs=3, callbacks=[cb], verbose=0).history
    eps = history["epsilon"]
    assert len(eps) == 3 and eps[0] < eps[1] < eps[2]
    for epoch, value in enumerate(eps):
        steps = 4 * (epoch + 1)
        event = acc.poisson_event(noise_multiplier=2.0, sampling_prob=B / N, steps=steps)
        assert value == _eps(event)
        assert history["epsilon_rdp"][epoch] == _eps(event, "rdp")
    assert cb.ledger.steps == 12

    # TensorBoard scalars hold the same values.
    files = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert files
    seen = {}
    for path in files:
        for record in tf.compat.v1.train.summary_iterator(path):
            for v in record.summary.value:
                if v.tag == "epsilon":
                    seen[record.step] = float(tf.make_ndarray(v.tensor))
    assert sorted(seen) == [0, 1, 2]
    np.testing.assert_allclose([seen[i] for i in range(3)], eps, rtol=1e-6)

    # The ledger file restores to the same ε, and a resumed fit continues it.
    saved = json.loads((tmp_path / "ledger.json").read_text())
    restored = acc.PrivacyLedger.from_dict(saved["ledger"])
    assert restored.epsilon(target_delta=1e-3, pld_discretization=FAST) == eps[-1]
    assert DPConfig.from_dict(saved["config"]) == cfg
    resumed = EpsilonCallback(cfg, ledger=restored, pld_discretization=FAST)
    more = _model().fit(x, y, batch_size=B, epochs=1, callbacks=[resumed], verbose=0)
    assert restored.steps == 16
    event = acc.poisson_event(noise_multiplier=2.0, sampling_prob=B / N, steps=16)
    assert more.history["epsilon"][0] == _eps(event)


def test_counts_optimizer_dp_steps_and_records_a_sigma_schedule():
    x, y = _data()
    opt = CountingSGD(noise_multiplier=2.0)
    model = _model(opt)

    def schedule(epoch, logs=None):
        opt.noise_multiplier = 2.0 if epoch == 0 else 4.0

    cb = EpsilonCallback(_config(), pld_discretization=FAST)
    history = model.fit(
        x,
        y,
        batch_size=B,
        epochs=2,
        callbacks=[keras.callbacks.LambdaCallback(on_epoch_begin=schedule), cb],
        verbose=0,
    ).history
    assert int(opt.dp_steps.numpy()) == 4  # 8 batches, one logical step per 2
    assert cb.ledger.segments == [
        {"noise_multiplier": 2.0, "sampling_prob": B / N, "steps": 2},
        {"noise_multiplier": 4.0, "sampling_prob": B / N, "steps": 2},
    ]
    assert history["epsilon"][-1] == _eps(cb.ledger.dp_event())


def test_optimizer_ahead_of_the_ledger_is_synced_with_a_warning():
    x, y = _data()
    opt = CountingSGD(noise_multiplier=2.0)
    model = _model(opt)
    opt.dp_steps.assign(5)
    cb = EpsilonCallback(_config(), pld_discretization=FAST)
    with pytest.warns(UserWarning, match="missing"):
        model.fit(x, y, batch_size=B, epochs=1, callbacks=[cb], verbose=0)
    assert cb.ledger.steps == int(opt.dp_steps.numpy()) == 7


def test_shuffle_mode_counts_one_gaussian_per_keras_epoch():
    x, y = _data()
    cfg = _config(sampling="shuffle", noise_multiplier=5.0)
    cb = EpsilonCallback(cfg, pld_discretization=FAST, report_poisson_assumption=True)
    history = _model().fit(x, y, batch_size=B, epochs=3, callbacks=[cb], verbose=0).history
    assert cb.ledger.epochs == 3
    sound = acc.shuffle_event(noise_multiplier=5.0, steps_per_epoch=4, steps=12)
    assert history["epsilon"][-1] == _eps(sound)
    assumed = acc.poisson_event(noise_multiplier=5.0, sampling_prob=B / N, steps=12)
    assert history["epsilon_assuming_poisson"][-1] == _eps(assumed)
    assert history["epsilon"][-1] > history["epsilon_assuming_poisson"][-1]


def test_budget_guard_stops_before_exceeding_the_target():
    x, y = _data()
    cfg = _config(noise_multiplier=4.0)
    target = 1.2
    opt = keras.optimizers.SGD(0.01)
    model = _model(opt)
    guard = PrivacyBudgetGuard(target_epsilon=target, config=cfg, accountant="rdp", verbose=0)
    model.fit(x, y, batch_size=B, epochs=50, callbacks=[guard], verbose=0)
    done = int(opt.iterations.numpy())
    assert 0 < done < 100
    assert done == guard.max_steps == guard.stopped_at

    def eps(steps):
        return _eps(
            acc.poisson_event(noise_multiplier=4.0, sampling_prob=B / N, steps=steps), "rdp"
        )

    assert eps(done) <= target < eps(done + 1)


def test_budget_guard_counts_spent_steps_and_refuses_an_exhausted_budget():
    x, y = _data()
    cfg = _config(noise_multiplier=4.0)
    spent = cfg.new_ledger()
    spent.record_steps(steps=10, noise_multiplier=4.0, sampling_prob=B / N)
    guard = PrivacyBudgetGuard(
        target_epsilon=1.2, config=cfg, ledger=spent, accountant="rdp", verbose=0
    )
    opt = keras.optimizers.SGD(0.01)
    _model(opt).fit(x, y, batch_size=B, epochs=50, callbacks=[guard], verbose=0)
    fresh = calibration.calibrate_steps(
        target_epsilon=1.2,
        target_delta=1e-3,
        noise_multiplier=4.0,
        sampling_prob=B / N,
        accountant="rdp",
        num_examples=N,
    )
    assert int(opt.iterations.numpy()) == fresh - 10
    assert spent.steps == 10  # the guard does not modify the caller's ledger

    spent.record_steps(steps=10_000, noise_multiplier=4.0, sampling_prob=B / N)
    guard = PrivacyBudgetGuard(
        target_epsilon=1.2, config=cfg, ledger=spent, accountant="rdp", verbose=0
    )
    with pytest.raises(RuntimeError, match="budget exhausted"):
        _model().fit(x, y, batch_size=B, epochs=1, callbacks=[guard], verbose=0)


def test_callbacks_reject_bad_arguments():
    cfg = _config()
    with pytest.raises(ValueError, match="config"):
        EpsilonCallback({"noise_multiplier": 1.0})
    with pytest.raises(ValueError, match=r"accountant.*gdp"):
        EpsilonCallback(cfg, accountant="gdp")
    with pytest.raises(ValueError, match="does not match"):
        EpsilonCallback(cfg, ledger=acc.PrivacyLedger(num_examples=N + 1))
    with pytest.raises(ValueError, match=r"target_epsilon.*0"):
        PrivacyBudgetGuard(target_epsilon=0, config=cfg)
    assert not os.path.exists("ledger.json")


def test_sigma_schedule_with_a_dp_optimizer_is_recorded_as_it_ran():
    """A callback changes σ between epochs: the steps run with the new σ (measured on
    noise-only updates) and the ledger records exactly that schedule."""
    import dpcore

    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(50)])
    opt = dpcore.DPOptimizer(
        keras.optimizers.SGD(4.0),
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        seed=1,
    )
    dp = dpcore.make_private(model, optimizer=opt, loss=keras.losses.MeanSquaredError())
    n = 4  # all-padding batches: every update is noise only, std lr * sigma * C / 4 = sigma
    ds = tf.data.Dataset.from_tensor_slices(
        (
            np.zeros((n, 4, 20), "float32"),
            np.zeros((n, 4, 50), "float32"),
            np.zeros((n, 4), "float32"),
            np.ones(n, bool),
        )
    )
    # A hand-made dataset declares the sampling it stands for (a Poisson account refuses
    # (x, y, mask, step_end) data that carries no spec).
    ds = dpcore.sampling.with_sampling_spec(
        ds,
        dpcore.sampling.SamplingSpec(
            sampling="poisson",
            num_examples=100,
            sampling_prob=0.04,
            expected_batch_size=4.0,
            steps=n,
            padded_batch_size=4,
        ),
    )
    schedule, stds = {0: 1.0, 1: 4.0}, []

    class Schedule(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            opt.noise_multiplier = schedule[epoch]
            self.kernel = model.layers[-1].kernel.numpy().copy()

        def on_epoch_end(self, epoch, logs=None):
            stds.append((model.layers[-1].kernel.numpy() - self.kernel).std() / np.sqrt(n))

    cfg = _config(num_examples=100, expected_batch_size=4, steps=2 * n)
    cb = EpsilonCallback(cfg, pld_discretization=FAST)
    dp.fit(ds, epochs=2, verbose=0, callbacks=[Schedule(), cb])
    tol = 4 / np.sqrt(2 * n * 20 * 50)
    for sigma, std in zip(schedule.values(), stds):
        assert abs(std - sigma) < tol * sigma * 2
    assert [(s["noise_multiplier"], s["steps"]) for s in cb.ledger.segments] == [(1.0, n), (4.0, n)]


def test_guard_counts_micro_batches_carried_over_between_epochs():
    """accumulation_steps=2 with 3 micro-batches per epoch: the odd micro-batch of each epoch is
    dropped (a step never spans two epochs), so each Keras epoch applies one logical step. The
    budget is one pass of the config (2 steps, one Gaussian), but every Keras epoch reshuffles
    the arrays, so the second epoch's step starts a second pass, as EpsilonCallback counts it:
    the guard stops after one step, where the reported epsilon is still within the target."""
    import dataclasses

    import dpcore

    n, micro, acc = 30, 10, 2
    cfg = DPConfig(
        l2_norm_clip=1.0,
        noise_multiplier=2.0,
        expected_batch_size=micro * acc,
        num_examples=n,
        steps=100,
        accumulation_steps=acc,
        target_delta=1e-3,
        sampling="shuffle",  # what fit on arrays runs: fixed-size shuffled batches
    )
    target = dataclasses.replace(cfg, steps=cfg.steps_per_epoch).epsilon()  # one pass
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    dp = dpcore.make_private(
        model, optimizer=keras.optimizers.SGD(0.1), loss="mse", config=cfg, seed=0
    )
    guard = PrivacyBudgetGuard(target_epsilon=target, config=cfg, verbose=0)
    eps = EpsilonCallback(cfg)
    rng = np.random.default_rng(0)
    x, y = rng.random((n, 5), dtype=np.float32), rng.random((n, 1), dtype=np.float32)
    dp.fit(x, y, batch_size=micro, epochs=10, verbose=0, callbacks=[guard, eps])
    assert cfg.steps_per_epoch == 2
    assert int(dp.optimizer.dp_steps) == 1 and guard.stopped_at == 1 and guard.max_steps == 1
    assert eps.ledger.steps == 1 and eps.epsilon() <= target
    one_more = eps.ledger.copy()
    one_more.end_epoch()
    one_more.record_steps(steps=1, noise_multiplier=2.0, sampling_prob=cfg.sampling_prob)
    assert one_more.epsilon(target_delta=cfg.target_delta) > target


def test_guard_closes_a_pass_at_every_keras_epoch_under_shuffle_accounting():
    """Under shuffle accounting each Keras epoch is a new pass (one more Gaussian per example).
    With epochs shorter than the config's pass (fewer rows, or larger batches), the guard used to
    count several Keras epochs as one pass and ran to 3.14 against a target of 2.05; it now stops
    where EpsilonCallback's epsilon is at most the target. On arrays fit now refuses those
    layouts (another N than the config's, a batch_size other than its own)."""
    import dpcore

    cfg = DPConfig(
        l2_norm_clip=1.0,
        noise_multiplier=2.0,
        expected_batch_size=20,
        num_examples=200,
        steps=1000,
        sampling="shuffle",
        target_delta=1e-3,
    )
    two_passes = cfg.new_ledger()
    for _ in range(2):
        two_passes.record_steps(
            steps=cfg.steps_per_epoch, noise_multiplier=2.0, sampling_prob=cfg.sampling_prob
        )
        two_passes.end_epoch()
    target = two_passes.epsilon(target_delta=cfg.target_delta, pld_discretization=FAST)
    rng = np.random.default_rng(0)
    x, y = rng.random((200, 5), dtype=np.float32), rng.random((200, 1), dtype=np.float32)
    # Arrays: fit trains on the config's N rows in batches of its size, or refuses.
    for kwargs, refusal in (
        ({"batch_size": 20, "validation_split": 0.5}, "num_examples=200"),
        ({"batch_size": 40}, "batch_size=40"),
    ):
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        dp = dpcore.make_private(
            model, optimizer=keras.optimizers.SGD(0.1), loss="mse", config=cfg, seed=0
        )
        with pytest.raises(ValueError, match=refusal):
            dp.fit(x, y, epochs=50, verbose=0, **kwargs)
        assert int(dp.optimizer.dp_steps) == 0
    # Batched datasets of the user's own (shuffle accounting takes them as they are).
    for data in (
        tf.data.Dataset.from_tensor_slices((x[:100], y[:100])).batch(20),
        tf.data.Dataset.from_tensor_slices((x, y)).batch(40),
    ):
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        dp = dpcore.make_private(
            model, optimizer=keras.optimizers.SGD(0.1), loss="mse", config=cfg, seed=0
        )
        guard = PrivacyBudgetGuard(
            target_epsilon=target, config=cfg, verbose=0, pld_discretization=FAST
        )
        eps = EpsilonCallback(cfg, pld_discretization=FAST)
        dp.fit(data, epochs=50, verbose=0, callbacks=[guard, eps])
        assert eps.ledger.epochs == 2 and int(dp.optimizer.dp_steps) == 10  # two short epochs
        assert eps.epsilon() <= target
        assert guard.stopped_at == 10


def test_a_sigma_set_by_a_later_callback_is_accounted_as_it_ran():
    """The optimizer logs every σ it is given with the steps applied so far, and the callbacks
    account each step with the σ it ran with, whatever the callbacks' order: a σ lowered for the
    last step by a callback listed after EpsilonCallback was booked at the old σ (ε 0.64
    reported against 10.30), and PrivacyBudgetGuard kept the step limit of the first σ."""
    import dp_accounting

    import dpcore

    n, b, steps = 200, 20, 20
    cfg = DPConfig(
        l2_norm_clip=1.0,
        noise_multiplier=2.0,
        expected_batch_size=b,
        num_examples=n,
        steps=steps,
        target_delta=1e-3,
    )
    rng = np.random.default_rng(0)
    x, y = rng.random((n, 5), dtype=np.float32), rng.random((n, 1), dtype=np.float32)

    def make():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        return dpcore.make_private(
            model, optimizer=keras.optimizers.SGD(0.1), loss="mse", config=cfg, seed=0
        )

    class Schedule(keras.callbacks.Callback):
        def __init__(self, dp, last):
            super().__init__()
            self.dp, self.last, self.ran = dp, last, []

        def on_train_batch_begin(self, batch, logs=None):
            self.dp.optimizer.noise_multiplier = 2.0 if batch < self.last else 0.3

        def on_train_batch_end(self, batch, logs=None):
            self.ran.append(self.dp.optimizer.noise_multiplier)

    dp = make()
    schedule = Schedule(dp, steps - 1)
    cb = EpsilonCallback(cfg, pld_discretization=FAST)
    data = dpcore.sampling.poisson_batches(
        x, y, sampling_prob=cfg.sampling_prob, steps=steps, seed=1
    )
    dp.fit(data, epochs=1, verbose=0, callbacks=[cb, schedule])
    assert schedule.ran == [2.0] * (steps - 1) + [0.3]
    assert cb.ledger.segments == [
        {"noise_multiplier": 2.0, "sampling_prob": cfg.sampling_prob, "steps": steps - 1},
        {"noise_multiplier": 0.3, "sampling_prob": cfg.sampling_prob, "steps": 1},
    ]
    ran = dp_accounting.ComposedDpEvent(
        [
            acc.poisson_event(noise_multiplier=s, sampling_prob=cfg.sampling_prob, steps=1)
            for s in schedule.ran
        ]
    )
    np.testing.assert_allclose(cb.epsilon(), _eps(ran), rtol=1e-9)

    # The guard: σ 2.0 for the first epoch's 10 steps, then 1.0; its limit follows the new σ.
    planned = cfg.new_ledger()
    planned.record_steps(steps=30, noise_multiplier=2.0, sampling_prob=cfg.sampling_prob)
    target = planned.epsilon(target_delta=cfg.target_delta, pld_discretization=FAST)
    dp = make()

    class Lower(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            dp.optimizer.noise_multiplier = 2.0 if epoch == 0 else 1.0

    guard = PrivacyBudgetGuard(
        target_epsilon=target, config=cfg, verbose=0, pld_discretization=FAST
    )
    cb = EpsilonCallback(cfg, pld_discretization=FAST)
    data = dpcore.sampling.poisson_batches(x, y, sampling_prob=cfg.sampling_prob, steps=10, seed=1)
    dp.fit(data, epochs=50, verbose=0, callbacks=[Lower(), guard, cb])
    assert cb.epsilon() <= target
    assert int(dp.optimizer.dp_steps) == guard.stopped_at and guard.stopped_at < 30
    one_more = cb.ledger.copy()
    one_more.record_steps(steps=1, noise_multiplier=1.0, sampling_prob=cfg.sampling_prob)
    assert one_more.epsilon(target_delta=cfg.target_delta, pld_discretization=FAST) > target


@pytest.mark.parametrize("callback", ["epsilon", "guard"])
def test_poisson_account_of_keras_batches_is_refused(callback):
    """fit on arrays under sampling="shuffle" runs Keras's fixed-size shuffled batches: a Poisson
    epsilon for them would be an assumption, so both privacy callbacks refuse it before the first
    step; a dataset of (x, y) batches that carries no SamplingSpec is refused too (it only warned,
    and reported the Poisson figure: 3.31 where the sound one for its shuffled batches was
    8.79), by fit itself under sampling="poisson"."""
    import dpcore

    cfg = _config()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    dp = dpcore.make_private(model, optimizer="sgd", loss="mse", config=cfg, seed=0)
    cb = (
        EpsilonCallback(cfg)
        if callback == "epsilon"
        else PrivacyBudgetGuard(target_epsilon=5.0, config=cfg)
    )
    x, y = _data()
    keras_batches = dpcore.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
        optimizer="sgd",
        loss="mse",
        sampling="shuffle",  # Keras's batches of arrays (fit's default samples Poisson ones)
        l2_norm_clip=cfg.l2_norm_clip,
        noise_multiplier=cfg.noise_multiplier,
        expected_batch_size=cfg.expected_batch_size,
        seed=0,
    )
    with pytest.raises(ValueError, match="poisson_batches"):
        keras_batches.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[cb])
    assert int(keras_batches.optimizer.dp_steps) == 0  # refused before any step ran
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    with pytest.raises(ValueError, match="poisson_batches"):
        dp.fit(ds, epochs=1, verbose=0, callbacks=[cb])
    assert int(dp.optimizer.dp_steps) == 0  # untagged (x, y) batches: refused too
    fresh = dpcore.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
        optimizer="sgd",
        loss="mse",
        config=_config(sampling="shuffle"),
        seed=0,
    )
    shuffled = dpcore.sampling.shuffled_batches(x, y, batch_size=B, epochs=1, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.fit(shuffled, verbose=0, callbacks=[EpsilonCallback(_config(sampling="shuffle"))])
    assert not [w for w in caught if issubclass(w.category, (UserWarning, RuntimeWarning))]


def test_guard_counts_the_optimizers_steps_not_the_configs_accumulation():
    """The guard's in-epoch count divided batches by the config's accumulation_steps, which
    nothing ties to the optimizer's: with a config saying 4 and an optimizer applying a step per
    batch it allowed 11 steps against a limit of 2. It now reads the optimizer's step count."""
    import dpcore

    n, b, steps = 256, 16, 40
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    opt = dpcore.DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=b
    )
    dp = dpcore.make_private(
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]),
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    cfg = DPConfig(
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=b,
        num_examples=n,
        steps=steps,
        accumulation_steps=4,
    )
    target = 1.5
    guard = PrivacyBudgetGuard(
        target_epsilon=target, config=cfg, verbose=0, pld_discretization=FAST
    )
    eps = EpsilonCallback(cfg, pld_discretization=FAST)
    data = dpcore.sampling.poisson_batches(x, y, sampling_prob=b / n, steps=steps, seed=1)
    dp.fit(data, epochs=1, verbose=0, callbacks=[guard, eps])
    assert int(opt.dp_steps.numpy()) == guard.stopped_at < 11  # 11 ran before
    assert eps.epsilon() <= target
    one_more = eps.ledger.copy()
    one_more.record_steps(steps=1, noise_multiplier=1.0, sampling_prob=b / n)
    assert one_more.epsilon(target_delta=cfg.target_delta, pld_discretization=FAST) > target


@pytest.mark.parametrize("sampling", ["shuffle", "poisson"])
def test_a_per_user_account_of_untagged_rows_is_refused(sampling):
    """A config per user (units of several rows) on data that carries no SamplingSpec: nothing
    says a user's rows are clipped together, and with one row per clip a user of 4 rows moved
    the update by 4 C while EpsilonCallback reported epsilon per user. Refused before any step,
    on arrays and on a dataset alike."""
    import dataclasses

    import dpcore

    cfg = dataclasses.replace(_config(sampling=sampling), privacy_unit="user")
    x, y = _data()
    for fit_args in ((x, y), (tf.data.Dataset.from_tensor_slices((x, y)).batch(B),)):
        dp = dpcore.make_private(
            keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
            optimizer="sgd",
            loss="mse",
            config=cfg,
            seed=0,
        )
        kwargs = {"batch_size": B} if len(fit_args) == 2 else {}
        # Under Poisson fit refuses the batches itself, and on arrays its own sampler's spec
        # names the example unit.
        refusal = "per 'user'|privacy_unit='user'|batches without a dpcore.sampling.SamplingSpec"
        with pytest.raises(ValueError, match=refusal):
            dp.fit(*fit_args, epochs=1, verbose=0, callbacks=[EpsilonCallback(cfg)], **kwargs)
        assert int(dp.optimizer.dp_steps) == 0
