"""The settings of a `dpcore-train` run and what follows from them: the schedule, σ, the ε report.

Contract:
  * `TrainSettings` mirrors the command-line flags; its checks name the flag that is wrong.
  * `make_plan` reads the schedule and σ off the run's `DPConfig` (`dp_config`), the object the
    accountant, the optimizer and the epsilon CLI all use, so what is accounted is what runs.
  * `privacy_report` gives ε by PLD and RDP of the steps a ledger holds (those that ran).
  * Standard library only at import time; dpcore is imported where it is used.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

DATASETS = ("digits", "fashion_mnist", "mnist")
MODELS = ("mlp", "cnn", "scatter_linear")
OPTIMIZERS = ("sgd", "adam")
SAMPLING = ("poisson", "shuffle")
PRIVACY_UNITS = ("example", "user")
RESULTS_FILE = "results.json"
CHECKPOINT_DIR = "checkpoint"


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Everything one training run depends on (mirrors the command-line flags)."""

    dataset: str = "digits"
    data_dir: str | None = None
    model: str = "mlp"
    optimizer: str = "sgd"
    learning_rate: float = 0.2
    momentum: float = 0.9
    epochs: int = 10
    batch_size: int = 128
    l2_norm_clip: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = 3.0
    target_delta: float = 1e-5
    sampling: str = "poisson"
    privacy_unit: str = "example"
    max_rows_per_user: int = 8
    num_users: int | None = None
    dp: bool = True
    seed: int | None = None
    output_dir: str | None = None
    resume: bool = False
    stop_after_epochs: int | None = None
    eval_batch_size: int = 1024
    train_eval_examples: int = 10000
    validation_examples: int = 0
    feature_cache: str | None = None
    verbose: int = 1

    def __post_init__(self) -> None:
        # Messages name the command-line flag (--delta is the field target_delta).
        checks = [
            (self.dataset in DATASETS, f"--dataset must be one of {DATASETS}"),
            (self.model in MODELS, f"--model must be one of {MODELS}"),
            (self.optimizer in OPTIMIZERS, f"--optimizer must be one of {OPTIMIZERS}"),
            (self.sampling in SAMPLING, f"--sampling must be one of {SAMPLING}"),
            (self.privacy_unit in PRIVACY_UNITS, f"--privacy_unit must be one of {PRIVACY_UNITS}"),
            (self.max_rows_per_user >= 1, "--max_rows_per_user must be >= 1"),
            (self.num_users is None or self.num_users >= 1, "--num_users must be >= 1"),
            (self.epochs >= 1, "--epochs must be >= 1"),
            (self.validation_examples >= 0, "--validation_examples must be >= 0"),
            (self.batch_size >= 1, "--batch_size must be >= 1"),
            (self.learning_rate > 0, "--learning_rate must be > 0"),
            (self.l2_norm_clip > 0, "--l2_norm_clip must be > 0"),
            (0 < self.target_delta < 1, "--delta must be in (0, 1)"),
        ]
        for ok, message in checks:
            if not ok:
                field = message.split()[0][2:]
                value = getattr(self, "target_delta" if field == "delta" else field)
                raise ValueError(f"{message}, got {value!r}.")
        if self.dp and self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("A DP run needs --noise_multiplier or --target_epsilon.")
        if self.noise_multiplier is not None and self.target_epsilon is not None:
            raise ValueError("Give --noise_multiplier or --target_epsilon, not both.")
        if self.dp and self.target_epsilon is not None and self.target_epsilon <= 0:
            raise ValueError(f"--target_epsilon must be > 0, got {self.target_epsilon}.")
        if self.resume and not self.output_dir:
            raise ValueError("--resume needs --output_dir (where the checkpoint is).")
        if self.privacy_unit == "user" and self.sampling != "poisson":
            raise ValueError("--privacy_unit=user samples users with Poisson sampling only.")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Derived schedule and σ, all read off the run's DPConfig.

    Epoch k (from 0) runs logical steps ``[epoch_end_steps[k-1], epoch_end_steps[k])``; the ends
    are ``DPConfig.steps_for_epochs(k + 1)``, the library's one definition of "steps after E
    epochs", so the run trains exactly the steps the accountant and the epsilon CLI count.
    """

    num_examples: int  # privacy units: rows, or users under --privacy_unit=user
    epoch_end_steps: tuple[int, ...]
    total_steps: int
    expected_batch_size: float
    sampling_prob: float
    noise_multiplier: float | None

    def epoch_start(self, epoch: int) -> int:
        """The logical step the epoch starts at (0 for the first)."""
        return 0 if epoch == 0 else self.epoch_end_steps[epoch - 1]

    def epoch_steps(self, epoch: int) -> int:
        """Logical steps in the epoch: ceil(N / B), the library's steps per epoch."""
        return self.epoch_end_steps[epoch] - self.epoch_start(epoch)


def dp_config(settings: TrainSettings, num_examples: int, noise_multiplier: float) -> Any:
    """The frozen DPConfig describing the whole run (what is accounted is what runs)."""
    from dpcore.config import DPConfig

    return DPConfig.from_epochs(
        epochs=settings.epochs,
        l2_norm_clip=settings.l2_norm_clip,
        noise_multiplier=noise_multiplier,
        expected_batch_size=float(min(settings.batch_size, num_examples)),
        num_examples=num_examples,
        sampling=settings.sampling,
        target_delta=settings.target_delta,
        privacy_unit=settings.privacy_unit,
    )


def make_plan(settings: TrainSettings, num_examples: int) -> Plan:
    """The run's schedule and σ (calibrated by the accountant when --target_epsilon is given)."""
    from dpcore.config import DPConfig

    config = dp_config(settings, num_examples, settings.noise_multiplier or 0.0)
    noise = settings.noise_multiplier
    if settings.dp and settings.target_epsilon is not None:
        fields = config.to_dict()
        for derived in ("noise_multiplier", "sampling_prob", "epochs"):
            fields.pop(derived)
        noise = float(
            DPConfig.calibrated(target_epsilon=settings.target_epsilon, **fields).noise_multiplier
        )
    return Plan(
        num_examples=num_examples,
        epoch_end_steps=tuple(config.steps_for_epochs(k) for k in range(1, settings.epochs + 1)),
        total_steps=config.steps,
        expected_batch_size=config.expected_batch_size,
        sampling_prob=config.sampling_prob,
        noise_multiplier=noise if settings.dp else None,
    )


def privacy_report(settings: TrainSettings, ledger: Any) -> dict[str, Any]:
    """ε by PLD and RDP of the steps the ledger holds (those the optimizer applied)."""
    if not settings.dp:
        return {"dp": False, "epsilon": math.inf, "note": "non-private baseline"}
    delta = settings.target_delta
    report: dict[str, Any] = {
        "dp": True,
        "steps": ledger.steps,
        "target_delta": delta,
        "privacy_unit": settings.privacy_unit,
    }
    if ledger.steps == 0:
        report.update(epsilon=0.0, epsilon_pld=0.0, epsilon_rdp=0.0, dp_event=None)
        return report
    report["dp_event"] = str(ledger.dp_event())
    report["epsilon_pld"] = float(ledger.epsilon(target_delta=delta, accountant="pld"))
    report["epsilon_rdp"] = float(ledger.epsilon(target_delta=delta, accountant="rdp"))
    report["epsilon"] = report["epsilon_pld"]
    report["accounting"] = (
        "Poisson subsampled Gaussian (PoissonSampledDpEvent)"
        if settings.sampling == "poisson"
        else "shuffled batches: no-amplification bound (each epoch composes as Gaussian "
        "mechanisms; no Poisson amplification assumed)"
    )
    if settings.privacy_unit == "user":
        report["accounting"] += (
            "; over users: epsilon per user (add/remove one user with all their rows)"
        )
    return report
