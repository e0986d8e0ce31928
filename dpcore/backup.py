"""Backup and resume at logical-step boundaries: a preempted run continues where it stopped.

Contract:
- :class:`StepBackup` is a Keras callback for :meth:`dpcore.DPModel.fit` on the sampler's
  ``(x, y, mask, step_end)`` batches, on one worker or under ``MultiWorkerMirroredStrategy``
  (``fit`` runs dpcore's own epoch loop whenever a ``StepBackup`` is among the callbacks). Its
  folder holds ``state.json`` (written atomically by the chief only) and the weights file it
  names (model, :class:`~dpcore.DPOptimizer` state with ``noise_seed``, ``dp_steps`` and
  ``micro_steps``, and the metrics); every worker saves the weights (a collective), the
  non-chief copies go to :func:`dpcore.distribute.worker_path`'s temporary folder.
- The state records, after every logical step: the sampling seed, the steps applied
  (``applied_steps``), the steps the weights file holds (``checkpoint_steps``, a multiple of
  ``save_every``, or the end of the run), the model's own privacy ledger (the steps applied) and,
  when an :class:`~dpcore.callbacks.EpsilonCallback` is attached, its ledger.
- Resume rule: a restarted run restores the weights file and then sets the optimizer's
  ``dp_steps`` to ``applied_steps``. With ``save_every=1`` (the default) the two are equal and
  the run continues exactly: no step is lost or applied twice, the noise of step ``t`` is
  ``fold_in(noise_seed, t)`` as in an uninterrupted run, and the sampler resumes at
  ``start_step=resume_step`` with the same seed. With ``save_every > 1`` the updates of the
  steps applied after the last weights file are lost, but those steps still count: their
  results may have been released (logs, other callbacks' files), so they stay in the ledger and
  their step indices, hence their noise draws and sampling coins, are never used again.
- The sampling seed is part of the state: the first run draws it with
  :func:`dpcore.distribute.shared_seed` (OS entropy, broadcast from the chief), a restarted run
  reads it back. The state is read when the callback is created, before the data pipeline is
  built; every worker reads the chief's folder, so it must be one folder they all see (the
  local launcher's workers share the machine's file system).
- ``fit`` counts epochs in logical steps with ``steps_per_epoch`` (required with a
  ``StepBackup``): a run restarted at step ``t`` goes on in epoch ``t // steps_per_epoch``,
  after its first ``t % steps_per_epoch`` steps. Feed it one pass of the sampler holding every
  remaining step: ``steps=epochs * steps_per_epoch - resume_step``, ``start_step=resume_step``.
- A finished run keeps its state: restarting it resumes with no step left.

Privacy:
  The folder holds the noise seed and the sampling seed of the run: whoever reads them can
  remove the noise from released updates. Keep it as private as the training data.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import keras

from dpcore import distribute
from dpcore.accounting.ledger import PrivacyLedger
from dpcore.optimizer import DPOptimizer

__all__ = ["StepBackup"]

_FORMAT = "dpcore.step_backup/1"
_STATE = "state.json"


def _read_steps(optimizer: DPOptimizer) -> int:
    return int(keras.ops.convert_to_numpy(optimizer.dp_steps))


def _write_json(path: str, payload: dict[str, Any]) -> None:
    """Writes ``path`` atomically (a reader sees the old file or the new one, never a part)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class StepBackup(keras.callbacks.Callback):
    """Saves the training state at logical-step boundaries and restores it on restart.

    Example (every worker runs the same program)::

      backup = StepBackup("/shared/run1/backup", strategy=strategy, epsilon=eps)
      data = sampling.sharded_poisson_batches(
          x, y, sampling_prob=q, num_workers=W, worker_index=i, seed=backup.sampling_seed,
          steps=epochs * spe - backup.resume_step, start_step=backup.resume_step)
      dp_model.fit(data, epochs=epochs, steps_per_epoch=spe, callbacks=[backup, eps])

    Args:
      backup_dir: the chief's folder for the state and weights (created when missing); every
        worker must see the same folder.
      strategy: the run's strategy (default: the current one). Creating the callback of a run
        that has no state yet is a collective operation under a multi-worker strategy (the
        sampling seed is broadcast from the chief): every worker creates it at the same point.
      save_every: save the weights every this many logical steps (>= 1). The state is
        written after every step whatever this is; see the module's resume rule.
      epsilon: the run's ``EpsilonCallback``, whose ledger is saved with the state and put
        back into it on restart (so ε counts every step applied before the restart).

    Privacy:
      Restored runs never reuse a step index: noise draws and sampling coins are keyed on it.
    """

    def __init__(
        self,
        backup_dir: str,
        *,
        strategy: Any = None,
        save_every: int = 1,
        epsilon: Any = None,
    ) -> None:
        super().__init__()
        if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
            raise ValueError(f"save_every must be a positive integer, got {save_every!r}.")
        if epsilon is not None and not isinstance(getattr(epsilon, "ledger", None), PrivacyLedger):
            raise ValueError(f"epsilon must be an EpsilonCallback, got {epsilon!r}.")
        self.backup_dir = backup_dir
        self.save_every = save_every
        self.epsilon = epsilon
        self._strategy = strategy or _current_strategy()
        self._chief = distribute.is_chief(self._strategy)
        state_path = os.path.join(backup_dir, _STATE)
        self._state: dict[str, Any] | None = None
        if os.path.exists(state_path):
            with open(state_path, encoding="utf-8") as f:
                state = json.load(f)
            if state.get("format") != _FORMAT:
                raise ValueError(f"{state_path} is not a {_FORMAT} state.")
            self._state = state
            seed = int(state["sampling_seed"])
        else:
            seed = distribute.shared_seed(self._strategy)
        self._seed = seed
        self._checkpoint: tuple[str, int] | None = (
            (self._state["checkpoint"], int(self._state["checkpoint_steps"]))
            if self._state and self._state.get("checkpoint")
            else None
        )
        self._saved_steps = -1  # steps in this process's last weights file
        self._resume_step = int(self._state["applied_steps"]) if self._state else 0
        self._to_restore = self._state is not None

    @property
    def sampling_seed(self) -> int:
        """The run's sampling seed: restored, or drawn for a new run."""
        return self._seed

    @property
    def resume_step(self) -> int:
        """Logical steps the run has applied before this start (0 for a new run)."""
        return self._resume_step

    @property
    def resumed(self) -> bool:
        """Whether this start continues a run that saved state."""
        return self._state is not None

    # ----------------------------------------------------------------------- callbacks
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        optimizer = self._optimizer()
        if not self._to_restore or self._state is None:
            return
        self._to_restore = False
        if self._checkpoint is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            name, steps = self._checkpoint
            self.model.load_weights(os.path.join(self.backup_dir, name))
            if _read_steps(optimizer) != steps:
                raise ValueError(
                    f"{name} holds dp_steps={_read_steps(optimizer)}, the state says {steps}."
                )
            self._saved_steps = steps
        else:
            steps = 0
        applied = self.resume_step
        if applied > steps:
            warnings.warn(
                f"dpcore: the run applied {applied} logical steps but its last weights were "
                f"saved after {steps} (save_every={self.save_every}); the updates of the "
                f"{applied - steps} steps in between are lost. They still count as spent: the "
                "ledger keeps them and their noise draws and sampling coins are not used again.",
                UserWarning,
                stacklevel=2,
            )
            optimizer.dp_steps.assign(applied)
        if self._state.get("model_ledger") is not None:  # every step applied, lost ones too
            optimizer.privacy_ledger = PrivacyLedger.from_dict(self._state["model_ledger"])
        if self.epsilon is not None and self._state.get("ledger") is not None:
            self.epsilon.ledger = PrivacyLedger.from_dict(self._state["ledger"])

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        applied = _read_steps(self._optimizer())
        self._save(applied, weights=applied % self.save_every == 0)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        applied = _read_steps(self._optimizer())
        self._save(applied, weights=applied != self._saved_steps)

    # -------------------------------------------------------------------------- saving
    def _optimizer(self) -> DPOptimizer:
        optimizer = getattr(self.model, "optimizer", None)
        if not isinstance(optimizer, DPOptimizer):
            raise ValueError("StepBackup needs a model compiled with a dpcore.DPOptimizer.")
        return optimizer

    def _save(self, applied: int, *, weights: bool) -> None:
        """Writes the weights (every worker) when asked, then the state (the chief)."""
        if weights:
            name = f"ckpt-{applied}.weights.h5"
            os.makedirs(self.backup_dir, exist_ok=True)
            target = distribute.worker_path(os.path.join(self.backup_dir, name), self._strategy)
            self.model.save_weights(target, overwrite=True)
            previous = self._checkpoint
            self._checkpoint = (name, applied)
            self._saved_steps = applied
        else:
            previous = None
        if self._chief:
            own = self._optimizer().privacy_ledger
            ledger = None
            if self.epsilon is not None:
                self.epsilon.flush()
                ledger = self.epsilon.ledger.to_dict()
            assert self._checkpoint is not None or not weights
            _write_json(
                os.path.join(self.backup_dir, _STATE),
                {
                    "format": _FORMAT,
                    "sampling_seed": self._seed,
                    "applied_steps": applied,
                    "checkpoint": self._checkpoint[0] if self._checkpoint else None,
                    "checkpoint_steps": self._checkpoint[1] if self._checkpoint else 0,
                    "ledger": ledger,
                    "model_ledger": None if own is None else own.to_dict(),
                },
            )
        if previous is not None and previous[0] != self._checkpoint[0]:  # type: ignore[index]
            old = distribute.worker_path(os.path.join(self.backup_dir, previous[0]), self._strategy)
            if os.path.exists(old):
                os.remove(old)


def _current_strategy() -> Any:
    import tensorflow as tf

    return tf.distribute.get_strategy()
