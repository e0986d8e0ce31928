"""DPConfig: one frozen description of a DP-SGD run, from which everything is derived.

Contract:
  * A `DPConfig` fixes the clip norm C, the noise multiplier σ, the expected size of one
    LOGICAL batch, the dataset size N, the number of logical steps, the sampling mode and the
    adjacency. The sampler (q = expected_batch_size / N), the optimizer's normalization
    (divide the noisy clipped sum by expected_batch_size) and the accountant's DpEvent all
    come from the same object, so what is accounted is what ran.
  * `accumulation_steps` only splits a logical batch into micro-batches to save memory; noise
    is added once per logical step, so it does not change the DpEvent.
  * `sampling="poisson"`: the event is Poisson-subsampled Gaussian steps.
    `sampling="shuffle"`: fixed-size shuffled batches (expected_batch_size is the batch
    size); the event is the sound no-amplification bound, one Gaussian mechanism per
    (possibly partial) epoch of ceil(N / B) steps. `assume_poisson=True` gives the Poisson
    figure for shuffled batches, which is an assumption and must be labelled as one.
  * Counts are in privacy units: `num_examples` is the number of units in the private dataset
    and `expected_batch_size` the expected units per logical step, so q = expected units /
    units and the DpEvent is over units. A unit is a row unless `privacy_unit` says otherwise
    (e.g. `"user"`: all of a user's rows, sampled together by `dpcore.units.unit_batches`);
    ε is then per unit, under add/remove-one-unit adjacency.
  * All fields are validated on construction; bad values raise `ValueError` naming the field
    and the value. δ >= 1/N triggers a `UserWarning`.
  * Its ε and δ are those of the PLAN (`planned_epsilon`, `planned_delta`: all `steps`); what a
    run spent is the ledger of the steps it applied (`dpcore.DPModel.epsilon()`,
    `PrivacyLedger`). `epsilon()` / `delta()` are deprecated names of the planned figures.
  * `planned_epsilon(max_examples_per_user=k)` is the user-level ε of an example-level run
    whose users have at most k examples each (group privacy, `compute_group_epsilon`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import dp_accounting

from dpcore_accounting import calibration
from dpcore_accounting import events as ev
from dpcore_accounting.ledger import PrivacyLedger, warn_if_delta_too_large

__all__ = ["DPConfig"]


def _steps_for_epochs(epochs: object, fields: dict[str, Any]) -> int:
    """`ev.steps_for_epochs` for constructor keywords; epochs must be > 0 here."""
    passes = ev.check_number(epochs, "epochs", low=0, low_open=True)
    # Missing or wrong-typed fields are refused by ev.steps_for_epochs with the field's name.
    return ev.steps_for_epochs(
        passes,
        num_examples=fields.get("num_examples"),  # type: ignore[arg-type]
        expected_batch_size=fields.get("expected_batch_size"),  # type: ignore[arg-type]
        sampling=fields.get("sampling", "poisson"),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPConfig:
    """The privacy-relevant settings of one DP-SGD run (frozen, keyword-only).

    Attributes:
      l2_norm_clip: C > 0, the per-example gradient clip norm.
      noise_multiplier: σ >= 0; the noise std on the clipped sum is σ · C (σ = 0: no privacy).
      expected_batch_size: expected size of one LOGICAL batch, in privacy units (Poisson:
        q · N; shuffle: the fixed batch size, a whole number).
      num_examples: N, size of the private dataset in privacy units (rows, or users when
        `privacy_unit="user"`).
      steps: logical steps of the run (noise added once per logical step).
      sampling: `"poisson"` (default) or `"shuffle"`.
      accumulation_steps: micro-batches per logical batch (memory only; no privacy effect).
      target_delta: δ for reported ε, in (0, 1); keep it well below 1/N.
      neighboring: `"add_remove"` (default) or `"replace_one"` adjacency.
      privacy_unit: what one unit is, and what ε is per: `"example"` (default, one row) or a
        group of rows such as `"user"`. It changes no number; it names the unit that
        `num_examples` and `expected_batch_size` count, and the sampler's spec must agree.
    """

    l2_norm_clip: float
    noise_multiplier: float
    expected_batch_size: float
    num_examples: int
    steps: int
    sampling: str = "poisson"
    accumulation_steps: int = 1
    target_delta: float = 1e-5
    neighboring: str = "add_remove"
    privacy_unit: str = "example"

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put(
            "l2_norm_clip", ev.check_number(self.l2_norm_clip, "l2_norm_clip", low=0, low_open=True)
        )
        put("noise_multiplier", ev.check_noise_multiplier(self.noise_multiplier))
        put("num_examples", ev.check_positive_int(self.num_examples, "num_examples"))
        batch = ev.check_batch_size(self.expected_batch_size, num_examples=self.num_examples)
        put("expected_batch_size", batch)
        put("steps", ev.check_positive_int(self.steps, "steps"))
        ev.check_choice(self.sampling, ev.SAMPLING_MODES, "sampling")
        if self.sampling == "shuffle" and batch != int(batch):
            raise ValueError(
                f"sampling='shuffle' needs a whole expected_batch_size (the fixed batch "
                f"size), got {batch!r}."
            )
        put(
            "accumulation_steps",
            ev.check_positive_int(self.accumulation_steps, "accumulation_steps"),
        )
        put("target_delta", ev.check_delta(self.target_delta))
        ev.check_choice(self.neighboring, ev.NEIGHBORING_RELATIONS, "neighboring")
        unit = self.privacy_unit
        if not isinstance(unit, str) or not unit.strip():
            raise ValueError(f"privacy_unit must be a non-empty string, got {unit!r}.")
        warn_if_delta_too_large(target_delta=self.target_delta, num_examples=self.num_examples)

    # ------------------------------------------------------------------------ derived
    @property
    def sampling_prob(self) -> float:
        """q = expected_batch_size / num_examples."""
        return self.expected_batch_size / self.num_examples

    @property
    def steps_per_epoch(self) -> int:
        """Logical steps in one epoch: ceil(N / B) for both modes (`steps_for_epochs(1)`)."""
        return self.steps_for_epochs(1)

    def steps_for_epochs(self, epochs: float) -> int:
        """Logical steps after `epochs` passes (`dpcore_accounting.steps_for_epochs`)."""
        return ev.steps_for_epochs(
            epochs,
            num_examples=self.num_examples,
            expected_batch_size=self.expected_batch_size,
            sampling=self.sampling,
        )

    @property
    def epochs(self) -> float:
        """Passes over the data: Poisson steps · q (expected); shuffle steps / steps_per_epoch."""
        if self.sampling == "shuffle":
            return self.steps / self.steps_per_epoch
        return self.steps * self.sampling_prob

    @property
    def micro_batch_size(self) -> float:
        """Expected size of one micro-batch (expected_batch_size / accumulation_steps)."""
        return self.expected_batch_size / self.accumulation_steps

    # ----------------------------------------------------------------------- accounting
    def dp_event(self, *, assume_poisson: bool = False) -> dp_accounting.DpEvent:
        """The DpEvent of the whole run.

        Args:
          assume_poisson: shuffle only: the Poisson figure, an assumption (label it).

        Privacy:
          Poisson: `PoissonSampledDpEvent` per step. Shuffle: the sound no-amplification
          bound, unless `assume_poisson`.
        """
        if self.sampling == "shuffle" and not assume_poisson:
            return ev.shuffle_event(
                noise_multiplier=self.noise_multiplier,
                steps_per_epoch=self.steps_per_epoch,
                steps=self.steps,
            )
        return ev.poisson_event(
            noise_multiplier=self.noise_multiplier,
            sampling_prob=self.sampling_prob,
            steps=self.steps,
        )

    def planned_epsilon(
        self,
        accountant: str = "pld",
        *,
        target_delta: float | None = None,
        assume_poisson: bool = False,
        max_examples_per_user: int = 1,
    ) -> float:
        """ε of the planned run (all `steps`) at `target_delta` (default: the config's δ).

        This is the plan: a model reports the ε of the steps it actually applied
        (`dpcore.DPModel.epsilon()`, the `epsilon` entry of its `fit` logs).

        Args:
          accountant: `"pld"` (default) or `"rdp"`.
          target_delta: δ; default `self.target_delta`. With `max_examples_per_user` > 1, the
            user-level δ.
          assume_poisson: shuffle only: the Poisson figure, an assumption (label it).
          max_examples_per_user: k >= 1. With k > 1, the ε per user of an example-level run
            where no user has more than k examples (group privacy, as TF Privacy's privacy
            statement; see `dpcore_accounting.compute_group_epsilon`); 1 (default): per
            example (per privacy unit).

        Privacy:
          `assume_poisson=True` (shuffle) is an assumption, not a guarantee. A user-level figure
          covers only users with at most `max_examples_per_user` examples.
        """
        delta = self.target_delta if target_delta is None else ev.check_delta(target_delta)
        return ev.compute_group_epsilon(
            self.dp_event(assume_poisson=assume_poisson),
            max_examples_per_user=max_examples_per_user,
            target_delta=delta,
            accountant=accountant,
            neighboring=self.neighboring,
        )

    def planned_delta(
        self, *, target_epsilon: float, accountant: str = "pld", assume_poisson: bool = False
    ) -> float:
        """δ of the planned run (all `steps`) at ε = `target_epsilon`.

        Privacy:
          `assume_poisson=True` (shuffle) is an assumption, not a guarantee.
        """
        return ev.compute_delta(
            self.dp_event(assume_poisson=assume_poisson),
            target_epsilon=target_epsilon,
            accountant=accountant,
            neighboring=self.neighboring,
        )

    def epsilon(
        self,
        accountant: str = "pld",
        *,
        target_delta: float | None = None,
        assume_poisson: bool = False,
    ) -> float:
        """Deprecated name of `planned_epsilon` (the plan, not what a run spent)."""
        warnings.warn(
            "DPConfig.epsilon() is the planned run's epsilon; call DPConfig.planned_epsilon() "
            "for it, and dp_model.epsilon() for the epsilon a model has spent.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.planned_epsilon(
            accountant, target_delta=target_delta, assume_poisson=assume_poisson
        )

    def delta(
        self, *, target_epsilon: float, accountant: str = "pld", assume_poisson: bool = False
    ) -> float:
        """Deprecated name of `planned_delta` (the plan, not what a run spent)."""
        warnings.warn(
            "DPConfig.delta() is the planned run's delta; call DPConfig.planned_delta() for it.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.planned_delta(
            target_epsilon=target_epsilon, accountant=accountant, assume_poisson=assume_poisson
        )

    def new_ledger(self) -> PrivacyLedger:
        """An empty `PrivacyLedger` for this run's dataset, sampling mode and adjacency."""
        return PrivacyLedger(
            num_examples=self.num_examples, sampling=self.sampling, neighboring=self.neighboring
        )

    def max_steps(self, *, target_epsilon: float, accountant: str = "pld") -> int:
        """The most logical steps (at this σ and q) whose ε stays <= `target_epsilon`.

        Privacy:
          Uses the same event as `dp_event()` (never a Poisson assumption for shuffle).
        """
        return calibration.calibrate_steps(
            target_epsilon=target_epsilon,
            target_delta=self.target_delta,
            noise_multiplier=self.noise_multiplier,
            sampling_prob=self.sampling_prob,
            accountant=accountant,
            ledger=self.new_ledger(),
        )

    def accounting_note(self) -> str:
        """One line saying what the reported ε assumes."""
        unit = self.privacy_unit
        per = "" if unit == "example" else f"; epsilon per {unit} (add/remove one {unit})"
        if self.sampling == "shuffle":
            return (
                "shuffled fixed-size batches: sound bound without amplification (each epoch "
                f"is one Gaussian mechanism per {unit}; epochs compose){per}"
            )
        return f"Poisson-sampled Gaussian steps (PoissonSampledDpEvent){per}"

    # ---------------------------------------------------------------------- constructors
    @classmethod
    def from_epochs(cls, *, epochs: float, **fields: Any) -> DPConfig:
        """A config whose `steps` cover `epochs` passes over the data.

        Steps are `dpcore_accounting.steps_for_epochs(epochs, ...)`: ceil(epochs · ceil(N / B))
        for both modes, so `from_epochs(epochs=E).steps == E * steps_per_epoch` for whole E,
        the steps `DPModel.fit(x, y, epochs=E)` runs.
        All other fields as for `DPConfig(...)`.
        """
        steps = _steps_for_epochs(epochs, fields)
        return cls(steps=steps, **fields)

    @classmethod
    def calibrated(
        cls,
        *,
        target_epsilon: float,
        target_delta: float = 1e-5,
        accountant: str = "pld",
        steps: int | None = None,
        epochs: float | None = None,
        **fields: Any,
    ) -> DPConfig:
        """A config whose noise_multiplier is the smallest σ meeting (ε, δ).

        Give `steps` or `epochs`, and the other fields except noise_multiplier.

        Raises:
          ValueError: invalid fields, or a target that no σ in range reaches.

        Privacy:
          The returned config's `planned_epsilon(accountant)` is <= target_epsilon.
        """
        if "noise_multiplier" in fields:
            raise ValueError(
                f"calibrated() computes noise_multiplier; do not pass it (got "
                f"{fields['noise_multiplier']!r})."
            )
        if (steps is None) == (epochs is None):
            raise ValueError(
                f"give exactly one of steps or epochs, got steps={steps!r}, epochs={epochs!r}."
            )
        if steps is None:
            steps = _steps_for_epochs(epochs, fields)
        probe = cls(
            noise_multiplier=1.0, steps=steps, target_delta=target_delta, **fields
        )  # validates every field before the (slower) search
        sigma = calibration.calibrate_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=probe.target_delta,
            sampling_prob=probe.sampling_prob,
            steps=probe.steps,
            sampling=probe.sampling,
            accountant=accountant,
            neighboring=probe.neighboring,
            steps_per_epoch=probe.steps_per_epoch if probe.sampling == "shuffle" else None,
        )
        return dataclasses.replace(probe, noise_multiplier=sigma)

    # --------------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        """The fields plus derived values (sampling_prob, epochs), JSON-ready."""
        data = dataclasses.asdict(self)
        data["sampling_prob"] = self.sampling_prob
        data["epochs"] = self.epochs
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DPConfig:
        """Rebuilds a config from `to_dict()` output (derived keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
