"""Poisson sampling of privacy units (``dpcore.units``) and accounting in units.

The sampler is checked row by row against the unit table: every sampled unit brings all its
kept rows, in its own slot, at most once per step, chunks cut only between units; inclusion
frequencies are within a sound (Hoeffding, union-bounded) interval of q. Training on it is
compared with the per-unit reference, and ε with dp-accounting called directly.
"""

import dataclasses
import math

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

from dpcore import DPConfig, aggregation, make_private, sampling, units
from dpcore.callbacks import EpsilonCallback, check_feed_matches_sampling
from dpcore.options import ExecutionOptions
from dpcore.testing import reference_clipped_mean, reference_unit_gradients

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")

K = 3
C = 0.5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def _skewed_ids(rng, num_units=12):
    """Unit ids with 1..7 rows each (several above the cap K), shuffled through the data."""
    counts = 1 + np.arange(num_units) % 7
    ids = np.repeat([f"user{u:02d}" for u in range(num_units)], counts)
    return ids[rng.permutation(len(ids))]


def _row_data(ids):
    """x holds each row's index (row r has x = r + 1, so padding rows, all 0, stand out)."""
    n = len(ids)
    x = (np.arange(n, dtype=np.float32) + 1.0)[:, None]
    return x, np.zeros(n, np.int64)


def _elements(ds):
    return [tf.nest.map_structure(np.asarray, e) for e in ds]


# -------------------------------------------------------------------------------- unit table


def test_cap_is_deterministic_and_depends_only_on_the_unit(rng):
    ids = _skewed_ids(rng)
    table = units.unit_table(ids, max_rows_per_unit=K)
    again = units.unit_table(ids, max_rows_per_unit=K)
    np.testing.assert_array_equal(table.rows, again.rows)
    assert table.num_units == 12 and table.max_rows_per_unit == K
    assert table.dropped_rows == int(np.sum(np.maximum(table.num_rows - K, 0))) > 0
    for u, uid in enumerate(table.ids):
        own = np.flatnonzero(ids == uid)
        kept = table.rows[u][table.rows[u] >= 0]
        assert len(kept) == min(K, len(own)) and set(kept) <= set(own)
        assert np.all(np.diff(kept) > 0)  # in data order
    # Removing other units (and shifting every row index) keeps the same rows of a unit.
    keep = np.isin(ids, table.ids[::2])
    sub = units.unit_table(ids[keep], max_rows_per_unit=K)
    old_index = np.flatnonzero(keep)
    for u in range(sub.num_units):
        kept = sub.rows[u][sub.rows[u] >= 0]
        np.testing.assert_array_equal(old_index[kept], table.rows[2 * u][table.rows[2 * u] >= 0])
    # cap_seed=None: the first K rows in data order.
    first = units.unit_table(ids, max_rows_per_unit=K, cap_seed=None)
    for u, uid in enumerate(first.ids):
        own = np.flatnonzero(ids == uid)[:K]
        np.testing.assert_array_equal(first.rows[u][: len(own)], own)


def test_unit_table_refuses_bad_input():
    with pytest.raises(ValueError, match="max_rows_per_unit"):
        units.unit_table([1, 2], max_rows_per_unit=0)
    with pytest.raises(ValueError, match="integers or strings"):
        units.unit_table([0.5, 1.5], max_rows_per_unit=2)
    with pytest.raises(ValueError, match="1-D"):
        units.unit_table([[1, 2]], max_rows_per_unit=2)
    with pytest.raises(ValueError, match="padded_units"):
        units.unit_batches(
            np.zeros((2, 1)), np.zeros(2), unit_ids=[1, 2], sampling_prob=0.5, steps=1,
            max_rows_per_unit=2, padded_units=0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="one id per row"):
        units.unit_batches(
            np.zeros((3, 1)), np.zeros(3), unit_ids=[1, 2], sampling_prob=0.5, steps=1,
            max_rows_per_unit=2,
        )  # fmt: skip


# ----------------------------------------------------------------------------------- sampler


def _check_steps(elements, table, n, slots):
    """Per step: the sampled units, after checking layout, masks, padding and chunk cuts."""
    steps, current = [], []
    rows = slots * K
    for e in elements:
        x, mask, end = e.x, e.mask, bool(e.step_end)
        assert x.shape == (rows, 1) and mask.shape == (rows,) and e.y.shape == (rows,)
        index = x[:, 0].astype(np.int64) - 1  # row index; -1 for padding rows
        np.testing.assert_array_equal(mask, (index >= 0).astype(np.float32))
        for slot in index.reshape(slots, K):
            real = slot[slot >= 0]
            if len(real) == 0:
                continue
            assert np.all(slot[: len(real)] >= 0)  # a unit's rows first, then padding
            u = int(np.flatnonzero(np.any(table.rows == real[0], axis=1))[0])
            np.testing.assert_array_equal(real, table.rows[u][table.rows[u] >= 0])
            current.append(u)
        if end:
            assert len(set(current)) == len(current), "a unit twice in one step"
            steps.append(current)
            current = []
    assert not current, "the data ended inside a step"
    return steps


def test_layout_and_whole_units_across_overflow_chunks(rng):
    ids = _skewed_ids(rng)
    x, y = _row_data(ids)
    table = units.unit_table(ids, max_rows_per_unit=K)
    ds = units.unit_batches(
        x, y, unit_ids=ids, sampling_prob=0.8, steps=6, max_rows_per_unit=K, padded_units=2, seed=3
    )
    spec = sampling.sampling_spec(ds)
    assert (spec.group_size, spec.privacy_unit, spec.num_examples) == (K, "user", 12)
    assert spec.padded_batch_size == 2 * K and spec.expected_batch_size == pytest.approx(0.8 * 12)
    elements = _elements(ds)
    steps = _check_steps(elements, table, len(ids), slots=2)
    assert len(steps) == 6
    assert len(elements) > 6  # samples of ~10 units in chunks of 2: whole-unit chunks
    # The default padding: the binomial tail over units.
    default = units.unit_batches(
        x, y, unit_ids=ids, sampling_prob=0.25, steps=1, max_rows_per_unit=K
    )
    slots = sampling.padded_batch_size_for(12, sampling_prob=0.25)
    assert sampling.sampling_spec(default).padded_batch_size == slots * K


def test_inclusion_frequency_is_q(rng):
    """Each unit's frequency over T steps within a Hoeffding bound, union-bounded over units."""
    num_units, q, t = 40, 0.3, 300
    ids = np.repeat(np.arange(num_units) * 7, 2)  # integer ids, two rows each
    x, y = _row_data(ids)
    table = units.unit_table(ids, max_rows_per_unit=K)
    ds = units.unit_batches(
        x, y, unit_ids=ids, sampling_prob=q, steps=t, max_rows_per_unit=K, seed=11
    )
    slots = sampling.sampling_spec(ds).padded_batch_size // K
    steps = _check_steps(_elements(ds), table, len(ids), slots)
    assert len(steps) == t
    counts = np.bincount(np.concatenate([np.asarray(s, int) for s in steps]), minlength=num_units)
    failure = 1e-6  # P(any assertion below fails | correct sampler) <= failure
    per_unit = math.sqrt(math.log(4 * num_units / failure) / (2 * t))
    overall = math.sqrt(math.log(4 / failure) / (2 * t * num_units))
    assert np.all(np.abs(counts / t - q) <= per_unit), counts
    assert abs(counts.sum() / (t * num_units) - q) <= overall


def test_iterations_draw_fresh_samples(rng):
    ids = _skewed_ids(rng)
    x, y = _row_data(ids)
    ds = units.unit_batches(
        x, y, unit_ids=ids, sampling_prob=0.5, steps=4, max_rows_per_unit=K, seed=5
    )
    first = [e.x for e in _elements(ds)]
    second = [e.x for e in _elements(ds)]
    assert any(a.shape != b.shape or np.any(a != b) for a, b in zip(first, second))


def test_spec_refuses_a_layout_that_cuts_units():
    with pytest.raises(ValueError, match="multiple of group_size"):
        sampling.SamplingSpec(
            sampling="poisson", num_examples=10, sampling_prob=0.5, expected_batch_size=5.0,
            steps=1, padded_batch_size=7, group_size=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match="unit_batches"):
        sampling.SamplingSpec(
            sampling="shuffle", num_examples=10, sampling_prob=0.5, expected_batch_size=5.0,
            steps=1, padded_batch_size=6, group_size=3,
        )  # fmt: skip


# -------------------------------------------------------------------------------- accounting


def test_epsilon_is_poisson_over_units():
    """ε of a user-level config == dp-accounting's event over units, called directly."""
    num_users, users_per_step, sigma, steps = 5000, 50.0, 1.1, 400
    config = DPConfig(
        l2_norm_clip=1.0,
        noise_multiplier=sigma,
        expected_batch_size=users_per_step,
        num_examples=num_users,
        steps=steps,
        privacy_unit="user",
        target_delta=1e-5,
    )
    q = users_per_step / num_users
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    assert config.dp_event() == event
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    rdp = dp_accounting.rdp.RdpAccountant()
    want_pld = pld.compose(event).get_epsilon(1e-5)
    want_rdp = rdp.compose(event).get_epsilon(1e-5)
    assert config.epsilon("pld") == pytest.approx(want_pld, rel=1e-9)
    assert config.epsilon("rdp") == pytest.approx(want_rdp, rel=1e-9)
    assert "per user" in config.accounting_note()
    assert DPConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="privacy_unit"):
        DPConfig(
            l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=1.0, num_examples=10,
            steps=1, privacy_unit="",
        )  # fmt: skip


# ------------------------------------------------------------------------------ training


def _tiny_model():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(5, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(h))


def _private(model, *, group_size, expected_batch_size, privacy_unit="user", num_units=None):
    config = DPConfig(
        l2_norm_clip=C,
        noise_multiplier=0.0,
        expected_batch_size=expected_batch_size,
        num_examples=num_units or 1000,
        steps=1,
        privacy_unit=privacy_unit,
        target_delta=1e-6,
    )
    dp_model = make_private(
        model,
        optimizer=keras.optimizers.SGD(1.0),
        loss=LOSS,
        config=config,
        options=ExecutionOptions(group_size=group_size),
    )
    return dp_model, config


def test_fit_on_unit_batches_clips_each_unit_once(rng):
    """One noise-free step: the update is the sum of the sampled units' clipped gradients
    (each unit the sum of its kept rows) divided by the expected number of units."""
    ids = _skewed_ids(rng, num_units=6)
    x = rng.normal(size=(len(ids), 4)).astype("float32") * 3.0
    y = rng.integers(0, 3, len(ids))
    q = 0.7
    model = _tiny_model()
    dp_model, config = _private(model, group_size=K, expected_batch_size=q * 6, num_units=6)

    def data():
        return units.unit_batches(
            x, y, unit_ids=ids, sampling_prob=q, steps=1, max_rows_per_unit=K, seed=2
        )

    (batch,) = _elements(data())  # the first pass of a dataset built alike: the same sample
    ref = reference_unit_gradients(
        model, LOSS, batch.x, batch.y, group_size=K, mask=batch.mask, training=True
    )
    want = reference_clipped_mean(ref, l2_norm_clip=C, expected_batch_size=q * 6)
    before = [v.numpy() for v in model.trainable_variables]
    dp_model.fit(data(), epochs=1, verbose=0, callbacks=[EpsilonCallback(config)])
    assert int(dp_model.optimizer.dp_steps) == 1
    for v, b, w in zip(model.trainable_variables, before, want):
        np.testing.assert_allclose(b - v.numpy(), w, rtol=1e-5, atol=1e-7)


def test_each_units_contribution_is_at_most_c(rng):
    """Units of huge rows, of rows that cancel and of ordinary rows, each alone in a fit."""
    x = rng.normal(size=(9, 4)).astype("float32")
    x[0:3] *= np.float32(1e17)
    x[4] = -x[3] * np.float32(1 + 2**-20)
    y = np.zeros(9, np.int64)
    ids = np.repeat([0, 1, 2], 3)
    for u in range(3):
        rows = ids == u
        model = _tiny_model()
        # The config's N is the one unit sampled: fit refuses another N than the accounted one.
        dp_model, _ = _private(model, group_size=K, expected_batch_size=1.0, num_units=1)
        before = [v.numpy() for v in model.trainable_variables]
        data = units.unit_batches(
            x[rows], y[rows], unit_ids=ids[rows], sampling_prob=1.0, steps=1,
            max_rows_per_unit=K, seed=0,
        )  # fmt: skip
        dp_model.fit(data, epochs=1, verbose=0)
        delta = [
            v.numpy().astype(np.float64) - b for v, b in zip(model.trainable_variables, before)
        ]
        norm = math.sqrt(sum(float(np.sum(d**2)) for d in delta))
        assert norm <= C * (1 + aggregation.CONTRIBUTION_TOLERANCE), (u, norm)
        if u == 0:
            assert norm >= C * (1 - 1e-3)  # far above the bound: clipped to C


def test_fit_and_callbacks_refuse_other_units(rng):
    ids = _skewed_ids(rng, num_units=4)
    x = rng.normal(size=(len(ids), 4)).astype("float32")
    y = rng.integers(0, 3, len(ids))
    data = units.unit_batches(
        x, y, unit_ids=ids, sampling_prob=0.5, steps=1, max_rows_per_unit=K, seed=1
    )
    # The model clips groups of 2 rows, the data holds units of 3.
    dp_model, _ = _private(_tiny_model(), group_size=2, expected_batch_size=2.0)
    with pytest.raises(ValueError, match="group_size=3"):
        dp_model.fit(data, epochs=1, verbose=0)
    # Row-level Poisson batches under a model that groups rows.
    rows = sampling.poisson_batches(x, y, sampling_prob=0.5, steps=1, seed=1)
    dp_model, _ = _private(_tiny_model(), group_size=K, expected_batch_size=0.5 * len(ids))
    with pytest.raises(ValueError, match="units of 1 row"):
        dp_model.fit(rows, epochs=1, verbose=0)
    # Untagged (x, y, mask, step_end): the spec was dropped by a .map.
    dp_model, config = _private(_tiny_model(), group_size=K, expected_batch_size=2.0, num_units=4)
    with pytest.raises(ValueError, match="no SamplingSpec"):
        dp_model.fit(data.map(lambda b: b), epochs=1, verbose=0)
    # The callbacks: a config per example for data sampled per user, a model of other units.
    dp_model.sampling_spec = sampling.sampling_spec(data)
    per_example = dataclasses.replace(config, privacy_unit="example")
    with pytest.raises(ValueError, match="privacy_unit='example'"):
        check_feed_matches_sampling(dp_model, per_example)
    check_feed_matches_sampling(dp_model, config)
    other, _ = _private(_tiny_model(), group_size=2, expected_batch_size=2.0)
    other.sampling_spec = sampling.sampling_spec(data)
    with pytest.raises(ValueError, match="group_size=2"):
        check_feed_matches_sampling(other, config)
