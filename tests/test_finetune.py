"""experiments/finetune.py: byte-level data, and short DP fine-tuning runs on the project's
own LICENSE text (GPT-2 from scratch and from a local preset, BERT on labelled lines)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub is not installed (pip install -e '.[test]' installs it)"
)

from dpcore_experiments import finetune  # noqa: E402

from dpcore.config import DPConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LICENSE = os.path.join(ROOT, "LICENSE")  # ships with the project (Apache-2.0 text)
TINY = dict(num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32, sequence_length=32)


def test_byte_tokens_and_lm_windows():
    tokens = finetune.byte_tokens("héllo")  # é is two UTF-8 bytes
    assert tokens.tolist() == [b + 1 for b in "héllo".encode()]
    x, y = finetune.lm_examples(np.arange(1, 12, dtype=np.int32), sequence_length=4)
    # windows of T + 1 tokens, stride T: [1..5], [5..9], [9..11] (short, padded)
    assert x["token_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]
    assert y.tolist() == [[2, 3, 4, 5], [6, 7, 8, 9], [10, 11, -1, -1]]
    assert x["padding_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    # every target is the next token of the stream, none is lost or repeated
    assert y[y >= 0].tolist() == list(range(2, 12))


def test_masked_token_loss_ignores_padding_per_example():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5)).astype("float32")
    y = np.array([[1, 2, -1], [4, -1, -1]], np.int32)
    got = np.asarray(finetune.masked_token_loss(y, logits))
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = [-(log_p[0, 0, 1] + log_p[0, 1, 2]) / 3, -log_p[1, 0, 4] / 3]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # the per-example loss depends on its own row only
    other = logits.copy()
    other[1] += 3.0
    assert np.asarray(finetune.masked_token_loss(y, other))[0] == pytest.approx(got[0])


def test_classification_lines_are_checked():
    x, y = finetune.classification_examples("1\tabc\n\n0\tde\n", 4, 2)
    assert y.tolist() == [1, 0]
    assert x["token_ids"].tolist() == [[98, 99, 100, 0], [101, 102, 0, 0]]
    assert x["segment_ids"].shape == (2, 4)
    with pytest.raises(ValueError, match="line 1"):
        finetune.classification_examples("no label here\n", 4, 2)
    with pytest.raises(ValueError, match="not in"):
        finetune.classification_examples("2\tabc\n", 4, 2)


def test_settings_need_one_privacy_target():
    with pytest.raises(ValueError, match="exactly one"):
        finetune.FinetuneSettings(text_file=LICENSE, target_epsilon=None)
    with pytest.raises(ValueError, match="lora_rank"):
        finetune.FinetuneSettings(text_file=LICENSE, lora_rank=-1)


def _check_run(results: dict, settings: finetune.FinetuneSettings) -> None:
    config = DPConfig.from_dict(results["config"])
    assert results["steps"] == config.steps_for_epochs(settings.epochs) == config.steps > 0
    assert config.sampling == "poisson"
    privacy = results["privacy"]
    assert "PoissonSampled" in privacy["dp_event"]
    # ε of the steps that ran, recomputed from the stored config by the accountant
    assert privacy["epsilon_pld"] == pytest.approx(config.epsilon("pld"), rel=1e-6)
    if settings.target_epsilon is not None:
        assert privacy["epsilon_pld"] <= settings.target_epsilon * (1 + 1e-6)
    assert np.isfinite(results["train_loss"]).all() and np.isfinite(results["eval_loss"])


@pytest.mark.slow
def test_gpt2_lora_finetune_on_license_text(tmp_path):
    settings = finetune.FinetuneSettings(
        text_file=LICENSE,
        model="gpt2",
        lora_rank=4,
        epochs=0.25,
        batch_size=16,
        target_epsilon=8.0,
        seed=1,
        output_dir=str(tmp_path),
        verbose=0,
        **TINY,
    )
    results = finetune.run_finetune(settings)
    with open(tmp_path / "results.json") as f:
        stored = json.load(f)
    assert stored["privacy"] == json.loads(json.dumps(results["privacy"]))
    _check_run(stored, settings)
    n_bytes = len(open(LICENSE, encoding="utf-8").read().encode())
    assert stored["data"]["bytes"] == n_bytes
    assert stored["data"]["num_train"] + stored["data"]["num_eval"] == -(-(n_bytes - 1) // 32)
    model = stored["model"]
    assert model["task"] == "GPT2CausalLM" and model["source"] == "from scratch"
    assert 0 < model["trainable_params"] < model["total_params"] / 4  # LoRA trains adapters only


@pytest.mark.slow
def test_finetune_from_local_preset_full_and_bert(tmp_path):
    """A preset saved locally is loaded (never downloaded); BERT trains on labelled lines."""
    preset = tmp_path / "preset"
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=300,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=32,
    )
    backbone.save_to_preset(str(preset))
    settings = finetune.FinetuneSettings(
        text_file=LICENSE,
        model="gpt2",
        preset=str(preset),
        lora_rank=0,
        sequence_length=32,
        epochs=0.1,
        batch_size=16,
        noise_multiplier=1.0,
        target_epsilon=None,
        seed=2,
        verbose=0,
    )
    model = finetune.build_model(settings)
    np.testing.assert_array_equal(
        model.backbone.token_embedding.embeddings.numpy(), backbone.token_embedding.embeddings
    )
    results = finetune.run_finetune(settings)
    _check_run(results, settings)
    assert results["model"]["source"].startswith("local preset")
    assert results["model"]["trainable_params"] == results["model"]["total_params"]
    with pytest.raises(FileNotFoundError, match="not a local KerasHub preset"):
        finetune.build_model(settings.__class__(**{**settings.__dict__, "preset": str(tmp_path)}))

    lines = open(LICENSE, encoding="utf-8").read().splitlines()
    labelled = tmp_path / "lines.tsv"  # label: does the line mention "License"?
    labelled.write_text("".join(f"{int('License' in s)}\t{s}\n" for s in lines if s.strip()))
    bert = finetune.FinetuneSettings(
        text_file=str(labelled),
        model="bert",
        epochs=0.1,
        batch_size=16,
        noise_multiplier=1.0,
        target_epsilon=None,
        seed=3,
        verbose=0,
        **TINY,
    )
    results = finetune.run_finetune(bert)
    _check_run(results, bert)
    assert results["model"]["task"] == "BertTextClassifier"
    assert DPConfig.from_dict(results["config"]).noise_multiplier == 1.0
