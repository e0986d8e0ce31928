"""Local tf.distribute workers: a command run as N workers of one cluster on loopback ports.

Contract:
  * `launch(argv, workers=N, ...)` starts N copies of `argv`, each with its own `TF_CONFIG`
    (`{"cluster": {"worker": [127.0.0.1:p0, ...]}, "task": {"type": "worker", "index": i}}`, on
    ports free when they were picked) and `DPCORE_WORKER_INDEX=i` in its environment. Worker 0
    is the chief (`MultiWorkerMirroredStrategy` makes worker 0 the chief when there is no
    "chief" task).
  * The chief's output goes to `stream` as it comes; every worker's output (the chief's too)
    is also written to `<log_dir>/worker<i>.log`.
  * No worker outlives the launch: when any worker fails, the others are killed at once (a
    peer blocked in a collective op would wait forever); when the chief ends, the others get
    `grace_s` seconds to finish, then are killed; at `timeout_s` all are killed.
  * Returns each worker's exit status (negative: killed by that signal).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

__all__ = ["WorkerRun", "free_ports", "launch", "tf_config"]


@dataclasses.dataclass(frozen=True)
class WorkerRun:
    """How one worker ended.

    Attributes:
      index: the worker's task index (0 is the chief).
      returncode: its exit status; negative when it was killed by that signal.
      log_path: the file holding its output (stdout and stderr).
      killed: True when the launcher stopped it (timeout, a failed peer, grace period over).
    """

    index: int
    returncode: int
    log_path: str
    killed: bool


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that were free when picked."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(ports: Sequence[int], index: int) -> str:
    """The `TF_CONFIG` of worker `index` of a loopback cluster on `ports`."""
    workers = [f"127.0.0.1:{p}" for p in ports]
    return json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": int(index)}}
    )


def _pump(source: IO[bytes], log: IO[bytes], stream: IO[str] | None) -> None:
    for line in iter(source.readline, b""):
        log.write(line)
        log.flush()
        if stream is not None:
            stream.write(line.decode(errors="replace"))
            stream.flush()


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Kills a worker's process group (it may have started children of its own)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def launch(
    argv: Sequence[str],
    *,
    workers: int,
    timeout_s: float,
    grace_s: float = 30.0,
    log_dir: str | None = None,
    stream: IO[str] | None = None,
    env: dict[str, str] | None = None,
) -> list[WorkerRun]:
    """Runs `argv` as `workers` local workers of one cluster; see the module contract.

    Args:
      argv: the command (program and arguments) every worker runs.
      workers: N (>= 1).
      timeout_s: wall-clock limit for the whole launch; every worker still running then is
        killed.
      grace_s: how long the other workers may run on after the chief ended.
      log_dir: where the logs go (default: a new temporary folder).
      stream: where the chief's output is copied as it comes (None: logs only).
      env: the workers' base environment (default: this process's).

    Returns:
      One `WorkerRun` per worker, by index.
    """
    if int(workers) < 1:
        raise ValueError(f"workers must be >= 1, got {workers}.")
    if not argv:
        raise ValueError("argv must name a command.")
    log_dir = log_dir or tempfile.mkdtemp(prefix="launch_local_")
    os.makedirs(log_dir, exist_ok=True)
    ports = free_ports(int(workers))
    processes, pumps, logs = [], [], []
    killed: set[int] = set()
    try:
        for i in range(int(workers)):
            log = open(os.path.join(log_dir, f"worker{i}.log"), "wb")  # noqa: SIM115
            logs.append(log)
            process, pump = _start_worker(argv, ports, i, env, log, stream if i == 0 else None)
            processes.append(process)
            pumps.append(pump)
        _watch(processes, killed, timeout_s=float(timeout_s), grace_s=float(grace_s))
    finally:
        for i, p in enumerate(processes):
            if p.poll() is None:
                killed.add(i)
                _stop(p)
        for pump in pumps:
            pump.join(timeout=5.0)
        for log in logs:
            log.close()
    return [
        WorkerRun(
            index=i,
            returncode=int(p.returncode),
            log_path=os.path.join(log_dir, f"worker{i}.log"),
            killed=i in killed,
        )
        for i, p in enumerate(processes)
    ]


def _start_worker(
    argv: Sequence[str],
    ports: Sequence[int],
    index: int,
    env: dict[str, str] | None,
    log: IO[bytes],
    stream: IO[str] | None,
) -> tuple[subprocess.Popen[bytes], threading.Thread]:
    """Starts worker `index` and the thread that copies its output to `log` (and `stream`)."""
    worker_env = dict(os.environ if env is None else env)
    worker_env.update(TF_CONFIG=tf_config(ports, index), DPCORE_WORKER_INDEX=str(index))
    process = subprocess.Popen(
        list(argv),
        env=worker_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: _stop reaches its children
    )
    assert process.stdout is not None
    pump = threading.Thread(target=_pump, args=(process.stdout, log, stream), daemon=True)
    pump.start()
    return process, pump


def _watch(
    processes: list[subprocess.Popen[bytes]],
    killed: set[int],
    *,
    timeout_s: float,
    grace_s: float,
) -> None:
    """Waits for the workers; kills the rest (adding them to `killed`) when one fails, when the
    chief ended more than `grace_s` ago, or at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    chief_end: float | None = None
    while any(p.poll() is None for p in processes):
        now = time.monotonic()
        failed = any(p.poll() not in (None, 0) for p in processes)
        if processes[0].poll() is not None and chief_end is None:
            chief_end = now
        late = chief_end is not None and now - chief_end > grace_s
        if failed or late or now > deadline:
            for i, p in enumerate(processes):
                if p.poll() is None:
                    killed.add(i)
                    _stop(p)
            break
        time.sleep(0.1)
