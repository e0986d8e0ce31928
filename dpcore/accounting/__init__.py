"""Privacy accounting for DP-SGD: `dpcore_accounting` under its `dpcore` name.

Contract: the implementation lives in the top-level package `dpcore_accounting`, which never
imports TensorFlow, so the `dpcore-epsilon` CLI starts fast; importing anything under `dpcore`
runs `dpcore/__init__.py`, which imports TensorFlow (it registers the Keras serializables that
`keras.saving.load_model` needs). Everything here is the same object as there:
`dpcore.accounting.events is dpcore_accounting.events`. See `dpcore_accounting` for the
accounting contract.
"""

import dpcore_accounting
from dpcore_accounting import *  # noqa: F403  (exactly the names in its __all__)
from dpcore_accounting import calibration as calibration
from dpcore_accounting import events as events
from dpcore_accounting import ledger as ledger

__all__: list[str] = []
__all__ += dpcore_accounting.__all__
