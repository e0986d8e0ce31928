"""Shared test helpers: a DP optimizer with test defaults and weight snapshots."""

from __future__ import annotations

import keras
import numpy as np

from dpcore.optimizer import DPOptimizer


def make_opt(inner=None, **kw):
    """A DPOptimizer over ``inner`` (SGD(1.0)): C = 1, σ = 0, expected batch size 6 unless given."""
    kw.setdefault("l2_norm_clip", 1.0)
    kw.setdefault("noise_multiplier", 0.0)
    kw.setdefault("expected_batch_size", 6)
    return DPOptimizer(inner or keras.optimizers.SGD(1.0), **kw)


def weights(model):
    """A copy of each trainable variable's value."""
    return [v.numpy().copy() for v in model.trainable_variables]


def flat_weights(model):
    """Every trainable value of ``model`` in one vector."""
    return np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
