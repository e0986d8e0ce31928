"""dpcore: differentially private training (DP-SGD) for TensorFlow 2 with Keras 3.

The public API, in pipeline order: the per-example gradient engine, clipping and noise
aggregation, the DP optimizer and Keras integration, sampling, accounting and callbacks.
"""

from dpcore import (
    accounting,
    adaptive,
    aggregation,
    audit,
    callbacks,
    data,
    sampling,
    testing,
    units,
)
from dpcore.config import DPConfig
from dpcore.engine import per_example_gradients, per_example_norms, summarize
from dpcore.explain import explain
from dpcore.model import DPModel, make_private
from dpcore.optimizer import DPOptimizer
from dpcore.options import ExecutionOptions
from dpcore.step import dp_step, dp_train_step

__version__ = "0.1.0"

__all__ = [
    "DPConfig",
    "DPModel",
    "DPOptimizer",
    "ExecutionOptions",
    "accounting",
    "adaptive",
    "aggregation",
    "audit",
    "callbacks",
    "data",
    "dp_step",
    "dp_train_step",
    "explain",
    "make_private",
    "per_example_gradients",
    "per_example_norms",
    "sampling",
    "summarize",
    "testing",
    "units",
]
