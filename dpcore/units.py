"""Poisson sampling of privacy units of several rows (user-level DP) as fixed-shape batches.

Contract:
  * A privacy unit is the set of rows that share a value of `unit_ids` (a user, a document, a
    device). `unit_batches` includes each of the U units independently with probability
    `sampling_prob` (q) at every logical step, with fresh randomness per step: the coins of
    `dpcore.sampling.poisson_batches` (float64 Philox, keyed by seed, step and iteration)
    drawn over units instead of rows. This is the sampling `PoissonSampledDpEvent(q, ...)`
    accounts for when the neighbouring datasets differ by one whole unit.
  * Cap: a unit contributes at most K = `max_rows_per_unit` rows, the same ones at every step
    (the excess is dropped once, deterministically; see `unit_table`). Which rows a unit keeps
    depends only on that unit's own rows (their order in the data), its id and `cap_seed`,
    never on other units, so adding or removing a unit leaves every other unit's rows as
    they were.
  * Layout: every element is a `dpcore.sampling.SampledBatch` of P = U_pad * K rows in the
    engine's contiguous-group layout (``ExecutionOptions(group_size=K)``): rows
    ``[u*K, (u+1)*K)`` are slot u. A sampled unit with m <= K rows fills the first m rows of
    its slot; the other rows of the slot, and empty slots, are zeros with mask 0. Shapes are
    static, so a compiled step traces once.
  * U_pad defaults to `padded_batch_size_for(U, sampling_prob=q)`: the binomial tail bound over
    units, so a step's sample overflows one element with probability below 1e-12. A larger
    sample (or a smaller `padded_units`, to bound memory) becomes several chunks of the same
    step, cut between units: a unit is never split across two micro-batches of a step, so each
    micro-batch clips whole units and the step's sum has sensitivity C per unit.
  * The dataset carries a `SamplingSpec` whose `num_examples`, `sampling_prob` and
    `expected_batch_size` count units, `padded_batch_size` rows, with `group_size=K` and
    `privacy_unit` (e.g. "user"). `DPModel.fit` refuses it unless the model runs with
    ``ExecutionOptions(group_size=K)``, and `EpsilonCallback` unless its `DPConfig` has
    ``num_examples=U`` and the same ``privacy_unit``.

Consumers normalise by the expected number of units q * U, never by the realized count.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import tensorflow as tf

from dpcore import sampling
from dpcore.sampling import SampledBatch

__all__ = ["UnitTable", "unit_batches", "unit_table"]


@dataclasses.dataclass(frozen=True)
class UnitTable:
    """The rows each unit contributes after the cap.

    Attributes:
      ids: ``[U]`` the distinct unit ids, sorted (unit u is ``ids[u]``).
      rows: int64 ``[U, K]``: the row indices unit u keeps, ascending, then -1 for empty slots.
      num_rows: int64 ``[U]``: rows each unit has in the data, before the cap.

    Privacy:
      Built from the raw ``unit_ids``, so not private: ``ids``, ``num_rows`` and
      ``dropped_rows`` reveal which units are present and how many rows each has; do not
      release them. Unit ``u``'s ``rows`` depend on its own rows only (:func:`unit_table`).
    """

    ids: np.ndarray
    rows: np.ndarray
    num_rows: np.ndarray

    @property
    def num_units(self) -> int:
        """U, the number of privacy units."""
        return int(self.rows.shape[0])

    @property
    def max_rows_per_unit(self) -> int:
        """K, the cap."""
        return int(self.rows.shape[1])

    @property
    def dropped_rows(self) -> int:
        """Rows beyond the cap, which no step ever uses."""
        return int(np.sum(np.maximum(self.num_rows - self.max_rows_per_unit, 0)))


def _unit_digest(unit_id: Any) -> int:
    """A stable 64-bit integer from a unit id (the same in every process and Python run)."""
    value = unit_id.item() if isinstance(unit_id, np.generic) else unit_id
    text = f"{type(value).__name__}:{value!r}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def unit_table(unit_ids: Any, *, max_rows_per_unit: int, cap_seed: int | None = 0) -> UnitTable:
    """Groups rows by unit and applies the cap.

    A unit with more than K rows keeps K of them: with ``cap_seed=None`` its first K rows in
    data order; with an integer ``cap_seed`` (default 0) K rows drawn by a permutation seeded
    by ``(cap_seed, hash of the unit id, the unit's row count)``, so the rows kept are spread
    over the unit's data rather than its oldest rows. Either way the choice is fixed (the same
    rows at every step and in every run) and depends on nothing outside the unit.

    Args:
      unit_ids: one id per row (1-D, N rows): integers or strings.
      max_rows_per_unit: K >= 1.
      cap_seed: non-negative integer, or None for the first K rows.

    Returns:
      The `UnitTable`.

    Raises:
      ValueError: for an empty or non-1-D `unit_ids`, float ids, or K < 1.

    Privacy:
      The cap bounds what one unit puts into a step; the clip bounds its gradient. Rows kept
      for one unit never depend on another unit's presence, which the add/remove-one-unit
      accounting needs.
    """
    ids = np.asarray(unit_ids)
    k = max_rows_per_unit
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"max_rows_per_unit must be a positive integer, got {k!r}.")
    if ids.ndim != 1 or ids.shape[0] < 1:
        raise ValueError(f"unit_ids must be 1-D with one id per row, got shape {ids.shape}.")
    if ids.dtype.kind not in "iuUSO":
        raise ValueError(f"unit_ids must be integers or strings, got dtype {ids.dtype}.")
    if cap_seed is not None and (not isinstance(cap_seed, (int, np.integer)) or cap_seed < 0):
        raise ValueError(f"cap_seed must be a non-negative integer or None, got {cap_seed!r}.")
    distinct, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")  # rows grouped by unit, data order inside
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    table = np.full((len(distinct), int(k)), -1, np.int64)
    for u, (start, m) in enumerate(zip(starts, counts)):
        rows = order[start : start + m]
        if m > k:
            if cap_seed is None:
                rows = rows[:k]
            else:
                rng = np.random.default_rng([int(cap_seed), _unit_digest(distinct[u]), int(m)])
                rows = np.sort(rows[rng.permutation(m)[:k]])
        table[u, : len(rows)] = rows
    return UnitTable(ids=distinct, rows=table, num_rows=counts.astype(np.int64))


def unit_batches(
    x: Any,
    y: Any,
    *,
    unit_ids: Any,
    sampling_prob: float,
    steps: int,
    max_rows_per_unit: int,
    padded_units: int | None = None,
    seed: int | None = None,
    start_step: int = 0,
    cap_seed: int | None = 0,
    privacy_unit: str = "user",
) -> tf.data.Dataset:
    """Poisson-sampled units, each with (up to K of) its rows, as fixed-shape masked batches.

    At each logical step every unit is included independently with probability
    `sampling_prob`, with all its rows up to the cap K (`unit_table`). See the module
    docstring for the layout, the overflow rule and the `SamplingSpec`. Train on it with
    ``make_private(..., options=ExecutionOptions(group_size=max_rows_per_unit))`` and an
    ``expected_batch_size`` of ``sampling_prob * num_units`` (a `DPConfig` with
    ``num_examples=num_units`` and ``privacy_unit`` gives both).

    Args:
      x: features: an array / tensor or a (nested) structure of them, leading axis N rows.
        When building a sampler per epoch, pass tensors (convert once): arrays are copied
        into a new tensor by every sampler.
      y: labels, same convention.
      unit_ids: one id per row (integers or strings); rows with the same id form a unit.
      sampling_prob: per-unit inclusion probability q in (0, 1].
      steps: logical steps to emit (>= 0).
      max_rows_per_unit: K, the cap and the rows of one slot (``group_size`` of the model).
      padded_units: unit slots per element U_pad; default
        `padded_batch_size_for(U, sampling_prob=q)`. A smaller value bounds memory: a step then
        runs as several micro-batches of whole units.
      seed: non-negative integer for reproducible sampling (tests); None (default) draws it
        from OS entropy, which is what a private run should use.
      start_step: index of the first step (a resumed run passes the steps already taken).
      cap_seed: which rows a unit over the cap keeps (`unit_table`); not a secret.
      privacy_unit: what a unit is, recorded in the spec (the `DPConfig` must say the same).

    Returns:
      A `tf.data.Dataset` of `SampledBatch(x, y, mask, step_end)` with U_pad * K rows,
      carrying its `SamplingSpec`.

    Raises:
      ValueError: for out-of-range arguments or `unit_ids` not one per row.

    Privacy:
      This is Poisson subsampling of units, what `PoissonSampledDpEvent(q, ...)` accounts for
      under add/remove-one-unit adjacency, provided the consumer clips each unit once (group
      size K), treats the chunks up to `step_end` as one noisy step and divides by q * U. The
      padded shape is data-independent; the realized counts are not and must not leak except
      through the noisy update. A fixed `seed` makes the sample predictable to whoever knows it.
    """
    n = sampling.num_examples(x, y)
    ids = np.asarray(unit_ids)
    if ids.shape != (n,):
        raise ValueError(f"unit_ids must hold one id per row ({n}), got shape {ids.shape}.")
    table = unit_table(ids, max_rows_per_unit=max_rows_per_unit, cap_seed=cap_seed)
    q = sampling._check_poisson_args(sampling_prob, steps, start_step)
    if padded_units is not None and (isinstance(padded_units, bool) or int(padded_units) < 1):
        raise ValueError(f"padded_units must be a positive integer, got {padded_units!r}.")
    num_units, k = table.num_units, table.max_rows_per_unit
    slots = sampling._padded_size(num_units, q, padded_units)
    rows = slots * k
    # Tensors are used as given (numpy arrays are converted once per sampler); padding rows are
    # zeroed after the gather, so no padded copy of the data is made.
    xs, ys = sampling._to_tensors(x), sampling._to_tensors(y)
    slot_rows = tf.constant(np.where(table.rows < 0, n, table.rows), tf.int64)  # n: empty

    def gather(tree: Any, indices: tf.Tensor, real: tf.Tensor) -> Any:
        safe = tf.where(real, indices, tf.zeros_like(indices))

        def one(t: tf.Tensor) -> tf.Tensor:
            rows_of_t = tf.gather(t, safe)
            keep = tf.reshape(real, [rows] + [1] * (t.shape.rank - 1))
            kept = tf.where(keep, rows_of_t, tf.zeros_like(rows_of_t))
            return tf.ensure_shape(kept, [rows, *t.shape[1:]])

        return tf.nest.map_structure(one, tree)

    def step_sample(key: tf.Tensor, step: tf.Tensor) -> tf.data.Dataset:
        units = tf.where(sampling._step_coins(key, step, num_units, q))[:, 0]
        num_chunks = sampling._chunks_for(
            tf.shape(units, out_type=tf.int64)[0], tf.constant(slots, tf.int64)
        )

        def chunk(c: tf.Tensor) -> SampledBatch:
            sel = units[c * slots : (c + 1) * slots]
            filled = tf.gather(slot_rows, sel)  # [real units, K]
            empty = tf.fill([slots - tf.shape(sel)[0], k], tf.constant(n, tf.int64))
            indices = tf.reshape(tf.concat([filled, empty], axis=0), [rows])
            real = indices < n
            return SampledBatch(
                gather(xs, indices, real),
                gather(ys, indices, real),
                tf.cast(real, tf.float32),
                tf.equal(c, num_chunks - 1),
            )

        return tf.data.Dataset.range(num_chunks).map(chunk)

    spec = sampling.poisson_spec(
        num_units,
        sampling_prob=q,
        steps=steps,
        padded_batch_size=rows,
        start_step=start_step,
        group_size=k,
        privacy_unit=privacy_unit,
    )
    return sampling._poisson_pipeline(step_sample, seed=seed, spec=spec)
