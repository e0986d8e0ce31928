"""Alias of `dpcore_accounting.events` (the TensorFlow-free accounting package).

`import dpcore.accounting.events` and `dpcore_accounting.events` are the same module object.
"""

import sys
from typing import TYPE_CHECKING

import dpcore_accounting.events as _module

if TYPE_CHECKING:  # type checkers do not follow the sys.modules swap below
    from dpcore_accounting.events import *  # noqa: F403

sys.modules[__name__] = _module
