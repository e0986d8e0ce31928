"""Keras callbacks for privacy accounting during `model.fit`.

Contract:
  * `EpsilonCallback` keeps a `PrivacyLedger` in step with training. The number of logical
    steps comes from the optimizer's int64 variable `dp_steps` when it has one (a
    `DPOptimizer`), else from counting train batches (divided by `accumulation_steps`). σ is
    read from the optimizer's `noise_multiplier` attribute when it has one (else the
    config's), so a σ schedule is recorded as it ran. At every epoch end it puts ε (PLD by
    default) into `logs["epsilon"]`, which the progress bar and `History` show, writes a
    TensorBoard scalar `epsilon` when `log_dir` is given, and the ledger JSON when
    `ledger_path` is given.
  * For shuffled batches each Keras epoch is taken to start a fresh pass over the data
    (`reshuffle_each_epoch=True`), which can only over-count epochs, never under-count.
  * `PrivacyBudgetGuard` computes, at the start of training and again whenever σ changes and
    (shuffle) at every epoch end, how many more logical steps keep ε <= target_epsilon (steps
    already spent included, each with the σ it ran with), then stops training before a batch
    would go past that. If no step fits, it raises `RuntimeError`.
  * Both take each step's σ from the optimizer's σ log (`DPState.noise_changes`), so a σ set
    by any callback, in any order, is accounted as it ran.
  * Before the first step both check the sampling that runs against their `DPConfig`
    (`check_feed_matches_sampling`): data from `dpcore.sampling` carries a `SamplingSpec`, and
    a different sampling mode, N, q (Poisson) or batch size (shuffle) is refused with both
    values named. Without a spec, a Poisson config is refused for a `DPModel` fed with arrays
    (Keras's fixed-size shuffled batches) or with `(x, y, mask, step_end)` batches whose spec a
    tf.data transformation dropped, or with a dataset of plain `(x, y)` batches; a config per
    unit of several rows (`privacy_unit` other than "example") is refused for untagged data.
    ε is always computed from the steps applied (`dp_steps`), never from `config.steps`.
  * Both work with any Keras 3 model and optimizer; nothing here touches Keras internals.
  * `DPModel.fit` runs `model_callbacks` first: they keep the model's own ledger (on its
    `DPOptimizer`, saved with it) of the steps applied, with the sampling the data's
    `SamplingSpec` names, and put its ε into `logs["epsilon"]` at every epoch end, so the ε
    spent is reported without any callback; with `epsilon_budget` a `PrivacyBudgetGuard` runs
    on that ledger. `EpsilonCallback` and `PrivacyBudgetGuard` given no ledger continue the
    model's when it covers the steps applied, so a resumed model warns only where its history
    is unknown (and the warning says how to give the ledger back).
  * `SwapPolyakWeights` evaluates (and predicts) with a `DPOptimizer`'s Polyak average of the
    weights during `fit`, swapping it into the model for the evaluation and back afterwards.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, NamedTuple

import keras

from dpcore.accounting import calibration
from dpcore.accounting import events as ev
from dpcore.accounting.ledger import PrivacyLedger
from dpcore.accounting.ledger import sigma_segments as _sigma_segments
from dpcore.config import DPConfig
from dpcore.optimizer import DPState, DPStateSource
from dpcore.sampling import SamplingSpec

__all__ = ["EpsilonCallback", "PrivacyBudgetGuard", "SwapPolyakWeights", "model_callbacks"]


def _dp_state(model: Any) -> DPState | None:
    """The model's optimizer's DP state, or None when it exposes none (not a DP optimizer)."""
    optimizer = getattr(model, "optimizer", None)
    return optimizer.dp_state if isinstance(optimizer, DPStateSource) else None


def _read_dp_steps(model: Any) -> int | None:
    """The optimizer's applied logical steps, or None when it is not a DPOptimizer."""
    state = _dp_state(model)
    return None if state is None else state.dp_steps


def _read_pending_micro_steps(model: Any) -> int:
    """Micro-batches already accumulated towards the optimizer's next logical step (0 if none)."""
    state = _dp_state(model)
    return 0 if state is None else state.pending_micro_steps


def check_feed_matches_sampling(model: Any, config: DPConfig) -> None:
    """Refuses an account of a sampling other than the one that runs.

    ``dpcore.DPModel.fit`` records how it was fed: ``"arrays"`` (Keras cuts arrays into
    fixed-size, shuffled batches), ``"dataset"`` (a dataset of ``(x, y[, sample_weight])``,
    normally fixed-size batches) or ``"masked_batches"`` (``(x, y, mask, step_end)``, what
    ``dpcore.sampling`` yields), and the data's ``SamplingSpec`` when it carries one. Other
    models record nothing and are not checked.

    Raises:
      ValueError: for a ``SamplingSpec`` that disagrees with ``config`` (sampling mode, N, q,
        batch size or privacy unit) or with the model's units (``group_size``); for
        ``config.sampling == "poisson"`` with arrays or with any untagged dataset; for a
        ``config.privacy_unit`` other than ``"example"`` with untagged data: the reported ε
        would assume a sampling (or a clipping of units) that may not be the one that ran.

    Privacy:
      The ε reported for ``config`` holds only for data drawn as its DpEvent assumes.
    """
    spec = getattr(model, "sampling_spec", None)
    if isinstance(spec, SamplingSpec):
        spec.check_config(config)
        options = getattr(model, "options", None)  # a DPModel's ExecutionOptions
        if options is not None:
            spec.check_group_size(getattr(options, "group_size", 1))
        return
    feed = getattr(model, "data_feed", None)
    if feed is None:
        return
    if config.privacy_unit != "example":
        raise ValueError(
            f"the config accounts per {config.privacy_unit!r} (units of several rows), but fit was "
            f"given {feed.replace('_', ' ')} that carry no dpcore.sampling.SamplingSpec, so "
            "nothing says each unit's rows are clipped together (with one row per clip, a unit "
            "of m rows moves the sum by m C while the noise is scaled to C). Feed "
            "dpcore.units.unit_batches(...), which carries its spec, to a model with "
            "ExecutionOptions(group_size=...) matching it."
        )
    if config.sampling != "poisson":
        return
    if feed == "arrays":
        raise ValueError(
            "the config accounts for Poisson sampling, but fit was given arrays, which Keras cuts "
            "into fixed-size shuffled batches: that epsilon would be an assumption, not a "
            "guarantee. Feed dpcore.sampling.poisson_batches(x, y, sampling_prob=..., steps=...), "
            "or account for what runs with DPConfig(sampling='shuffle', ...)."
        )
    if feed == "masked_batches":
        raise ValueError(
            "the config accounts for Poisson sampling with sampling_prob="
            f"{config.sampling_prob:.6g}, but fit was given (x, y, mask, step_end) batches that "
            "carry no dpcore.sampling.SamplingSpec (a tf.data transformation such as .map drops "
            "it), so what sampling ran is unknown. Feed dpcore.sampling.poisson_batches(...) as "
            "returned, or re-attach its spec after a per-element .map: "
            "dpcore.sampling.with_sampling_spec(mapped, dpcore.sampling.sampling_spec(ds))."
        )
    raise ValueError(
        "the config accounts for Poisson sampling, but fit was given a dataset of (x, y) batches "
        "that carries no dpcore.sampling.SamplingSpec, normally fixed-size batches: that epsilon "
        "would be an assumption (for shuffled fixed-size batches the sound figure is several "
        "times larger). Feed dpcore.sampling.poisson_batches(x, y, sampling_prob=..., steps=...), "
        "tag a Poisson sampler of your own that yields (x, y, mask, step_end) batches with "
        "dpcore.sampling.with_sampling_spec, or account for what runs with "
        "DPConfig(sampling='shuffle')."
    )


def _current_noise(model: Any, default: float) -> float:
    state = _dp_state(model)
    return default if state is None else state.noise_multiplier


def _noise_changes(model: Any) -> tuple[tuple[int, float], ...]:
    state = _dp_state(model)
    return () if state is None else tuple(state.noise_changes)


class _NoiseTracker:
    """Follows the optimizer's σ log: which σ each newly applied step ran with."""

    def __init__(self, model: Any, sigma: float) -> None:
        self.model = model
        self.sigma = sigma  # σ in effect after the changes already seen
        self.seen = len(_noise_changes(model))

    def changed(self) -> bool:
        """Whether σ was set (or, for a source without a log, differs) since the last segments."""
        state = _dp_state(self.model)  # one read of the optimizer's state per batch hook
        if state is None:
            return False
        return len(state.noise_changes) > self.seen or state.noise_multiplier != self.sigma

    def record(self, ledger: PrivacyLedger, start: int, end: int, *, sampling_prob: float) -> None:
        """Records steps ``start .. end - 1`` in ``ledger``, each with the σ it ran with."""
        for steps, sigma in self.segments(start, end):
            ledger.record_steps(steps=steps, noise_multiplier=sigma, sampling_prob=sampling_prob)

    def segments(self, start: int, end: int) -> list[tuple[int, float]]:
        """Segments for steps ``start .. end - 1``; afterwards σ is the one now in effect."""
        changes = _noise_changes(self.model)
        new = changes[self.seen :]
        current = _current_noise(self.model, self.sigma)
        if new:
            out = _sigma_segments(start, end, self.sigma, new)
        elif current != self.sigma:
            # A source that does not log its σ changes: the lower σ for the whole interval (the
            # callbacks flush at every batch boundary where σ differs, so intervals are short).
            out = [(end - start, min(current, self.sigma))] if end > start else []
        else:
            out = [(end - start, self.sigma)] if end > start else []
        self.seen = len(changes)
        self.sigma = current
        return out


_RESTORE_LEDGER = (
    "To keep the run's exact history, restore the whole model: keras.saving.load_model(...) of a "
    ".keras file or dp_model.load_weights(...) of a .weights.h5 file written after those steps "
    "bring back its ledger (dp_model.privacy_ledger); or give the ledger back before fit: "
    "dp_model.privacy_ledger = dpcore.accounting.PrivacyLedger.from_json(text) (the JSON of "
    "dp_model.privacy_ledger.to_json(), or the 'ledger' entry of the file "
    "EpsilonCallback(ledger_path=...) wrote; pass that one to EpsilonCallback(config, ledger=...) "
    "too)."
)


def _model_ledger(model: Any, config: DPConfig, applied: int) -> PrivacyLedger | None:
    """A copy of the model's own ledger (``DPModel.fit`` keeps it, saving restores it) when it
    covers the ``applied`` steps and is one ``config`` can continue; else None."""
    optimizer = getattr(model, "optimizer", None)
    ledger = getattr(optimizer, "privacy_ledger", None)
    if not isinstance(ledger, PrivacyLedger) or ledger.steps < applied:
        return None
    if (ledger.sampling, ledger.neighboring) != (config.sampling, config.neighboring):
        return None
    if config.sampling == "shuffle" and ledger.num_examples != config.num_examples:
        return None
    copy = ledger.copy()
    copy.num_examples = config.num_examples  # Poisson: q per segment; N only names the data
    return copy


def _sync_ledger(
    ledger: PrivacyLedger, applied: int | None, config: DPConfig, sigma: float
) -> None:
    """Records steps the optimizer applied that the ledger lacks (their history is unknown)."""
    if applied is not None and applied > ledger.steps:
        missing = applied - ledger.steps
        warnings.warn(
            f"the optimizer has applied {applied} logical steps but the ledger holds "
            f"{ledger.steps}, and the model keeps no ledger of them (restored from a checkpoint "
            "without one, or steps run outside fit); recording the "
            f"{missing} missing steps with noise_multiplier={sigma} and "
            f"sampling_prob={config.sampling_prob}, an assumption. {_RESTORE_LEDGER}",
            UserWarning,
            stacklevel=3,
        )
        ledger.record_steps(
            steps=missing, noise_multiplier=sigma, sampling_prob=config.sampling_prob
        )


def _scalar_summary(name: str, value: float, *, step: int) -> None:
    """A TensorBoard scalar, as `tf.summary.scalar` writes it, without needing tensorboard."""
    import tensorflow as tf

    metadata = tf.compat.v1.SummaryMetadata(
        plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"),
        data_class=1,  # DATA_CLASS_SCALAR
    )
    tf.summary.write(name, tf.constant(float(value), tf.float32), step=step, metadata=metadata)


def _write_atomic(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class EpsilonCallback(keras.callbacks.Callback):
    """Adds the run's ε so far to the epoch logs (progress bar, History, TensorBoard).

    Example:
      config = DPConfig(l2_norm_clip=1.0, noise_multiplier=1.1, expected_batch_size=256,
                        num_examples=60000, steps=14063)
      model.fit(..., callbacks=[EpsilonCallback(config, log_dir="runs/tb")])

    A `dpcore.DPModel` reports the ε it spent by itself (`DPModel.epsilon()`, `epsilon` in the
    `fit` logs); this callback adds a ledger JSON file, TensorBoard scalars, RDP figures and the
    check of the data against a `DPConfig`. Its `epsilon` log entry replaces the model's.

    Privacy:
      Reports ε for the steps that actually ran (the optimizer's `dp_steps` when present).
      Resuming, it continues the model's own ledger (saved with the model) when no `ledger` is
      given; else give the ledger restored from the previous run's JSON.
    """

    def __init__(
        self,
        config: DPConfig,
        *,
        ledger: PrivacyLedger | None = None,
        accountant: str = "pld",
        target_delta: float | None = None,
        log_dir: str | None = None,
        ledger_path: str | None = None,
        also_rdp: bool = False,
        report_poisson_assumption: bool = False,
        reshuffle_each_epoch: bool = True,
        pld_discretization: float = ev.DEFAULT_PLD_DISCRETIZATION,
    ) -> None:
        """Creates the callback.

        Args:
          config: the run's `DPConfig` (σ, q, N, sampling mode, adjacency, δ).
          ledger: a ledger to continue (resumed run); default: a new empty one.
          accountant: `"pld"` (default) or `"rdp"` for `logs["epsilon"]`.
          target_delta: δ; default `config.target_delta`.
          log_dir: if given, writes TensorBoard scalars `epsilon` (step = epoch).
          ledger_path: if given, writes the ledger JSON there at each epoch end.
          also_rdp: also log `epsilon_rdp`.
          report_poisson_assumption: shuffle only: also log `epsilon_assuming_poisson`,
            the Poisson figure (an assumption, not a guarantee).
          reshuffle_each_epoch: shuffle only: each Keras epoch starts a new pass.
          pld_discretization: PLD value discretization interval (coarser: faster, still an
            upper bound).
        """
        super().__init__()
        if not isinstance(config, DPConfig):
            raise ValueError(f"config must be a dpcore.config.DPConfig, got {config!r}.")
        self.config = config
        self.accountant = ev.check_choice(accountant, ev.ACCOUNTANTS, "accountant")
        ev.make_accountant(
            accountant, neighboring=config.neighboring, pld_discretization=pld_discretization
        )
        self.pld_discretization = pld_discretization
        self.target_delta = (
            config.target_delta if target_delta is None else ev.check_delta(target_delta)
        )
        if ledger is None:
            ledger = config.new_ledger()
        if not isinstance(ledger, PrivacyLedger):
            raise ValueError(f"ledger must be a PrivacyLedger, got {ledger!r}.")
        if (ledger.num_examples, ledger.sampling, ledger.neighboring) != (
            config.num_examples,
            config.sampling,
            config.neighboring,
        ):
            raise ValueError(
                f"ledger={ledger!r} does not match config (num_examples={config.num_examples}, "
                f"sampling={config.sampling!r}, neighboring={config.neighboring!r})."
            )
        self.ledger = ledger
        self.log_dir = log_dir
        self.ledger_path = ledger_path
        self.also_rdp = bool(also_rdp)
        self.report_poisson_assumption = bool(report_poisson_assumption)
        self.reshuffle_each_epoch = bool(reshuffle_each_epoch)
        self.history: list[dict[str, float]] = []
        self._writer: Any = None
        self._use_counter = False
        self._synced = 0  # logical-step position already in the ledger
        self._done_batches = 0
        self._epoch_batches = 0
        self._noise = _NoiseTracker(None, config.noise_multiplier)

    # --------------------------------------------------------------------------- steps
    def _position(self) -> int:
        if self._use_counter:
            value = _read_dp_steps(self.model)
            return int(value) if value is not None else self._synced
        return (self._done_batches + self._epoch_batches) // self.config.accumulation_steps

    def flush(self) -> None:
        """Records the steps run since the last flush, each with the σ it ran with."""
        position = self._position()
        self._noise.record(
            self.ledger, self._synced, position, sampling_prob=self.config.sampling_prob
        )
        self._synced = max(self._synced, position)

    def epsilon(self) -> float:
        """ε of the ledger so far (after a `flush`)."""
        return self.ledger.epsilon(
            target_delta=self.target_delta,
            accountant=self.accountant,
            pld_discretization=self.pld_discretization,
        )

    # ----------------------------------------------------------------------- callbacks
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        check_feed_matches_sampling(self.model, self.config)
        sigma = _current_noise(self.model, self.config.noise_multiplier)
        self._noise = _NoiseTracker(self.model, sigma)
        applied = _read_dp_steps(self.model)
        self._use_counter = applied is not None
        if applied is not None:
            if self.ledger.steps < applied:
                own = _model_ledger(self.model, self.config, applied)
                if own is not None:  # the model's exact history (a resumed model keeps it)
                    self.ledger = own
            _sync_ledger(self.ledger, applied, self.config, sigma)
            self._synced = int(applied)
        else:
            self._synced = 0
        self._done_batches = 0
        self._epoch_batches = 0
        self.ledger.end_epoch()  # a new fit starts a new pass over the data
        if self.log_dir and self._writer is None:
            import tensorflow as tf

            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch_batches = 0

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._noise.changed():
            self.flush()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch_batches = int(batch) + 1
        if self._noise.changed():
            self.flush()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.flush()
        self._done_batches += self._epoch_batches
        self._epoch_batches = 0
        if self.reshuffle_each_epoch:
            self.ledger.end_epoch()
        record: dict[str, float] = {"epoch": float(epoch), "steps": float(self.ledger.steps)}
        record["epsilon"] = self.epsilon()
        if self.also_rdp:
            record["epsilon_rdp"] = self.ledger.epsilon(
                target_delta=self.target_delta, accountant="rdp"
            )
        if self.report_poisson_assumption and self.config.sampling == "shuffle":
            record["epsilon_assuming_poisson"] = self.ledger.epsilon(
                target_delta=self.target_delta,
                accountant=self.accountant,
                assume_poisson=True,
                pld_discretization=self.pld_discretization,
            )
        self.history.append(record)
        if logs is not None:
            for key, value in record.items():
                if key.startswith("epsilon"):
                    logs[key] = value
        if self._writer is not None:
            with self._writer.as_default():
                for key, value in record.items():
                    if key.startswith("epsilon"):
                        _scalar_summary(key, value, step=int(epoch))
                _scalar_summary("dp_steps", record["steps"], step=int(epoch))
            self._writer.flush()
        self._save_ledger()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.flush()
        self._save_ledger()

    def _save_ledger(self) -> None:
        if self.ledger_path:
            payload = {
                "config": self.config.to_dict(),
                "ledger": self.ledger.to_dict(),
                "accountant": self.accountant,
                "target_delta": self.target_delta,
            }
            _write_atomic(self.ledger_path, json.dumps(payload, indent=2, sort_keys=True))


class PrivacyBudgetGuard(keras.callbacks.Callback):
    """Stops training before a step would take ε past `target_epsilon`.

    Privacy:
      The guard keeps its own copy of the ledger the run reports (steps already spent
      included), recording each applied step with the σ it ran with (the optimizer's σ log) and,
      when each Keras epoch is a new pass over the data (`reshuffle_each_epoch`, as
      `EpsilonCallback` counts it), closing the pass at every epoch end. Its step limit is
      computed from that ledger at train begin and again at every epoch end and every σ change.
      Batches are counted conservatively (a batch is at most one logical step).
    """

    def __init__(
        self,
        *,
        target_epsilon: float,
        config: DPConfig,
        ledger: PrivacyLedger | None = None,
        accountant: str = "pld",
        target_delta: float | None = None,
        verbose: int = 1,
        pld_discretization: float = ev.DEFAULT_PLD_DISCRETIZATION,
        reshuffle_each_epoch: bool = True,
    ) -> None:
        """Creates the guard.

        Args:
          target_epsilon: the ε that must not be exceeded (> 0).
          config: the run's `DPConfig` (σ, q, N, sampling mode, adjacency, δ).
          ledger: steps already spent (resumed run); it is not modified.
          accountant: `"pld"` (default) or `"rdp"`.
          target_delta: δ; default `config.target_delta`.
          verbose: 1 prints a line when it stops training.
          pld_discretization: PLD value discretization interval (coarser: faster).
          reshuffle_each_epoch: shuffle only: each Keras epoch starts a new pass (as for
            `EpsilonCallback`; Keras reshuffles arrays every epoch).
        """
        super().__init__()
        if not isinstance(config, DPConfig):
            raise ValueError(f"config must be a dpcore.config.DPConfig, got {config!r}.")
        self.target_epsilon = ev.check_epsilon(target_epsilon)
        self.config = config
        self.accountant = ev.check_choice(accountant, ev.ACCOUNTANTS, "accountant")
        self.target_delta = (
            config.target_delta if target_delta is None else ev.check_delta(target_delta)
        )
        self.ledger = ledger
        self.verbose = int(verbose)
        self.pld_discretization = pld_discretization
        self.reshuffle_each_epoch = bool(reshuffle_each_epoch)
        self.max_steps: int | None = None  # total logical steps allowed (counter scale)
        self.stopped_at: int | None = None
        self._base = 0
        self._batches = 0
        self._spent: PrivacyLedger | None = None
        self._synced = 0
        self._noise = _NoiseTracker(None, config.noise_multiplier)

    def remaining_steps(self, spent: PrivacyLedger) -> int:
        """Further logical steps (at the σ now in force and the config's q) that keep ε <= target."""
        return calibration.calibrate_steps(
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            noise_multiplier=_current_noise(self.model, self.config.noise_multiplier),
            sampling_prob=self.config.sampling_prob,
            accountant=self.accountant,
            ledger=spent,
            pld_discretization=self.pld_discretization,
        )

    def _steps_so_far(self) -> int:
        applied = _read_dp_steps(self.model)
        if applied is not None:
            return int(applied)
        return self._base + self._batches // self.config.accumulation_steps

    def _recompute(self, *, end_epoch: bool) -> int:
        """Records the steps applied since the last call in the guard's ledger (each with its σ),
        closes the pass if asked, and sets the limit from it; returns the steps remaining."""
        assert self._spent is not None
        position = self._steps_so_far()
        self._noise.record(
            self._spent, self._synced, position, sampling_prob=self.config.sampling_prob
        )
        self._synced = max(self._synced, position)
        if end_epoch:
            self._spent.end_epoch()
        remaining = self.remaining_steps(self._spent)
        self.max_steps = self._synced + remaining
        return remaining

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        check_feed_matches_sampling(self.model, self.config)
        spent = self.ledger.copy() if self.ledger is not None else self.config.new_ledger()
        applied = _read_dp_steps(self.model)
        sigma = _current_noise(self.model, self.config.noise_multiplier)
        if applied is not None and applied > spent.steps:
            own = _model_ledger(self.model, self.config, applied)
            if own is not None:  # the model's exact history (a resumed model keeps it)
                spent = own
        if applied is not None and applied > spent.steps:
            spent.record_steps(
                steps=applied - spent.steps,
                noise_multiplier=sigma,
                sampling_prob=self.config.sampling_prob,
            )
        self._spent = spent
        self._noise = _NoiseTracker(self.model, sigma)
        self._base = int(applied) if applied is not None else 0
        self._synced = self._base
        self._batches = _read_pending_micro_steps(self.model)
        remaining = self._recompute(end_epoch=True)  # a new fit starts a new pass over the data
        if remaining == 0:
            raise RuntimeError(
                f"privacy budget exhausted: no further step keeps epsilon <= "
                f"target_epsilon={self.target_epsilon} at delta={self.target_delta} "
                f"(spent: {spent.steps} steps, epsilon "
                f"{spent.epsilon(target_delta=self.target_delta, accountant=self.accountant):.4g})."
            )

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        applied = _read_dp_steps(self.model)
        if applied is not None:  # exact count (chunked Poisson steps are one step)
            self._base = int(applied)
            # Micro-batches of an unfinished logical step carry over from the last epoch: count
            # them, or the step they complete would go unseen.
            self._batches = _read_pending_micro_steps(self.model)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        # A Poisson ledger has no passes; a shuffled one starts a new pass with each Keras epoch.
        if (
            self._spent is None
            or self.config.sampling != "shuffle"
            or not self.reshuffle_each_epoch
        ):
            return
        if self._recompute(end_epoch=True) == 0:
            self._stop(self._synced)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._batch_start = int(batch)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._batches += int(batch) - getattr(self, "_batch_start", int(batch)) + 1
        if self._spent is not None and self._noise.changed():
            self._recompute(end_epoch=False)  # σ changed: the limit is for the new σ
        per_execution = int(getattr(self.model, "steps_per_execution", 1) or 1)
        applied = _read_dp_steps(self.model)
        if applied is not None:
            # The optimizer's own count, and each next batch may complete a logical step
            # (whatever accumulation the optimizer runs, which the config need not state).
            done, after_next = int(applied), int(applied) + per_execution
        else:
            acc = self.config.accumulation_steps
            done = self._base + self._batches // acc
            after_next = self._base + (self._batches + per_execution) // acc
        if self.max_steps is not None and after_next > self.max_steps:
            self._stop(done)

    def _stop(self, done: int) -> None:
        self.model.stop_training = True
        self.stopped_at = done
        if self.verbose:
            print(
                f"\nPrivacyBudgetGuard: stopping after {done} logical steps; the next "
                f"would exceed epsilon={self.target_epsilon} at delta={self.target_delta} "
                f"(limit {self.max_steps} steps)."
            )


class _FitSampling(NamedTuple):
    """The sampling a ``DPModel.fit`` runs, in privacy units."""

    sampling: str
    num_examples: int
    sampling_prob: float
    expected_batch_size: float
    privacy_unit: str


def _fit_sampling(model: Any, rows: int | None, batch_size: int | None) -> _FitSampling | None:
    """What the model's current fit samples: its data's ``SamplingSpec``; for arrays without one
    (Keras's fixed-size shuffled batches) a pass of ``ceil(N / B)`` batches; else None."""
    spec = getattr(model, "sampling_spec", None)
    if isinstance(spec, SamplingSpec):
        return _FitSampling(
            spec.sampling,
            int(spec.num_examples),
            float(spec.sampling_prob),
            float(spec.expected_batch_size),
            spec.privacy_unit,
        )
    if getattr(model, "data_feed", None) != "arrays" or not rows:
        return None
    k = int(getattr(getattr(model, "options", None), "group_size", 1) or 1)
    units = max(1, rows // k)
    batch = max(1, min(int(batch_size or 32) // k, units))
    return _FitSampling("shuffle", units, batch / units, float(batch), "example")


def _num_rows(x: Any) -> int | None:
    """Rows of array inputs (None for a dataset or anything without a leading dimension)."""
    import tensorflow as tf

    if x is None or isinstance(x, tf.data.Dataset):
        return None
    leaves = tf.nest.flatten(x)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    return int(shape[0]) if shape is not None and len(shape) and shape[0] is not None else None


class _SpentPrivacy(keras.callbacks.Callback):
    """Keeps a ``DPModel``'s own ledger (on its ``DPOptimizer``) in step with the steps applied
    and puts the ε spent so far into the epoch logs (``epsilon``: History, progress bar,
    CSVLogger, TensorBoard). ``DPModel.fit`` runs it first among the callbacks.

    Privacy:
      Each step is recorded with the σ it ran with (the optimizer's σ log) and the q of the
      sampling that ran (the data's ``SamplingSpec``; for arrays, Keras's shuffled fixed-size
      batches, accounted without amplification, one pass per Keras epoch).
    """

    def __init__(self, *, rows: int | None, batch_size: int | None) -> None:
        super().__init__()
        self._rows = rows
        self._batch_size = batch_size
        self._sampling: _FitSampling | None = None

    def _optimizer(self) -> Any:
        optimizer = getattr(self.model, "optimizer", None)
        return optimizer if hasattr(optimizer, "step_recorder") else None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        optimizer = self._optimizer()
        self._sampling = None
        if optimizer is None:
            return
        found = _fit_sampling(self.model, self._rows, self._batch_size)
        if found is None:
            optimizer.step_recorder.finish()
            warnings.warn(
                "dpcore: fit was given a dataset that carries no dpcore.sampling.SamplingSpec, so "
                "what sampling runs (and over how many examples) is unknown: the model reports "
                "no epsilon for these steps ('epsilon' is left out of the logs and "
                "dp_model.epsilon() refuses). Feed arrays or dpcore.sampling.poisson_batches(...),"
                " or tag your sampler with dpcore.sampling.with_sampling_spec.",
                UserWarning,
                stacklevel=2,
            )
            return
        state = optimizer.dp_state
        missing = optimizer.step_recorder.begin(
            sampling=found.sampling,
            num_examples=found.num_examples,
            sampling_prob=found.sampling_prob,
            neighboring=getattr(self.model, "neighboring", "add_remove"),
            applied=state.dp_steps,
            noise_multiplier=state.noise_multiplier,
            noise_changes=state.noise_changes,
        )
        self._sampling = found
        if missing:
            warnings.warn(
                f"dpcore: the optimizer has applied {state.dp_steps} logical steps, {missing} of "
                "them missing from its privacy ledger (restored from a checkpoint that does not "
                "carry the ledger, or run outside fit): their history is unknown, so they are "
                f"recorded with noise_multiplier={state.noise_multiplier} and "
                f"sampling_prob={found.sampling_prob:.6g} (what this fit runs), an assumption. "
                f"{_RESTORE_LEDGER}",
                UserWarning,
                stacklevel=2,
            )

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._sampling is None:
            return
        optimizer = self._optimizer()
        optimizer.record_applied_steps()
        if self._sampling.sampling == "shuffle":
            optimizer.step_recorder.end_pass()  # each Keras epoch is a new pass
        if logs is not None:
            logs["epsilon"] = self.model.epsilon()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._sampling is None:
            return
        optimizer = self._optimizer()
        optimizer.record_applied_steps()
        optimizer.step_recorder.finish()


class _BudgetGuard(PrivacyBudgetGuard):
    """``make_private(..., epsilon_budget=...)``: a ``PrivacyBudgetGuard`` on the model's own
    ledger, for the sampling each ``fit`` runs."""

    def __init__(self, *, epsilon_budget: float, rows: int | None, batch_size: int | None) -> None:
        placeholder = DPConfig(
            l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=1, num_examples=1, steps=1
        )  # replaced at train begin by the fit's own sampling
        super().__init__(target_epsilon=epsilon_budget, config=placeholder)
        self._rows = rows
        self._batch_size = batch_size

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        found = _fit_sampling(self.model, self._rows, self._batch_size)
        if found is None:
            raise ValueError(
                f"make_private(..., epsilon_budget={self.target_epsilon}) cannot keep the budget: "
                "fit was given a dataset that carries no dpcore.sampling.SamplingSpec, so its "
                "sampling is unknown. Feed arrays or dpcore.sampling.poisson_batches(...)."
            )
        self.target_delta = float(getattr(self.model, "target_delta", self.target_delta))
        self.config = DPConfig(
            l2_norm_clip=1.0,  # no effect on epsilon
            noise_multiplier=_current_noise(self.model, 1.0),
            expected_batch_size=found.expected_batch_size,
            num_examples=found.num_examples,
            steps=1,
            sampling=found.sampling,
            target_delta=self.target_delta,
            neighboring=getattr(self.model, "neighboring", "add_remove"),
            privacy_unit=found.privacy_unit,
        )
        super().on_train_begin(logs)


def model_callbacks(model: Any, arguments: dict[str, Any]) -> list[Any]:
    """``fit``'s callbacks for a ``DPModel``: its ε record first (so ``epsilon`` is in the logs
    every later callback sees), its budget guard (``epsilon_budget``), then the caller's."""
    rows = _num_rows(arguments.get("x"))
    batch_size = arguments.get("batch_size")
    own: list[Any] = [_SpentPrivacy(rows=rows, batch_size=batch_size)]
    budget = getattr(model, "epsilon_budget", None)
    if budget is not None:
        own.append(_BudgetGuard(epsilon_budget=budget, rows=rows, batch_size=batch_size))
    return [*own, *list(arguments.get("callbacks") or [])]


class SwapPolyakWeights(keras.callbacks.Callback):
    """Evaluates and predicts with the Polyak average of a ``DPOptimizer(polyak_start_step=...)``.

    While a validation pass (or ``evaluate``/``predict`` inside ``fit``) runs, the model's
    trainable weights hold the average; training resumes on the raw weights. Before the average
    holds any step the model is left as it is. ``fit`` itself writes the average into the model
    at the end of training (``DPOptimizer.finalize_variable_values``).

    Privacy:
      The average is a function of the released (noised) updates: post-processing, no cost.
    """

    def __init__(self) -> None:
        super().__init__()
        self._swapped = False

    def _optimizer(self) -> Any:
        optimizer = self.model.optimizer
        if getattr(optimizer, "polyak_start_step", None) is None:
            raise ValueError(
                "SwapPolyakWeights needs a dpcore.DPOptimizer with polyak_start_step set; got "
                f"{type(optimizer).__name__}."
            )
        return optimizer

    def _swap(self) -> None:
        self._optimizer().swap_polyak_weights()
        self._swapped = not self._swapped

    def _begin(self) -> None:
        if not self._swapped and self._optimizer().polyak_count > 0:
            self._swap()

    def _end(self) -> None:
        if self._swapped:
            self._swap()

    def on_train_begin(self, logs: Any = None) -> None:
        self._optimizer()  # a missing average fails here, before any step

    def on_test_begin(self, logs: Any = None) -> None:
        self._begin()

    def on_test_end(self, logs: Any = None) -> None:
        self._end()

    def on_predict_begin(self, logs: Any = None) -> None:
        self._begin()

    def on_predict_end(self, logs: Any = None) -> None:
        self._end()
