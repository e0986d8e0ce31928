"""The recipe in ``dpcore/rules/README.md`` runs as written, and a user rule reaches training.

The README's three Python blocks (the layer and its rule, training with it, its test) are executed
in order in one namespace; the rule, given as ``ExecutionOptions(rules=...)``, is then spied on to
show that ``explain`` reports it and that ``make_private(...).fit``, ``DPModel.fit`` and
``dp_train_step`` compute with it (not the vectorized fallback) and apply the exact clipped mean.
Also: ``dpcore.rules.base`` imports nothing from the engine.
"""

import ast
import dataclasses
import pathlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import dpcore
from dpcore.rules import LayerRule, default_registry
from dpcore.testing import reference_clipped_mean, reference_per_example_gradients

# Tests here build noise_multiplier=0 optimizers on purpose (exact, noise-free updates); the
# warning that such a run is not private is expected in this module.
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0:UserWarning")

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = ROOT / "dpcore" / "rules" / "README.md"
C = 0.5
LOSS = keras.losses.MeanSquaredError(reduction=None)


@pytest.fixture(scope="module")
def recipe():
    """The README's blocks, run in order; returns their namespace."""
    blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(), re.S)
    assert len(blocks) == 3, "the recipe has three Python blocks: rule, use, test"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(RECIPE), "exec"), namespace)
    return namespace


def test_recipe_test_passes(recipe):
    recipe["test_scale_rule"]()


def test_recipe_rule_is_reported_and_trained(recipe):
    model = recipe["model"]
    scale, dense = (layer.name for layer in model.layers)
    rows = {r.name: r for r in dpcore.explain(model, options=recipe["options"]).rows}
    assert rows[scale].path == "materialized" and "Scale" in rows[scale].why
    assert rows[dense].path == "ghost"
    # Without the rule the layer falls back, and explain says so.
    assert dpcore.explain(model).paths()[scale] == "fallback:vectorized"
    assert int(recipe["dp_model"].optimizer.dp_steps.numpy()) == 4  # 64 rows, batches of 16


def test_explain_takes_the_rules_once(recipe):
    registry = recipe["options"].layer_rules()
    assert registry[recipe["Scale"]] is recipe["SCALE"]
    assert registry[keras.layers.Dense] is default_registry()[keras.layers.Dense]  # merged
    same = dpcore.explain(recipe["model"], registry=registry).paths()
    assert same == dpcore.explain(recipe["model"], options=recipe["options"]).paths()
    full = dpcore.ExecutionOptions(registry=registry)
    assert dpcore.explain(recipe["model"], options=full).paths() == same
    for options in (recipe["options"], full):
        with pytest.raises(ValueError, match="once"):
            dpcore.explain(recipe["model"], options=options, registry=registry)
    with pytest.raises(ValueError, match="once"):
        dpcore.ExecutionOptions(rules={recipe["Scale"]: recipe["SCALE"]}, registry=registry)
    with pytest.raises(TypeError, match="LayerRule"):
        dpcore.ExecutionOptions(rules={recipe["Scale"]: recipe["scale_grads"]})
    vectorized = dpcore.explain(
        recipe["model"], options=recipe["options"].replace(method="vectorized")
    )
    assert vectorized.whole_model_fallback
    assert set(vectorized.paths().values()) == {"fallback:vectorized"}


def _spied(recipe):
    """Options with SCALE's ``grads`` counting its (trace-time) calls and a ``plan`` that names
    the spy, as ``rules=`` (merged over the built-in rules)."""
    calls = []
    rule = recipe["SCALE"]

    def grads(layer, uses):
        calls.append(layer.name)
        return rule.grads(layer, uses)

    def plan(layer, input_shapes):
        return "materialized", "counting spy rule"

    spy = dataclasses.replace(rule, grads=grads, plan=plan)
    return dpcore.ExecutionOptions(method="fast", rules={recipe["Scale"]: spy}), calls


def _fit(model, x, y, options):
    dp_model = dpcore.make_private(
        model,
        optimizer=keras.optimizers.SGD(1.0),
        loss=LOSS,
        l2_norm_clip=C,
        noise_multiplier=0.0,
        expected_batch_size=len(x),
        options=options,
    )
    dp_model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)


def _dp_model_fit(model, x, y, options):
    dp_model = dpcore.DPModel(model, options=options)
    dp_model.compile(
        optimizer=dpcore.DPOptimizer(
            keras.optimizers.SGD(1.0),
            l2_norm_clip=C,
            noise_multiplier=0.0,
            expected_batch_size=len(x),
        ),
        loss=LOSS,
    )
    dp_model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)


def _custom_loop(model, x, y, options):
    opt = dpcore.DPOptimizer(
        keras.optimizers.SGD(1.0), l2_norm_clip=C, noise_multiplier=0.0, expected_batch_size=len(x)
    )
    tf.function(lambda: dpcore.dp_train_step(model, LOSS, x, y, optimizer=opt, options=options))()


@pytest.mark.parametrize(
    "entry", [_fit, _dp_model_fit, _custom_loop], ids=["make_private", "DPModel", "dp_train_step"]
)
def test_user_rule_reaches_training(recipe, rng, entry):
    """One σ = 0 SGD(1.0) step with the user rule applies the exact clipped mean."""
    model = keras.Sequential([keras.Input((3, 4)), recipe["Scale"](), keras.layers.Dense(2)])
    model.layers[0].w.assign(rng.normal(size=4).astype("float32"))
    x = rng.normal(size=(6, 3, 4)).astype("float32")
    y = rng.normal(size=(6, 3, 2)).astype("float32")
    grads = reference_per_example_gradients(model, LOSS, x, y)
    expected = reference_clipped_mean(grads, l2_norm_clip=C, expected_batch_size=len(x))
    before = [v.numpy() for v in model.trainable_variables]
    options, calls = _spied(recipe)
    rows = {r.name: r for r in dpcore.explain(model, options=options).rows}
    assert rows[model.layers[0].name].why == "counting spy rule"  # explain shows the user rule
    assert rows[model.layers[1].name].path == "materialized"  # the built-in Dense rule
    entry(model, x, y, options)
    assert calls and set(calls) == {model.layers[0].name}  # the rule ran, not the fallback
    for v, b, e in zip(model.trainable_variables, before, expected):
        np.testing.assert_allclose(b - v.numpy(), e, rtol=1e-4, atol=1e-6)


def test_rules_base_imports_nothing_from_the_engine():
    tree = ast.parse((ROOT / "dpcore" / "rules" / "base.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(f"{node.module}.{a.name}" for a in node.names)
    assert not [m for m in imported if m.startswith("dpcore.engine")], imported
    assert {m for m in imported if m.startswith("dpcore")} <= {"dpcore", "dpcore.norms"}


def test_simple_rule_defaults():
    rule = LayerRule(name="r", forward=lambda *a: None, grads=lambda *a: [])
    dense = keras.layers.Dense(2, activation="relu")
    assert rule.check(dense) is None
    z = tf.constant([[-1.0, 2.0]])
    np.testing.assert_array_equal(rule.activate(dense, z), [[0.0, 2.0]])
    np.testing.assert_array_equal(rule.activate(keras.layers.Identity(), z), z)
    assert rule.plan(dense, [None])[0] == "materialized"
    with pytest.raises(TypeError, match="forward and grads"):
        LayerRule(name="incomplete", forward=lambda *a: None)
