"""Helpers shared by the dpcore-side experiments: JSON output and memory probes.

Contract: standard library only (no TensorFlow, no dpcore), so any experiment can import it
cheaply. The model definitions live in :mod:`dpcore_experiments.lib.zoo`.
"""

from __future__ import annotations

import json
import os
import resource
from typing import Any

__all__ = ["peak_rss_mb", "proc_status_kb", "reset_peak_rss", "write_json_atomic"]


def write_json_atomic(path: str, payload: Any, *, indent: int = 2, **dump_kwargs: Any) -> None:
    """Writes ``payload`` as JSON to ``path`` atomically (a temporary file, then a rename).

    A reader (or a run interrupted mid-write) sees the old file or the new one, never half.

    Args:
      path: destination; its directory is created if missing.
      payload: anything ``json.dump`` takes (with ``dump_kwargs``, e.g. ``default=str``).
      indent: JSON indentation.
      **dump_kwargs: further ``json.dump`` arguments (``sort_keys``, ``default``).
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=indent, **dump_kwargs)
    os.replace(tmp, path)


def proc_status_kb(field: str, pid: int | str = "self") -> float | None:
    """A ``/proc/<pid>/status`` field in kB (``VmRSS``, ``VmHWM``); None where unavailable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets this process's ``VmHWM`` (Linux >= 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """This process's peak resident memory since it started, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
