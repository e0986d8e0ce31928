"""Fast-path layer rules: the rule types, the built-in rules and their registry.

Contract:
- The rule types and shared helpers live in :mod:`dpcore.rules.base` (re-exported here), which
  imports nothing from :mod:`dpcore.engine`; the built-in rules are one module per layer family
  (:mod:`~dpcore.rules.dense`, :mod:`~dpcore.rules.conv`, :mod:`~dpcore.rules.embedding`,
  :mod:`~dpcore.rules.normalization`, :mod:`~dpcore.rules.attention`,
  :mod:`~dpcore.rules.keras_hub`). The engine imports the rules, never the other way round; the
  one exception is the composed rules (attention, KerasHub), which reach Keras internals through
  the accessors of :mod:`dpcore.engine.graph` (a module importing nothing from dpcore).
- Registries are explicit: importing this package registers nothing. Users add rules with
  ``dpcore.ExecutionOptions(rules={MyLayer: MY_RULE})``, merged over the built-in rules for every
  entry point (see ``dpcore/rules/README.md``); :func:`default_registry` returns a fresh
  ``{layer class: LayerRule}`` mapping of the built-in rules, and
  ``dpcore.ExecutionOptions(registry=...)`` replaces them as a whole.
- Lookup is by exact class: a subclass of ``Dense`` may override ``call``, so it does not inherit
  ``Dense``'s rule; it falls back to vectorized gradients unless registered itself.
- A layer used several times in one model is summarized from all its uses at once: its
  per-example gradient is the sum over uses, and the norm is taken of that sum.
"""

from __future__ import annotations

from typing import Any

import keras

from dpcore.rules.base import (
    PATHS,
    LayerRule,
    Registry,
    Use,
    VariableGrad,
    from_per_example,
)

__all__ = [
    "PATHS",
    "LayerRule",
    "Registry",
    "Use",
    "VariableGrad",
    "builtin_rules",
    "default_registry",
    "from_per_example",
    "lookup",
]


def builtin_rules() -> dict[type, LayerRule]:
    """``{layer class: rule}`` for every layer dpcore has a rule for (exact classes)."""
    from dpcore.rules.attention import MULTI_HEAD_ATTENTION
    from dpcore.rules.conv import CONV
    from dpcore.rules.dense import DENSE, EINSUM_DENSE
    from dpcore.rules.embedding import EMBEDDING
    from dpcore.rules.keras_hub import REVERSIBLE_EMBEDDING, keras_hub_rules
    from dpcore.rules.normalization import (
        GROUP_NORMALIZATION,
        LAYER_NORMALIZATION,
        RMS_NORMALIZATION,
    )

    return {
        keras.layers.Dense: DENSE,
        keras.layers.EinsumDense: EINSUM_DENSE,
        keras.layers.Conv1D: CONV,
        keras.layers.Conv2D: CONV,
        keras.layers.Embedding: EMBEDDING,
        keras.layers.LayerNormalization: LAYER_NORMALIZATION,
        keras.layers.GroupNormalization: GROUP_NORMALIZATION,
        keras.layers.MultiHeadAttention: MULTI_HEAD_ATTENTION,
        **_if_present("RMSNormalization", RMS_NORMALIZATION),  # Keras >= 3.9
        **_if_present("ReversibleEmbedding", REVERSIBLE_EMBEDDING),  # Keras >= 3.13
        **keras_hub_rules(),  # KerasHub's layers, once keras_hub is imported
    }


def _if_present(name: str, rule: LayerRule) -> dict[type, LayerRule]:
    """``{keras.layers.<name>: rule}``, or nothing on a Keras that lacks the layer."""
    cls = getattr(keras.layers, name, None)
    return {} if cls is None else {cls: rule}


def default_registry() -> dict[type, LayerRule]:
    """A fresh registry with dpcore's built-in rules.

    Returns:
      ``{layer class: LayerRule}`` for Dense, EinsumDense, Conv1D, Conv2D, Embedding,
      LayerNormalization, GroupNormalization, RMSNormalization, MultiHeadAttention and
      ReversibleEmbedding, and, once ``keras_hub`` is imported, KerasHub's transformer layers and
      embeddings (:mod:`dpcore.rules.keras_hub`).
    """
    return builtin_rules()


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
