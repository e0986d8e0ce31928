"""A privacy ledger: the DP steps a run actually took, as DpEvents, serializable.

Contract:
  * `PrivacyLedger.record_steps(steps=n, noise_multiplier=σ, sampling_prob=q)` appends n
    logical steps (noise added once each) run with σ and q. σ and q may change between calls
    (schedules, a different batch size after a restart); consecutive equal settings merge.
  * Poisson sampling: the ledger's event composes one
    `SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), n)` per segment, so a
    single-segment ledger gives exactly `poisson_event(...)`.
  * Shuffled fixed-size batches (sound, no amplification): the ledger groups steps into
    epochs of ceil(N / B) steps. Each epoch, complete or not, is one Gaussian mechanism for
    an example, with the smallest σ used in that epoch. An epoch is closed early (a new one
    starts) when the batch size changes, or when `end_epoch()` is called (a data pipeline
    that reshuffles, e.g. at every Keras epoch or after a resume). Closing early can only
    add epochs, so it never under-reports.
  * `to_json()` / `from_json()` round-trip the exact state, so a resumed run continues the
    same ledger and reports the same ε; the JSON goes into checkpoints and run reports.
  * `epsilon(...)` / `delta(...)` use dp-accounting (PLD default, RDP on request).
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import dp_accounting

from dpcore_accounting import events as ev

__all__ = ["PrivacyLedger", "warn_if_delta_too_large"]

_FORMAT = "dpcore.PrivacyLedger/1"


def warn_if_delta_too_large(*, target_delta: float, num_examples: int) -> None:
    """Warns when δ >= 1/N: such a δ permits releasing an example outright."""
    if num_examples >= 1 and target_delta >= 1.0 / num_examples:
        warnings.warn(
            f"target_delta={target_delta!r} is >= 1/num_examples = 1/{num_examples}: a "
            "mechanism could publish a whole example with that probability; choose "
            "target_delta well below 1/num_examples.",
            UserWarning,
            stacklevel=3,
        )


@dataclass
class _Segment:
    """Consecutive logical steps with the same σ and q."""

    noise_multiplier: float
    sampling_prob: float
    steps: int


@dataclass
class _Epoch:
    """One pass (or part of one) of shuffled fixed-size batches."""

    noise_multiplier: float  # smallest σ used in this epoch
    steps_per_epoch: int
    steps: int
    closed: bool = False

    @property
    def full(self) -> bool:
        return self.closed or self.steps >= self.steps_per_epoch


class PrivacyLedger:
    """Records the DP steps of a run and reports their privacy.

    Example:
      ledger = PrivacyLedger(num_examples=60000, sampling="poisson")
      ledger.record_steps(steps=234, noise_multiplier=1.1, sampling_prob=256 / 60000)
      ledger.epsilon(target_delta=1e-5)

    Privacy:
      Record every logical step that ran (a step whose noisy gradient was applied),
      including those of earlier, resumed runs (restore with `from_json`).
    """

    def __init__(
        self,
        *,
        num_examples: int,
        sampling: str = "poisson",
        neighboring: str = "add_remove",
    ) -> None:
        """Creates an empty ledger.

        Args:
          num_examples: N, the size of the private dataset.
          sampling: `"poisson"` or `"shuffle"`.
          neighboring: `"add_remove"` (default) or `"replace_one"`.
        """
        self.num_examples = ev.check_positive_int(num_examples, "num_examples")
        self.sampling = ev.check_choice(sampling, ev.SAMPLING_MODES, "sampling")
        self.neighboring = ev.check_choice(neighboring, ev.NEIGHBORING_RELATIONS, "neighboring")
        self._segments: list[_Segment] = []
        self._epochs: list[_Epoch] = []

    # ------------------------------------------------------------------------ recording
    @property
    def steps(self) -> int:
        """Total logical steps recorded."""
        return sum(s.steps for s in self._segments)

    @property
    def segments(self) -> list[dict[str, Any]]:
        """The recorded (σ, q, steps) segments, oldest first."""
        return [asdict(s) for s in self._segments]

    @property
    def epochs(self) -> int:
        """Shuffle mode: epochs touched so far (each one a Gaussian mechanism); else 0."""
        return len(self._epochs)

    def record_steps(self, *, steps: int, noise_multiplier: float, sampling_prob: float) -> None:
        """Appends `steps` logical steps run with noise multiplier σ and sampling rate q.

        Args:
          steps: number of logical steps (>= 0; 0 records nothing).
          noise_multiplier: σ used for these steps.
          sampling_prob: q = expected batch size / N (shuffle: batch size / N).

        Privacy:
          Must describe what ran; an under-recorded ledger under-reports ε.
        """
        steps = int(ev.check_number(steps, "steps", low=0, integer=True))
        sigma = ev.check_noise_multiplier(noise_multiplier)
        q = ev.check_sampling_prob(sampling_prob)
        if steps == 0:
            return
        last = self._segments[-1] if self._segments else None
        if last is not None and last.noise_multiplier == sigma and last.sampling_prob == q:
            last.steps += steps
        else:
            self._segments.append(_Segment(sigma, q, steps))
        if self.sampling == "shuffle":
            self._record_shuffle(steps, sigma, q)

    def _batch_size(self, q: float) -> int:
        batch = q * self.num_examples
        b = round(batch)
        if b < 1 or abs(batch - b) > 1e-6 * max(1.0, batch):
            raise ValueError(
                f"sampling='shuffle' needs sampling_prob * num_examples to be a whole batch "
                f"size, got sampling_prob={q!r} with num_examples={self.num_examples}."
            )
        return int(b)

    def _record_shuffle(self, steps: int, sigma: float, q: float) -> None:
        spe = self.steps_per_epoch(sampling_prob=q)
        remaining = steps
        while remaining > 0:
            cur = self._epochs[-1] if self._epochs else None
            if cur is None or cur.full or cur.steps_per_epoch != spe:
                if cur is not None:
                    cur.closed = True
                cur = _Epoch(noise_multiplier=sigma, steps_per_epoch=spe, steps=0)
                self._epochs.append(cur)
            take = min(remaining, spe - cur.steps)
            cur.steps += take
            cur.noise_multiplier = min(cur.noise_multiplier, sigma)
            remaining -= take

    def steps_per_epoch(self, *, sampling_prob: float) -> int:
        """Shuffle mode: steps in one pass at batch size q · N, i.e. ceil(N / B)."""
        q = ev.check_sampling_prob(sampling_prob)
        return ev.shuffle_steps_per_epoch(
            num_examples=self.num_examples, batch_size=self._batch_size(q)
        )

    def steps_left_in_epoch(self, *, sampling_prob: float) -> int:
        """Shuffle mode: further steps at rate q that stay inside the open epoch (else 0)."""
        if self.sampling != "shuffle" or not self._epochs:
            return 0
        cur = self._epochs[-1]
        spe = self.steps_per_epoch(sampling_prob=sampling_prob)
        if cur.full or cur.steps_per_epoch != spe:
            return 0
        return spe - cur.steps

    def end_epoch(self) -> None:
        """Marks a pass boundary: the next shuffled step starts a new epoch.

        Call it whenever the data pipeline starts a fresh permutation before the current one
        was used up (every Keras epoch, a resumed run). No effect for Poisson sampling.
        """
        if self._epochs:
            self._epochs[-1].closed = True

    def copy(self) -> PrivacyLedger:
        """An independent copy (e.g. to ask "what if n more steps ran?")."""
        return copy.deepcopy(self)

    # ------------------------------------------------------------------------ reporting
    def dp_event(self, *, assume_poisson: bool = False) -> dp_accounting.DpEvent:
        """The DpEvent of everything recorded.

        Args:
          assume_poisson: shuffle mode only: the event as if batches had been Poisson
            sampled with the same q. An assumption, not a guarantee; label it as such.

        Returns:
          A DpEvent (`NoOpDpEvent` when nothing was recorded).

        Privacy:
          For shuffled batches the default is the sound no-amplification bound.
        """
        if self.sampling == "shuffle" and not assume_poisson:
            parts: list[dp_accounting.DpEvent] = []
            runs: list[list[float]] = []  # [σ, count] of consecutive equal-σ epochs
            for epoch in self._epochs:
                if runs and runs[-1][0] == epoch.noise_multiplier:
                    runs[-1][1] += 1
                else:
                    runs.append([epoch.noise_multiplier, 1])
            for sigma, count in runs:
                parts.append(
                    dp_accounting.SelfComposedDpEvent(
                        dp_accounting.GaussianDpEvent(sigma), int(count)
                    )
                )
        else:
            parts = [
                ev.poisson_event(
                    noise_multiplier=s.noise_multiplier,
                    sampling_prob=s.sampling_prob,
                    steps=s.steps,
                )
                for s in self._segments
            ]
        if not parts:
            return dp_accounting.NoOpDpEvent()
        if len(parts) == 1:
            return parts[0]
        return dp_accounting.ComposedDpEvent(parts)

    def epsilon(
        self,
        *,
        target_delta: float,
        accountant: str = "pld",
        assume_poisson: bool = False,
        pld_discretization: float = ev.DEFAULT_PLD_DISCRETIZATION,
    ) -> float:
        """ε at δ = `target_delta` of everything recorded (0.0 when empty).

        Privacy:
          Warns when δ >= 1/N. `assume_poisson=True` (shuffle only) is an assumption.
        """
        delta = ev.check_delta(target_delta)
        warn_if_delta_too_large(target_delta=delta, num_examples=self.num_examples)
        if not self._segments:
            return 0.0
        return ev.compute_epsilon(
            self.dp_event(assume_poisson=assume_poisson),
            target_delta=delta,
            accountant=accountant,
            neighboring=self.neighboring,
            pld_discretization=pld_discretization,
        )

    def delta(
        self,
        *,
        target_epsilon: float,
        accountant: str = "pld",
        assume_poisson: bool = False,
        pld_discretization: float = ev.DEFAULT_PLD_DISCRETIZATION,
    ) -> float:
        """δ at ε = `target_epsilon` of everything recorded (0.0 when empty).

        Privacy:
          `assume_poisson=True` (shuffle only) is an assumption, not a guarantee.
        """
        eps = ev.check_epsilon(target_epsilon)
        if not self._segments:
            return 0.0
        return ev.compute_delta(
            self.dp_event(assume_poisson=assume_poisson),
            target_epsilon=eps,
            accountant=accountant,
            neighboring=self.neighboring,
            pld_discretization=pld_discretization,
        )

    # -------------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the full state."""
        return {
            "format": _FORMAT,
            "num_examples": self.num_examples,
            "sampling": self.sampling,
            "neighboring": self.neighboring,
            "steps": self.steps,
            "segments": [asdict(s) for s in self._segments],
            "epochs": [asdict(e) for e in self._epochs],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrivacyLedger:
        """Restores a ledger written by `to_dict`."""
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"data is not a {_FORMAT} ledger: {str(data)[:200]!r}.")
        ledger = cls(
            num_examples=data["num_examples"],
            sampling=data["sampling"],
            neighboring=data["neighboring"],
        )
        for s in data["segments"]:
            steps = ev.check_positive_int(s["steps"], "segment steps")
            ledger._segments.append(
                _Segment(
                    ev.check_noise_multiplier(s["noise_multiplier"]),
                    ev.check_sampling_prob(s["sampling_prob"]),
                    steps,
                )
            )
        for e in data.get("epochs", []):
            ledger._epochs.append(
                _Epoch(
                    noise_multiplier=ev.check_noise_multiplier(e["noise_multiplier"]),
                    steps_per_epoch=ev.check_positive_int(e["steps_per_epoch"], "steps_per_epoch"),
                    steps=ev.check_positive_int(e["steps"], "epoch steps"),
                    closed=bool(e["closed"]),
                )
            )
        if ledger.sampling == "shuffle" and sum(e.steps for e in ledger._epochs) != ledger.steps:
            raise ValueError("ledger epochs and segments disagree on the number of steps.")
        return ledger

    def to_json(self) -> str:
        """The full state as a JSON string."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PrivacyLedger:
        """Restores a ledger written by `to_json`."""
        return cls.from_dict(json.loads(text))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrivacyLedger) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(num_examples={self.num_examples}, sampling={self.sampling!r}, "
            f"neighboring={self.neighboring!r}, steps={self.steps}, "
            f"segments={len(self._segments)})"
        )
