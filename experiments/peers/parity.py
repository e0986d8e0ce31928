"""Accounting parity with the reference peer (TensorFlow Privacy 0.9.0 on TensorFlow 2.15).

Contract: for a fixed grid of DP-SGD settings, runs the peer's
`compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy_statement` and
`compute_noise_from_budget_lib.compute_noise` in the peer's own venv (a subprocess; see
`peers/env.py`), computes the same quantities with dpcore, and prints a Markdown table of both
with their differences. Not a unit test: it needs the peer environment (built on first use).

Usage:
  .venv/bin/python -m dpcore_experiments.peers.parity --output_json=runs/peer_parity.json
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """Defines the flags (only when run as a program, so the module imports cleanly)."""
    flags.DEFINE_string("output_json", None, "Write all rows as JSON here.")
    flags.DEFINE_string("output_md", None, "Write the Markdown tables here.")
    flags.DEFINE_boolean("pld", True, "Also compare PLD figures (slower).")
    flags.DEFINE_string("peer_env", None, "Peer venv directory (default <repo>/.peer-venv).")


# (name, N, batch size, epochs, noise multiplier, delta)
SETTINGS = [
    ("TF Privacy MNIST tutorial", 60000, 256, 60, 1.1, 1e-5),
    ("Tramer-Boneh MNIST", 60000, 512, 40, 1.23, 1e-5),
    ("Tramer-Boneh Fashion-MNIST", 60000, 2048, 40, 2.15, 1e-5),
    ("sklearn digits", 1797, 64, 20, 1.0, 1e-5),
    ("CIFAR-10 sized", 50000, 1000, 10, 0.8, 1e-5),
]
# (name, N, batch size, epochs, target epsilon, delta)
BUDGETS = [
    ("MNIST eps=3", 60000, 256, 60, 3.0, 1e-5),
    ("MNIST eps=1", 60000, 256, 15, 1.0, 1e-5),
    ("Fashion-MNIST eps=3", 60000, 2048, 40, 3.0, 1e-5),
    ("digits eps=8", 1797, 64, 20, 8.0, 1e-5),
]

PEER_SCRIPT = r"""
import json, re, sys, io, contextlib
from tensorflow_privacy.privacy.analysis import compute_dp_sgd_privacy_lib as lib
from tensorflow_privacy.privacy.analysis import compute_noise_from_budget_lib as nlib
jobs = json.load(sys.stdin)
out = []
for job in jobs:
    if job["kind"] == "statement":
        acc = lib.AccountantType.PLD if job["accountant"] == "pld" else lib.AccountantType.RDP
        text = lib.compute_dp_sgd_privacy_statement(
            number_of_examples=job["n"], batch_size=job["batch"], num_epochs=job["epochs"],
            noise_multiplier=job["sigma"], delta=job["delta"],
            used_microbatching=job["microbatching"], accountant_type=acc)
        once = float(re.search(r"once per epoch:\s+([0-9.eE+-]+|inf)", text).group(1))
        poisson = float(re.search(r"Poisson sampling \(\*\):\s+([0-9.eE+-]+|inf)", text).group(1))
        out.append({"shuffle": once, "poisson": poisson})
    else:
        with contextlib.redirect_stdout(io.StringIO()):
            sigma = nlib.compute_noise(job["n"], job["batch"], job["target_epsilon"],
                                       job["epochs"], job["delta"], 0.1)
        out.append({"noise_multiplier": sigma})
print(json.dumps(out))
"""


def _statement_jobs(with_pld: bool) -> list[dict[str, Any]]:
    jobs = []
    for _, n, b, e, s, d in SETTINGS:
        for accountant, microbatching in [("rdp", False), ("rdp", True)] + (
            [("pld", False)] if with_pld else []
        ):
            jobs.append(
                dict(
                    kind="statement",
                    n=n,
                    batch=b,
                    epochs=e,
                    sigma=s,
                    delta=d,
                    accountant=accountant,
                    microbatching=microbatching,
                )
            )
    return jobs


def _budget_jobs() -> list[dict[str, Any]]:
    return [
        dict(kind="noise", n=n, batch=b, epochs=e, target_epsilon=t, delta=d)
        for _, n, b, e, t, d in BUDGETS
    ]


def dpcore_statement(job: dict[str, Any]) -> dict[str, float]:
    """dpcore's figures for a statement job (per-example clipping: no microbatch doubling)."""
    from dpcore.config import DPConfig

    common = dict(
        l2_norm_clip=1.0,
        noise_multiplier=job["sigma"],
        expected_batch_size=job["batch"],
        num_examples=job["n"],
        target_delta=job["delta"],
        epochs=job["epochs"],
    )
    shuffle = DPConfig.from_epochs(sampling="shuffle", **common)
    common.pop("epochs")
    poisson = DPConfig(sampling="poisson", steps=peer_poisson_steps(job), **common)
    return {
        "shuffle": shuffle.epsilon(job["accountant"]),
        "poisson": poisson.epsilon(job["accountant"]),
        "shuffle_steps": shuffle.steps,
        "poisson_steps": poisson.steps,
    }


def peer_poisson_steps(job: dict[str, Any]) -> int:
    """The peer's Poisson steps for ``epochs``: ceil(epochs · N / B). dpcore's
    ``steps_for_epochs`` counts whole epochs of ceil(N / B) steps, more where B does not divide
    N; the comparison is made at the peer's count."""
    return max(1, math.ceil(job["epochs"] * job["n"] / job["batch"] - 1e-9))


def dpcore_noise(job: dict[str, Any], accountant: str) -> float:
    from dpcore.config import DPConfig

    return DPConfig.calibrated(
        target_epsilon=job["target_epsilon"],
        target_delta=job["delta"],
        accountant=accountant,
        steps=peer_poisson_steps(job),
        l2_norm_clip=1.0,
        expected_batch_size=job["batch"],
        num_examples=job["n"],
    ).noise_multiplier


def epsilon_of(job: dict[str, Any], sigma: float, accountant: str) -> float:
    from dpcore.config import DPConfig

    return DPConfig(
        steps=peer_poisson_steps(job),
        l2_norm_clip=1.0,
        noise_multiplier=sigma,
        expected_batch_size=job["batch"],
        num_examples=job["n"],
        target_delta=job["delta"],
    ).epsilon(accountant)


def _rel(a: float, b: float) -> str:
    if math.isinf(a) or math.isinf(b) or b == 0:
        return "n/a"
    return f"{(a - b) / b:+.2e}"


def compare(with_pld: bool = True, env_dir: str | None = None) -> dict[str, Any]:
    """Runs the peer and dpcore on the grid; returns rows and Markdown tables."""
    from dpcore_experiments.peers import env as peer_env

    python = peer_env.ensure_peer_env(env_dir)
    versions = peer_env.peer_versions(python)
    s_jobs, b_jobs = _statement_jobs(with_pld), _budget_jobs()
    t0 = time.time()
    peer = peer_env.run_peer_script(PEER_SCRIPT, s_jobs + b_jobs, python=python)
    peer_seconds = time.time() - t0
    rows, budget_rows = [], []
    per_setting = len(s_jobs) // len(SETTINGS)
    for i, job in enumerate(s_jobs):
        name = SETTINGS[i // per_setting][0]
        ours = dpcore_statement(job)
        theirs = peer[i]
        rows.append({"setting": name, **job, "peer": theirs, "dpcore": ours})
    for j, job in enumerate(b_jobs):
        theirs = peer[len(s_jobs) + j]["noise_multiplier"]
        row = {
            "setting": BUDGETS[j][0],
            **job,
            "peer_noise_multiplier": theirs,
            "dpcore_noise_multiplier_rdp": dpcore_noise(job, "rdp"),
            "peer_sigma_epsilon_rdp": epsilon_of(job, theirs, "rdp"),
        }
        if with_pld:
            row["dpcore_noise_multiplier_pld"] = dpcore_noise(job, "pld")
        budget_rows.append(row)
    return {
        "peer_versions": versions,
        "peer_seconds": peer_seconds,
        "statement_rows": rows,
        "budget_rows": budget_rows,
        "markdown": to_markdown(rows, budget_rows),
    }


def to_markdown(rows: list[dict[str, Any]], budget_rows: list[dict[str, Any]]) -> str:
    lines = [
        "| setting | N | B | epochs | σ | acct | peer microbatching | peer ε once/epoch | "
        "dpcore ε shuffle (sound) | peer ε Poisson | dpcore ε Poisson | rel. diff Poisson |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, d = r["peer"], r["dpcore"]
        lines.append(
            f"| {r['setting']} | {r['n']} | {r['batch']} | {r['epochs']} | {r['sigma']} | "
            f"{r['accountant'].upper()} | {r['microbatching']} | {p['shuffle']:.3f} | "
            f"{d['shuffle']:.3f} | {p['poisson']:.3f} | {d['poisson']:.3f} | "
            f"{_rel(d['poisson'], p['poisson'])} |"
        )
    lines += [
        "",
        "| budget | N | B | epochs | target ε | peer σ (compute_noise, RDP) | "
        "dpcore σ (RDP) | dpcore σ (PLD) | dpcore RDP ε at peer σ |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in budget_rows:
        pld_sigma = r.get("dpcore_noise_multiplier_pld")
        lines.append(
            f"| {r['setting']} | {r['n']} | {r['batch']} | {r['epochs']} | "
            f"{r['target_epsilon']} | {r['peer_noise_multiplier']:.5f} | "
            f"{r['dpcore_noise_multiplier_rdp']:.5f} | "
            f"{'-' if pld_sigma is None else f'{pld_sigma:.5f}'} | "
            f"{r['peer_sigma_epsilon_rdp']:.5f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    result = compare(with_pld=FLAGS.pld, env_dir=FLAGS.peer_env)
    print(f"peer: {result['peer_versions']} ({result['peer_seconds']:.0f} s)")
    print(result["markdown"])
    if FLAGS.output_md:
        with open(FLAGS.output_md, "w", encoding="utf-8") as f:
            f.write(result["markdown"] + "\n")
    if FLAGS.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output_json)), exist_ok=True)
        with open(FLAGS.output_json, "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in result.items() if k != "markdown"}, f, indent=2)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
