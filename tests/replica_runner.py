"""Runs the suite's 2-replica scripts in one child process (started by tests/conftest.py).

Usage: python tests/replica_runner.py <folder>. ``<folder>/scripts.json`` lists the scripts
(``key``, ``source``, ``argv``); each runs as ``__main__`` in its own namespace, and its stdout
and error (a traceback, or "") go to ``<folder>/<key>.json`` as soon as it ends; ``<folder>/done``
marks the end of the run. After a script that failed, the rest run in a fresh process. The process
has 2 logical CPUs, set before any TensorFlow op as every script asks; a script's own request
for the same 2 devices is then a no-op (TensorFlow refuses a second one).
"""

import contextlib
import io
import json
import os
import sys
import traceback
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # noqa: E402

CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(CPU, [tf.config.LogicalDeviceConfiguration()] * 2)


def _already_set(device, logical_devices):
    """What a script's `set_logical_device_configuration` call does here: the 2 CPUs are set."""
    if device != CPU or len(logical_devices) != 2:
        raise RuntimeError("replica_runner: this process has exactly 2 logical CPUs")


tf.config.set_logical_device_configuration = _already_set


def _write(folder, key, payload):
    path = os.path.join(folder, f"{key}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)  # a reader sees the whole file or none


def main(folder):
    """Runs every script; writes ``<folder>/done`` at the end, whatever happened."""
    try:
        _run_all(folder)
    finally:
        open(os.path.join(folder, "done"), "w").close()


def _run_all(folder):
    with open(os.path.join(folder, "scripts.json")) as f:
        scripts = json.load(f)
    argv, path = list(sys.argv), list(sys.path)
    for index, script in enumerate(scripts):
        key = script["key"]
        if os.path.exists(os.path.join(folder, f"{key}.json")):
            continue  # run before this process was restarted
        # From a file, so that AutoGraph and tracebacks find the source.
        source_path = os.path.join(folder, f"{key}.py")
        with open(source_path, "w") as f:
            f.write(script["source"])
        # Strategies made by different scripts would number their collective ops alike (one
        # op's shape then clashes with another's): each script's get their own range, as
        # TensorFlow's own tests do.
        tf.distribute.MirroredStrategy._collective_key_base = 10_000 * (index + 1)
        stdout, error = io.StringIO(), ""
        sys.argv = [source_path, *script["argv"]]
        try:
            with contextlib.redirect_stdout(stdout), warnings.catch_warnings():
                code = compile(script["source"], source_path, "exec")
                exec(code, {"__name__": "__main__", "__file__": source_path})
        except BaseException:  # recorded: the test that owns the script reports it
            error = traceback.format_exc()
        finally:
            sys.argv, sys.path[:] = argv, path
        _write(folder, key, {"stdout": stdout.getvalue(), "error": error})
        if error:
            # A failed step can leave collective ops of the 2 replicas out of step, which would
            # fail the next scripts' collectives too: the rest run in a fresh process.
            sys.stdout.flush()
            sys.stderr.flush()
            os.execv(sys.executable, [sys.executable, __file__, folder])


if __name__ == "__main__":
    main(sys.argv[1])
