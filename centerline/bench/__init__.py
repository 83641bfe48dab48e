"""`centerline bench <target>`: every benchmark, each in its module here.

A target prints one JSON object (``--json``: on one line) and writes the same object to
``--out`` (default ``runs/bench/<target>.json``) stamped by ``centerline/runs/run_figures.py``:
``command``, the command line; ``commit``; ``machine``: host name, CPU model, CPUs usable and
when it was measured (UTC); and ``digest``, the sha256 of it all. docs/results.md's benchmark
tables are generated from the figure files committed in ``docs/bench/``
(``scripts/gen_bench_docs.py``, whose ``--check`` recomputes each digest).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from centerline.cli import dispatch

# bench target -> (module:function, one-line help); each prints one JSON object with --json.
BENCHES: dict[str, tuple[str, str]] = {
    "wire": ("centerline.bench.wire:bench_wire", "encode+decode throughput of wire format v2 vs memcpy"),
    "contract": ("centerline.bench.wire:bench_contract", "completeness-contract check cost per batch"),
    "long-sample": (
        "centerline.bench.long_sample:bench_long_sample",
        "seconds and bytes of a sample over one NATS message, published in pieces and admitted, beside one that fits",
    ),
    "proxy": (
        "centerline.bench.proxy:bench_proxy",
        "proxy req/s and added latency vs direct, audit cost vs orjson parse",
    ),
    "loss": ("centerline.bench.loss:bench_loss", "score-centering loss vs REINFORCE forward+backward"),
    "step": (
        "centerline.bench.step:bench_step",
        "peak memory of one training step at Qwen2.5-1.5B's head shape: chunked head and loss vs dense logits",
    ),
    "pipeline": (
        "centerline.bench.pipeline:bench_pipeline",
        "samples/s and tokens/s of a short up run vs SGLang alone, SGLang's duty cycle",
    ),
    "weights": (
        "centerline.bench.weights:bench_weights",
        "seconds a weight version takes to reach every engine, by disk and by broadcast, vs the machine's limit",
    ),
    "sessions": (
        "centerline.bench.sessions:bench_sessions",
        "multi-turn session turns vs single requests of the same token counts, prefix-cache share by router policy",
    ),
}


def _writable(value: str) -> Path:
    """``--out``, checked before the bench runs (some take minutes): its folder exists or can be made, and is
    writable."""
    path = Path(value)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"{value}: cannot make its folder ({exc.strerror}); pick a writable path"
        ) from None
    if path.is_dir() or not os.access(path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{value}: not a writable file path; pick a writable path")
    return path


def add_out_flag(parser: argparse.ArgumentParser, target: str) -> None:
    parser.add_argument(
        "--out",
        type=_writable,
        default=f"runs/bench/{target}.json",
        help="file the figures are written to, with the machine they were measured on (default: %(default)s)",
    )


def progress(bench: str, phase: str, **fields) -> None:
    """One JSON line per phase of a bench on stderr: ``{"bench": bench, "phase": phase, **fields}``."""
    print(json.dumps({"bench": bench, "phase": phase, **fields}), file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    return dispatch(BENCHES, "centerline bench", argv)
