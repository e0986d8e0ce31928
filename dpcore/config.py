"""Alias of `dpcore_accounting.config` (`DPConfig` lives in the TensorFlow-free package).

`import dpcore.config` and `dpcore_accounting.config` are the same module object, so
`dpcore.config.DPConfig is dpcore.DPConfig is dpcore_accounting.DPConfig`.
"""

import sys
from typing import TYPE_CHECKING

import dpcore_accounting.config as _module

if TYPE_CHECKING:  # type checkers do not follow the sys.modules swap below
    from dpcore_accounting.config import *  # noqa: F403

sys.modules[__name__] = _module
