"""Rule types for the fast path, and the helpers every rule shares.

Contract:
- A :class:`LayerRule` is a bundle of plain functions for one layer class. ``forward`` recomputes
  the layer's pre-activation output ``z`` from the call's inputs and the layer's own variables and
  returns what the rule needs later (its *capture*); ``activate`` maps ``z`` to the layer's output.
  After one backward pass the engine hands the rule every call of the layer (a :class:`Use`: the
  capture plus ``dL_i/dz``) and ``grads`` returns, per variable, each example's squared gradient
  norm and a function forming ``sum_i w_i * grad_i`` (a :class:`VariableGrad`).
- Every ``sq_norm`` a rule returns is a certified upper bound (float64, :mod:`dpcore.norms`): the
  clip factors are computed from it, so an underestimate would leave an example unclipped.
  :func:`from_per_example` gives that bound for any rule that forms per-example gradients.
- A simple rule is three functions: ``forward``, ``grads`` and, when the default does not fit,
  ``activate``. ``check`` defaults to "handles every instance", ``activate`` to the layer's
  ``activation`` (identity when it has none) and ``plan`` to ``"materialized"``, the path
  :func:`from_per_example` reports by default. See ``dpcore/rules/README.md`` for the recipe.
- Privacy units of several rows (``ExecutionOptions.group_size = K``) need nothing from a rule:
  the engine presents unit ``u`` (rows ``u*K .. u*K+K-1``) as one example that called the layer
  ``K`` times (:func:`unit_uses`), so ``grads`` returns per-unit norms and sums through its
  ordinary multi-use path. This assumes every tensor of rank >= 1 in a capture has the rows as its
  leading axis; a rule whose capture holds anything else sets ``groupable=False`` and its layer
  takes the per-layer vectorized fallback when units have several rows.
- Rules never mutate layers and never read globals. Defining one registers nothing:
  registries are explicit mappings (:func:`dpcore.rules.default_registry`).
- Dependencies run one way: this module imports only TensorFlow and :mod:`dpcore.norms` (pure
  tensor math), never :mod:`dpcore.engine`; the engine imports the rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf

from dpcore import norms

__all__ = [
    "PATHS",
    "LayerRule",
    "Registry",
    "Use",
    "VariableGrad",
    "activation_or_identity",
    "always",
    "cast_input",
    "from_per_example",
    "materialized_plan",
    "quantized_variant",
    "tracing_for_xla",
    "unit_uses",
    "unsupported_variant",
    "weighted_rows",
]

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
        finite input (see :mod:`dpcore.norms`; :func:`from_per_example` gives it for a rule that
        materializes per-example gradients).
      weighted_sum: ``w [B] -> sum_i w_i * grad_i`` shaped like the variable.
      path: how the norm was computed (``"ghost"``, ``"materialized"``, ...).
      sum_error: ``[B]`` float64, or None for zero: a bound of how far what example ``i`` adds
        through ``weighted_sum`` can be from ``w_i`` times a gradient of norm ``sqrt(sq_norm)``,
        for any ``0 <= w_i <= 1``, beyond that scaling. Needed where the sum multiplies ``w``
        into a factor of a product (``A^T diag(w) G``): a flushed ``w g`` loses up to
        ``2^-126 |a|`` whatever ``w`` is (:func:`dpcore.norms.outer_sum_error`). Clipping spends
        it out of ``C``. A weighted sum of materialized per-example gradients (one product per
        entry) has none.
    """

    variable: Any
    sq_norm: tf.Tensor
    weighted_sum: Callable[[tf.Tensor], tf.Tensor]
    path: str
    sum_error: tf.Tensor | None = None


# ------------------------------------------------------------------------------------ defaults


def always(layer: Any) -> str | None:
    """The default ``check``: the rule handles every instance of its class."""
    return None


def activation_or_identity(layer: Any, z: tf.Tensor) -> Any:
    """The default ``activate``: ``layer.activation(z)`` when the layer has one, else ``z``."""
    activation = getattr(layer, "activation", None)
    return activation(z) if activation is not None else z


def materialized_plan(layer: Any, input_shapes: Sequence[Any]) -> tuple[str, str]:
    """The default ``plan``: ``"materialized"`` (what :func:`from_per_example` reports)."""
    return "materialized", f"per-example gradients formed by the rule for {type(layer).__name__}"


def _composed_only(*args: Any) -> Any:
    raise NotImplementedError("this rule composes sub-layers (compose); it has no forward/grads")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerRule:
    """The fast-path rule for one layer class (fields are keyword-only).

    Attributes:
      name: short name for reports.
      forward: ``(layer, args, kwargs) -> (z, capture)``: ``z`` is the tensor whose gradient the
        engine takes (pre-activation output), ``capture`` the tensors ``grads`` needs later.
      grads: ``(layer, uses) -> [VariableGrad]`` for the layer's trainable variables; every
        ``sq_norm`` a certified upper bound (float64).
      check: ``layer -> None`` when the rule handles this layer instance, else a reason string
        (e.g. a quantized or LoRA-enabled ``Dense``). Default :func:`always`.
      activate: ``(layer, z) -> outputs``. Default :func:`activation_or_identity`.
      plan: ``(layer, input_shapes) -> (path, why)`` for reports, from static shapes; the path must
        be the one ``grads`` reports. Default :func:`materialized_plan`.
      compose: for a layer made of sub-layers (e.g. MultiHeadAttention):
        ``(layer, args, kwargs, call) -> outputs`` replays the layer's computation, calling each
        sub-layer through ``call(sublayer, args, kwargs)`` so that the engine records the
        sub-layers with their own rules. When set, ``forward``/``activate``/``grads`` are unused
        (and may be left out), except for a layer owning variables outside its sub-layers (e.g.
        a bias): its ``compose`` calls the layer itself through ``call``, which runs ``forward``
        and ``activate`` and hands those uses to ``grads`` (``dpcore.rules.keras_hub``'s
        ``MaskedLMHead`` rule).
      groupable: True (default) when every tensor of rank >= 1 in a capture has the rows as its
        leading axis, so that a privacy unit of several rows can be handed to ``grads`` as
        several uses (:func:`unit_uses`); False sends the layer to the per-layer fallback then.
      units_as_positions: True when ``grads`` flattens every capture and gradient tensor
        ``[B, ..., C]`` to positions ``[B, T, C]`` and concatenates the uses along ``T`` (e.g.
        ``Dense``): a unit's ``K`` uses then arrive as one use whose tensors are reshaped to
        ``[U, K, ..., C]``, which is that concatenation without copying (:func:`unit_uses`).

    Raises:
      TypeError: a rule without ``compose`` that leaves out ``forward`` or ``grads``.
    """

    name: str
    forward: Callable[[Any, tuple, dict], tuple[tf.Tensor, dict[str, Any]]] = _composed_only
    grads: Callable[[Any, Sequence[Use]], list[VariableGrad]] = _composed_only
    check: Callable[[Any], str | None] = always
    activate: Callable[[Any, tf.Tensor], Any] = activation_or_identity
    plan: Callable[[Any, Sequence[Any]], tuple[str, str]] = materialized_plan
    compose: Callable[[Any, tuple, dict, Callable], Any] | None = None
    groupable: bool = True
    units_as_positions: bool = False

    def __post_init__(self) -> None:
        if self.compose is None and _composed_only in (self.forward, self.grads):
            raise TypeError(f"LayerRule {self.name!r} needs forward and grads (or compose).")


Registry = Mapping[type, LayerRule]


# ------------------------------------------------------------------------------ shared helpers


def weighted_rows(per_example: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    """``sum_i w_i per_example[i]`` in float32."""
    return tf.tensordot(tf.cast(w, tf.float32), tf.cast(per_example, tf.float32), axes=1)


def from_per_example(
    variable: Any, per_example: tf.Tensor, *, path: str = "materialized"
) -> VariableGrad:
    """A variable's gradient info from its per-example gradients ``[B, *variable.shape]``:
    certified norms row by row (:func:`dpcore.norms.sq_norm_bound`), the clipped sum as
    :func:`weighted_rows` of the same tensor, cast to the variable's dtype.

    Args:
      variable: the variable the gradients belong to.
      per_example: ``[B, *variable.shape]`` per-example gradients (any float dtype).
      path: the path reported for it (``"ghost"`` where the per-example tensor is as small as
        the parameters times the batch, e.g. a bias).

    Privacy:
      Unclipped per-example gradients: the engine clips them through ``weighted_sum``'s weights.
    """
    return VariableGrad(
        variable=variable,
        sq_norm=norms.sq_norm_bound(per_example),
        weighted_sum=lambda w: tf.cast(weighted_rows(per_example, w), variable.dtype),
        path=path,
    )


def unit_uses(uses: Sequence[Use], group_size: int, *, as_positions: bool = False) -> list[Use]:
    """Row-level uses -> unit-level uses: unit ``u`` (rows ``u*K .. u*K+K-1``) becomes one example
    that called the layer ``K`` times, so a rule's multi-use path gives per-unit quantities.

    Every tensor of rank >= 1 in a capture or gradient is split by its leading (row) axis; other
    values are passed through. Use ``k`` of the result holds row ``k`` of every unit.

    With ``as_positions`` (a rule with ``units_as_positions``) and every such tensor of rank >= 2,
    each use instead stays one use with its tensors reshaped ``[U*K, ...] -> [U, K, ...]``: for a
    rule that flattens ``[B, ..., C]`` to positions and concatenates uses along them, that is the
    same ``[U, K*T, C]`` tensor in the same order as the ``K`` split uses, without the copies.

    Privacy:
      Row ``u`` of the result depends on unit ``u`` alone.
    """
    if group_size == 1:
        return list(uses)

    def has_rows(t: Any) -> bool:
        return tf.is_tensor(t) and bool(t.shape.rank)

    def to_units(t: tf.Tensor) -> tf.Tensor:  # [U*K, ...] -> [U, K, ...]
        dims = t.shape[1:].as_list()
        if None in dims:
            return tf.reshape(t, tf.concat([[-1, group_size], tf.shape(t)[1:]], 0))
        return tf.reshape(t, [-1, group_size, *dims])

    leaves = [tf.nest.flatten((dict(use.capture), use.grad)) for use in uses]
    if as_positions and all(t.shape.rank >= 2 for ls in leaves for t in ls if has_rows(t)):

        def group(t: Any) -> Any:
            return to_units(t) if has_rows(t) else t

        return [
            Use(capture=tf.nest.map_structure(group, dict(use.capture)), grad=group(use.grad))
            for use in uses
        ]

    def split(t: Any) -> list[Any]:
        if not has_rows(t):
            return [t] * group_size
        return tf.unstack(to_units(t), num=group_size, axis=1)

    out = []
    for use, use_leaves in zip(uses, leaves):
        parts = [split(t) for t in use_leaves]
        for k in range(group_size):
            capture, grad = tf.nest.pack_sequence_as(
                (dict(use.capture), use.grad), [p[k] for p in parts]
            )
            out.append(Use(capture=capture, grad=grad))
    return out


def tracing_for_xla() -> bool:
    """True while tracing a function XLA will compile (``tf.function(jit_compile=True)``, Keras's
    ``jit_compile=True``), read at trace time. A rule may pick a route by it where TensorFlow's
    kernels and XLA's differ widely in speed; False when it cannot be told.
    """
    try:  # TensorFlow's own test (tf.function uses it); not part of its public API
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - a TensorFlow without it
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()))


def cast_input(layer: Any, x: Any) -> tf.Tensor:
    """``x`` as a tensor in the layer's compute dtype (floating inputs only), as Keras casts it."""
    x = tf.convert_to_tensor(x)
    if x.dtype.is_floating and x.dtype != tf.as_dtype(layer.compute_dtype):
        x = tf.cast(x, layer.compute_dtype)
    return x


def unsupported_variant(layer: Any) -> str | None:
    """Why a LoRA-enabled or quantized Keras layer is not handled (None for the plain layer)."""
    if getattr(layer, "lora_enabled", False):
        return f"{type(layer).__name__} {layer.name!r} has LoRA enabled"
    return quantized_variant(layer)


def quantized_variant(layer: Any) -> str | None:
    """Why a quantized Keras layer is not handled (None when it is not quantized)."""
    if getattr(layer, "quantization_mode", None):
        return f"{type(layer).__name__} {layer.name!r} is quantized ({layer.quantization_mode})"
    return None
