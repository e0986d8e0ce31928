"""Soak test: long ``make_private(...).fit`` runs hold their memory, traces and accounting.

Runs two phases in one process, each one ``fit`` over one pass of a Poisson sampler
(``dpcore.sampling.poisson_batches``, fixed-shape padded batches):

1. ``--mlp_steps`` logical steps on the benchmark MLP (784-512-256-10) on synthetic data;
2. ``--hub_steps`` logical steps on a small randomly initialized KerasHub task model
   (``--hub_model``: GPT-2 causal LM or BERT classifier, sizes from the flags; nothing is
   downloaded).

For each phase it reports, after logical step ``--check_step`` and at the end:

- the resident memory (``VmRSS``) and its peak (``VmHWM``, reset at the start of the phase where
  Linux allows it), and the growth of the peak from the check step to the end;
- how often the train step was traced (``DPModel.train_step`` runs only while Keras traces it) and
  the shared norm bodies of :mod:`dpcore.norms` (how many, and how often they were traced): all
  must stay constant after the check step;
- ε of the steps the optimizer applied (``EpsilonCallback``) against dp-accounting's PLD
  accountant called directly on ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` composed
  ``dp_steps`` times, and ``dp_steps`` against the steps sampled.

A check fails when the peak memory grows by ``--max_rss_growth`` or more after the check step,
when a count of traces or bodies changes after it, when the applied steps differ from the sampled
ones, or when the two ε differ by more than 1e-9 relative. The summary is printed as JSON (and
written to ``--json``); the exit status is 1 when a check failed.

Usage (the issue's lengths):
  python experiments/dev/soak.py --mlp_steps=5000 --hub_steps=2000 --json=runs/soak.json

Privacy:
  Synthetic data; the runs clip and noise every step and account with dp-accounting, but the
  figures are only a consistency check.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from absl import flags
from dpcore_experiments.lib import cli, common

FLAGS = flags.FLAGS
HUB_ARCHITECTURES = ("gpt2", "bert")


def _define_flags() -> None:
    flags.DEFINE_integer("mlp_steps", 5000, "Logical steps on the MLP (0: skip the phase).")
    flags.DEFINE_integer("hub_steps", 2000, "Logical steps on the KerasHub model (0: skip).")
    flags.DEFINE_integer(
        "check_step", 500, "Step after which memory and traces are first read (per phase)."
    )
    flags.DEFINE_integer("mlp_examples", 8192, "Synthetic MLP dataset size N.")
    flags.DEFINE_float("mlp_batch_size", 64.0, "Expected MLP batch size (q = this / N).")
    flags.DEFINE_enum("hub_model", "gpt2", list(HUB_ARCHITECTURES), "KerasHub task model.")
    flags.DEFINE_integer("hub_examples", 1024, "Synthetic token dataset size N.")
    flags.DEFINE_float("hub_batch_size", 8.0, "Expected KerasHub batch size.")
    flags.DEFINE_integer("hub_layers", 2, "Transformer layers.")
    flags.DEFINE_integer("hub_hidden", 64, "Hidden size.")
    flags.DEFINE_integer("hub_sequence", 32, "Sequence length.")
    flags.DEFINE_integer("hub_vocabulary", 257, "Vocabulary size.")
    flags.DEFINE_float("l2_norm_clip", 1.0, "C.")
    flags.DEFINE_float("noise_multiplier", 1.0, "σ.")
    flags.DEFINE_float("learning_rate", 0.05, "SGD learning rate.")
    flags.DEFINE_float("target_delta", 1e-5, "δ for ε.")
    flags.DEFINE_float(
        "max_rss_growth", 0.05, "Largest allowed relative growth of the peak RSS after check_step."
    )
    flags.DEFINE_integer("seed", 0, "Seed of the data, the weights and the sampler.")
    flags.DEFINE_string("json", None, "Write the summary here too.")


def _memory() -> dict[str, float | None]:
    rss, hwm = common.proc_status_kb("VmRSS"), common.proc_status_kb("VmHWM")
    return {
        "rss_mb": None if rss is None else round(rss / 1024, 1),
        "peak_rss_mb": round(hwm / 1024 if hwm is not None else common.peak_rss_mb(), 1),
    }


def _shared_bodies() -> dict[str, int]:
    """The shared norm bodies of :mod:`dpcore.norms` and how often they were traced in total."""
    from dpcore import norms

    bodies = list(norms._BODIES.values())
    return {
        "shared_norm_bodies": len(bodies),
        "shared_body_traces": sum(int(f.experimental_get_tracing_count()) for f in bodies),
    }


def _make_probe(check_step: int, traces: list[int]) -> Any:
    import keras

    class Probe(keras.callbacks.Callback):
        """Reads memory and trace counts after ``check_step`` logical steps and at the end."""

        def __init__(self) -> None:
            super().__init__()
            self.at_check: dict[str, Any] | None = None
            self.at_end: dict[str, Any] | None = None
            self.started = 0.0

        def snapshot(self, step: int) -> dict[str, Any]:
            return {
                "step": step,
                "seconds": round(time.perf_counter() - self.started, 1),
                **_memory(),
                "train_step_traces": traces[0],
                **_shared_bodies(),
            }

        def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            if batch + 1 == check_step:  # one Keras batch is one logical step here
                self.at_check = self.snapshot(batch + 1)

        def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
            steps = int(keras.ops.convert_to_numpy(self.model.optimizer.dp_steps))
            self.at_end = self.snapshot(steps)

    return Probe()


def direct_epsilon(
    *, sampling_prob: float, noise_multiplier: float, steps: int, delta: float
) -> float:
    """ε of ``steps`` Poisson-sampled Gaussian steps from dp-accounting's PLD accountant."""
    import dp_accounting

    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                sampling_prob, dp_accounting.GaussianDpEvent(noise_multiplier)
            ),
            steps,
        )
    )
    return float(accountant.get_epsilon(delta))


def soak_phase(
    name: str,
    model: Any,
    x: Any,
    y: Any,
    *,
    steps: int,
    expected_batch_size: float,
    check_step: int,
    l2_norm_clip: float,
    noise_multiplier: float,
    learning_rate: float,
    target_delta: float,
    max_rss_growth: float,
    seed: int,
) -> dict[str, Any]:
    """One ``fit`` of ``steps`` logical steps on ``model``; the phase's report and checks."""
    import keras

    import dpcore

    n = dpcore.sampling.num_examples(x, y)
    q = expected_batch_size / n
    config = dpcore.DPConfig(
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        num_examples=n,
        steps=steps,
        target_delta=target_delta,
    )
    dp = dpcore.make_private(
        model,
        optimizer=keras.optimizers.SGD(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        config=config,
    )
    traces = [0]
    step = dp.train_step

    def counted(data: Any) -> Any:  # runs while Keras traces the train function only
        traces[0] += 1
        return step(data)

    dp.train_step = counted
    probe = _make_probe(check_step, traces)
    epsilon = dpcore.callbacks.EpsilonCallback(config)
    data = dpcore.sampling.poisson_batches(x, y, sampling_prob=q, steps=steps, seed=seed)
    peak_reset = common.reset_peak_rss()
    dp.fit(data, epochs=1, verbose=0, callbacks=[epsilon, probe])
    applied = int(dp.optimizer.dp_steps.numpy())
    eps = float(epsilon.epsilon())
    direct = direct_epsilon(
        sampling_prob=q, noise_multiplier=noise_multiplier, steps=applied, delta=target_delta
    )
    at_check, at_end = probe.at_check, probe.at_end
    assert at_end is not None
    report: dict[str, Any] = {
        "phase": name,
        "steps": steps,
        "applied_steps": applied,
        "num_examples": n,
        "sampling_prob": q,
        "noise_multiplier": noise_multiplier,
        "peak_reset": peak_reset,
        "at_check": at_check,
        "at_end": at_end,
        "epsilon": eps,
        "epsilon_dp_accounting": direct,
    }
    _add_checks(report, max_rss_growth=max_rss_growth)
    return report


def _add_checks(report: dict[str, Any], *, max_rss_growth: float) -> None:
    """The phase's checks: every step applied, ε as dp-accounting computes it, and from the
    check step on, flat peak memory, no new traces."""
    at_check, at_end = report["at_check"], report["at_end"]
    eps, direct = report["epsilon"], report["epsilon_dp_accounting"]
    checks = {
        "steps_applied": report["applied_steps"] == report["steps"],
        "epsilon_matches": abs(eps - direct) <= 1e-9 * max(abs(direct), 1.0),
    }
    if at_check is not None:
        growth = at_end["peak_rss_mb"] / at_check["peak_rss_mb"] - 1.0
        report["peak_rss_growth"] = round(growth, 4)
        checks["peak_rss_growth"] = growth < max_rss_growth
        for key in ("train_step_traces", "shared_norm_bodies", "shared_body_traces"):
            checks[f"{key}_constant"] = at_check[key] == at_end[key]
    report["checks"] = checks
    report["ok"] = all(checks.values())


def mlp_phase(steps: int) -> dict[str, Any]:
    import numpy as np
    from dpcore_experiments.lib import bench_steps as bench

    n = FLAGS.mlp_examples
    rng = np.random.default_rng(FLAGS.seed)
    x = rng.random((n, 784), dtype=np.float32)
    y = rng.integers(0, 10, n).astype("int32")
    return soak_phase(
        "mlp",
        bench.build_model("mlp", seed=FLAGS.seed),
        x,
        y,
        steps=steps,
        expected_batch_size=FLAGS.mlp_batch_size,
        **_common_args(),
    )


def hub_phase(steps: int) -> dict[str, Any]:
    import keras
    import numpy as np
    from dpcore_experiments.lib import hub_models

    size = hub_models.HubSize(
        num_layers=FLAGS.hub_layers,
        hidden_dim=FLAGS.hub_hidden,
        num_heads=2,
        intermediate_dim=2 * FLAGS.hub_hidden,
        vocabulary_size=FLAGS.hub_vocabulary,
        sequence_length=FLAGS.hub_sequence,
    )
    keras.utils.set_random_seed(FLAGS.seed)
    model = hub_models.build_task(FLAGS.hub_model, size)
    n, t = FLAGS.hub_examples, FLAGS.hub_sequence
    rng = np.random.default_rng(FLAGS.seed)
    ids = rng.integers(1, size.vocabulary_size, (n, t)).astype("int32")
    x = hub_models.inputs_for(FLAGS.hub_model, ids, np.ones((n, t), "int32"))
    if FLAGS.hub_model == "gpt2":
        y = rng.integers(1, size.vocabulary_size, (n, t)).astype("int32")
    else:
        y = rng.integers(0, 2, n).astype("int32")
    return soak_phase(
        f"hub_{FLAGS.hub_model}",
        model,
        x,
        y,
        steps=steps,
        expected_batch_size=FLAGS.hub_batch_size,
        **_common_args(),
    )


def _common_args() -> dict[str, Any]:
    return {
        "check_step": FLAGS.check_step,
        "l2_norm_clip": FLAGS.l2_norm_clip,
        "noise_multiplier": FLAGS.noise_multiplier,
        "learning_rate": FLAGS.learning_rate,
        "target_delta": FLAGS.target_delta,
        "max_rss_growth": FLAGS.max_rss_growth,
        "seed": FLAGS.seed,
    }


HELP = """Soak test of long DP training runs: memory, traces and epsilon stay put.

Runs --mlp_steps logical steps of make_private(...).fit on an MLP (784-512-256-10) and
--hub_steps on a small random KerasHub model, with Poisson sampling and synthetic data; reports
the peak memory after --check_step and at the end, the traced train steps and shared norm
bodies, and epsilon against dp-accounting's. Exits with status 1 when a check fails.

Example:
  python experiments/dev/soak.py --mlp_steps=5000 --hub_steps=2000 --json=runs/soak.json
"""


def prepare(argv: list[str]) -> None:
    """Checks the flags (no TensorFlow)."""
    cli.check_no_arguments(argv)
    if FLAGS.check_step < 1:
        raise cli.UserError(f"--check_step={FLAGS.check_step}: must be >= 1.")
    for flag in ("mlp_steps", "hub_steps", "mlp_examples", "hub_examples"):
        if getattr(FLAGS, flag) < 0:
            raise cli.UserError(f"--{flag}={getattr(FLAGS, flag)}: must be >= 0.")
    if FLAGS.json:
        cli.check_writable_file(FLAGS.json, "json")


def execute(prepared: None) -> int:
    """Runs the phases, prints the summary (JSON); 1 when a check failed."""
    del prepared
    phases = []
    if FLAGS.mlp_steps:
        print(f"mlp: {FLAGS.mlp_steps} steps ...", file=sys.stderr, flush=True)
        phases.append(mlp_phase(FLAGS.mlp_steps))
    if FLAGS.hub_steps:
        print(f"{FLAGS.hub_model}: {FLAGS.hub_steps} steps ...", file=sys.stderr, flush=True)
        phases.append(hub_phase(FLAGS.hub_steps))
    summary = {"phases": phases, "ok": all(p["ok"] for p in phases)}
    print(json.dumps(summary, indent=1))
    if FLAGS.json:
        common.write_json_atomic(FLAGS.json, summary)
    return 0 if summary["ok"] else 1


def run_program() -> None:
    """Entry point."""
    cli.run_program(prepare=prepare, execute=execute, define_flags=_define_flags, help_text=HELP)


if __name__ == "__main__":
    run_program()
