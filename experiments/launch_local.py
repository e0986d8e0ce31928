"""launch_local: runs a command as N local tf.distribute workers on loopback ports.

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
  * Returns each worker's exit status (negative: killed by that signal); the program exits
    with the status of the first worker that failed by itself (else of one the launcher
    stopped), 0 when all succeeded.

  * The program (`dpcore-launch-local`) keeps the logs in `--output_dir` (default
    `runs/launch_local-<time>/`) and names that folder in its last line.

Example:
  dpcore-launch-local --workers=2 -- python my_training.py --flag=value
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

from dpcore_experiments.lib import cli

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
            worker_env = dict(os.environ if env is None else env)
            worker_env.update(TF_CONFIG=tf_config(ports, i), DPCORE_WORKER_INDEX=str(i))
            log = open(os.path.join(log_dir, f"worker{i}.log"), "wb")  # noqa: SIM115
            logs.append(log)
            process = subprocess.Popen(
                list(argv),
                env=worker_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: _stop reaches its children
            )
            processes.append(process)
            assert process.stdout is not None
            pump = threading.Thread(
                target=_pump, args=(process.stdout, log, stream if i == 0 else None), daemon=True
            )
            pump.start()
            pumps.append(pump)
        deadline = time.monotonic() + float(timeout_s)
        chief_end: float | None = None
        while any(p.poll() is None for p in processes):
            now = time.monotonic()
            failed = any(p.poll() not in (None, 0) for p in processes)
            if processes[0].poll() is not None and chief_end is None:
                chief_end = now
            late = chief_end is not None and now - chief_end > float(grace_s)
            if failed or late or now > deadline:
                for i, p in enumerate(processes):
                    if p.poll() is None:
                        killed.add(i)
                        _stop(p)
                break
            time.sleep(0.1)
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


HELP = """dpcore-launch-local: runs a command as N local TensorFlow workers of one cluster.

Starts N copies of the command, each with its own TF_CONFIG on free loopback ports (worker
0 is the chief), streams the chief's output, and keeps every worker's output in
<output_dir>/worker<i>.log (default runs/launch_local-<date>-<time>/). When one worker fails
the others are stopped at once; when the chief ends the others get --grace_s seconds; at
--timeout_s all are stopped. Exits with the status of the first worker that failed.

Example:
  dpcore-launch-local --workers=2 -- dpcore-train --epochs=1 --output_dir=runs/two
"""


@dataclasses.dataclass(frozen=True)
class _Launch:
    command: list[str]
    log_dir: str


def prepare(argv: Sequence[str]) -> _Launch:
    """The command and the log folder, checked before any worker starts."""
    from absl import flags

    f = flags.FLAGS
    command = list(argv[1:])
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise cli.UserError(
            "no command to run: dpcore-launch-local --workers=N -- <command> [args...]"
        )
    if f.workers < 1:
        raise cli.UserError(f"--workers must be >= 1, got {f.workers}.")
    if not f.timeout_s > 0 or not f.grace_s >= 0:
        raise cli.UserError("--timeout_s must be > 0 and --grace_s >= 0.")
    if shutil.which(command[0]) is None:
        raise cli.UserError(f"command {command[0]!r} not found (not on PATH, not executable).")
    return _Launch(command=command, log_dir=cli.output_dir(f.output_dir, "launch_local"))


def execute(plan: _Launch) -> int:
    """Runs the workers; the exit status is that of the first worker that failed."""
    from absl import flags

    runs = launch(
        plan.command,
        workers=flags.FLAGS.workers,
        timeout_s=flags.FLAGS.timeout_s,
        grace_s=flags.FLAGS.grace_s,
        log_dir=plan.log_dir,
        stream=sys.stdout,
    )
    for run in runs:
        if run.returncode != 0:
            why = "stopped by the launcher" if run.killed else "failed"
            print(
                f"launch_local: worker {run.index} {why} (status {run.returncode}); log: "
                f"{run.log_path}",
                file=sys.stderr,
            )
    print(f"worker logs: {plan.log_dir}", flush=True)
    # A worker that failed by itself explains the run; the ones stopped after it do not.
    failed = [r for r in runs if r.returncode and not r.killed] or [r for r in runs if r.returncode]
    return min(abs(failed[0].returncode), 255) if failed else 0


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_integer("workers", 2, "Number of local workers (worker 0 is the chief).")
    flags.DEFINE_float("timeout_s", 3600.0, "Stop every worker after this many seconds.")
    flags.DEFINE_float("grace_s", 30.0, "How long the others may run on after the chief ended.")
    flags.DEFINE_string(
        "output_dir", None, "Folder for worker<i>.log (default runs/launch_local-<time>/)."
    )
    flags.DEFINE_alias("worker_log_dir", "output_dir")


def run() -> None:
    """Console-script entry point (`dpcore-launch-local`)."""
    cli.run_program(
        prepare=prepare,
        execute=execute,
        define_flags=_define_flags,
        help_text=HELP,
        tensorflow=False,
    )


if __name__ == "__main__":
    run()
