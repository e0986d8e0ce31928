"""Execution options: how a DP step computes, kept apart from what it privatizes.

Contract: :class:`ExecutionOptions` is one frozen object built once and handed to every stage
that computes per-example quantities (:func:`dpcore.engine.summarize`,
:func:`dpcore.engine.per_example_gradients`, :func:`dpcore.engine.per_example_norms`,
:func:`dpcore.step.dp_step`, :class:`dpcore.DPModel`). It holds execution choices only (engine
path, training mode, memory chunking, non-finite handling, input gradients, layer rules); the
privacy parameters (``l2_norm_clip``, ``noise_multiplier``, ``expected_batch_size``) belong to
the :class:`dpcore.DPOptimizer` and :class:`dpcore.DPConfig`. No option weakens the privacy
guarantee: every path clips each privacy unit with a certified norm bound. ``group_size`` says what
a unit is (a layout of the batch: contiguous blocks of rows, one row by default); the guarantee is
then per unit. Each option has exactly one default, defined here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotation only: options imports no rules at run time
    from dpcore.rules.base import Registry

METHODS = ("auto", "vectorized", "fast")
NONFINITE_MODES = ("raise", "skip")
GROUP_REDUCTIONS = ("sum", "mean")

__all__ = ["GROUP_REDUCTIONS", "METHODS", "NONFINITE_MODES", "ExecutionOptions"]


@dataclasses.dataclass(frozen=True)
class ExecutionOptions:
    """How the engine and the DP step run (never what they privatize).

    Attributes:
      method: ``"auto"`` (the fast per-layer rules for Sequential/Functional models, vectorized
        otherwise), ``"fast"`` or ``"vectorized"``.
      training: passed to every model call. True by default everywhere, since per-example
        gradients are training gradients (dropout on, BatchNormalization refused unless frozen);
        pass False to differentiate the inference-mode model.
      chunk_size: vectorized path only: examples per chunk, bounding peak memory (two passes: norms,
        then the clipped sum). None processes the batch at once; with ``method="auto"`` a chunk
        size selects the vectorized path.
      nonfinite: ``"raise"`` fails the step on an example with NaN/Inf inputs, labels, sample
        weight, loss or gradient; ``"skip"`` drops such examples (zero contribution, counted).
      wrt_inputs: also compute per-example gradients w.r.t. the floating inputs, in the same step.
      rules: your own fast-path layer rules, ``{layer class: LayerRule}``, merged over dpcore's
        built-in rules (an entry for a built-in class replaces its rule). This is how a custom
        rule reaches ``make_private``, ``DPModel``, ``dp_train_step``/``dp_step``, ``summarize``
        and ``explain``: they all take ``options`` (see ``dpcore/rules/README.md``).
      registry: the complete rule mapping, replacing the built-in rules (e.g. to drop one); None
        uses :func:`dpcore.rules.default_registry`. Give ``rules`` or ``registry``, not both.
      group_size: the batch's layout of privacy units: rows ``[u*K, (u+1)*K)`` form unit ``u``
        (``K = group_size``), whose gradient is clipped once (user-level DP, augmentation
        multiplicity). Per-example quantities (norms, losses, clip factors, the mask) are then per
        unit, and ``expected_batch_size`` counts units. The batch size must be a multiple of
        ``K``; a unit's padding rows have mask 0, and an all-padding unit contributes nothing.
        1 (the default): every row is its own unit. With ``chunk_size``, chunks count units.
      group_reduction: how a unit's rows make its loss: ``"sum"`` of the rows' (weighted) losses,
        or ``"mean"`` over its real (unmasked) rows, e.g. the average over augmented views.
    """

    method: str = "auto"
    training: bool = True
    chunk_size: int | None = None
    nonfinite: str = "raise"
    wrt_inputs: bool = False
    rules: Registry | None = dataclasses.field(default=None, compare=False)
    registry: Registry | None = dataclasses.field(default=None, compare=False)
    group_size: int = 1
    group_reduction: str = "sum"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}; expected one of {METHODS}.")
        if self.nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite={self.nonfinite!r}; expected one of {NONFINITE_MODES}.")
        if not isinstance(self.training, bool):
            raise TypeError(f"training must be a bool, got {self.training!r}.")
        if not isinstance(self.wrt_inputs, bool):
            raise TypeError(f"wrt_inputs must be a bool, got {self.wrt_inputs!r}.")
        c = self.chunk_size
        if c is not None and (isinstance(c, bool) or int(c) != c or int(c) <= 0):
            raise ValueError(f"chunk_size must be a positive integer or None, got {c!r}.")
        if self.chunk_size is not None and self.method == "fast":
            raise ValueError(
                "chunk_size bounds the vectorized path's memory; the fast path never materializes "
                "per-example gradients. Use method='vectorized' (or 'auto') with chunk_size."
            )
        if self.chunk_size is not None and self.wrt_inputs:
            raise ValueError("wrt_inputs=True is not supported together with chunk_size.")
        k = self.group_size
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"group_size must be a positive integer, got {k!r}.")
        if self.group_reduction not in GROUP_REDUCTIONS:
            raise ValueError(
                f"group_reduction={self.group_reduction!r}; expected one of {GROUP_REDUCTIONS}."
            )
        if self.registry is not None and not isinstance(self.registry, Mapping):
            raise TypeError(
                f"registry must be a mapping {{layer class: LayerRule}}, got {self.registry!r}."
            )
        if self.rules is not None:
            _check_rules(self.rules)
            if self.registry is not None:
                raise ValueError(
                    "pass the layer rules once: rules= (merged over the built-in rules) or "
                    "registry= (the complete mapping), not both."
                )

    def layer_rules(self) -> Registry:
        """The fast-path rules in force: ``registry`` when given, else the built-in rules with
        ``rules`` merged over them (a fresh mapping)."""
        if self.registry is not None:
            return self.registry
        from dpcore.rules import default_registry  # at call time: importing options loads no rules

        return {**default_registry(), **(self.rules or {})}

    def replace(self, **changes: Any) -> ExecutionOptions:
        """A copy with some options changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def cache_key(self) -> tuple:
        """A hashable identity for compiled-function caches (rules and registry by identity)."""
        return (
            self.method,
            self.training,
            self.chunk_size,
            self.nonfinite,
            self.wrt_inputs,
            None if self.rules is None else id(self.rules),
            None if self.registry is None else id(self.registry),
            self.group_size,
            self.group_reduction,
        )


def _check_rules(rules: Any) -> None:
    from dpcore.rules.base import LayerRule  # at call time: importing options loads no rules

    if not isinstance(rules, Mapping):
        raise TypeError(f"rules must be a mapping {{layer class: LayerRule}}, got {rules!r}.")
    for cls, rule in rules.items():
        if not isinstance(cls, type) or not isinstance(rule, LayerRule):
            raise TypeError(
                f"rules maps layer classes to dpcore.rules.LayerRule; got {cls!r}: {rule!r}."
            )


def resolve(options: ExecutionOptions | None) -> ExecutionOptions:
    """``options``, or the defaults; refuses anything that is not an :class:`ExecutionOptions`."""
    if options is None:
        return ExecutionOptions()
    if not isinstance(options, ExecutionOptions):
        raise TypeError(
            f"options must be a dpcore.ExecutionOptions, got {type(options).__name__}: e.g. "
            "dpcore.ExecutionOptions(method='fast', nonfinite='skip')."
        )
    return options
