"""Layer rules for the fast path, and the explicit registry that maps layer classes to them.

Contract:
- A :class:`LayerRule` is a bundle of plain functions for one layer class. ``forward`` recomputes
  the layer's pre-activation output ``z`` from the call's inputs and the layer's own variables and
  returns what the rule needs later (its *capture*); ``activate`` maps ``z`` to the layer's output.
  After one backward pass the engine hands the rule every call of the layer (a :class:`Use`: the
  capture plus ``dL_i/dz``) and ``grads`` returns, per variable, each example's squared gradient
  norm and a function forming ``sum_i w_i * grad_i`` (a :class:`VariableGrad`).
- Rules never mutate layers, never read globals, and are registered explicitly: importing this
  module (or :mod:`dpcore.rules`) registers nothing. :func:`default_registry` builds a fresh
  mapping, which users may extend with ``{**default_registry(), MyLayer: my_rule}``.
- Lookup is by exact class: a subclass of ``Dense`` may override ``call``, so it does not inherit
  ``Dense``'s rule; it falls back to vectorized gradients unless registered itself.
- A layer used several times in one model is summarized from all its uses at once: its
  per-example gradient is the sum over uses, and the norm is taken of that sum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf

PATHS = ("ghost", "materialized", "fallback:vectorized", "no variables", "frozen")


@dataclasses.dataclass(frozen=True)
class Use:
    """One call of a layer in the recorded forward pass.

    Attributes:
      capture: tensors the rule's ``forward`` recorded (e.g. the layer input).
      grad: ``dL/dz`` where ``L = sum_i L_i``; row ``i`` is ``dL_i/dz_i``.
    """

    capture: Mapping[str, Any]
    grad: Any


@dataclasses.dataclass(frozen=True)
class VariableGrad:
    """Per-example information about one variable's gradient.

    Attributes:
      variable: the variable.
      sq_norm: ``[B]`` certified upper bound (float64) of the squared L2 norm of what each example
        contributes to ``weighted_sum`` for this variable: never below the true value, for any
        finite input (see :mod:`dpcore.norms`; :func:`dpcore.rules.linear.from_per_example`
        gives it for a rule that materializes per-example gradients).
      weighted_sum: ``w [B] -> sum_i w_i * grad_i`` shaped like the variable.
      path: how the norm was computed (``"ghost"``, ``"materialized"``, ...).
    """

    variable: Any
    sq_norm: tf.Tensor
    weighted_sum: Callable[[tf.Tensor], tf.Tensor]
    path: str


@dataclasses.dataclass(frozen=True)
class LayerRule:
    """The fast-path rule for one layer class.

    Attributes:
      name: short name for reports.
      check: ``layer -> None`` when the rule handles this layer instance, else a reason string
        (e.g. a quantized or LoRA-enabled ``Dense``).
      forward: ``(layer, args, kwargs) -> (z, capture)``: ``z`` is the tensor whose gradient the
        engine takes (pre-activation output), ``capture`` the tensors ``grads`` needs later.
      activate: ``(layer, z) -> outputs``.
      grads: ``(layer, uses) -> [VariableGrad]`` for the layer's trainable variables.
      plan: ``(layer, input_shapes) -> (path, why)`` for reports, from static shapes.
      compose: for a layer made of sub-layers (e.g. MultiHeadAttention):
        ``(layer, args, kwargs, call) -> outputs`` replays the layer's computation, calling each
        sub-layer through ``call(sublayer, args, kwargs)`` so that the engine records the
        sub-layers with their own rules. When set, ``forward``/``activate``/``grads`` are unused.
    """

    name: str
    check: Callable[[Any], str | None]
    forward: Callable[[Any, tuple, dict], tuple[tf.Tensor, dict[str, Any]]]
    activate: Callable[[Any, tf.Tensor], Any]
    grads: Callable[[Any, Sequence[Use]], list[VariableGrad]]
    plan: Callable[[Any, Sequence[Any]], tuple[str, str]]
    compose: Callable[[Any, tuple, dict, Callable], Any] | None = None


Registry = Mapping[type, LayerRule]


def default_registry() -> dict[type, LayerRule]:
    """A fresh registry with dpcore's built-in rules.

    Returns:
      ``{layer class: LayerRule}`` for Dense, EinsumDense, Conv1D, Conv2D, Embedding,
      LayerNormalization, GroupNormalization and MultiHeadAttention.
    """
    from dpcore.rules import builtin_rules

    return dict(builtin_rules())


def lookup(registry: Registry, layer: Any) -> tuple[LayerRule | None, str]:
    """The rule for ``layer`` (exact class match) and, when there is none, why.

    Returns:
      ``(rule, "")`` when a rule applies, else ``(None, reason)``.
    """
    rule = registry.get(type(layer))
    if rule is None:
        return None, f"no rule for {type(layer).__name__}"
    reason = rule.check(layer)
    if reason:
        return None, reason
    return rule, ""
