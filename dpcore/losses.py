"""Per-example losses.

Contract: every loss that enters the DP pipeline is a callable ``(y_true, y_pred) -> [B]`` that
returns one loss per example and never reduces over the batch. :func:`per_example_loss_fn` turns
what users write (a Keras loss name, a ``keras.losses.Loss`` instance, a plain function) into such
a callable, and rejects losses whose output cannot be attributed to single examples.

Keras masks: when the model's output carries a Keras mask (``return_sequences`` after ``Masking``
or ``Embedding(mask_zero=True)``), masked positions contribute zero loss, as in Keras's
``compile``d loss, which (for a ``keras.losses.Loss`` and for a plain function alike, wrapped in
``LossFunctionWrapper``) turns the output mask into 0/1 weights on the per-position losses. Keras
then divides the batch's sum by the number of unmasked positions in the whole *batch*, a count
that depends on the other examples and so has no place in a per-example loss. Here each example's
loss is the sum of its unmasked positions' losses divided by the padded length ``T`` (the mean over
trailing axes of the masked per-position losses): a function of that example alone, with every
unmasked position weighted ``1/T`` as Keras weights it ``1/N``; averaged over the ``B`` examples it
is Keras's loss times the batch's fraction of unmasked positions ``N / (B T)``: the same gradient
direction.
A fully masked example has loss 0 and gradient 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

PerExampleLoss = Callable[[Any, Any], tf.Tensor]
_PER_EXAMPLE = "_dpcore_per_example_loss"  # marks what per_example_loss_fn returns


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
        ``[B, T]``) are averaged over those axes, matching Keras' own mean reduction, after the
        Keras mask of ``y_pred`` (if any) zeroes the masked positions (see the module docstring).

    Returns:
      ``fn(y_true, y_pred) -> tf.Tensor`` of shape ``[B]``.

    Raises:
      ValueError: if ``loss`` is None, or (when called) the loss returns a scalar, or fewer axes
        than the Keras mask of ``y_pred`` (the mask could not be applied per position).

    Privacy:
      Per-example clipping is only meaningful when each returned value depends on one example
      alone; a loss that mixes examples (e.g. a contrastive loss over the batch) breaks the
      sensitivity bound and must not be used.
    """
    if loss is None:
        raise ValueError("loss=None: a per-example loss is required (reduction=None, shape [B]).")
    if getattr(loss, _PER_EXAMPLE, False):  # already one of ours: its mask is applied once
        return loss
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        loss = _unreduced_copy(loss)
    if not callable(loss):
        raise ValueError(f"loss={loss!r} is neither a Keras loss identifier nor a callable.")
    name = getattr(loss, "name", getattr(loss, "__name__", repr(loss)))

    def fn(y_true: Any, y_pred: Any) -> tf.Tensor:
        mask = output_mask(y_pred)
        values = tf.convert_to_tensor(loss(y_true, y_pred))
        if values.shape.rank == 0:
            raise ValueError(
                f"loss {name!r} returned a scalar (shape {values.shape}); dpcore needs one loss "
                "per example, shape [B]. Create the loss with reduction=None."
            )
        if mask is not None:
            values = apply_output_mask(values, mask, name=name)
        if values.shape.rank is not None and values.shape.rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        return values

    setattr(fn, _PER_EXAMPLE, True)
    return fn


def output_mask(y_pred: Any) -> tf.Tensor | None:
    """The Keras mask carried by a single-tensor model output (None for none, or nested outputs)."""
    if not tf.is_tensor(y_pred):
        return None
    from dpcore.engine import graph  # the one module reading Keras's mask storage (lazy: cycle)

    return graph.keras_mask(y_pred)


def apply_output_mask(values: tf.Tensor, mask: Any, *, name: str = "loss") -> tf.Tensor:
    """Per-position losses ``values`` with the positions where ``mask`` is False set to 0.

    ``mask`` is the ``[B, T, ...]`` Keras mask of the model output; ``values`` has at least its
    axes (extra trailing axes are masked alike). A select, not a product, so a non-finite loss at
    a masked position (e.g. ``log(0)`` on a padded step) does not reach the example's loss.

    Raises:
      ValueError: if ``values`` has fewer axes than ``mask``.
    """
    mask = tf.cast(mask, tf.bool)
    if values.shape.rank is not None and mask.shape.rank is not None:
        if values.shape.rank < mask.shape.rank:
            raise ValueError(
                f"loss {name!r} returned shape {values.shape} for an output carrying a Keras mask "
                f"of shape {mask.shape}: the mask cannot be applied per position. Return the "
                "per-position losses (a keras.losses.Loss with reduction=None does) so that "
                "masked positions contribute nothing, as in Keras's compiled loss."
            )
        for _ in range(values.shape.rank - mask.shape.rank):
            mask = mask[..., None]
    mask = tf.broadcast_to(mask, tf.shape(values))
    return tf.where(mask, values, tf.zeros_like(values))
