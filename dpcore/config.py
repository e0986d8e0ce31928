"""Alias of `dpcore_accounting.config` (`DPConfig` lives in the TensorFlow-free package).

`import dpcore.config` and `dpcore_accounting.config` are the same module object, so
`dpcore.config.DPConfig is dpcore.DPConfig is dpcore_accounting.DPConfig`.
"""

import sys

import dpcore_accounting.config as _module

sys.modules[__name__] = _module
