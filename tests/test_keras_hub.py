"""KerasHub layers and task models on the fast path, against the slow exact reference.

Each case runs eagerly, under ``tf.function`` and under ``tf.function(jit_compile=True)`` (XLA; for
the task models a separate slow test with one layer) with sample weights and a padding example: the
certified norms must bound the reference's per-example squared norms tightly
(``assert_sq_norm_bound``) and the clipped sums must match, and the engine must take the layers'
rules (no per-layer or whole-model fallback). Skipped when ``keras_hub`` (the ``test`` extra) is
not installed.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub is not installed (pip install -e '.[test]' installs it)"
)

import dpcore  # noqa: E402
from dpcore.engine import ghost, graph  # noqa: E402
from dpcore.engine.summary import prepare_batch  # noqa: E402
from dpcore.explain import explain  # noqa: E402
from dpcore.losses import per_example_loss_fn  # noqa: E402
from dpcore.options import ExecutionOptions  # noqa: E402
from dpcore.rules import default_registry  # noqa: E402
from dpcore.rules.keras_hub import replay_cached_attention, replay_transformer_decoder  # noqa: E402
from dpcore.testing import assert_sq_norm_bound, reference_per_example_gradients  # noqa: E402

RTOL = 1e-5
SPARSE_CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
MSE = keras.losses.MeanSquaredError(reduction=None)
H = keras_hub.layers


def _summary(model, loss, x, y, sw, mask, weights, mode, rules=None):
    loss_fn = per_example_loss_fn(loss)
    paths: dict = {}
    y_pred: list = []

    def step(x, y, sw, mask, weights):
        xp, yp, swp, mkp = prepare_batch(x, y, sw, mask)
        s = ghost.fast_summary(
            model,
            loss_fn,
            xp,
            yp,
            swp,
            mkp,
            model.trainable_variables,
            options=ExecutionOptions(training=False, rules=rules),
        )
        paths.update(s.paths)
        return s.sq_norms, s.weighted_sum(weights), s.y_pred

    if mode != "eager":
        step = tf.function(step, jit_compile=(mode == "jit"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a whole-model fallback fails the test
        sq, sums, y_pred = step(x, y, sw, mask, weights)
    return np.asarray(sq), [np.asarray(t) for t in sums], paths, np.asarray(y_pred)


MODES = ("eager", "function", "jit")  # jit: tf.function(jit_compile=True), i.e. XLA
TRACED = ("eager", "function")  # the task models: their XLA compiles are a slow test of their own


def check(
    model, x, y, loss=SPARSE_CE, *, modes=MODES, per_layer_fallback=False, outputs=None, rules=None
):
    """Fast norms and clipped sums == reference, with sample weights and a padding example.

    ``outputs``, a dict, receives the model's output as the fast path computed it, per mode;
    ``rules`` are extra layer rules (``ExecutionOptions(rules=...)``)."""
    b = tf.nest.flatten(x)[0].shape[0]
    sw = np.linspace(0.5, 1.5, b).astype("float32")
    mask = np.ones(b, "float32")
    mask[-1] = 0.0
    ref = reference_per_example_gradients(model, loss, x, y, sample_weight=sw, mask=mask)
    ref_sq = np.stack([np.sum(g.reshape(b, -1) ** 2, axis=1) for g in ref], axis=1)
    assert ref_sq[:-1].min(axis=0).max() > 0, "degenerate case: zero gradients"
    weights = np.random.default_rng(1).uniform(0.1, 1.0, (b, len(ref))).astype("float32")
    ref_sums = [np.tensordot(weights[:, j], g, axes=1) for j, g in enumerate(ref)]
    # Round-off is relative to the overall gradient scale (some attention key biases have an
    # exactly-zero gradient and only round-off noise).
    scale = max(np.abs(w).max() for w in ref_sums)
    for mode in modes:
        sq, sums, paths, y_pred = _summary(model, loss, x, y, sw, mask, weights, mode, rules)
        if outputs is not None:
            outputs[mode] = y_pred
        assert_sq_norm_bound(sq, ref_sq, rtol=RTOL, atol=1e-7 * ref_sq.max(), err_msg=mode)
        for j, (got, want) in enumerate(zip(sums, ref_sums)):
            np.testing.assert_allclose(
                got,
                want,
                rtol=RTOL,
                atol=1e-6 * scale,
                err_msg=f"{mode} {model.trainable_variables[j].path}",
            )
        assert np.all(sq[-1] == 0)
        if not per_layer_fallback:
            assert "fallback:vectorized" not in paths.values(), paths
    return paths


def _ids(rng, b, t, vocab, *, low=1):
    return rng.integers(low, vocab, (b, t)).astype("int32")


def _padding(b, t, rng):
    lengths = rng.integers(t // 2, t + 1, b)
    return (np.arange(t)[None, :] < lengths[:, None]).astype("int32")


# ------------------------------------------------------------------------------------ layers


@pytest.mark.parametrize("normalize_first", [False, True])
def test_transformer_encoder_with_padding_and_attention_masks(normalize_first, rng):
    b, t, d = 4, 6, 8
    x_in = keras.Input((t, d))
    pad_in = keras.Input((t,), dtype="int32")
    att_in = keras.Input((t, t), dtype="int32")
    encoder = H.TransformerEncoder(16, 2, normalize_first=normalize_first, name="enc")
    h = encoder(x_in, padding_mask=pad_in, attention_mask=att_in)
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model([x_in, pad_in, att_in], out)
    att = (rng.uniform(size=(b, t, t)) < 0.8).astype("int32")
    att[:, :, 0] = 1  # every query sees at least one key
    x = [rng.normal(size=(b, t, d)).astype("float32"), _padding(b, t, rng), att]
    paths = check(model, x, rng.integers(0, 3, b))
    assert paths["enc/self_attention_layer/query"] in ("ghost", "materialized")
    assert paths["enc/feedforward_intermediate_dense"] in ("ghost", "materialized")


def test_transformer_decoder_causal_and_cross_attention(rng):
    b, t, s, d = 3, 5, 4, 8
    dec_in, enc_in = keras.Input((t, d)), keras.Input((s, d))
    dec_pad, enc_pad = keras.Input((t,), dtype="int32"), keras.Input((s,), dtype="int32")
    decoder = H.TransformerDecoder(12, 2, name="dec")
    h = decoder(dec_in, enc_in, decoder_padding_mask=dec_pad, encoder_padding_mask=enc_pad)
    model = keras.Model([dec_in, enc_in, dec_pad, enc_pad], keras.layers.Dense(4)(h))
    x = [
        rng.normal(size=(b, t, d)).astype("float32"),
        rng.normal(size=(b, s, d)).astype("float32"),
        _padding(b, t, rng),
        _padding(b, s, rng),
    ]
    y = rng.integers(0, 4, (b, t))
    paths = check(model, x, y)
    assert "dec/cross_attention/query" in paths and "dec/self_attention/value" in paths


def test_transformer_decoder_without_causal_mask_normalize_first(rng):
    b, t, d = 3, 6, 8
    dec_in = keras.Input((t, d))
    decoder = H.TransformerDecoder(8, 2, normalize_first=True, name="dec")
    h = decoder(dec_in, use_causal_mask=False)
    model = keras.Model(dec_in, keras.layers.Dense(2)(h))
    x = rng.normal(size=(b, t, d)).astype("float32")
    check(model, x, rng.normal(size=(b, t, 2)).astype("float32"), MSE)


# KerasHub's cached calls return ``(output, cache)``, but the layers declare a single symbolic
# output, so no Functional model can hold one. These subclasses only declare both outputs (the call
# is KerasHub's own); ``ExecutionOptions(rules=...)`` gives them the built-in rules.


class _CachedDecoder(H.TransformerDecoder):
    def compute_output_spec(self, decoder_sequence, *args, self_attention_cache=None, **kwargs):
        x = keras.KerasTensor(decoder_sequence.shape, decoder_sequence.dtype)
        if self_attention_cache is None:
            return x
        return x, keras.KerasTensor(self_attention_cache.shape, self_attention_cache.dtype)


class _CachedAttention(H.CachedMultiHeadAttention):
    def compute_output_spec(self, query, value, key=None, cache=None, **kwargs):
        kwargs.pop("cache_update_index", None)
        out = super().compute_output_spec(query, value, key, **kwargs)
        return out if cache is None else (out, keras.KerasTensor(cache.shape, cache.dtype))


CACHED_RULES = {
    _CachedDecoder: default_registry()[H.TransformerDecoder],
    _CachedAttention: default_registry()[H.CachedMultiHeadAttention],
}


def _plain_call(layer, args, kwargs):
    """A replay's ``call`` that runs each sub-layer as it is (no recording)."""
    return layer(*args, **kwargs)


def _cache(rng, b, length, heads, key_dim):
    """A key/value cache ``[B, 2, length, heads, key_dim]`` holding earlier steps' projections."""
    return rng.normal(size=(b, 2, length, heads, key_dim)).astype("float32")


def _cached_decoder_model(t, d, heads, length, index):
    """A decoder step over a ``[B, 2, length, heads, d // heads]`` self-attention cache; the output
    is the head's logits and the returned cache, flattened side by side."""
    dec_in, cache_in = keras.Input((t, d)), keras.Input((2, length, heads, d // heads))
    decoder = _CachedDecoder(12, heads, name="dec")
    h, new_cache = decoder(
        dec_in, self_attention_cache=cache_in, self_attention_cache_update_index=index
    )
    out = keras.layers.Concatenate()(
        [keras.layers.Flatten()(keras.layers.Dense(4)(h)), keras.layers.Flatten()(new_cache)]
    )
    return keras.Model([dec_in, cache_in], out), decoder


def _check_replay_outputs(decoder, x, index, want_h, want_cache):
    """The decoder's replay, sub-layers called as they are: the layer's structure and values."""
    kwargs = {"self_attention_cache": x[1], "self_attention_cache_update_index": index}
    got_h, got_cache = replay_transformer_decoder(decoder, (x[0],), kwargs, _plain_call)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_cache, want_cache, rtol=1e-6, atol=1e-6)


def test_transformer_decoder_reading_a_self_attention_cache(rng):
    """``self_attention_cache`` without an update index: the queries attend to the cached keys and
    values (causal from position 0), which come back unchanged; the key and value projections are
    not used."""
    b, t, d, heads, length = 4, 3, 8, 2, 5
    model, decoder = _cached_decoder_model(t, d, heads, length, None)
    x = [rng.normal(size=(b, t, d)).astype("float32"), _cache(rng, b, length, heads, d // heads)]
    y = rng.normal(size=(b, model.output.shape[-1])).astype("float32")
    fast: dict = {}
    paths = check(model, x, y, MSE, modes=TRACED, outputs=fast, rules=CACHED_RULES)
    assert "dec/self_attention/query" in paths and "dec/self_attention/key" not in paths, paths
    want_h, want_cache = decoder(x[0], self_attention_cache=x[1])
    np.testing.assert_array_equal(want_cache, x[1])
    want = np.asarray(model(x))
    for mode, got in fast.items():  # the fast path's model output (the padding row is zeroed)
        np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-6, atol=1e-6, err_msg=mode)
    _check_replay_outputs(decoder, x, None, want_h, want_cache)


def test_transformer_decoder_replay_refuses_one_cache_of_two(rng):
    """With cross-attention, both caches or neither: the replay raises the layer's own error."""
    b, t, s, d = 2, 3, 4, 8
    decoder = H.TransformerDecoder(8, 2, name="dec")
    dec, enc = rng.normal(size=(b, t, d)), rng.normal(size=(b, s, d))
    decoder(dec, enc)  # builds the cross-attention
    kwargs = {
        "self_attention_cache": _cache(rng, b, 5, 2, 4),
        "self_attention_cache_update_index": 0,
    }
    with pytest.raises(ValueError, match="should both be set"):
        decoder(dec, enc, **kwargs)
    with pytest.raises(ValueError, match="should both be set"):
        replay_transformer_decoder(decoder, (dec, enc), kwargs, _plain_call)


def _replay(model, rules):
    """``x -> model(x)`` with every composition replayed by its rule (nothing recorded)."""
    registry = ExecutionOptions(rules=rules).layer_rules()

    def layer_fn(layer, args, kwargs):
        rule = registry.get(type(layer))
        if rule is not None and rule.compose is not None:
            return rule.compose(layer, args, kwargs, layer_fn)
        return layer(*args, **kwargs)

    return lambda x: graph.run(model, x, training=False, layer_fn=layer_fn)


def test_transformer_decoder_cache_update_step_replays_the_layer(rng):
    """A cached decoding step: T new tokens' keys and values written into the cache at an index,
    the queries attending to the cached keys before them. The replay (the decoder's and its
    attention's, nested) must mask, update and return the cache as the layer does.

    TensorFlow has no gradient for the update (``keras.ops.slice_update`` is
    ``XlaDynamicUpdateSlice``), so the model itself cannot be differentiated through the new keys
    and values, nor checked against the reference: this step is inference only."""
    b, t, d, heads, length, index = 4, 3, 8, 2, 7, 2
    model, decoder = _cached_decoder_model(t, d, heads, length, index)
    x = [rng.normal(size=(b, t, d)).astype("float32"), _cache(rng, b, length, heads, d // heads)]
    want_h, want_cache = decoder(
        x[0], self_attention_cache=x[1], self_attention_cache_update_index=index
    )
    want_cache = np.asarray(want_cache)
    assert not np.array_equal(want_cache, x[1])  # the step wrote keys and values ...
    np.testing.assert_array_equal(want_cache[:, :, :index], x[1][:, :, :index])  # ... from index
    want = np.asarray(model(x))
    np.testing.assert_array_equal(want[:, t * 4 :], want_cache.reshape(b, -1))
    for mode in TRACED:
        replay = _replay(model, CACHED_RULES)
        replay = replay if mode == "eager" else tf.function(replay)
        got = np.asarray(replay([tf.constant(v) for v in x]))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=mode)
    _check_replay_outputs(decoder, x, index, want_h, want_cache)
    with pytest.raises(LookupError, match="XlaDynamicUpdateSlice"):
        reference_per_example_gradients(model, MSE, x, np.zeros_like(want))


def test_cached_attention_reading_a_cache_without_update(rng):
    """``cache_update_index=None``: keys and values come from the cache alone, so the key and
    value projections are not used and get no gradient; query and output projections do."""
    b, t, d, heads, length = 4, 3, 8, 2, 5
    q_in, cache_in = keras.Input((t, d)), keras.Input((2, length, heads, 4))
    attention = _CachedAttention(heads, 4, name="att")
    h, _ = attention(q_in, q_in, cache=cache_in)
    model = keras.Model([q_in, cache_in], keras.layers.Dense(3)(h))
    x = [rng.normal(size=(b, t, d)).astype("float32"), _cache(rng, b, length, heads, 4)]
    fast: dict = {}
    paths = check(model, x, rng.integers(0, 3, (b, t)), outputs=fast, rules=CACHED_RULES)
    assert paths["att/query"] in ("ghost", "materialized") and "att/key" not in paths, paths
    want = np.asarray(model(x))
    for mode, got in fast.items():  # the fast path's model output (the padding row is zeroed)
        np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-6, atol=1e-6, err_msg=mode)
    want_h, want_cache = attention(x[0], x[0], cache=x[1])
    got_h, got_cache = replay_cached_attention(
        attention, (x[0], x[0]), {"cache": x[1]}, _plain_call
    )
    np.testing.assert_allclose(got_h, want_h, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got_cache, want_cache)
    np.testing.assert_array_equal(got_cache, x[1])  # read only: the cache comes back unchanged


def _tied_lm(vocab, dim, t, **embedding_kwargs):
    ids = keras.Input((t,), dtype="int32")
    embedding = H.ReversibleEmbedding(vocab, dim, name="tied", **embedding_kwargs)
    h = keras.layers.Dense(dim, activation="tanh")(embedding(ids))
    return keras.Model(ids, embedding(h, reverse=True)), embedding


@pytest.mark.parametrize(
    "vocab,dim,t,path",
    [(40, 4, 10, "materialized"), (40, 8, 6, "ghost"), (200, 32, 3, "ghost")],
)
def test_reversible_embedding_tied_sums_both_uses(vocab, dim, t, path, rng):
    """Lookup and output projection of one table: the norm is that of their sum (cross terms)."""
    model, _ = _tied_lm(vocab, dim, t)
    x = _ids(rng, 4, t, vocab)
    x[0, :2] = 7  # repeated ids: same-row terms of the lookup
    paths = check(model, x, rng.integers(0, vocab, (4, t)))
    assert paths["tied"] == path


@pytest.mark.parametrize("t,path", [(6, "ghost"), (10, "materialized")])
def test_reversible_embedding_tied_extreme_record_is_clipped(t, path, rng):
    """A record with huge logit gradients and one id at every position stays within C."""
    from tests.test_certified_norms import _check_record

    vocab, dim = 40, 8 if path == "ghost" else 4
    model, _ = _tied_lm(vocab, dim, t)
    assert {r.name: r.path for r in explain(model).rows}["tied"] == path
    x = _ids(rng, 3, t, vocab)
    x[0] = 5
    y = rng.normal(size=(3, t, vocab)).astype("float32")
    y[0] = 1e15 * np.where(np.arange(vocab) % 2, 1.0, -1.0)
    _check_record(model, x, y, methods=("fast",))


def test_reversible_embedding_tied_logit_gram_in_pieces(rng, monkeypatch):
    """The logit block's Gram matrix summed over pieces of the vocabulary (16, 16, 8 columns):
    the same norms and sums as the reference, and an extreme record still within C."""
    from dpcore.rules import keras_hub as rules
    from tests.test_certified_norms import _check_record

    monkeypatch.setattr(rules, "_GRAM_COLUMNS", 16)
    vocab, dim, t = 40, 8, 6
    model, _ = _tied_lm(vocab, dim, t)
    x = _ids(rng, 4, t, vocab)
    x[0, :2] = 7
    assert check(model, x, rng.integers(0, vocab, (4, t)))["tied"] == "ghost"
    dl = tf.constant(rng.normal(size=(3, t, vocab)).astype("float32"))
    scale = tf.constant([[[0.5]], [[2.0]], [[1e3]]])
    np.testing.assert_allclose(
        rules._scaled_gram(dl, scale),
        tf.matmul(dl / scale, dl / scale, transpose_b=True),
        rtol=1e-5,
    )
    x = _ids(rng, 3, t, vocab)
    x[0] = 5
    y = rng.normal(size=(3, t, vocab)).astype("float32")
    y[0] = 1e15 * np.where(np.arange(vocab) % 2, 1.0, -1.0)
    _check_record(model, x, y, methods=("fast",))


@pytest.mark.parametrize("vocab,dim,t,path", [(40, 4, 10, "materialized"), (200, 32, 3, "ghost")])
def test_reversible_embedding_tied_in_units_of_rows(vocab, dim, t, path, rng):
    """Units of 3 rows: the tied table's per-unit norm and sum, cross terms between rows too."""
    from dpcore.rules.keras_hub import _tied_path
    from tests.test_groups import UNITS, K, check_units

    assert _tied_path(K * t, K * t, vocab, dim) == path  # a unit: K times the positions
    model, _ = _tied_lm(vocab, dim, t)
    x = _ids(rng, K * UNITS, t, vocab)
    x[:K, :3] = 7  # one id in every row of unit 0
    check_units(model, x, rng.integers(0, vocab, (K * UNITS, t)), methods=("fast",))


def test_reversible_embedding_soft_cap_and_mask_zero(rng):
    t, vocab = 5, 30
    ids = keras.Input((t,), dtype="int32")
    embedding = H.ReversibleEmbedding(vocab, 6, logit_soft_cap=2.0, mask_zero=True, name="emb")
    h = embedding(ids)
    pooled = keras.layers.GlobalAveragePooling1D()(h)  # uses the Keras mask of mask_zero
    model = keras.Model(ids, embedding(pooled, reverse=True))
    x = _ids(rng, 4, t, vocab)
    x[:, 3:] = 0
    check(model, x, rng.integers(0, vocab, 4))


def test_reversible_embedding_untied(rng):
    model, embedding = _tied_lm(25, 6, 4, tie_weights=False)
    assert len(embedding.trainable_variables) == 2
    check(model, _ids(rng, 4, 4, 25), rng.integers(0, 25, (4, 4)))


def test_token_and_position_embedding_with_start_index(rng):
    t, vocab, dim = 5, 20, 6
    ids = keras.Input((t,), dtype="int32")
    h = H.TokenAndPositionEmbedding(vocab, 9, dim, name="tpe")(ids)
    h2 = H.PositionEmbedding(9, name="offset_pos")(h, start_index=2)
    model = keras.Model(ids, keras.layers.Dense(3)(h + h2))
    paths = check(model, _ids(rng, 4, t, vocab), rng.integers(0, 3, (4, t)))
    assert {"tpe/token_embedding", "tpe/position_embedding", "offset_pos"} <= set(paths)


def test_token_and_position_embedding_tied_to_output_projection(rng):
    """The composed embedding's token table and a later reverse call are two uses of one layer."""
    t, vocab = 5, 20
    ids = keras.Input((t,), dtype="int32")
    tpe = H.TokenAndPositionEmbedding(vocab, 9, 6, name="tpe")
    h = H.TransformerDecoder(8, 2, name="dec")(tpe(ids))
    model = keras.Model(ids, tpe.token_embedding(h, reverse=True))
    assert explain(model).whole_model_fallback is None
    paths = check(model, _ids(rng, 4, t, vocab), rng.integers(0, vocab, (4, t)))
    assert "tpe/token_embedding" in paths and "token_embedding" not in paths
    # explain plans the lookup (inside the composition) and the projection together.
    table = next(r for r in explain(model).rows if r.name == "token_embedding")
    assert table.path == paths["tpe/token_embedding"], (table, paths)
    assert table.why.startswith("tied table, lookup and reverse projection"), table
    assert table.why.endswith("also called inside 'tpe' (TokenAndPositionEmbedding)"), table
    # Without the composition the two layers would each claim the table: whole-model fallback.
    registry = {k: v for k, v in default_registry().items() if k is not H.TokenAndPositionEmbedding}
    assert "tied weights" in ghost.fallback_reason(model, registry=registry)


def test_masked_lm_head_untied_output_kernel(rng):
    """Without a token embedding the head owns its output kernel: ``X^T dlogits`` plus the bias."""
    b, t, d, vocab = 4, 6, 8, 30
    h_in, pos_in = keras.Input((t, d)), keras.Input((2,), dtype="int32")
    head = H.MaskedLMHead(vocabulary_size=vocab, intermediate_activation="gelu", name="head")
    model = keras.Model([h_in, pos_in], head(keras.layers.Dense(d)(h_in), mask_positions=pos_in))
    bias = next(v for v in head.weights if v.path.endswith("output_bias"))
    bias.assign(rng.normal(size=vocab).astype("float32"))  # not the zero initial bias
    x = [rng.normal(size=(b, t, d)).astype("float32"), rng.integers(0, t, (b, 2)).astype("int32")]
    paths = check(model, x, _ids(rng, b, 2, vocab))
    assert paths["head"] in ("ghost", "materialized") and "head/intermediate_dense" in paths


# ------------------------------------------------------------------------------- task models


def _task(backbone, task, *, vocab=100, layers=2, hidden=16, seq=8, **task_kwargs):
    backbone = backbone(
        vocabulary_size=vocab,
        num_layers=layers,
        num_heads=2,
        hidden_dim=hidden,
        intermediate_dim=2 * hidden,
        max_sequence_length=seq,
    )
    return task(backbone, preprocessor=None, **task_kwargs)


def _bert(**kwargs):
    models = keras_hub.models
    return _task(models.BertBackbone, models.BertTextClassifier, num_classes=3, **kwargs)


def _gpt2(**kwargs):
    return _task(keras_hub.models.GPT2Backbone, keras_hub.models.GPT2CausalLM, **kwargs)


def _bert_batch(rng, b=4, t=8, vocab=100):
    pad = _padding(b, t, rng)
    return {
        "token_ids": _ids(rng, b, t, vocab) * pad,
        "segment_ids": (np.arange(t)[None] >= t // 2).astype("int32").repeat(b, 0),
        "padding_mask": pad,
    }, rng.integers(0, 3, b)


def _gpt2_batch(rng, b=4, t=8, vocab=100):
    pad = _padding(b, t, rng)
    return {"token_ids": _ids(rng, b, t, vocab) * pad, "padding_mask": pad}, _ids(rng, b, t, vocab)


def test_explain_puts_keras_hub_layers_on_rules():
    for model in (_bert(layers=1), _gpt2(layers=1)):
        report = explain(model)
        assert report.whole_model_fallback is None
        rows = {r.cls: r.path for r in report.rows}
        assert "fallback:vectorized" not in rows.values(), str(report)
        for cls in ("ReversibleEmbedding", "PositionEmbedding"):
            assert rows[cls] == "ghost", str(report)
        assert rows.get("TransformerEncoder", rows.get("TransformerDecoder")) in (
            "ghost",
            "materialized",
        )


def _bert_mlm(**kwargs):
    models = keras_hub.models
    return _task(models.BertBackbone, models.BertMaskedLM, **kwargs)


def _bert_mlm_batch(rng, b=4, t=8, vocab=100, masked=3):
    x, _ = _bert_batch(rng, b, t, vocab)
    lengths = x["padding_mask"].sum(axis=1)
    # Distinct masked positions inside each example's real tokens (a repeat would be legal too).
    x["mask_positions"] = np.stack(
        [rng.permutation(int(n))[:masked] for n in np.maximum(lengths, masked)]
    ).astype("int32")
    return x, _ids(rng, b, masked, vocab)


def test_bert_masked_lm_head_ties_to_the_token_embedding(rng):
    """The head's reverse projection is one more use of the backbone's token table."""
    model = _bert_mlm(layers=1)
    report = explain(model)
    assert report.whole_model_fallback is None, report.whole_model_fallback
    rows = {r.name: r for r in report.rows}
    assert "fallback:vectorized" not in {r.path for r in report.rows}, str(report)
    assert "tied 'token_embedding'" in rows["mlm_head"].why, str(report)
    # The table's row plans both uses (not the lookup alone) and names the head that projects.
    table = rows["token_embedding"]
    assert table.why.startswith("tied table, lookup and reverse projection as one A^T G"), table
    assert table.why.endswith("also called inside 'mlm_head' (MaskedLMHead)"), table
    x, y = _bert_mlm_batch(rng)
    x["mask_positions"][0] = [1, 1, 2]  # a position masked twice: its rows add up
    paths = check(model, x, y, modes=TRACED)
    head = {"mlm_head", "mlm_head/intermediate_dense", "mlm_head/intermediate_layer_norm"}
    assert head <= set(paths) and "token_embedding" in paths, paths
    # The tied table's two uses are summed by one rule: no "mlm_head/token_embedding" row.
    assert not any(k.endswith("/token_embedding") for k in paths), paths
    assert paths["token_embedding"] == table.path, (paths, table)


def test_bert_classifier_matches_reference(rng):
    model = _bert()
    x, y = _bert_batch(rng)
    paths = check(model, x, y, modes=TRACED)
    assert "transformer_layer_1/self_attention_layer/key" in paths


def test_gpt2_causal_lm_matches_reference(rng):
    model = _gpt2()
    x, y = _gpt2_batch(rng)
    paths = check(model, x, y, modes=TRACED)
    assert paths["token_embedding"] in ("ghost", "materialized")


@pytest.mark.slow  # one XLA compile of a whole (one-layer) task model each: ~10-20 s on 2 cores
@pytest.mark.parametrize("task", ["bert_classifier", "gpt2_causal_lm", "bert_masked_lm"])
def test_task_models_under_xla(task, rng):
    make, batch = {
        "bert_classifier": (_bert, _bert_batch),
        "gpt2_causal_lm": (_gpt2, _gpt2_batch),
        "bert_masked_lm": (_bert_mlm, _bert_mlm_batch),
    }[task]
    check(make(layers=1), *batch(rng), modes=("jit",))


def test_bert_with_lora_stays_on_the_fast_path(rng):
    model = _bert(layers=1)
    model.backbone.enable_lora(2)
    names = {v.path for v in model.trainable_variables}
    assert any("lora" in n for n in names)
    report = explain(model)
    assert report.whole_model_fallback is None, report.whole_model_fallback
    x, y = _bert_batch(rng)
    for v in model.trainable_variables:  # LoRA B starts at zero: give the adapters a gradient
        if "lora_kernel_b" in v.path:
            v.assign(rng.normal(size=v.shape).astype("float32") * 0.1)
    # LoRA projections take the EinsumDense rule where it covers LoRA, else their own fallback.
    check(model, x, y, modes=("eager",), per_layer_fallback=True)


def test_gpt2_trains_with_make_private_fit(rng):
    model = _gpt2(layers=1)
    x, y = _gpt2_batch(rng, b=8)
    dp = dpcore.make_private(
        model,
        optimizer=keras.optimizers.SGD(0.01),
        loss=SPARSE_CE,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4,
    )
    before = [np.array(v) for v in model.trainable_variables]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        history = dp.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert any(
        not np.array_equal(a, np.array(v)) for a, v in zip(before, model.trainable_variables)
    )


def test_registry_without_keras_hub_import_has_no_hub_rules():
    registry = default_registry()
    assert H.TransformerEncoder in registry and keras.layers.ReversibleEmbedding in registry
