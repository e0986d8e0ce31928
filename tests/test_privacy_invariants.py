"""Privacy invariants of dpcore, checked as properties over adversarial inputs (issue 7, 5).

dpcore's claim: each noised step releases ``sum_i clip(g_i) + N(0, (σC)^2 I)`` whose sensitivity
is ``C`` under add/remove-one adjacency, and the reported ε is that of the sampling and the steps
that really ran. This suite states that claim as properties and lets ``hypothesis`` search for
inputs that break them. What it proves (for the generated inputs, with σ = 0 to see the pre-noise
sum, C = 1):

1. Sensitivity of the clipped sum. A batch holds benign rows and one crafted record (huge
   1e15..1e30 or tiny 1e-30 magnitudes, positions that nearly cancel (``a``, ``-a``, ..., ``-a +
   δ``), one huge entry, zeros, repeated or random ids, extreme labels). Removing the record
   (mask 0) moves the clipped sum by at most ``C (1 + TOLERANCE)``; for per-group clipping, each
   group's sum by at most ``C_g (1 + TOLERANCE)``. Replacing a record by another is two such
   moves, so the replace-one bound ``2 C (1 + TOLERANCE)`` follows. Checked on
   ``dpcore.summarize`` + ``dpcore.aggregation.clip`` on both the ``fast`` and the ``vectorized``
   method for each built-in rule (the path that ran is pinned with ``dpcore.explain``):
   Dense on 2-D input, Dense on sequences (ghost and materialized), EinsumDense (ghost and
   materialized), Conv1D (ghost, strided), Conv2D (materialized, strided; and groups > 1 on the
   ghost path, fast method only: TensorFlow cannot vectorize a grouped convolution's filter
   gradient on CPU), Embedding (repeated ids), LayerNormalization, GroupNormalization,
   MultiHeadAttention (projections materialized), RMSNormalization,
   LayerNormalization(rms_scaling), a LoRA Dense (ghost), KerasHub's TransformerEncoder and tied
   ReversibleEmbedding; for the per-layer fallback (a custom layer with its own weight in a
   Functional model) and the whole-model fallback (a subclassed ``keras.Model``); per-group
   clipping (a list of bounds with ``variable_groups``). Privacy units of two rows
   (``group_size=2``, ``nonfinite="skip"``) on every case but the grouped convolution: the crafted
   record's unit (its other row benign, its negation, its copy with the label negated, or a second
   crafted record) moves the clipped sum by at most ``C (1 + TOLERANCE)``, no other unit is
   skipped because of it, and a skipped unit adds exactly nothing. Through ``dp_train_step``
   with ``DPOptimizer(accumulation_steps=2)`` (SGD, lr 1, σ = 0, expected batch size 1, so the
   applied update is minus the clipped sum of the logical step): removing the record from either
   micro-batch moves the update by at most ``C (1 + TOLERANCE)``. The same on two replicas of a
   ``MirroredStrategy`` (2 logical CPUs, in a subprocess because logical devices must be set
   before TensorFlow starts).
2. Certified norms. Every norm that decides a clip factor (``GradientSummary.sq_norms`` summed
   per example) is at least the exact per-example gradient norm
   (``dpcore.testing.reference_per_example_gradients``, one example at a time) times
   ``1 - NORM_TOLERANCE``, for every row of every generated batch, on the same paths as 1. The
   reference is float32 too: a row where it is below that only passes if it differs from the
   float64 gradient of the same model by more than a tenth of NORM_TOLERANCE, i.e. where float32
   does not determine the gradient to that precision (a forward pass that cancels); the engine's
   own float32 gradient of such a row is another rounding, and property 1 covers what it adds.
   Keras' own gradient of the row inside the batch must agree with float64 too (a batched float32
   forward pass can round a row differently from the row alone). Inputs whose float32 loss or
   reference gradient is not finite, or whose gradient norm is within 2^8 of float32's maximum,
   are outside the claim (the library refuses them on purpose) and are rejected; a refusal of the
   engine is accepted only when Keras' own backward pass of the same batch is not finite;
   instead, with ``nonfinite="skip"`` a batch holding such a record (labels or inputs that
   overflow the loss) has a finite clipped sum, the record is masked out, and its contribution is
   exactly zero.
3. Noise. The noise on the sum has std ``σ C`` (a noise-only step with lr 1 moves the weights by
   ``σ C / expected_batch_size`` in std), is drawn once per logical step (with
   ``accumulation_steps=3`` the first two micro-steps change nothing and the third applies exactly
   the draw of a single step with the same seed), and fresh at every step (successive draws are
   uncorrelated). Once per global step on two replicas (in the subprocess of 1).
4. Sampling and steps (issue 7, sections 2 and 3), through the public API: data whose sampling
   disagrees with the optimizer's expected batch size or with a privacy callback's ``DPConfig``
   (Poisson q, or shuffled batches under a Poisson config) is refused before the first step;
   over ``fit(epochs=k)`` on the Poisson sampler with overflow chunks (random numbers of chunks
   per pass), the applied ``dp_steps`` equal the sampled steps and no step is left open.

Each Keras model is built once per module and fed through one compiled ``tf.function`` per model
and method (the tests assert it traced once), so the examples cost milliseconds each.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, assume, event, given, reject, settings
from hypothesis import strategies as st

import dpcore
from dpcore import aggregation, sampling
from dpcore.callbacks import EpsilonCallback, PrivacyBudgetGuard
from dpcore.config import DPConfig
from dpcore.testing import reference_per_example_gradients

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")

if "options" in inspect.signature(dpcore.summarize).parameters:
    from dpcore.options import ExecutionOptions
else:  # releases before it: summarize took method= and nonfinite= keywords
    ExecutionOptions = None

# Stated once for the whole suite. A record's own contribution to a clipped sum is within
# C * (1 + dpcore.aggregation.CONTRIBUTION_TOLERANCE) (1e-6); removing it also changes the float32
# batch-level summation of the *other* records' terms (each rounded relative to the running sum,
# up to B of them per coordinate), which a pre-noise difference measures too: 1e-3 covers that.
TOLERANCE = 1e-3
# A certified norm may not be below the exact (float32 reference) norm by more than this.
NORM_TOLERANCE = 1e-5
C = 1.0
B = 4  # rows per batch: three benign rows and the crafted record
MSE = keras.losses.MeanSquaredError(reduction=None)


def _settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


# ------------------------------------------------------------------------------- the crafted record
EXPONENTS = (-30, -19, -10, -3, 0, 1, 3, 6, 10, 15, 20, 30)  # feature magnitudes 10^e
LABEL_EXPONENTS = (-30, -10, 0, 3, 6, 10, 15, 18)  # |label| <= 1e18 keeps a float32 MSE finite
PATTERNS = ("random", "cancel", "spike", "zeros")
ID_PATTERNS = ("repeat", "two", "random")


@st.composite
def records(draw: Any) -> dict[str, Any]:
    """Parameters of one crafted record (small and readable when hypothesis minimizes them)."""
    return {
        "seed": draw(st.integers(0, 2**16)),
        "index": draw(st.integers(0, B - 1)),
        "pattern": draw(st.sampled_from(PATTERNS)),
        "exp": draw(st.sampled_from(EXPONENTS)),
        "delta_exp": draw(st.integers(-9, 0)),  # cancellation: last position off by 10^d |a|
        "ids": draw(st.sampled_from(ID_PATTERNS)),
        "label_exp": draw(st.sampled_from(LABEL_EXPONENTS)),
        "label_sign": draw(st.sampled_from((1.0, -1.0))),
    }


def _crafted_features(shape: tuple[int, ...], rec: dict[str, Any], rng: Any) -> np.ndarray:
    scale = np.float64(10.0) ** rec["exp"]
    if rec["pattern"] == "zeros":
        return np.zeros(shape, "float32")
    if rec["pattern"] == "spike":
        x = np.zeros(int(np.prod(shape)))
        x[rng.integers(0, x.size)] = scale
        return x.reshape(shape).astype("float32")
    if rec["pattern"] == "random":
        return (rng.normal(size=shape) * scale).astype("float32")
    # "cancel": positions a, -a, a, ..., and the last one -(+-a) + delta: sums over positions of
    # a_s . a_t nearly cancel while each term is huge.
    positions = shape[0] if len(shape) == 2 else int(np.prod(shape[:-1]))
    a = rng.normal(size=shape[-1]) * scale
    signs = (-1.0) ** np.arange(positions)
    x = signs[:, None] * a[None, :]
    x[-1] += np.float64(10.0) ** rec["delta_exp"] * scale
    return x.reshape(shape).astype("float32")


def _crafted_ids(shape: tuple[int, ...], vocab: int, rec: dict[str, Any], rng: Any) -> np.ndarray:
    if rec["ids"] == "repeat":
        return np.full(shape, rng.integers(0, vocab), "int32")
    if rec["ids"] == "two":
        return rng.choice(rng.choice(vocab, 2, replace=False), size=shape).astype("int32")
    return rng.integers(0, vocab, shape).astype("int32")


def crafted_batch(feature_shape, rec, *, vocab=None, b=B):
    """``b`` benign rows (N(0,1) features, labels) with the crafted record at ``rec["index"]``."""
    rng = np.random.default_rng(rec["seed"])
    if vocab is None:
        x = rng.normal(size=(b, *feature_shape)).astype("float32")
        x[rec["index"]] = _crafted_features(tuple(feature_shape), rec, rng)
    else:
        x = rng.integers(0, vocab, (b, *feature_shape)).astype("int32")
        x[rec["index"]] = _crafted_ids(tuple(feature_shape), vocab, rec, rng)
    y = rng.normal(size=(b, 1)).astype("float32")
    y[rec["index"]] = rec["label_sign"] * np.float64(10.0) ** rec["label_exp"]
    return x, y


# ------------------------------------------------------------------------------------ model zoo
class Scale(keras.layers.Layer):
    """A layer without a dpcore rule, with a weight of its own: the per-layer fallback."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x):
        return x * self.w


class Subclassed(keras.Model):
    """A subclassed model: its graph cannot be replayed, the whole model falls back."""

    def __init__(self):
        super().__init__(name="subclassed")
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x, training=False):
        return self.out(self.hidden(x))


def _functional(shape, body, dtype="float32"):
    inputs = keras.Input(shape, dtype=dtype)
    h = body(inputs)
    if len(h.shape) > 2:
        h = keras.layers.Flatten()(h)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(h))


def _gap1(h):
    return keras.layers.GlobalAveragePooling1D()(h)


def _lora(inputs):
    """A Dense layer with LoRA enabled (rank 4) after it is built: its base kernel is frozen."""
    dense = keras.layers.Dense(32, name="lora")
    h = dense(inputs)
    dense.enable_lora(4)
    return _gap1(h)


def _keras_hub() -> Any:
    return pytest.importorskip("keras_hub")


def _tied_embedding(ids):
    """A tied ReversibleEmbedding read twice: the lookup and the output projection."""
    emb = _keras_hub().layers.ReversibleEmbedding(7, 4, tie_weights=True, name="rev")
    h = keras.layers.Dense(4, activation="tanh", name="mid")(emb(ids))
    return _gap1(emb(h, reverse=True))


L = keras.layers
# name: (feature shape, vocab (int ids) or None, builder, {layer: path}, methods)
ZOO = {
    "dense_2d": (
        (6,),
        None,
        lambda: _functional((6,), lambda i: L.Dense(4, activation="tanh", name="dense")(i)),
        {"dense": "ghost", "head": "ghost"},
        ("fast", "vectorized"),
    ),
    "dense_seq_ghost": (
        (2, 16),
        None,
        lambda: _functional((2, 16), lambda i: _gap1(L.Dense(16, name="dense")(i))),
        {"dense": "ghost"},
        ("fast", "vectorized"),
    ),
    "dense_seq_materialized": (
        (8, 3),
        None,
        lambda: _functional((8, 3), lambda i: _gap1(L.Dense(2, name="dense")(i))),
        {"dense": "materialized"},
        ("fast", "vectorized"),
    ),
    "einsum_dense": (
        (2, 8),
        None,
        lambda: _functional(
            (2, 8),
            lambda i: L.EinsumDense("btd,dp->btp", (2, 2), bias_axes="p", name="ein_m")(
                L.EinsumDense("btd,dp->btp", (2, 8), name="ein_g")(i)
            ),
        ),
        {"ein_g": "ghost", "ein_m": "materialized"},
        ("fast", "vectorized"),
    ),
    "conv1d": (
        (4, 8),
        None,
        lambda: _functional((4, 8), lambda i: _gap1(L.Conv1D(8, 2, strides=2, name="conv")(i))),
        {"conv": "ghost"},
        ("fast", "vectorized"),
    ),
    "conv2d_strided": (
        (6, 6, 4),
        None,
        lambda: _functional(
            (6, 6, 4),
            lambda i: L.GlobalAveragePooling2D()(L.Conv2D(4, 2, strides=2, name="conv")(i)),
        ),
        {"conv": "materialized"},
        ("fast", "vectorized"),
    ),
    "conv2d_groups": (
        (3, 3, 8),
        None,
        lambda: _functional(
            (3, 3, 8),
            lambda i: L.GlobalAveragePooling2D()(L.Conv2D(16, 2, groups=2, name="conv")(i)),
        ),
        {"conv": "ghost"},
        ("fast",),  # vectorized: TF cannot vectorize grouped Conv2DBackpropFilter on CPU
    ),
    "embedding": (
        (6,),
        5,
        lambda: _functional((6,), lambda i: L.Embedding(5, 3, name="emb")(i), dtype="int32"),
        {"emb": "ghost"},
        ("fast", "vectorized"),
    ),
    "layer_norm": (
        (5, 4),
        None,
        lambda: _functional((5, 4), lambda i: L.LayerNormalization(name="norm")(i)),
        {"norm": "ghost"},
        ("fast", "vectorized"),
    ),
    "group_norm": (
        (3, 4),
        None,
        lambda: _functional((3, 4), lambda i: L.GroupNormalization(groups=2, name="norm")(i)),
        {"norm": "ghost"},
        ("fast", "vectorized"),
    ),
    "attention": (
        (3, 4),
        None,
        lambda: _functional((3, 4), lambda i: L.MultiHeadAttention(2, 2, name="mha")(i, i)),
        {"mha": "materialized"},
        ("fast", "vectorized"),
    ),
    "rms_norm": (
        (5, 4),
        None,
        lambda: _functional((5, 4), lambda i: L.RMSNormalization(name="norm")(i)),
        {"norm": "ghost"},
        ("fast", "vectorized"),
    ),
    "layer_norm_rms": (
        (5, 4),
        None,
        lambda: _functional(
            (5, 4), lambda i: L.LayerNormalization(rms_scaling=True, name="norm")(i)
        ),
        {"norm": "ghost"},
        ("fast", "vectorized"),
    ),
    "lora": (
        (2, 32),
        None,
        lambda: _functional((2, 32), _lora),
        {"lora": "ghost"},
        ("fast", "vectorized"),
    ),
    "hub_transformer_encoder": (
        (3, 4),
        None,
        lambda: _functional((3, 4), lambda i: _keras_hub().layers.TransformerEncoder(8, 2)(i)),
        {"transformer_encoder": "materialized"},
        ("fast", "vectorized"),
    ),
    "hub_tied_embedding": (
        (5,),
        7,
        lambda: _functional((5,), _tied_embedding, dtype="int32"),
        {"rev": "materialized", "mid": "materialized"},
        ("fast", "vectorized"),
    ),
    "layer_fallback": (
        (5,),
        None,
        lambda: _functional((5,), lambda i: Scale(name="scale")(i)),
        {"scale": "fallback:vectorized", "head": "ghost"},
        ("fast", "vectorized"),
    ),
    "whole_model_fallback": (
        (6,),
        None,
        None,  # Subclassed, built below
        {},
        ("fast", "vectorized"),
    ),
}


@dataclass
class Case:
    """A model built once, with one compiled clipped-sum function per method."""

    name: str
    model: Any
    feature_shape: tuple[int, ...]
    vocab: int | None
    methods: tuple[str, ...]
    fns: dict[str, Any] = field(default_factory=dict)
    traces: dict[str, int] = field(default_factory=dict)
    model64: Any = None  # the same model in float64, for the reference's accuracy


_CASES: dict[str, Case] = {}


def _build(name: str, check_paths: bool = True) -> Any:
    shape, vocab, builder, paths, _ = ZOO[name]
    keras.utils.set_random_seed(0)
    if builder is None:
        model = Subclassed()
        model(np.zeros((1, *shape), keras.config.dtype_policy().variable_dtype))
        assert dpcore.explain(model).whole_model_fallback
        return model
    model = builder()
    if not check_paths:
        return model
    got = dpcore.explain(model).paths()
    for layer, path in paths.items():
        assert got[layer] == path, (name, got)
    return model


def _summarize(model, x, y, mask, *, method: str, nonfinite: str, group_size: int = 1):
    if ExecutionOptions is None:  # releases before ExecutionOptions (the suite runs on them too)
        if group_size != 1:
            pytest.skip("this release has no privacy units (ExecutionOptions(group_size=...))")
        return dpcore.summarize(model, MSE, x, y, mask=mask, method=method, nonfinite=nonfinite)
    options = ExecutionOptions(method=method, nonfinite=nonfinite, group_size=group_size)
    return dpcore.summarize(model, MSE, x, y, mask=mask, options=options)


def _key(method: str, nonfinite: str = "raise", bounds=None, group_size: int = 1) -> str:
    return f"{method}/{nonfinite}/{bounds}/{group_size}"


def _compile(
    case: Case, method: str, nonfinite: str = "raise", bounds=None, groups=None, group_size=1
):
    model = case.model
    key = _key(method, nonfinite, bounds, group_size)

    @tf.function
    def run(x, y, mask):
        case.traces[key] = case.traces.get(key, 0) + 1
        s = _summarize(model, x, y, mask, method=method, nonfinite=nonfinite, group_size=group_size)
        clipped = aggregation.clip(
            s, l2_norm_clip=C if bounds is None else bounds, variable_groups=groups
        )
        return list(clipped.grads), s.sq_norms, s.mask

    return run


def case(name: str) -> Case:
    if name not in _CASES:
        shape, vocab, _, _, methods = ZOO[name]
        _CASES[name] = Case(name, _build(name), shape, vocab, methods)
    return _CASES[name]


def clipped_sum(c: Case, method: str, x, y, mask, **kw):
    """(list of per-variable sums as float64 arrays, sq_norms [units, V], kept mask [units])."""
    key = _key(method, kw.get("nonfinite", "raise"), kw.get("bounds"), kw.get("group_size", 1))
    if key not in c.fns:
        c.fns[key] = _compile(c, method, **kw)
    grads, sq, kept = c.fns[key](tf.constant(x), tf.constant(y), tf.constant(mask, tf.float32))
    return [g.numpy().astype(np.float64) for g in grads], sq.numpy(), kept.numpy()


def _flat(grads) -> np.ndarray:
    return np.concatenate([g.ravel() for g in grads])


def reference_sq_norms(model, x, y):
    """``[B]`` float64 squared norms of the per-example gradients of the float32 reference (one
    example at a time) and ``[B]`` float32 losses."""
    grads = reference_per_example_gradients(model, MSE, x, y)
    sq = sum(np.sum(np.asarray(g, np.float64).reshape(len(x), -1) ** 2, axis=1) for g in grads)
    losses = np.asarray(MSE(y, model(x)), np.float32)
    return sq, losses


def float64_sq_norms(c: Case, x, y) -> np.ndarray:
    """``[B]`` squared gradient norms of the same model, weights and inputs, in float64."""
    if c.model64 is None:
        keras.utils.set_random_seed(0)
        with _policy("float64"):
            c.model64 = _build(c.name, check_paths=False)
    for v64, v in zip(c.model64.weights, c.model.weights):
        v64.assign(np.asarray(v.numpy(), v64.dtype))
    x64 = x if c.vocab is not None else x.astype(np.float64)
    loss = keras.losses.MeanSquaredError(reduction=None, dtype="float64")
    grads = reference_per_example_gradients(c.model64, loss, x64, y.astype(np.float64))
    return sum(np.sum(np.asarray(g, np.float64).reshape(len(x), -1) ** 2, axis=1) for g in grads)


class _policy:
    """Builds layers in another dtype (restores the global policy on exit)."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.saved = keras.config.dtype_policy()
        keras.config.set_dtype_policy(self.name)

    def __exit__(self, *exc):
        keras.config.set_dtype_policy(self.saved)


def _removal(mask_index: int, b: int = B) -> tuple[np.ndarray, np.ndarray]:
    full = np.ones(b, "float32")
    less = full.copy()
    less[mask_index] = 0.0
    return full, less


def in_batch_sq_norms(model, x, y) -> np.ndarray:
    """``[B]`` float64 squared norms of each example's float32 gradient, its backward pass run
    inside the batch (NaN or Inf where that gradient is not finite).

    A float32 forward pass over ``B`` rows can round differently from the same row alone (e.g.
    the batched matmuls of attention or of a head), and the engine's rounding is the batch's.
    """
    sq = np.zeros(len(x))
    for i in range(len(x)):  # one tape each: a persistent tape rounded one record finite
        with tf.GradientTape() as tape:
            loss = MSE(y, model(x))[i]
        grads = tape.gradient(loss, model.trainable_variables)
        sq[i] = sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads if g is not None)
    return sq


REFUSED = "the loss or the gradient of an example is NaN/Inf"


def check_sensitivity_and_norms(c: Case, rec: dict[str, Any]) -> None:
    x, y = crafted_batch(c.feature_shape, rec, vocab=c.vocab)
    ref_sq, losses = reference_sq_norms(c.model, x, y)
    # Outside the claim: a float32 loss or gradient that overflows (the library refuses it), and
    # a gradient whose norm is within 2^8 of float32's maximum, where another float32 association
    # of the same products may overflow (LoRA's (a A)^T g against Keras' A^T (a^T g)).
    assume(np.all(np.isfinite(losses)) and np.all(ref_sq <= 2.0**240))
    exact = np.sqrt(ref_sq)
    full_mask, less_mask = _removal(rec["index"])
    for method in c.methods:
        try:
            full, sq, kept = clipped_sum(c, method, x, y, full_mask)
        except tf.errors.InvalidArgumentError as e:
            # The same overflow, seen only inside the batch: the refusal must have that cause.
            assert REFUSED in str(e), e
            assert not np.all(np.isfinite(in_batch_sq_norms(c.model, x, y))), (method, str(e)[:200])
            event("refused: a gradient that overflows within the batch only")
            reject()
        less, _, _ = clipped_sum(c, method, x, y, less_mask)
        assert kept.tolist() == full_mask.tolist(), method
        moved = float(np.linalg.norm(_flat(full) - _flat(less)))
        assert np.isfinite(moved), (method, moved)
        assert moved <= C * (1 + TOLERANCE), (method, moved)
        assert c.traces[_key(method)] == 1, c.traces  # every example reused one trace
        bound = np.sqrt(sq.sum(axis=1))
        below = bound < exact * (1 - NORM_TOLERANCE)
        if below.any():
            # The reference is itself float32. Where it, or Keras' own gradient of the same row
            # inside the batch, differs from the float64 gradient of the same model by more than
            # a tenth of NORM_TOLERANCE, float32 does not determine the example's gradient to that
            # precision (e.g. an output that cancels against its label): the engine's float32
            # gradient (whose norm its bound certifies) and the reference's are different
            # roundings, and only the sensitivity property speaks about such a row.
            exact64 = np.sqrt(float64_sq_norms(c, x, y))
            in_batch = np.sqrt(in_batch_sq_norms(c.model, x, y))
            determined = (np.abs(exact - exact64) <= 0.1 * NORM_TOLERANCE * exact64) & (
                np.abs(in_batch - exact64) <= 0.1 * NORM_TOLERANCE * exact64
            )
            event("a bound below a float32 reference not determined to NORM_TOLERANCE")
            assert not np.any(below & determined), (method, bound, exact, exact64)


# -------------------------------------------------------------- 1 + 2. sensitivity and norms
RULE_CASES = [n for n in ZOO if n not in ("layer_fallback", "whole_model_fallback")]


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")  # layer_norm_rms: deprecated
@pytest.mark.parametrize("name", [n for n in RULE_CASES if n != "conv2d_groups"])
@_settings(max_examples=25)
@given(rec=records())
def test_built_in_rules_clip_every_record(name, rec):
    check_sensitivity_and_norms(case(name), rec)


def test_a_gradient_that_overflows_only_within_the_batch_is_refused_skipped_or_clipped():
    """Attention's query and key kernels: this record's gradient is finite alone but NaN in the
    batch's own backward pass. A path that reads that backward pass (the fast path, always;
    ``vectorized_map``) refuses the step under ``nonfinite="raise"``, and ``"skip"`` drops the
    record; then removing it moves nothing, and the other rows keep their clipped gradients. A
    path that computes the record alone (the per-example loop the vectorized path takes on CPU
    where vectorizing would build a product oneDNN mishandles) sees its finite gradient: it must
    clip it, so that removing the record moves the sum by at most C."""
    c = case("attention")
    rec = {
        "seed": 0, "index": 0, "pattern": "random", "exp": 15, "delta_exp": 0,
        "ids": "random", "label_exp": -30, "label_sign": 1.0,
    }  # fmt: skip
    x, y = crafted_batch(c.feature_shape, rec, vocab=c.vocab)
    ref_sq, losses = reference_sq_norms(c.model, x, y)
    assert np.all(np.isfinite(losses)) and np.all(np.isfinite(ref_sq))
    assert not np.all(np.isfinite(in_batch_sq_norms(c.model, x, y)))
    full_mask, less_mask = _removal(rec["index"])
    refused = []
    for method in c.methods:
        try:
            clipped = clipped_sum(c, method, x, y, full_mask)
        except tf.errors.InvalidArgumentError as e:
            assert REFUSED in str(e), (method, str(e)[:200])
            refused.append(method)
        else:
            full, sq, kept = clipped
            less, _, _ = clipped_sum(c, method, x, y, less_mask)
            assert kept.tolist() == full_mask.tolist(), method
            assert np.all(np.isfinite(sq)), method
            moved = float(np.linalg.norm(_flat(full) - _flat(less)))
            assert moved <= C * (1 + TOLERANCE), (method, moved)
            continue
        full, sq, kept = clipped_sum(c, method, x, y, full_mask, nonfinite="skip")
        less, _, _ = clipped_sum(c, method, x, y, less_mask, nonfinite="skip")
        assert kept.tolist() == [0.0, 1.0, 1.0, 1.0], method
        assert np.all(np.isfinite(_flat(full))), method
        np.testing.assert_array_equal(_flat(full), _flat(less))  # the skipped record adds nothing
        assert np.all(np.isfinite(sq[1:])), method
    assert "fast" in refused, refused  # the fast path reads the batch's own backward pass


@pytest.mark.slow
@_settings(max_examples=8)
@given(rec=records())
def test_grouped_conv_clips_every_record(rec):
    """Fewer examples: Keras runs a grouped convolution through a tf.function it re-creates on
    every eager call, so the one-example-at-a-time reference retraces each time."""
    check_sensitivity_and_norms(case("conv2d_groups"), rec)


@pytest.mark.filterwarnings("ignore:dpcore. model 'subclassed' takes the vectorized path")
@pytest.mark.parametrize("name", ["layer_fallback", "whole_model_fallback"])
@_settings(max_examples=25)
@given(rec=records())
def test_fallbacks_clip_every_record(name, rec):
    check_sensitivity_and_norms(case(name), rec)


UNIT_ROWS = 2  # privacy units of two rows: B units, the crafted record and a partner in one
PARTNERS = ("benign", "negate", "copy", "crafted")


@st.composite
def unit_records(draw: Any) -> dict[str, Any]:
    """A crafted record at any of the ``B * UNIT_ROWS`` rows, and what its unit's other row is:
    benign, its negation (same label: the unit's gradients cancel), its copy with the label
    negated, or a second crafted record of another magnitude."""
    rec = draw(records())
    rec["index"] = draw(st.integers(0, B * UNIT_ROWS - 1))
    rec["partner"] = draw(st.sampled_from(PARTNERS))
    rec["partner_exp"] = draw(st.sampled_from(EXPONENTS))
    return rec


def check_units(c: Case, rec: dict[str, Any]) -> None:
    rows = B * UNIT_ROWS
    x, y = crafted_batch(c.feature_shape, rec, vocab=c.vocab, b=rows)
    i = rec["index"]
    j = i + 1 if i % UNIT_ROWS == 0 else i - 1  # the other row of its unit
    if rec["partner"] == "negate" and c.vocab is None:
        x[j], y[j] = -x[i], y[i]
    elif rec["partner"] == "copy":
        x[j], y[j] = x[i], -y[i]
    elif rec["partner"] == "crafted":
        other = dict(rec, seed=rec["seed"] + 1, index=j, exp=rec["partner_exp"])
        x2, y2 = crafted_batch(c.feature_shape, other, vocab=c.vocab, b=rows)
        x[j], y[j] = x2[j], y2[j]
    unit = i // UNIT_ROWS
    full = np.ones(rows, "float32")
    less = full.copy()
    less[unit * UNIT_ROWS : (unit + 1) * UNIT_ROWS] = 0.0
    for method in c.methods:
        kw = {"nonfinite": "skip", "group_size": UNIT_ROWS}
        with_unit, _, kept = clipped_sum(c, method, x, y, full, **kw)
        without, _, _ = clipped_sum(c, method, x, y, less, **kw)
        # The benign units are kept whatever the crafted one holds (skipping is per unit).
        assert np.delete(kept, unit).tolist() == [1.0] * (B - 1), (method, kept)
        moved = float(np.linalg.norm(_flat(with_unit) - _flat(without)))
        assert np.isfinite(moved), (method, moved)
        assert moved <= C * (1 + TOLERANCE), (method, rec, moved)
        if not kept[unit]:
            assert moved == 0.0, (method, moved)  # a skipped unit adds exactly nothing
        assert c.traces[_key(method, "skip", None, UNIT_ROWS)] == 1, c.traces


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
@pytest.mark.filterwarnings("ignore:dpcore. model 'subclassed' takes the vectorized path")
@pytest.mark.parametrize("name", [n for n in ZOO if n != "conv2d_groups"])
@_settings(max_examples=12)
@given(rec=unit_records())
def test_units_of_crafted_rows_contribute_at_most_c(name, rec):
    """Privacy units of two rows (``group_size=2``), with ``nonfinite="skip"``: removing the unit
    that holds a crafted record (and a benign, cancelling, copied or second crafted row) moves the
    clipped sum by at most C, the other units are never skipped because of it, and a skipped
    unit adds exactly nothing."""
    check_units(case(name), rec)


GROUP_BOUNDS = [0.5, 2.0]


@_settings(max_examples=25)
@given(rec=records())
def test_per_group_clipping_bounds_each_group(rec):
    c = case("dense_seq_ghost")
    x, y = crafted_batch(c.feature_shape, rec)
    _, losses = reference_sq_norms(c.model, x, y)
    assume(np.all(np.isfinite(losses)))
    groups = [0, 0, 1, 1]  # the sequence Dense's kernel and bias, then the head's
    assert len(groups) == len(c.model.trainable_variables)
    full_mask, less_mask = _removal(rec["index"])
    for method in c.methods:
        kw = {"bounds": GROUP_BOUNDS, "groups": groups}
        full, _, _ = clipped_sum(c, method, x, y, full_mask, **kw)
        less, _, _ = clipped_sum(c, method, x, y, less_mask, **kw)
        moved = {}
        for g, bound in enumerate(GROUP_BOUNDS):
            idx = [v for v, grp in enumerate(groups) if grp == g]
            moved[g] = float(np.linalg.norm(_flat([full[v] - less[v] for v in idx])))
            assert moved[g] <= bound * (1 + TOLERANCE), (method, g, moved)
        total = math.sqrt(sum(m * m for m in moved.values()))
        assert total <= math.sqrt(sum(b * b for b in GROUP_BOUNDS)) * (1 + TOLERANCE)


OVERFLOW = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**16),
        "index": st.integers(0, B - 1),
        "pattern": st.sampled_from(("random", "cancel", "spike", "zeros")),
        # features that keep the prediction far below the label (or overflow it themselves)
        "exp": st.sampled_from((-30, 0, 10, 30)),
        "delta_exp": st.integers(-9, 0),
        "ids": st.just("random"),
        "label_exp": st.sampled_from((20, 25, 30)),  # the squared error overflows float32
        "label_sign": st.sampled_from((1.0, -1.0)),
    }
)


@_settings(max_examples=15)
@given(rec=OVERFLOW)
def test_overflowing_records_are_skipped_with_zero_contribution(rec):
    """nonfinite='skip': the record is dropped (mask 0), the sum stays finite, and it contributes
    exactly nothing (the sum equals the sum without it)."""
    c = case("dense_seq_ghost")
    x, y = crafted_batch(c.feature_shape, rec)
    _, losses = reference_sq_norms(c.model, x, y)
    assert not np.isfinite(losses[rec["index"]])
    full_mask, less_mask = _removal(rec["index"])
    for method in c.methods:
        full, sq, kept = clipped_sum(c, method, x, y, full_mask, nonfinite="skip")
        less, _, _ = clipped_sum(c, method, x, y, less_mask, nonfinite="skip")
        assert kept.tolist() == less_mask.tolist(), method
        assert np.all(np.isfinite(_flat(full))) and np.all(sq[rec["index"]] == 0), method
        np.testing.assert_array_equal(_flat(full), _flat(less), err_msg=method)


# ------------------------------------------------------------------ accumulation, one process
class _StepRunner:
    """dp_train_step with DPOptimizer(SGD(1), σ=0, expected_batch_size=1, accumulation_steps=2),
    compiled once: the update of a logical step is minus its clipped sum."""

    def __init__(self):
        self.case = case("dense_seq_ghost")
        model = self.case.model
        self.opt = dpcore.DPOptimizer(
            keras.optimizers.SGD(1.0),
            l2_norm_clip=C,
            noise_multiplier=0.0,
            expected_batch_size=1,
            accumulation_steps=2,
            seed=0,
        )
        self.opt.build(model.trainable_variables)
        self.start = [v.numpy() for v in model.trainable_variables]
        self.traces = 0

        @tf.function
        def step(x, y, mask):
            self.traces += 1
            return dpcore.dp_train_step(model, MSE, x, y, optimizer=self.opt, mask=mask)

        self.step = step

    def update(self, micro_batches) -> np.ndarray:
        model = self.case.model
        if int(self.opt.micro_steps):  # a previous example failed inside a logical step:
            empty = np.zeros((B, *self.case.feature_shape), "float32")  # end it (reset below)
            self.step(tf.constant(empty), tf.zeros([B, 1]), tf.zeros([B]))
        for v, s in zip(model.trainable_variables, self.start):
            v.assign(s)
        for x, y, mask in micro_batches:
            self.step(tf.constant(x), tf.constant(y), tf.constant(mask))
        assert int(self.opt.micro_steps) == 0
        return np.concatenate(
            [
                v.numpy().astype(np.float64).ravel() - s.astype(np.float64).ravel()
                for v, s in zip(model.trainable_variables, self.start)
            ]
        )


_RUNNER: list[_StepRunner] = []


@_settings(max_examples=20)
@given(rec=records(), second=st.booleans())
def test_accumulated_logical_step_moves_by_at_most_c(rec, second):
    """Two micro-batches of one logical step; the record in the first or the second."""
    if not _RUNNER:
        _RUNNER.append(_StepRunner())
    runner = _RUNNER[0]
    c = runner.case
    x, y = crafted_batch(c.feature_shape, rec)
    _, losses = reference_sq_norms(c.model, x, y)
    assume(np.all(np.isfinite(losses)))
    other_x, other_y = crafted_batch(c.feature_shape, {**rec, "pattern": "random", "exp": 0})
    full_mask, less_mask = _removal(rec["index"])
    benign = (other_x, other_y, np.ones(B, "float32"))
    if second:
        with_it = runner.update([benign, (x, y, full_mask)])
        without = runner.update([benign, (x, y, less_mask)])
    else:
        with_it = runner.update([(x, y, full_mask), benign])
        without = runner.update([(x, y, less_mask), benign])
    moved = float(np.linalg.norm(with_it - without))
    assert moved <= C * (1 + TOLERANCE), moved
    assert runner.traces == 1


# --------------------------------------------------------------------- the multi-replica path
_REPLICA_SCRIPT = r"""
import math, os, sys, traceback
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import numpy as np
from hypothesis import given, strategies as st
sys.path.insert(0, sys.argv[1])
import test_privacy_invariants as suite
import dpcore

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
keras.utils.set_random_seed(0)
with strategy.scope():
    model = suite.ZOO["dense_seq_ghost"][2]()
    opt = dpcore.DPOptimizer(keras.optimizers.SGD(1.0), l2_norm_clip=suite.C,
                             noise_multiplier=0.0, expected_batch_size=1, seed=0)
    opt.build(model.trainable_variables)
start = [v.numpy() for v in model.trainable_variables]
traces = []


def per_replica(t):
    half = t.shape[0] // 2
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: t[half * ctx.replica_id_in_sync_group : half * (ctx.replica_id_in_sync_group + 1)]
    )


def updater(model, opt, loss):
    @tf.function
    def step(x, y, m):
        traces.append(1)
        strategy.run(
            lambda a, b, c: dpcore.dp_train_step(model, loss, a, b, optimizer=opt, mask=c),
            args=(x, y, m),
        )

    def update(x, y, mask, start):
        for v, s in zip(model.trainable_variables, start):
            v.assign(s)
        step(*(per_replica(tf.constant(t)) for t in (x, y, mask)))
        return np.concatenate([(v.numpy().astype(np.float64) - s).ravel()
                               for v, s in zip(model.trainable_variables, start)])
    return update


update = updater(model, opt, suite.MSE)
examples = []


@suite._settings(max_examples=int(sys.argv[2]))
@given(rec=suite.records())
def prop(rec):
    x, y = suite.crafted_batch(suite.ZOO["dense_seq_ghost"][0], rec)
    _, losses = suite.reference_sq_norms(model, x, y)
    suite.assume(np.all(np.isfinite(losses)))
    full, less = suite._removal(rec["index"])
    moved = float(np.linalg.norm(update(x, y, full, start) - update(x, y, less, start)))
    examples.append(moved)
    assert moved <= suite.C * (1 + suite.TOLERANCE), moved
    # every replica holds the same weights (one all-reduced update)
    for v in model.trainable_variables:
        vals = [t.numpy() for t in v.value.values]
        assert all(np.array_equal(vals[0], t) for t in vals[1:])


try:
    prop()
    print("SENSITIVITY", "ok", len(examples), max(examples), len(traces), int(opt.dp_steps.numpy()))
except Exception:
    print("SENSITIVITY", "failed")
    traceback.print_exc()

# Noise once per global step: a noise-only step (all rows masked) moves the weights by
# sigma * C / expected_batch_size in std, not sqrt(2) times that.
with strategy.scope():
    wide = keras.Sequential([keras.Input((200,)), keras.layers.Dense(20)])
    noisy = dpcore.DPOptimizer(keras.optimizers.SGD(1.0), l2_norm_clip=0.5,
                               noise_multiplier=1.5, expected_batch_size=3, seed=1)
    noisy.build(wide.trainable_variables)
w0 = [v.numpy() for v in wide.trainable_variables]
loss = keras.losses.MeanSquaredError(reduction=None)
traces.clear()
delta = updater(wide, noisy, loss)(np.ones((4, 200), "float32"), np.zeros((4, 20), "float32"),
                                   np.zeros(4, "float32"), w0)
print("NOISE", float(delta.std()), delta.size, int(noisy.dp_steps.numpy()))
"""


@pytest.mark.slow
@pytest.mark.replica_script(_REPLICA_SCRIPT, str(Path(__file__).resolve().parent), "12")
def test_two_replicas_clip_every_record_and_noise_once(replica_run):
    stdout, error = replica_run["stdout"], replica_run["error"]
    lines = {ln.split()[0]: ln.split()[1:] for ln in stdout.splitlines() if ln.strip()}
    assert "SENSITIVITY" in lines, stdout[-3000:] + error[-3000:]
    result = lines["SENSITIVITY"]
    assert result[0] == "ok", stdout[-3000:] + error[-3000:]
    examples, worst, traces, steps = (
        int(result[1]),
        float(result[2]),
        int(result[3]),
        int(result[4]),
    )
    assert examples >= 6 and worst <= C * (1 + TOLERANCE)
    assert traces == 1 and steps == 2 * examples
    std, n, noise_steps = float(lines["NOISE"][0]), int(lines["NOISE"][1]), int(lines["NOISE"][2])
    target = 1.5 * 0.5 / 3
    assert abs(std - target) < 4 * target / math.sqrt(2 * n)
    assert noise_steps == 1


# ------------------------------------------------------------------------------------- 3. noise
NOISE_C, NOISE_EBS, NOISE_K = 0.7, 5.0, 3


class _NoiseRunner:
    """Noise-only steps (every row masked) on a 4020-weight layer, SGD lr 1: the update is minus
    the noise over the expected batch size. One optimizer with accumulation, one without."""

    def __init__(self):
        keras.utils.set_random_seed(0)
        self.models = [
            keras.Sequential([keras.Input((200,)), keras.layers.Dense(20)]) for _ in range(2)
        ]
        self.opts = [
            dpcore.DPOptimizer(
                keras.optimizers.SGD(1.0),
                l2_norm_clip=NOISE_C,
                noise_multiplier=1.0,
                expected_batch_size=NOISE_EBS,
                accumulation_steps=k,
                seed=0,
            )
            for k in (NOISE_K, 1)
        ]
        self.steps = []
        for model, opt in zip(self.models, self.opts):
            opt.build(model.trainable_variables)

            def make(model=model, opt=opt):
                @tf.function
                def step():
                    x = tf.ones([4, 200])
                    return dpcore.dp_train_step(
                        model, MSE, x, tf.zeros([4, 20]), optimizer=opt, mask=tf.zeros([4])
                    )

                return step

            self.steps.append(make())

    def delta(self, which: int) -> np.ndarray:
        model = self.models[which]
        before = [v.numpy() for v in model.trainable_variables]
        self.steps[which]()
        return np.concatenate(
            [(b - v.numpy()).ravel() for b, v in zip(before, model.trainable_variables)]
        )


_NOISE: list[_NoiseRunner] = []


@_settings(max_examples=8)
@given(
    sigma=st.sampled_from((0.5, 1.0, 2.3)),
    seed=st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1)),
)
def test_noise_is_sigma_c_fresh_every_step_and_once_per_logical_step(sigma, seed):
    if not _NOISE:
        _NOISE.append(_NoiseRunner())
    r = _NOISE[0]
    for opt in r.opts:  # the same noise state: seed and step counter
        opt.noise_multiplier = sigma
        opt.noise_seed.assign(seed)
        opt.dp_steps.assign(0)
    for v1, v0 in zip(r.models[1].trainable_variables, r.models[0].trainable_variables):
        v1.assign(v0)  # the same weights: the same rounding of the same update
    micro = [r.delta(0) for _ in range(NOISE_K)]
    assert not micro[0].any() and not micro[1].any()  # nothing applied inside a logical step
    assert int(r.opts[0].dp_steps) == 1
    single = r.delta(1)
    np.testing.assert_array_equal(micro[-1], single)  # k micro-steps draw one step's noise
    target = sigma * NOISE_C / NOISE_EBS
    n = single.size
    assert abs(single.std() - target) < 4.5 * target / math.sqrt(2 * n)
    assert abs(single.mean()) < 4.5 * target / math.sqrt(n)
    following = r.delta(1)  # the next step draws fresh noise
    assert abs(np.corrcoef(single, following)[0, 1]) < 4.5 / math.sqrt(n)


# --------------------------------------------------------------- 4. sampling and step counting
N = 40
_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 5)).astype("float32"), rng.integers(0, 3, N).astype("int32")


def _private(expected_batch_size: float, noise_multiplier: float = 0.0):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    return dpcore.make_private(
        model,
        optimizer=keras.optimizers.SGD(0.1),
        loss=_LOSS,
        l2_norm_clip=0.5,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        seed=0,
    )


QS = (0.1, 0.25, 0.5)


@_settings(max_examples=10)
@given(
    q_data=st.sampled_from(QS),
    q_config=st.sampled_from(QS),
    shuffled=st.booleans(),
    check=st.sampled_from(("optimizer", "epsilon", "guard")),
)
def test_sampling_mismatch_is_refused_before_the_first_step(q_data, q_config, shuffled, check):
    """Data sampled otherwise than the optimizer normalizes for or the accountant accounts for is
    refused before any step is applied."""
    x, y = _data()
    config = DPConfig(
        l2_norm_clip=0.5,
        noise_multiplier=1.0,
        expected_batch_size=q_config * N,
        num_examples=N,
        steps=100,
        target_delta=1e-3,
    )
    if shuffled:
        ds = sampling.shuffled_batches(x, y, batch_size=int(q_data * N), epochs=1, seed=0)
    else:
        ds = sampling.poisson_batches(x, y, sampling_prob=q_data, steps=2, seed=0)
    assume(shuffled or q_data != q_config)
    if check == "optimizer":
        assume(q_data != q_config)  # the optimizer sees only the expected batch size
        dp, callbacks = _private(q_config * N), []
    else:
        dp = _private(q_data * N, noise_multiplier=1.0)  # normalizes what the data samples
        if check == "epsilon":
            callbacks = [EpsilonCallback(config)]
        else:
            callbacks = [PrivacyBudgetGuard(target_epsilon=50.0, config=config)]
    with pytest.raises(ValueError, match="expected|sampling"):
        dp.fit(ds, verbose=0, callbacks=callbacks)
    assert int(dp.optimizer.dp_steps) == 0 and int(dp.optimizer.micro_steps) == 0
    assert all(np.all(v.numpy() == 0) for v in dp.optimizer._accumulators)


_FIT: list[Any] = []


@pytest.mark.slow
@_settings(max_examples=6)
@given(
    seed=st.integers(0, 1000),
    steps=st.integers(3, 5),  # several steps of 2 to 5 chunks: passes of different lengths
    epochs=st.integers(2, 3),
    start_step=st.integers(0, 5),
)
def test_fit_applies_exactly_the_sampled_steps(seed, steps, epochs, start_step):
    """Poisson sampler with P = 6 for an expected 20 rows per step (2 to 5 chunks per step, a
    different number per pass): fit(epochs=k) applies steps * k logical steps, none left open.
    The model is shared across examples, so the fitted sampler starts at its dp_steps (a
    fixed-seed sampler must: another start would replay an earlier sampler's steps)."""
    x, y = _data()

    def sampler(start):
        return sampling.poisson_batches(
            x,
            y,
            sampling_prob=0.5,
            steps=steps,
            padded_batch_size=6,
            seed=seed,
            start_step=start,
        )

    passes = [list(sampler(start_step).as_numpy_iterator())]
    ends = [int(sum(bool(e[3]) for e in p)) for p in passes]
    assert ends == [steps]  # a pass holds exactly `steps` logical steps, ending on a boundary
    if not _FIT:
        _FIT.append(_private(20.0))
    dp = _FIT[0]
    before = int(dp.optimizer.dp_steps)
    dp.fit(sampler(before), epochs=epochs, verbose=0)
    assert int(dp.optimizer.dp_steps) - before == steps * epochs
    assert int(dp.optimizer.micro_steps) == 0


@pytest.mark.parametrize("bad", [2.0, 0.5, -1.0, float("nan")])
def test_a_mask_value_other_than_0_or_1_never_weights_a_row(bad):
    """A mask is a 0/1 padding marker. Any other value fails the step in a graph. The batch
    preparation also makes such a row padding where its assertion does not run: traced for XLA
    (which drops assertions, and which the public entry points refuse), the clipped sum equals the
    one with that row masked out, bit for bit (a mask of 2 used to double the row's clipped
    gradient there)."""
    import keras

    from dpcore import engine
    from dpcore.engine.ghost import fast_summary
    from dpcore.engine.summary import prepare_batch
    from dpcore.losses import per_example_loss_fn

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 4)) * 100, tf.float32)
    y = tf.constant([0, 1, 0, 1])

    def clipped(mask):
        s = engine.summarize(model, loss, x, y, mask=mask)
        return aggregation.clip(s, l2_norm_clip=1.0).grads

    mask = tf.constant([bad, 1.0, 1.0, 1.0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="mask must hold only 0"):
        tf.function(clipped)(mask)

    def prepared(mask):
        xp, yp, swp, mkp = prepare_batch(x, y, None, mask)
        s = fast_summary(
            model, per_example_loss_fn(loss), xp, yp, swp, mkp, model.trainable_variables
        )
        return aggregation.clip(s, l2_norm_clip=1.0).grads

    xla = tf.function(prepared, jit_compile=True)
    padded = xla(tf.constant([0.0, 1.0, 1.0, 1.0]))
    for got, want in zip(xla(mask), padded):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def _dense_and_dp_optimizer():
    """A one-Dense model, its per-example loss, a built DPOptimizer and a batch of 4."""
    import keras

    import dpcore

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    opt = dpcore.DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=4
    )
    opt.build(model.trainable_variables)
    return model, loss, opt, tf.ones([4, 4]), tf.constant([0, 1, 0, 1])


def test_the_dp_step_refuses_to_be_compiled_whole_by_xla():
    """XLA drops the step's assertions and its CPU maxima drop NaN, so neither a user's
    ``tf.function(jit_compile=True)`` around ``dp_train_step`` nor ``DPModel`` compiled with
    ``jit_compile=True`` may trace the DP step; without XLA the same step runs."""
    import keras

    import dpcore

    model, loss, opt, x, y = _dense_and_dp_optimizer()

    def step(x, y):
        return dpcore.dp_train_step(model, loss, x, y, optimizer=opt)

    before = [v.numpy().copy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match="cannot be compiled by XLA"):
        tf.function(step, jit_compile=True)(x, y)
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    tf.function(step)(x, y)
    assert int(opt.dp_steps.numpy()) == 1

    dp = dpcore.make_private(
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
        optimizer=keras.optimizers.SGD(0.1),
        loss=loss,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4,
        jit_compile=True,
    )
    with pytest.raises(ValueError, match="cannot be compiled by XLA"):
        dp.fit(x, y, batch_size=4, epochs=1, verbose=0)


def test_the_custom_loop_stages_refuse_to_be_compiled_by_xla():
    """A custom loop's stages whose guards are assertions refuse XLA too: ``dpcore.summarize``
    (non-finite inputs and examples) and ``DPOptimizer.apply_clipped_sum`` (a clipped sum that is
    not finite); nothing changes, and the same loop runs without XLA."""
    import dpcore

    model, loss, opt, x, y = _dense_and_dp_optimizer()

    def summarize(x, y):
        return dpcore.summarize(model, loss, x, y).sq_norms

    with pytest.raises(ValueError, match="dpcore.summarize cannot be compiled by XLA"):
        tf.function(summarize, jit_compile=True)(x, y)
    clipped = opt.clip(dpcore.summarize(model, loss, x, y))

    def apply():
        opt.apply_clipped_sum(clipped, model.trainable_variables)
        return opt.dp_steps

    before = [v.numpy().copy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match="apply_clipped_sum cannot be compiled by XLA"):
        tf.function(apply, jit_compile=True)()
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    assert int(tf.function(apply)().numpy()) == 1


def _moved_by_record_0(model, x, y, *, options=None, steps=1):
    """The largest norm, over ``steps`` steps from the same weights, of the difference between
    the update with record 0 and without it (σ = 0, SGD lr 1, divisor 1: the update is the
    clipped sum). ``keras.utils.set_random_seed`` makes random layers repeat per call order."""
    import dpcore

    start = [v.numpy().copy() for v in model.trainable_variables]
    opt = dpcore.DPOptimizer(
        keras.optimizers.SGD(1.0), l2_norm_clip=C, noise_multiplier=0.0, expected_batch_size=1
    )
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, y, mask):
        return dpcore.dp_train_step(model, "mse", x, y, optimizer=opt, mask=mask, options=options)

    def update(mask):
        for v, s in zip(model.trainable_variables, start):
            v.assign(s)
        step(x, y, mask)
        return np.concatenate(
            [
                (s - v.numpy()).astype(np.float64).ravel()
                for s, v in zip(start, model.trainable_variables)
            ]
        )

    full = np.ones(len(x), "float32")
    less = full.copy()
    less[0] = 0.0
    worst = 0.0
    for _ in range(steps):
        worst = max(worst, float(np.linalg.norm(update(full) - update(less))))
    return worst


def test_a_layer_fed_a_transposed_batch_takes_the_vectorized_path():
    """The rules (and the per-layer fallback) take a layer's leading axis as the batch. A Dense
    applied to a transposed [T, B, D] tensor, or an EinsumDense whose output moves the batch
    axis ('btd,de->tbe'), with T == B so that nothing fails: their clip factors fell on positions
    (one record moved the clipped sum by 2.6 C and 1.9e9 C). A probe trace now finds the batch
    off the first axis and sends the model to the vectorized path, which is exact."""
    b = t = 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(b, t, 8)).astype("float32")
    y = (rng.normal(size=(b, 1)) * 0.01).astype("float32")
    x[0] *= 1e3
    y[0] = 1e6

    def transposed_dense():
        inp = keras.Input((t, 8))
        h = keras.ops.transpose(inp, (1, 0, 2))
        h = keras.layers.Dense(8, use_bias=False)(h)
        h = keras.layers.GlobalAveragePooling1D()(keras.ops.transpose(h, (1, 0, 2)))
        return keras.Model(inp, keras.layers.Dense(1, use_bias=False)(h))

    def batch_moving_einsum():
        inp = keras.Input((t, 8))
        h = keras.layers.EinsumDense("btd,de->tbe", output_shape=(None, 8))(inp)
        h = keras.layers.GlobalAveragePooling1D()(keras.ops.transpose(h, (1, 0, 2)))
        return keras.Model(inp, keras.layers.Dense(1, use_bias=False)(h))

    for build in (transposed_dense, batch_moving_einsum):
        keras.utils.set_random_seed(0)
        model = build()
        with pytest.warns(RuntimeWarning, match="first axis is not the batch"):
            moved = _moved_by_record_0(model, x, y)
        assert moved <= C * (1 + 1e-6), (build.__name__, moved)


class _BackwardMean(keras.layers.Layer):
    """Forward value exactly ``x``; the gradient couples rows through the batch mean."""

    def call(self, x):
        m = keras.ops.mean(x, axis=0, keepdims=True)
        return x + (m - keras.ops.stop_gradient(m))


@tf.custom_gradient
def _sum_rows_backward(x):
    def grad(g):
        return g + tf.reduce_sum(g, axis=0, keepdims=True)

    return tf.identity(x), grad


class _BackwardSum(keras.layers.Layer):
    """Identity forward; a ``tf.custom_gradient`` adds every row's gradient to each row."""

    def call(self, x):
        return _sum_rows_backward(x)


class _MixesAtEvenBatch(keras.layers.Layer):
    """Centres over the batch when the (static) batch size is even, else the identity."""

    def call(self, x):
        if x.shape[0] is not None and x.shape[0] % 2 == 0:
            return x - keras.ops.mean(x, axis=0, keepdims=True)
        return x


class _MixesAboveTwelveRows(keras.layers.Layer):
    """Centres over the batch when it has more than 12 rows (a branch on the dynamic size)."""

    def call(self, x):
        return tf.cond(
            tf.shape(x)[0] > 12,
            lambda: x - tf.reduce_mean(x, axis=0, keepdims=True),
            lambda: tf.identity(x),
        )


def _around(mixer: keras.layers.Layer) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, name="d1")(inp)
    return keras.Model(inp, keras.layers.Dense(1, name="d2")(mixer(h)))


def _crafted_16() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = (rng.normal(size=(16, 1)) * 0.01).astype("float32")
    x[0] *= 1e3
    y[0] = 1e6
    return x, y


@pytest.mark.parametrize("mixer", [_BackwardMean, _BackwardSum], ids=["stop_gradient", "custom"])
def test_a_layer_that_mixes_rows_only_in_the_backward_pass_is_refused(mixer):
    """The probe compared forward values only: a layer whose value is exactly ``x`` but whose
    gradient couples rows passed, and the fast path's per-example norms and clipped sums, taken
    from one batched backward pass, carried other rows' gradients (one record moved the clipped
    sum by 7.97 C at B = 16). Each path now refuses it or bounds the record by C."""
    x, y = _crafted_16()
    refused = 0
    for method in ("fast", "vectorized"):
        options = dpcore.ExecutionOptions(method=method)
        try:
            moved = _moved_by_record_0(_around(mixer(name="mixer")), x, y, options=options)
        except ValueError as e:
            assert "backward pass mixes examples downstream of layer 'd1'" in str(e), str(e)
            refused += 1
            continue
        assert moved <= C * (1 + 1e-6), (method, moved)
    assert refused == 2


@pytest.mark.parametrize(
    "mixer", [_MixesAtEvenBatch, _MixesAboveTwelveRows], ids=["even batch", "above 12 rows"]
)
def test_a_layer_that_mixes_rows_only_at_the_batch_size_that_runs_is_refused(mixer):
    """The probe ran on a few rows of an odd count only: a layer that mixes rows at an even
    batch size, or above 12 rows, passed (18.8 C and 21.0 C at B = 16). The probe now also runs
    at the batch's static row count."""
    x, y = _crafted_16()
    with pytest.raises(ValueError, match="mixes examples downstream of layer 'd1'.*16 rows"):
        _moved_by_record_0(_around(mixer(name="mixer")), x, y)


@pytest.mark.parametrize("path", ["chunked", "skip"])
def test_a_second_pass_that_redraws_dropout_is_bounded_by_its_own_norms(path):
    """The chunked vectorized path sums in a second pass, and nonfinite='skip' recomputes the
    sum when a record is dropped; with training=True Dropout draws again there, so the factor
    C / N1 met a gradient of norm N2 (8e8 C measured). The second pass's weights are now bounded
    by its own certified norms."""
    import dpcore

    keras.utils.set_random_seed(0)
    inp = keras.Input((16,))
    h = keras.layers.Dropout(0.5)(inp)
    model = keras.Model(inp, keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(h))
    # No other real record: the difference is record 0's own contribution, whatever the draws.
    if path == "chunked":
        options = dpcore.ExecutionOptions(method="vectorized", chunk_size=1)
        x = np.full((1, 16), 0.01, "float32")
    else:
        options = dpcore.ExecutionOptions(nonfinite="skip")
        x = np.full((2, 16), 0.01, "float32")
        x[1] = 3e38  # finite inputs, an infinite loss: dropped, and the sum recomputed
    x[0, 0] = 1e4  # one large feature that Dropout keeps or drops
    y = np.zeros((len(x), 1), "float32")
    moved = _moved_by_record_0(model, x, y, options=options, steps=12)
    assert moved <= C * (1 + 1e-6), moved


def test_low_precision_variables_are_refused():
    """A clipped sum held in bfloat16 (or float16) is rounded before the noise: one example moved
    it by 1.033 C at batch 8, more as the sum grows. Such variables are refused; mixed-precision
    policies (float32 variables) run."""
    import dpcore

    x, y = np.ones((4, 2), "float32"), np.zeros((4, 1), "float32")
    for policy, refused in (("bfloat16", True), ("float16", True), ("mixed_bfloat16", False)):
        with _policy(policy):
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        if refused:
            with pytest.raises(ValueError, match="float32"):
                dpcore.summarize(model, MSE, x, y)
        else:
            assert dpcore.summarize(model, MSE, x, y).sq_norms.shape == (4, 2)


@pytest.mark.parametrize(
    "layer",
    [
        lambda: keras.layers.UnitNormalization(axis=0),
        lambda: keras.layers.LayerNormalization(axis=0, center=False, scale=False),
        lambda: keras.layers.Softmax(axis=0),
        lambda: keras.layers.UnitNormalization(axis=-2),  # -2 is the batch axis of [B, D]
    ],
    ids=["unit_norm", "layer_norm", "softmax", "negative_axis"],
)
def test_built_in_layers_set_to_reduce_over_the_batch_are_refused(layer):
    """UnitNormalization(axis=0) let one example move the update by 5.7 C on the fast path;
    built-in layers configured to reduce over axis 0 are refused by the validator like
    BatchNormalization, through every entry point that trains."""
    import dpcore

    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(1)(layer()(inp)))
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 1), "float32")
    with pytest.raises(ValueError, match="batch axis"):
        dpcore.summarize(model, MSE, x, y)
    assert not dpcore.validation.find_batch_mixing_layers(
        keras.Sequential([keras.Input((4,)), keras.layers.UnitNormalization(axis=-1)])
    )
