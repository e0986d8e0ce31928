"""KerasHub task models for the experiments: built from scratch, or from a local preset.

Contract:
  * Nothing is downloaded: :func:`build_task` builds a named architecture (``gpt2``: a
    ``GPT2CausalLM``; ``bert``: a ``BertTextClassifier``) with random weights and the sizes of a
    :class:`HubSize`, and :func:`load_backbone` reads a preset only from a local directory.
    Every task is built with ``preprocessor=None``: it takes token ids (a dict of
    ``token_ids``, ``padding_mask`` and, for BERT, ``segment_ids``) and returns logits.
  * ``keras_hub`` is imported inside the functions, so importing this module costs nothing and
    works where KerasHub is not installed (the Keras 2 peer environment never imports it).
  * The benchmark configurations (``BENCH_MODELS``) are dpcore-only and opt-in: they are not in
    :data:`dpcore_experiments.lib.zoo.BENCH_MODELS`, which the peer shares. Their synthetic batches
    are full-length sequences (no padding) so both sides of a comparison do the same work.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

ARCHITECTURES = ("gpt2", "bert")


@dataclasses.dataclass(frozen=True)
class HubSize:
    """A transformer's sizes (KerasHub backbone arguments) and its sequence length."""

    num_layers: int = 2
    hidden_dim: int = 64
    num_heads: int = 2
    intermediate_dim: int = 128
    vocabulary_size: int = 257
    sequence_length: int = 64
    dropout: float = 0.1


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One opt-in KerasHub benchmark model: an architecture, its sizes, and LoRA or not."""

    architecture: str
    size: HubSize
    lora_rank: int | None = None
    num_classes: int = 2


# The benchmark's configurations: 2 layers, hidden 256, T = 128 (batch 32 on the command line),
# full fine-tuning and LoRA rank 8; and a GPT-2-small-sized model (12 layers, hidden 768,
# vocabulary 50257, T = 256; batch 8). The small ones use an 8192-token vocabulary.
_SMALL = HubSize(
    num_layers=2,
    hidden_dim=256,
    num_heads=4,
    intermediate_dim=1024,
    vocabulary_size=8192,
    sequence_length=128,
)
_GPT2_SMALL = HubSize(
    num_layers=12,
    hidden_dim=768,
    num_heads=12,
    intermediate_dim=3072,
    vocabulary_size=50257,
    sequence_length=256,
)
BENCH_CONFIGS = {
    "bert": BenchConfig("bert", _SMALL),
    "bert_lora": BenchConfig("bert", _SMALL, lora_rank=8),
    "gpt2": BenchConfig("gpt2", _SMALL),
    "gpt2_lora": BenchConfig("gpt2", _SMALL, lora_rank=8),
    "gpt2_small": BenchConfig("gpt2", _GPT2_SMALL),
}
BENCH_MODELS = tuple(BENCH_CONFIGS)


def _backbone_class(keras_hub: Any, architecture: str) -> Any:
    if architecture == "gpt2":
        return keras_hub.models.GPT2Backbone
    if architecture == "bert":
        return keras_hub.models.BertBackbone
    raise ValueError(f"architecture={architecture!r}; expected one of {ARCHITECTURES}.")


def build_backbone(architecture: str, size: HubSize) -> Any:
    """A randomly initialized ``GPT2Backbone`` or ``BertBackbone`` of that size (not seeded)."""
    import keras_hub

    return _backbone_class(keras_hub, architecture)(
        vocabulary_size=size.vocabulary_size,
        num_layers=size.num_layers,
        num_heads=size.num_heads,
        hidden_dim=size.hidden_dim,
        intermediate_dim=size.intermediate_dim,
        dropout=size.dropout,
        max_sequence_length=size.sequence_length,
    )


def load_backbone(preset_dir: str) -> Any:
    """The backbone saved in a local preset directory (``config.json`` + weights; no download).

    Raises:
      FileNotFoundError: if ``preset_dir`` is not a local directory with a ``config.json``.
    """
    if not os.path.isfile(os.path.join(preset_dir, "config.json")):
        raise FileNotFoundError(
            f"--preset={preset_dir!r} is not a local KerasHub preset directory (no config.json); "
            "nothing is downloaded: point it at a directory saved with save_to_preset, or leave "
            "it out to build the architecture from scratch."
        )
    import keras_hub

    return keras_hub.models.Backbone.from_preset(preset_dir)


def architecture_of(backbone: Any) -> str:
    """``gpt2`` or ``bert`` for a backbone of that family."""
    import keras_hub

    for name in ARCHITECTURES:
        if isinstance(backbone, _backbone_class(keras_hub, name)):
            return name
    raise ValueError(
        f"{type(backbone).__name__}: only GPT-2 (causal LM) and BERT (classifier) backbones are "
        f"supported, expected one of {ARCHITECTURES}."
    )


def task_for(backbone: Any, *, num_classes: int = 2, lora_rank: int | None = None) -> Any:
    """The task model on ``backbone`` (``GPT2CausalLM`` / ``BertTextClassifier``), LoRA optional.

    With ``lora_rank`` the backbone's attention query/value projections get rank-``lora_rank``
    adapters and the rest of the backbone is frozen (KerasHub's ``enable_lora``); a classifier's
    head stays trainable.
    """
    import keras_hub

    architecture = architecture_of(backbone)
    if lora_rank is not None:
        backbone.enable_lora(int(lora_rank))
    if architecture == "gpt2":
        return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    return keras_hub.models.BertTextClassifier(backbone, num_classes=num_classes, preprocessor=None)


def build_task(
    architecture: str, size: HubSize, *, num_classes: int = 2, lora_rank: int | None = None
) -> Any:
    """A task model of that architecture and size, random weights (seed Keras first)."""
    return task_for(
        build_backbone(architecture, size), num_classes=num_classes, lora_rank=lora_rank
    )


def inputs_for(architecture: str, token_ids: Any, padding_mask: Any) -> dict[str, Any]:
    """The task's input dict for ``[N, T]`` token ids and padding mask (numpy)."""
    x = {"token_ids": token_ids, "padding_mask": padding_mask}
    if architecture == "bert":
        x["segment_ids"] = 0 * token_ids
    return x


def build_bench_model(name: str) -> Any:
    """The opt-in benchmark model of that name (not seeded: seed Keras first)."""
    if name not in BENCH_CONFIGS:
        raise ValueError(f"unknown KerasHub model {name!r}; expected one of {BENCH_MODELS}.")
    c = BENCH_CONFIGS[name]
    return build_task(c.architecture, c.size, num_classes=c.num_classes, lora_rank=c.lora_rank)


def make_bench_batch(name: str, batch_size: int, *, seed: int = 0) -> tuple[Any, Any]:
    """A synthetic full-length batch ``(x, y)`` (numpy) for that benchmark model.

    GPT-2: next-token labels ``[B, T]``; BERT: class labels ``[B]``. No padding.
    """
    import numpy as np

    c = BENCH_CONFIGS[name]
    rng = np.random.default_rng(seed)
    shape = (batch_size, c.size.sequence_length)
    ids = rng.integers(1, c.size.vocabulary_size, shape).astype("int32")
    x = inputs_for(c.architecture, ids, np.ones(shape, "int32"))
    if c.architecture == "gpt2":
        y = rng.integers(1, c.size.vocabulary_size, shape).astype("int32")
    else:
        y = rng.integers(0, c.num_classes, batch_size).astype("int32")
    return x, y
