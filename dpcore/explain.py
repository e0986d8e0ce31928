"""Which path each layer of a model takes in the per-example gradient engine.

Contract: :func:`explain` inspects a built model statically (no data, no tracing) and returns one
row per layer: its name, class, path (``"ghost"``, ``"materialized"``, ``"fallback:vectorized"``,
``"no variables"``, ``"frozen"``) and why. The paths are those the engine
(:func:`dpcore.engine.summarize`) takes for the same model and :class:`dpcore.ExecutionOptions`
(its layer rules, and a ``method``/``chunk_size`` that selects the vectorized path).
A layer that a composition calls from inside (e.g. the tied ``token_embedding`` whose reverse
projection a KerasHub ``MaskedLMHead`` calls) and that the graph also calls is one layer with
several uses in the engine: its row plans all of them and names the compositions that call it.
A whole-model fallback that only a traced step can find (the rows probe of
:mod:`dpcore.engine.independence` could not verify the model, a layer's batch axis is not its
first) is reported once such a step has been traced, with the reason its warning gave.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dpcore.engine import graph
from dpcore.engine.ghost import fallback_reason
from dpcore.engine.independence import whole_model_fallback
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


def _parts(layer: Any, registry: Registry) -> list[Any]:
    """The layers a composition's rule calls through the engine: its sub-layers, and theirs where
    they compose too."""
    out = []
    for sub in graph.sublayers(layer):
        out.append(sub)
        rule, _ = lookup(registry, sub)
        if rule is not None and rule.compose is not None:
            out.extend(_parts(sub, registry))
    return out


def _unknown_positions(shape: Any) -> Any:
    """``[B, ..., C]`` with its positions unknown: how many a composition feeds a part it calls
    (e.g. the gathered mask positions of a head) is not in the graph."""
    if shape is None or len(shape) < 3:
        return shape
    return (shape[0], *([None] * (len(shape) - 2)), shape[-1])


def _inner_uses(order: list[Any], shapes: dict[int, list], registry: Registry) -> dict[int, list]:
    """``{id(layer): [(composition, input shape), ...]}`` for every layer that the graph calls and
    a composition calls too, from inside: the engine records those calls as uses of the one layer
    (tied weights), so its row plans them together."""
    leaves = {id(layer) for layer in order}
    uses: dict[int, list] = {}
    for layer in order:
        rule, _ = lookup(registry, layer)
        if rule is None or rule.compose is None:
            continue
        for sub in _parts(layer, registry):
            if id(sub) in leaves:
                calls = [(layer, _unknown_positions(shape)) for shape in shapes[id(layer)]]
                uses.setdefault(id(sub), []).extend(calls)
    return uses


def _shared_row(layer: Any, shapes: list, inner: list, registry: Registry) -> LayerPath:
    """The row of a layer also called from inside compositions (``inner``): its plan over every
    use, and which compositions call it."""
    row = _row(layer, shapes + [shape for _, shape in inner], registry)
    callers = ", ".join(
        dict.fromkeys(f"{c.name!r} ({type(c).__name__})" for c, _ in inner)
    )  # each once, in graph order
    return dataclasses.replace(row, why=f"{row.why}; also called inside {callers}")


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
      An :class:`Explanation`; ``print(explain(model))`` shows a table. Its
      ``whole_model_fallback`` also holds the reason a traced step of ``model`` took the
      vectorized path as a whole (the one its warning named), once such a step was traced.

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
    whole = (
        _vectorized_by_options(options)
        or fallback_reason(model, registry=registry)
        or whole_model_fallback(model)
    )
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
    inner = _inner_uses(order, shapes, registry)
    rows = tuple(
        _shared_row(layer, shapes[id(layer)], inner[id(layer)], registry)
        if id(layer) in inner
        else _row(layer, shapes[id(layer)], registry)
        for layer in order
    )
    return Explanation(model=name, rows=rows)
