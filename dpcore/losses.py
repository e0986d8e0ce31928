"""Per-example losses.

Contract: every loss that enters the DP pipeline is a callable ``(y_true, y_pred) -> [B]`` that
returns one loss per example and never reduces over the batch. :func:`per_example_loss_fn` turns
what users write (a Keras loss name, a ``keras.losses.Loss`` instance, a plain function) into such
a callable, and rejects losses whose output cannot be attributed to single examples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

PerExampleLoss = Callable[[Any, Any], tf.Tensor]


def _unreduced_copy(loss: keras.losses.Loss) -> keras.losses.Loss:
    if loss.reduction is None or loss.reduction == "none":
        return loss
    config = loss.get_config()
    config["reduction"] = None
    try:
        return loss.__class__.from_config(config)
    except Exception as err:  # pragma: no cover - depends on user loss classes
        raise ValueError(
            f"loss={loss!r} reduces over the batch (reduction={loss.reduction!r}) and cannot be "
            "rebuilt with reduction=None from its config; pass a loss created with reduction=None "
            "that returns one value per example."
        ) from err


def per_example_loss_fn(loss: Any) -> PerExampleLoss:
    """Returns a callable computing one loss value per example, shape ``[B]``.

    Args:
      loss: a Keras loss identifier (``"sparse_categorical_crossentropy"``), a
        ``keras.losses.Loss`` instance (rebuilt with ``reduction=None`` when it reduces), or a
        callable ``(y_true, y_pred) -> [B]``. Outputs with trailing axes (e.g. per-token losses
        ``[B, T]``) are averaged over those axes, matching Keras' own mean reduction.

    Returns:
      ``fn(y_true, y_pred) -> tf.Tensor`` of shape ``[B]``.

    Raises:
      ValueError: if ``loss`` is None, or (when called) the loss returns a scalar.

    Privacy:
      Per-example clipping is only meaningful when each returned value depends on one example
      alone; a loss that mixes examples (e.g. a contrastive loss over the batch) breaks the
      sensitivity bound and must not be used.
    """
    if loss is None:
        raise ValueError("loss=None: a per-example loss is required (reduction=None, shape [B]).")
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        loss = _unreduced_copy(loss)
    if not callable(loss):
        raise ValueError(f"loss={loss!r} is neither a Keras loss identifier nor a callable.")
    name = getattr(loss, "name", getattr(loss, "__name__", repr(loss)))

    def fn(y_true: Any, y_pred: Any) -> tf.Tensor:
        values = tf.convert_to_tensor(loss(y_true, y_pred))
        if values.shape.rank == 0:
            raise ValueError(
                f"loss {name!r} returned a scalar (shape {values.shape}); dpcore needs one loss "
                "per example, shape [B]. Create the loss with reduction=None."
            )
        if values.shape.rank is not None and values.shape.rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        return values

    return fn
