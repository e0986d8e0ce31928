"""DP fine-tuning of a KerasHub causal LM (GPT-2) or classifier (BERT) on a local text file.

Nothing is downloaded. ``--preset=/path`` loads a backbone (and its weights) from a local
KerasHub preset directory; without it ``--model=gpt2|bert`` builds that architecture from
scratch with small default sizes (random weights: a smoke run, not a pretrained fine-tune).

Contract:
  * Flags live here only; :func:`run_finetune` takes a plain :class:`FinetuneSettings` and
    returns the results dict (tests call it without absl flags).
  * Tokenization is byte-level and needs no vocabulary file: every UTF-8 byte of the text is
    one token (id = byte + 1; id 0 is padding), so the model's vocabulary is 257. A preset's
    own tokenizer is not used (its vocabulary must still hold the 257 ids).
  * Examples (the privacy unit, what ε is per):
      - ``gpt2``: the file's bytes cut into consecutive windows of ``--sequence_length`` + 1
        tokens; each window is one example (inputs: its first T tokens; labels: the next-token
        targets; a short last window is padded and its padding positions have no loss).
      - ``bert``: one example per non-empty line ``<label><TAB><text>`` (integer label in
        ``[0, num_classes)``), the text's bytes truncated or padded to ``--sequence_length``.
    ε protects one example (one window or line). Text of one person or document spread over
    several examples is protected only by group privacy: weaker by about that factor.
  * Training: ``dpcore.make_private`` (LoRA of rank ``--lora_rank`` on the backbone by
    default; ``--lora_rank=0`` fine-tunes every weight), Poisson-sampled batches from
    ``dpcore.sampling.poisson_batches`` for ``DPConfig.steps_for_epochs(--epochs)`` logical
    steps (σ calibrated to ``--target_epsilon`` unless ``--noise_multiplier`` is given), ε by
    ``dpcore.callbacks.EpsilonCallback`` from the steps the optimizer applied.
  * ``<output_dir>/results.json`` (written atomically) holds the settings, the tokenizer and
    data description, the model sizes and trainable parameter count, the DPConfig, the DpEvent
    that ran, ε by PLD and RDP, the training loss and the held-out loss, and the versions.

Example:
  dpcore-finetune --text_file=LICENSE --model=gpt2 --epochs=2 \\
      --target_epsilon=8 --output_dir=runs/finetune_license
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import types
import warnings
from typing import Any

import numpy as np
from dpcore_experiments.lib import cli, common, hub_models
from dpcore_experiments.lib.train_model import versions
from dpcore_experiments.lib.train_plan import privacy_report

RESULTS_FILE = "results.json"
BYTE_VOCABULARY = 257  # 256 byte values + padding (id 0)
PAD_LABEL = -1  # next-token label of a padding position: no loss


@dataclasses.dataclass(frozen=True)
class FinetuneSettings:
    """Everything one fine-tuning run depends on (mirrors the command-line flags)."""

    text_file: str
    model: str = "gpt2"
    preset: str | None = None
    lora_rank: int = 8
    sequence_length: int = 64
    num_layers: int = 2
    hidden_dim: int = 64
    num_heads: int = 2
    intermediate_dim: int = 128
    num_classes: int = 2
    learning_rate: float = 1e-3
    epochs: float = 1.0
    batch_size: int = 16
    l2_norm_clip: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = 8.0
    target_delta: float = 1e-5
    eval_fraction: float = 0.1
    seed: int | None = None
    output_dir: str | None = None
    verbose: int = 1

    def __post_init__(self) -> None:
        # Messages name the command-line flag (--delta is the field target_delta).
        checks = [
            (
                self.model in hub_models.ARCHITECTURES,
                f"--model must be in {hub_models.ARCHITECTURES}",
            ),
            (self.lora_rank >= 0, "--lora_rank must be >= 0 (0: full fine-tuning)"),
            (self.sequence_length >= 2, "--sequence_length must be >= 2"),
            (self.epochs > 0, "--epochs must be > 0"),
            (self.batch_size >= 1, "--batch_size must be >= 1"),
            (self.learning_rate > 0, "--learning_rate must be > 0"),
            (self.l2_norm_clip > 0, "--l2_norm_clip must be > 0"),
            (0 < self.target_delta < 1, "--delta must be in (0, 1)"),
            (0 <= self.eval_fraction < 1, "--eval_fraction must be in [0, 1)"),
            (self.num_classes >= 2, "--num_classes must be >= 2"),
        ]
        for ok, message in checks:
            if not ok:
                field = message.split()[0][2:]
                value = getattr(self, "target_delta" if field == "delta" else field)
                raise ValueError(f"{message}, got {value!r}.")
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("Give exactly one of --noise_multiplier and --target_epsilon.")
        if self.target_epsilon is not None and self.target_epsilon <= 0:
            raise ValueError(f"--target_epsilon must be > 0, got {self.target_epsilon}.")

    @property
    def size(self) -> hub_models.HubSize:
        """The from-scratch model's sizes (byte-level vocabulary)."""
        return hub_models.HubSize(
            num_layers=self.num_layers,
            hidden_dim=self.hidden_dim,
            num_heads=self.num_heads,
            intermediate_dim=self.intermediate_dim,
            vocabulary_size=BYTE_VOCABULARY,
            sequence_length=self.sequence_length,
        )


# ---------------------------------------------------------------------------------------- data
def byte_tokens(text: str) -> np.ndarray:
    """Byte-level token ids of ``text``: each UTF-8 byte ``b`` is id ``b + 1`` (0 is padding)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + 1


def lm_examples(tokens: np.ndarray, sequence_length: int) -> tuple[dict[str, Any], np.ndarray]:
    """Next-token examples from one token stream: windows of ``T + 1`` tokens, stride ``T``.

    Returns:
      ``(x, y)``: ``x = {"token_ids", "padding_mask"}`` ``[N, T]`` and next-token labels
      ``y [N, T]`` (``PAD_LABEL`` where the position is padding). The last, shorter window is
      padded; a final window of one token (no target) is dropped.
    """
    t = int(sequence_length)
    n = max(0, math.ceil((len(tokens) - 1) / t))
    ids = np.zeros((n, t), np.int32)
    labels = np.full((n, t), PAD_LABEL, np.int32)
    for i in range(n):
        window = tokens[i * t : i * t + t + 1]
        ids[i, : len(window) - 1] = window[:-1]
        labels[i, : len(window) - 1] = window[1:]
    x = hub_models.inputs_for("gpt2", ids, (labels != PAD_LABEL).astype(np.int32))
    return x, labels


def classification_examples(
    text: str, sequence_length: int, num_classes: int
) -> tuple[dict[str, Any], np.ndarray]:
    """One example per non-empty line ``<label>\\t<text>``: byte ids truncated/padded to T."""
    rows, labels = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        label, sep, body = line.partition("\t")
        if not sep or not label.strip().lstrip("-").isdigit():
            raise ValueError(f"line {number}: expected '<label>\\t<text>', got {line[:80]!r}.")
        if not 0 <= int(label) < num_classes:
            raise ValueError(f"line {number}: label {label} not in [0, {num_classes}).")
        rows.append(byte_tokens(body)[:sequence_length])
        labels.append(int(label))
    ids = np.zeros((len(rows), sequence_length), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    x = hub_models.inputs_for("bert", ids, (ids != 0).astype(np.int32))
    return x, np.asarray(labels, np.int32)


def _split(x: dict[str, Any], y: np.ndarray, eval_fraction: float) -> tuple[tuple, tuple]:
    """The last ``eval_fraction`` of the examples held out (in file order)."""
    n_eval = int(len(y) * eval_fraction)
    cut = len(y) - n_eval
    return (
        ({k: v[:cut] for k, v in x.items()}, y[:cut]),
        ({k: v[cut:] for k, v in x.items()}, y[cut:]),
    )


# --------------------------------------------------------------------------------------- model
def masked_token_loss(y_true: Any, y_pred: Any) -> Any:
    """Per-example next-token cross-entropy ``[B]``: the mean over positions, padding (label
    ``PAD_LABEL``) contributing zero. Each value depends on its own example only."""
    import keras
    import tensorflow as tf

    valid = tf.not_equal(y_true, PAD_LABEL)
    labels = tf.where(valid, y_true, tf.zeros_like(y_true))
    token_losses = keras.losses.sparse_categorical_crossentropy(labels, y_pred, from_logits=True)
    return tf.reduce_mean(token_losses * tf.cast(valid, token_losses.dtype), axis=-1)


def build_model(settings: FinetuneSettings) -> Any:
    """The task model: from the local ``--preset`` directory, or built from scratch."""
    import keras

    if settings.seed is not None:
        keras.utils.set_random_seed(settings.seed)
    if settings.preset:
        backbone = hub_models.load_backbone(settings.preset)
        if hub_models.architecture_of(backbone) != settings.model:
            raise ValueError(
                f"--preset holds a {type(backbone).__name__}, but --model={settings.model!r}."
            )
        if int(backbone.vocabulary_size) < BYTE_VOCABULARY:
            raise ValueError(
                f"the preset's vocabulary ({backbone.vocabulary_size}) is smaller than the "
                f"byte-level tokenizer's {BYTE_VOCABULARY} ids."
            )
    else:
        backbone = hub_models.build_backbone(settings.model, settings.size)
    return hub_models.task_for(
        backbone, num_classes=settings.num_classes, lora_rank=settings.lora_rank or None
    )


# ------------------------------------------------------------------------------------ training
def dp_config(settings: FinetuneSettings, num_examples: int) -> Any:
    """The run's DPConfig (Poisson sampling); σ calibrated when ``target_epsilon`` is given."""
    from dpcore.config import DPConfig

    fields = dict(
        epochs=settings.epochs,
        l2_norm_clip=settings.l2_norm_clip,
        expected_batch_size=float(min(settings.batch_size, num_examples)),
        num_examples=num_examples,
        sampling="poisson",
        target_delta=settings.target_delta,
    )
    if settings.noise_multiplier is not None:
        return DPConfig.from_epochs(noise_multiplier=settings.noise_multiplier, **fields)
    return DPConfig.calibrated(target_epsilon=settings.target_epsilon, **fields)


def _read_examples(settings: FinetuneSettings) -> tuple[str, Any, Any, Any]:
    """(the file's text, x, y, the loss): windows for `gpt2`, labelled lines for `bert`."""
    import keras

    with cli.user_errors(OSError, ValueError, hint=f"(--text_file={settings.text_file})"):
        with open(settings.text_file, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if settings.model == "gpt2":
            x, y = lm_examples(byte_tokens(text), settings.sequence_length)
            loss: Any = masked_token_loss
        else:
            x, y = classification_examples(text, settings.sequence_length, settings.num_classes)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return text, x, y, loss


def _fit(
    settings: FinetuneSettings, config: Any, model: Any, loss: Any, x: Any, y: Any
) -> tuple[Any, Any, Any, float]:
    """Trains the run's logical steps on Poisson batches: (DP model, history, ε log, seconds)."""
    import keras

    from dpcore import sampling
    from dpcore.callbacks import EpsilonCallback
    from dpcore.model import make_private

    dp_model = make_private(
        model,
        optimizer=keras.optimizers.Adam(settings.learning_rate),
        loss=loss,
        config=config,
        seed=settings.seed,
    )
    steps = config.steps_for_epochs(settings.epochs)
    batches = sampling.poisson_batches(
        x, y, sampling_prob=config.sampling_prob, steps=steps, seed=settings.seed
    )
    epsilon_log = EpsilonCallback(config, ledger=config.new_ledger(), also_rdp=True)
    start = time.perf_counter()
    with warnings.catch_warnings():
        # The sampler's dataset ends after its steps (unknown cardinality); that end is intended.
        warnings.filterwarnings("ignore", message="Your input ran out of data")
        history = dp_model.fit(
            batches, epochs=1, verbose=settings.verbose > 1, callbacks=[epsilon_log]
        )
    train_time = time.perf_counter() - start
    if epsilon_log.ledger.steps != steps:
        raise RuntimeError(
            f"the optimizer applied {epsilon_log.ledger.steps} logical steps, the run planned "
            f"{steps}; the accounting would not match what ran."
        )
    return dp_model, history, epsilon_log, train_time


def _privacy(settings: FinetuneSettings, ledger: Any) -> dict[str, Any]:
    """ε of the steps that ran, and what one privacy unit is."""
    privacy = privacy_report(
        types.SimpleNamespace(
            dp=True, target_delta=settings.target_delta, sampling="poisson", privacy_unit="example"
        ),
        ledger,
    )
    privacy["privacy_unit_meaning"] = (
        f"one window of {settings.sequence_length} + 1 byte tokens of the file"
        if settings.model == "gpt2"
        else "one line (label and text) of the file"
    )
    return privacy


def _model_summary(settings: FinetuneSettings, model: Any) -> dict[str, Any]:
    return {
        "task": type(model).__name__,
        "backbone": type(model.backbone).__name__,
        "source": f"local preset {settings.preset}" if settings.preset else "from scratch",
        "lora_rank": settings.lora_rank or None,
        "trainable_params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        "total_params": int(model.count_params()),
    }


def run_finetune(settings: FinetuneSettings) -> dict[str, Any]:
    """Fine-tunes per ``settings``; writes ``results.json`` when ``output_dir`` is set.

    Returns:
      The results dict (also written to ``<output_dir>/results.json``).

    Privacy:
      The fine-tuned weights (and anything computed from them alone) are (ε, δ)-DP with
      respect to one example (one window of the file, or one line) for the ε reported (PLD;
      RDP also reported). The training loss logged by Keras and the held-out loss are computed
      on the raw text and are NOT private: diagnostics for the experimenter only.
    """
    text, x, y, loss = _read_examples(settings)
    (x_train, y_train), (x_eval, y_eval) = _split(x, y, settings.eval_fraction)
    num_examples = len(y_train)
    if num_examples < 1:
        raise ValueError(f"{settings.text_file!r} yields no training example.")
    config = dp_config(settings, num_examples)
    model = build_model(settings)
    dp_model, history, epsilon_log, train_time = _fit(
        settings, config, model, loss, x_train, y_train
    )
    eval_loss = None
    if len(y_eval):
        out = dp_model.evaluate(x_eval, y_eval, batch_size=64, verbose=0, return_dict=True)
        eval_loss = float(out["loss"])
    results: dict[str, Any] = {
        "settings": dataclasses.asdict(settings),
        "data": {
            "text_file": os.path.abspath(settings.text_file),
            "bytes": len(text.encode("utf-8")),
            "num_train": num_examples,
            "num_eval": int(len(y_eval)),
            "tokenizer": "byte-level: each UTF-8 byte b is token b + 1, 0 is padding "
            f"(vocabulary {BYTE_VOCABULARY}, built in; no vocabulary file, nothing downloaded)",
        },
        "model": _model_summary(settings, model),
        "config": config.to_dict(),
        "privacy": _privacy(settings, epsilon_log.ledger),
        "train_loss": [float(v) for v in history.history.get("loss", [])],
        "eval_loss": eval_loss,
        "train_time_s": train_time,
        "steps": int(epsilon_log.ledger.steps),
        "ledger": epsilon_log.ledger.to_dict(),
        "versions": versions(),
    }
    if settings.output_dir:
        path = os.path.join(settings.output_dir, RESULTS_FILE)
        common.write_json_atomic(path, results, sort_keys=True, default=str)
    return results


# --------------------------------------------------------------------------------------- flags
def _define_flags() -> None:
    from absl import flags

    d = FinetuneSettings(text_file="")
    flags.DEFINE_string("text_file", None, "Local UTF-8 text file to fine-tune on.", required=True)
    flags.DEFINE_enum(
        "model", d.model, hub_models.ARCHITECTURES, "gpt2: causal LM; bert: classifier."
    )
    flags.DEFINE_string(
        "preset", None, "Local KerasHub preset directory (never downloaded); default: scratch."
    )
    flags.DEFINE_integer("lora_rank", d.lora_rank, "LoRA rank on the backbone; 0: full tuning.")
    flags.DEFINE_integer("sequence_length", d.sequence_length, "Tokens (bytes) per example.")
    flags.DEFINE_integer("num_layers", d.num_layers, "From scratch: transformer layers.")
    flags.DEFINE_integer("hidden_dim", d.hidden_dim, "From scratch: hidden size.")
    flags.DEFINE_integer("num_heads", d.num_heads, "From scratch: attention heads.")
    flags.DEFINE_integer("intermediate_dim", d.intermediate_dim, "From scratch: MLP width.")
    flags.DEFINE_integer("num_classes", d.num_classes, "bert: number of classes.")
    flags.DEFINE_float("learning_rate", d.learning_rate, "Adam learning rate.")
    flags.DEFINE_float("epochs", d.epochs, "Passes over the data (may be fractional).")
    flags.DEFINE_integer("batch_size", d.batch_size, "Expected (Poisson) batch size.")
    flags.DEFINE_float("l2_norm_clip", d.l2_norm_clip, "Per-example clipping bound C.")
    flags.DEFINE_float("noise_multiplier", None, "σ; when set, --target_epsilon is ignored.")
    flags.DEFINE_float("target_epsilon", d.target_epsilon, "Calibrate σ to reach this ε (PLD).")
    flags.DEFINE_float("delta", d.target_delta, "δ of the (ε, δ) guarantee.")
    flags.DEFINE_float("eval_fraction", d.eval_fraction, "Last fraction of examples held out.")
    flags.DEFINE_integer("seed", None, "Fixed seed (sampling, noise, init); default OS entropy.")
    flags.DEFINE_string(
        "output_dir", None, "Where results.json goes (default runs/finetune-<time>/)."
    )
    flags.DEFINE_integer("verbose", d.verbose, "0: quiet, 1: summary, 2: Keras progress.")


def settings_from_flags() -> FinetuneSettings:
    """The settings of the command line (each field has the flag of its name; ``--delta`` is
    ``target_delta``, and ``--noise_multiplier`` overrides ``--target_epsilon``)."""
    from absl import flags

    f = flags.FLAGS
    values = {
        field.name: getattr(f, field.name)
        for field in dataclasses.fields(FinetuneSettings)
        if field.name != "target_delta"
    }
    if f.noise_multiplier is not None:
        values["target_epsilon"] = None
    return FinetuneSettings(target_delta=f.delta, **values)


HELP = """dpcore-finetune: DP fine-tuning of a KerasHub GPT-2 or BERT on a local text file.

Nothing is downloaded. --preset=<folder> loads a backbone and its weights from a local
KerasHub preset folder; without it --model=gpt2|bert builds a small model from scratch (random
weights: a smoke run). Text is tokenized byte by byte. gpt2: the file is cut into windows of
--sequence_length bytes, one example each. bert: one example per line "<label><TAB><text>".
ε protects one example (a window or a line). Prints the losses and the ε spent, and writes
results.json to --output_dir (default runs/finetune-<date>-<time>/).

Examples:
  dpcore-finetune --text_file=LICENSE --model=gpt2 --epochs=2 --target_epsilon=8
  dpcore-finetune --text_file=labelled.tsv --model=bert --preset=/path/to/bert_preset
"""


def prepare(argv: list[str]) -> FinetuneSettings:
    """The run's settings from the flags, with the files and output folder checked."""
    from absl import flags

    cli.check_no_arguments(argv)
    f = flags.FLAGS
    with cli.user_errors(ValueError):
        settings = settings_from_flags()
    cli.check_readable_file(f.text_file, "text_file")
    if f.preset is not None and not os.path.isfile(os.path.join(f.preset, "config.json")):
        raise cli.UserError(
            f"--preset={f.preset} is not a local KerasHub preset folder (no config.json); "
            "nothing is downloaded: give a folder saved with save_to_preset, or leave --preset "
            "out to build the model from scratch."
        )
    return dataclasses.replace(settings, output_dir=cli.output_dir(f.output_dir, "finetune"))


def execute(settings: FinetuneSettings) -> None:
    """Fine-tunes and prints the summary; the last line names results.json."""
    results = run_finetune(settings)
    data, model, privacy = results["data"], results["model"], results["privacy"]
    print(
        f"data: {data['text_file']} ({data['bytes']} bytes, {data['num_train']} training "
        f"examples; byte-level tokens)"
    )
    print(
        f"model: {model['task']} ({model['source']}), LoRA rank {model['lora_rank']}, "
        f"{model['trainable_params']} of {model['total_params']} weights trained"
    )
    eval_loss = results["eval_loss"]
    print(
        f"train loss {results['train_loss'][-1]:.4f}"
        + ("" if eval_loss is None else f", held-out loss {eval_loss:.4f}")
        + f" ({results['steps']} steps, {results['train_time_s']:.1f}s)"
    )
    print(
        f"epsilon spent: {privacy['epsilon']:.3f} (PLD; RDP {privacy['epsilon_rdp']:.3f}) at "
        f"delta={settings.target_delta:g}, noise_multiplier="
        f"{results['config']['noise_multiplier']:.4f}, Poisson sampling; per example = "
        f"{privacy['privacy_unit_meaning']}"
    )
    print(f"results: {os.path.join(settings.output_dir or '', RESULTS_FILE)}")


def run() -> None:
    """Console-script entry point (`dpcore-finetune`)."""
    cli.run_program(prepare=prepare, execute=execute, define_flags=_define_flags, help_text=HELP)


if __name__ == "__main__":
    run()
