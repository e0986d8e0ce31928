"""The benchmark's models and training steps: plain Keras, make_private, and engine-level DP.

Contract:
  * `build_model` / `make_batch`: the benchmark models (`zoo.BENCH_MODELS`, and the opt-in
    KerasHub ones of `hub_models`) and their synthetic batches.
  * `make_fit_model` compiles a model for a `fit` row (plain Keras or `dpcore.make_private`);
    `make_train_step` returns one training step of any method of `METHODS` (see
    `dpcore_experiments.benchmark` for what each method is). Both sides of a ratio compile
    alike: SGD, the same loss, no metrics, ``jit_compile=False``.
  * Standard library at import time (and the model zoos); TensorFlow and dpcore are imported by
    the functions that use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dpcore_experiments.lib import hub_models, zoo

MODELS = zoo.BENCH_MODELS
HUB_MODELS = hub_models.BENCH_MODELS  # dpcore-only, opt-in (never in the default --models)
# make_private(...).fit with privacy units of several rows: (augmentations, group_size). Their
# batch size counts rows, like the nonprivate Keras fit row they are compared with.
UNIT_FIT_METHODS = {"make_private_fit_aug4": (4, 1), "make_private_fit_user8": (1, 8)}
USER_METHODS = ("nonprivate", "make_private_fit", "dp_train_step", *UNIT_FIT_METHODS)
ENGINE_METHODS = ("nonprivate_step", "loop", "jacobian", "vectorized", "fast")
METHODS = USER_METHODS + ENGINE_METHODS
FIT_METHODS = ("nonprivate", "make_private_fit", *UNIT_FIT_METHODS)
SLOW_METHODS = ("loop", "jacobian")


def build_model(name: str, *, seed: int = 0) -> Any:
    """The benchmark model of that name (a built Keras 3 model; :mod:`dpcore_experiments.lib.zoo`,
    or :mod:`dpcore_experiments.lib.hub_models` for ``HUB_MODELS``).

    Args:
      name: one of ``MODELS`` or ``HUB_MODELS``.
      seed: weight initialization seed.

    Returns:
      A Functional or Sequential Keras model (a KerasHub task for ``HUB_MODELS``) producing
      logits.
    """
    import keras

    keras.utils.set_random_seed(seed)
    if name in HUB_MODELS:
        return hub_models.build_bench_model(name)
    return zoo.build_bench_model(keras, name)


def make_batch(name: str, batch_size: int, *, seed: int = 0) -> tuple[Any, Any]:
    """A synthetic batch ``(x, y)`` (numpy; ``x`` a dict for ``HUB_MODELS``) for that model."""
    if name in HUB_MODELS:
        return hub_models.make_bench_batch(name, batch_size, seed=seed)
    return zoo.make_bench_batch(name, batch_size, seed=seed)


def _dense(g: Any) -> Any:
    import tensorflow as tf

    return tf.convert_to_tensor(g)


def _summary_from_grads(variables, grads, losses, y_pred) -> Any:
    """A GradientSummary over materialized per-example gradients ``[B, *var.shape]``."""
    import tensorflow as tf

    from dpcore import norms
    from dpcore.engine.summary import GradientSummary

    flat = [tf.reshape(g, [tf.shape(g)[0], -1]) for g in grads]
    # float64 certified bounds (the GradientSummary contract), the clipped sum is a matvec of flat.
    sq = tf.stack([norms.sq_norm_bound(f) for f in flat], axis=1)

    def weighted_sum(weights):
        return [
            tf.reshape(tf.linalg.matvec(f, weights[:, v], transpose_a=True), tf.shape(g)[1:])
            for v, (f, g) in enumerate(zip(flat, grads))
        ]

    return GradientSummary(
        variables=tuple(variables),
        sq_norms=sq,
        per_example_loss=losses,
        mask=tf.ones_like(losses),
        y_pred=y_pred,
        weighted_sum=weighted_sum,
    )


def _loop_clipped_sum(model, loss_fn, x, y, variables, *, l2_norm_clip: float) -> Any:
    """Clipped sum by a loop over examples, one batch-size-1 backward pass each."""
    import tensorflow as tf

    from dpcore import norms as dp_norms
    from dpcore.aggregation import ClippedSum, clip_factors, round_down_f32, total_norm_bound

    b = tf.shape(y)[0]

    def factor(norm):
        """float32 clip factor rounded toward zero, as ``aggregation.clip`` forms it."""
        return round_down_f32(clip_factors(norm, l2_norm_clip=l2_norm_clip))

    def body(i, acc, norms, losses):
        xi, yi = x[i : i + 1], y[i : i + 1]
        with tf.GradientTape() as tape:
            li = tf.reduce_sum(loss_fn(yi, model(xi, training=True)))
        g = tape.gradient(li, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        g = [_dense(t) for t in g]
        # float64 upper bound of the norm (certified, combined as aggregation.clip does).
        sq = [dp_norms.sq_norm_bound(t[None], weighted_by_matmul=False) for t in g]
        norm = total_norm_bound(tf.stack(sq, axis=1))[0]
        acc = [a + factor(norm) * t for a, t in zip(acc, g)]
        return i + 1, acc, norms.write(i, tf.cast(norm, tf.float32)), losses.write(i, li)

    acc0 = [tf.zeros(v.shape, v.dtype) for v in variables]
    # Two arrays: one TensorArray passed twice aliases norms and losses when run eagerly.
    norms_ta, losses_ta = (tf.TensorArray(tf.float32, size=b) for _ in range(2))
    _, acc, norms, losses = tf.while_loop(
        lambda i, *_: i < b,
        body,
        [tf.constant(0), acc0, norms_ta, losses_ta],
        parallel_iterations=1,
    )
    norms = norms.stack()
    return ClippedSum(
        grads=tuple(acc),
        l2_sensitivity=float(l2_norm_clip),
        num_examples=tf.cast(b, tf.float32),
        per_example_norms=norms,
        clip_weights=factor(norms)[:, None],
        per_example_loss=losses.stack(),
    )


def make_fit_model(
    model: Any,
    method: str,
    *,
    batch_size: int,
    l2_norm_clip: float,
    noise_multiplier: float,
    learning_rate: float,
) -> Any:
    """The compiled model whose ``fit`` a ``nonprivate`` / ``make_private_fit`` row runs.

    Both compile the same model with SGD and the same loss, no metrics and
    ``jit_compile=False`` (a KerasHub task compiles itself with default metrics when built, and
    a later ``compile(metrics=None)`` keeps them; plain Keras' ``"auto"`` would compile with XLA
    on a GPU, the ``DPModel`` does not);
    ``make_private_fit`` wraps it with ``dpcore.make_private`` (default
    :class:`dpcore.ExecutionOptions`).

    Privacy:
      ``make_private_fit`` clips and noises every step (benchmark only: synthetic data, no
      accounting).
    """
    import keras

    optimizer = keras.optimizers.SGD(learning_rate=learning_rate)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if method == "nonprivate":
        # Empty lists, not None: recompiling with None keeps the previous compile's metrics, and
        # a KerasHub task compiles itself on construction (GPT2CausalLM: an accuracy metric,
        # an argmax over every [B, T, vocab] logit each step).
        model.compile(
            optimizer=optimizer, loss=loss, metrics=[], weighted_metrics=[], jit_compile=False
        )
        return model
    if method not in FIT_METHODS:
        raise ValueError(f"method={method!r}; expected one of {FIT_METHODS}.")
    import dpcore
    from dpcore.options import ExecutionOptions

    augmentations, group_size = UNIT_FIT_METHODS.get(method, (1, 1))
    rows_per_unit = augmentations * group_size
    if batch_size % rows_per_unit:
        raise ValueError(f"{method} needs a batch size (rows) divisible by {rows_per_unit}.")
    return dpcore.make_private(
        model,
        optimizer=optimizer,
        loss=loss,
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=noise_multiplier,
        expected_batch_size=batch_size // rows_per_unit,
        augmentations=augmentations,
        options=ExecutionOptions(group_size=group_size),
        sampling="shuffle",  # one fixed batch per step: the step's cost, not a sampler's
        jit_compile=False,
    )


def fit_batch(method: str, x: Any, y: Any) -> tuple[Any, Any]:
    """What a fit row feeds each step, given ``batch_size`` rows ``(x, y)``: all of them, or the
    first ``batch_size / 4`` examples for ``make_private_fit_aug4`` (its step makes the views)."""
    import tensorflow as tf

    augmentations, _ = UNIT_FIT_METHODS.get(method, (1, 1))
    if augmentations == 1:
        return x, y
    examples = int(tf.nest.flatten(y)[0].shape[0]) // augmentations
    return tf.nest.map_structure(lambda t: t[:examples], (x, y))


def make_train_step(
    model: Any,
    method: str,
    *,
    batch_size: int,
    l2_norm_clip: float,
    noise_multiplier: float,
    learning_rate: float,
    info: dict | None = None,
) -> Callable[[Any, Any], Any]:
    """One training step ``step(x, y) -> loss`` for the given method.

    ``nonprivate`` and ``make_private_fit`` return one ``fit`` call on the one batch (for tests
    and profiling; :func:`measure` times their steps inside a single ``fit``). The others return
    a ``tf.function``.

    Args:
      model: a built Keras model.
      method: one of ``METHODS``.
      batch_size: used as ``expected_batch_size`` of the DP step.
      l2_norm_clip: clip bound C.
      noise_multiplier: noise std / C.
      learning_rate: SGD learning rate.
      info: if given, filled at trace time with the engine's per-variable paths.

    Returns:
      A ``tf.function``; the DP variants clip, add noise (seed advanced every step) and apply.

    Privacy:
      The DP variants clip every example to ``l2_norm_clip`` and add Gaussian noise once per step
      (benchmark only: the data are synthetic and no accounting is done).
    """
    import keras
    import tensorflow as tf

    import dpcore  # noqa: F401  (every row's process loads dpcore, the baselines' too)

    if method not in METHODS:
        raise ValueError(f"method={method!r}; expected one of {METHODS}.")
    dp = dict(batch_size=batch_size, l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier)
    if method in FIT_METHODS:
        return _fit_step(model, method, learning_rate=learning_rate, **dp)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    variables = list(model.trainable_variables)
    opt = keras.optimizers.SGD(learning_rate=learning_rate)
    opt.build(variables)
    seed = tf.Variable([0, 0], dtype=tf.int64, trainable=False)
    if method == "dp_train_step":
        return _custom_loop_step(model, loss_fn, learning_rate=learning_rate, **dp)
    info = {} if info is None else info
    return _engine_step(model, loss_fn, method, variables, opt, seed, info=info, **dp)


def _fit_step(
    model: Any,
    method: str,
    *,
    batch_size: int,
    l2_norm_clip: float,
    noise_multiplier: float,
    learning_rate: float,
) -> Callable[[Any, Any], Any]:
    """One ``fit`` call on the one batch; ``.fit_model`` is the compiled model it runs."""
    import tensorflow as tf

    fit_model = make_fit_model(
        model,
        method,
        batch_size=batch_size,
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=noise_multiplier,
        learning_rate=learning_rate,
    )

    def fit_step(x, y):
        ds = tf.data.Dataset.from_tensors(fit_batch(method, x, y))
        return fit_model.fit(ds, epochs=1, verbose=0, shuffle=False).history["loss"][-1]

    fit_step.fit_model = fit_model  # measure() times its steps inside one fit
    return fit_step


def _custom_loop_step(
    model: Any,
    loss_fn: Any,
    *,
    batch_size: int,
    l2_norm_clip: float,
    noise_multiplier: float,
    learning_rate: float,
) -> Callable[[Any, Any], Any]:
    """``dpcore.dp_train_step`` with a ``DPOptimizer`` inside the user's own ``tf.function``."""
    import keras
    import tensorflow as tf

    import dpcore

    dp_optimizer = dpcore.DPOptimizer(
        keras.optimizers.SGD(learning_rate=learning_rate),
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=noise_multiplier,
        expected_batch_size=batch_size,
    )

    @tf.function
    def custom_loop_step(x, y):
        return dpcore.dp_train_step(model, loss_fn, x, y, optimizer=dp_optimizer)

    return custom_loop_step


def _engine_step(
    model: Any,
    loss_fn: Any,
    method: str,
    variables: list[Any],
    opt: Any,
    seed: Any,
    *,
    batch_size: int,
    l2_norm_clip: float,
    noise_multiplier: float,
    info: dict,
) -> Callable[[Any, Any], Any]:
    """A hand-written step around one engine call (or the loop / jacobian references): clip,
    noise once (``seed`` advanced every step) and apply with ``opt``."""
    import tensorflow as tf

    from dpcore import aggregation, engine
    from dpcore.options import ExecutionOptions

    def privatize_and_apply(clipped):
        s = seed.read_value()
        seed.assign_add(tf.constant([0, 1], tf.int64))
        grads = aggregation.privatize(
            clipped,
            noise_multiplier=noise_multiplier,
            expected_batch_size=batch_size,
            seed=s,
        )
        opt.apply(grads, variables)
        return tf.reduce_mean(clipped.per_example_loss)

    @tf.function
    def step(x, y):
        if method == "nonprivate_step":
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(y, model(x, training=True)))
            opt.apply(tape.gradient(loss, variables), variables)
            return loss
        if method == "loop":
            clipped = _loop_clipped_sum(model, loss_fn, x, y, variables, l2_norm_clip=l2_norm_clip)
            return privatize_and_apply(clipped)
        if method == "jacobian":
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                losses = loss_fn(y, y_pred)
            jac = tape.jacobian(
                losses, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
            summary = _summary_from_grads(variables, [_dense(j) for j in jac], losses, y_pred)
        else:
            summary = engine.summarize(
                model, loss_fn, x, y, variables=variables, options=ExecutionOptions(method=method)
            )
        info["paths"] = dict(summary.paths)
        return privatize_and_apply(aggregation.clip(summary, l2_norm_clip=l2_norm_clip))

    return step
