"""Alias of `dpcore_accounting.events` (the TensorFlow-free accounting package).

`import dpcore.accounting.events` and `dpcore_accounting.events` are the same module object.
"""

import sys

import dpcore_accounting.events as _module

sys.modules[__name__] = _module
