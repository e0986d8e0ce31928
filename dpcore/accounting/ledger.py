"""Alias of `dpcore_accounting.ledger` (the TensorFlow-free accounting package).

`import dpcore.accounting.ledger` and `dpcore_accounting.ledger` are the same module object.
"""

import sys

import dpcore_accounting.ledger as _module

sys.modules[__name__] = _module
