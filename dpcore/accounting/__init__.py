"""Privacy accounting for DP-SGD on dp-accounting.

Contract: every ε or δ dpcore reports comes from a `dp_accounting` accountant (PLD by default,
RDP on request) applied to the DpEvent of what ran: `poisson_event` for Poisson sampling,
`shuffle_event` (the sound no-amplification bound) for shuffled fixed-size batches.
`PrivacyLedger` records those events as training runs and round-trips through JSON;
`calibrate_noise_multiplier` / `calibrate_steps` never return a value that exceeds the target.
"""

from dpcore.accounting.calibration import (
    calibrate_noise_multiplier,
    calibrate_steps,
    run_event,
)
from dpcore.accounting.events import (
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
)
from dpcore.accounting.ledger import PrivacyLedger, warn_if_delta_too_large

__all__ = [
    "ACCOUNTANTS",
    "NEIGHBORING_RELATIONS",
    "SAMPLING_MODES",
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
    "warn_if_delta_too_large",
]
