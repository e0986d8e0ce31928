"""DPOptimizer: DP-SGD noise and gradient accumulation around any Keras 3 optimizer.

Contract:
- :class:`DPOptimizer` wraps an inner Keras optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, ...),
  the way ``keras.optimizers.LossScaleOptimizer`` does: Keras saving, ``tf.train.Checkpoint`` and
  ``model.compile`` see one optimizer whose variables are its own plus the inner one's.
- It only ever applies privatized gradients. :meth:`DPOptimizer.apply_clipped_sum` takes a
  :class:`~dpcore.aggregation.ClippedSum`, accumulates it, and at the end of each logical step
  adds Gaussian noise once (:func:`dpcore.aggregation.privatize`: std ``noise_multiplier * C`` on
  the sum, then division by ``expected_batch_size``) and hands the result to the inner optimizer.
  ``apply`` / ``apply_gradients`` on raw gradients refuse: those gradients are not clipped.
- Noise state is optimizer state: ``noise_seed`` (int64 ``[2]``, from OS entropy unless a fixed
  ``seed`` is given) and ``dp_steps`` (int64, logical steps applied). Step ``t`` draws its noise
  from ``fold_in(noise_seed, t)``, so a checkpoint restored into a fresh optimizer draws exactly the
  noise the original would have drawn next and never one it already used. Continuing one
  checkpoint twice would draw the same noise twice: :meth:`DPOptimizer.fork_noise` re-keys a
  continuation. σ is state too (a
  float64 variable read when the step runs): setting ``noise_multiplier`` between steps (a
  schedule) takes effect without retracing, is validated like the constructor argument, and is
  what a checkpoint restores and the callbacks record.
- A logical step ends every ``accumulation_steps`` calls, or when the caller's ``step_end`` is True
  (the Poisson sampler marks the last chunk of a step). The decision is a ``tf.cond``: a compiled
  training step traces once.
- Under a multi-replica ``tf.distribute`` strategy each replica clips its own examples, the clipped
  sums are all-reduced, and every replica adds the same noise (same seed), so noise is added
  exactly once per global step and normalized by the global ``expected_batch_size``. The DP state
  is created when the optimizer is, so it must be constructed inside ``strategy.scope()``: built or
  used under a strategy whose scope did not create that state (each worker would keep its own
  seed, each replica would count the steps), the optimizer refuses.
- The optimizer owns the clip parameters and clips through :meth:`DPOptimizer.clip`; the DP step
  that composes engine, clipping and this optimizer is written once, in :mod:`dpcore.step`.
- With ``adaptive_clip`` (:mod:`dpcore.adaptive`) C is state too (a float64 variable
  ``l2_norm_clip``, checkpointed): each logical step also noises the count of unclipped examples
  once (accumulated over micro-steps and replicas like the gradients), then updates C from that
  noised count only. ``noise_multiplier`` stays the σ the run is accounted with; the gradient
  noise uses σ_Δ > σ so that gradient and count together are one Gaussian mechanism of σ. Every
  micro-batch must be clipped to the current C (:meth:`DPOptimizer.clip`), and C (restored from a
  checkpoint without a check) must be finite and within ``[adaptive.MIN_CLIP,
  adaptive.MAX_CLIP]``: both are asserted when the step runs, before any state changes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import keras
import numpy as np
import tensorflow as tf

from dpcore import adaptive, aggregation, distribute, validation
from dpcore.accounting.ledger import PrivacyLedger, StepRecorder
from dpcore.adaptive import AdaptiveClip
from dpcore.aggregation import ClippedSum
from dpcore.engine.summary import GradientSummary
from dpcore_accounting import events

__all__ = ["DPOptimizer", "DPState", "DPStateSource"]

_LEDGER_KEY = "privacy_ledger"  # the ledger's entry among a saved optimizer's variables

# Base-optimizer arguments that belong on the inner optimizer, with their neutral values.
_BASE_ARGS = {
    "learning_rate": None,
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def _entropy_seed() -> list[int]:
    return [int.from_bytes(os.urandom(8), "little", signed=True) for _ in range(2)]


def _normalize_seed(seed: int | Sequence[int] | None) -> list[int] | None:
    if seed is None:
        return None
    if isinstance(seed, bool):
        raise TypeError(f"seed must be an int or a pair of ints, got {seed!r}.")
    if isinstance(seed, int):
        return [0, int(seed)]
    seed = [int(s) for s in seed]
    if len(seed) != 2:
        raise ValueError(f"seed must be an int or a pair of ints, got {seed!r}.")
    return seed


def _caller_stacklevel() -> int:
    """The ``warnings.warn`` stack level of the first caller outside dpcore (the user's line)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _slot_name(variable: Any, suffix: str) -> str:
    base = getattr(variable, "path", None) or str(variable.name)
    return f"{base.replace('/', '_').replace(':', '_')}_{suffix}"


def _check_inner(inner: Any) -> keras.optimizers.Optimizer:
    if isinstance(inner, str):
        inner = keras.optimizers.get(inner)
    if isinstance(inner, DPOptimizer):
        raise ValueError(
            "inner_optimizer is already a DPOptimizer: wrapping it again would add noise twice. "
            "Pass the plain Keras optimizer."
        )
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "inner_optimizer is a LossScaleOptimizer: dynamic loss scaling skips steps and rescales "
            "gradients after noise, which dpcore does not support. Pass the plain optimizer "
            "(model.compile(auto_scale_loss=False) for mixed precision); dpcore computes "
            "per-example losses without loss scaling."
        )
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError(
            f"inner_optimizer must be a keras.optimizers.Optimizer (or its name), got {inner!r}."
        )
    if inner.gradient_accumulation_steps:
        raise ValueError(
            f"inner_optimizer has gradient_accumulation_steps={inner.gradient_accumulation_steps}: "
            "it would average separately noised micro-steps, so the noise per applied update and "
            "the privacy accounting would no longer match. Remove it from the inner optimizer and "
            f"pass DPOptimizer(..., accumulation_steps={inner.gradient_accumulation_steps}), which "
            "sums the clipped micro-batches and adds noise once per logical step."
        )
    if inner.loss_scale_factor is not None:
        raise ValueError(
            f"inner_optimizer has loss_scale_factor={inner.loss_scale_factor}: it would divide the "
            "privatized gradient by that factor although dpcore never scales the loss. Remove it."
        )
    for arg in ("clipnorm", "global_clipnorm", "clipvalue"):
        value = getattr(inner, arg, None)
        if value:
            warnings.warn(
                f"inner_optimizer has {arg}={value}: it is applied to the already noised "
                "gradient, which is harmless for privacy (post-processing) but is not the DP "
                "clipping; per-example clipping is DPOptimizer(l2_norm_clip=...).",
                UserWarning,
                stacklevel=3,
            )
    return inner


def _check_polyak(start: Any, inner: keras.optimizers.Optimizer) -> None:
    if start is None:
        return
    if isinstance(start, bool) or not isinstance(start, numbers.Integral) or start < 0:
        raise ValueError(f"polyak_start_step must be None or an integer >= 0, got {start!r}.")
    if inner.use_ema:
        raise ValueError(
            "polyak_start_step and the inner optimizer's use_ema=True are two weight averages "
            "for one model; choose one."
        )


def _check_adaptive(config: Any, l2_norm_clip: Any, noise_multiplier: float) -> None:
    if not isinstance(config, AdaptiveClip):
        raise TypeError(f"adaptive_clip must be a dpcore.adaptive.AdaptiveClip, got {config!r}.")
    if isinstance(l2_norm_clip, (list, tuple)) or not math.isfinite(float(l2_norm_clip)):
        raise ValueError(
            f"adaptive_clip needs one finite initial l2_norm_clip, got {l2_norm_clip!r} "
            "(per-group bounds are not adapted)."
        )
    adaptive.check_noise_range(
        noise_multiplier=float(noise_multiplier),
        count_stddev=config.count_stddev,
        l2_norm_clip=float(l2_norm_clip),
    )


@dataclasses.dataclass(frozen=True)
class DPState:
    """The DP state of a :class:`DPOptimizer` at one moment (a read-only snapshot).

    Attributes:
      dp_steps: logical steps applied so far (each noised once).
      pending_micro_steps: micro-batches accumulated towards the next logical step, not yet
        noised or applied.
      noise_multiplier: σ the next logical step will use (with adaptive clipping: the effective
        σ of gradient and count together, what the run is accounted with).
      l2_norm_clip: the bound(s) the next logical step clips to (adaptive clipping: current C).
      noise_changes: every σ set through ``noise_multiplier`` in this process, in order, as
        ``(dp_steps when set, σ)``: logical steps from that count on ran with that σ, whichever
        callback set it and when. Empty for a source that does not log them.
    """

    dp_steps: int
    pending_micro_steps: int
    noise_multiplier: float
    l2_norm_clip: float | tuple[float, ...] | None = None
    noise_changes: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class StepNoise:
    """A logical step's standard normal draw (see :meth:`DPOptimizer.draw_step_noise`)."""

    unit: tuple[tf.Tensor, ...]


@runtime_checkable
class DPStateSource(Protocol):
    """What the privacy callbacks read from an optimizer: a :class:`DPState` snapshot.

    :class:`DPOptimizer` implements it; an optimizer of your own that does DP-SGD can too.
    """

    @property
    def dp_state(self) -> DPState: ...


@keras.saving.register_keras_serializable(package="dpcore")
class DPOptimizer(keras.optimizers.Optimizer):
    """Differentially private wrapper around any Keras 3 optimizer.

    Example (custom loop)::

        opt = dpcore.DPOptimizer(keras.optimizers.Adam(1e-3), l2_norm_clip=1.0,
                                 noise_multiplier=1.1, expected_batch_size=256)
        opt.build(model.trainable_variables)  # before tracing: the step is traced once

        @tf.function
        def step(x, y, mask, step_end):
            return dpcore.dp_train_step(model, loss, x, y, optimizer=opt, mask=mask,
                                        step_end=step_end)

    Args:
      inner_optimizer: the Keras optimizer that applies the privatized gradient (or its name).
        Its ``gradient_accumulation_steps`` and ``loss_scale_factor`` must be unset.
      l2_norm_clip: per-example clipping bound C (> 0), or one bound per variable group.
      noise_multiplier: σ (>= 0); the noise std on the clipped sum is ``σ * C``. σ = 0 adds no
        noise (ε = inf) and warns once per optimizer that the run is not private.
      expected_batch_size: the divisor of the noised sum (> 0): ``sampling_prob * num_examples``
        under Poisson sampling, the batch size (times ``accumulation_steps``) otherwise.
      accumulation_steps: micro-steps per logical step when the caller gives no ``step_end``.
      seed: None (default) seeds the noise from OS entropy. An int or a pair of ints fixes it:
        for tests and reproducibility only.
      variable_groups: with a list of bounds, the group index of each trainable variable.
      polyak_start_step: None (default: no Polyak averaging) or ``k >= 0``: keep the uniform
        average of the weights after every logical step ``t > k`` (Polyak-Ruppert tail
        averaging; ``0`` averages every step). Not together with the inner optimizer's EMA.
      adaptive_clip: None (fixed C) or an :class:`~dpcore.adaptive.AdaptiveClip`: C starts at
        ``l2_norm_clip`` (one flat bound) and follows a target quantile of the per-example norms.
        ``noise_multiplier`` is then the effective σ of each step (what ``DPConfig`` and the
        ledger account); the gradient sum gets noise std ``σ_Δ C_t``, see
        :func:`dpcore.adaptive.gradient_noise_multiplier`.
      name: optimizer name.

    Parameter averaging: give the inner optimizer ``use_ema=True`` (and ``ema_momentum``): it
    keeps an exponential moving average of the weights after each applied logical step, saved
    with the optimizer's variables; ``fit`` (and :meth:`finalize_variable_values` in a custom loop)
    writes it into the model at the end of training, and ``keras.callbacks.SwapEMAWeights``
    evaluates with it during ``fit``. Or give ``polyak_start_step``: the uniform average of the
    weights after the logical steps past it (:attr:`polyak_averages`, :attr:`polyak_count`), saved
    and written into the model the same way; ``dpcore.callbacks.SwapPolyakWeights`` evaluates with
    it during ``fit``.

    Privacy:
      Each logical step releases ``sum_i clip(g_i) + N(0, (σ C)^2 I)`` divided by a constant: the
      Gaussian mechanism with sensitivity C under add/remove-one adjacency, provided the
      micro-batches of one logical step are disjoint (each example in at most one of them).
      Everything the inner optimizer does afterwards (momentum, weight decay, clipnorm, EMA or
      other weight averaging) is post-processing: no privacy cost. With ``adaptive_clip`` a step
      also releases ``sum_i (1[unclipped_i] - 1/2) + N(0, σ_b^2)`` (sensitivity 1/2); the pair is
      one Gaussian mechanism of noise multiplier ``noise_multiplier``, and C_t depends only on
      earlier releases.
    """

    def __init__(
        self,
        inner_optimizer: Any,
        *,
        l2_norm_clip: float | list[float] | tuple[float, ...],
        noise_multiplier: float,
        expected_batch_size: float,
        accumulation_steps: int = 1,
        seed: int | Sequence[int] | None = None,
        variable_groups: Sequence[int] | None = None,
        adaptive_clip: AdaptiveClip | None = None,
        polyak_start_step: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        for arg, neutral in _BASE_ARGS.items():
            if arg in kwargs:
                value = kwargs.pop(arg)
                if value != neutral and not (arg == "learning_rate" and value == 0.0):
                    raise ValueError(
                        f"DPOptimizer does not take {arg}={value!r}: set it on the inner "
                        f"optimizer, e.g. keras.optimizers.SGD(..., {arg}={value!r})."
                    )
        if kwargs:
            raise TypeError(f"DPOptimizer got unexpected arguments: {sorted(kwargs)}.")
        inner_optimizer = _check_inner(inner_optimizer)
        aggregation.check_privacy_args(
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
        )
        accumulation_steps = events.check_positive_int(accumulation_steps, "accumulation_steps")
        if adaptive_clip is not None:
            _check_adaptive(adaptive_clip, l2_norm_clip, noise_multiplier)
        _check_polyak(polyak_start_step, inner_optimizer)
        super().__init__(learning_rate=0.0, name=name)
        self.polyak_start_step = None if polyak_start_step is None else int(polyak_start_step)
        self._polyak_averages: list[Any] = []
        self._polyak_targets: list[Any] = []
        self._polyak_count: Any = None
        self.inner_optimizer = inner_optimizer
        if isinstance(l2_norm_clip, (list, tuple)):
            self.l2_norm_clip: float | tuple[float, ...] = tuple(float(c) for c in l2_norm_clip)
        else:
            self.l2_norm_clip = float(l2_norm_clip)
        self.expected_batch_size = float(expected_batch_size)
        self.accumulation_steps = int(accumulation_steps)
        self.variable_groups = None if variable_groups is None else tuple(variable_groups)
        self._seed_arg = _normalize_seed(seed)
        # Under a multi-worker strategy a variable's initial value is the chief's: one seed for all.
        initial_seed = self._seed_arg if self._seed_arg is not None else _entropy_seed()
        # The strategy whose scope creates the DP state below (see _check_strategy).
        self._state_strategy = tf.distribute.get_strategy()
        self.noise_seed = self.add_variable(
            shape=(2,),
            dtype="int64",
            initializer=lambda shape, dtype=None: tf.constant(initial_seed, tf.int64),
            aggregation="only_first_replica",
            name="noise_seed",
        )
        self.dp_steps = self.add_variable(
            shape=(), dtype="int64", aggregation="only_first_replica", name="dp_steps"
        )
        self.micro_steps = self.add_variable(
            shape=(), dtype="int64", aggregation="only_first_replica", name="micro_steps"
        )
        sigma = float(noise_multiplier)
        # σ is state, read when the step runs: a schedule (set `noise_multiplier` between steps)
        # takes effect without retracing, and what the callbacks read is what ran.
        self._noise_multiplier = self._scalar_state("noise_multiplier", sigma)
        self._warned_not_private = False
        self._warn_if_not_private(sigma)
        # (dp_steps when set, σ) for every σ set through the setter: the callbacks account each
        # step with the σ it ran with, whatever the order of the callbacks that set it.
        self._noise_changes: tuple[tuple[int, float], ...] = ()
        # The ledger of the steps applied (kept by DPModel.fit, saved with the variables).
        self.step_recorder = StepRecorder()
        self._accumulators: list[Any] = []
        self.adaptive_clip = adaptive_clip
        if adaptive_clip is not None:
            clip0 = float(l2_norm_clip)  # type: ignore[arg-type]  # one flat bound, checked
            self._adaptive_clip_var = self._scalar_state("l2_norm_clip", clip0)
            # The last released (noised) unclipped fraction, for logs.
            self._unclipped_fraction = self._scalar_state("unclipped_fraction", 0.0)

    def _check_strategy(self) -> None:
        """Refuses to run under a ``tf.distribute`` strategy that did not create the DP state.

        The noise seed, ``dp_steps`` and ``micro_steps`` are created in ``__init__``. Created
        outside ``strategy.scope()`` they are plain variables: under a multi-worker strategy each
        worker keeps its own OS-entropy seed and draws its own noise (the all-reduced update then
        carries noise of std ``σ C / sqrt(W)``), and under several local replicas each replica
        counts every step (``dp_steps`` doubles, accumulation ends steps at the wrong call).

        Raises:
          ValueError: under a non-default strategy whose scope did not create the DP state.
        """
        if not tf.distribute.has_strategy():
            return
        strategy = tf.distribute.get_strategy()
        state = (self.noise_seed, self.dp_steps, self.micro_steps)
        if all(strategy.extended.variable_created_in_scope(v.value) for v in state):
            return
        raise ValueError(
            f"this DPOptimizer is used under a {type(strategy).__name__}, but its DP state (noise "
            "seed, dp_steps) was not created in that strategy's scope: each worker would draw its "
            "own noise (too little in the sum) and each replica would count every step. Construct "
            "the optimizer inside `with strategy.scope():` (with the model; make_private too)."
        )

    def _scalar_state(self, name: str, value: float) -> Any:
        """A float64 scalar of DP state (checkpointed; every replica holds the first's value)."""
        return self.add_variable(
            shape=(),
            dtype="float64",
            initializer=lambda shape, dtype=None: tf.constant(value, tf.float64),
            aggregation="only_first_replica",
            name=name,
        )

    @property
    def dp_state(self) -> DPState:
        """A read-only snapshot of the DP state (what the callbacks account), read eagerly."""

        def read(var: Any) -> Any:
            return keras.ops.convert_to_numpy(var)

        return DPState(
            dp_steps=int(read(self.dp_steps)),
            pending_micro_steps=int(read(self.micro_steps)),
            noise_multiplier=float(read(self._noise_multiplier)),
            l2_norm_clip=self.l2_norm_clip
            if self.adaptive_clip is None
            else float(read(self._adaptive_clip_var)),
            noise_changes=tuple(self._noise_changes),
        )

    def adaptive_logs(self) -> dict[str, tf.Tensor]:
        """With adaptive clipping, ``l2_norm_clip`` (C for the next step) and the last noised
        ``unclipped_fraction`` as float32 tensors for Keras logs; else an empty dict.

        Privacy:
          Both are functions of noised releases only.
        """
        if self.adaptive_clip is None:
            return {}
        return {
            "l2_norm_clip": tf.cast(tf.convert_to_tensor(self._adaptive_clip_var), tf.float32),
            "unclipped_fraction": tf.cast(
                tf.convert_to_tensor(self._unclipped_fraction), tf.float32
            ),
        }

    @property
    def noise_multiplier(self) -> float:
        """σ of the next logical step (optimizer state: checkpointed, restored with the rest)."""
        return float(keras.ops.convert_to_numpy(self._noise_multiplier))

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        """Sets σ for the following logical steps (e.g. a schedule in a callback).

        Privacy:
          Steps run with the σ in effect when they end. Each change is logged with the number of
          steps applied so far (``dp_state.noise_changes``), from which ``EpsilonCallback`` and
          ``PrivacyBudgetGuard`` account every step with the σ it ran with.
        """
        aggregation.check_privacy_args(
            l2_norm_clip=self.l2_norm_clip,
            noise_multiplier=value,
            expected_batch_size=self.expected_batch_size,
        )
        if self.adaptive_clip is not None:
            adaptive.check_noise_range(
                noise_multiplier=float(value), count_stddev=self.adaptive_clip.count_stddev
            )
        if float(value) == self.noise_multiplier:
            return  # nothing changes (a schedule may set the same σ every epoch)
        self._warn_if_not_private(float(value))
        self._noise_multiplier.assign(float(value))
        applied = int(keras.ops.convert_to_numpy(self.dp_steps))
        self._noise_changes = (
            *self._noise_changes,
            (applied, float(keras.ops.convert_to_numpy(self._noise_multiplier))),
        )

    def _warn_if_not_private(self, sigma: float) -> None:
        """Warns, once per optimizer, when σ = 0: the run adds no noise and has ε = inf."""
        if sigma == 0.0 and not self._warned_not_private:
            self._warned_not_private = True
            warnings.warn(
                f"noise_multiplier=0: DPOptimizer {self.name!r} adds no noise, so this run is "
                "NOT differentially private (epsilon = inf). Use noise_multiplier > 0 for a "
                "private run (DPConfig.calibrated finds one for a target epsilon).",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )

    # ----------------------------------------------------------------------------- state
    def build(self, var_list: Sequence[Any]) -> None:
        """Creates one accumulator per variable and builds the inner optimizer.

        Raises:
          ValueError: under a ``tf.distribute`` strategy whose scope did not create this
            optimizer (construct it inside ``strategy.scope()``).
        """
        self._check_strategy()
        if self.built:
            return
        var_list = list(var_list)
        if not var_list:
            raise ValueError(
                "DPOptimizer.build got no variables: the model has no trainable variables."
            )
        # Replicas hold identical (all-reduced) sums, so the first replica's value is the value.
        accumulators = self._slots(var_list, "dp_accumulator")
        if self.adaptive_clip is not None:  # the centred count, accumulated like the gradients
            accumulators.append(
                self.add_variable(
                    shape=(), dtype="float64", aggregation="only_first_replica", name="dp_count"
                )
            )
        self._accumulators = accumulators
        if self.polyak_start_step is not None:
            self._polyak_count = self.add_variable(
                shape=(), dtype="int64", aggregation="only_first_replica", name="polyak_count"
            )
            self._polyak_averages = self._slots(var_list, "polyak_average")
            self._polyak_targets = var_list
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    def _slots(self, var_list: Sequence[Any], suffix: str) -> list[Any]:
        """One zero-initialized variable per variable of ``var_list``, shaped like it."""
        return [
            self.add_variable(
                shape=v.shape,
                dtype=v.dtype,
                aggregation="only_first_replica",
                name=_slot_name(v, suffix),
            )
            for v in var_list
        ]

    @property
    def polyak_averages(self) -> list[Any]:
        """The Polyak averages, one variable per trainable variable (empty without
        ``polyak_start_step`` or before :meth:`build`).

        Privacy:
          Functions of the released (noised) updates only: post-processing.
        """
        return list(self._polyak_averages)

    def swap_polyak_weights(self) -> None:
        """Exchanges the values of the variables the optimizer was built on with their Polyak
        averages (twice restores both); :class:`dpcore.callbacks.SwapPolyakWeights` uses it."""
        for var, average in zip(self._polyak_targets, self._polyak_averages):
            raw = tf.identity(tf.convert_to_tensor(var))
            var.assign(tf.convert_to_tensor(average))
            average.assign(raw)

    @property
    def polyak_count(self) -> int:
        """How many logical steps' weights the Polyak average holds (0 without averaging)."""
        if self._polyak_count is None:
            return 0
        return int(keras.ops.convert_to_numpy(self._polyak_count))

    @property
    def variables(self) -> list[Any]:
        return self._variables[:] + self.inner_optimizer.variables

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        self.inner_optimizer.learning_rate = value

    @property
    def iterations(self) -> Any:
        """The inner optimizer's update count (one per applied logical step)."""
        return self.inner_optimizer.iterations

    # ------------------------------------------------------------------------ privacy ledger
    def record_applied_steps(self) -> None:
        """Brings the privacy ledger up to ``dp_steps`` while data of known sampling feeds the
        steps (``DPModel.fit``), each step with the σ it ran with."""
        state = self.dp_state
        self.step_recorder.sync(
            applied=state.dp_steps,
            noise_multiplier=state.noise_multiplier,
            noise_changes=state.noise_changes,
        )

    @property
    def privacy_ledger(self) -> PrivacyLedger | None:
        """The ledger of the logical steps applied under ``DPModel.fit`` (None before any).

        Saved with the optimizer's variables (``model.save`` to ``.keras``, ``save_weights``)
        and restored with them, so a resumed model keeps its history.
        """
        self.record_applied_steps()
        return self.step_recorder.ledger

    @privacy_ledger.setter
    def privacy_ledger(self, ledger: PrivacyLedger | None) -> None:
        """Gives back the ledger of the steps applied (e.g. ``PrivacyLedger.from_json(text)``)."""
        if ledger is not None and not isinstance(ledger, PrivacyLedger):
            raise ValueError(
                f"privacy_ledger must be a dpcore.accounting.PrivacyLedger or None, got {ledger!r}."
            )
        self.step_recorder = StepRecorder(ledger)

    def save_own_variables(self, store: Any) -> None:
        """Keras saving: the variables, and the privacy ledger (JSON bytes) under its own key."""
        super().save_own_variables(store)
        ledger = self.privacy_ledger
        if ledger is not None:
            store[_LEDGER_KEY] = np.frombuffer(ledger.to_json().encode("utf-8"), dtype=np.uint8)

    def load_own_variables(self, store: Any) -> None:
        """Keras loading: the variables and, when the file has one, the privacy ledger."""
        keys = list(store.keys())
        if _LEDGER_KEY in keys:
            text = bytes(np.asarray(store[_LEDGER_KEY], dtype=np.uint8)).decode("utf-8")
            self.privacy_ledger = PrivacyLedger.from_dict(json.loads(text))
            store = {k: store[k] for k in keys if k != _LEDGER_KEY}
        super().load_own_variables(store)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """Writes the weight average into the model: the inner optimizer's EMA into ``var_list``,
        or the Polyak average (once it holds a step) into the variables it was made for; ``fit``
        calls it at the end of training."""
        self.inner_optimizer.finalize_variable_values(var_list)
        if self._polyak_averages and self.polyak_count > 0:
            for var, average in zip(self._polyak_targets, self._polyak_averages):
                var.assign(average)

    def scale_loss(self, loss: Any) -> Any:
        return loss

    # ----------------------------------------------------------------------------- updates
    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        """Refuses raw gradients: they are neither clipped per example nor noised."""
        raise ValueError(
            "DPOptimizer cannot apply raw gradients (they are not clipped per example, so no "
            "privacy guarantee holds). In a custom loop call dpcore.dp_train_step(model, loss, x, "
            "y, optimizer=...); with model.fit use dpcore.make_private(model, optimizer=..., "
            "loss=...). Lower level: DPOptimizer.apply_clipped_sum(dpcore.aggregation.clip(...))."
        )

    def apply_gradients(self, grads_and_vars: Any) -> None:
        """Refuses raw gradients; see :meth:`apply`."""
        self.apply(None)

    @tf.autograph.experimental.do_not_convert
    def clip(self, summary: GradientSummary) -> ClippedSum:
        """Clips a batch's per-example gradients with this optimizer's bound(s).

        The optimizer owns the clip parameters (``l2_norm_clip``, ``variable_groups``): the DP
        step clips through it, so the bound that is applied is the one the noise is scaled to.

        Privacy:
          Each example's contribution has norm at most ``l2_norm_clip`` (per group with groups),
          computed from certified norm bounds (:func:`dpcore.aggregation.clip`).
        """
        if self.adaptive_clip is not None:
            return aggregation.clip(
                summary, l2_norm_clip=self._adaptive_clip_var.value, count_unclipped=True
            )
        return aggregation.clip(
            summary, l2_norm_clip=self.l2_norm_clip, variable_groups=self.variable_groups
        )

    @tf.autograph.experimental.do_not_convert
    def draw_step_noise(self, variables: Sequence[Any]) -> StepNoise | None:
        """The current logical step's standard normal draw, to be made before the forward pass.

        The draw depends only on the noise seed and ``dp_steps``, never on data, so drawing it
        first lets it overlap the engine's forward and backward passes. None with
        ``accumulation_steps > 1``, where most calls end no step (the draw is then made when the
        step ends).

        Privacy:
          Exactly the draw :meth:`apply_clipped_sum` would make at the end of the step (same
          seed, same values); pass it there for the same logical step only.
        """
        self._check_strategy()
        if self.accumulation_steps != 1:
            return None
        return StepNoise(unit=tuple(aggregation.standard_normal(variables, seed=self.step_seed())))

    def step_seed(self) -> tf.Tensor:
        """The ``[2]`` int64 seed of the current logical step's noise.

        Privacy:
          ``fold_in(noise_seed, dp_steps)``: it depends on the optimizer's state only, never on
          data, and differs for every step. Whoever knows ``noise_seed`` (saved in checkpoints)
          can recompute every step's noise, which makes the updates as good as noise-free: keep
          it secret, and fix ``seed`` for tests only.
        """
        return tf.random.experimental.stateless_fold_in(
            tf.convert_to_tensor(self.noise_seed), tf.convert_to_tensor(self.dp_steps)
        )

    def fork_noise(self) -> None:
        """Gives this optimizer a fresh noise stream (a new ``noise_seed`` from OS entropy).

        A checkpoint holds the noise stream: an optimizer restored from it draws, at step ``t``,
        exactly the noise the saved run would have drawn. That is what resuming one interrupted
        run needs (``dpcore.backup.StepBackup``), and what must not happen when one checkpoint
        is continued more than once (two fine-tunes from one saved model, a hyper-parameter
        search, a rollback after its steps were released): two continuations would add the same
        noise to different clipped sums, and their difference would be noise-free. Call this
        after restoring, for every continuation but one, eagerly (not inside a
        ``tf.function``, whose trace would fix one seed for every call).

        Under a multi-worker strategy the new seed is the chief's OS entropy, broadcast to every
        worker (as :func:`dpcore.distribute.shared_seed`): every worker must call this at the
        same point of the program (a collective operation), as they do when they all run the
        same program. Workers with seeds of their own would each add independent noise divided
        by the worker count: the sum would carry noise of std ``σ C / sqrt(W)``.

        Raises:
          ValueError: inside a ``tf.function``, or under a ``tf.distribute`` strategy whose
            scope did not create this optimizer.

        Privacy:
          Continuations of one checkpoint are separate releases on the same data: their ε
          compose (each continuation's ledger counts only its own steps).
        """
        if tf.inside_function():
            raise ValueError(
                "DPOptimizer.fork_noise() must run eagerly: traced, its OS-entropy seed would be "
                "fixed into the graph and every call would assign the same one."
            )
        self._check_strategy()
        seed = distribute.chief_value(_entropy_seed(), self._state_strategy)
        self.noise_seed.assign(tf.constant(seed, tf.int64))

    def discard_open_step(self) -> int:
        """Drops the micro-batches accumulated towards a logical step that has not ended.

        For a caller that starts a new pass over its data, which can only start a new step
        (e.g. ``DPModel.fit`` on sampler batches, a run restored from a checkpoint saved
        mid-step): continuing the old step would put two samples into one noised update.

        Returns:
          The number of micro-batches dropped (0 when the last step ended).

        Privacy:
          Accumulated micro-batches are released only when their step ends (noise added once,
          then applied), so dropping them releases nothing and records no step.
        """
        pending = int(keras.ops.convert_to_numpy(self.micro_steps))
        if pending:
            for a in self._accumulators:
                a.assign(tf.zeros(a.shape, a.dtype))
            self.micro_steps.assign(0)
        return pending

    @tf.autograph.experimental.do_not_convert
    def apply_clipped_sum(
        self,
        clipped: ClippedSum,
        variables: Sequence[Any] | None = None,
        *,
        step_end: Any = None,
        step_noise: StepNoise | None = None,
        public_grads: Sequence[Any] | None = None,
    ) -> None:
        """Accumulates a clipped sum; at the end of a logical step noises it once and applies it.

        Args:
          clipped: the clipped per-example gradient sum of one (micro-)batch.
          variables: the variables ``clipped.grads`` belong to (default: those the optimizer was
            built with). The first call builds the optimizer on them.
          step_end: None (a logical step ends every ``accumulation_steps`` calls) or a bool
            scalar (tensor) that is True on the last micro-batch of a logical step (then
            ``accumulation_steps`` must be 1).
          step_noise: this step's noise draw from :meth:`draw_step_noise`, made before the
            forward pass so that the draw overlaps it; None draws it when the step ends.
          public_grads: optional gradients (one per variable, None for none) of terms that are
            functions of the weights alone, e.g. weight regularizers
            (:class:`dpcore.losses.Regularization`): added, unclipped and unnoised, to the
            privatized gradient of the logical step; the last micro-batch's are used.

        Raises:
          ValueError: for mismatched gradients/variables or a sensitivity that changes between
            micro-steps.
          tf.errors.InvalidArgumentError: when the step runs (nothing of the optimizer's state
            changes), with adaptive clipping: if the bound C (a checkpoint restores it unchecked)
            is not finite and within ``[MIN_CLIP, MAX_CLIP]``, or ``clipped.l2_sensitivity`` is
            not C (every micro-batch must be clipped by :meth:`clip`); and for any σ, bound or
            noise std that fails :func:`dpcore.aggregation.privatize`'s checks.
          ValueError: under a multi-replica strategy, when called outside ``strategy.run``.
          ValueError: under a ``tf.distribute`` strategy whose scope did not create this
            optimizer (construct it inside ``strategy.scope()``).
          ValueError: inside an XLA-compiled function (its guards are assertions, which XLA
            drops; see :func:`dpcore.validation.check_not_compiled_by_xla`).

        Privacy:
          Noise ``N(0, (σ · clipped.l2_sensitivity)^2)`` is added once to the summed micro-batches
          of a logical step, then divided by ``expected_batch_size``. Micro-batches of one logical
          step must be disjoint. ``public_grads`` must not depend on any example: they are added
          after the noise, as post-processing.
        """
        validation.check_not_compiled_by_xla("DPOptimizer.apply_clipped_sum")
        self._check_strategy()
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1 and tf.distribute.in_cross_replica_context():
            raise ValueError(
                "DPOptimizer.apply_clipped_sum must run in a replica context (inside "
                "strategy.run) under a multi-replica tf.distribute strategy."
            )
        if variables is None:
            if not self.built:
                raise ValueError(
                    "DPOptimizer.apply_clipped_sum needs `variables` on its first call (or call "
                    "optimizer.build(model.trainable_variables) first)."
                )
            variables = list(self._trainable_variables)
        variables = list(variables)
        if not self.built:
            self.build(variables)
        self._check_variables_are_known(variables)
        grads = list(clipped.grads)
        if len(grads) != len(variables):
            raise ValueError(
                f"clipped.grads has {len(grads)} tensors but {len(variables)} variables were given."
            )
        for g, v in zip(grads, variables):
            if g is None or tuple(g.shape) != tuple(v.shape):
                raise ValueError(
                    f"clipped gradient of shape {None if g is None else tuple(g.shape)} does not "
                    f"match variable {getattr(v, 'path', v.name)} of shape {tuple(v.shape)}."
                )
        public = None
        if public_grads is not None:
            public = list(public_grads)
            if len(public) != len(variables) or any(
                p is not None and tuple(p.shape) != tuple(v.shape)
                for p, v in zip(public, variables)
            ):
                raise ValueError("public_grads must hold one gradient (or None) per variable.")
            public = [
                tf.zeros(v.shape, tf.float32) if p is None else tf.cast(p, tf.float32)
                for p, v in zip(public, variables)
            ]
        if (clipped.unclipped_count is None) != (self.adaptive_clip is None):
            raise ValueError(
                "clipped.unclipped_count must be given exactly when the optimizer has "
                "adaptive_clip: clip through DPOptimizer.clip(summary)."
            )
        known = getattr(self, "_sensitivity", None)
        # With adaptive_clip the bound is the optimizer's own l2_norm_clip variable (clip()),
        # checked when the step runs (_check_adaptive_bound).
        bound_checks: list[Any] = []
        if self.adaptive_clip is not None:
            bound_checks = self._check_adaptive_bound(clipped.l2_sensitivity)
        else:
            if not isinstance(clipped.l2_sensitivity, numbers.Real) or isinstance(
                clipped.l2_sensitivity, bool
            ):
                # A tensor bound could change between the micro-batches of one step while the
                # noise follows the last one; a fixed-clip optimizer's own clip() gives a number.
                raise ValueError(
                    "clipped.l2_sensitivity must be a Python number for an optimizer without "
                    f"adaptive_clip (got {type(clipped.l2_sensitivity).__name__}): clip through "
                    "DPOptimizer.clip(summary), or aggregation.clip with a Python l2_norm_clip."
                )
            if known is not None and known != clipped.l2_sensitivity:
                raise ValueError(
                    f"clipped.l2_sensitivity={clipped.l2_sensitivity} differs from the {known} "
                    "of earlier steps: every step of one optimizer must use the same bound."
                )
            self._sensitivity = clipped.l2_sensitivity
        if replicas > 1:
            # Each replica clipped its own examples; the logical step's sum is over all of them.
            grads = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, [tf.convert_to_tensor(g) for g in grads]
            )
        if clipped.unclipped_count is not None:  # summed and accumulated like the gradients
            count = tf.convert_to_tensor(clipped.unclipped_count)
            if replicas > 1:
                count = tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, count
                )
            grads = [*grads, count]
        # Nothing non-finite may reach the accumulators or the weights: one assertion that every
        # entry is finite gates every downstream op, so a bad batch fails the step before any
        # variable changes. (TensorFlow's CheckNumerics tests one entry at a time, slower on CPU
        # than the vectorized test below.)
        grads = [tf.convert_to_tensor(g) for g in grads]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        with tf.control_dependencies(bound_checks):  # the bound's own message first
            check = tf.debugging.Assert(
                finite,
                [
                    "dpcore: the clipped gradient sum is not finite; the step was not applied. The "
                    "engine drops or refuses non-finite examples before this point, so a clipped "
                    "sum built outside dpcore.engine.summarize is the likely cause"
                ],
            )
        with tf.control_dependencies([check, *bound_checks]):
            grads = [tf.identity(g) for g in grads]

        if step_end is not None:
            if self.accumulation_steps != 1:
                raise ValueError(
                    f"step_end was given but accumulation_steps={self.accumulation_steps}: the "
                    "sampler's step_end already marks where each logical step ends. Keep "
                    "accumulation_steps=1 and, to bound memory, give the sampler a smaller "
                    "padded batch size (a logical step then spans several chunks)."
                )
            step_end = tf.cast(step_end, tf.bool)
            if step_end.shape.rank != 0:
                raise ValueError(
                    "step_end must be a bool scalar (True on the last chunk of a logical step), "
                    f"got shape {step_end.shape}."
                )
        # Counters and accumulators change only once the checked gradients exist.
        if step_noise is not None and not isinstance(step_noise, StepNoise):
            raise TypeError("step_noise must come from DPOptimizer.draw_step_noise().")
        with tf.control_dependencies(grads):
            self._update(clipped, grads, variables, step_end, step_noise, public)

    def _check_adaptive_bound(self, sensitivity: Any) -> list[Any]:
        """Assertions, run with the step, that the adaptive bound C is finite and within
        ``[MIN_CLIP, MAX_CLIP]`` (a checkpoint restores it without a check: C = 0 or -1 ran
        with the floor's noise, C = inf released -inf) and that ``sensitivity``, the bound this
        micro-batch was clipped to, is C (the noise of the step is scaled to C: a micro-batch
        clipped to a larger bound would get too little)."""
        c = tf.convert_to_tensor(self._adaptive_clip_var)
        in_range = tf.math.is_finite(c) & (c >= adaptive.MIN_CLIP) & (c <= adaptive.MAX_CLIP)
        range_check = tf.debugging.Assert(
            in_range,
            [
                "dpcore: the adaptive l2_norm_clip must be finite and within [2^-30, 2^60] "
                "(dpcore.adaptive.MIN_CLIP, MAX_CLIP) when the step runs; the step was not "
                "applied (was it restored from a corrupted checkpoint?). Got",
                c,
            ],
        )
        with tf.control_dependencies([range_check]):
            sensitivity = aggregation.as_float64(sensitivity)  # not through float32
            same_check = tf.debugging.Assert(
                tf.equal(sensitivity, c),
                [
                    "dpcore: clipped.l2_sensitivity",
                    sensitivity,
                    "is not the optimizer's adaptive l2_norm_clip",
                    c,
                    "; the step was not applied. Clip every micro-batch with "
                    "DPOptimizer.clip(summary): the step's noise is scaled to that bound",
                ],
            )
        return [range_check, same_check]

    def _update(
        self,
        clipped: ClippedSum,
        grads: Sequence[tf.Tensor],
        variables: Sequence[Any],
        step_end: tf.Tensor | None,
        step_noise: StepNoise | None,
        public: list[tf.Tensor] | None = None,
    ) -> None:
        if step_end is None and self.accumulation_steps == 1:
            self._finish(
                clipped, grads, variables, accumulators=None, step_noise=step_noise, public=public
            )
            return
        accumulators = [self._accumulators[self._get_variable_index(v)] for v in variables]
        if self.adaptive_clip is not None:
            accumulators.append(self._accumulators[-1])
        totals = [
            tf.convert_to_tensor(a) + tf.cast(g, a.dtype) for a, g in zip(accumulators, grads)
        ]
        if step_end is None:
            end = tf.equal(tf.convert_to_tensor(self.micro_steps) + 1, self.accumulation_steps)
        else:
            end = step_end

        def finish(
            totals: Sequence[tf.Tensor],
            step_noise: StepNoise | None = step_noise,
            public: list[tf.Tensor] | None = public,
        ) -> None:
            self._finish(
                clipped,
                totals,
                variables,
                accumulators=accumulators,
                step_noise=step_noise,
                public=public,
            )

        def accumulate(totals: Sequence[tf.Tensor]) -> None:
            for a, t in zip(accumulators, totals):
                a.assign(t)
            self.micro_steps.assign_add(1)

        # Under any strategy but the default one the inner optimizer's all-reduce may need a
        # merge call, one replica included (a one-worker MultiWorkerMirroredStrategy).
        if (
            not tf.distribute.has_strategy()
            or tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            tf.cond(end, lambda: finish(totals), lambda: accumulate(totals))
            return

        # The inner optimizer synchronizes replicas (merge_call), which a tf.cond in replica
        # context cannot contain: branch in cross-replica context, then run each branch on every
        # replica (the pattern keras.optimizers.LossScaleOptimizer uses).
        def branch(distribution: Any, end: Any, totals: Any, public: Any = None) -> None:
            end = distribution.experimental_local_results(end)[0]
            tf.cond(
                end,
                # Drawn in the branch: replica-context tensors do not cross the merge call.
                lambda: distribution.extended.call_for_each_replica(
                    finish, args=(totals, None, public)
                ),
                lambda: distribution.extended.call_for_each_replica(accumulate, args=(totals,)),
            )

        # Replica-context tensors cross the merge call as its arguments only.
        args = (end, totals) if public is None else (end, totals, public)
        tf.distribute.get_replica_context().merge_call(branch, args=args)

    def _finish(
        self,
        clipped: ClippedSum,
        totals: Sequence[tf.Tensor],
        variables: Sequence[Any],
        *,
        accumulators: Sequence[Any] | None,
        step_noise: StepNoise | None = None,
        public: Sequence[tf.Tensor] | None = None,
    ) -> None:
        count = None
        sigma: Any = self._noise_multiplier
        if self.adaptive_clip is not None:
            totals, count = totals[:-1], totals[-1]
            sigma = adaptive.gradient_noise_multiplier_tensor(
                sigma, count_stddev=self.adaptive_clip.count_stddev
            )
        summed = dataclasses.replace(clipped, grads=tuple(tf.cast(t, tf.float32) for t in totals))
        noised = aggregation.privatize(
            summed,
            noise_multiplier=sigma,
            expected_batch_size=self.expected_batch_size,
            seed=self.step_seed(),
            unit_noise=None if step_noise is None else step_noise.unit,
        )
        # The noised sum exists only once σ (and σ_Δ) passed their checks: every state change of
        # the step waits for it, so a step that fails them changes nothing (the count noise and
        # C, the weights, the accumulators, dp_steps), rather than only leaving the weights put.
        with tf.control_dependencies(noised):
            if count is not None:
                self._update_adaptive_clip(tf.identity(count))
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            if public is not None:
                # Functions of the weights alone (e.g. weight regularizers), the same on every
                # replica: added after the noise, as post-processing (PRIVACY.md).
                noised = [n + p for n, p in zip(noised, public)]
            # Every replica holds the same noised sum (same all-reduced input, same seed); the
            # inner Keras optimizer all-reduces (sums) its gradients across replicas: 1/R each.
            noised = [tf.cast(n / replicas, v.dtype) for n, v in zip(noised, variables)]
            self.inner_optimizer.apply(noised, variables)
            if accumulators is not None:
                for a in accumulators:
                    a.assign(tf.zeros(a.shape, a.dtype))
                self.micro_steps.assign(0)
            self.dp_steps.assign_add(1)
            if self._polyak_averages:
                self._update_polyak()

    def _update_polyak(self) -> None:
        """Adds the weights after this logical step to the uniform average, once the step is past
        ``polyak_start_step``: ``avg += (w - avg) / n`` (``n`` the new count). The weights are the
        variables the optimizer was built on, paired with the averages made for them, whichever
        variables this step's gradients were for."""
        assert self.polyak_start_step is not None
        step = tf.convert_to_tensor(self.dp_steps)
        counted = tf.cast(step > self.polyak_start_step, tf.int64)
        n = tf.convert_to_tensor(self._polyak_count) + counted
        rate = tf.cast(counted, tf.float64) / tf.cast(tf.maximum(n, 1), tf.float64)
        for var, average in zip(self._polyak_targets, self._polyak_averages):
            value = tf.convert_to_tensor(var)
            old = tf.convert_to_tensor(average)
            average.assign(old + (value - old) * tf.cast(rate, average.dtype))
        self._polyak_count.assign(n)

    def _update_adaptive_clip(self, count: tf.Tensor) -> None:
        """Noises the step's centred count once and moves C towards the target quantile."""
        config = self.adaptive_clip
        assert config is not None
        fraction = adaptive.noised_unclipped_fraction(
            count,
            count_stddev=config.count_stddev,
            expected_batch_size=self.expected_batch_size,
            seed=self.step_seed(),
        )
        self._unclipped_fraction.assign(fraction)
        self._adaptive_clip_var.assign(
            adaptive.updated_clip(
                l2_norm_clip=self._adaptive_clip_var.value,
                unclipped_fraction=fraction,
                target_quantile=config.target_quantile,
                learning_rate=config.learning_rate,
            )
        )

    # ----------------------------------------------------------------------------- config
    def get_config(self) -> dict[str, Any]:
        clip = self.l2_norm_clip
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "l2_norm_clip": list(clip) if isinstance(clip, tuple) else clip,
            "noise_multiplier": self.noise_multiplier,
            "expected_batch_size": self.expected_batch_size,
            "accumulation_steps": self.accumulation_steps,
            "seed": self._seed_arg,
            "variable_groups": None if self.variable_groups is None else list(self.variable_groups),
            "adaptive_clip": None if self.adaptive_clip is None else self.adaptive_clip.to_dict(),
            "polyak_start_step": self.polyak_start_step,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> DPOptimizer:
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        if config.get("adaptive_clip") is not None:
            config["adaptive_clip"] = AdaptiveClip(**config["adaptive_clip"])
        return cls(inner, **config)
