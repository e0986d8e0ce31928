"""Tests for dpcore.sampling.sharded_poisson_batches: W workers simulated in one process."""

import math

import numpy as np
import pytest

from dpcore import sampling


def _ids(n: int):
    """Features carry id + 1 (zero padding is distinguishable); labels carry the id."""
    return np.arange(1, n + 1, dtype=np.float32)[:, None], np.arange(n, dtype=np.int64)


def _worker_steps(ds):
    """Per logical step: (sampled ids, number of chunks), checking padding and row layout."""
    steps, ids, chunks = [], [], 0
    for xb, yb, mask, end in ds:
        real = mask.numpy() > 0
        np.testing.assert_array_equal(xb.numpy()[real][:, 0], yb.numpy()[real] + 1)
        np.testing.assert_array_equal(xb.numpy()[~real], 0.0)
        ids.extend(yb.numpy()[real].tolist())
        chunks += 1
        if bool(end):
            steps.append((ids, chunks))
            ids, chunks = [], 0
    assert chunks == 0, "a worker's data ended inside a logical step"
    return steps


def _workers(n, q, steps, w, seed, **kw):
    return [
        sampling.sharded_poisson_batches(
            *_ids(n), sampling_prob=q, steps=steps, num_workers=w, worker_index=i, seed=seed, **kw
        )
        for i in range(w)
    ]


@pytest.mark.parametrize("n,w", [(10, 1), (10, 3), (11, 4), (7, 7)])
def test_shards_are_disjoint_and_cover(n, w):
    shards = [sampling.shard_indices(n, num_workers=w, worker_index=i) for i in range(w)]
    together = np.concatenate(shards)
    assert sorted(together.tolist()) == list(range(n))
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
    for i, shard in enumerate(shards):
        assert np.all(shard % w == i)


def test_union_of_shards_is_the_single_machine_sample_and_workers_stay_in_lockstep():
    n, q, steps, w, seed = 40, 0.3, 12, 3, 5
    # A small padded size forces overflow chunks, in different amounts on different shards.
    per_worker = [_worker_steps(ds) for ds in _workers(n, q, steps, w, seed, padded_batch_size=2)]
    single = _worker_steps(
        sampling.poisson_batches(*_ids(n), sampling_prob=q, steps=steps, seed=seed)
    )
    assert all(len(s) == steps for s in per_worker)
    chunk_counts = set()
    for t in range(steps):
        # Same number of chunks on every worker, as many as the fullest shard needs.
        counts = {per_worker[i][t][1] for i in range(w)}
        assert len(counts) == 1
        chunk_counts |= counts
        ids = [per_worker[i][t][0] for i in range(w)]
        for i in range(w):
            assert all(e % w == i for e in ids[i])  # each worker samples its own shard only
        assert max(1, math.ceil(max(len(s) for s in ids) / 2)) == counts.pop()
        assert sorted(sum(ids, [])) == sorted(single[t][0])  # the global sample
    assert len(chunk_counts) > 1  # overflow did happen on some steps and not others


def test_inclusion_frequency_is_q_for_every_example():
    n, q, steps, w = 30, 0.2, 300, 3
    counts = np.zeros(n)
    for ds in _workers(n, q, steps, w, seed=11):
        for ids, _ in _worker_steps(ds):
            np.add.at(counts, ids, 1)
    # Hoeffding for each example's Binomial(steps, q) count, union bound over the n examples:
    # P(any |count / steps - q| > eps) <= 2 n exp(-2 steps eps^2) = 1e-9.
    eps = math.sqrt(math.log(2 * n / 1e-9) / (2 * steps))
    assert np.all(np.abs(counts / steps - q) <= eps), (counts / steps).round(3)
    # The total is Binomial(n * steps, q): a much tighter check of the mean.
    total_eps = math.sqrt(math.log(2 / 1e-9) / (2 * n * steps))
    assert abs(counts.sum() / (n * steps) - q) <= total_eps


def test_spec_is_global_and_per_worker():
    ds = _workers(50, 0.1, 4, 2, seed=0)[1]
    spec = sampling.sampling_spec(ds)
    assert spec.num_examples == 50 and spec.expected_batch_size == pytest.approx(5.0)
    assert spec.num_workers == 2 and spec.worker_index == 1 and spec.steps == 4
    assert spec.padded_batch_size == sampling.padded_batch_size_for(25, sampling_prob=0.1)
    spec.check_expected_batch_size(expected_batch_size=5.0)
    spec.check_workers(2, 1)
    with pytest.raises(ValueError, match="own shard"):
        spec.check_workers(2, 0)
    with pytest.raises(ValueError, match="own shard"):
        spec.check_workers(3, 1)


def test_full_dataset_on_every_worker_is_refused():
    spec = sampling.sampling_spec(
        sampling.poisson_batches(*_ids(20), sampling_prob=0.2, steps=1, seed=0)
    )
    spec.check_workers(1, 0)
    with pytest.raises(ValueError, match="whole dataset"):
        spec.check_workers(2, 0)


def test_arguments_are_checked():
    x, y = _ids(6)
    with pytest.raises(ValueError, match="shared by all workers"):
        sampling.sharded_poisson_batches(
            x, y, sampling_prob=0.5, steps=1, num_workers=2, worker_index=0, seed=None
        )
    with pytest.raises(ValueError, match="worker_index"):
        sampling.sharded_poisson_batches(
            x, y, sampling_prob=0.5, steps=1, num_workers=2, worker_index=2, seed=0
        )
    with pytest.raises(ValueError, match="num_workers"):
        sampling.shard_indices(6, num_workers=7, worker_index=0)
    with pytest.raises(ValueError, match="sampling_prob"):
        sampling.sharded_poisson_batches(
            x, y, sampling_prob=0.0, steps=1, num_workers=1, worker_index=0, seed=0
        )
