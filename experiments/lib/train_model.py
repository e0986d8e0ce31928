"""The models of a `dpcore-train` run, made private with the run's `DPConfig`.

Contract:
  * `build_model` builds the named classifier (logits); `build_training_model` compiles it
    plainly (`--nodp`) or wraps it with `dpcore.make_private` and the run's `DPConfig`, so the
    clip, noise and normalization the optimizer uses are what the accountant counts.
  * `versions` are the library versions results.json records.
"""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any

import numpy as np
from dpcore_experiments.lib import zoo
from dpcore_experiments.lib.train_plan import MODELS, Plan, TrainSettings, dp_config


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int = 10) -> Any:
    """`mlp` (one tanh hidden layer), `cnn` (the end-to-end tanh CNN of Tramèr & Boneh) or
    `scatter_linear` (their linear model on scattering features, see `scatter_features`).

    The CNN is conv16 8x8 stride 2 -> tanh -> maxpool 2 stride 1 -> conv32 4x4 stride 2 ->
    tanh -> maxpool 2 stride 1 -> dense32 -> tanh -> dense10 (logits). The first convolution
    uses 'same' padding (the original pads by 2; on 28x28 inputs both give the same 5x5x32
    feature map before the last pooling and the same 26,010 parameters). On inputs smaller than
    28x28 (the 8x8 digits) the second convolution also uses 'same' padding so shapes stay valid.
    """
    import keras

    if name == "mlp":
        layers = zoo.tanh_mlp_layers(keras, input_shape, num_classes, hidden=128)
    elif name == "cnn":
        layers = zoo.cnn_layers(keras, input_shape, num_classes)
    elif name == "scatter_linear":  # a linear classifier on scattering features
        layers = [
            keras.Input(input_shape),
            keras.layers.Dense(num_classes, kernel_initializer="zeros"),
        ]
    else:
        raise ValueError(f"Unknown model {name!r}; expected one of {MODELS}.")
    return keras.Sequential(layers, name=name)


def build_optimizer(settings: TrainSettings) -> Any:
    import keras

    if settings.optimizer == "sgd":
        return keras.optimizers.SGD(settings.learning_rate, momentum=settings.momentum)
    return keras.optimizers.Adam(settings.learning_rate)


def versions() -> dict[str, str]:
    import keras
    import tensorflow as tf

    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "dp_accounting": importlib.metadata.version("dp-accounting"),
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def build_training_model(settings: TrainSettings, plan: Plan, model: Any) -> tuple[Any, Any]:
    """(trainable model, optimizer): a make_private DPModel, or the plain compiled model.

    The DP model is built from the same DPConfig that the accountant uses, so the optimizer's
    clip, noise and normalisation (expected batch size q * N) are exactly what is accounted.
    """
    import keras

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    metrics = [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
    inner = build_optimizer(settings)
    if not settings.dp:
        model.compile(optimizer=inner, loss=loss, metrics=metrics)
        return model, inner
    import dpcore.model
    from dpcore.options import ExecutionOptions

    group_size = settings.max_rows_per_user if settings.privacy_unit == "user" else 1
    dp_model = dpcore.model.make_private(
        model,
        optimizer=inner,
        loss=loss,
        metrics=metrics,
        config=dp_config(settings, plan.num_examples, plan.noise_multiplier),
        seed=settings.seed,
        options=ExecutionOptions(group_size=group_size),
    )
    return dp_model, dp_model.optimizer


def evaluate(model: Any, x: np.ndarray, y: np.ndarray, batch_size: int) -> tuple[float, float]:
    out = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    return float(out["loss"]), float(out["accuracy"])
