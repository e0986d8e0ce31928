"""Tests for dpcore.distribute: multi-worker DP training with 2 local worker processes.

The multi-worker tests start their workers with `dpcore_experiments.launch_local.launch` on free
loopback ports, bounded by a timeout (a worker whose peer died would block in a collective op
forever; the launcher kills every worker at the timeout or when one fails).
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from dpcore_experiments.launch_local import launch

import dpcore
from dpcore import distribute, sampling, units

WORKER = str(Path(__file__).with_name("mwms_worker.py"))
TWO_REPLICAS = str(Path(__file__).with_name("two_replicas.py"))


def _report(runs) -> str:
    """Every worker's status and log tail: the worker asserted on is not always the first to fail."""
    return "\n\n".join(
        f"worker {run.index}: status {run.returncode}, stopped by the launcher: {run.killed}"
        f"\n{Path(run.log_path).read_text()[-3000:]}"
        for run in runs
    )


def _run_workers(scenario: str, tmp_path: Path, workers: int = 2) -> list[dict]:
    runs = launch(
        [sys.executable, WORKER, scenario, str(tmp_path)],
        workers=workers,
        timeout_s=400,
        log_dir=str(tmp_path / "logs"),
    )
    if any(run.returncode != 0 for run in runs):
        pytest.fail(_report(runs))
    if "," in scenario:
        return []  # each scenario's results are in its own folder
    return _results(tmp_path, workers)


def _results(folder: Path, workers: int = 2) -> list[dict]:
    return [json.loads((folder / f"worker{i}.json").read_text()) for i in range(workers)]


@pytest.fixture
def dp_step_and_fit(run_once) -> Path:
    """One start of a 2-worker cluster that runs the dp_step and fit scenarios (once per test
    run: the tests of both read it); their results are in its dp_step/ and fit/ folders."""
    return run_once("mwms_dp_step_fit", lambda folder: _run_workers("dp_step,fit", folder))


def test_single_process_is_one_chief_worker():
    info = distribute.worker_info()
    assert (info.num_workers, info.worker_index, info.is_chief) == (1, 0, True)
    assert distribute.is_chief()
    assert distribute.shared_seed() >= 0
    x, y = np.zeros((8, 2), "float32"), np.zeros(8, "int32")
    ds = sampling.poisson_batches(x, y, sampling_prob=0.5, steps=2, seed=0)
    distribute.check_sharding(ds)  # one worker: any sampler's data is fine


def test_for_replicas_pads_to_a_multiple_and_copies_step_end():
    x, y = np.ones((10, 2), "float32"), np.zeros(10, "int32")
    ds = sampling.poisson_batches(x, y, sampling_prob=0.5, steps=1, padded_batch_size=5, seed=0)
    for batch in distribute.for_replicas(ds, 2).take(1):
        xb, yb, mask, end = batch
        assert xb.shape[0] == yb.shape[0] == mask.shape[0] == end.shape[0] == 6
        assert float(tf.reduce_sum(mask[5:])) == 0.0
        assert len(set(end.numpy().tolist())) == 1


def _units(padded_units=3):
    """unit_batches over 3 units of 2 rows, 3 unit slots (6 rows) per element."""
    x, y = np.ones((6, 2), "float32"), np.zeros(6, "int32")
    return units.unit_batches(
        x,
        y,
        unit_ids=np.repeat(np.arange(3), 2),
        sampling_prob=1.0,
        steps=1,
        max_rows_per_unit=2,
        padded_units=padded_units,
        seed=0,
    )


def test_for_replicas_pads_units_of_several_rows_to_whole_units_per_replica():
    """3 unit slots of 2 rows on 2 replicas: padded to 8 rows (4 per replica, whole units),
    not 6 (3 per replica, which cut the second unit in two)."""
    data = _units()
    untagged = data.filter(lambda *element: True)  # what DPModel.fit hands on: no spec
    for padded in (
        distribute.for_replicas(data, 2),
        distribute.for_replicas(untagged, 2, group_size=2),
    ):
        for batch in padded.take(1):
            assert batch.mask.shape[0] == 8
            np.testing.assert_array_equal(batch.mask.numpy(), [1, 1, 1, 1, 1, 1, 0, 0])


def test_distribute_sampled_refuses_units_unless_the_step_clips_them_whole():
    """Units of 2 rows fed to a custom loop whose step clips rows one by one would let one unit
    move the clipped sum by up to 2 C: refused unless the step's options say group_size=2."""
    strategy = tf.distribute.get_strategy()
    data = _units()
    with pytest.raises(
        ValueError, match=r"options=ExecutionOptions\(group_size=2\) to dp_train_step"
    ):
        distribute.distribute_sampled(strategy, data)
    with pytest.raises(ValueError, match=r"use options=ExecutionOptions\(group_size=2\)"):
        distribute.distribute_sampled(strategy, data, options=dpcore.ExecutionOptions())
    untagged = data.filter(lambda *element: True)
    with pytest.raises(ValueError, match="carry no SamplingSpec"):
        distribute.distribute_sampled(
            strategy, untagged, options=dpcore.ExecutionOptions(group_size=2)
        )
    distribute.distribute_sampled(strategy, data, options=dpcore.ExecutionOptions(group_size=2))


@pytest.fixture
def two_replicas(replica_run) -> dict:
    """tests/two_replicas.py's measurements (run on 2 logical CPUs)."""
    lines = [line for line in replica_run["stdout"].splitlines() if line.startswith("RESULT ")]
    assert lines, replica_run["error"][-3000:]
    return json.loads(lines[0][len("RESULT ") :])


ON_TWO_REPLICAS = pytest.mark.replica_script(Path(TWO_REPLICAS).read_text())


@pytest.mark.slow
@ON_TWO_REPLICAS
def test_an_optimizer_constructed_outside_the_strategy_scope_is_refused(two_replicas):
    """Its DP state would be plain variables: each replica counted every step (dp_steps 6
    after 3 steps with fit; with accumulation_steps=2 no update ever applied), and under several
    workers each drew its own noise. Refused at build (fit) or at the step (custom loop)."""
    for part in ("outside_fit", "outside_loop"):
        error = two_replicas[part].get("error", "")
        assert "not created in that strategy's scope" in error, two_replicas[part]
        assert "inside `with strategy.scope():`" in error


@pytest.mark.slow
@ON_TWO_REPLICAS
def test_the_custom_loop_over_distribute_sampled_runs_on_two_replicas(two_replicas):
    """distribute_sampled hands each replica a copy of step_end per row; dp_train_step folds it
    (it used to refuse it: "step_end must be a bool scalar"). Same update as one device."""
    multi, single = two_replicas["loop_replicas"], two_replicas["loop_single"]
    assert "error" not in multi, multi["error"] if "error" in multi else None
    assert multi["dp_steps"] == single["dp_steps"] == 3
    assert np.abs(single["delta"]).max() > 0.05
    np.testing.assert_allclose(multi["delta"], single["delta"], rtol=0, atol=1e-6)


@pytest.mark.slow
@ON_TWO_REPLICAS
def test_units_on_two_replicas_fit_and_one_unit_moves_the_clipped_sum_by_at_most_c(two_replicas):
    """K = 2 rows per unit in 3 slots on 2 replicas: fit pads to whole units per replica (it
    used to split 6 rows 3 + 3, cutting a unit, and the engine refused the batch), and removing
    the unit that straddled the replicas moves the clipped sum by at most C = 1."""
    full, less = two_replicas["units_all"], two_replicas["units_without_1"]
    assert "error" not in full and "error" not in less, (full, less)
    assert full["dp_steps"] == less["dp_steps"] == 1
    moved = float(np.linalg.norm(np.subtract(full["sum"], less["sum"])))
    # Every unit is clipped (inputs ~100): its contribution is C up to float32 rounding.
    assert 0.99 <= moved <= 1.0 + 1e-5


@pytest.mark.slow
def test_dp_step_on_two_workers_matches_one_process(dp_step_and_fit):
    """Custom loop (strategy.run of dp_train_step) on 2 workers over the sharded sampler."""
    w0, w1 = _results(dp_step_and_fit / "dp_step")
    assert w0["info"] == [2, 0, True] and w1["info"] == [2, 1, False]
    assert w0["shared_seed"] == w1["shared_seed"]
    for key in ("sigma0", "sigma1"):
        a, b = w0[key], w1[key]
        # Same noise seed (OS entropy, broadcast from the chief), steps and weights everywhere.
        assert a["noise_seed"] == b["noise_seed"]
        assert a["dp_steps"] == b["dp_steps"] == 5
        np.testing.assert_array_equal(a["delta"], b["delta"])
        # The same update as one process on the same global sample (and the same noise seed).
        assert np.abs(a["delta"]).max() > 0.05
        np.testing.assert_allclose(a["delta"], a["single_delta"], rtol=0, atol=1e-6)
    # Noise once per global step: std sigma * C / expected_batch_size, not sqrt(2) times it.
    target = 1.0 * 0.5 / 12.0
    n = w0["noise_size"]
    for std in w0["noise_std"]:  # 2 workers, then 1 process
        # The sample std of n standard normals is within 5/sqrt(2n) of 1 but for ~3e-7.
        assert abs(std - target) < 5 * target / math.sqrt(2 * n)
    assert w0["full_refused"] and w1["full_refused"]
    # fork_noise takes the chief's new seed on every worker (each used to keep its own entropy:
    # noise std σ C / sqrt(2) in the sum), and an optimizer made outside the scope is refused.
    assert w0["forked_seed"] == w1["forked_seed"] != w0["sigma1"]["noise_seed"]
    assert w0["outside_refused"] and w1["outside_refused"]


@pytest.mark.slow
def test_fit_and_evaluate_on_two_workers_match_one_process(dp_step_and_fit):
    """DPModel.fit/evaluate under MultiWorkerMirroredStrategy (dpcore's own epoch loop): the
    Keras surface (callbacks, History, validation, metrics over real rows of every worker)
    and the same weights and logs as one process fitting the same global sample."""
    tmp_path = dp_step_and_fit / "fit"
    w0, w1 = _results(tmp_path)
    for w in (w0, w1):
        assert w["dp_steps"] == 10 and w["batches"] == 10 and w["epochs"] == 2
        assert w["data_feed"] == "masked_batches"
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            values = w["history"][key]
            np.testing.assert_allclose(values, w["single_history"][key], rtol=1e-5)
        assert w["evaluate"]["loss"] == pytest.approx(w["history"]["val_loss"][-1], rel=1e-6)
        np.testing.assert_allclose(w["weights"], w["single_weights"], rtol=0, atol=1e-5)
        assert w["stopped_steps"] == 2  # worker 1's callback stopped both workers
        assert w["full_refused"]
    assert w0["weights"] == w1["weights"] and w0["noise_seed"] == w1["noise_seed"]
    # Epsilon on every worker; one copy of each output: the chief's.
    assert w0["history"]["epsilon"][-1] > 0
    assert w0["history"] == w1["history"]
    assert (tmp_path / "written_by.txt").read_text() == "0\n"
    assert (tmp_path / "ckpt.weights.h5").exists()
    assert json.loads((tmp_path / "ledger.json").read_text())


@pytest.mark.slow
def test_kill_9_of_one_worker_then_restart_continues_the_run(tmp_path):
    """Preemption: worker 1 SIGKILLs itself after logical step 6 (mid-epoch), the launcher
    kills the chief; relaunched, both resume from the chief's StepBackup folder and end with
    the steps, ε and weights of an uninterrupted run (σ > 0: the same noise draws)."""
    first = launch(
        [sys.executable, WORKER, "preempt", str(tmp_path)],
        workers=2,
        timeout_s=300,
        log_dir=str(tmp_path / "logs1"),
    )
    assert first[1].returncode == -9 and not first[1].killed, _report(first)
    assert first[0].killed, _report(first)
    assert not (tmp_path / "worker0.json").exists()
    noise_seed = json.loads((tmp_path / "first.json").read_text())["noise_seed"]
    w0, w1 = _run_workers("preempt", tmp_path)
    for w in (w0, w1):
        assert w["resumed"]
        # The chief's last state: after step 6, or step 5 when the launcher's kill landed
        # while it was writing step 6's; either way inside epoch 1 (steps 4..7).
        assert w["resume_step"] in (5, 6)
        assert w["epochs_run"] == 2  # the rest of epoch 1, then epoch 2
        assert w["dp_steps"] == 12
        assert w["noise_seed"] == noise_seed  # restored, not the restart's own entropy
        assert w["ledger_steps"] == w["single_ledger_steps"] == 12
        assert w["epsilon"] == w["single_epsilon"]
        np.testing.assert_allclose(w["weights"], w["single_weights"], rtol=0, atol=1e-5)
    assert w0["weights"] == w1["weights"] and w0["resume_step"] == w1["resume_step"]
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["ledger"]["steps"] == 12
