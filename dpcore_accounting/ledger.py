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
  * `StepRecorder` keeps a ledger in step with an optimizer's counter of applied steps and its
    log of σ changes (what `dpcore.DPOptimizer` keeps and saves with its state), so a model
    reports the ε of the steps it applied, each with the σ and q it ran with.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import dp_accounting

from dpcore_accounting import events as ev

__all__ = ["PrivacyLedger", "StepRecorder", "sigma_segments", "warn_if_delta_too_large"]

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


def sigma_segments(
    start: int, end: int, sigma: float, changes: Sequence[tuple[int, float]]
) -> list[tuple[int, float]]:
    """``[(steps, σ)]`` covering logical steps ``start .. end - 1`` in order.

    Step ``i`` ran with the σ of the last change set when ``i`` or fewer steps had been applied:
    ``sigma`` before ``changes``, which are ``(steps applied when set, σ)`` in the order made.
    """
    cuts = []
    for k, value in changes:
        if k <= start:
            sigma = value
        elif k < end:
            cuts.append((k, value))
    segments, position = [], start
    for k, value in cuts:
        if k > position:
            segments.append((k - position, sigma))
            position = k
        sigma = value
    if end > position:
        segments.append((end - position, sigma))
    return segments


class StepRecorder:
    """Keeps a `PrivacyLedger` in step with an optimizer's applied logical steps.

    The owner (a `dpcore.DPOptimizer`) passes its counters: the steps applied so far, the σ in
    effect and its log of σ changes ``(steps applied when set, σ)``. `begin` names the sampling
    of the data that feeds the next steps; `sync` records the steps applied since the last call,
    each with the σ it ran with and that data's q.

    Privacy:
      Steps the ledger did not see run (applied before `begin`, e.g. restored from a checkpoint
      that does not carry the ledger, or run outside ``fit``) are the unknown history: `begin`
      records them with the σ and q given to it and returns how many there were, for the owner
      to say so. `epsilon` refuses while applied steps are missing from the ledger.
    """

    def __init__(self, ledger: PrivacyLedger | None = None) -> None:
        self.ledger = ledger
        self._sampling_prob: float | None = None  # q of the data now feeding the steps
        self._sigma: float | None = None  # σ in effect at ledger.steps
        self._seen = 0  # σ changes already accounted
        self._cache: dict[tuple[Any, ...], float] = {}

    @property
    def recording(self) -> bool:
        """Whether data of a known sampling is feeding the steps (between begin and finish)."""
        return self._sampling_prob is not None

    def begin(
        self,
        *,
        sampling: str,
        num_examples: int,
        sampling_prob: float,
        neighboring: str,
        applied: int,
        noise_multiplier: float,
        noise_changes: Sequence[tuple[int, float]],
    ) -> int:
        """Starts recording steps fed by data of this sampling (a new pass over the data).

        Returns:
          The applied steps the ledger lacked (unknown history), now recorded with
          `noise_multiplier` and `sampling_prob`.

        Raises:
          ValueError: if the ledger so far is for another sampling mode or adjacency (or, for
            shuffled batches, another dataset size): one ledger cannot hold both.
        """
        q = ev.check_sampling_prob(sampling_prob)
        ledger = self.ledger
        if ledger is None:
            ledger = self.ledger = PrivacyLedger(
                num_examples=num_examples, sampling=sampling, neighboring=neighboring
            )
        elif (ledger.sampling, ledger.neighboring) != (sampling, neighboring) or (
            sampling == "shuffle" and ledger.num_examples != num_examples
        ):
            raise ValueError(
                f"this model's privacy ledger holds {ledger.steps} steps of "
                f"sampling={ledger.sampling!r} over num_examples={ledger.num_examples} "
                f"({ledger.neighboring}), but this fit runs sampling={sampling!r} over "
                f"num_examples={num_examples} ({neighboring}); one ledger cannot account both. "
                "Keep the sampling of the earlier fits, or train a new make_private(...) model "
                "and account the two runs together with dpcore.accounting (the ledger so far: "
                "dp_model.privacy_ledger)."
            )
        missing = max(0, int(applied) - ledger.steps)
        ledger.record_steps(steps=missing, noise_multiplier=noise_multiplier, sampling_prob=q)
        ledger.end_epoch()
        self._sampling_prob = q
        self._sigma = float(noise_multiplier)
        self._seen = len(noise_changes)
        return missing

    def sync(
        self, *, applied: int, noise_multiplier: float, noise_changes: Sequence[tuple[int, float]]
    ) -> None:
        """Records the steps applied since the last call (while recording), each with its σ."""
        if self.ledger is None or self._sampling_prob is None or self._sigma is None:
            return
        start = self.ledger.steps
        new = noise_changes[self._seen :]
        if new:
            segments = sigma_segments(start, int(applied), self._sigma, new)
        else:
            # σ set without a log entry (weights restored mid-run): the lower one, to be safe.
            sigma = min(self._sigma, float(noise_multiplier))
            segments = [(int(applied) - start, sigma)] if applied > start else []
        for steps, sigma in segments:
            self.ledger.record_steps(
                steps=steps, noise_multiplier=sigma, sampling_prob=self._sampling_prob
            )
        self._sigma = float(noise_multiplier)
        self._seen = len(noise_changes)

    def end_pass(self) -> None:
        """A pass boundary of the data (shuffled batches: the next step starts a new epoch)."""
        if self.ledger is not None:
            self.ledger.end_epoch()

    def finish(self) -> None:
        """The data stops feeding steps: later steps are unknown until the next `begin`."""
        self._sampling_prob = None

    def epsilon(
        self,
        *,
        applied: int,
        target_delta: float,
        accountant: str = "pld",
        max_examples_per_user: int = 1,
        pld_discretization: float = ev.DEFAULT_PLD_DISCRETIZATION,
    ) -> float:
        """ε of the ledger (computed once per ledger state), which must hold `applied` steps.

        Raises:
          ValueError: if fewer steps are recorded than `applied` (an ε for only some of the
            steps would under-report).
        """
        ledger = self.ledger
        steps = 0 if ledger is None else ledger.steps
        if steps < int(applied):
            raise ValueError(
                f"the optimizer applied {applied} logical steps but its privacy ledger holds "
                f"{steps} (steps run outside fit, or restored without their ledger); the "
                "epsilon of only some steps would under-report. Give the ledger back: "
                "dp_model.privacy_ledger = dpcore.accounting.PrivacyLedger.from_json(text)."
            )
        if ledger is None or steps == 0:
            return 0.0
        key = (
            ledger.to_json(),
            target_delta,
            accountant,
            max_examples_per_user,
            pld_discretization,
        )
        if key not in self._cache:
            if max_examples_per_user == 1:
                value = ledger.epsilon(
                    target_delta=target_delta,
                    accountant=accountant,
                    pld_discretization=pld_discretization,
                )
            else:
                warn_if_delta_too_large(target_delta=target_delta, num_examples=ledger.num_examples)
                value = ev.compute_group_epsilon(
                    ledger.dp_event(),
                    max_examples_per_user=max_examples_per_user,
                    target_delta=target_delta,
                    accountant=accountant,
                    neighboring=ledger.neighboring,
                    pld_discretization=pld_discretization,
                )
            self._cache = {key: value}  # only the latest state is asked again
        return self._cache[key]
