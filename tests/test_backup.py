"""Tests for dpcore.backup.StepBackup on one worker (the 2-worker kill -9 test is in
tests/test_distribute.py): a run stopped mid-epoch and restarted from its folder ends with the
weights, dp_steps, noise and ε of an uninterrupted run."""

import json

import keras
import numpy as np
import pytest

import dpcore
from dpcore import sampling
from dpcore.backup import StepBackup
from tests.helpers import flat_weights
from tests.models import dense_model

N, Q, SPE, EPOCHS = 40, 0.25, 4, 3
TOTAL = SPE * EPOCHS
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Crash(Exception):
    pass


class _CrashAfter(keras.callbacks.Callback):
    """Stands for a preemption: the process stops after logical step `steps`."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.dp_steps.numpy()) == self.steps:
            raise Crash()


def _data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(N, 4)).astype("float32"), rng.integers(0, 3, N).astype("int32")


def _dp_model(seed=None):
    return dpcore.make_private(
        dense_model(),
        optimizer=keras.optimizers.SGD(0.5),
        loss=LOSS,
        l2_norm_clip=0.5,
        noise_multiplier=0.7,
        expected_batch_size=Q * N,
        seed=seed,
    )


def _config():
    return dpcore.DPConfig(
        l2_norm_clip=0.5,
        noise_multiplier=0.7,
        expected_batch_size=Q * N,
        num_examples=N,
        steps=TOTAL,
    )


def _run(folder, crash_after=None, save_every=1):
    """One start of the run in `folder`: returns (model, backup, epsilon callback)."""
    x, y = _data()
    dp = _dp_model()
    eps = dpcore.callbacks.EpsilonCallback(_config())
    backup = StepBackup(str(folder), save_every=save_every, epsilon=eps)
    start = backup.resume_step
    data = sampling.poisson_batches(
        x, y, sampling_prob=Q, steps=TOTAL - start, start_step=start, seed=backup.sampling_seed
    )
    callbacks = [eps, backup] + ([_CrashAfter(crash_after)] if crash_after else [])
    dp.fit(data, epochs=EPOCHS, steps_per_epoch=SPE, callbacks=callbacks, verbose=0)
    return dp, backup, eps


def _uninterrupted(sampling_seed, noise_seed):
    x, y = _data()
    dp = _dp_model(seed=noise_seed)
    eps = dpcore.callbacks.EpsilonCallback(_config())
    data = sampling.poisson_batches(x, y, sampling_prob=Q, steps=TOTAL, seed=sampling_seed)
    dp.fit(data, epochs=1, callbacks=[eps], verbose=0)
    return dp, eps


def test_resumed_mid_epoch_equals_an_uninterrupted_run(tmp_path):
    with pytest.raises(Crash):
        _run(tmp_path, crash_after=6)
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["applied_steps"] == state["checkpoint_steps"] == 6
    assert [p.name for p in tmp_path.glob("*.weights.h5")] == ["ckpt-6.weights.h5"]
    dp, backup, eps = _run(tmp_path)
    assert backup.resumed and backup.resume_step == 6
    assert int(dp.optimizer.dp_steps.numpy()) == TOTAL
    # The second start ran the rest of epoch 1 (6 = 1 * SPE + 2), then epoch 2.
    assert len(dp.history.history["loss"]) == 2
    noise_seed = [int(s) for s in dp.optimizer.noise_seed.numpy()]
    ref, ref_eps = _uninterrupted(backup.sampling_seed, noise_seed)
    # Same samples, same noise draws (sigma > 0): nothing lost, repeated or replayed.
    np.testing.assert_allclose(flat_weights(dp.model), flat_weights(ref.model), rtol=0, atol=1e-6)
    assert np.abs(flat_weights(dp.model) - flat_weights(_dp_model(seed=0).model)).max() > 0.05
    assert eps.ledger.steps == ref_eps.ledger.steps == TOTAL
    assert eps.epsilon() == ref_eps.epsilon()
    assert dp.epsilon() == ref.epsilon() == eps.epsilon()  # the model's own figure agrees


def test_steps_after_the_last_weights_stay_counted(tmp_path):
    with pytest.raises(Crash):
        _run(tmp_path, crash_after=6, save_every=4)
    state = json.loads((tmp_path / "state.json").read_text())
    assert (state["applied_steps"], state["checkpoint_steps"]) == (6, 4)
    with pytest.warns(UserWarning, match="2 steps in between are lost") as record:
        dp, backup, eps = _run(tmp_path, save_every=4)
    # The state carries the model's own ledger: its history is known, nothing is assumed.
    assert not [w for w in record if "privacy ledger" in str(w.message)]
    assert dp.privacy_ledger == eps.ledger and dp.epsilon() == eps.epsilon()
    assert backup.resume_step == 6
    assert int(dp.optimizer.dp_steps.numpy()) == TOTAL  # steps 5, 6 never run again
    assert eps.ledger.steps == TOTAL
    _, ref_eps = _uninterrupted(backup.sampling_seed, [0, 1])
    assert eps.epsilon() == ref_eps.epsilon()


def test_a_finished_run_restarts_with_nothing_left(tmp_path):
    first, backup, _ = _run(tmp_path)
    assert not backup.resumed
    again, backup, eps = _run(tmp_path)
    assert backup.resume_step == TOTAL and int(again.optimizer.dp_steps.numpy()) == TOTAL
    np.testing.assert_array_equal(flat_weights(first.model), flat_weights(again.model))
    assert eps.ledger.steps == TOTAL


def test_fit_with_a_backup_needs_steps_per_epoch(tmp_path):
    x, y = _data()
    dp = _dp_model()
    backup = StepBackup(str(tmp_path))
    data = sampling.poisson_batches(x, y, sampling_prob=Q, steps=2, seed=backup.sampling_seed)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        dp.fit(data, callbacks=[backup], verbose=0)
    with pytest.raises(ValueError, match="save_every"):
        StepBackup(str(tmp_path), save_every=0)
