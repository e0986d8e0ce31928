"""Built-in fast-path rules, one module per layer family.

Contract: importing this package registers nothing; :func:`builtin_rules` returns a fresh
``{layer class: LayerRule}`` mapping that :func:`dpcore.engine.registry.default_registry` uses.
"""

from __future__ import annotations

import keras

from dpcore.engine.registry import LayerRule


def builtin_rules() -> dict[type, LayerRule]:
    """``{layer class: rule}`` for every layer dpcore has a rule for (exact classes)."""
    from dpcore.rules.attention import MULTI_HEAD_ATTENTION
    from dpcore.rules.conv import CONV
    from dpcore.rules.dense import DENSE, EINSUM_DENSE
    from dpcore.rules.embedding import EMBEDDING
    from dpcore.rules.normalization import GROUP_NORMALIZATION, LAYER_NORMALIZATION

    return {
        keras.layers.Dense: DENSE,
        keras.layers.EinsumDense: EINSUM_DENSE,
        keras.layers.Conv1D: CONV,
        keras.layers.Conv2D: CONV,
        keras.layers.Embedding: EMBEDDING,
        keras.layers.LayerNormalization: LAYER_NORMALIZATION,
        keras.layers.GroupNormalization: GROUP_NORMALIZATION,
        keras.layers.MultiHeadAttention: MULTI_HEAD_ATTENTION,
    }
