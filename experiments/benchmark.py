"""Benchmark of one DP-SGD training step against the non-private step.

Contract: for every (model, method, batch size) configuration, one child process builds the
model, traces the step, runs ``--warmup`` untimed steps and then ``--steps`` timed ones, and
reports the median milliseconds per training step (forward + backward + clip + noise + apply),
its peak resident memory (whole process, and during the timed steps alone) and, on a GPU, peak
device memory. One process per configuration keeps each peak-memory figure its own. The parent
process runs the non-private configuration of each (model, batch size) first and reports every
other row's ratio to it, measured in the same run. A per-row timeout and a per-row resident
memory cap stop pathological configurations (the row says so instead of hanging the run).

With ``--peer``, the same rows are produced for TensorFlow Privacy 0.9.0 by
``experiments/peers/bench.py`` in its own TensorFlow 2.15 virtual environment; each peer row's
ratio is to the peer's own non-private step.

Methods (dpcore side), the path users run (ratios to the plain Keras ``fit`` row):
  nonprivate        plain Keras: ``model.compile(SGD, loss)`` and ``fit`` (mean loss, one
                    backward pass, apply). Timed per step inside one ``fit`` call.
  make_private_fit  ``dpcore.make_private(model, ...)`` and ``fit`` on the same model, batches
                    and optimizer, default ``ExecutionOptions``; timed like ``nonprivate``.
  dp_train_step     ``dpcore.dp_train_step`` with a ``DPOptimizer`` inside the user's own
                    ``tf.function`` (the custom-training-loop path).
  make_private_fit_aug4
                    ``make_private(..., augmentations=4)``: each example's 4 views form one
                    privacy unit, clipped once. The batch size counts rows (4 views per
                    example), so the step takes batch / 4 examples and processes as many rows
                    as the ``nonprivate`` row of that batch size, its baseline.
  make_private_fit_user8
                    ``make_private(..., options=ExecutionOptions(group_size=8))``: user-level
                    units of 8 rows, batch / 8 units per step: the same rows as the baseline.

Engine-level breakdown (a hand-written step around one engine call; ratios to
``nonprivate_step`` when that row is run, else to ``nonprivate``):
  nonprivate_step   mean loss, one backward pass, apply, in one ``tf.function`` (no Keras
                    ``fit`` machinery): the breakdown's baseline.
  loop        a ``tf.while_loop`` over examples, batch size 1 each: per-example gradient, clip,
              accumulate (the textbook reference; slow).
  jacobian    ``tape.jacobian`` of the ``[B]`` per-example losses (what TF Privacy's
              microbatched optimizer does).
  vectorized  ``dpcore.engine.summarize(method="vectorized")``.
  fast        ``dpcore.engine.summarize(method="fast")`` (ghost norms + book-keeping).

KerasHub models (dpcore only, opt-in: not in the default ``--models``, no peer rows):
``bert``, ``gpt2`` (2 layers, hidden 256, T = 128, vocabulary 8192), ``bert_lora``,
``gpt2_lora`` (the same with rank-8 LoRA) and ``gpt2_small`` (12 layers, hidden 768, vocabulary
50257, T = 256); see :mod:`dpcore_experiments.lib.hub_models`. Both sides of a ratio compile alike:
SGD, the same loss, no metrics (a KerasHub task compiles itself with Adam and an accuracy
metric when it is built, and recompiling with ``metrics=None`` keeps that metric: the plain side
passes empty lists) and ``jit_compile=False`` (the ``DPModel`` default; plain Keras' ``"auto"``
would turn XLA on for the non-private side alone on a GPU).

Usage:
  python experiments/benchmark.py --models=mlp,cnn --methods=nonprivate,vectorized,fast \
      --batch_sizes=64,256 --steps=10 --json=bench.json
  python experiments/benchmark.py --models=bert,gpt2,bert_lora,gpt2_lora \
      --methods=nonprivate,make_private_fit --batch_sizes=32 --steps=5
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from absl import app, flags
from dpcore_experiments.lib import common

# The benchmark's parts, also for tests and the developer tools: steps, measurement, report.
from dpcore_experiments.lib.bench_measure import measure, planned_steps, profile_top_ops
from dpcore_experiments.lib.bench_report import (
    RESULT_PREFIX,
    add_ratios,
    fmt,
    format_tables,
    run_subprocess,
)
from dpcore_experiments.lib.bench_steps import (
    ENGINE_METHODS,
    FIT_METHODS,
    HUB_MODELS,
    METHODS,
    MODELS,
    SLOW_METHODS,
    UNIT_FIT_METHODS,
    USER_METHODS,
    build_model,
    fit_batch,
    make_batch,
    make_fit_model,
    make_train_step,
)

__all__ = [
    "ENGINE_METHODS",
    "FIT_METHODS",
    "HUB_MODELS",
    "METHODS",
    "MODELS",
    "PEER_METHODS",
    "RESULT_PREFIX",
    "SLOW_METHODS",
    "UNIT_FIT_METHODS",
    "USER_METHODS",
    "add_ratios",
    "build_model",
    "fit_batch",
    "format_tables",
    "make_batch",
    "make_fit_model",
    "make_train_step",
    "measure",
    "planned_steps",
    "profile_top_ops",
    "run_benchmark",
    "run_subprocess",
]

PEER_METHODS = ("nonprivate", "dpkeras", "dpsequential", "vectorized")
PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "bench.py")

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """Defines the command-line flags (called only when run as a program).

    Keeping flag definitions out of import time lets the experiment modules be imported
    together (tests, other binaries) without duplicate-flag errors.
    """
    flags.DEFINE_list(
        "models", list(MODELS), f"Models, from {MODELS}, or the opt-in KerasHub {HUB_MODELS}."
    )
    flags.DEFINE_list("methods", list(METHODS), f"dpcore methods, from {METHODS}.")
    flags.DEFINE_list("batch_sizes", ["64", "256", "1024"], "Batch sizes.")
    flags.DEFINE_integer("steps", 10, "Timed steps per configuration (the median is reported).")
    flags.DEFINE_integer("warmup", 2, "Untimed steps first (the first one traces).")
    flags.DEFINE_integer(
        "slow_max_batch",
        256,
        "loop/jacobian (and the peer's dpkeras/vectorized) rows above this batch size are skipped "
        "and marked so; they take minutes per step there.",
    )
    flags.DEFINE_integer("slow_steps", 3, "Timed steps for loop/jacobian rows (capped, marked).")
    flags.DEFINE_float(
        "step_budget_s",
        60.0,
        "Fewer timed steps (at least 3) where --steps of them would take longer than this.",
    )
    flags.DEFINE_float("row_timeout_s", 600.0, "Wall-clock limit of one configuration's process.")
    flags.DEFINE_float("max_rss_mb", 12000.0, "A configuration whose RSS passes this is stopped.")
    flags.DEFINE_float("l2_norm_clip", 1.0, "Clip bound C of the DP step.")
    flags.DEFINE_float("noise_multiplier", 1.0, "Noise multiplier of the DP step.")
    flags.DEFINE_float("learning_rate", 0.01, "SGD learning rate (every method).")
    flags.DEFINE_integer(
        "profile_ops",
        0,
        "If > 0 (dpcore rows only), profile --profile_steps more steps with the TensorFlow "
        "profiler after the timed ones and report the ops with the most self time per step.",
    )
    flags.DEFINE_integer("profile_steps", 5, "Steps profiled for --profile_ops.")
    flags.DEFINE_string("json", None, "Write the rows (a JSON list) here.")
    flags.DEFINE_string("markdown", None, "Write the tables (Markdown) here.")
    flags.DEFINE_bool("peer", False, "Also run TensorFlow Privacy 0.9.0 in its own TF 2.15 env.")
    flags.DEFINE_list(
        "peer_methods",
        ["nonprivate", "dpkeras", "dpsequential"],
        f"Peer methods, from {PEER_METHODS}.",
    )
    flags.DEFINE_string(
        "peer_python", None, "Python of the peer env (default: built on first use)."
    )
    flags.DEFINE_string("child", None, "Internal: run one 'model,method,batch' row and print it.")


def child_main(spec: str) -> None:
    """Runs one ``model,method,batch`` configuration and prints its row."""
    model_name, method, batch = spec.split(",")
    batch_size = int(batch)
    steps = FLAGS.slow_steps if method in SLOW_METHODS else FLAGS.steps
    row: dict[str, Any] = {"impl": "dpcore", "model": model_name, "method": method}
    row["batch_size"] = batch_size
    try:
        row.update(
            measure(
                model_name,
                method,
                batch_size,
                steps=steps,
                warmup=FLAGS.warmup,
                step_budget_s=FLAGS.step_budget_s,
                l2_norm_clip=FLAGS.l2_norm_clip,
                noise_multiplier=FLAGS.noise_multiplier,
                learning_rate=FLAGS.learning_rate,
                profile_ops=FLAGS.profile_ops,
                profile_steps=FLAGS.profile_steps,
            )
        )
        row["status"] = "ok"
        if row["steps_timed"] < FLAGS.steps:
            row["note"] = f"capped: {row['steps_timed']} timed steps"
    except Exception as err:  # reported in the row, not raised: the run goes on
        row["status"] = "unavailable" if isinstance(err, ImportError) else "error"
        msg = [ln for ln in str(err).splitlines() if ln.strip()]
        row["note"] = f"{type(err).__name__}: {(msg[-1] if msg else '')[:400]}"
    print(RESULT_PREFIX + json.dumps(row), flush=True)


def peer_python() -> str:
    """Path of the peer env's Python (TF 2.15.1 + tensorflow-privacy 0.9.0), built on first use.

    ``--peer_python`` if given, else :func:`dpcore_experiments.peers.env.ensure_peer_env`.
    """
    if FLAGS.peer_python:
        return FLAGS.peer_python
    from dpcore_experiments.peers.env import ensure_peer_env

    return str(ensure_peer_env())


def _rows_plan(models, methods, batch_sizes) -> list[tuple[str, str, int]]:
    plan = []
    for model in models:
        for b in batch_sizes:
            ordered = ["nonprivate"] + [m for m in methods if m != "nonprivate"]
            plan += [(model, m, b) for m in ordered]
    return plan


def _common_flags() -> list[str]:
    return [
        f"--steps={FLAGS.steps}",
        f"--warmup={FLAGS.warmup}",
        f"--slow_steps={FLAGS.slow_steps}",
        f"--step_budget_s={FLAGS.step_budget_s}",
        f"--l2_norm_clip={FLAGS.l2_norm_clip}",
        f"--noise_multiplier={FLAGS.noise_multiplier}",
        f"--learning_rate={FLAGS.learning_rate}",
    ]


def _check_choices() -> None:
    """A usage error for a model or method the benchmark does not know."""
    for m in FLAGS.models:
        if m not in MODELS + HUB_MODELS:
            raise app.UsageError(
                f"--models: unknown {m!r}; expected some of {MODELS} or {HUB_MODELS}."
            )
    for m in FLAGS.methods:
        if m not in METHODS:
            raise app.UsageError(f"--methods: unknown {m!r}; expected some of {METHODS}.")
    for m in FLAGS.peer_methods:
        if m not in PEER_METHODS:
            raise app.UsageError(f"--peer_methods: unknown {m!r}; expected some of {PEER_METHODS}.")


def _jobs() -> list[tuple[str, str, str, int]]:
    """(side, model, method, batch) of every row, in the order they run."""
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    # Side by side: each (model, batch) runs dpcore's rows, then the peer's, non-private first.
    jobs = []
    for model in FLAGS.models:
        for b in batch_sizes:
            jobs += [("dpcore", *c) for c in _rows_plan([model], FLAGS.methods, [b])]
            if FLAGS.peer and model not in HUB_MODELS:  # the peer has no KerasHub
                jobs += [("peer", *c) for c in _rows_plan([model], FLAGS.peer_methods, [b])]
    return jobs


def _row_command(side: str, model: str, method: str, b: int, peer_py: str | None) -> list[str]:
    """The command line of one row's process: this program as a child, or the peer's script."""
    if side == "dpcore":
        cmd = [sys.executable, os.path.abspath(__file__), f"--child={model},{method},{b}"]
        cmd += [
            f"--profile_ops={FLAGS.profile_ops}",
            f"--profile_steps={FLAGS.profile_steps}",
        ]
    else:
        cmd = [str(peer_py), PEER_SCRIPT, f"--model={model}", f"--method={method}"]
        cmd += [f"--batch_size={b}"]
    return cmd + _common_flags()


def _run_row(side: str, model: str, method: str, b: int, peer_py: str | None) -> dict[str, Any]:
    """One row: measured in its own process, or skipped (a slow method past its batch cap)."""
    slow = method in (SLOW_METHODS if side == "dpcore" else ("dpkeras", "vectorized"))
    row = {"impl": "dpcore" if side == "dpcore" else "tf_privacy-0.9.0"}
    row.update(model=model, method=method, batch_size=b, median_ms=None, peak_rss_mb=None)
    if slow and b > FLAGS.slow_max_batch:
        row.update(status="skipped", note=f"batch > --slow_max_batch={FLAGS.slow_max_batch}")
        return row
    row.update(
        run_subprocess(
            _row_command(side, model, method, b, peer_py),
            timeout_s=FLAGS.row_timeout_s,
            max_rss_mb=FLAGS.max_rss_mb,
        )
    )
    row["impl"] = "dpcore" if side == "dpcore" else "tf_privacy-0.9.0"
    return row


def run_benchmark() -> list[dict]:
    """Runs every configuration (and the peer's, with ``--peer``); returns rows with ratios."""
    _check_choices()
    jobs = _jobs()
    peer_py = peer_python() if FLAGS.peer else None
    rows = []
    for k, (side, model, method, b) in enumerate(jobs, 1):
        row = _run_row(side, model, method, b, peer_py)
        print(
            f"[{k}/{len(jobs)}] {row['impl']} {model} {method} b={b}: {row.get('status')} "
            f"{fmt(row.get('median_ms'))} ms, peak RSS {fmt(row.get('peak_rss_mb'), '.0f')} MB"
            + (f" ({row['note']})" if row.get("note") else ""),
            flush=True,
        )
        rows.append(row)
        if FLAGS.json:  # rows so far, so an interrupted run keeps what it measured
            common.write_json_atomic(FLAGS.json, add_ratios([dict(r) for r in rows]), indent=1)
    return add_ratios(rows)


def main(argv: Sequence[str]) -> None:
    del argv
    if FLAGS.child:
        child_main(FLAGS.child)
        return
    rows = run_benchmark()
    tables = format_tables(rows)
    print(tables)
    if FLAGS.json:
        common.write_json_atomic(FLAGS.json, rows, indent=1)
    if FLAGS.markdown:
        with open(FLAGS.markdown, "w") as f:
            f.write(tables)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
