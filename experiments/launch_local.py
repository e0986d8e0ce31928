"""launch_local: runs a command as N local tf.distribute workers on loopback ports.

Contract (the launch itself is `dpcore_experiments.lib.workers.launch`):
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
import shutil
import sys
from collections.abc import Sequence

from dpcore_experiments.lib import cli
from dpcore_experiments.lib.workers import WorkerRun, free_ports, launch, tf_config

__all__ = ["WorkerRun", "free_ports", "launch", "run", "tf_config"]


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
