"""Crafted records against the parts of one step that had no adversary yet (issue 28, item 4).

The same claim and machinery as ``tests/test_privacy_invariants.py`` (σ = 0, C = 1, a batch of
benign rows and one crafted record; removing it moves the pre-noise clipped sum by at most
``C (1 + TOLERANCE)``, and every certified norm is at least the exact one), aimed at:

1. More layers: LoRA on the materialized route (Dense and EinsumDense), LoRA with a large
   ``lora_alpha`` and large adapters on the ghost route, LoRA inside KerasHub's
   ``TransformerEncoder`` (its query and value projections), grouped and dilated ``Conv1D``,
   ``Conv2D`` with ``same`` padding, causal ``MultiHeadAttention`` and a layer without a rule
   (``DepthwiseConv2D``, the per-layer fallback).
2. Records aimed at the boundaries of :data:`dpcore.norms.ORDINARY_DIAGONAL` (an example whose
   Gram diagonal peaks just below, at or just above ``2^-40`` or ``2^80`` keeps its operand or is
   divided by its largest magnitude) and at float32's flush-to-zero range (entries whose squares
   or values are subnormal, next to a spike), with labels that move the output gradients across
   the same boundaries, on every ghost-path case.
3. Sample weights (``dpcore.summarize``) and ``class_weight`` (``DPModel.fit`` on arrays, which
   Keras turns into sample weights): 0, subnormal, tiny, huge, the largest float32, negative,
   NaN and Inf on the crafted record, extreme weights on the other rows too. A finite weight
   never lets the record move the sum by more than C (negative weights are accepted: they flip
   the example's gradient, whose norm is clipped all the same); weight 0 moves it by exactly
   nothing; a non-finite weight is refused (``nonfinite="raise"``) or the record skipped with no
   contribution (``"skip"``), and the other rows keep theirs.
4. Per-variable clipping groups (every trainable variable its own bound, bounds from 1e-3 to
   1e3): removing the record moves each variable's sum by at most its own bound.
"""

from __future__ import annotations

import math
from typing import Any
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
import test_privacy_invariants as inv
from hypothesis import Phase, assume, given, settings
from hypothesis import strategies as st

import dpcore
from dpcore import aggregation
from dpcore.options import ExecutionOptions

C, B, TOLERANCE, MSE = inv.C, inv.B, inv.TOLERANCE, inv.MSE
L = keras.layers


def _settings(max_examples: int) -> Any:
    """The invariants suite's settings; no shrinking (a failing record is reported as drawn)."""
    return settings(inv._settings(max_examples), phases=(Phase.explicit, Phase.generate))


# ------------------------------------------------------------------------- 1. more layers
def _lora_dense_materialized(inputs):
    dense = L.Dense(2, name="lora")
    h = dense(inputs)
    dense.enable_lora(1)
    return inv._gap1(h)


def _lora_einsum(inputs):
    layer = L.EinsumDense("btd,de->bte", (None, 8), bias_axes="e", name="lora")
    h = layer(inputs)
    layer.enable_lora(2)
    return inv._gap1(h)


def _lora_alpha(inputs):
    """LoRA rank 4 with lora_alpha 512 (scale 128) and adapters far from their initial values."""
    dense = L.Dense(32, name="lora")
    h = dense(inputs)
    dense.enable_lora(4, lora_alpha=512.0)
    rng = np.random.default_rng(5)
    dense.lora_kernel_a.assign(rng.normal(size=dense.lora_kernel_a.shape) * 30.0)
    dense.lora_kernel_b.assign(rng.normal(size=dense.lora_kernel_b.shape) * 30.0)
    return inv._gap1(h)


def _hub_encoder_lora(inputs):
    encoder = inv._keras_hub().layers.TransformerEncoder(8, 2, name="encoder")
    h = encoder(inputs)
    attention = encoder._self_attention_layer
    for projection in (attention._query_dense, attention._value_dense):
        projection.enable_lora(2)
        projection.lora_kernel_b.assign(
            np.random.default_rng(1).normal(size=projection.lora_kernel_b.shape) * 0.5
        )
    return inv._gap1(h)


def _gap2(h):
    return L.GlobalAveragePooling2D()(h)


# name: (feature shape, vocab, builder, {layer: path}, methods): as test_privacy_invariants.ZOO,
# registered there under these new names so that its helpers (the float64 twin of a model)
# find them; its own parametrized tests were collected from its names before.
ADV_ZOO = {
    "adv_lora_dense_materialized": (
        (8, 3),
        None,
        lambda: inv._functional((8, 3), _lora_dense_materialized),
        {"lora": "materialized"},
        ("fast", "vectorized"),
    ),
    "adv_lora_einsum": (
        (4, 6),
        None,
        lambda: inv._functional((4, 6), _lora_einsum),
        {"lora": "materialized"},
        ("fast", "vectorized"),
    ),
    "adv_lora_alpha": (
        (2, 32),
        None,
        lambda: inv._functional((2, 32), _lora_alpha),
        {"lora": "ghost"},
        ("fast", "vectorized"),
    ),
    "adv_hub_encoder_lora": (
        (3, 4),
        None,
        lambda: inv._functional((3, 4), _hub_encoder_lora),
        {},
        ("fast", "vectorized"),
    ),
    "adv_conv1d_groups": (
        (6, 4),
        None,
        lambda: inv._functional(
            (6, 4), lambda i: inv._gap1(L.Conv1D(4, 3, groups=2, padding="same", name="conv")(i))
        ),
        {"conv": "materialized"},
        ("fast",),  # vectorized: TF cannot vectorize a grouped convolution's filter gradient
    ),
    "adv_conv1d_dilated": (
        (8, 4),
        None,
        lambda: inv._functional(
            (8, 4), lambda i: inv._gap1(L.Conv1D(4, 2, dilation_rate=2, name="conv")(i))
        ),
        {"conv": "materialized"},
        ("fast", "vectorized"),
    ),
    "adv_conv2d_same": (
        (4, 4, 3),
        None,
        lambda: inv._functional(
            (4, 4, 3), lambda i: _gap2(L.Conv2D(4, 3, padding="same", name="conv")(i))
        ),
        {"conv": "materialized"},
        ("fast", "vectorized"),
    ),
    "adv_attention_causal": (
        (3, 4),
        None,
        lambda: inv._functional(
            (3, 4),
            lambda i: inv._gap1(L.MultiHeadAttention(2, 2, name="mha")(i, i, use_causal_mask=True)),
        ),
        {"mha": "materialized"},
        ("fast", "vectorized"),
    ),
    "adv_depthwise_fallback": (
        (4, 4, 2),
        None,
        lambda: inv._functional((4, 4, 2), lambda i: _gap2(L.DepthwiseConv2D(2, name="conv")(i))),
        {"conv": "fallback:vectorized", "head": "ghost"},
        ("fast", "vectorized"),
    ),
}
inv.ZOO.update(ADV_ZOO)


SLOW_LAYERS = ("adv_hub_encoder_lora", "adv_conv1d_groups", "adv_attention_causal")


@pytest.mark.filterwarnings("ignore:dpcore. model")
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LAYERS else n for n in ADV_ZOO],
)
@_settings(max_examples=5)
@given(rec=inv.records())
def test_more_layers_clip_every_record(name, rec):
    inv.check_sensitivity_and_norms(inv.case(name), rec)


# ------------------------------------------------- 2. ORDINARY_DIAGONAL and flush-to-zero records
GHOST_CASES = ("dense_seq_ghost", "einsum_dense", "conv1d", "lora", "adv_lora_alpha")
LOW, HIGH = (math.log2(v) for v in dpcore.norms.ORDINARY_DIAGONAL)  # -40, 80


@st.composite
def boundary_records(draw: Any) -> dict[str, Any]:
    """A record whose largest squared row norm is ``2^e (1 + sign 2^-k)`` with ``e`` at or next
    to a boundary of ORDINARY_DIAGONAL, or whose entries lie in float32's flush-to-zero range;
    its other positions ``2^-shift`` smaller; a label ``± 2^label_exp``."""
    return {
        "seed": draw(st.integers(0, 2**16)),
        "index": draw(st.integers(0, B - 1)),
        "kind": draw(st.sampled_from(("low", "high", "ftz"))),
        "offset": draw(st.sampled_from((-1, 0, 1))),
        "k": draw(st.sampled_from((1, 10, 23, 30))),
        "sign": draw(st.sampled_from((-1.0, 1.0))),
        "shift": draw(st.sampled_from((0, 20, 64, 100))),
        "ftz_exp": draw(st.sampled_from((60, 63, 64, 75, 100, 126, 130, 149))),
        "spike": draw(st.sampled_from((None, 0.0, 40.0))),
        "label_exp": draw(st.sampled_from((-60, -40, -20, 0, 20, 40, 60))),
        "label_sign": draw(st.sampled_from((-1.0, 1.0))),
    }


def boundary_batch(shape: tuple[int, ...], rec: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rec["seed"])
    x = rng.normal(size=(B, *shape)).astype("float32")
    y = rng.normal(size=(B, 1)).astype("float32")
    rows = rng.normal(size=(int(np.prod(shape[:-1])), shape[-1]))
    if rec["kind"] == "ftz":
        rows = rows / np.abs(rows).max() * 2.0 ** -rec["ftz_exp"]
        if rec["spike"] is not None:
            rows[rng.integers(0, len(rows)), rng.integers(0, shape[-1])] = 2.0 ** rec["spike"]
    else:
        e = (LOW if rec["kind"] == "low" else HIGH) + rec["offset"]
        rows /= np.sqrt(np.sum(rows**2, axis=1, keepdims=True))  # every row of norm 1, then
        rows *= np.sqrt(2.0**e * (1.0 + rec["sign"] * 2.0 ** -rec["k"]))  # the peak, and
        rows[1:] *= 2.0 ** -rec["shift"]  # the other positions below it
    x[rec["index"]] = rows.reshape(shape).astype("float32")
    y[rec["index"]] = rec["label_sign"] * 2.0 ** rec["label_exp"]
    return x, y


def _check_batch(c: Any, x: np.ndarray, y: np.ndarray, index: int) -> None:
    """test_privacy_invariants' sensitivity and certified-norm check, on this batch."""
    with mock.patch.object(inv, "crafted_batch", lambda *args, **kwargs: (x, y)):
        inv.check_sensitivity_and_norms(c, {"index": index})


@pytest.mark.parametrize("name", GHOST_CASES)
@_settings(max_examples=8)
@given(rec=boundary_records())
def test_records_at_the_ordinary_diagonal_boundaries_and_in_the_flush_range(name, rec):
    c = inv.case(name)
    x, y = boundary_batch(c.feature_shape, rec)
    _check_batch(c, x, y, rec["index"])


def test_boundary_records_reach_both_sides_of_each_boundary():
    """The records above do land on both sides of 2^-40 and 2^80 and in the flush range (the
    largest squared row norm of the float32 record, computed in float64)."""
    peaks = set()
    for kind in ("low", "high"):
        for offset in (-1, 0, 1):
            for sign in (-1.0, 1.0):
                rec = {
                    "seed": 0, "index": 0, "kind": kind, "offset": offset, "k": 23,
                    "sign": sign, "shift": 20, "ftz_exp": 0, "spike": None, "label_exp": 0,
                    "label_sign": 1.0,
                }  # fmt: skip
                x, _ = boundary_batch((2, 16), rec)
                peak = np.max(np.sum(x[0].astype(np.float64) ** 2, axis=-1))
                low, high = dpcore.norms.ORDINARY_DIAGONAL
                peaks.add((kind, peak < low, peak > high))
    assert {("low", True, False), ("low", False, False)} <= peaks
    assert {("high", False, False), ("high", False, True)} <= peaks
    rec = dict(rec, kind="ftz", ftz_exp=130, spike=None)
    x, _ = boundary_batch((2, 16), rec)
    nonzero = np.abs(x[0][x[0] != 0])
    assert nonzero.size and np.all(nonzero < 2.0**-126)  # subnormal float32 entries


# --------------------------------------------------------------- 3. sample and class weights
WEIGHTS = (
    0.0, 1e-45, 1e-38, 1e-30, 1e-10, 1.0, 1e10, 1e30, 3.4e38, -1.0, -1e30, -3.4e38,
    float("nan"), float("inf"), -float("inf"),
)  # fmt: skip
REFUSED_INPUT = r"NaN or Inf in sample_weight at row \d"


class _Weighted:
    """dense_2d's model with one compiled clipped sum per (method, nonfinite) taking weights."""

    def __init__(self) -> None:
        self.case = inv.case("dense_2d")
        self.fns: dict[tuple[str, str], Any] = {}
        self.traces: dict[tuple[str, str], int] = {}

    def __call__(self, method, nonfinite, x, y, sw, mask):
        key = (method, nonfinite)
        if key not in self.fns:
            options = ExecutionOptions(method=method, nonfinite=nonfinite)
            model = self.case.model

            @tf.function
            def run(x, y, sw, mask):
                self.traces[key] = self.traces.get(key, 0) + 1
                s = dpcore.summarize(model, MSE, x, y, sample_weight=sw, mask=mask, options=options)
                return aggregation.clip(s, l2_norm_clip=C).grads, s.mask

            self.fns[key] = run
        grads, kept = self.fns[key](*(tf.constant(t) for t in (x, y, sw, mask)))
        return inv._flat([g.numpy().astype(np.float64) for g in grads]), kept.numpy()


_WEIGHTED: list[_Weighted] = []


@_settings(max_examples=12)
@given(
    rec=inv.records(),
    weight=st.sampled_from(WEIGHTS),
    others=st.sampled_from(("ones", "random", "extreme")),
)
def test_one_record_with_an_extreme_sample_weight_moves_the_sum_by_at_most_c(rec, weight, others):
    if not _WEIGHTED:
        _WEIGHTED.append(_Weighted())
    w = _WEIGHTED[0]
    x, y = inv.crafted_batch(w.case.feature_shape, rec)
    ref_sq, losses = inv.reference_sq_norms(w.case.model, x, y)
    assume(np.all(np.isfinite(losses)))
    # The record's unweighted gradient norm, where float32 determines it (see
    # test_privacy_invariants.check_sensitivity_and_norms): its weighted contribution is then
    # min(C, |weight| norm), which shows the weight is applied, and applied before clipping.
    norm = math.sqrt(ref_sq[rec["index"]])
    norm64 = math.sqrt(inv.float64_sq_norms(w.case, x, y)[rec["index"]])
    determined = abs(norm - norm64) <= 1e-5 * norm64
    rng = np.random.default_rng(rec["seed"])
    sw = {
        "ones": np.ones(B),
        "random": rng.uniform(0.5, 2.0, B),
        "extreme": rng.choice([1e-30, 1e30, -1e30, 3.4e38], B),
    }[others].astype("float32")
    i = rec["index"]
    sw[i] = weight
    full, less = inv._removal(i)
    for method in ("fast", "vectorized"):
        if not np.isfinite(weight):
            with pytest.raises(tf.errors.InvalidArgumentError, match=REFUSED_INPUT):
                w(method, "raise", x, y, sw, full)
        for nonfinite in ("raise", "skip"):
            if nonfinite == "raise" and not np.isfinite(weight):
                continue
            try:
                with_it, kept = w(method, nonfinite, x, y, sw, full)
            except tf.errors.InvalidArgumentError as e:
                # A finite weight times a finite loss can overflow: the step refuses it as a
                # non-finite example (never a silent clip of an infinite gradient).
                assert nonfinite == "raise" and inv.REFUSED in str(e), e
                continue
            without, _ = w(method, nonfinite, x, y, sw, less)
            moved = float(np.linalg.norm(with_it - without))
            assert np.isfinite(moved) and moved <= C * (1 + TOLERANCE), (method, weight, moved)
            if weight == 0.0 or not kept[i]:
                assert moved == 0.0, (method, weight, moved)
            elif determined and 1e-30 <= abs(weight) * norm <= 1e30:
                want = min(C, abs(weight) * norm)
                assert abs(moved - want) <= 1e-3 * want + 1e-6 * C, (method, weight, moved, want)
            if not np.isfinite(weight):
                assert not kept[i] and kept.tolist().count(0.0) >= 1
    assert all(v == 1 for v in w.traces.values()), w.traces


class _ClassWeighted:
    """make_private(...).fit on one fixed batch of every row (σ = 0, SGD lr 1, expected batch
    size 1: the update is minus the clipped sum); the record is the only row of class 2. A
    fixed batch whose size is not the expected batch size is a dataset under
    sampling="shuffle" (on arrays fit refuses the contradiction)."""

    def __init__(self) -> None:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), L.Dense(4, activation="tanh"), L.Dense(3)])
        self.dp = dpcore.make_private(
            model,
            optimizer=keras.optimizers.SGD(1.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            l2_norm_clip=C,
            noise_multiplier=0.0,
            expected_batch_size=1.0,
            options=ExecutionOptions(nonfinite="skip"),
            sampling="shuffle",
        )
        self.start = [v.numpy() for v in model.trainable_variables]

    def update(self, x, y, class_weight) -> np.ndarray:
        model = self.dp.model
        for v, s in zip(model.trainable_variables, self.start):
            v.assign(s)
        batch = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x))
        self.dp.fit(batch, class_weight=class_weight, verbose=0)
        return np.concatenate(
            [
                (s - v.numpy()).astype(np.float64).ravel()
                for s, v in zip(self.start, model.trainable_variables)
            ]
        )


_CLASS_WEIGHTED: list[_ClassWeighted] = []


@_settings(max_examples=6)
@given(rec=inv.records(), weight=st.sampled_from(WEIGHTS))
def test_one_record_with_an_extreme_class_weight_moves_the_update_by_at_most_c(rec, weight):
    if not _CLASS_WEIGHTED:
        _CLASS_WEIGHTED.append(_ClassWeighted())
    r = _CLASS_WEIGHTED[0]
    x, _ = inv.crafted_batch((6,), rec)
    y = np.array([0, 1, 0, 1], "int32")
    y[rec["index"]] = 2
    class_weight = {0: 1.0, 1: 1.0, 2: weight}
    with_it = r.update(x, y, class_weight)
    keep = np.arange(B) != rec["index"]
    without = r.update(x[keep], y[keep], class_weight)
    moved = float(np.linalg.norm(with_it - without))
    assert np.isfinite(moved) and moved <= C * (1 + TOLERANCE), (weight, moved)
    if weight == 0.0 or not np.isfinite(weight):
        assert moved <= C * 1e-6 * (1 + TOLERANCE), (weight, moved)  # summation rounding only


# ------------------------------------------------------------ 4. per-variable clipping groups
GROUP_CASES = [
    "lora",
    *(
        pytest.param(n, marks=pytest.mark.slow)
        for n in ("attention", "conv1d", "layer_norm", "adv_lora_alpha")
    ),
]
SCALES = (1e-3, 1.0, 1e3, 0.5, 7.0, 1e-2)


@pytest.mark.parametrize("name", GROUP_CASES)
@_settings(max_examples=8)
@given(rec=inv.records())
def test_per_variable_groups_bound_each_variable(name, rec):
    c = inv.case(name)
    x, y = inv.crafted_batch(c.feature_shape, rec, vocab=c.vocab)
    _, losses = inv.reference_sq_norms(c.model, x, y)
    assume(np.all(np.isfinite(losses)))
    n = len(c.model.trainable_variables)
    groups = list(range(n))
    bounds = [SCALES[v % len(SCALES)] * (1 + v * 1e-3) for v in range(n)]  # unique to this test
    full_mask, less_mask = inv._removal(rec["index"])
    for method in c.methods:
        kw = {"bounds": bounds, "groups": groups, "nonfinite": "skip"}
        full, _, kept = inv.clipped_sum(c, method, x, y, full_mask, **kw)
        less, _, _ = inv.clipped_sum(c, method, x, y, less_mask, **kw)
        for v, bound in enumerate(bounds):
            moved = float(np.linalg.norm(full[v] - less[v]))
            assert np.isfinite(moved) and moved <= bound * (1 + TOLERANCE), (method, v, moved)
        if not kept[rec["index"]]:
            np.testing.assert_array_equal(inv._flat(full), inv._flat(less))
