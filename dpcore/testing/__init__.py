"""Slow exact references for testing dpcore and users' own layers.

Contract: these functions compute per-example quantities the obvious way, one example at a time,
eagerly, with a fresh ``tf.GradientTape`` per example. They are deliberately slow and simple, and
every fast path in dpcore is tested against them.
"""

from dpcore.testing.reference import (
    NORM_BOUND_SLACK,
    assert_sq_norm_bound,
    reference_clipped_mean,
    reference_input_gradients,
    reference_per_example_gradients,
    reference_per_example_norms,
    reference_unit_gradients,
)

__all__ = [
    "NORM_BOUND_SLACK",
    "assert_sq_norm_bound",
    "reference_clipped_mean",
    "reference_input_gradients",
    "reference_per_example_gradients",
    "reference_per_example_norms",
    "reference_unit_gradients",
]
