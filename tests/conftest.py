"""Shared test set-up: quiet TensorFlow logs, deterministic seeds, small model zoo."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import hashlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    yield


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_configure(config):
    tf.config.threading.set_inter_op_parallelism_threads(2)
    config.addinivalue_line(
        "markers",
        "replica_script(source, *argv): the test reads that script's run on 2 logical CPUs "
        "(the replica_run fixture)",
    )


# ------------------------------------------------------------------- work shared by tests
def _shared_folder(config) -> Path:
    """A folder of this test run that every pytest-xdist worker of it sees."""
    base = config._tmp_path_factory.getbasetemp()
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its basetemp is in the run's
        base = base.parent
    return base


@pytest.fixture(scope="session")
def run_once(request):
    """``run_once(name, fn)``: ``fn(folder)`` once per test run, across pytest-xdist workers too
    (a worker that comes second waits for the first), for work several tests read, such as
    one start of a cluster; returns the folder. A failure of ``fn`` fails every test asking."""
    base = _shared_folder(request.config) / "run_once"

    def run(name, fn):
        folder = base / name
        folder.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(folder / ".started", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            deadline = time.monotonic() + REPLICA_TIMEOUT_S
            while not (folder / ".done").exists():
                if time.monotonic() > deadline:
                    pytest.fail(f"{name}: not finished by another worker within the timeout")
                time.sleep(0.5)
        else:
            try:
                fn(folder)
            except BaseException as e:
                (folder / ".failed").write_text(f"{type(e).__name__}: {e}")
                raise
            finally:
                (folder / ".done").touch()
        if (folder / ".failed").exists():
            pytest.fail(f"{name} failed: {(folder / '.failed').read_text()}")
        return folder

    return run


# ------------------------------------------------------------------------ 2-replica scripts
# A MirroredStrategy over 2 logical CPUs needs them set before any TensorFlow op of the process,
# so tests of it run a script in another process. The scripts of every collected test marked
# `replica_script` run in one child process (tests/replica_runner.py: one TensorFlow start-up
# for all), started once per run as soon as the tests are collected and running beside them;
# the `replica_run` fixture waits for its test's script.
RUNNER = Path(__file__).with_name("replica_runner.py")
REPLICA_TIMEOUT_S = 1800


def _replica_key(marker) -> str:
    source, *argv = marker.args
    return hashlib.sha1(json.dumps([source, argv]).encode()).hexdigest()[:16]


def _replica_folder(config) -> Path:
    return _shared_folder(config) / "replica_scripts"


def pytest_collection_finish(session):
    scripts = {}
    for item in session.items:
        marker = item.get_closest_marker("replica_script")
        if marker is not None:
            key = _replica_key(marker)
            scripts[key] = {"key": key, "source": marker.args[0], "argv": list(marker.args[1:])}
    if not scripts or session.config.option.collectonly:
        return
    folder = _replica_folder(session.config)
    folder.mkdir(parents=True, exist_ok=True)
    try:  # the first worker to get here starts the child; the others read its results
        os.close(os.open(folder / "started", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    (folder / "scripts.json").write_text(json.dumps(list(scripts.values())))
    root = str(RUNNER.parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    with open(folder / "runner.log", "w") as log:
        session.config._replica_runner = subprocess.Popen(
            [sys.executable, str(RUNNER), str(folder)],
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def pytest_sessionfinish(session, exitstatus):
    runner = getattr(session.config, "_replica_runner", None)
    if runner is None:
        return
    stopped = session.shouldfail or session.shouldstop or exitstatus == pytest.ExitCode.INTERRUPTED
    try:  # unless the run was stopped, another worker may still wait for a script's result
        runner.wait(timeout=0 if stopped else REPLICA_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        runner.kill()
        runner.wait()


@pytest.fixture
def replica_run(request) -> dict:
    """``{"stdout": ..., "error": ...}`` of the test's `replica_script` run on 2 logical CPUs
    (``error``: the script's traceback, or "")."""
    marker = request.node.get_closest_marker("replica_script")
    assert marker is not None, "replica_run needs @pytest.mark.replica_script(source, *argv)"
    folder = _replica_folder(request.config)
    path = folder / f"{_replica_key(marker)}.json"
    deadline = time.monotonic() + REPLICA_TIMEOUT_S
    while not path.exists():
        done = (folder / "done").exists()
        if done or time.monotonic() > deadline:
            if path.exists():
                break
            log = folder / "runner.log"
            tail = log.read_text()[-3000:] if log.exists() else ""
            pytest.fail(f"tests/replica_runner.py ended without this script's result:\n{tail}")
        time.sleep(0.2)
    return json.loads(path.read_text())
