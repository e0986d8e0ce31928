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

:func:`check_model` is THE validator: every public entry point that computes per-example
quantities for training (``dp_step``/``dp_train_step``, ``DPModel``, and
``dpcore.engine.summarize``, which every clipped sum handed to ``DPOptimizer.apply_clipped_sum``
comes from) calls it. Beyond the layer list above, given the batch it traces the model call once
in a scratch graph inside a :class:`keras.StatelessScope` (nothing runs, no variable changes) and
refuses every layer whose call would write a variable with a value computed from the batch:
BatchNormalization moving statistics, stateful RNN states, a custom layer's ``assign_add`` on its
own non-trainable variable, raw ``tf.Variable`` writes. Writes that do not depend on the data
(random seed generators, e.g. Dropout's) are allowed; so are layers that only read state set
offline (``keras.layers.Normalization`` after ``adapt``, a frozen BatchNormalization, which
Keras 3 runs in inference mode). Results are cached per model under a structural key (each
layer's identity, ``trainable`` and ``stateful`` flags, the training mode and the input
signature), so the check runs when a step is traced, not on every step, and runs again when the
user toggles ``layer.trainable``.

Mixing that no layer class or setting shows (a ``Lambda`` or Keras op that reduces over the
batch, a custom layer without weights that sorts rows, a loss with in-batch terms) is caught by
the rows probe of :mod:`dpcore.engine.independence`, which ``summarize`` runs right after this
check (it replays the model layer by layer, so it lives with the engine).

:func:`check_not_compiled_by_xla` is the other entry-point check: the DP step, ``summarize`` and
``DPOptimizer.apply_clipped_sum`` refuse to be traced for XLA as a whole, because XLA drops the
assertions that stand between a bad batch and the weights.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import keras
import tensorflow as tf

from dpcore.rules.base import tracing_for_xla

_NORM_HINT = (
    "use keras.layers.GroupNormalization(groups=...) or keras.layers.LayerNormalization instead "
    "(they normalize each example on its own), or freeze this layer (trainable=False) so that it "
    "runs in inference mode with its stored statistics"
)
_STATEFUL_HINT = "create the layer with stateful=False"
_STATE_HINT = (
    "compute such state outside private training (e.g. keras.layers.Normalization.adapt on public "
    "data) or remove the update from call(); a frozen layer (trainable=False) must not update it"
)


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


def _issue(path: str, layer: Any, training: bool = True) -> LayerIssue | None:
    cls = type(layer)
    is_bn = isinstance(layer, keras.layers.BatchNormalization) or any(
        "batchnorm" in k.__name__.lower() for k in cls.__mro__
    )
    # Keras' own BatchNormalization called with training=False normalizes with its stored
    # statistics and updates nothing; a custom one may ignore the flag, so it is refused always.
    keras_inference = not training and isinstance(layer, keras.layers.BatchNormalization)
    if is_bn and layer.trainable and not keras_inference:
        return LayerIssue(
            path,
            layer,
            "batch normalization in training mode normalizes each example with statistics of the "
            "whole batch, so one example's gradient depends on the others and per-example "
            "clipping no longer bounds its influence",
            _NORM_HINT,
        )
    axes = _batch_axis_use(layer)
    if axes is not None:
        return LayerIssue(
            path,
            layer,
            f"{cls.__name__} with axis={axes!r} normalizes over the batch axis (axis 0), so each "
            "example's output depends on the others and per-example clipping no longer bounds "
            "its influence",
            "keep axis 0 (the batch) out of the layer's axes",
        )
    if getattr(layer, "stateful", False) is True and isinstance(layer, keras.layers.RNN):
        return LayerIssue(
            path,
            layer,
            "a stateful recurrent layer carries state from one batch's examples to the next's",
            _STATEFUL_HINT,
        )
    return None


# Built-in layers that reduce over configurable axes: set to include axis 0 they mix the batch
# (UnitNormalization(axis=0) let one example move the update by 5.7 C on the fast path).
_AXIS_LAYERS = tuple(
    getattr(keras.layers, name)
    for name in ("UnitNormalization", "LayerNormalization", "Softmax", "GroupNormalization")
    if hasattr(keras.layers, name)
)


def _batch_axis_use(layer: Any) -> Any:
    """The layer's ``axis`` setting when it includes the batch axis, else None."""
    if not isinstance(layer, _AXIS_LAYERS):
        return None
    axis = getattr(layer, "axis", None)
    listed = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    if any(isinstance(a, bool) or not isinstance(a, int) for a in listed):
        return None
    axes: list[int] = [a for a in listed if isinstance(a, int)]
    rank: int | None = None
    try:
        rank = len(layer.input.shape)
    except (AttributeError, ValueError, TypeError):  # not called yet, or called several times
        pass
    resolved = [a + rank if (a < 0 and rank is not None) else a for a in axes]
    return axis if 0 in resolved else None


def find_batch_mixing_layers(model: Any, *, training: bool = True) -> list[LayerIssue]:
    """Finds every layer of ``model`` (nested too) that mixes examples within or across batches.

    Args:
      model: a Keras model or layer.
      training: the mode the model will be called in. With ``False``, a trainable Keras
        ``BatchNormalization`` uses its stored statistics (per-example, no update) and passes.

    Returns:
      A list of :class:`LayerIssue`, empty when the model is fine for per-example clipping.

    Privacy:
      A layer that mixes examples voids the per-example sensitivity bound of DP-SGD.
    """
    return _layer_issues(walk_layers(model), training)


def _layer_issues(layers: list[tuple[str, Any]], training: bool) -> list[LayerIssue]:
    return [issue for path, layer in layers if (issue := _issue(path, layer, training))]


def _raise(model: Any, issues: list[LayerIssue], what: str) -> None:
    if issues:
        lines = "\n".join(f"  - {issue}" for issue in issues)
        raise ValueError(
            f"model {getattr(model, 'name', model)!r} has layers that {what}, which DP-SGD "
            f"cannot train with a per-example privacy guarantee:\n{lines}"
        )


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
    _raise(model, find_batch_mixing_layers(model), "mix examples")


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


# Op types that write a resource variable in place (TensorFlow's raw variable updates).
_WRITE_PREFIXES = ("Assign", "ResourceScatter", "ResourceApply", "ResourceSparseApply")
_WRITE_TYPES = frozenset({"ResourceStridedSliceAssign"})
# Per model: the structural keys already validated (a bounded set; see check_model).
_VALIDATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_KEYS_PER_MODEL = 32


def _is_write(op_type: str) -> bool:
    return op_type.startswith(_WRITE_PREFIXES) or op_type in _WRITE_TYPES


def _variables_in(value: Any, depth: int = 0) -> list[Any]:
    if isinstance(value, (keras.Variable, tf.Variable)):
        return [value]
    if depth < 2 and isinstance(value, (list, tuple)):
        return [v for item in value for v in _variables_in(item, depth + 1)]
    if depth < 2 and isinstance(value, dict):
        return [v for item in value.values() for v in _variables_in(item, depth + 1)]
    return []


def _owners(layers: list[tuple[str, Any]]) -> dict[int, tuple[str, Any, Any]]:
    """``id(variable) -> (path, layer, variable)``; the layer holding the fewest variables wins.

    That is the innermost layer holding it (a model and its inner graph hold all of them).
    Includes variables Keras does not track (a stateful RNN's ``states``, raw ``tf.Variable``
    attributes), found through the layer's attributes.
    """
    best: dict[int, tuple[int, tuple[str, Any, Any]]] = {}
    for path, layer in layers:
        tracked = list(getattr(layer, "variables", []))
        untracked = [v for value in vars(layer).values() for v in _variables_in(value)]
        for size, group in ((len(tracked), tracked), (0, untracked)):
            for v in group:
                raw = v.value if isinstance(v, keras.Variable) else v
                for key in (id(v), id(getattr(raw, "handle", v))):
                    if key not in best or size < best[key][0]:
                        best[key] = (size, (path, layer, v))
    return {key: owner for key, (_, owner) in best.items()}


def _specs(inputs: Any, *, batched: bool) -> Any:
    """Type specs of ``inputs``; with ``batched=False`` the leading (batch) axis is unknown."""

    def spec(value: Any) -> Any:
        s = tf.type_spec_from_value(value)
        if not batched and isinstance(s, tf.TensorSpec) and s.shape.rank:
            return tf.TensorSpec([None, *s.shape[1:]], s.dtype)
        return s

    return tf.nest.map_structure(spec, inputs)


def _state_update_issues(
    model: Any, layers: list[tuple[str, Any]], inputs: Any, training: bool
) -> list[LayerIssue]:
    """Traces ``model(x, training=training)`` for ``x`` like ``inputs``, runs nothing; reports writes.

    Two kinds of writes are seen: Keras variable assignments, which the
    :class:`keras.StatelessScope` records instead of applying, and raw TensorFlow variable
    updates, found as write ops in the traced graph (nested loop/branch bodies included). A write
    counts when the value written depends, through data edges, on the inputs (their batch size
    included); a Keras assignment made inside a nested loop or branch body always counts.
    """
    recorded: dict[str, Any] = {}

    def probe(x: Any) -> Any:
        with keras.StatelessScope(initialize_variables=False) as scope:
            model(x, training=training)
        recorded["updates"] = dict(scope.state_mapping)
        recorded["inputs"] = [t for t in tf.nest.flatten(x) if tf.is_tensor(t)]
        return tf.constant(0)

    try:  # an unknown batch size, so that a write of the batch size counts as data-fed
        graph = tf.function(probe).get_concrete_function(_specs(inputs, batched=False)).graph
    except Exception:  # a model that needs a static batch size: trace with the batch's own
        graph = tf.function(probe).get_concrete_function(_specs(inputs, batched=True)).graph
    # Every op whose value depends on the inputs: the forward closure of the input placeholders.
    tainted: set[int] = set()
    stack = [t.op for t in recorded["inputs"]]
    while stack:
        op = stack.pop()
        if id(op) in tainted:
            continue
        tainted.add(id(op))
        stack.extend(c for out in op.outputs for c in out.consumers())

    owners = _owners(layers)
    issues: list[LayerIssue] = []
    for var_id, value in recorded["updates"].items():
        value_graph = getattr(value, "graph", None) if tf.is_tensor(value) else None
        if value_graph is not None and (value_graph is not graph or id(value.op) in tainted):
            issues.append(_write_issue(owners.get(var_id), model))

    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    writes_memo: dict[str, bool] = {}

    def function_writes(name: str) -> bool:
        if name not in writes_memo:
            writes_memo[name] = False  # recursion guard
            fdef = library.get(name)
            writes_memo[name] = fdef is not None and any(
                _is_write(node.op) or any(function_writes(f) for f in _called(node.attr))
                for node in fdef.node_def
            )
        return writes_memo[name]

    for op in graph.get_operations():
        if id(op) not in tainted:
            continue
        if _is_write(op.type) or any(function_writes(f) for f in _called(op.node_def.attr)):
            # The variable written: a resource input (the first one of a loop or branch).
            found = [
                owners.get(id(_captured(graph, t))) for t in op.inputs if t.dtype == tf.resource
            ]
            owner = next((o for o in found if o is not None), None)
            issues.append(_write_issue(owner, model, op_name=op.name))
    return issues


def _called(attrs: Any) -> list[str]:
    """Names of the functions an op or node calls (loop bodies, branches, function calls)."""
    names = []
    for value in attrs.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func)
    return names


def _captured(graph: Any, tensor: Any) -> Any:
    """The outside value a captured placeholder stands for (a variable's handle), else None."""
    for external, internal in graph.captures:
        if internal is tensor:
            return external
    return None


def _write_issue(owner: tuple[str, Any, Any] | None, model: Any, op_name: str = "") -> LayerIssue:
    if owner is None:
        where = f"op {op_name}" if op_name else "a variable held by no layer"
        return LayerIssue(
            getattr(model, "name", type(model).__name__),
            model,
            f"its call writes a variable from the batch ({where}), so private data would leave "
            "the step without noise",
            _STATE_HINT,
        )
    path, layer, variable = owner
    if isinstance(layer, keras.layers.BatchNormalization):
        hint = _NORM_HINT
    elif isinstance(layer, keras.layers.RNN):
        hint = _STATEFUL_HINT
    else:
        hint = _STATE_HINT
    name = getattr(variable, "path", None) or getattr(variable, "name", "?")
    return LayerIssue(
        path,
        layer,
        f"its call writes the non-trainable variable {name!r} with a value computed from the "
        "batch, so private data would leave the step without noise",
        hint,
    )


def _structure_key(layers: list[tuple[str, Any]]) -> tuple:
    return tuple(
        (id(layer), bool(getattr(layer, "trainable", True)), getattr(layer, "stateful", None))
        for _, layer in layers
    )


@tf.autograph.experimental.do_not_convert
def check_model(
    model: Any,
    inputs: Any = None,
    *,
    training: Any = True,
    require_variables: bool = True,
) -> None:
    """The one validator every training entry point calls; cached, so cheap to call per step.

    Refuses (1) layers that mix examples (:func:`find_batch_mixing_layers`), (2) a model without
    trainable variables, and, given ``inputs``, (3) any layer whose call in this ``training``
    mode would write a variable with a value computed from the batch (found by tracing the call
    once in a scratch graph, see the module docstring). Passing checks are cached per model under
    a key of every layer's identity, ``trainable`` and ``stateful`` flags, the mode and the input
    signature: inside a ``tf.function`` this runs when the step is traced, never per step.

    Args:
      model: a Keras model or layer.
      inputs: a batch (or one with the same structure, shapes and dtypes): tensors, arrays or
        symbolic tensors of the caller's graph; nothing is computed from their values. ``None``
        (or an unbuilt model) skips check (3).
      training: the mode the model will be called in (a tensor counts as ``True``).
      require_variables: refuse a model without trainable variables.

    Raises:
      ValueError: naming each offending layer's path and a replacement.

    Privacy:
      Enforces that each example's gradient depends on that example alone, and that no state
      outside the noised update (BatchNormalization statistics, RNN states, any non-trainable
      variable) is updated from private data.
    """
    training = True if tf.is_tensor(training) else bool(training)
    layers = walk_layers(model)
    probe = inputs is not None and bool(getattr(model, "built", True))
    signature = repr(_specs(inputs, batched=False)) if probe else None
    key = (training, _structure_key(layers), require_variables, signature)
    done = _VALIDATED.setdefault(model, set())
    if key in done:
        return
    _raise(model, _layer_issues(layers, training), "mix examples")
    if require_variables:
        check_trainable(model)
    if probe:
        _raise(model, _state_update_issues(model, layers, inputs, training), "update state")
    if len(done) >= _MAX_KEYS_PER_MODEL:
        done.clear()
    done.add(key)


def check_not_compiled_by_xla(entry: str) -> None:
    """Refuses to trace ``entry`` (a public DP entry point) inside an XLA-compiled function.

    XLA drops ``tf.debugging.Assert`` ("Ignoring Assert operator"), and the DP step's guards are
    assertions: NaN or Inf in a batch, an example whose loss or gradient is not finite, a clipped
    sum that is not finite before it reaches the weights. Its CPU maxima also drop NaN, which the
    certified norm bounds expect to propagate. Nothing is lost by refusing: dpcore compiles its
    own large per-example products with XLA inside the step.

    Raises:
      ValueError: while tracing for XLA (``jit_compile=True`` on ``DPModel.compile`` or on a
        ``tf.function`` around ``entry``).
    """
    if tracing_for_xla():
        raise ValueError(
            f"{entry} cannot be compiled by XLA as part of a jit_compile=True function: XLA drops "
            "the assertions that guard the DP step (non-finite inputs and gradients, the clipped "
            "sum reaching the weights), and its CPU maxima do not propagate NaN, which the "
            "certified norm bounds rely on. Compile without jit_compile (DPModel's default); "
            "dpcore already compiles its large per-example products with XLA inside the step."
        )
