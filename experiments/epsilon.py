"""Deprecated: `dpcore-epsilon` lives in `dpcore_accounting.cli`; this path goes in the next release."""

import warnings

from dpcore_accounting.cli import (  # noqa: F401  (the names this module had)
    FLAGS,
    HELP,
    PRIVACY_UNITS,
    compute,
    format_result,
    main,
    prepare,
    run,
)

warnings.warn(
    "dpcore_experiments.epsilon is deprecated; use dpcore_accounting.cli (the same names).",
    DeprecationWarning,
    stacklevel=1 if __name__ == "__main__" else 2,  # shown where it was imported, or run
)

if __name__ == "__main__":
    run()
