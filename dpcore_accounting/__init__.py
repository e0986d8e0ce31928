"""Privacy accounting for DP-SGD on dp-accounting, importable without TensorFlow.

Contract:
  * This package imports only the standard library, dp-accounting (with numpy and scipy) and
    absl; never TensorFlow or Keras. `dpcore-epsilon` (`dpcore_accounting.cli`, with the
    console scripts' shared body in `_program`) uses it alone and starts without TensorFlow's
    import.
  * `dpcore.accounting` and `dpcore.DPConfig` re-export these same objects (the modules under
    `dpcore.accounting` and `dpcore.config` are aliases of the ones here), so code written
    against `dpcore` keeps working and `isinstance` checks agree across both names.
  * Every ε or δ reported comes from a `dp_accounting` accountant (PLD by default, RDP on
    request) applied to the DpEvent of what ran: `poisson_event` for Poisson sampling,
    `shuffle_event` (the sound no-amplification bound) for shuffled fixed-size batches.
    `PrivacyLedger` records those events as training runs and round-trips through JSON;
    `calibrate_noise_multiplier` / `calibrate_steps` never return a value that exceeds the
    target. `DPConfig` is the frozen description of a run from which the event is derived.
  * RDP accountants made here (`make_accountant("rdp")`, used by every entry point) drop
    dp-accounting's "failed to converge" warnings, one per fractional order it leaves out of
    the minimum (ε stays a sound bound), only while they compose; other warnings pass.
"""

from dpcore_accounting.calibration import (
    calibrate_noise_multiplier,
    calibrate_steps,
    run_event,
)
from dpcore_accounting.config import DPConfig
from dpcore_accounting.events import (
    ACCOUNTANTS,
    NEIGHBORING_RELATIONS,
    SAMPLING_MODES,
    compute_delta,
    compute_epsilon,
    make_accountant,
    neighboring_relation,
    poisson_event,
    shuffle_epochs,
    shuffle_event,
    shuffle_steps_per_epoch,
    steps_for_epochs,
)
from dpcore_accounting.ledger import PrivacyLedger, warn_if_delta_too_large

__all__ = [
    "ACCOUNTANTS",
    "NEIGHBORING_RELATIONS",
    "SAMPLING_MODES",
    "DPConfig",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "compute_delta",
    "compute_epsilon",
    "make_accountant",
    "neighboring_relation",
    "poisson_event",
    "run_event",
    "shuffle_epochs",
    "shuffle_event",
    "shuffle_steps_per_epoch",
    "steps_for_epochs",
    "warn_if_delta_too_large",
]
