"""Alias of `dpcore_accounting.ledger` (the TensorFlow-free accounting package).

`import dpcore.accounting.ledger` and `dpcore_accounting.ledger` are the same module object.
"""

import sys
from typing import TYPE_CHECKING

import dpcore_accounting.ledger as _module

if TYPE_CHECKING:  # type checkers do not follow the sys.modules swap below
    from dpcore_accounting.ledger import *  # noqa: F403

sys.modules[__name__] = _module
