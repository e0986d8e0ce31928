"""ε spent: a DPModel reports the ε of the steps its optimizer applied, keeps its ledger across
save/load, and stops at an ε budget. Every figure is checked against dp-accounting itself."""

import csv
import math
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
from dp_accounting import pld

import dpcore
from dpcore import sampling
from dpcore.accounting import PrivacyLedger
from dpcore.callbacks import EpsilonCallback
from tests.models import dense_model

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
N, BATCH, DELTA = 60, 12, 1e-3


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 4)).astype("float32"), rng.integers(0, 3, N)


def _config(**overrides):
    fields = dict(
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=BATCH,
        num_examples=N,
        steps=5,
        target_delta=DELTA,
    )
    return dpcore.DPConfig(**(fields | overrides))


def _private(config, **kwargs):
    return dpcore.make_private(
        dense_model(),
        config=config,
        optimizer=keras.optimizers.SGD(0.1),
        loss=LOSS,
        seed=1,
        **kwargs,
    )


def _batches(config, seed=3, start_step=0):
    x, y = _data()
    return sampling.poisson_batches(
        x,
        y,
        sampling_prob=config.sampling_prob,
        steps=config.steps,
        seed=seed,
        start_step=start_step,
    )


def _dp_accounting_epsilon(segments, delta=DELTA, q=BATCH / N):
    """The reference: dp-accounting's own PLD accountant on Poisson-sampled Gaussian steps."""
    accountant = pld.PLDAccountant()
    for steps, sigma in segments:
        accountant.compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
            )
        )
    return accountant.get_epsilon(delta)


def test_three_times_the_planned_steps_report_the_epsilon_spent_not_the_plan(tmp_path, capsys):
    """The README case: a config planned for 5 steps, fit for 3 passes of them (15 steps), no
    privacy callback. History, the progress bar, CSVLogger and dp_model.epsilon() all say the
    ε of 15 steps (dp-accounting's), not the plan's."""
    config = _config()
    dp_model = _private(config)
    log = tmp_path / "log.csv"
    history = dp_model.fit(
        _batches(config), epochs=3, verbose=2, callbacks=[keras.callbacks.CSVLogger(str(log))]
    )
    assert int(dp_model.optimizer.dp_steps) == 3 * config.steps
    want = [_dp_accounting_epsilon([(k * config.steps, 1.0)]) for k in (1, 2, 3)]
    assert history.history["epsilon"] == pytest.approx(want, rel=1e-12)
    assert dp_model.epsilon() == pytest.approx(want[-1], rel=1e-12)
    assert dp_model.epsilon() > 1.5 * config.planned_epsilon()
    assert f"epsilon: {want[-1]:.4f}" in capsys.readouterr().out
    with open(log, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["epsilon"]) for r in rows] == pytest.approx(want, rel=1e-6)
    # Other δ, RDP, user level: the same ledger through dp-accounting.
    assert dp_model.epsilon(target_delta=1e-5) == pytest.approx(
        _dp_accounting_epsilon([(15, 1.0)], delta=1e-5), rel=1e-12
    )
    ledger = dp_model.privacy_ledger
    assert ledger.steps == 15 and ledger.segments == [
        {"noise_multiplier": 1.0, "sampling_prob": BATCH / N, "steps": 15}
    ]
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(ledger.dp_event())
    assert dp_model.epsilon("rdp") == pytest.approx(rdp.get_epsilon(DELTA), rel=1e-12)
    assert dp_model.epsilon(max_examples_per_user=2) > dp_model.epsilon()


def test_a_noise_schedule_is_accounted_as_it_ran():
    """σ set by a callback between epochs: each step with the σ it ran with."""

    class Schedule(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.model.optimizer.noise_multiplier = [1.0, 0.7, 1.3][epoch]

    config = _config()
    dp_model = _private(config)
    history = dp_model.fit(_batches(config), epochs=3, verbose=0, callbacks=[Schedule()])
    segments = [(5, 1.0), (5, 0.7), (5, 1.3)]
    assert history.history["epsilon"][-1] == pytest.approx(
        _dp_accounting_epsilon(segments), rel=1e-12
    )
    assert history.history["epsilon"][1] == pytest.approx(
        _dp_accounting_epsilon(segments[:2]), rel=1e-12
    )


def test_saved_model_keeps_its_ledger_and_continues_it_without_a_warning(tmp_path):
    """save (.keras) / load_model / fit again: no 'restore the ledger' warning, and the ε is
    that of every step applied, before and after the save, each with its σ."""
    config = _config()
    dp_model = _private(config)
    dp_model.fit(_batches(config), epochs=2, verbose=0)
    dp_model.optimizer.noise_multiplier = 0.8
    path = str(tmp_path / "model.keras")
    dp_model.save(path)
    loaded = keras.saving.load_model(path)
    assert int(loaded.optimizer.dp_steps) == 10
    assert loaded.privacy_ledger == dp_model.privacy_ledger
    assert loaded.target_delta == DELTA
    callback = EpsilonCallback(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        history = loaded.fit(
            _batches(config, start_step=10), epochs=1, verbose=0, callbacks=[callback]
        )
    want = _dp_accounting_epsilon([(10, 1.0), (5, 0.8)])
    assert loaded.epsilon() == pytest.approx(want, rel=1e-12)
    assert history.history["epsilon"][-1] == pytest.approx(want, rel=1e-12)
    assert callback.ledger == loaded.privacy_ledger  # the callback continued the model's ledger
    # The weights file carries it too.
    weights = str(tmp_path / "model.weights.h5")
    loaded.save_weights(weights)
    fresh = _private(config)
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(weights)
    assert fresh.privacy_ledger == loaded.privacy_ledger
    assert fresh.epsilon() == pytest.approx(want, rel=1e-12)


def test_unknown_history_refuses_epsilon_and_says_exactly_how_to_restore_it():
    """Steps applied without a ledger (a checkpoint that does not carry one): epsilon()
    refuses, fit warns naming the ways back, and giving the ledger back silences it."""
    config = _config()
    earlier = _private(config)
    earlier.fit(_batches(config), epochs=1, verbose=0)
    text = earlier.privacy_ledger.to_json()

    restored = _private(config)
    restored.optimizer.build(restored.trainable_variables)
    restored.optimizer.dp_steps.assign(5)  # what restoring the variables alone does
    with pytest.raises(ValueError, match=r"applied 5 logical steps .* holds 0"):
        restored.epsilon()
    with pytest.warns(UserWarning, match="missing from its privacy ledger") as record:
        restored.fit(_batches(config, start_step=5), epochs=1, verbose=0)
    (message,) = [str(w.message) for w in record if "privacy ledger" in str(w.message)]
    for way in ("keras.saving.load_model", "load_weights", "PrivacyLedger.from_json"):
        assert way in message
    assert restored.epsilon() == pytest.approx(_dp_accounting_epsilon([(10, 1.0)]), rel=1e-12)

    again = _private(config)
    again.optimizer.build(again.trainable_variables)
    again.optimizer.dp_steps.assign(5)
    again.privacy_ledger = PrivacyLedger.from_json(text)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        again.fit(_batches(config, start_step=5), epochs=1, verbose=0)
    assert again.epsilon() == pytest.approx(_dp_accounting_epsilon([(10, 1.0)]), rel=1e-12)


def test_epsilon_budget_on_make_private_stops_before_the_budget():
    """make_private(..., epsilon_budget=...) stops fit after the last step that keeps ε within
    the budget: the next step would exceed it (dp-accounting)."""
    config = _config()
    budget = 0.5 * (_dp_accounting_epsilon([(7, 1.0)]) + _dp_accounting_epsilon([(8, 1.0)]))
    dp_model = _private(config, epsilon_budget=budget)
    history = dp_model.fit(_batches(config), epochs=4, verbose=0)
    assert int(dp_model.optimizer.dp_steps) == 7
    assert dp_model.epsilon() <= budget < _dp_accounting_epsilon([(8, 1.0)])
    assert history.history["epsilon"][-1] == pytest.approx(dp_model.epsilon())
    with pytest.raises(RuntimeError, match="privacy budget exhausted"):  # nothing more fits
        dp_model.fit(_batches(config, start_step=7), epochs=1, verbose=0)
    assert int(dp_model.optimizer.dp_steps) == 7
    with pytest.raises(ValueError, match="epsilon_budget"):
        _private(config, epsilon_budget=0.0)


def test_arrays_are_accounted_as_the_sampling_that_ran():
    """fit(x, y): the reported ε is that of the sampling the model says it ran."""
    x, y = _data()
    dp_model = dpcore.make_private(
        dense_model(),
        optimizer="sgd",
        loss=LOSS,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=BATCH,
        target_delta=DELTA,
        seed=1,
    )
    history = dp_model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    steps = int(dp_model.optimizer.dp_steps)
    spec = dp_model.sampling_spec
    if (
        spec is None
    ):  # Keras's shuffled fixed-size batches: one Gaussian per pass (no amplification)
        event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.0), 2)
    else:
        assert spec.sampling == "poisson"
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                spec.sampling_prob, dp_accounting.GaussianDpEvent(1.0)
            ),
            steps,
        )
    accountant = pld.PLDAccountant()
    accountant.compose(event)
    assert history.history["epsilon"][-1] == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-12)
    assert math.isfinite(dp_model.epsilon())


def test_tensorboard_logs_epsilon(tmp_path):
    pytest.importorskip("tensorboard")
    import tensorflow as tf

    config = _config()
    dp_model = _private(config)
    dp_model.fit(
        _batches(config),
        epochs=1,
        verbose=0,
        callbacks=[keras.callbacks.TensorBoard(str(tmp_path))],
    )
    tags = set()
    for path in (tmp_path / "train").glob("events.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            tags |= {v.tag for v in event.summary.value}
    assert "epoch_epsilon" in tags
