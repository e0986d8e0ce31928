"""Adversarial properties of the parts of the guarantee around the step (issue 28, item 4).

``tests/test_privacy_invariants.py`` states dpcore's claim for one noised step (the pre-noise
clipped sum moves by at most C when one record is removed) and lets ``hypothesis`` search for
records that break it. This suite does the same for what surrounds the step, through the public
entry points:

1. Multi-worker sharded sampling (``sampling.sharded_poisson_batches``, one call per
   ``worker_index``, no subprocesses): every worker samples its own shard only, a record is in
   at most one worker's sample of a step and in at most one chunk of it, the union of the
   shards is exactly the single-machine Poisson sample of the same seed and start step, and every
   worker runs the same number of chunks. Summed over the workers and chunks of a step (the
   all-reduce), the pre-noise clipped sum equals the single machine's and removing a crafted
   record (σ = 0) moves it by at most ``C (1 + TOLERANCE)``, and by exactly nothing in a step
   that did not sample it: a record counted twice would move it by up to 2 C.
2. ``StepBackup`` resume after a kill at every point of a step: after any chunk of any logical
   step (before the step ends, or after it was applied but before the backup saw it), in the
   middle of saving (a torn weights file, weights written but no state, a torn state file) and
   after the save; once or twice in one run. The resumed run ends with the weights of an
   uninterrupted run with the same sampling seed and noise seed (σ > 0: no step lost, applied
   twice or given other noise), the noise seed of the first run that left a checkpoint, the same
   ``dp_steps`` and ledger, and the same ε.
3. ``DPOptimizer.fork_noise``: continuations of one checkpoint, forked, never draw a noise vector
   another continuation (or an earlier step) drew; unforked ones replay it exactly (which is why
   forking exists, and what makes this property able to fail).
4. EMA and Polyak averaging are post-processing: on crafted records, with logical steps of several
   chunks, the averages change only when a logical step ends, and then exactly as the averaging
   formula of the weights after that step (the privatized weights) says; nothing else of the
   batch reaches them.
5. A σ schedule (set between steps by a callback), with and without adaptive clipping: ε of the
   run is dp-accounting's ε for the Poisson-sampled Gaussian of each step's σ, composed in the
   order they ran, called directly; with adaptive clipping, the effective σ of the gradient and
   count releases, computed here from σ_Δ and σ_b, is the σ accounted.

Every property keeps few examples and shares its compiled steps; heavier ones are marked slow.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any
from unittest import mock

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf
import test_privacy_invariants as inv
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import dpcore
from dpcore import aggregation, sampling
from dpcore import backup as backup_module
from dpcore.backup import StepBackup
from dpcore.options import ExecutionOptions

C = inv.C
TOLERANCE = inv.TOLERANCE
MSE = inv.MSE


def _settings(max_examples: int) -> Any:
    """The suite's settings without shrinking: each example here runs whole training steps,
    and a failing one is reported as drawn (shrinking it took minutes)."""
    return settings(inv._settings(max_examples), phases=(Phase.explicit, Phase.generate))


# ------------------------------------------------------------------ 1. sharded sampling
FEATURES = 6
PMAX = 8  # every chunk is re-padded to this many rows for one compiled clipped sum


class _ShardedClip:
    """A Dense model and one compiled clipped sum (σ = 0, fast path, nonfinite='skip') of a
    ``[PMAX, FEATURES]`` chunk."""

    def __init__(self) -> None:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((FEATURES,))
        h = keras.layers.Dense(4, activation="tanh")(inputs)
        self.model = keras.Model(inputs, keras.layers.Dense(1)(h))
        self.traces = 0
        options = ExecutionOptions(method="fast", nonfinite="skip")

        @tf.function
        def clipped(x, y, mask):
            self.traces += 1
            s = dpcore.summarize(self.model, MSE, x, y, mask=mask, options=options)
            return aggregation.clip(s, l2_norm_clip=C).grads

        self.fn = clipped

    def __call__(self, features, labels, ids, mask) -> np.ndarray:
        """The clipped sum of the rows ``ids`` (mask 0 rows are padding) as one float64 vector."""
        b = len(ids)
        x = np.zeros((PMAX, FEATURES), "float32")
        y = np.zeros((PMAX, 1), "float32")
        m = np.zeros(PMAX, "float32")
        real = mask > 0
        x[:b][real] = features[ids[real]]
        y[:b][real] = labels[ids[real]]
        m[:b] = mask.astype("float32")
        grads = self.fn(tf.constant(x), tf.constant(y), tf.constant(m))
        return np.concatenate([g.numpy().astype(np.float64).ravel() for g in grads])


_SHARDED: list[_ShardedClip] = []


def _steps_of(dataset) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Per logical step, its chunks as (ids, mask); checks the padding rows."""
    steps, chunks = [], []
    for xb, yb, mask, end in dataset.as_numpy_iterator():
        real = mask > 0
        np.testing.assert_array_equal(mask[~real], 0.0)
        np.testing.assert_array_equal(xb[real][:, 0], yb[real] + 1)  # x carries id + 1
        np.testing.assert_array_equal(xb[~real], 0.0)
        chunks.append((yb.astype(np.int64), mask.astype("float32")))
        if end:
            steps.append(chunks)
            chunks = []
    assert not chunks, "the data ended inside a logical step"
    return steps


@_settings(max_examples=6)
@given(
    n=st.integers(4, 30),
    workers=st.integers(1, 4),
    q=st.sampled_from((0.2, 0.5, 1.0)),
    steps=st.integers(1, 3),
    start_step=st.integers(0, 5),
    padded=st.sampled_from((3, 5, PMAX)),
    seed=st.integers(0, 2**31 - 1),
    rec=inv.records(),
    record=st.integers(0, 29),
)
def test_sharded_workers_sample_each_record_once_and_sum_like_one_machine(
    n, workers, q, steps, start_step, padded, seed, rec, record
):
    workers = min(workers, n)
    record = record % n
    ids_x = np.arange(1, n + 1, dtype="float32")[:, None]
    ids_y = np.arange(n, dtype=np.int64)
    kw = dict(sampling_prob=q, steps=steps, seed=seed, padded_batch_size=padded)
    per_worker = [
        _steps_of(
            sampling.sharded_poisson_batches(
                ids_x, ids_y, num_workers=workers, worker_index=i, start_step=start_step, **kw
            )
        )
        for i in range(workers)
    ]
    single = _steps_of(sampling.poisson_batches(ids_x, ids_y, start_step=start_step, **kw))
    features, labels = inv.crafted_batch((FEATURES,), dict(rec, index=record), b=n)
    if not _SHARDED:
        _SHARDED.append(_ShardedClip())
    clip = _SHARDED[0]
    assert len(single) == steps and all(len(w) == steps for w in per_worker)
    cache: dict[Any, np.ndarray] = {}
    for t in range(steps):
        assert len({len(w[t]) for w in per_worker}) == 1  # same number of chunks everywhere
        sampled: list[int] = []
        for i, w in enumerate(per_worker):
            for ids, mask in w[t]:
                own = ids[mask > 0]
                assert np.all(own % workers == i), (i, own)  # only the worker's own shard
                sampled.extend(own.tolist())
        assert len(sampled) == len(set(sampled)), sampled  # no record twice in a step
        want = sorted(int(i) for ids, mask in single[t] for i in ids[mask > 0])
        assert sorted(sampled) == want  # the union is the single-machine sample

        def total(chunks_by_worker, drop=None):
            out = 0.0
            for chunks in chunks_by_worker:
                for ids, mask in chunks:
                    if drop is None or drop not in ids[mask > 0]:
                        key = (ids.tobytes(), mask.tobytes())  # the same chunk's sum, computed once
                        if key not in cache:
                            cache[key] = clip(features, labels, ids, mask)
                        out = out + cache[key]
                    else:
                        out = out + clip(features, labels, ids, np.where(ids == drop, 0.0, mask))
            return out

        sharded = total([w[t] for w in per_worker])
        without = total([w[t] for w in per_worker], drop=record)
        moved = float(np.linalg.norm(sharded - without))
        assert np.isfinite(moved) and moved <= C * (1 + TOLERANCE), moved
        if record not in sampled:
            assert moved == 0.0
        one_machine = total([single[t]])
        np.testing.assert_allclose(sharded, one_machine, rtol=1e-5, atol=1e-5 * C * (n + 1))
    assert clip.traces == 1


# --------------------------------------------------------------------- 2. StepBackup kills
BN, BQ, SPE, EPOCHS, BP = 24, 0.25, 3, 2, 3  # 6 logical steps, ~6 rows each, chunks of 3 rows
TOTAL = SPE * EPOCHS
SAMPLING_SEED = 1234
FIRST_NOISE_SEED = (11, 12)
B_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
B_SIGMA, B_CLIP = 0.7, 0.5


class Killed(Exception):
    """Stands for the process being killed at that point."""


def _backup_data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(BN, 4)).astype("float32")
    x[5] *= 1e6  # a record whose gradient is clipped hard
    return x, rng.integers(0, 3, BN).astype("int32")


def _backup_config():
    return dpcore.DPConfig(
        l2_norm_clip=B_CLIP,
        noise_multiplier=B_SIGMA,
        expected_batch_size=BQ * BN,
        num_examples=BN,
        steps=TOTAL,
    )


def _backup_model(seed):
    init = keras.initializers.GlorotUniform(seed=0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer=init)])
    return dpcore.make_private(
        model,
        optimizer=keras.optimizers.SGD(0.5),
        loss=B_LOSS,
        l2_norm_clip=B_CLIP,
        noise_multiplier=B_SIGMA,
        expected_batch_size=BQ * BN,
        seed=seed,
    )


def _sampler(start):
    x, y = _backup_data()
    return sampling.poisson_batches(
        x,
        y,
        sampling_prob=BQ,
        steps=TOTAL - start,
        start_step=start,
        seed=SAMPLING_SEED,
        padded_batch_size=BP,
    )


def _chunks_per_step() -> list[int]:
    counts, n = [], 0
    for *_, end in _sampler(0).as_numpy_iterator():
        n += 1
        if end:
            counts.append(n)
            n = 0
    return counts


_CHUNKS: list[list[int]] = []
_REFERENCE: dict[tuple[int, int], tuple[np.ndarray, float]] = {}
_EPS_DISCRETIZATION = 1e-3


def _weights(dp) -> np.ndarray:
    return np.concatenate([np.ravel(v.numpy()) for v in dp.model.trainable_variables])


def _reference(noise_seed: tuple[int, int]) -> tuple[np.ndarray, float]:
    """Weights and ε of the uninterrupted run (no backup) with that noise seed."""
    if noise_seed not in _REFERENCE:
        dp = _backup_model(noise_seed)
        eps = dpcore.callbacks.EpsilonCallback(
            _backup_config(), pld_discretization=_EPS_DISCRETIZATION
        )
        dp.fit(_sampler(0), epochs=1, callbacks=[eps], verbose=0)
        assert int(dp.optimizer.dp_steps.numpy()) == TOTAL
        _REFERENCE[noise_seed] = (_weights(dp), eps.epsilon())
    return _REFERENCE[noise_seed]


class _After(keras.callbacks.Callback):
    """Kills the process after the backup saved step ``step``."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.dp_steps.numpy()) == self.step:
            raise Killed()


def _start(folder: str, noise_seed, kill: tuple[int, str, int] | None, started=None):
    """One start of the run in ``folder``, killed at ``kill = (step, phase, chunk)``; the model
    is appended to ``started``."""
    dp = _backup_model(noise_seed)
    if started is not None:
        started.append(dp)
    eps = dpcore.callbacks.EpsilonCallback(_backup_config(), pld_discretization=_EPS_DISCRETIZATION)
    with mock.patch.object(dpcore.distribute, "shared_seed", lambda strategy: SAMPLING_SEED):
        backup = StepBackup(folder, epsilon=eps)
    start = backup.resume_step
    callbacks = [eps, backup]
    patches: list[Any] = []
    if kill is not None:
        step, phase, chunk = kill
        if phase == "chunk":
            # _step_open runs after every chunk of a logical step: the kill lands after chunk
            # `chunk` of step `step` (for the last chunk: after the step was applied, before any
            # callback saw it).
            target = sum(_CHUNKS[0][start : step - 1]) + chunk
            calls = [0]
            step_open = dp._step_open

            def killed_step_open():
                calls[0] += 1
                if calls[0] == target:
                    raise Killed()
                return step_open()

            dp._step_open = killed_step_open
        elif phase in ("weights_torn", "weights_written"):
            save_weights = dp.save_weights

            def killed_save_weights(path, *args, **kwargs):
                if int(dp.optimizer.dp_steps.numpy()) != step:
                    return save_weights(path, *args, **kwargs)
                if phase == "weights_torn":
                    with open(path, "wb") as f:
                        f.write(b"\x89HDF\r\n")  # the first bytes of a weights file, no more
                else:
                    save_weights(path, *args, **kwargs)
                raise Killed()

            dp.save_weights = killed_save_weights
        elif phase == "state_torn":
            write_json = backup_module._write_json

            def killed_write_json(path, payload):
                if payload["applied_steps"] != step:
                    return write_json(path, payload)
                with open(f"{path}.tmp", "w") as f:
                    f.write('{"format": "dpcore.step_b')
                raise Killed()

            patches.append(mock.patch.object(backup_module, "_write_json", killed_write_json))
        else:
            callbacks.append(_After(step))
    data = _sampler(start)
    for p in patches:
        p.start()
    try:
        dp.fit(data, epochs=EPOCHS, steps_per_epoch=SPE, callbacks=callbacks, verbose=0)
    finally:
        for p in patches:
            p.stop()
    return dp, backup, eps


def _checkpoint_written(folder: str) -> bool:
    path = os.path.join(folder, "state.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return json.load(f).get("checkpoint") is not None


PHASES = ("chunk", "weights_torn", "weights_written", "state_torn", "after")


@st.composite
def kill_plans(draw: Any) -> list[tuple[int, str, int]]:
    """One or two kills at increasing steps, each at some point of its step."""
    if not _CHUNKS:
        _CHUNKS.append(_chunks_per_step())
    steps = sorted(draw(st.sets(st.integers(1, TOTAL), min_size=1, max_size=2)))
    plan = []
    for step in steps:
        phase = draw(st.sampled_from(PHASES))
        chunk = draw(st.integers(1, _CHUNKS[0][step - 1])) if phase == "chunk" else 0
        plan.append((step, phase, chunk))
    return plan


@pytest.mark.slow
@_settings(max_examples=8)
@given(plan=kill_plans())
def test_step_backup_resumes_a_run_killed_at_any_point_of_a_step(tmp_path_factory, plan):
    folder = str(tmp_path_factory.mktemp("backup"))
    persisted = None  # the noise seed of the first start that left a checkpoint
    restarts = 0
    for step, phase, chunk in plan:
        seed = FIRST_NOISE_SEED if restarts == 0 else (21 + restarts, 22 + restarts)
        restarts += 1
        with pytest.raises(Killed):
            _start(folder, seed, (step, phase, chunk))
        if persisted is None and _checkpoint_written(folder):
            persisted = seed
    seed = (21 + restarts, 22 + restarts)
    had_state = os.path.exists(os.path.join(folder, "state.json"))
    dp, backup, eps = _start(folder, seed, None)
    if persisted is None:
        persisted = seed
    assert backup.resumed == had_state
    assert backup.resume_step <= max(step for step, _, _ in plan)
    # The run's noise stream is the one of the first checkpoint: later starts' own seeds are
    # overwritten by the restore, so no step index is drawn from two streams.
    assert tuple(int(s) for s in dp.optimizer.noise_seed.numpy()) == persisted
    assert int(dp.optimizer.dp_steps.numpy()) == TOTAL
    assert int(dp.optimizer.micro_steps.numpy()) == 0
    assert eps.ledger.steps == TOTAL
    ref_weights, ref_eps = _reference(persisted)
    np.testing.assert_allclose(_weights(dp), ref_weights, rtol=0, atol=1e-6)
    assert eps.epsilon() == ref_eps


def test_step_backup_kill_points_land_inside_a_step(tmp_path):
    """The kill hooks of the property above land where they claim: killed after the first chunk
    of a step of several chunks, the optimizer holds that step open (one chunk accumulated, the
    step not applied) and the backup's state still says the step before."""
    if not _CHUNKS:
        _CHUNKS.append(_chunks_per_step())
    step = next(i + 1 for i, c in enumerate(_CHUNKS[0]) if c > 1)
    started: list[Any] = []
    with pytest.raises(Killed):
        _start(str(tmp_path), FIRST_NOISE_SEED, (step, "chunk", 1), started)
    opt = started[0].optimizer
    assert (int(opt.dp_steps.numpy()), int(opt.micro_steps.numpy())) == (step - 1, 1)
    state = json.loads((tmp_path / "state.json").read_text()) if step > 1 else None
    if state is not None:
        assert state["applied_steps"] == state["checkpoint_steps"] == step - 1


# ------------------------------------------------------------------------ 3. fork_noise
class _NoiseSteps:
    """Noise-only steps (every row masked), weights zeroed before each: the update is minus the
    step's noise (σ C / expected batch size = 1), read exactly."""

    def __init__(self) -> None:
        keras.utils.set_random_seed(0)
        self.model = keras.Sequential([keras.Input((50,)), keras.layers.Dense(8)])
        self.opt = dpcore.DPOptimizer(
            keras.optimizers.SGD(1.0),
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            expected_batch_size=1.0,
            seed=(5, 6),
        )
        self.opt.build(self.model.trainable_variables)
        self.traces = 0

        @tf.function
        def step():
            self.traces += 1
            return dpcore.dp_train_step(
                self.model, MSE, tf.ones([2, 50]), tf.zeros([2, 8]), optimizer=self.opt,
                mask=tf.zeros([2]),
            )  # fmt: skip

        self.step = step

    def noise(self) -> np.ndarray:
        for v in self.model.trainable_variables:
            v.assign(tf.zeros_like(v))
        self.step()
        return -np.concatenate([v.numpy().ravel() for v in self.model.trainable_variables])


_NOISE: list[_NoiseSteps] = []


@_settings(max_examples=10)
@given(
    checkpoint_step=st.integers(0, 50),
    plan=st.lists(st.tuples(st.booleans(), st.integers(1, 3)), min_size=2, max_size=4),
)
def test_forked_continuations_never_replay_a_noise_vector(checkpoint_step, plan):
    """Continuations of one checkpoint (its noise seed and dp_steps), each forked or not: a
    forked continuation shares no noise vector with any other continuation or step; two
    unforked ones draw exactly the same vectors at the same steps."""
    if not _NOISE:
        _NOISE.append(_NoiseSteps())
    r = _NOISE[0]
    saved_seed = r.opt.noise_seed.numpy().copy()
    draws: list[tuple[bool, int, np.ndarray]] = []
    seeds = []
    for forked, k in plan:
        r.opt.noise_seed.assign(saved_seed)  # restore the checkpoint
        r.opt.dp_steps.assign(checkpoint_step)
        if forked:
            r.opt.fork_noise()
            seeds.append(tuple(r.opt.noise_seed.numpy()))
        for i in range(k):
            draws.append((forked, checkpoint_step + i, r.noise()))
    assert len(set(seeds)) == len(seeds) and tuple(saved_seed) not in seeds
    size = draws[0][2].size
    for a in range(len(draws)):
        fa, sa, va = draws[a]
        assert abs(va.std() - 1.0) < 6 / math.sqrt(2 * size)
        for b in range(a):
            fb, sb, vb = draws[b]
            same = int(np.sum(va == vb))
            if not fa and not fb and sa == sb:
                assert same == size  # the replay fork_noise exists to prevent
            else:
                assert same <= 2, (fa, sa, fb, sb, same)
                assert abs(np.corrcoef(va, vb)[0, 1]) < 6 / math.sqrt(size)
    assert r.traces == 1
    with pytest.raises(ValueError, match="eagerly"):
        tf.function(r.opt.fork_noise)()


# ---------------------------------------------------------------- 4. EMA and Polyak averaging
A_FEATURES, A_ROWS, A_MOMENTUM, A_POLYAK_START = 6, 4, 0.9, 1


class _Averaged:
    """A model whose DPOptimizer averages (inner EMA, or Polyak), trained by dp_train_step on
    chunks with step_end; one compiled step."""

    def __init__(self, kind: str) -> None:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((A_FEATURES,))
        h = keras.layers.Dense(4, activation="tanh")(inputs)
        self.model = keras.Model(inputs, keras.layers.Dense(1)(h))
        if kind == "ema":
            inner = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=A_MOMENTUM)
            extra = {}
        else:
            inner = keras.optimizers.SGD(0.1)
            extra = {"polyak_start_step": A_POLYAK_START}
        self.kind = kind
        self.opt = dpcore.DPOptimizer(
            inner, l2_norm_clip=C, noise_multiplier=0.5, expected_batch_size=4.0, seed=0, **extra
        )
        self.opt.build(self.model.trainable_variables)
        self.traces = 0

        @tf.function
        def step(x, y, mask, end):
            self.traces += 1
            return dpcore.dp_train_step(
                self.model, MSE, x, y, optimizer=self.opt, mask=mask, step_end=end,
                options=ExecutionOptions(nonfinite="skip"),
            )  # fmt: skip

        self.step = step

    def averages(self) -> list[np.ndarray]:
        if self.kind == "ema":
            avg = self.opt.inner_optimizer._model_variables_moving_average
        else:
            avg = self.opt.polyak_averages
        return [np.array(v.numpy()) for v in avg]

    def weights(self) -> list[np.ndarray]:
        return [np.array(v.numpy()) for v in self.model.trainable_variables]


_AVERAGED: dict[str, _Averaged] = {}


@_settings(max_examples=8)
@given(
    kind=st.sampled_from(("ema", "polyak")),
    rec=inv.records(),
    chunks=st.lists(st.integers(1, 3), min_size=1, max_size=3),
)
def test_weight_averages_are_post_processing_of_the_privatized_weights(kind, rec, chunks):
    """Each logical step (``chunks[i]`` chunks of crafted rows): the average stays bitwise put
    on the chunks before the step ends, and when it ends it is exactly the averaging formula of
    the previous average and the weights just applied: no other input reaches it."""
    if kind not in _AVERAGED:
        _AVERAGED[kind] = _Averaged(kind)
    r = _AVERAGED[kind]
    for i, k in enumerate(chunks):
        for j in range(k):
            x, y = inv.crafted_batch((A_FEATURES,), dict(rec, seed=rec["seed"] + 7 * i + j))
            before_w, before_avg = r.weights(), r.averages()
            applied = int(r.opt.dp_steps.numpy())
            end = j == k - 1
            r.step(tf.constant(x), tf.constant(y), tf.ones([A_ROWS]), tf.constant(end))
            after_w, after_avg = r.weights(), r.averages()
            if not end:
                for a, b in zip(before_avg + before_w, after_avg + after_w):
                    np.testing.assert_array_equal(a, b)
                continue
            assert int(r.opt.dp_steps.numpy()) == applied + 1
            for old, new, w in zip(before_avg, after_avg, after_w):
                if kind == "ema":
                    m = np.float32(A_MOMENTUM) if applied > 0 else np.float32(0.0)
                    want = m * old + (np.float32(1.0) - m) * w
                else:
                    n = max(applied + 1 - A_POLYAK_START, 0)
                    rate = np.float32(1.0 / n) if n else np.float32(0.0)
                    want = old + (w - old) * rate
                np.testing.assert_allclose(new, want, rtol=1e-6, atol=1e-7 * np.abs(w).max())
    if kind == "polyak":
        assert r.opt.polyak_count == max(int(r.opt.dp_steps.numpy()) - A_POLYAK_START, 0)
    assert r.traces == 1


# ----------------------------------------------------------- 5. σ schedule and adaptive clipping
S_N, S_Q, S_DELTA = 40, 0.25, 1e-3
SIGMAS = (0.9, 1.3, 2.0)
COUNT_STDDEV = 4.0


def _direct_epsilon(sigmas: list[float]) -> float:
    """dp-accounting's PLD ε for one Poisson-sampled Gaussian step per σ (composition commutes:
    the steps of each σ are one self-composed event, which builds one PLD per σ)."""
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=_EPS_DISCRETIZATION)
    for sigma in sorted(set(sigmas)):
        accountant.compose(
            dp_accounting.PoissonSampledDpEvent(S_Q, dp_accounting.GaussianDpEvent(sigma)),
            sigmas.count(sigma),
        )
    return float(accountant.get_epsilon(S_DELTA))


class _Scheduled:
    """One DPModel (fixed or adaptive clipping) and one EpsilonCallback kept across examples:
    every example is one more ``fit`` of the same run, so the whole run's ε is checked."""

    def __init__(self, adaptive: bool) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(S_N, 5)).astype("float32")
        self.x[0] *= 1e8  # one crafted record
        self.y = rng.integers(0, 3, S_N).astype("int32")
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
        clip = dpcore.adaptive.AdaptiveClip(
            target_quantile=0.5, learning_rate=0.2, count_stddev=COUNT_STDDEV
        )
        self.opt = dpcore.DPOptimizer(
            keras.optimizers.SGD(0.1),
            l2_norm_clip=0.5,
            noise_multiplier=SIGMAS[0],
            expected_batch_size=S_Q * S_N,
            adaptive_clip=clip if adaptive else None,
        )
        self.dp = dpcore.make_private(model, optimizer=self.opt, loss=B_LOSS)
        config = dpcore.DPConfig(
            l2_norm_clip=0.5,
            noise_multiplier=SIGMAS[0],
            expected_batch_size=S_Q * S_N,
            num_examples=S_N,
            steps=100,
            target_delta=S_DELTA,
        )
        self.eps = dpcore.callbacks.EpsilonCallback(config, pld_discretization=_EPS_DISCRETIZATION)
        self.ran: list[float] = []


_SCHEDULED: dict[bool, _Scheduled] = {}


@_settings(max_examples=4)
@given(
    schedule=st.lists(st.sampled_from(SIGMAS), min_size=1, max_size=4),
    adaptive=st.booleans(),
)
def test_epsilon_of_a_sigma_schedule_is_dp_accountings(schedule, adaptive):
    if adaptive not in _SCHEDULED:
        _SCHEDULED[adaptive] = _Scheduled(adaptive)
    r = _SCHEDULED[adaptive]
    opt, ran = r.opt, r.ran

    class Schedule(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch < len(schedule):  # Keras begins one more batch to find the data's end
                opt.noise_multiplier = schedule[batch]

        def on_train_batch_end(self, batch, logs=None):
            ran.append(opt.noise_multiplier)

    start = int(opt.dp_steps.numpy())
    data = sampling.poisson_batches(
        r.x, r.y, sampling_prob=S_Q, steps=len(schedule), seed=7, start_step=start
    )
    r.dp.fit(data, epochs=1, verbose=0, callbacks=[Schedule(), r.eps])
    assert ran[start:] == schedule and int(opt.dp_steps.numpy()) == len(ran)
    if adaptive:
        # The gradient noise multiplier the step computes (DPOptimizer._finish calls this tensor
        # function with the σ that ran) and the count's make up the accounted σ:
        # σ^-2 = σ_Δ^-2 + (2 σ_b)^-2, computed here independently of dpcore.
        for s in set(schedule):
            s_grad = float(
                dpcore.adaptive.gradient_noise_multiplier_tensor(
                    tf.constant(s, tf.float64), count_stddev=COUNT_STDDEV
                )
            )
            effective = (s_grad**-2 + (2 * COUNT_STDDEV) ** -2) ** -0.5
            assert effective == pytest.approx(s, rel=1e-12)
            assert s_grad > s
    assert r.eps.ledger.steps == len(ran)
    np.testing.assert_allclose(r.eps.epsilon(), _direct_epsilon(ran), rtol=1e-9)
