"""The benchmark's parent side: one process per configuration, ratios, and the tables.

Contract:
  * `run_subprocess` runs one configuration's process, which prints one line
    ``BENCH_RESULT {json}`` (`RESULT_PREFIX`), and stops it past a wall-clock or resident
    memory limit (the row then says ``timeout`` or ``memory_cap``).
  * `add_ratios` compares each row with its baseline row of the same impl, model and batch;
    `format_tables` writes the rows as Markdown.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from dpcore_experiments.lib import common
from dpcore_experiments.lib.bench_steps import ENGINE_METHODS

RESULT_PREFIX = "BENCH_RESULT "


def run_subprocess(
    cmd: Sequence[str], *, timeout_s: float, max_rss_mb: float, env: dict | None = None
) -> dict:
    """Runs one configuration's process; returns its result row fields or why it has none.

    The child prints one line ``BENCH_RESULT {json}``. The parent watches its RSS and wall time
    and kills it (status ``memory_cap`` / ``timeout``) past the limits.
    """
    env = dict(os.environ if env is None else env)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    status, max_seen = None, 0.0
    while proc.poll() is None:
        max_seen = max(max_seen, (common.proc_status_kb("VmRSS", proc.pid) or 0.0) / 1024)
        if max_seen > max_rss_mb:
            status = "memory_cap"
        elif time.perf_counter() - start > timeout_s:
            status = "timeout"
        if status:
            proc.kill()
            break
        time.sleep(0.1)
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    if status:
        limit = f"{max_rss_mb:.0f} MB RSS" if status == "memory_cap" else f"{timeout_s:.0f} s"
        return {"status": status, "note": f"stopped at {limit}", "wall_s": round(wall, 1)}
    for line in out.splitlines():
        if line.startswith(RESULT_PREFIX):
            row = json.loads(line[len(RESULT_PREFIX) :])
            row["wall_s"] = round(wall, 1)
            return row
    tail = [ln for ln in (err or "").splitlines() if ln.strip()][-3:]
    return {
        "status": "error",
        "note": f"exit {proc.returncode}: " + " | ".join(tail)[-500:],
        "wall_s": round(wall, 1),
    }


def add_ratios(rows: list[dict]) -> list[dict]:
    """Adds each row's time and memory ratios to its baseline row of the same impl/model/batch.

    The baseline (``baseline`` in the row) is ``nonprivate`` (dpcore: plain Keras ``fit``; the
    peer: its own non-private step), except that dpcore's engine-level breakdown rows
    (``ENGINE_METHODS``) compare to ``nonprivate_step`` when that row was run.
    """
    ok_rows = {
        (r["impl"], r["model"], r["batch_size"], r["method"]): r
        for r in rows
        if r.get("status") == "ok"
    }
    for r in rows:
        key = (r["impl"], r["model"], r["batch_size"])
        baseline = "nonprivate"
        if r["impl"] == "dpcore" and r["method"] in ENGINE_METHODS:
            if (*key, "nonprivate_step") in ok_rows:
                baseline = "nonprivate_step"
        r["baseline"] = baseline
        b = ok_rows.get((*key, baseline))
        ok = r.get("status") == "ok" and b is not None
        r["ratio_to_nonprivate"] = r["median_ms"] / b["median_ms"] if ok else None
        # Fastest step over fastest step: less sensitive to other load on a shared machine.
        r["min_ratio_to_nonprivate"] = (
            min(r["step_ms"]) / min(b["step_ms"]) if ok and r.get("step_ms") else None
        )
        r["rss_ratio_to_nonprivate"] = r["peak_rss_mb"] / b["peak_rss_mb"] if ok else None
        sp, bp = r.get("step_peak_rss_mb"), (b or {}).get("step_peak_rss_mb")
        r["step_rss_ratio_to_nonprivate"] = sp / bp if ok and sp and bp else None
    return rows


def fmt(v: Any, spec: str = ".1f") -> str:
    """`v` formatted by `spec`, or "-" when there is none."""
    return "-" if v is None else format(v, spec)


def _column(impl: str, method: str) -> str:
    """A method's column head: user path as is, engine breakdown and peer labelled."""
    if impl != "dpcore":
        return f"peer {method}"
    return f"{method} (engine)" if method in ENGINE_METHODS else method


def _baseline_label(row: dict) -> str:
    base = row.get("baseline")
    if base is None:
        return "-"
    if row["impl"] == "dpcore" and base == "nonprivate":
        return "Keras fit"
    return base


def format_tables(rows: list[dict]) -> str:
    """Markdown: a full table of rows and a compact ratio table per (model, batch).

    Each row's ratio is to its ``baseline`` (see :func:`add_ratios`): the user-path rows to the
    plain Keras ``fit`` row, the engine-level breakdown rows (marked "engine") to
    ``nonprivate_step`` where it was run.
    """
    lines = _full_table(rows) + [""] + _ratio_table(rows) + _top_ops_tables(rows)
    return "\n".join(lines) + "\n"


def _full_table(rows: list[dict]) -> list[str]:
    """Every row with its time, ratio, memory and status."""
    lines = [
        "| model | batch | impl | method | median ms | x baseline | baseline | peak RSS MB "
        "| step peak RSS MB | x RSS (step) | status / note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = r.get("status", "")
        if r.get("note"):
            note += f": {r['note']}"
        if r.get("paths") and r["method"] in ("fast", "dpsequential"):
            note += " paths " + ",".join(f"{k}={v}" for k, v in sorted(r["paths"].items()))
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {r['impl']} | {_column(r['impl'], r['method'])} "
            f"| {fmt(r.get('median_ms'))} | {fmt(r.get('ratio_to_nonprivate'), '.2f')} "
            f"| {_baseline_label(r)} "
            f"| {fmt(r.get('peak_rss_mb'), '.0f')} | {fmt(r.get('step_peak_rss_mb'), '.0f')} "
            f"| {fmt(r.get('step_rss_ratio_to_nonprivate'), '.2f')} | {note} |"
        )
    return lines


def _ratio_table(rows: list[dict]) -> list[str]:
    """Per (model, batch): the non-private time and every method's ratio to its baseline."""
    cols = []
    for r in rows:
        key = (r["impl"], r["method"])
        if r["method"] != "nonprivate" and key not in cols:
            cols.append(key)
    head = ["model", "batch", "non-private ms"] + [_column(i, m) for i, m in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = []
    for r in rows:
        if (r["model"], r["batch_size"]) not in keys:
            keys.append((r["model"], r["batch_size"]))
    index = {(r["impl"], r["model"], r["batch_size"], r["method"]): r for r in rows}
    for model, batch in keys:
        np_row = index.get(("dpcore", model, batch, "nonprivate"), {})
        cells = [model, str(batch), fmt(np_row.get("median_ms"))]
        for impl, method in cols:
            r = index.get((impl, model, batch, method))
            if r is None:
                cells.append("")
            elif r.get("ratio_to_nonprivate") is not None:
                cells.append(f"{r['ratio_to_nonprivate']:.2f}x")
            else:
                cells.append(r.get("status", "-"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _top_ops_tables(rows: list[dict]) -> list[str]:
    """The profiled ops of the rows run with ``--profile_ops``."""
    lines: list[str] = []
    for r in rows:
        if r.get("top_ops"):
            lines += [
                "",
                f"Top ops by self time, {r['model']} {r['method']} batch {r['batch_size']} "
                "(ms per step; concurrent ops overlap):",
                "",
                "| self ms | calls | type | op |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| {fmt(o['self_ms'], '.2f')} | {fmt(o['calls'], 'g')} | {o['type']} "
                f"| {o['op'][:80]} |"
                for o in r["top_ops"]
            ]
    return lines
