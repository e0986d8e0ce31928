"""One worker of the multi-worker tests (run by tests/test_distribute.py via launch_local).

Usage: python tests/mwms_worker.py <scenario>[,<scenario>...] <output folder>. Every worker
writes ``<output folder>/worker<i>.json`` (``<output folder>/<scenario>/worker<i>.json`` for
several scenarios) with what the test compares across workers and against a
single-process run of the same global sample (computed here too, outside the strategy).
"""

import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # noqa: E402

# Before any other TensorFlow op of the process.
STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import dpcore  # noqa: E402
from dpcore import distribute, sampling  # noqa: E402
from dpcore.backup import StepBackup  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
N, Q, STEPS, SEED = 48, 0.25, 5, 7


def _data(d=5):
    rng = np.random.default_rng(0)
    x = (2 * rng.normal(size=(N, d))).astype("float32")
    y = rng.integers(0, 3, N).astype("int32")
    return x, y


def _model(d=5, use_bias=True):
    init = keras.initializers.GlorotUniform(seed=0)
    return keras.Sequential(
        [keras.Input((d,)), keras.layers.Dense(3, kernel_initializer=init, use_bias=use_bias)]
    )


def _optimizer(sigma, seed):
    return dpcore.DPOptimizer(
        keras.optimizers.SGD(1.0),
        l2_norm_clip=0.5,
        noise_multiplier=sigma,
        expected_batch_size=Q * N,
        seed=seed,
    )


def _train(x, y, *, sigma, seed, strategy, dataset, d=5, use_bias=True):
    """Custom loop: strategy.run(dp_train_step) over the (distributed) sampler batches."""
    with strategy.scope():
        model = _model(d, use_bias)
        opt = _optimizer(sigma, seed)
        opt.build(model.trainable_variables)
    w0 = [v.numpy() for v in model.trainable_variables]

    @tf.function
    def step(batch):
        def one(x, y, mask, end):
            return dpcore.dp_train_step(model, LOSS, x, y, optimizer=opt, mask=mask, step_end=end)

        return strategy.run(one, args=tuple(batch))

    for batch in distribute.distribute_sampled(strategy, dataset):
        step(batch)
    deltas = [v.numpy() - a for v, a in zip(model.trainable_variables, w0)]
    return deltas, opt


def _flat(arrays):
    return np.concatenate([np.ravel(a) for a in arrays])


def _finish(out, info, result):
    """Writes this worker's result, then waits for every worker to have written its own.

    Without the final barrier the chief could exit while another worker still runs its
    single-process reference; that worker then loses the cluster's coordination service under
    it and may not end within the launcher's grace period (it is killed, the run fails).
    """
    with open(os.path.join(out, f"worker{info.worker_index}.json"), "w") as f:
        json.dump(result, f)
    distribute.any_worker(STRATEGY)(False)  # a collective op: returns once all reached it


def dp_step(out):
    info = distribute.worker_info(STRATEGY)
    seed = distribute.shared_seed(STRATEGY)
    x, y = _data()
    result = {"info": [info.num_workers, info.worker_index, info.is_chief], "shared_seed": seed}

    def shard():
        return sampling.sharded_poisson_batches(
            x,
            y,
            sampling_prob=Q,
            steps=STEPS,
            seed=SEED,
            num_workers=info.num_workers,
            worker_index=info.worker_index,
        )

    def single():
        return sampling.poisson_batches(x, y, sampling_prob=Q, steps=STEPS, seed=SEED)

    default = tf.distribute.get_strategy()
    for sigma in (0.0, 1.0):
        # seed None: the noise seed is OS entropy, broadcast from the chief with the variables.
        multi, opt = _train(x, y, sigma=sigma, seed=None, strategy=STRATEGY, dataset=shard())
        noise_seed = [int(s) for s in opt.noise_seed.numpy()]
        one, _ = _train(x, y, sigma=sigma, seed=noise_seed, strategy=default, dataset=single())
        result[f"sigma{sigma:g}"] = {
            "delta": _flat(multi).tolist(),
            "single_delta": _flat(one).tolist(),
            "noise_seed": noise_seed,
            "dp_steps": int(opt.dp_steps.numpy()),
        }
    # Noise only: a bias-free layer on all-zero inputs has zero gradients, so one step's update
    # (learning rate 1) is the noise divided by the expected batch size.
    d = 400
    zeros = np.zeros((N, d), "float32")
    shard0 = sampling.sharded_poisson_batches(
        zeros,
        y,
        sampling_prob=Q,
        steps=1,
        seed=SEED,
        num_workers=info.num_workers,
        worker_index=info.worker_index,
    )
    noise, _ = _train(
        zeros, y, sigma=1.0, seed=None, strategy=STRATEGY, dataset=shard0, d=d, use_bias=False
    )
    alone = sampling.poisson_batches(zeros, y, sampling_prob=Q, steps=1, seed=SEED)
    noise1, _ = _train(
        zeros, y, sigma=1.0, seed=None, strategy=default, dataset=alone, d=d, use_bias=False
    )
    result["noise_std"] = [float(_flat(noise).std()), float(_flat(noise1).std())]
    result["noise_size"] = int(_flat(noise).size)
    try:  # every worker sampling the whole dataset is refused
        distribute.distribute_sampled(STRATEGY, single())
        result["full_refused"] = False
    except ValueError as e:
        result["full_refused"] = "whole dataset" in str(e)
    opt.fork_noise()  # every worker, at the same point: the chief's new seed everywhere
    result["forked_seed"] = [int(s) for s in opt.noise_seed.numpy()]
    outside = _optimizer(1.0, None)  # each worker's own entropy seed, plain variables
    try:
        with STRATEGY.scope():
            outside.build(_model().trainable_variables)
        result["outside_refused"] = False
    except ValueError as e:
        result["outside_refused"] = "strategy's scope" in str(e)
    _finish(out, info, result)


class _Record(keras.callbacks.Callback):
    """Counts the batch-level calls and stops after `stop_after` steps (None: never)."""

    def __init__(self, stop_after=None):
        super().__init__()
        self.batches, self.epochs, self.stop_after = 0, 0, stop_after

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.stop_after is not None and self.batches >= self.stop_after:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1


def _dp_model(strategy, noise_seed=None):
    with strategy.scope():
        return dpcore.make_private(
            _model(),
            optimizer=keras.optimizers.SGD(0.5),
            loss=LOSS,
            metrics=["accuracy"],
            l2_norm_clip=0.5,
            noise_multiplier=0.5,
            expected_batch_size=Q * N,
            seed=noise_seed,
        )


def fit(out):
    info = distribute.worker_info(STRATEGY)
    x, y = _data()
    xv, yv = x[:20] + 0.5, y[:20]
    shard = sampling.sharded_poisson_batches(
        x,
        y,
        sampling_prob=Q,
        steps=STEPS,
        seed=SEED,
        num_workers=info.num_workers,
        worker_index=info.worker_index,
    )
    dp = _dp_model(STRATEGY)
    record = _Record()
    config = dpcore.DPConfig(
        l2_norm_clip=0.5,
        noise_multiplier=0.5,
        expected_batch_size=Q * N,
        num_examples=N,
        steps=2 * STEPS,
    )
    # Every worker runs the writers; only the chief's outputs land in `out`.
    callbacks = [
        record,
        dpcore.callbacks.EpsilonCallback(
            config, ledger_path=distribute.worker_path(os.path.join(out, "ledger.json"), STRATEGY)
        ),
        keras.callbacks.ModelCheckpoint(
            distribute.worker_path(os.path.join(out, "ckpt.weights.h5"), STRATEGY),
            save_weights_only=True,
        ),
    ]
    result_path = distribute.worker_path(os.path.join(out, "written_by.txt"), STRATEGY)
    with open(result_path, "a") as f:
        f.write(f"{info.worker_index}\n")
    history = dp.fit(shard, epochs=2, validation_data=(xv, yv), callbacks=callbacks, verbose=0)
    ev = dp.evaluate(xv, yv, return_dict=True, verbose=0)
    noise_seed = [int(s) for s in dp.optimizer.noise_seed.numpy()]
    result = {
        "history": history.history,
        "evaluate": ev,
        "weights": _flat([v.numpy() for v in dp.model.trainable_variables]).tolist(),
        "dp_steps": int(dp.optimizer.dp_steps.numpy()),
        "batches": record.batches,
        "epochs": record.epochs,
        "noise_seed": noise_seed,
        "data_feed": dp.data_feed,
    }
    # The same two passes of the global sample, one process, the same noise seed.
    single = _dp_model(tf.distribute.get_strategy(), noise_seed)
    one = single.fit(
        sampling.poisson_batches(x, y, sampling_prob=Q, steps=STEPS, seed=SEED),
        epochs=2,
        validation_data=(xv, yv),
        verbose=0,
    )
    result["single_history"] = one.history
    result["single_weights"] = _flat([v.numpy() for v in single.model.trainable_variables]).tolist()
    # A callback on worker 1 only asks to stop after 2 steps: every worker stops there.
    stopped = _dp_model(STRATEGY)
    stopper = _Record(stop_after=2 if info.worker_index == 1 else None)
    stopped.fit(shard, epochs=2, callbacks=[stopper], verbose=0)
    result["stopped_steps"] = int(stopped.optimizer.dp_steps.numpy())
    try:  # an unsharded sampler is refused before any step
        dp.fit(sampling.poisson_batches(x, y, sampling_prob=Q, steps=1, seed=SEED), verbose=0)
        result["full_refused"] = False
    except ValueError as e:
        result["full_refused"] = "whole dataset" in str(e)
    _finish(out, info, result)


class _KillAfter(keras.callbacks.Callback):
    """Preemption: SIGKILLs this process after logical step `steps` (once: leaves `marker`)."""

    def __init__(self, steps, marker):
        super().__init__()
        self.steps, self.marker = steps, marker

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.dp_steps.numpy()) == self.steps:
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


SPE, EPOCHS, KILL_AT = 4, 3, 6  # the kill falls inside epoch 1


def preempt(out):
    """One start of a run that worker 1 kills after step KILL_AT the first time; a restart of
    the cluster resumes it from the chief's StepBackup folder."""
    info = distribute.worker_info(STRATEGY)
    x, y = _data()
    total = SPE * EPOCHS
    dp = _dp_model(STRATEGY)  # noise seed: OS entropy, replaced by the restored one
    config = dpcore.DPConfig(
        l2_norm_clip=0.5,
        noise_multiplier=0.5,
        expected_batch_size=Q * N,
        num_examples=N,
        steps=total,
    )
    eps = dpcore.callbacks.EpsilonCallback(
        config, ledger_path=distribute.worker_path(os.path.join(out, "ledger.json"), STRATEGY)
    )
    backup = StepBackup(os.path.join(out, "backup"), strategy=STRATEGY, epsilon=eps)
    start = backup.resume_step
    shard = sampling.sharded_poisson_batches(
        x,
        y,
        sampling_prob=Q,
        steps=total - start,
        start_step=start,
        seed=backup.sampling_seed,
        num_workers=info.num_workers,
        worker_index=info.worker_index,
    )
    callbacks = [eps, backup]
    marker = os.path.join(out, "killed")
    if not backup.resumed:
        dp.optimizer.build(dp.model.trainable_variables)
        first = {"noise_seed": [int(s) for s in dp.optimizer.noise_seed.numpy()]}
        with open(distribute.worker_path(os.path.join(out, "first.json"), STRATEGY), "w") as f:
            json.dump(first, f)
        if info.worker_index == 1 and not os.path.exists(marker):
            callbacks.append(_KillAfter(KILL_AT, marker))
    history = dp.fit(shard, epochs=EPOCHS, steps_per_epoch=SPE, callbacks=callbacks, verbose=0)
    noise_seed = [int(s) for s in dp.optimizer.noise_seed.numpy()]
    # The uninterrupted run: one process, the same global sample, noise seed and steps.
    single = _dp_model(tf.distribute.get_strategy(), noise_seed)
    single_eps = dpcore.callbacks.EpsilonCallback(config)
    single.fit(
        sampling.poisson_batches(x, y, sampling_prob=Q, steps=total, seed=backup.sampling_seed),
        callbacks=[single_eps],
        verbose=0,
    )
    result = {
        "resume_step": start,
        "resumed": backup.resumed,
        "epochs_run": len(history.history["loss"]),
        "dp_steps": int(dp.optimizer.dp_steps.numpy()),
        "noise_seed": noise_seed,
        "weights": _flat([v.numpy() for v in dp.model.trainable_variables]).tolist(),
        "single_weights": _flat([v.numpy() for v in single.model.trainable_variables]).tolist(),
        "ledger_steps": eps.ledger.steps,
        "epsilon": eps.epsilon(),
        "single_ledger_steps": single_eps.ledger.steps,
        "single_epsilon": single_eps.epsilon(),
    }
    _finish(out, info, result)


if __name__ == "__main__":
    # Several scenarios ("dp_step,fit") run one after the other in one cluster start, each in
    # its own folder <output folder>/<scenario>.
    names, out = sys.argv[1].split(","), sys.argv[2]
    for name in names:
        folder = out if len(names) == 1 else os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        {"dp_step": dp_step, "fit": fit, "preempt": preempt}[name](folder)
