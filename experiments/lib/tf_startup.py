"""TensorFlow for an experiment binary, without the C++ start-up lines that look like failures.

Contract:
  * `import_tensorflow_quietly()` is for a program's `__main__` only (it sets an environment
    variable and briefly redirects file descriptor 2); dpcore's library code never does either.
  * It sets `TF_CPP_MIN_LOG_LEVEL=2` unless the user set it (TensorFlow's C++ INFO and WARNING
    logs after start-up are dropped, errors still print), then imports TensorFlow and lists
    its devices with stderr captured, and writes back every captured line except the known
    start-up noise: C++ INFO/WARNING lines (oneDNN notice, "Could not find cuda drivers", CPU
    feature notes; with or without the date prefix of older TensorFlow), older TensorFlow's
    "Unable to register cuDNN/cuFFT/cuBLAS factory" errors, absl's "All log messages before absl::InitializeLog()" banner and the
    `failed call to cuInit` error of a machine without a GPU driver. These lines are printed
    while TensorFlow's shared libraries load, before `TF_CPP_MIN_LOG_LEVEL` is read, so the
    variable alone cannot silence them.
  * Anything else written during the import (Python warnings, other C++ errors, a traceback)
    is written back unchanged, and an import error still propagates.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from types import ModuleType

__all__ = ["import_tensorflow_quietly", "is_startup_noise"]

# absl/TensorFlow C++ log prefix: severity, MMDD, time, thread id, file:line].
_CXX_INFO_OR_WARNING = re.compile(r"^[IW]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\] ")
_CXX_CUINIT_ERROR = re.compile(r"^E\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\] failed call to cuInit")
# Older TensorFlow (2.16) logs, as errors, that its CUDA plugins register twice.
_CXX_FACTORY_ERROR = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: )?E\S* .*Unable to register cu(DNN|FFT|BLAS) "
    r"factory: Attempting to register factory for plugin cu\w+ when one has already been"
)
# Older TensorFlow writes its C++ logs with a date prefix: "2026-01-01 00:00:00.000: I ...".
_DATED_INFO_OR_WARNING = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] \S+:\d+\] ")
_NOISE_PREFIXES = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "To enable the following instructions:",  # second line of the CPU-feature INFO line
)


def is_startup_noise(line: str) -> bool:
    """True for a captured start-up line that does not indicate a problem (see module)."""
    return (
        bool(_CXX_INFO_OR_WARNING.match(line))
        or bool(_CXX_CUINIT_ERROR.match(line))
        or bool(_CXX_FACTORY_ERROR.match(line))
        or bool(_DATED_INFO_OR_WARNING.match(line))
        or line.startswith(_NOISE_PREFIXES)
    )


def import_tensorflow_quietly() -> ModuleType:
    """Imports TensorFlow (and finds its devices) without its start-up noise on stderr.

    Returns:
      The `tensorflow` module.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()  # device discovery logs here (cuInit)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode("utf-8", errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not is_startup_noise(line))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()
    return tf
