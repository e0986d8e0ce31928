"""What every dpcore binary shares: user errors, quiet TensorFlow, output folders, help.

Contract:
  * `run_program(prepare=..., execute=..., define_flags=..., help_text=...)` is the body of
    every console script (`dpcore-train`, `dpcore-audit`, ...). It defines the program's flags,
    parses them, calls `prepare(argv)` (flag and file checks, output folder; no TensorFlow),
    then imports TensorFlow without its start-up noise (`tf_startup`), and calls
    `execute(prepared)`; the program exits with `execute`'s return value.
  * A user error (a flag that does not parse, a `UserError` raised by `prepare` or `execute`)
    prints ONE line, `error: <what is wrong and what to do>`, on stderr and exits with status 2,
    without a traceback. Anything else (a bug) keeps its traceback.
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

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

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

EXIT_USER_ERROR = 2
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


class UserError(Exception):
    """A mistake in the command line or in the files it names (not a bug in the program)."""


def fail(message: str) -> NoReturn:
    """Prints `error: <message>` (one line) on stderr and exits with status 2."""
    sys.stdout.flush()
    text = " ".join(str(message).split())  # one line, whatever the message
    print(f"error: {text}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


@contextlib.contextmanager
def user_errors(*types: type[BaseException], hint: str = "") -> Iterator[None]:
    """Turns the given exception types, raised inside the block, into `UserError`s.

    For the few calls whose failure is the user's input (loading their data files, building
    settings from flags); never wrap training itself, where such an error would be a bug.
    """
    try:
        yield
    except types as err:
        message = str(err) or type(err).__name__
        raise UserError(f"{message} {hint}".strip()) from err


def check_no_arguments(argv: list[str]) -> None:
    """A `UserError` for words on the command line that are not flags."""
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {argv[1:]}: every setting is a --flag=value.")


def check_readable_file(path: str | None, flag: str) -> str:
    """`path` if it names a readable file, else a `UserError` naming `--flag`."""
    if not path:
        raise UserError(f"--{flag} is required.")
    if not os.path.isfile(path):
        raise UserError(f"--{flag}={path}: no such file.")
    if not os.access(path, os.R_OK):
        raise UserError(f"--{flag}={path}: not readable.")
    return path


def check_writable_file(path: str, flag: str) -> str:
    """`path` if a file can be written there (its folder is created), else a `UserError`."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(21, "it is a folder")
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise NotADirectoryError(20, f"{folder} is a file, not a folder")
        os.makedirs(folder, exist_ok=True)
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(13, "not writable")
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise UserError(
            f"--{flag}={path} cannot be written ({err.strerror or err}); give a path you can "
            "write to."
        ) from err
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


def _show_flags_in_short_help(module_name: str) -> None:
    """Lists the flags defined in `module_name` under `--help` (absl shows only the flags
    of the module it takes for the program, `sys.argv[0]`, which is the console script)."""
    from absl import flags

    main_key = sys.argv[0]
    if module_name == main_key:
        return
    shown = {id(f) for f in flags.FLAGS.get_flags_for_module(main_key)}
    for flag in flags.FLAGS.get_flags_for_module(module_name):
        if id(flag) not in shown:
            flags.FLAGS.register_flag_by_module(main_key, flag)


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
    from absl import app, flags, logging

    if not getattr(define_flags, "_dpcore_defined", False):
        before = set(flags.FLAGS)
        define_flags()
        define_flags._dpcore_defined = True  # type: ignore[attr-defined]
        new = set(flags.FLAGS) - before
        modules = {flags.FLAGS.find_module_defining_flag(name) for name in new}
        for module in modules - {None}:
            _show_flags_in_short_help(module)
    sys.modules["__main__"].__doc__ = help_text

    def parse(argv: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv)
        except flags.Error as err:
            fail(f"{err} (see --help)")

    def body(argv: list[str]) -> Any:
        try:
            prepared = prepare(argv)
            if tensorflow:
                from dpcore_experiments.tf_startup import import_tensorflow_quietly

                import_tensorflow_quietly()
                if not flags.FLAGS["verbosity"].present:
                    logging.set_verbosity(logging.WARNING)
            return execute(prepared)
        except UserError as err:
            fail(str(err))

    app.run(body, flags_parser=parse)
