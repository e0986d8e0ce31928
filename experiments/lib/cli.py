"""What every dpcore binary shares: user errors, quiet TensorFlow, output folders, help.

Contract:
  * `run_program(prepare=..., execute=..., define_flags=..., help_text=...)` is the body of
    every console script (`dpcore-train`, `dpcore-audit`, ...): `dpcore_accounting._program`'s
    (flags, `prepare(argv)` with flag and file checks and the output folder but no TensorFlow,
    `execute(prepared)`), with TensorFlow imported without its start-up noise (`tf_startup`)
    between the two. `dpcore-epsilon` (`dpcore_accounting.cli`) uses that body directly.
  * A user error (a flag that does not parse, a `UserError` raised by `prepare` or `execute`)
    prints ONE line, `error: <what is wrong and what to do>`, on stderr and exits with status 2,
    without a traceback. Anything else (a bug) keeps its traceback. `UserError`, `fail`,
    `user_errors`, `check_no_arguments` and `check_writable_file` are those of
    `dpcore_accounting._program`.
  * `--help` prints `help_text` (written for users) and the program's own flags, also when the
    program runs as a console script; module docstrings (with their "Contract:" sections) are
    for readers of the code and are not shown.
  * `output_dir(value, program)` is the folder a run writes into: `value`, or
    `runs/<program>-<YYYYmmdd-HHMMSS>` by default; it is created and checked writable at once,
    so an unwritable output fails before any training.
  * Standard library and absl only at import time (TensorFlow is imported by `run_program`
    after `prepare`), so a bad command line fails in well under a second.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import TypeVar

from dpcore_accounting import _program
from dpcore_accounting._program import (
    EXIT_USER_ERROR,
    UserError,
    check_no_arguments,
    check_writable_file,
    fail,
    user_errors,
)

__all__ = [
    "EXIT_USER_ERROR",
    "UserError",
    "check_dataset",
    "check_idx_dir",
    "check_no_arguments",
    "check_readable_file",
    "check_writable_file",
    "fail",
    "output_dir",
    "run_program",
    "user_errors",
]

RUNS_DIR = "runs"
# The four MNIST-format files `dpcore.data.load_idx_dataset` reads (each also accepted without
# `.gz`); tests/test_binaries.py checks that these constants agree with dpcore.data.
IDX_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)

# Where `dpcore.data.load_dataset` reads each IDX dataset when no --data_dir is given.
DEFAULT_DATA_DIRS = {
    "fashion_mnist": "/usr/share/datasets/fashion-mnist",
    "mnist": "/usr/share/datasets/mnist",
}

T = TypeVar("T")


def check_readable_file(path: str | None, flag: str) -> str:
    """`path` if it names a readable file, else a `UserError` naming `--flag`."""
    if not path:
        raise UserError(f"--{flag} is required.")
    if not os.path.isfile(path):
        raise UserError(f"--{flag}={path}: no such file.")
    if not os.access(path, os.R_OK):
        raise UserError(f"--{flag}={path}: not readable.")
    return path


def check_idx_dir(data_dir: str, flag: str = "data_dir") -> None:
    """Checks that `data_dir` holds the four MNIST-format IDX files (gzip or plain)."""
    if not os.path.isdir(data_dir):
        raise UserError(
            f"--{flag}={data_dir}: no such directory. Point --{flag} at the four MNIST-format "
            "IDX files (Fashion-MNIST on Debian/Ubuntu: apt-get install dataset-fashion-mnist)."
        )
    missing = [
        name
        for name in IDX_FILES
        if not any(os.path.isfile(os.path.join(data_dir, n)) for n in (name, name[:-3]))
    ]
    if missing:
        raise UserError(f"--{flag}={data_dir} lacks {', '.join(missing)} (or their unzipped form).")


def check_dataset(dataset: str, data_dir: str | None) -> None:
    """Checks that `--dataset`'s files are where `dpcore.data.load_dataset` will read them."""
    if dataset not in DEFAULT_DATA_DIRS:  # digits ship with scikit-learn
        return
    if data_dir:
        check_idx_dir(data_dir)
        return
    try:
        check_idx_dir(DEFAULT_DATA_DIRS[dataset])
    except UserError as err:
        raise UserError(
            f"--dataset={dataset} reads {DEFAULT_DATA_DIRS[dataset]} when --data_dir is not "
            "given, and that folder is missing or incomplete; give --data_dir=<folder of its "
            "four IDX files>."
        ) from err


def output_dir(value: str | None, program: str, *, flag: str = "output_dir") -> str:
    """The run's output folder, created and checked writable now (before any training).

    Args:
      value: the folder the user gave, or None for `runs/<program>-<YYYYmmdd-HHMMSS>` (a
        suffix `-2`, `-3`, ... when that folder exists already).
      program: the binary's short name (`train`, `audit`, ...).
      flag: the flag's name, for the error message.

    Returns:
      The folder's path.

    Raises:
      UserError: if the folder cannot be created or written to.
    """
    path = value
    if not path:
        base = os.path.join(RUNS_DIR, f"{program}-{time.strftime('%Y%m%d-%H%M%S')}")
        path, n = base, 1
        while os.path.exists(path):
            n += 1
            path = f"{base}-{n}"
    try:
        if os.path.exists(path) and not os.path.isdir(path):
            raise NotADirectoryError(20, "it is a file")
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise UserError(
            f"--{flag}={path} is not a writable folder ({err.strerror or err}); give "
            f"--{flag} a folder you can write to."
        ) from err
    return path


def _quiet_tensorflow() -> None:
    """Imports TensorFlow without its start-up noise; absl logs warnings and up by default."""
    from absl import flags, logging
    from dpcore_experiments.lib.tf_startup import import_tensorflow_quietly

    import_tensorflow_quietly()
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


def run_program(
    *,
    prepare: Callable[[list[str]], T],
    execute: Callable[[T], int | None],
    define_flags: Callable[[], None],
    help_text: str,
    tensorflow: bool = True,
) -> None:
    """Runs a dpcore binary (see the module contract); never returns.

    Args:
      prepare: checks the parsed flags and the files they name, creates the output folder and
        returns what `execute` needs; it must not import TensorFlow. Raises `UserError`.
      execute: does the work; may raise `UserError` (e.g. a data file that does not parse);
        its return value is the exit status (None: 0).
      define_flags: defines the program's absl flags (called once).
      help_text: what `--help` prints above the flags: what the program does, examples.
      tensorflow: import TensorFlow quietly between `prepare` and `execute`.
    """
    _program.run_program(
        prepare=prepare,
        execute=execute,
        define_flags=define_flags,
        help_text=help_text,
        before_execute=_quiet_tensorflow if tensorflow else None,
    )
