"""Figures as data, stamped by the code that measured them: a finished run's headline figures
(``RUN_DIR/figures.json``, written by ``centerline up`` at the end of a run, beside
``report.html``) and every bench's (``centerline bench <target> --out FILE``, through ``write_bench_figures``).

Each file holds its figures and its provenance: ``command`` (what ran), ``commit`` (the code's
``git rev-parse HEAD``), ``machine`` (host, CPU model, CPUs, UTC time) and ``digest``, the sha256
of all of that as canonical JSON (``digest``). The docs quote such files
(``docs/bench/<name>.json``, ``docs/runs/<name>.json``), never numbers typed by hand, and
``scripts/gen_bench_docs.py --check`` recomputes each digest, so a figure edited by hand fails
the check naming the file and the command that regenerates it. The digest is no signature:
it shows an edit, it does not stop one made on purpose.

Each figure is computed from ``metrics.jsonl`` and the held-out record as the report reads them
(``heldout_metrics.jsonl``, or an earlier release's ``eval.jsonl``: ``report.load_heldout``):
``heldout`` is every held-out evaluation (``{step, value}``: exact-match accuracy, or a run of
sessions' mean reward); ``*_first`` and ``*_last`` are means over the first and last ``WINDOW``
steps (fewer when the run is shorter).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from centerline.runs.report import load_heldout
from shared import heldout_record

WINDOW = 30  # steps averaged at each end of the run


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def run_figures(run_dir: Path) -> dict:
    """The figures of the run in ``run_dir`` (``metrics.jsonl``, and its held-out record when it has one)."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not steps:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no steps")
    evals = load_heldout(run_dir)
    window = min(WINDOW, len(steps))
    first, last = steps[:window], steps[-window:]
    kl = [s["train_rollout_kl"] for s in steps]
    tokens = sum(s["trained_tokens"] for s in steps)
    return {
        "steps": steps[-1]["step"],
        "samples": sum(s["samples"] for s in steps),
        "steps_wall_s": round(sum(s["step_s"] for s in steps), 1),
        "window_steps": window,
        "reward_first": round(_mean([s["reward_mean"] for s in first]), 4),
        "reward_last": round(_mean([s["reward_mean"] for s in last]), 4),
        "heldout": [
            {"step": e["step"], "value": round(e.get(heldout_record.ACCURACY, e.get(heldout_record.REWARD, 0.0)), 4)}
            for e in evals
        ],
        "train_rollout_kl_mean": float(f"{_mean(kl):.3g}"),
        "train_rollout_kl_max": float(f"{max(kl):.3g}"),
        "train_rollout_kl_first": float(f"{_mean([s['train_rollout_kl'] for s in first]):.3g}"),
        "train_rollout_kl_last": float(f"{_mean([s['train_rollout_kl'] for s in last]):.3g}"),
        "staleness_mean": round(_mean([s["staleness_mean"] for s in steps]), 3),
        "staleness_max": max(s["staleness_max"] for s in steps),
        "token_kv_unverified_share": round(
            sum(s.get("token_kv_unverified_share", 0.0) * s["trained_tokens"] for s in steps) / tokens, 4
        ),
        "gather_s_mean": round(_mean([s["gather_s"] for s in steps]), 3),
        "step_s_mean": round(_mean([s["step_s"] for s in steps]), 3),
        "batches_accepted": sum(s["gate_accepted"] for s in steps),
        "batches_rejected": sum(sum(s["gate_rejected"].values()) for s in steps),
        "tasks_republished": sum(s.get("gate_resampled", 0) for s in steps),
        **_tool_call_figures(first, last),
    }


def _tool_call_figures(first: list[dict], last: list[dict]) -> dict:
    """A run whose sessions offered tools, at each end of the run: the share of replies with call
    markup whose calls parsed (calls parsed / (calls parsed + replies that did not parse)), and the
    calls parsed per sample."""
    if not any("tool_calls" in s for s in first + last):
        return {}

    def share(steps: list[dict]) -> float:
        calls, errors = (sum(s.get(key, 0) for s in steps) for key in ("tool_calls", "tool_call_parse_errors"))
        return round(calls / (calls + errors), 4) if calls + errors else 0.0

    def per_sample(steps: list[dict]) -> float:
        return round(sum(s.get("tool_calls", 0) for s in steps) / sum(s["samples"] for s in steps), 4)

    return {
        "well_formed_calls_first": share(first),
        "well_formed_calls_last": share(last),
        "tool_calls_per_sample_first": per_sample(first),
        "tool_calls_per_sample_last": per_sample(last),
    }


def machine() -> dict:
    """Where and when the figures were measured."""
    model = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(),
        "cpu_model": model,
        "nproc": len(os.sched_getaffinity(0)),
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def commit() -> str | None:
    """The checked-out commit of the code that ran, None outside a git work tree."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def digest(doc: dict) -> str:
    """sha256 (hex) of ``doc`` without its ``digest`` key, as canonical JSON: keys sorted, no spaces."""
    body = {key: value for key, value in doc.items() if key != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def stamped(figures: dict, command: str) -> dict:
    """``figures`` with their provenance: ``command``, ``commit``, ``machine``, then ``digest`` of it all."""
    doc = {**figures, "command": command, "commit": commit(), "machine": machine()}
    return {**doc, "digest": digest(doc)}


def this_command(argv: list[str] | None = None) -> str:
    """The ``centerline`` command line that is running (``argv``: its arguments, default this process's)."""
    return shlex.join(["centerline", *(sys.argv[1:] if argv is None else argv)])


def write_run_figures(run_dir: Path, argv: list[str] | None = None) -> Path:
    """``RUN_DIR/figures.json``: ``run_figures`` stamped with the command (default: this process's)."""
    out = run_dir / "figures.json"
    out.write_text(json.dumps(stamped(run_figures(run_dir), this_command(argv)), indent=2) + "\n")
    return out


def write_bench_figures(result: dict, out: Path, *, indent: int | None = None) -> None:
    """A bench's figures: print ``result`` as one JSON object, and write it stamped to ``out``."""
    print(json.dumps(result, indent=indent))
    out.write_text(json.dumps(stamped(result, this_command()), indent=2) + "\n")
