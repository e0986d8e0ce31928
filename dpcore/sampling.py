"""Batch sampling for DP-SGD as fixed-shape, masked `tf.data` pipelines.

Contract:
  * `poisson_batches` implements Poisson subsampling: at every logical step each of the
    N examples is included independently with probability `sampling_prob` (q), with fresh,
    independent randomness per step. This is the sampling scheme that the privacy
    accountant's `PoissonSampledDpEvent` assumes.
  * Every element of the returned dataset is a `SampledBatch(x, y, mask, step_end)` (a named
    tuple):
    `x_batch` / `y_batch` have the structure of `x` / `y` with exactly `padded_batch_size` (P)
    rows (padding rows are zeros), `mask` is float32 `[P]` (1.0 real row, 0.0 padding) and
    `step_end` is a bool scalar that is True on the last chunk of a logical step. All shapes are
    static, so a compiled train step traces once; an empty sample is a valid step (all-zero
    mask, `step_end=True`).
  * Normally a logical step is one element. If a step's sample holds more than P examples
    (overflow), it is emitted as ceil(n / P) consecutive chunks with `step_end` True only on the
    last one: no example is ever dropped or resampled, so overflow introduces no bias. The
    consumer accumulates the chunks and adds noise once, on `step_end`.
  * The dataset arrays are held once (as tensors captured by the pipeline); each step draws an
    O(N) Bernoulli vector and gathers only the selected rows, so memory stays bounded.
  * `sharded_poisson_batches` is `poisson_batches` split across W workers (multi-worker
    `tf.distribute`): example i belongs to worker i mod W, and every worker draws the same
    global coins (one shared seed) and keeps the rows of its own shard, so the union of the
    workers' samples at a step is exactly `poisson_batches`' sample for that seed and step (the
    global sample is Poisson with the same q). Every worker emits the same number of chunks per
    step (the largest any shard needs: each worker counts every shard's sample from the shared
    coins), all of the same padded size, so the workers stay in lockstep with no communication.
    Its `SamplingSpec` is the global one (N, q, expected batch size q * N) plus the worker count
    and index; a multi-worker run refuses data whose spec is not sharded for its worker count.
  * `dpcore.units.unit_batches` is `poisson_batches` over privacy units of several rows (users):
    the coins are drawn per unit and each element lays its units out as contiguous groups of K
    rows. Its `SamplingSpec` counts units (N, q, expected batch size) and records K
    (`group_size`) and what a unit is (`privacy_unit`); `DPModel.fit` refuses it unless the
    model clips groups of K rows, and the callbacks unless their `DPConfig` names that unit.
  * `shuffled_batches` yields the same 4-tuple for the (non-Poisson) shuffle mode: every
    example exactly once per epoch, the last partial batch padded and masked.
  * Every returned dataset carries a `SamplingSpec` (read it with `sampling_spec(ds)`): the
    sampling mode, N, q, the expected batch size, the logical steps per iteration, the padded
    size P and the first step index. `DPModel.fit` refuses data whose expected batch size
    differs from the optimizer's, and the privacy callbacks refuse data whose sampling differs
    from their `DPConfig`, before the first step. `DPModel.fit` gives Keras the spec's `steps`
    as the epoch's length (logical steps, whatever the overflow chunks), and fed arrays it
    samples them with `poisson_batches` itself. The spec is a Python attribute of the dataset
    object: tf.data transformations (`.map`, `.prefetch`, `.take`, ...) return new datasets
    without it. `DPModel.fit` keeps it through its own re-wrapping; after a transformation of
    your own, re-attach it with `with_sampling_spec(new_ds, sampling_spec(ds))` if (and only
    if) the transformation keeps every element and its order (a per-element `.map` does;
    `.filter`, `.take`, `.shuffle`, `.repeat` or re-batching do not). Untagged
    `(x, y, mask, step_end)` data is refused by callbacks that account for Poisson sampling.
  * A logical step never spans two iterations: each iteration holds exactly `steps` logical
    steps and its last element has `step_end=True`.
  * Every iteration over a returned dataset (e.g. each epoch of `model.fit(ds, epochs=k)`)
    draws fresh samples: the per-step keys are folded with a per-iteration salt, so iterating
    twice never replays the same Poisson samples, whose accounting as 2x`steps` independent
    steps would then be wrong. With a fixed `seed`, the sequence of iterations is reproducible
    (whatever TensorFlow's global seed) and the first iteration of two datasets built alike is
    the same.

Consumers must normalise by the expected batch size q * N, never by the realized count.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from dpcore_accounting import events


class SampledBatch(NamedTuple):
    """One element of a sampler's dataset: a padded, masked chunk of one logical step.

    Attributes:
      x: inputs, ``P`` rows (padding rows are zeros).
      y: labels, ``P`` rows.
      mask: float32 ``[P]``: 1 for a sampled example, 0 for padding.
      step_end: bool scalar, True on the last chunk of a logical step.
    """

    x: Any
    y: Any
    mask: Any
    step_end: Any


def as_sampled_batch(data: Any) -> SampledBatch | None:
    """``data`` (an element or an element spec) as a :class:`SampledBatch`, or None.

    The one place that decides whether a batch is a sampler chunk: a ``SampledBatch``, or a
    plain 4-tuple ``(x, y, mask, step_end)`` (hand-built datasets, or after a ``.map`` that
    returned a tuple), whose ``step_end`` is a scalar (or, after multi-replica splitting, one
    copy per row).
    """
    if isinstance(data, SampledBatch):
        return data
    if isinstance(data, (tuple, list)) and len(data) == 4 and all(d is not None for d in data):
        end = data[3]
        if getattr(end, "shape", None) is not None and end.shape.rank in (0, 1):
            return SampledBatch(*data)
    return None


__all__ = [
    "SampledBatch",
    "as_sampled_batch",
    "SamplingSpec",
    "num_examples",
    "padded_batch_size_for",
    "poisson_batches",
    "poisson_spec",
    "passes_started",
    "sampling_spec",
    "shard_indices",
    "sharded_poisson_batches",
    "shuffled_batches",
    "with_sampling_spec",
]

DEFAULT_FAILURE_PROB = 1e-12


def _log_binom_pmf(k: int, n: int, q: float) -> float:
    """log P(Binomial(n, q) = k), for 0 < q < 1 and 0 <= k <= n."""
    return (
        math.lgamma(n + 1)
        - math.lgamma(k + 1)
        - math.lgamma(n - k + 1)
        + k * math.log(q)
        + (n - k) * math.log1p(-q)
    )


def binomial_tail_bound(threshold: int, num_examples: int, sampling_prob: float) -> float:
    """Upper bound on P(Binomial(num_examples, sampling_prob) > threshold).

    For k above the mean the pmf ratio r(k) = pmf(k+1) / pmf(k) = (n - k) q / ((k + 1)(1 - q))
    is decreasing in k, so the tail from k0 = threshold + 1 is at most the geometric series
    pmf(k0) / (1 - r(k0)). The bound is within a small factor of the exact tail. Returns 1.0
    when `threshold` is not beyond the point where the ratio drops below one.

    Args:
      threshold: the padded batch size P.
      num_examples: N.
      sampling_prob: q.

    Returns:
      A number in [0, 1] that is >= the exact tail probability.
    """
    n, q = int(num_examples), float(sampling_prob)
    k0 = int(threshold) + 1
    if k0 > n or q <= 0.0:
        return 0.0
    if q >= 1.0:
        return 1.0
    ratio = (n - k0) * q / ((k0 + 1) * (1.0 - q))
    if ratio >= 1.0:
        return 1.0
    return min(1.0, math.exp(_log_binom_pmf(k0, n, q)) / (1.0 - ratio))


def padded_batch_size_for(
    num_examples: int,
    *,
    sampling_prob: float,
    failure_prob: float = DEFAULT_FAILURE_PROB,
) -> int:
    """Smallest padded batch size P whose per-step overflow probability is tiny.

    P is the smallest integer (at least 1, at most N) such that a rigorous upper bound on
    P(Binomial(N, q) > P) (see `binomial_tail_bound`, a geometric-series bound on the exact
    binomial tail, within a small factor of it) is at most `failure_prob`. With the default
    1e-12 an overflow is astronomically unlikely; if one happens anyway `poisson_batches`
    splits the step into extra chunks, so the choice affects speed only, never correctness.

    Args:
      num_examples: dataset size N (>= 1).
      sampling_prob: per-example inclusion probability q in (0, 1].
      failure_prob: target bound on the per-step overflow probability, in (0, 1).

    Returns:
      The padded batch size P.
    """
    n = int(num_examples)
    q = float(sampling_prob)
    if n < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}.")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sampling_prob must be in (0, 1], got {sampling_prob}.")
    if not 0.0 < failure_prob < 1.0:
        raise ValueError(f"failure_prob must be in (0, 1), got {failure_prob}.")
    if q == 1.0:
        return n
    # The bound is non-increasing in P above the mean; binary search on [floor(mean), n].
    lo = max(0, int(math.floor(n * q)))
    hi = n  # bound(n) == 0 always satisfies the condition.
    while lo < hi:
        mid = (lo + hi) // 2
        if binomial_tail_bound(mid, n, q) <= failure_prob:
            hi = mid
        else:
            lo = mid + 1
    return max(1, lo)


def num_examples(x: Any, y: Any) -> int:
    """Number of examples N in `(x, y)`, checking that every array agrees on it."""
    leaves = tf.nest.flatten((x, y))
    if not leaves:
        raise ValueError("x and y must contain at least one array.")
    sizes = {int(np.shape(leaf)[0]) if np.ndim(leaf) > 0 else -1 for leaf in leaves}
    if -1 in sizes:
        raise ValueError("Every array in x and y needs a leading example axis.")
    if len(sizes) != 1:
        raise ValueError(f"Arrays in x and y disagree on the number of examples: {sorted(sizes)}.")
    n = sizes.pop()
    if n < 1:
        raise ValueError("The dataset is empty.")
    return n


_MODES = ("poisson", "shuffle")
_SAMPLERS = {"poisson": "poisson_batches", "shuffle": "shuffled_batches"}


def _same(a: float, b: float) -> bool:
    """Equal up to float rounding (q * N against a batch size given directly)."""
    return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """How a sampler's dataset draws its batches; carried with the dataset it describes.

    `poisson_batches` and `shuffled_batches` attach one to the dataset they return (read it
    with `sampling_spec`). `dpcore.DPModel.fit` checks it against the optimizer's
    `expected_batch_size`, and `EpsilonCallback` / `PrivacyBudgetGuard` against their
    `DPConfig`, before the first step.

    Attributes:
      sampling: `"poisson"` (each example independently with probability `sampling_prob` at
        every step) or `"shuffle"` (fixed-size batches, every example once per pass).
      num_examples: N, the size of the dataset sampled from.
      sampling_prob: Poisson: q. Shuffle: min(batch size, N) / N (a fraction of the data per
        step, not an amplification).
      expected_batch_size: the divisor the optimizer must use: q * N (Poisson), the fixed
        batch size (shuffle).
      steps: logical steps in one iteration over the dataset (one Keras epoch).
      padded_batch_size: rows in every element (P).
      start_step: Poisson: index of the first step (resumed runs); 0 for shuffle.
      num_workers: W, the workers that each sample a disjoint shard of the N examples
        (`sharded_poisson_batches`); 1 for a single machine's sampler.
      worker_index: which shard this dataset draws from (0 <= worker_index < num_workers).
      group_size: K, rows per privacy unit in every element: rows ``[u*K, (u+1)*K)`` are one
        unit (`dpcore.units.unit_batches`; 1 for a sampler of single rows). `num_examples`,
        `sampling_prob` and `expected_batch_size` then count units, `padded_batch_size` rows
        (a multiple of K), and the model must run with ``ExecutionOptions(group_size=K)``.
      privacy_unit: what one unit is (`"example"` for the row samplers, e.g. `"user"`); the
        `DPConfig` that accounts for the data must name the same unit.
      fixed_seed: Poisson: the sampler was given a seed (its first pass is the same for every
        sampler built with that seed and `start_step`), so it must start at the optimizer's
        next step (see `check_start_step`).
    """

    sampling: str
    num_examples: int
    sampling_prob: float
    expected_batch_size: float
    steps: int
    padded_batch_size: int
    start_step: int = 0
    num_workers: int = 1
    worker_index: int = 0
    group_size: int = 1
    privacy_unit: str = "example"
    fixed_seed: bool = False

    def __post_init__(self) -> None:
        if self.sampling not in _MODES:
            raise ValueError(f"sampling must be one of {_MODES}, got {self.sampling!r}.")
        for name in ("num_examples", "padded_batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}.")
        for name in ("steps", "start_step"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}.")
        if not 0.0 < float(self.sampling_prob) <= 1.0:
            raise ValueError(f"sampling_prob must be in (0, 1], got {self.sampling_prob!r}.")
        if not 1 <= int(self.num_workers) <= int(self.num_examples):
            raise ValueError(
                f"num_workers must be in [1, num_examples={self.num_examples}], got "
                f"{self.num_workers!r}."
            )
        if not 0 <= int(self.worker_index) < int(self.num_workers):
            raise ValueError(
                f"worker_index must be in [0, num_workers={self.num_workers}), got "
                f"{self.worker_index!r}."
            )
        if self.num_workers > 1 and self.sampling != "poisson":
            raise ValueError("only Poisson sampling is sharded across workers.")
        k = self.group_size
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"group_size must be a positive integer, got {k!r}.")
        if int(self.padded_batch_size) % k:
            raise ValueError(
                f"padded_batch_size={self.padded_batch_size} is not a multiple of group_size={k}: "
                "an element would cut a privacy unit in two."
            )
        if k > 1 and (self.sampling != "poisson" or self.num_workers > 1):
            raise ValueError("units of several rows are sampled by dpcore.units.unit_batches only.")
        if not isinstance(self.privacy_unit, str) or not self.privacy_unit:
            raise ValueError(f"privacy_unit must be a non-empty string, got {self.privacy_unit!r}.")
        poisson = self.sampling == "poisson"
        if poisson and not _same(self.expected_batch_size, self.sampling_prob * self.num_examples):
            raise ValueError(
                f"expected_batch_size={self.expected_batch_size!r} is not sampling_prob="
                f"{self.sampling_prob!r} x num_examples={self.num_examples!r}."
            )

    def _describe(self) -> str:
        if self.group_size > 1 or self.privacy_unit != "example":
            return (
                f"unit_batches(sampling_prob={self.sampling_prob:.6g}, max_rows_per_unit="
                f"{self.group_size}) over {self.num_examples} units ({self.privacy_unit})"
            )
        if self.sampling == "poisson" and self.num_workers > 1:
            return (
                f"sharded_poisson_batches(sampling_prob={self.sampling_prob:.6g}, num_workers="
                f"{self.num_workers}, worker_index={self.worker_index}) over "
                f"num_examples={self.num_examples}"
            )
        if self.sampling == "poisson":
            return (
                f"poisson_batches(sampling_prob={self.sampling_prob:.6g}) over "
                f"num_examples={self.num_examples}"
            )
        return (
            f"shuffled_batches(batch_size={int(self.expected_batch_size)}) over "
            f"num_examples={self.num_examples}"
        )

    def check_expected_batch_size(self, *, expected_batch_size: float) -> None:
        """Refuses an optimizer whose divisor is not this sampling's expected batch size.

        Raises:
          ValueError: naming both values.
        """
        if not _same(expected_batch_size, self.expected_batch_size):
            raise ValueError(
                f"the data comes from {self._describe()}, whose expected batch size is "
                f"{self.expected_batch_size:.6g}, but the optimizer's expected_batch_size="
                f"{float(expected_batch_size):.6g}: the noised sum would be normalized for a "
                "different sampling than the one that runs. Build the sampler and the "
                "optimizer from one DPConfig (sampling_prob=config.sampling_prob)."
            )

    def check_group_size(self, group_size: int) -> None:
        """Refuses a model whose units are not this data's units.

        Args:
          group_size: the model's ``ExecutionOptions.group_size`` (rows clipped together).

        Raises:
          ValueError: naming both sizes.

        Privacy:
          The engine clips rows ``[u*K, (u+1)*K)`` together. With another K than the sampler's,
          a unit's rows would be clipped in several groups (its contribution up to a multiple
          of C while the noise is scaled to C) or rows of different units would share a clip.
        """
        if int(group_size) == self.group_size:
            return
        raise ValueError(
            f"the data comes from {self._describe()}, laid out in units of {self.group_size} "
            f"row(s), but the model clips groups of ExecutionOptions(group_size={group_size}) "
            f"rows: use options=ExecutionOptions(group_size={self.group_size}) so that each "
            "unit is clipped once, as a whole."
        )

    def check_workers(self, num_workers: int, worker_index: int) -> None:
        """Refuses data that is not this worker's shard of a W-worker sampling.

        Args:
          num_workers: the workers of the run (W).
          worker_index: this worker's index in the run.

        Raises:
          ValueError: if the data samples all N examples on a multi-worker run (every worker
            would sample the whole dataset), is sharded for another worker count, or is
            another worker's shard.

        Privacy:
          With every worker sampling the full dataset an example could be in W places of one
          global step: its contribution to the noised sum would be up to W * C while the noise
          is scaled to C. Disjoint shards keep the sensitivity at C.
        """
        if int(self.num_workers) == int(num_workers) and int(self.worker_index) == int(
            worker_index
        ):
            return
        if self.num_workers == 1:
            raise ValueError(
                f"the run has {num_workers} workers but the data comes from {self._describe()}: "
                "every worker would sample the whole dataset, so one example could be in "
                f"{num_workers} replicas of one step (sensitivity {num_workers} x C, noise "
                "scaled to C). Use dpcore.sampling.sharded_poisson_batches(..., num_workers="
                f"{num_workers}, worker_index=<this worker>, seed=<a seed shared by all "
                "workers>)."
            )
        raise ValueError(
            f"the data comes from {self._describe()}, but this is worker {worker_index} of "
            f"{num_workers}: each worker must sample its own shard of the same sharding."
        )

    def check_start_step(self, dp_steps: int) -> None:
        """Refuses a fixed-seed Poisson sampler that does not start at the optimizer's next step.

        Call it before the first iteration over the sampler's dataset (:func:`passes_started` is
        0 or unknown): every later iteration over the same dataset draws fresh samples.

        Args:
          dp_steps: the logical steps the optimizer has applied.

        Raises:
          ValueError: for `fixed_seed` Poisson data whose `start_step` is not `dp_steps`.

        Privacy:
          A sampler built again with the same seed and `start_step` draws the same samples for
          the same steps: steps `start_step ..` would reuse earlier steps' samples under fresh
          noise, which is not the independent Poisson sampling the DpEvent counts (ten steps of
          fresh Poisson samples at σ 1 reported ε 2.13 where the replayed samples cost 3.40).
        """
        if self.sampling != "poisson" or not self.fixed_seed or self.start_step == dp_steps:
            return
        raise ValueError(
            f"this Poisson sampler has a fixed seed and start_step={self.start_step}, but the "
            f"optimizer has applied {dp_steps} logical steps: its samples would repeat those of "
            "the run's earlier steps drawn with the same seed, which the accounting counts as "
            f"fresh. Build it with start_step={dp_steps} (or without a seed), or fit again on the "
            "dataset that drew those steps (each new pass over it draws fresh samples)."
        )

    def check_config(self, config: Any) -> None:
        """Refuses a `DPConfig` that accounts for a different sampling than this one.

        Args:
          config: the `dpcore.DPConfig` whose DpEvent is reported.

        Raises:
          ValueError: for a different sampling mode, dataset size, sampling probability
            (Poisson) or batch size (shuffle), naming both values.

        Privacy:
          The reported epsilon is the DpEvent of `config`; it is the run's only if the data
          was drawn the way the event assumes.
        """
        if config.sampling != self.sampling:
            raise ValueError(
                f"the config accounts for sampling={config.sampling!r}, but the data comes from "
                f"{self._describe()} (sampling={self.sampling!r}): the reported epsilon would "
                f"not be the run's. Use DPConfig(sampling={self.sampling!r}, ...) or feed "
                f"dpcore.sampling.{_SAMPLERS[config.sampling]}."
            )
        config_unit = getattr(config, "privacy_unit", "example")
        if config_unit != self.privacy_unit:
            raise ValueError(
                f"the config accounts for privacy_unit={config_unit!r}, but the data comes from "
                f"{self._describe()}: the reported epsilon would be per {config_unit}, not per "
                f"{self.privacy_unit}. Use DPConfig(privacy_unit={self.privacy_unit!r}, "
                "num_examples=<number of units>, ...)."
            )
        if int(config.num_examples) != self.num_examples:
            raise ValueError(
                f"the config accounts for num_examples={config.num_examples}, but the data "
                f"comes from {self._describe()}."
            )
        if self.sampling == "poisson" and not _same(config.sampling_prob, self.sampling_prob):
            raise ValueError(
                f"the config accounts for sampling_prob={config.sampling_prob:.6g} (expected_"
                f"batch_size={config.expected_batch_size:.6g} / num_examples="
                f"{config.num_examples}), but the data was sampled with sampling_prob="
                f"{self.sampling_prob:.6g}: the reported epsilon would not be the run's. Pass "
                "sampling_prob=config.sampling_prob to poisson_batches."
            )
        if self.sampling == "shuffle" and not _same(
            config.expected_batch_size, self.expected_batch_size
        ):
            raise ValueError(
                f"the config accounts for batches of expected_batch_size="
                f"{config.expected_batch_size:.6g}, but the data comes from {self._describe()}."
            )


def sampling_spec(dataset: Any) -> SamplingSpec | None:
    """The `SamplingSpec` a dataset carries, or None (not a sampler's dataset, or transformed).

    Args:
      dataset: any object; only a `tf.data.Dataset` returned by a sampler (or tagged with
        `with_sampling_spec`) carries a spec.

    Returns:
      The spec, or None.
    """
    if not isinstance(dataset, tf.data.Dataset):
        return None
    spec = getattr(dataset, "dpcore_sampling_spec", None)
    return spec if isinstance(spec, SamplingSpec) else None


def with_sampling_spec(dataset: tf.data.Dataset, spec: SamplingSpec) -> tf.data.Dataset:
    """Attaches `spec` to `dataset` (the same object, returned for chaining).

    Use it to keep a sampler's spec through a per-element transformation of your own, e.g.
    `with_sampling_spec(ds.map(lambda b: b._replace(x=augment(b.x))), sampling_spec(ds))` (a
    `SampledBatch` reaches `.map` as one argument), or to declare how a pipeline of
    your own samples.

    Args:
      dataset: a dataset of `(x, y, mask, step_end)` elements with `spec.padded_batch_size` rows.
      spec: how its batches are drawn.

    Returns:
      `dataset`, now carrying `spec`.

    Raises:
      TypeError: for a non-dataset or a non-`SamplingSpec`.
      ValueError: if the elements are not `(x, y, mask, step_end)` with P rows.

    Privacy:
      The spec is a claim that the callbacks account for: attach it only to data drawn that
      way. A transformation that drops, adds, reorders or regroups elements (`.filter`,
      `.take`, `.shuffle`, `.repeat`, re-batching) changes the sampling: do not re-attach then.
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"dataset must be a tf.data.Dataset, got {type(dataset).__name__}.")
    if not isinstance(spec, SamplingSpec):
        raise TypeError(f"spec must be a dpcore.sampling.SamplingSpec, got {spec!r}.")
    element = as_sampled_batch(dataset.element_spec)
    if (
        element is None
        or element.step_end.shape.rank != 0
        or element.mask.shape.as_list() != [spec.padded_batch_size]
    ):
        raise ValueError(
            f"with_sampling_spec needs (x, y, mask, step_end) elements with a mask of shape "
            f"[{spec.padded_batch_size}] (the spec's padded_batch_size), got "
            f"{dataset.element_spec}."
        )
    dataset.dpcore_sampling_spec = spec
    return dataset


def _entropy_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)


def _base_key(seed: int | None) -> tuple[int, int]:
    """A Philox key (two 63-bit words) from a user seed, or from OS entropy when seed is None."""
    if seed is None:
        hi, lo = _entropy_seed(), _entropy_seed()
    else:
        seed = int(seed)
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}.")
        # Two independent-looking words from one integer seed (hashing keeps seed 0 and 1
        # far apart in key space).
        words = np.random.SeedSequence(seed).generate_state(2, dtype=np.uint64)
        hi, lo = (int(w) & ((1 << 63) - 1) for w in words)
    return hi, lo


def _per_iteration(words: tuple[int, int], body: Any) -> tf.data.Dataset:
    """`body(iteration_key)`, with a Philox key that is new on every iteration over the result.

    A counter owned by the dataset counts the iterations started over it (1, 2, ...); folding it
    into the base key gives the iteration's key. The sequence depends only on `words` (the user
    seed or OS entropy), not on TensorFlow's global seed, so a fixed seed fixes every pass.
    """
    key = tf.constant(list(words), dtype=tf.int64)
    passes = tf.Variable(0, dtype=tf.int64, trainable=False, name="sampler_passes")
    salt = tf.data.Dataset.range(1).map(lambda _: passes.assign_add(1))
    dataset = salt.flat_map(
        lambda r: body(tf.random.experimental.stateless_fold_in(key, r, alg="philox"))
    )
    dataset.dpcore_sampler_passes = passes  # read by passes_started
    return dataset


def _to_tensors(tree: Any) -> Any:
    """Tensors of ``tree``, its lists as tuples (a tf.data element holds no list: the labels of
    a list of outputs come out as a tuple, which Keras takes the same way)."""
    if isinstance(tree, list):
        tree = tuple(tree)
    if isinstance(tree, (tuple, dict)) and not hasattr(tree, "_fields"):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        converted = {k: _to_tensors(v) for k, v in items}
        return (
            converted if isinstance(tree, dict) else tuple(converted[i] for i in range(len(tree)))
        )
    if hasattr(tree, "_fields"):  # a named tuple keeps its type
        return type(tree)(*(_to_tensors(v) for v in tree))
    return tf.convert_to_tensor(tree)


def _gather_padded(tree: Any, indices: tf.Tensor, padded_size: int) -> Any:
    """Rows `indices` (length <= padded_size) of every tensor in `tree`, zero-padded to P."""
    count = tf.shape(indices)[0]

    def one(t: tf.Tensor) -> tf.Tensor:
        rows = tf.gather(t, indices)
        paddings = tf.concat(
            [[[0, padded_size - count]], tf.zeros([t.shape.rank - 1, 2], tf.int32)], axis=0
        )
        out = tf.pad(rows, paddings)
        return tf.ensure_shape(out, [padded_size] + t.shape[1:].as_list())

    return tf.nest.map_structure(one, tree)


def _chunked(
    xs: Any,
    ys: Any,
    indices: tf.Tensor,
    padded_size: int,
    num_chunks: tf.Tensor | None = None,
) -> tf.data.Dataset:
    """Split `indices` into ceil(n / P) (at least one) padded, masked chunks, or into
    `num_chunks` (int64, at least that many) when given: extra chunks are all padding."""
    count = tf.shape(indices, out_type=tf.int64)[0]
    p = tf.constant(padded_size, tf.int64)
    if num_chunks is None:
        num_chunks = _chunks_for(count, p)

    def chunk(c: tf.Tensor) -> SampledBatch:
        sel = indices[c * p : (c + 1) * p]
        real = tf.shape(sel)[0]
        mask = tf.concat(
            [tf.ones([real], tf.float32), tf.zeros([padded_size - real], tf.float32)], 0
        )
        mask = tf.ensure_shape(mask, [padded_size])
        step_end = tf.equal(c, num_chunks - 1)
        return SampledBatch(
            _gather_padded(xs, sel, padded_size),
            _gather_padded(ys, sel, padded_size),
            mask,
            step_end,
        )

    return tf.data.Dataset.range(num_chunks).map(chunk)


def _chunks_for(count: tf.Tensor, p: tf.Tensor) -> tf.Tensor:
    """ceil(count / p), at least 1 (an empty sample is one all-padding chunk)."""
    return tf.maximum(tf.constant(1, tf.int64), tf.reduce_max((count + p - 1) // p))


def _check_poisson_args(sampling_prob: float, steps: int, start_step: int) -> float:
    """Validates the Poisson sampler's arguments (each error names its argument); returns q."""
    q = events.check_sampling_prob(sampling_prob)
    events.check_number(steps, "steps", low=0, integer=True)
    events.check_number(start_step, "start_step", low=0, integer=True)
    return q


def _padded_size(n: int, q: float, padded_batch_size: int | None) -> int:
    p = (
        padded_batch_size_for(n, sampling_prob=q)
        if padded_batch_size is None
        else int(padded_batch_size)
    )
    if p < 1:
        raise ValueError(f"padded_batch_size must be >= 1, got {padded_batch_size}.")
    return p


def _step_coins(key: tf.Tensor, step: tf.Tensor, n: int, q: float) -> tf.Tensor:
    """Bool ``[n]``: which of the N examples step `step` includes (float64 Philox coins)."""
    step_key = tf.random.experimental.stateless_fold_in(key, step, alg="philox")
    u = tf.random.stateless_uniform([n], seed=step_key, dtype=tf.float64, alg="philox")
    return u < tf.constant(q, tf.float64)


def poisson_batches(
    x: Any,
    y: Any,
    *,
    sampling_prob: float,
    steps: int,
    padded_batch_size: int | None = None,
    seed: int | None = None,
    start_step: int = 0,
) -> tf.data.Dataset:
    """Poisson-subsampled, fixed-shape, masked batches for `steps` logical steps.

    At each logical step s every example is included independently with probability
    `sampling_prob`: a Bernoulli vector over all N examples is drawn from a counter-based
    (Philox) stateless generator keyed by (seed, start_step + s), in float64, so inclusion is
    independent across examples and across steps. The selected rows are gathered and padded to
    `padded_batch_size` rows; see the module docstring for the element format and the overflow
    rule (a sample larger than P becomes several chunks of the same step; nothing is dropped).

    Args:
      x: features: a numpy array / tensor or a (nested) structure of them, leading axis N. The
        dataset holds a tensor copy of numpy input; when calling this repeatedly (a sampler per
        epoch), pass tensors (`tf.convert_to_tensor(x)` once) so that every call shares one
        copy: Keras frees a finished fit's dataset only when Python's cycle collector runs.
      y: labels, same convention as `x`.
      sampling_prob: per-example inclusion probability q in (0, 1].
      steps: number of logical steps to emit (>= 0).
      padded_batch_size: rows per element P; default
        `padded_batch_size_for(N, sampling_prob=q)`, the smallest P whose per-step overflow
        probability is below 1e-12.
      seed: non-negative integer seed for reproducible runs (tests, debugging). None (the
        default) draws the seed from OS entropy, which is what a private run should use.
      start_step: index of the first step; a resumed run passes the number of steps already
        taken so that, with a fixed seed, it never replays the samples of earlier steps.
        Iterating the returned dataset again (another Keras epoch) draws fresh samples.

    Returns:
      A `tf.data.Dataset` of `(x_batch, y_batch, mask, step_end)` carrying its `SamplingSpec`.

    Privacy:
      This is the Poisson subsampling that `PoissonSampledDpEvent(sampling_prob, ...)` accounts
      for, provided the consumer (1) treats each logical step (chunks up to `step_end`) as one
      noisy step, (2) ignores rows with mask 0 and (3) normalises by the expected batch size
      q * N. The batch size seen by the model (P) is data-independent; the realized count
      (sum of mask) is data-dependent and must not leak except through the noisy update. A
      fixed `seed` makes the sample choice predictable to anyone who knows it: only use one
      when that is acceptable.
    """
    n = num_examples(x, y)
    q = _check_poisson_args(sampling_prob, steps, start_step)
    p = _padded_size(n, q, padded_batch_size)
    xs, ys = _to_tensors(x), _to_tensors(y)
    start = int(start_step)

    def step_sample(key: tf.Tensor, step: tf.Tensor) -> tf.data.Dataset:
        indices = tf.where(_step_coins(key, step, n, q))[:, 0]
        return _chunked(xs, ys, indices, p)

    spec = poisson_spec(n, sampling_prob=q, steps=steps, padded_batch_size=p, start_step=start)
    return _poisson_pipeline(step_sample, seed=seed, spec=spec)


def poisson_spec(
    num_examples: int,
    *,
    sampling_prob: float,
    steps: int,
    padded_batch_size: int,
    start_step: int = 0,
    **fields: Any,
) -> SamplingSpec:
    """The `SamplingSpec` of a Poisson sampler over N examples (or units): expected size q * N.

    Args:
      num_examples: N.
      sampling_prob: q.
      steps: logical steps per iteration.
      padded_batch_size: rows per element.
      start_step: index of the first step.
      **fields: the other `SamplingSpec` fields (workers, `group_size`, `privacy_unit`).

    Returns:
      The spec.
    """
    return SamplingSpec(
        sampling="poisson",
        num_examples=int(num_examples),
        sampling_prob=float(sampling_prob),
        expected_batch_size=float(sampling_prob) * int(num_examples),
        steps=int(steps),
        padded_batch_size=int(padded_batch_size),
        start_step=int(start_step),
        **fields,
    )


def _poisson_pipeline(step_sample: Any, *, seed: int | None, spec: SamplingSpec) -> tf.data.Dataset:
    """`step_sample(key, step)` for the spec's steps, a fresh key per iteration, tagged."""

    def iteration(key: tf.Tensor) -> tf.data.Dataset:
        steps = tf.data.Dataset.range(spec.start_step, spec.start_step + spec.steps)
        return steps.flat_map(lambda step: step_sample(key, step))

    inner = _per_iteration(_base_key(seed), iteration)
    dataset = inner.prefetch(tf.data.AUTOTUNE)
    dataset.dpcore_sampler_passes = inner.dpcore_sampler_passes
    return with_sampling_spec(dataset, dataclasses.replace(spec, fixed_seed=seed is not None))


def passes_started(dataset: Any) -> int | None:
    """How many iterations over a sampler's dataset have started (each draws fresh samples), or
    None for a dataset that does not count them (not a Poisson sampler's, or transformed)."""
    passes = getattr(dataset, "dpcore_sampler_passes", None)
    return None if passes is None else int(passes.numpy())


def shard_indices(num_examples: int, *, num_workers: int, worker_index: int) -> np.ndarray:
    """The examples worker `worker_index` of `num_workers` owns: i with i mod W == worker_index.

    The W shards are disjoint and cover range(num_examples); their sizes differ by at most one.

    Args:
      num_examples: N (>= 1).
      num_workers: W, in [1, N].
      worker_index: in [0, W).

    Returns:
      int64 array of the owned example indices, ascending.
    """
    n, w, i = int(num_examples), int(num_workers), int(worker_index)
    if n < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}.")
    if not 1 <= w <= n:
        raise ValueError(f"num_workers must be in [1, num_examples={n}], got {num_workers}.")
    if not 0 <= i < w:
        raise ValueError(f"worker_index must be in [0, num_workers={w}), got {worker_index}.")
    return np.arange(i, n, w, dtype=np.int64)


def sharded_poisson_batches(
    x: Any,
    y: Any,
    *,
    sampling_prob: float,
    steps: int,
    num_workers: int,
    worker_index: int,
    seed: int | None,
    padded_batch_size: int | None = None,
    start_step: int = 0,
) -> tf.data.Dataset:
    """One worker's share of a Poisson sampling that W workers run together.

    Example i belongs to worker i mod W (`shard_indices`). At every step all workers draw the
    same coins as `poisson_batches` with this `seed` (one per example, from a Philox key of the
    shared seed and the step); each keeps the sampled examples of its own shard. So the union
    of the W samples is exactly the single-machine sample, each example is included with
    probability `sampling_prob` independently of the others and of other steps, and no example
    is in two workers' samples. From the same coins every worker also counts every shard's
    sample, and emits as many chunks per step as the fullest shard needs (padding chunks
    where it needs fewer): all workers run the same number of elements, with `step_end` at
    the same places, without communicating.

    Args:
      x: the full dataset's features (N rows, the same on every worker); only this worker's
        shard is kept by the pipeline.
      y: labels, same convention.
      sampling_prob: q in (0, 1], the global per-example inclusion probability.
      steps: logical steps per iteration (>= 0), the same on every worker.
      num_workers: W (>= 1, at most N).
      worker_index: this worker's index in [0, W) (the chief is usually 0).
      seed: the seed every worker passes: required for W > 1 (the workers must draw the same
        coins); draw it per run with `dpcore.distribute.shared_seed(strategy)`, which is
        OS entropy broadcast from the chief. None only for W = 1 (OS entropy).
      padded_batch_size: rows per element; default
        `padded_batch_size_for(ceil(N / W), sampling_prob=q)` (the largest shard's overflow
        probability per step below 1e-12).
      start_step: index of the first step (resumed runs), as in `poisson_batches`.

    Returns:
      A `tf.data.Dataset` of `(x, y, mask, step_end)` whose `SamplingSpec` is the global one
      (N, q, expected batch size q * N) with `num_workers` and `worker_index`.

    Raises:
      ValueError: for out-of-range arguments, or `seed=None` with more than one worker.

    Privacy:
      The global sample is the Poisson subsampling `PoissonSampledDpEvent(q, ...)` accounts for,
      provided the W workers' batches of a step go into one noised update (the clipped sums
      all-reduced, noise added once, divided by the global q * N) and each worker feeds its own
      shard. A seed known to others makes the sample choice predictable to them, as in
      `poisson_batches`; `shared_seed` keeps it within the run.
    """
    n = num_examples(x, y)
    q = _check_poisson_args(sampling_prob, steps, start_step)
    workers, index = int(num_workers), int(worker_index)
    own = shard_indices(n, num_workers=workers, worker_index=index)
    if seed is None and workers > 1:
        raise ValueError(
            "sharded_poisson_batches needs a seed shared by all workers when num_workers > 1 "
            "(they draw the same coins): pass seed=dpcore.distribute.shared_seed(strategy)."
        )
    rows = -(-n // workers)  # the largest shard
    p = _padded_size(rows, q, padded_batch_size)
    xs, ys = (
        tf.nest.map_structure(lambda t: tf.gather(t, own), _to_tensors(tree)) for tree in (x, y)
    )

    def step_sample(key: tf.Tensor, step: tf.Tensor) -> tf.data.Dataset:
        coins = _step_coins(key, step, n, q)
        # Row r, column w of the grid: example r * W + w (padding: never sampled).
        grid = tf.reshape(tf.pad(coins, [[0, rows * workers - n]]), [rows, workers])
        counts = tf.reduce_sum(tf.cast(grid, tf.int64), axis=0)
        num_chunks = _chunks_for(counts, tf.constant(p, tf.int64))
        return _chunked(xs, ys, tf.where(grid[:, index])[:, 0], p, num_chunks)

    spec = poisson_spec(
        n,
        sampling_prob=q,
        steps=steps,
        padded_batch_size=p,
        start_step=start_step,
        num_workers=workers,
        worker_index=index,
    )
    return _poisson_pipeline(step_sample, seed=seed, spec=spec)


def shuffled_batches(
    x: Any,
    y: Any,
    *,
    batch_size: int,
    epochs: int,
    seed: int | None = None,
) -> tf.data.Dataset:
    """Shuffled fixed-size batches: every example exactly once per epoch.

    Each epoch draws a fresh permutation (stateless Philox keyed by (seed, epoch)) and cuts it
    into ceil(N / batch_size) batches; the last, partial batch is zero-padded and masked. Each
    element has the same `(x_batch, y_batch, mask, step_end)` format as `poisson_batches`,
    with `step_end` always True (one element per logical step).

    Args:
      x: features (array or nested structure of arrays, leading axis N).
      y: labels, same convention.
      batch_size: rows per batch (>= 1), also the padded size.
      epochs: number of passes over the data (>= 0).
      seed: non-negative integer seed; None draws one from OS entropy.

    Returns:
      A `tf.data.Dataset` of `(x_batch, y_batch, mask, step_end)` carrying its `SamplingSpec`.

    Privacy:
      This is NOT Poisson sampling: the accountant must not apply Poisson amplification to
      these batches. Each example contributes to exactly one step per epoch; account for it
      accordingly (e.g. no amplification, one full-dataset composition per epoch) and label
      any Poisson-assumed figure as an assumption.
    """
    n = num_examples(x, y)
    b = int(batch_size)
    if b < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if int(epochs) < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}.")
    xs, ys = _to_tensors(x), _to_tensors(y)

    def iteration(key: tf.Tensor) -> tf.data.Dataset:
        def epoch_batches(epoch: tf.Tensor) -> tf.data.Dataset:
            epoch_key = tf.random.experimental.stateless_fold_in(key, epoch, alg="philox")
            u = tf.random.stateless_uniform([n], seed=epoch_key, dtype=tf.float64, alg="philox")
            perm = tf.argsort(u, stable=True)
            num_batches = (n + b - 1) // b

            def one(i: tf.Tensor) -> tf.data.Dataset:
                sel = perm[i * b : (i + 1) * b]
                sel = tf.cast(sel, tf.int64)
                return _chunked(xs, ys, sel, b)

            return tf.data.Dataset.range(num_batches).flat_map(one)

        return tf.data.Dataset.range(int(epochs)).flat_map(epoch_batches)

    spec = SamplingSpec(
        sampling="shuffle",
        num_examples=n,
        sampling_prob=min(b, n) / n,
        expected_batch_size=float(b),
        steps=int(epochs) * ((n + b - 1) // b),
        padded_batch_size=b,
    )
    inner = _per_iteration(_base_key(seed), iteration)
    dataset = inner.prefetch(tf.data.AUTOTUNE)
    dataset.dpcore_sampler_passes = inner.dpcore_sampler_passes
    return with_sampling_spec(dataset, dataclasses.replace(spec, fixed_seed=seed is not None))
