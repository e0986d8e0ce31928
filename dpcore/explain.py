"""Which path each layer of a model takes in the per-example gradient engine.

Contract: :func:`explain` inspects a built model statically (no data, no tracing) and returns one
row per layer: its name, class, path (``"ghost"``, ``"materialized"``, ``"fallback:vectorized"``,
``"no variables"``, ``"frozen"``) and why. The paths are those the engine
(:func:`dpcore.engine.summarize`) takes for the same model and :class:`dpcore.ExecutionOptions`
(its layer rules, and a ``method``/``chunk_size`` that selects the vectorized path).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dpcore.engine import graph
from dpcore.engine.ghost import fallback_reason
from dpcore.options import ExecutionOptions, resolve
from dpcore.rules import Registry, lookup

__all__ = ["Explanation", "LayerPath", "explain"]


@dataclasses.dataclass(frozen=True)
class LayerPath:
    """One layer's row: ``name``, ``cls`` (class name), ``path``, ``why``."""

    name: str
    cls: str
    path: str
    why: str


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The per-layer report; ``str()`` gives a table, ``rows`` the data.

    Attributes:
      model: the model's name.
      rows: one :class:`LayerPath` per layer, in graph order.
      whole_model_fallback: why the whole model takes the vectorized path (None if it does not).
    """

    model: str
    rows: tuple[LayerPath, ...]
    whole_model_fallback: str | None = None

    def paths(self) -> dict[str, str]:
        """``{layer name: path}``."""
        return {r.name: r.path for r in self.rows}

    def __str__(self) -> str:
        header = ("layer", "class", "path", "why")
        cells = [header] + [(r.name, r.cls, r.path, r.why) for r in self.rows]
        widths = [max(len(c[i]) for c in cells) for i in range(3)]
        lines = [f"dpcore engine paths for model {self.model!r}"]
        if self.whole_model_fallback:
            lines.append(f"whole model falls back to vectorized: {self.whole_model_fallback}")
        for c in cells:
            lines.append("  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3])
        return "\n".join(lines)


def _row(layer: Any, shapes: list, registry: Registry) -> LayerPath:
    cls = type(layer).__name__
    if not layer.weights:
        return LayerPath(layer.name, cls, "no variables", "nothing to differentiate")
    if not graph.trainable_weights(layer):
        return LayerPath(layer.name, cls, "frozen", "no trainable variables")
    rule, reason = lookup(registry, layer)
    if rule is None:
        return LayerPath(
            layer.name,
            cls,
            "fallback:vectorized",
            f"{reason}: vectorized per-example gradients of this layer only",
        )
    path, why = rule.plan(layer, shapes)
    return LayerPath(layer.name, cls, path, why)


def _vectorized_by_options(options: ExecutionOptions) -> str | None:
    """Why ``options`` select the vectorized path for the whole model (as ``summarize`` does)."""
    if options.method == "vectorized":
        return "options.method='vectorized'"
    if options.method == "auto" and options.chunk_size is not None:
        return "options.chunk_size selects the vectorized path"
    return None


def explain(
    model: Any,
    *,
    options: ExecutionOptions | None = None,
    registry: Registry | None = None,
) -> Explanation:
    """Reports the engine path of every layer of ``model``.

    Args:
      model: a built Keras model.
      options: the :class:`dpcore.ExecutionOptions` the model trains with: its layer rules
        (``rules`` merged over the built-in ones, or a complete ``registry``) and
        ``method``/``chunk_size`` (which may select the vectorized path for the whole model) are
        used.
      registry: the complete rule mapping, a shorthand for
        ``options=ExecutionOptions(registry=...)``; default :func:`dpcore.rules.default_registry`.

    Returns:
      An :class:`Explanation`; ``print(explain(model))`` shows a table.

    Raises:
      ValueError: when ``registry`` is given together with ``options.rules`` or
        ``options.registry``.
    """
    options = resolve(options)
    if registry is not None and (options.registry is not None or options.rules is not None):
        raise ValueError(
            "pass the layer rules once: registry= or options.rules/options.registry, not both."
        )
    registry = registry if registry is not None else options.layer_rules()
    name = getattr(model, "name", type(model).__name__)
    whole = _vectorized_by_options(options) or fallback_reason(model, registry=registry)
    if whole is not None:
        members = list(getattr(model, "layers", []))
        rows = tuple(
            LayerPath(
                layer.name,
                type(layer).__name__,
                "fallback:vectorized" if graph.trainable_weights(layer) else "no variables",
                "whole model: " + whole,
            )
            for layer in members
        )
        return Explanation(model=name, rows=rows, whole_model_fallback=whole)
    shapes: dict[int, list] = {}
    order: list[Any] = []
    for layer, input_shapes in graph.leaf_calls(model):
        if id(layer) not in shapes:
            order.append(layer)
            shapes[id(layer)] = []
        shapes[id(layer)].append(input_shapes[0] if input_shapes else None)
    rows = tuple(_row(layer, shapes[id(layer)], registry) for layer in order)
    return Explanation(model=name, rows=rows)
