"""Refuse models whose layers mix information across the examples of a batch.

Contract: DP-SGD clips each example's gradient on its own, which is only meaningful when each
example's loss depends on that example alone (and on the weights). :func:`find_batch_mixing_layers`
walks every layer of a model, nested layers included, and reports each layer that breaks this,
with its path (``outer/inner/layer``) and a suggested replacement. :func:`check_layers` raises a
single ``ValueError`` listing all of them. Layers refused:

- ``BatchNormalization`` (and any layer whose class name contains ``BatchNorm``, e.g. synchronized
  or third-party variants) while trainable: in training mode it normalizes with statistics of the
  whole batch. A frozen one (``trainable=False``) runs in inference mode in Keras 3, using its
  stored moving statistics, and is per-example, so it is accepted.
- recurrent layers with ``stateful=True``: the state left by example ``i`` of one batch is the
  initial state of example ``i`` of the next one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

_NORM_HINT = (
    "use keras.layers.GroupNormalization(groups=...) or keras.layers.LayerNormalization instead "
    "(they normalize each example on its own), or freeze this layer (trainable=False) so that it "
    "runs in inference mode with its stored statistics"
)
_STATEFUL_HINT = "create the layer with stateful=False"


@dataclasses.dataclass(frozen=True)
class LayerIssue:
    """One layer that mixes examples.

    Attributes:
      path: ``/``-joined names from the outermost model down to the layer.
      layer: the layer object.
      reason: why it mixes examples.
      suggestion: what to use instead.
    """

    path: str
    layer: Any
    reason: str
    suggestion: str

    def __str__(self) -> str:
        return f"{self.path} ({type(self.layer).__name__}): {self.reason}; {self.suggestion}."


def _children(layer: Any) -> list[Any]:
    """Direct sub-layers, found through attributes (covers Sequential, Functional, subclassed)."""
    found: list[Any] = []
    seen: set[int] = set()

    def visit(value: Any, depth: int) -> None:
        if depth > 3:
            return
        if isinstance(value, keras.layers.Layer):
            if value is not layer and id(value) not in seen:
                seen.add(id(value))
                found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item, depth + 1)

    if isinstance(layer, keras.Model):
        for sub in layer.layers:
            visit(sub, 0)
    for value in vars(layer).values():
        visit(value, 0)
    return found


def walk_layers(model: Any) -> list[tuple[str, Any]]:
    """Every layer under ``model`` (itself included) with its path, depth first, each once.

    Args:
      model: a Keras layer or model.

    Returns:
      ``[(path, layer), ...]``; paths join layer names with ``/``.
    """
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def rec(layer: Any, path: str) -> None:
        if id(layer) in seen:
            return
        seen.add(id(layer))
        out.append((path, layer))
        for child in _children(layer):
            rec(child, f"{path}/{child.name}")

    rec(model, getattr(model, "name", type(model).__name__))
    return out


def _issue(path: str, layer: Any) -> LayerIssue | None:
    cls = type(layer)
    is_bn = isinstance(layer, keras.layers.BatchNormalization) or any(
        "batchnorm" in k.__name__.lower() for k in cls.__mro__
    )
    if is_bn and layer.trainable:
        return LayerIssue(
            path,
            layer,
            "batch normalization in training mode normalizes each example with statistics of the "
            "whole batch, so one example's gradient depends on the others and per-example "
            "clipping no longer bounds its influence",
            _NORM_HINT,
        )
    if getattr(layer, "stateful", False) is True and isinstance(layer, keras.layers.RNN):
        return LayerIssue(
            path,
            layer,
            "a stateful recurrent layer carries state from one batch's examples to the next's",
            _STATEFUL_HINT,
        )
    return None


def find_batch_mixing_layers(model: Any) -> list[LayerIssue]:
    """Finds every layer of ``model`` (nested too) that mixes examples within or across batches.

    Args:
      model: a Keras model or layer.

    Returns:
      A list of :class:`LayerIssue`, empty when the model is fine for per-example clipping.

    Privacy:
      A layer that mixes examples voids the per-example sensitivity bound of DP-SGD.
    """
    return [issue for path, layer in walk_layers(model) if (issue := _issue(path, layer))]


def check_layers(model: Any) -> None:
    """Raises ``ValueError`` naming every layer that mixes examples, with a replacement.

    Args:
      model: a Keras model or layer.

    Raises:
      ValueError: if :func:`find_batch_mixing_layers` finds anything.

    Privacy:
      Enforces that each example's loss depends on that example alone, which the clipping bound
      (and hence the privacy guarantee) relies on.
    """
    issues = find_batch_mixing_layers(model)
    if issues:
        lines = "\n".join(f"  - {issue}" for issue in issues)
        raise ValueError(
            f"model {getattr(model, 'name', model)!r} has layers that mix examples, which DP-SGD "
            f"cannot train with a per-example privacy guarantee:\n{lines}"
        )


def check_trainable(model: Any) -> None:
    """Raises ``ValueError`` when the model has no trainable variables.

    Args:
      model: a Keras model.

    Raises:
      ValueError: naming the model.
    """
    if not list(getattr(model, "trainable_variables", [])):
        raise ValueError(
            f"model {getattr(model, 'name', model)!r} has no trainable variables (is it built, "
            "and are its layers trainable?): there is nothing to train privately. Build the model "
            "(call it on a batch, or give it an Input) before wrapping it."
        )
