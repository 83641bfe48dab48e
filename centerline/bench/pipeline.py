"""`centerline bench pipeline [--json]`: weight updates that drain the engine and updates in
flight side by side (and on-policy, when asked), each with its samples/s and tokens/s, the time
per weight update, the share of wall time SGLang had work, staleness per trained token and the
held-out accuracy (a run of sessions: held-out reward) it reached in the same training time;
beside SGLang alone at the same concurrency.

Phase 1, the pipeline (``pipeline_modes.py``), once per ``--modes`` entry (default
``drain,in-flight``): each is a ``centerline up`` run with a ``max_inflight_steps`` and the
trainer's ``weight_update`` (``MODES``: ``on-policy``, ``drain``, ``in-flight``, ``in-place``),
measured over a window of its steps. ``--weight-transports disk,distributed`` runs each mode once
per weight transport (the trainer's ``weight_transport``, docs/design.md section 8, transports),
named ``<mode>-<transport>`` (``in-flight-distributed``); without it every mode runs on the
transport ``up``'s flags name (``--weight-transport``, default ``disk``). ``--teacher-force`` then
checks each mode's labels by teacher forcing (``label_truth``).

Phase 2, SGLang alone (``sglang_alone.py``): after ``up`` has stopped, a fresh SGLang server of the
same model gets the requests the workers send, as the proxy rewrites them, from as many
closed-loop clients as the pipeline can have requests in flight. The ratios are pipeline over
SGLang alone; the rest of the machine is idle in phase 2, so SGLang alone is the ceiling. Both
phases report SGLang's duty cycle, the share of their window in which its scheduler had work
(``duty_cycle.py`` says how it is read from its ``/metrics``).

``trainer_duty_cycle``, the share of the trainer's step time not spent waiting for batches, says
which side waits. The figures are data: ``--out`` (default
``runs/bench/pipeline.json``) and, for docs/results.md, ``docs/bench/pipeline*.json``.

Left out: more than one SGLang server (``--engines``), GPUs, and the pipeline's latency
figures (``metrics.jsonl`` has ``gather_s``, ``train_s`` per step). Sessions run the same way
with ``-- --task chain`` (its tasks name the chain environment): the bench measures whatever
``up`` trains.

    centerline bench pipeline --json
    centerline bench pipeline --modes on-policy,drain,in-flight --train-seconds 30 -- --rollout-n 4
    centerline bench pipeline --modes in-flight --weight-transports disk,distributed --teacher-force

Every flag but the bench's own (``--modes``, ``--weight-transports``, ``--teacher-force``,
``--warmup-steps``, ``--run-dir``, ``--alone-*``, ``--poll``, ``--json``, ``--out``), and every
flag after ``--``, is ``centerline up``'s (``--config FILE`` too): the run spec each mode is a
variant of (``centerline/up/run_spec.py``, ``parse``), with the bench's defaults
``BENCH_DEFAULTS`` under them (``--steps 1000``, ``--train-seconds 60``, ``--heldout-prompts 50``;
``up``'s own otherwise) and the mode's ``max_inflight_steps``, ``weight_update`` (and
``weight_transport``, with ``--weight-transports``) over them (``mode_spec``). A mode runs as
``centerline up --config RUN_DIR/<name>.toml``, that variant's file; the bench reports the settings
it ran, the workers' resolved ``concurrency`` among them.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from datetime import datetime
from pathlib import Path

from centerline.bench import add_out_flag
from centerline.bench.pipeline_modes import MODES, label_truth, mode_spec, run_pipeline
from centerline.bench.sglang_alone import concurrent_requests, run_alone
from centerline.runs.run_figures import write_bench_figures
from centerline.up import run_spec
from shared.config import ConfigError
from shared.settings import TrainerSettings

# `up`'s settings whose default differs for this bench (`up`'s flags override them): every mode trains
# for the same wall time, and the held-out evaluations are outside the measured window anyway.
BENCH_DEFAULTS = {"trainer": {"steps": 1000, "train_seconds": 60.0}, "up": {"heldout_prompts": 50}}
TRANSPORTS = typing.get_args(TrainerSettings.model_fields["weight_transport"].annotation)  # --weight-transports


def bench_pipeline(argv: list[str]) -> int:
    """Pipeline samples/s and tokens/s vs SGLang alone at the same concurrency, and SGLang's duty cycle; one JSON
    object."""
    ours, after = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="centerline bench pipeline",
        description=bench_pipeline.__doc__,
        epilog="every other flag, and those after --, are centerline up's: the spec each mode derives from "
        "(here --steps 1000, --train-seconds 60 and --heldout-prompts 50 by default)",
        allow_abbrev=False,  # `--mode` must not read as `--modes`
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON object, on one line")
    parser.add_argument(
        "--modes",
        default="drain,in-flight",
        help="runs, in this order, comma-separated: drain (asynchronous, weight_update drain), in-flight "
        "(asynchronous, weight_update retract: the defaults), in-place (asynchronous, weight_update in_place), "
        "on-policy (--max-inflight-steps 1)",
    )
    parser.add_argument(
        "--teacher-force",
        action="store_true",
        help="then check every mode's token labels by teacher forcing (centerline teacher-force)",
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=2, help="first steps left out of the window (start-up, first batches)"
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="the bench's directory, each mode's up run in a folder of it; default: runs/bench-pipeline-<date-time>",
    )
    parser.add_argument(
        "--alone-seconds",
        type=float,
        default=None,
        help="measured seconds of SGLang alone (default: the last mode's window)",
    )
    parser.add_argument(
        "--alone-warmup", type=float, default=3.0, help="seconds of SGLang alone before the measured ones"
    )
    parser.add_argument(
        "--poll",
        type=float,
        default=0.25,
        help="seconds between looks at metrics.jsonl and scrapes of SGLang's /metrics",
    )
    parser.add_argument(
        "--weight-transports",
        default=None,
        help="run each mode once per weight transport, comma-separated: disk, distributed (the trainer's "
        "--weight-transport); each run named <mode>-<transport>. Default: each mode once, on up's --weight-transport",
    )
    add_out_flag(parser, "pipeline")
    args, up_flags = parser.parse_known_args(ours)
    up_flags += after
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES) or len(set(modes)) != len(modes):
        parser.error(f"--modes {args.modes}: distinct names from {', '.join(MODES)}")
    if any(flag.startswith(("--max-inflight-steps", "--weight-update")) for flag in up_flags):
        parser.error("--max-inflight-steps or --weight-update: --modes sets them for each run")
    runs = [(mode, None, mode) for mode in modes]  # (mode, transport, name)
    if args.weight_transports is not None:
        transports = [t.strip() for t in args.weight_transports.split(",") if t.strip()]
        if not transports or set(transports) - set(TRANSPORTS) or len(set(transports)) != len(transports):
            parser.error(f"--weight-transports {args.weight_transports}: distinct names from {', '.join(TRANSPORTS)}")
        if any(flag.startswith("--weight-transport") for flag in up_flags):
            parser.error("--weight-transport: --weight-transports sets it for each run; give one of the two")
        runs = [(mode, t, f"{mode}-{t}") for mode in modes for t in transports]
    base = run_spec.parse(up_flags, BENCH_DEFAULTS, prog=parser.prog)  # a bad flag exits 2 naming it, before any run
    if not 1 <= args.warmup_steps < base.trainer.steps:
        parser.error(f"--warmup-steps {args.warmup_steps}: must be at least 1 and below --steps {base.trainer.steps}")
    run_dir = args.run_dir or Path("runs") / datetime.now().strftime("bench-pipeline-%Y-%m-%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    try:
        for mode, transport, name in runs:
            results[name], spec, model = run_pipeline(args, mode_spec(base, mode, run_dir / name, transport), name)
        last = runs[-1][2]
        seconds = args.alone_seconds or results[last]["pipeline_window_s"]
        alone = run_alone(args, spec, model, run_dir / last / "train.jsonl", run_dir, seconds)
        if args.teacher_force:
            for name in results:
                results[name].update(label_truth(run_dir / name, model, run_dir / "logs"))
    except ConfigError as exc:  # a variant up refuses
        print(f"centerline bench pipeline: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"centerline bench pipeline: {exc}", file=sys.stderr)
        return 1
    for figures in results.values():
        figures["samples_per_s_ratio"] = round(
            figures["pipeline_samples_per_s"] / alone["sglang_alone_samples_per_s"], 4
        )
        figures["tokens_per_s_ratio"] = round(figures["pipeline_tokens_per_s"] / alone["sglang_alone_tokens_per_s"], 4)
    result = {
        "task": spec.up.task,
        "model": model,
        "steps": spec.trainer.steps,
        "train_seconds": spec.trainer.train_seconds,
        "warmup_steps": args.warmup_steps,
        "workers": spec.up.workers,
        "trainer_ranks": spec.up.trainer_ranks,
        "prompts_per_step": spec.trainer.prompts_per_step,
        "heldout_prompts": spec.up.heldout_prompts,
        "rollout_n": spec.cfg.rollout.n,
        "rollout_max_new_tokens": spec.cfg.rollout.max_new_tokens,
        "rollout_top_logprobs_num": spec.cfg.rollout.top_logprobs_num,
        "rollout_temperature": spec.cfg.rollout.temperature,
        "concurrent_requests": concurrent_requests(spec),  # what SGLang alone was driven at
        "cpus": os.cpu_count(),
        "run_dir": str(run_dir),
        "modes": results,
        **alone,
    }
    write_bench_figures(result, args.out, indent=None if args.json else 2)
    return 0
