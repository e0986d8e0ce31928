"""Alias of `dpcore_accounting.calibration` (the TensorFlow-free accounting package).

`import dpcore.accounting.calibration` and `dpcore_accounting.calibration` are the same module object.
"""

import sys

import dpcore_accounting.calibration as _module

sys.modules[__name__] = _module
