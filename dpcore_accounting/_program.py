"""What every dpcore console script shares: user errors as one line, help, the program body.

Contract:
  * `run_program(prepare=..., execute=..., define_flags=..., help_text=...)` is the body of
    every console script (`dpcore-epsilon` here; `dpcore-train`, `dpcore-audit`, ... through
    `dpcore_experiments.lib.cli`). It defines the program's flags, parses them, calls
    `prepare(argv)` (flag and file checks), then `before_execute()` if given, then
    `execute(prepared)`; the program exits with `execute`'s return value.
  * A user error (a flag that does not parse, a `UserError` raised by `prepare` or `execute`)
    prints ONE line, `error: <what is wrong and what to do>`, on stderr and exits with status 2,
    without a traceback. Anything else (a bug) keeps its traceback.
  * `--help` prints `help_text` (written for users) and the program's own flags, also when the
    program runs as a console script; module docstrings are for readers of the code.
  * Standard library and absl only: the console scripts' binaries use it, never library code.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

__all__ = [
    "EXIT_USER_ERROR",
    "UserError",
    "check_no_arguments",
    "check_writable_file",
    "fail",
    "run_program",
    "user_errors",
]

EXIT_USER_ERROR = 2

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


def _define_once(define_flags: Callable[[], None]) -> None:
    """Calls `define_flags` unless it ran already, and shows its flags under `--help`."""
    from absl import flags

    if getattr(define_flags, "_dpcore_defined", False):
        return
    before = set(flags.FLAGS)
    define_flags()
    define_flags._dpcore_defined = True  # type: ignore[attr-defined]
    new = set(flags.FLAGS) - before
    modules = {flags.FLAGS.find_module_defining_flag(name) for name in new}
    for module in modules:
        if module is not None:
            _show_flags_in_short_help(module)


def run_program(
    *,
    prepare: Callable[[list[str]], T],
    execute: Callable[[T], int | None],
    define_flags: Callable[[], None],
    help_text: str,
    before_execute: Callable[[], None] | None = None,
) -> None:
    """Runs a dpcore binary (see the module contract); never returns.

    Args:
      prepare: checks the parsed flags and the files they name and returns what `execute`
        needs. Raises `UserError`.
      execute: does the work; may raise `UserError` (e.g. a data file that does not parse);
        its return value is the exit status (None: 0).
      define_flags: defines the program's absl flags (called once).
      help_text: what `--help` prints above the flags: what the program does, examples.
      before_execute: called between `prepare` and `execute` (e.g. a quiet TensorFlow import).
    """
    from absl import app, flags

    _define_once(define_flags)
    sys.modules["__main__"].__doc__ = help_text

    def parse(argv: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv)
        except flags.Error as err:
            fail(f"{err} (see --help)")

    def body(argv: list[str]) -> Any:
        try:
            prepared = prepare(argv)
            if before_execute is not None:
                before_execute()
            return execute(prepared)
        except UserError as err:
            fail(str(err))

    app.run(body, flags_parser=parse)
