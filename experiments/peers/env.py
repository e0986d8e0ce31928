"""The reference peer's environment: TensorFlow 2.15 + TensorFlow Privacy 0.9.0 in its own venv.

Contract: `ensure_peer_env()` returns the Python interpreter of a virtual environment (default
`<repo>/.peer-venv`, git-ignored) in which `tensorflow_privacy` 0.9.0 imports, building it with
`python3.11 -m venv` and pip if needed. The peer only ever runs in a subprocess through
`run_peer_script`; dpcore never imports it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["PEER_PACKAGES", "default_env_dir", "ensure_peer_env", "run_peer_script"]

PEER_PACKAGES = ("tensorflow-cpu==2.15.1", "tensorflow-privacy==0.9.0")
_CHECK = (
    "import importlib.metadata as m, json; "
    "print(json.dumps({p: m.version(p) for p in ('tensorflow-cpu', 'tensorflow-privacy')}))"
)


def default_env_dir() -> Path:
    """`<repo root>/.peer-venv` (the repo root is the parent of `experiments/`)."""
    return Path(__file__).resolve().parents[2] / ".peer-venv"


def _find_python311() -> str:
    for name in ("python3.11", "python3"):
        path = shutil.which(name)
        if path is None:
            continue
        out = subprocess.run(
            [path, "-c", "import sys; print(sys.version_info[:2] == (3, 11))"],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.stdout.strip() == "True":
            return path
    raise RuntimeError(
        "TensorFlow Privacy 0.9.0 needs TensorFlow 2.15, which needs Python <= 3.11: no "
        "python3.11 found on PATH."
    )


def peer_versions(python: str | Path) -> dict[str, str] | None:
    """The installed peer package versions in that interpreter, or None if missing."""
    out = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def ensure_peer_env(env_dir: str | Path | None = None, *, quiet: bool = True) -> Path:
    """Returns the peer venv's python, creating/installing it if needed.

    Args:
      env_dir: where the venv lives; default `<repo>/.peer-venv`.
      quiet: pass `-q` to pip.

    Returns:
      Path of the venv's `bin/python`.

    Raises:
      RuntimeError: no Python 3.11, or the install failed.
    """
    env = Path(env_dir) if env_dir is not None else default_env_dir()
    python = env / "bin" / "python"
    wanted = {p.split("==")[0]: p.split("==")[1] for p in PEER_PACKAGES}
    if python.exists() and peer_versions(python) == wanted:
        return python
    if not python.exists():
        subprocess.run([_find_python311(), "-m", "venv", str(env)], check=True)
    cmd = [str(python), "-m", "pip", "install", *(["-q"] if quiet else []), *PEER_PACKAGES]
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0 or peer_versions(python) != wanted:
        raise RuntimeError(f"installing the peer environment failed: {' '.join(cmd)}")
    return python


def run_peer_script(
    script: str, payload: Any, *, python: str | Path | None = None, timeout: float = 1800
) -> Any:
    """Runs `script` with the peer's python; sends `payload` as JSON on stdin.

    The script must print its JSON result as the last line of stdout.
    """
    python = python or ensure_peer_env()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [str(python), "-c", script],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise RuntimeError(f"peer script failed with exit code {out.returncode}.")
    return json.loads(out.stdout.strip().splitlines()[-1])
