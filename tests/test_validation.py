"""Layer validation: batch-mixing layers are found with their paths, nested ones too."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpcore import engine
from dpcore.optimizer import DPOptimizer
from dpcore.options import ExecutionOptions
from dpcore.step import dp_step, dp_train_step
from dpcore.validation import check_layers, check_trainable, find_batch_mixing_layers

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")


def test_clean_model_has_no_issues():
    model = keras.Sequential(
        [
            keras.Input((4, 4, 1)),
            keras.layers.Conv2D(4, 2),
            keras.layers.GroupNormalization(groups=2),
            keras.layers.Flatten(),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(2),
        ]
    )
    assert find_batch_mixing_layers(model) == []
    check_layers(model)


def test_batch_norm_is_refused_with_path_and_replacement():
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(name="bn")],
        name="net",
    )
    with pytest.raises(ValueError) as err:
        check_layers(model)
    message = str(err.value)
    assert "net/bn" in message and "BatchNormalization" in message
    assert "GroupNormalization" in message and "LayerNormalization" in message


def test_nested_and_subclassed_layers_are_found():
    inner = keras.Sequential(
        [keras.Input((3,)), keras.layers.BatchNormalization(name="deep_bn")], name="block"
    )

    class Wrapper(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.parts = [keras.layers.Dense(3), keras.layers.BatchNormalization(name="held_bn")]

        def call(self, x):
            return self.parts[1](self.parts[0](x))

    inputs = keras.Input((3,))
    outputs = Wrapper(name="wrapper")(inner(inputs))
    model = keras.Model(inputs, outputs, name="outer")
    paths = sorted(issue.path for issue in find_batch_mixing_layers(model))
    assert paths == ["outer/block/deep_bn", "outer/wrapper/held_bn"]


def test_custom_batch_norm_subclass_and_frozen_batch_norm():
    class MyBatchNorm(keras.layers.Layer):
        def call(self, x):
            return x - keras.ops.mean(x, axis=0)

    model = keras.Sequential([keras.Input((3,)), MyBatchNorm(name="mine")], name="m")
    assert [i.path for i in find_batch_mixing_layers(model)] == ["m/mine"]

    frozen = keras.layers.BatchNormalization()
    frozen.trainable = False  # runs in inference mode in Keras 3: per-example
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), frozen])
    check_layers(model)


def test_stateful_rnn_is_refused():
    model = keras.Sequential(
        [
            keras.Input((5, 2), batch_size=1),
            keras.layers.LSTM(3, stateful=True, name="lstm"),
            keras.layers.Dense(1),
        ],
        name="seq",
    )
    with pytest.raises(ValueError, match="seq/lstm.*stateful=False"):
        check_layers(model)
    # Every training entry point refuses it too (batch size 1: state carried example to example).
    x = np.ones((1, 5, 2), "float32")
    y = np.ones((1, 1), "float32")
    opt = DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=0.0, expected_batch_size=1
    )
    with pytest.raises(ValueError, match="seq/lstm.*stateful=False"):
        dp_step(model, "mse", x, y, optimizer=opt, options=ExecutionOptions(method="vectorized"))
    with pytest.raises(ValueError, match="seq/lstm.*stateful=False"):
        tf.function(lambda a, b: dp_train_step(model, "mse", a, b, optimizer=opt))(x, y)
    with pytest.raises(ValueError, match="seq/lstm.*stateful=False"):
        engine.summarize(model, "mse", x, y)


def test_model_without_trainable_variables_is_refused():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)], name="frozen")
    model.trainable = False
    with pytest.raises(ValueError, match="'frozen' has no trainable variables"):
        check_trainable(model)
    model.trainable = True
    check_trainable(model)
    assert model(np.zeros((1, 3), "float32")).shape == (1, 2)
