"""Distributed-data checks on 2 local replicas (run by tests/test_distribute.py in a subprocess:
logical CPUs must be set before any other TensorFlow op of the process).

Prints one line ``RESULT <json>``: for each part, what it measured or the error it raised, so
that each test asserts on its own part.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import dpcore  # noqa: E402
from dpcore import distribute, sampling, units  # noqa: E402

STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
LOSS = keras.losses.MeanSquaredError(reduction=None)
rng = np.random.default_rng(0)
X = (100 * rng.normal(size=(16, 4))).astype("float32")  # large: every example is clipped
Y = (100 * rng.normal(size=(16, 1))).astype("float32")


def _dense():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])


def _optimizer(expected_batch_size, accumulation_steps=1):
    return dpcore.DPOptimizer(
        keras.optimizers.SGD(1.0),
        l2_norm_clip=1.0,
        noise_multiplier=0.0,
        expected_batch_size=expected_batch_size,
        accumulation_steps=accumulation_steps,
        seed=0,
    )


def _weights(model):
    return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])


def outside_fit():
    """fit with the optimizer constructed outside the scope (model and compile inside)."""
    opt = _optimizer(4.0)
    with STRATEGY.scope():
        model = dpcore.DPModel(_dense())
        model.compile(optimizer=opt, loss="mse")
    model.fit(sampling.poisson_batches(X, Y, sampling_prob=0.25, steps=3, seed=0), verbose=0)
    return {"dp_steps": int(opt.dp_steps.numpy())}


def outside_loop():
    """Custom loop, accumulation_steps=2, optimizer constructed and built outside the scope."""
    opt = _optimizer(4.0, accumulation_steps=2)
    with STRATEGY.scope():
        model = _dense()
    opt.build(model.trainable_variables)
    batches = tf.data.Dataset.from_tensors((X[:4], Y[:4])).repeat(4)

    @tf.function
    def step(a, b):
        STRATEGY.run(lambda a, b: dpcore.dp_train_step(model, LOSS, a, b, optimizer=opt), (a, b))

    for a, b in STRATEGY.experimental_distribute_dataset(batches):
        step(a, b)
    return {"dp_steps": int(opt.dp_steps.numpy())}


def custom_loop(strategy):
    """The custom loop of docs/workers.md: strategy.run(dp_train_step) over distribute_sampled."""
    with strategy.scope():
        model = _dense()
        opt = _optimizer(4.0)
        opt.build(model.trainable_variables)
    w0 = _weights(model)

    @tf.function
    def step(batch):
        def one(x, y, mask, end):
            return dpcore.dp_train_step(model, LOSS, x, y, optimizer=opt, mask=mask, step_end=end)

        strategy.run(one, args=tuple(batch))

    data = sampling.poisson_batches(X, Y, sampling_prob=0.25, steps=3, seed=0)
    for batch in distribute.distribute_sampled(strategy, data):
        step(batch)
    return {"delta": (_weights(model) - w0).tolist(), "dp_steps": int(opt.dp_steps.numpy())}


def unit_fit(keep):
    """fit on units of K = 2 rows in 3 slots (not a multiple of the 2 replicas), q = 1, σ = 0,
    learning rate 1: the update times the expected batch size is the clipped sum."""
    ids = np.repeat(np.arange(3), 2)
    rows = np.isin(ids, keep)
    data = units.unit_batches(
        X[:6][rows],
        Y[:6][rows],
        unit_ids=ids[rows],
        sampling_prob=1.0,
        steps=1,
        max_rows_per_unit=2,
        padded_units=3,
        seed=0,
    )
    with STRATEGY.scope():
        model = dpcore.DPModel(_dense(), options=dpcore.ExecutionOptions(group_size=2))
        model.compile(optimizer=_optimizer(float(len(keep))), loss="mse")
    w0 = _weights(model.model)
    model.fit(data, verbose=0)
    return {
        "sum": ((w0 - _weights(model.model)) * len(keep)).tolist(),
        "dp_steps": int(model.optimizer.dp_steps.numpy()),
    }


def main():
    parts = {
        "outside_fit": outside_fit,
        "outside_loop": outside_loop,
        "loop_replicas": lambda: custom_loop(STRATEGY),
        "loop_single": lambda: custom_loop(tf.distribute.get_strategy()),
        # Unit 1 is the one a layout of 3 rows per replica cut in two.
        "units_all": lambda: unit_fit([0, 1, 2]),
        "units_without_1": lambda: unit_fit([0, 2]),
    }
    result = {}
    for name, part in parts.items():
        try:
            result[name] = part()
        except Exception as e:  # recorded: each test asserts on its own part
            result[name] = {"error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
