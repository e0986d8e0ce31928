"""dpcore-epsilon: ε of a DP-SGD run, or the noise multiplier for a target ε.

Contract: builds one `DPConfig` (`dpcore.DPConfig`, the same object as this package's) from the
flags and prints (and optionally writes as JSON) what
dp-accounting says about its DpEvent. Neither the program nor `compute` imports TensorFlow (or
`dpcore`), so a query answers in about a second instead of after TensorFlow's multi-second
import. Give `--noise_multiplier` to get ε, or `--target_epsilon` to get the calibrated noise
multiplier (and its ε). Shuffled batches get the sound no-amplification bound;
`--poisson_assumption` adds the Poisson figure, labelled as an assumption. `--privacy_unit`
names what one unit is: with `user`, `--num_examples` and `--batch_size` count users, the event
samples users, and the output says "epsilon per user". `--max_examples_per_user=k` adds, next to
the example-level ε, the ε per user of an example-level run in which no user has more than k
examples (group privacy, `DPConfig.planned_epsilon(max_examples_per_user=k)`). Bad flag values
exit with a message naming the flag.

Examples:
  dpcore-epsilon --num_examples=60000 --batch_size=256 --epochs=60 --noise_multiplier=1.1
  dpcore-epsilon --num_examples=60000 --batch_size=256 --epochs=60 --target_epsilon=3
  dpcore-epsilon --privacy_unit=user --num_examples=5000 --batch_size=50 --steps=2000 \
      --noise_multiplier=1.0
  dpcore-epsilon --num_examples=10000 --batch_size=64 --epochs=5 --noise_multiplier=1.0 \
      --max_examples_per_user=3
"""

from __future__ import annotations

import json
import math
import warnings
from typing import Any, cast

from absl import flags

from dpcore_accounting import _program
from dpcore_accounting.config import DPConfig

FLAGS = flags.FLAGS
PRIVACY_UNITS = ("example", "user")


def _define_flags() -> None:
    """Defines the flags (only when run as a program, so the module imports cleanly)."""
    flags.DEFINE_integer("num_examples", None, "Dataset size N, in privacy units.")
    flags.DEFINE_float(
        "batch_size",
        None,
        "Expected logical batch size (Poisson) or fixed batch size (shuffle), in privacy units.",
    )
    flags.DEFINE_float("epochs", None, "Passes over the data (give this or --steps).")
    flags.DEFINE_integer("steps", None, "Logical steps (give this or --epochs).")
    flags.DEFINE_float("noise_multiplier", None, "σ (give this or --target_epsilon).")
    flags.DEFINE_float("target_epsilon", None, "Calibrate σ for this ε instead.")
    flags.DEFINE_float("delta", 1e-5, "δ.")
    flags.DEFINE_enum("sampling", "poisson", ["poisson", "shuffle"], "Batch sampling scheme.")
    flags.DEFINE_enum("accountant", "pld", ["pld", "rdp"], "dp-accounting accountant.")
    flags.DEFINE_enum(
        "neighboring", "add_remove", ["add_remove", "replace_one"], "Adjacency relation."
    )
    flags.DEFINE_enum(
        "privacy_unit",
        "example",
        list(PRIVACY_UNITS),
        "What one privacy unit is. example: one row. user: all of a user's rows, sampled "
        "together (dpcore.units.unit_batches); --num_examples and --batch_size then count "
        "users and epsilon is per user (add/remove one user).",
    )
    flags.DEFINE_boolean(
        "poisson_assumption",
        False,
        "With --sampling=shuffle, also report ε as if batches were Poisson sampled (an "
        "assumption, not a guarantee).",
    )
    flags.DEFINE_integer(
        "max_examples_per_user",
        None,
        "Also report epsilon per user for users with at most this many examples each (group "
        "privacy over an example-level run).",
    )
    flags.DEFINE_string("output_json", None, "Write the result as JSON to this path.")


def _check_arguments(
    *,
    epochs: float | None,
    steps: int | None,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    privacy_unit: str,
    max_examples_per_user: int | None,
) -> None:
    """The checks `DPConfig` does not make: one of each pair, known unit, k >= 1."""
    if (epochs is None) == (steps is None):
        raise ValueError(f"give exactly one of --epochs or --steps, got {epochs!r} and {steps!r}.")
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError(
            "give exactly one of --noise_multiplier or --target_epsilon, got "
            f"{noise_multiplier!r} and {target_epsilon!r}."
        )
    if privacy_unit not in PRIVACY_UNITS:
        raise ValueError(f"--privacy_unit must be one of {PRIVACY_UNITS}, got {privacy_unit!r}.")
    if max_examples_per_user is not None and (
        isinstance(max_examples_per_user, bool)
        or not isinstance(max_examples_per_user, int)
        or max_examples_per_user < 1
    ):
        raise ValueError(
            f"--max_examples_per_user must be an integer >= 1, got {max_examples_per_user!r}."
        )


def compute(
    *,
    num_examples: int,
    batch_size: float,
    epochs: float | None,
    steps: int | None,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    delta: float,
    sampling: str,
    accountant: str,
    neighboring: str = "add_remove",
    poisson_assumption: bool = False,
    privacy_unit: str = "example",
    max_examples_per_user: int | None = None,
) -> dict[str, Any]:
    """The result dict the CLI prints/writes (also usable from Python).

    `num_examples` and `batch_size` count privacy units (`privacy_unit`, e.g. users), and
    the ε is per unit. With `max_examples_per_user=k`, also `epsilon_per_user`: the ε of
    adding or removing one user who has at most k units (group privacy), at the same δ.
    """
    _check_arguments(
        epochs=epochs,
        steps=steps,
        noise_multiplier=noise_multiplier,
        target_epsilon=target_epsilon,
        privacy_unit=privacy_unit,
        max_examples_per_user=max_examples_per_user,
    )
    fields: dict[str, Any] = dict(
        l2_norm_clip=1.0,  # does not affect ε
        expected_batch_size=batch_size,
        num_examples=num_examples,
        sampling=sampling,
        target_delta=delta,
        neighboring=neighboring,
        privacy_unit=privacy_unit,
    )
    if target_epsilon is not None:
        config = DPConfig.calibrated(
            target_epsilon=target_epsilon,
            accountant=accountant,
            steps=steps,
            epochs=epochs,
            **fields,
        )
    else:  # _check_arguments: noise_multiplier is given, and exactly one of steps and epochs
        sigma = cast(float, noise_multiplier)
        if steps is not None:
            config = DPConfig(noise_multiplier=sigma, steps=steps, **fields)
        else:
            config = DPConfig.from_epochs(
                epochs=cast(float, epochs), noise_multiplier=sigma, **fields
            )
    result: dict[str, Any] = {
        "epsilon": config.planned_epsilon(accountant),
        "delta": config.target_delta,
        "noise_multiplier": config.noise_multiplier,
        "steps": config.steps,
        "epochs": config.epochs,
        "sampling_prob": config.sampling_prob,
        "num_examples": config.num_examples,
        "batch_size": config.expected_batch_size,
        "accountant": accountant,
        "sampling": config.sampling,
        "neighboring": config.neighboring,
        "privacy_unit": config.privacy_unit,
        "target_epsilon": target_epsilon,
        "calibrated": target_epsilon is not None,
        "accounting": config.accounting_note(),
        "dp_event": str(config.dp_event()),
        "delta_warning": config.target_delta >= 1.0 / config.num_examples,
    }
    if poisson_assumption and config.sampling == "shuffle":
        result["epsilon_assuming_poisson"] = config.planned_epsilon(accountant, assume_poisson=True)
        result["epsilon_assuming_poisson_note"] = (
            "ASSUMPTION: as if batches were Poisson sampled with the same rate; shuffled "
            "batches do not provably get this amplification."
        )
    if max_examples_per_user is not None:
        result["max_examples_per_user"] = max_examples_per_user
        result["epsilon_per_user"] = config.planned_epsilon(
            accountant, max_examples_per_user=max_examples_per_user
        )
        if "epsilon_assuming_poisson" in result:
            result["epsilon_per_user_assuming_poisson"] = config.planned_epsilon(
                accountant, max_examples_per_user=max_examples_per_user, assume_poisson=True
            )
    return result


def format_result(result: dict[str, Any]) -> str:
    """Human-readable lines for a `compute` result."""
    lines = []
    if result["calibrated"]:
        lines.append(
            f"noise_multiplier = {result['noise_multiplier']:.6f} (calibrated for "
            f"epsilon <= {result['target_epsilon']})"
        )
    adjacency = f"{result['neighboring']} adjacency"
    if result["sampling"] == "shuffle" and result["neighboring"] == "add_remove":
        # Fixed batch positions: one example's contribution added or zeroed, see ACCOUNTING.md.
        adjacency = "zero-out adjacency"
    unit = result["privacy_unit"]
    # Example-level ε keeps the plain "epsilon = ..." line; any other unit is named in it.
    per, units = ("", "") if unit == "example" else (f" per {unit}", f" {unit}s")
    lines.append(
        f"epsilon{per} = {result['epsilon']:.4f} at delta = {result['delta']:g} "
        f"({result['accountant'].upper()}, {adjacency})"
    )
    lines.append(
        f"N = {result['num_examples']}{units}, batch = {result['batch_size']:g}{units}, "
        f"q = {result['sampling_prob']:.6g}, steps = {result['steps']}, "
        f"epochs = {result['epochs']:.4g}, noise_multiplier = {result['noise_multiplier']:.6g}"
    )
    lines.append(f"accounting: {result['accounting']}")
    if "epsilon_assuming_poisson" in result:
        lines.append(
            f"epsilon assuming Poisson sampling = {result['epsilon_assuming_poisson']:.4f} "
            "(an assumption, not a guarantee)"
        )
    if "epsilon_per_user" in result:
        k = result["max_examples_per_user"]
        each = "example" if unit == "example" else unit
        lines.append(
            f"epsilon per user with at most {k} {each}s = {result['epsilon_per_user']:.4f} at "
            f"delta = {result['delta']:g} (group privacy; a user with more {each}s is not "
            "covered)"
        )
        if "epsilon_per_user_assuming_poisson" in result:
            lines.append(
                "epsilon per user assuming Poisson sampling = "
                f"{result['epsilon_per_user_assuming_poisson']:.4f} (an assumption, not a "
                "guarantee)"
            )
    if result["delta_warning"]:
        lines.append(
            f"WARNING: delta = {result['delta']:g} >= 1/N = {1.0 / result['num_examples']:.3g}; "
            "choose delta well below 1/N."
        )
    return "\n".join(lines)


HELP = """dpcore-epsilon: the ε of a DP-SGD run, or the noise multiplier for a target ε.

Give the dataset size and batch size (in privacy units), the length of the run (--epochs or
--steps) and either --noise_multiplier (prints ε) or --target_epsilon (prints the calibrated
noise multiplier). --max_examples_per_user=k adds ε per user for users with at most k
examples (group privacy). Needs no TensorFlow; answers in about a second.

Examples:
  dpcore-epsilon --num_examples=60000 --batch_size=256 --epochs=60 --noise_multiplier=1.1
  dpcore-epsilon --num_examples=60000 --batch_size=256 --epochs=60 --target_epsilon=3
  dpcore-epsilon --privacy_unit=user --num_examples=5000 --batch_size=50 --steps=2000 \\
      --noise_multiplier=1.0
"""


def prepare(argv: list[str]) -> None:
    """Checks the flags that need no accounting, and that --output_json can be written."""
    _program.check_no_arguments(argv)
    if FLAGS.num_examples is None or FLAGS.batch_size is None:
        raise _program.UserError("--num_examples and --batch_size are required (see --help).")
    if FLAGS.output_json:
        _program.check_writable_file(FLAGS.output_json, "output_json")


def main(argv: list[str] | None = None) -> int:
    """Prints (and optionally writes) the result; bad values raise `_program.UserError`."""
    del argv
    with _program.user_errors(ValueError), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # δ >= 1/N is reported below
        result = compute(
            num_examples=FLAGS.num_examples,
            batch_size=FLAGS.batch_size,
            epochs=FLAGS.epochs,
            steps=FLAGS.steps,
            noise_multiplier=FLAGS.noise_multiplier,
            target_epsilon=FLAGS.target_epsilon,
            delta=FLAGS.delta,
            sampling=FLAGS.sampling,
            accountant=FLAGS.accountant,
            neighboring=FLAGS.neighboring,
            poisson_assumption=FLAGS.poisson_assumption,
            privacy_unit=FLAGS.privacy_unit,
            max_examples_per_user=FLAGS.max_examples_per_user,
        )
    print(format_result(result))
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    k: (None if isinstance(v, float) and math.isinf(v) else v)
                    for k, v in result.items()
                }
                | {"epsilon_is_infinite": math.isinf(result["epsilon"])},
                f,
                indent=2,
                sort_keys=True,
            )
    return 0


def run() -> None:
    """Console-script entry point (`dpcore-epsilon`)."""
    _program.run_program(prepare=prepare, execute=main, define_flags=_define_flags, help_text=HELP)


if __name__ == "__main__":
    run()
