"""The DP step, written once: engine -> clip -> accumulate/noise -> apply.

Contract: :func:`dp_step` is the only place that composes the stages of DP-SGD:

1. :func:`dpcore.engine.summarize` validates the model and turns the batch into per-example
   certified norm bounds and a weighted-sum function, as ``options`` say
   (:class:`dpcore.ExecutionOptions`);
2. :meth:`dpcore.DPOptimizer.clip` clips every example with the optimizer's own bound(s) into a
   :class:`~dpcore.aggregation.ClippedSum` of known sensitivity;
3. :meth:`dpcore.DPOptimizer.apply_clipped_sum` accumulates it and, at the end of the logical step,
   adds the noise once, normalizes by ``expected_batch_size``, adds the gradient of the model's
   data-independent loss terms (weight regularizers, ``add_loss`` terms of the weights alone:
   :func:`dpcore.losses.regularization`, which refuses the data-dependent ones) and applies the
   update.

:class:`dpcore.DPModel` (``fit``) and custom loops (:func:`dp_train_step`) both call it, inside a
compiled step that traces once. Everything it returns besides the update is computed from the raw
batch and is not private.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from dpcore import engine, losses, validation
from dpcore.optimizer import DPOptimizer
from dpcore.options import ExecutionOptions, resolve

__all__ = ["DPStepResult", "dp_step", "dp_train_step"]


@dataclasses.dataclass(frozen=True)
class DPStepResult:
    """What one DP step computed (all non-private diagnostics of the batch).

    Attributes:
      loss: mean per-example loss over the real (unmasked) examples, before the update.
      per_example_loss: ``[B]``, zero where masked.
      y_pred: the model's output on the batch.
      mask: ``[B]`` float32, 0 for padding or skipped examples (per row, also with privacy units
        of several rows).
      num_examples: realized number of real examples (of units with ``options.group_size``).
      per_example_norms: ``[B]`` unclipped gradient norms (zero where masked); per unit
        (``[B / K]``) with ``options.group_size = K``, as are ``per_example_loss`` and ``loss``
        (the mean unit loss).
      input_gradients: per-example gradients w.r.t. the inputs, or None.
      num_skipped: real examples dropped by ``nonfinite="skip"`` (non-finite inputs, labels,
        weights, loss or gradient); always 0 with ``"raise"``.
      regularization_loss: float32 scalar, the model's data-independent loss terms (weight
        regularizers, ``add_loss`` terms of the weights alone) at the weights before the update:
        what Keras adds to ``loss`` in its logs. 0 when the model has none.

    Privacy:
      Not private: every field is computed from the raw batch without noise, several of them
      per example (``per_example_loss``, ``per_example_norms``, ``input_gradients``) and the
      counts from the realized sample. Only the model update the step applied is privatized;
      do not release these values.
    """

    loss: tf.Tensor
    per_example_loss: tf.Tensor
    y_pred: Any
    mask: tf.Tensor
    num_examples: tf.Tensor
    per_example_norms: tf.Tensor
    input_gradients: Any = None
    num_skipped: Any = 0.0
    regularization_loss: Any = 0.0


# Traced as written, as Keras traces its own ``fit`` step: AutoGraph (on by default in a user's
# ``tf.function``) would otherwise rewrite every dpcore function on the way, keeping a larger
# traced program alive, and the step has no Python control flow on tensors.
@tf.autograph.experimental.do_not_convert
def dp_step(
    model: Any,
    loss: Any,
    x: Any,
    y: Any,
    *,
    optimizer: DPOptimizer,
    sample_weight: Any = None,
    mask: Any = None,
    step_end: Any = None,
    options: ExecutionOptions | None = None,
) -> DPStepResult:
    """One DP-SGD (micro-)step: per-example gradients, clipping, noise, update.

    Same arguments as :func:`dp_train_step`; returns a :class:`DPStepResult`.

    Privacy:
      Only the model update is privatized. Everything in the returned result (loss, predictions,
      norms, input gradients) is computed from the raw batch and is not private.
    """
    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(
            f"optimizer must be a dpcore.DPOptimizer, got {type(optimizer).__name__}: wrap it, "
            "e.g. dpcore.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=..., "
            "noise_multiplier=..., expected_batch_size=...)."
        )
    validation.check_not_compiled_by_xla("dpcore's DP step")
    if step_end is not None:
        step_end = tf.convert_to_tensor(step_end)
        if step_end.shape.rank == 1:  # a copy per row (dpcore.distribute.for_replicas)
            end = tf.cast(step_end, tf.bool)
            # One flag copied, never a mix: a mix would end the sampler's step part-way.
            uniform = tf.debugging.assert_equal(
                tf.reduce_any(end),
                tf.reduce_all(end),
                message="dpcore: step_end per row must hold one value (the sampler's flag, "
                "copied to every row); the step was not applied",
            )
            with tf.control_dependencies([uniform]):
                step_end = tf.identity(tf.reduce_any(end))
    variables = list(model.trainable_variables)
    options = resolve(options)
    sample_weight = losses.one_sample_weight(sample_weight)  # Keras copies it to every output
    # Refuses add_loss terms of the batch and activity regularizers it cannot split by example
    # (those it can enter each example's loss in the engine) before anything.
    regularization = losses.regularization(model, x, training=options.training)
    # Data-independent: drawn first, so that it overlaps the forward and backward passes.
    step_noise = optimizer.draw_step_noise(variables)
    summary = engine.summarize(
        model,
        loss,
        x,
        y,
        sample_weight=sample_weight,
        mask=mask,
        variables=variables,
        options=options,
    )
    clipped = optimizer.clip(summary)
    regularization_loss: Any = tf.zeros([], tf.float32)
    public_grads = None
    if regularization is not None:
        # Functions of the weights alone: added after the noise, unclipped (post-processing).
        regularization_loss, public_grads = regularization.value_and_gradients(summary.variables)
    optimizer.apply_clipped_sum(
        clipped,
        summary.variables,
        step_end=step_end,
        step_noise=step_noise,
        public_grads=public_grads,
    )
    num = tf.reduce_sum(summary.mask)
    mean_loss = tf.reduce_sum(tf.cast(summary.per_example_loss, tf.float32)) / tf.maximum(num, 1.0)
    return DPStepResult(
        loss=mean_loss,
        per_example_loss=summary.per_example_loss,
        y_pred=summary.y_pred,
        mask=summary.mask if summary.row_mask is None else summary.row_mask,
        num_examples=num,
        per_example_norms=clipped.per_example_norms,
        input_gradients=summary.input_gradients,
        num_skipped=summary.num_skipped,
        regularization_loss=regularization_loss,
    )


@tf.autograph.experimental.do_not_convert
def dp_train_step(
    model: Any,
    loss: Any,
    x: Any,
    y: Any,
    *,
    optimizer: DPOptimizer,
    sample_weight: Any = None,
    mask: Any = None,
    step_end: Any = None,
    options: ExecutionOptions | None = None,
) -> Any:
    """The custom-training-loop DP step; call it inside your ``tf.function``.

    Computes per-example gradients of ``loss`` (one compiled program, no retrace per step), clips
    each to ``optimizer.l2_norm_clip``, and lets ``optimizer`` accumulate, noise and apply them.
    Build the optimizer before the first call (``optimizer.build(model.trainable_variables)``):
    otherwise the first trace creates its variables, and ``tf.function`` then traces the step a
    second time and keeps both programs (``make_private(...).fit`` does this itself). The step
    is traced as written, not rewritten by AutoGraph, like Keras' own ``fit`` step: Python control
    flow on tensors in the model's ``call`` or in the loss is not converted (use ``tf.cond``).

    Args:
      model: a built Keras model.
      loss: a per-example loss (``reduction=None``, shape ``[B]``) or a Keras loss/name; for a
        model with several outputs a dict or list of them, or
        :func:`dpcore.losses.per_example_loss_fn` ``(losses, loss_weights=...,
        output_names=model.output_names)`` for weighted outputs (Keras's weighted sum per
        example). The model's weight regularizers and ``add_loss`` terms of the weights alone
        enter the update as in Keras; activity regularizers' penalties (``keras.regularizers.L1``,
        ``L2``, ``L1L2``) enter each example's loss (:mod:`dpcore.engine.activity`); other
        activity regularizers and ``add_loss`` terms of the batch are refused
        (:func:`dpcore.losses.regularization`).
      x: inputs with a leading batch axis.
      y: labels.
      optimizer: the :class:`~dpcore.DPOptimizer` (privacy parameters and DP state).
      sample_weight: optional ``[B]`` loss weights (for several outputs, also Keras's copies of
        one array per output, which must agree: the step fails otherwise).
      mask: optional ``[B]`` 0/1; 0 marks padding (the sampler's mask). An all-masked or empty
        batch is a valid step: noise only.
      step_end: optional bool: True on the last chunk of a logical step (the sampler's flag),
        or its copy per row (``[B]``, all equal) that
        :func:`dpcore.distribute.distribute_sampled` hands each replica; the step folds it
        back to one flag and fails, before any update, on a copy whose rows disagree.
      options: how to compute (:class:`dpcore.ExecutionOptions`: engine path, training mode,
        chunking, non-finite handling, input gradients, layer rules, rows per privacy unit);
        defaults when None. On :func:`dpcore.units.unit_batches` data of K rows per unit,
        ``group_size=K``, and give the same options to
        :func:`dpcore.distribute.distribute_sampled`, which checks them against the data.

    Returns:
      The mean per-example loss of the real examples plus the model's data-independent loss
      terms (weight regularizers, ``add_loss`` terms of the weights alone), as Keras reports its
      loss; or ``(loss, input_gradients)`` with ``options.wrt_inputs``.

    Privacy:
      The model update is (σ, C)-Gaussian-privatized per logical step, plus the gradient of the
      data-independent loss terms (post-processing). The returned loss and input gradients come
      from the raw batch and are not private: do not release them.
    """
    options = resolve(options)
    result = dp_step(
        model,
        loss,
        x,
        y,
        optimizer=optimizer,
        sample_weight=sample_weight,
        mask=mask,
        step_end=step_end,
        options=options,
    )
    loss_value = result.loss + result.regularization_loss
    if options.wrt_inputs:
        return loss_value, result.input_gradients
    return loss_value
