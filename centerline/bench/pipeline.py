"""`centerline bench pipeline [--json]`: weight updates that drain the engine and updates in
flight side by side (and on-policy, when asked), each with its samples/s and tokens/s, the time
per weight update, the share of wall time SGLang had work, staleness per trained token and the
held-out accuracy (a run of sessions: held-out reward) it reached in the same training time;
beside SGLang alone at the same concurrency.

Phase 1, the pipeline, once per ``--modes`` entry (default ``drain,in-flight``): each is a
``centerline up`` run with a ``max_inflight_steps`` and the trainer's ``weight_update``
(docs/design.md section 8): ``drain`` is the asynchronous default pipeline (``2``: the engine
samples the next step while the trainer trains, so a batch is at most one weight version stale
and score centering corrects for it) with updates that wait for the generations in flight;
``in-flight`` the same with ``weight_update = retract``, the default (pause, load, flush the
prefix cache, recompute the requests in flight: the generations go on, a response may span an
update); ``in-place`` the same with ``weight_update = in_place`` (no flush, no recompute: tokens
may rest on KV of older weights than their label); ``on-policy`` is ``--max-inflight-steps 1``
(the engine samples a step's batches, then waits while the trainer trains on them).
``--weight-transports disk,distributed`` runs each mode once per weight transport (the trainer's
``weight_transport``, docs/design.md section 8, transports), named ``<mode>-<transport>``
(``in-flight-distributed``); without it every mode runs on the transport ``up``'s flags name
(``--weight-transport``, default ``disk``). Each mode reports the transport it ran and
``weight_fallbacks``, the versions an engine loaded from disk instead (the run's last step's count).

``--teacher-force`` then checks each mode's labels (``centerline/runs/teacher_force.py``): one fresh
SGLang server of the model, without a prefix cache, loads every weight version still on disk and
forces the tokens labelled with it; ``label_mismatch_share`` is the share of those tokens whose
recorded log-prob is more than 1e-3 from the forced one (``label_checked_tokens`` of them), beside
``token_kv_unverified_share``, the trainer's own bound, and ``wrong_label_share``, the same tokens
under the neighbouring version (what the check can tell apart).

Each run is its own process, every service real, SGLang started with ``--enable-metrics``, and
trains for ``--train-seconds`` (the trainer starts no step after that; at most ``--steps``),
then the trainer evaluates ``--heldout-prompts`` held-out prompts (docs/design.md section 9), as it
did before training. The measured window runs from the end of step ``--warmup-steps`` to the end
of the last step, as this process sees lines appear in ``metrics.jsonl`` (polled every ``--poll`` s), so start-up,
the first batches and the evaluations are outside it. Samples and tokens are the trainer's own
counts for the steps in the window (``samples``, ``trained_tokens``; every generated token is
trained); ``weights_s`` the trainer's time per step to load the new version into the engine and
announce it; staleness per trained token the steps' ``token_staleness_*``, weighted by their
trained tokens.

Phase 2, SGLang alone: after ``up`` has stopped, a fresh ``centerline sglang`` of the same model
(weights of step 0, the same recipe and flags) gets the requests the workers send, as the proxy
rewrites them (``router_proxy.rewrite``: the run's ``rollout_n``, ``max_new_tokens``,
temperature, ``top_logprobs_num = K``; prompts of the run's dataset, tokenized as the worker
does), straight to the server, from ``workers x`` the worker's ``concurrency`` closed-loop clients:
the most requests the pipeline can have in flight. Completions in ``--alone-seconds`` (default:
as long as the pipeline's window) after ``--alone-warmup`` s count. The ratios are pipeline over
SGLang alone; the rest of the machine is idle in phase 2, so SGLang alone is the ceiling.

Duty cycle: the share of the window in which the SGLang scheduler had work, from its Prometheus
counter ``sglang:scheduler_idle_seconds_total`` ("wall time while the scheduler has no runnable
or queued work", ``srt/managers/scheduler_components/metrics_reporter.py``). The scheduler
timestamps each switch exactly (monotonic ns: idle from the moment ``on_idle`` finds no running
batch and an empty waiting queue, busy from the receipt of a request or the launch of a batch)
but adds the accumulated idle time to the counter only when at least 1 s has passed since its last
addition, at its next busy/idle event (a forward pass, or the 1 s poll of ``--sleep-on-idle``):
the counter is exact at those flush moments and up to about 2 s behind in between. So this bench
scrapes ``/metrics`` every ``--poll`` s, recognises a flush by a change of
``sglang:scheduler_process_cpu_seconds_total`` (added at every flush), and measures between the
first flush after the window starts and the last before it ends, dating each flush at the middle
of the two scrapes that bracket it. ``duty_cycle = 1 - idle / window``; the window's ends are
known to half a poll interval each, so ``duty_cycle_error_bound = (half gap + half gap) /
window``. A control request (a weight update the trainer sends) is work by this definition; the
router's health checks (``/health``, no generation by default) are not. A scrape costs the server's
HTTP process some milliseconds, so the default ``--poll`` of 0.25 s takes a few percent
of one core. It is the scheduler's view: a request still in SGLang's tokenizer or detokenizer
process (before the scheduler has it, after its last token) leaves the scheduler idle unless
another is running. Phase 2 reports its own duty cycle the same way, what the pipeline's could be
at this concurrency: short of 1 by the round trips between an answer and the next request, which
are long beside a small model's forward passes (top-K log-probs are formatted in Python).

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
``weight_transport``, with ``--weight-transports``) over them. A mode runs as ``centerline up
--config RUN_DIR/<name>.toml``, that variant's file; the bench reports the settings it ran, the
workers' resolved ``concurrency`` among them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import typing
import urllib.request
from datetime import datetime
from pathlib import Path

import orjson

from centerline.bench import add_out_flag
from centerline.ports import free_port
from centerline.runs.run_figures import write_bench_figures
from centerline.up import run_spec
from centerline.up.processes import PYTHON, Supervisor, sglang_argv, wait_http
from centerline.up.run_spec import RunSpec
from shared.config import Config, ConfigError
from shared.settings import TrainerSettings

# --modes: each a `centerline up` run with this max_inflight_steps and the trainer's weight_update
# `up`'s settings whose default differs for this bench (`up`'s flags override them): every mode trains
# for the same wall time, and the held-out evaluations are outside the measured window anyway.
BENCH_DEFAULTS = {"trainer": {"steps": 1000, "train_seconds": 60.0}, "up": {"heldout_prompts": 50}}
MODES = {
    "on-policy": (1, "retract"),
    "drain": (2, "drain"),
    "in-flight": (2, "retract"),
    "in-place": (2, "in_place"),
}
IDLE = "sglang:scheduler_idle_seconds_total"
CPU = "sglang:scheduler_process_cpu_seconds_total"  # grows at every flush of IDLE
TRANSPORTS = typing.get_args(TrainerSettings.model_fields["weight_transport"].annotation)  # --weight-transports


def progress(phase: str, **fields) -> None:
    """One JSON line per phase on stderr."""
    print(json.dumps({"bench": "pipeline", "phase": phase, **fields}), file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the duty cycle


def counters(text: str) -> dict[str, float]:
    """``IDLE`` and ``CPU`` from a Prometheus text page, summed over label sets (one per scheduler)."""
    totals = {IDLE: 0.0, CPU: 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


class Scraper:
    """Scrapes ``url``/metrics every ``interval`` s on a thread: ``samples`` is ``[(t, idle_s, cpu_s)]``,
    ``t`` the monotonic time the answer arrived."""

    def __init__(self, url: str, interval: float):
        self.url, self.interval = url.rstrip("/") + "/metrics", interval
        self.samples: list[tuple[float, float, float]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:
                    page = counters(resp.read().decode())
                self.samples.append((time.monotonic(), page[IDLE], page[CPU]))
            except OSError:
                pass  # a missed scrape only widens the bracket around a flush
            self.stopping.wait(self.interval)


def duty_cycle(samples: list[tuple[float, float, float]], start: float, end: float) -> dict:
    """Share of ``[start, end]`` the scheduler was busy, from scrapes ``(t, idle_s, cpu_s)`` (module
    docstring). Measured between the first flush after ``start`` and the last before ``end``."""
    flushes = [
        (t0, t1, idle)
        for (t0, _, c0), (t1, idle, c1) in zip(samples, samples[1:])
        if c1 != c0 and t0 >= start and t1 <= end
    ]
    if len(flushes) < 2:
        raise RuntimeError(
            f"SGLang flushed its idle counter {len(flushes)} times in the {end - start:.1f} s window, "
            "too few to measure (it flushes about once a second); raise --steps or --alone-seconds"
        )
    (a0, a1, idle_a), (b0, b1, idle_b) = flushes[0], flushes[-1]
    window = (b0 + b1) / 2 - (a0 + a1) / 2
    return {
        "duty_cycle": round(min(1.0, max(0.0, 1 - (idle_b - idle_a) / window)), 4),
        "duty_cycle_window_s": round(window, 3),
        "duty_cycle_error_bound": round(((a1 - a0) / 2 + (b1 - b0) / 2) / window, 4),
    }


# ---------------------------------------------------------------------------- phase 1: the pipeline


def mode_spec(base: RunSpec, mode: str, run_dir: Path, transport: str | None = None) -> RunSpec:
    """The spec of one ``MODES`` run: ``base`` (``up``'s flags) with the mode's ``max_inflight_steps``
    and ``weight_update``, ``transport`` as its ``weight_transport`` (None: ``base``'s), its run
    directory, held-out evaluations before and after training only, SGLang's ``--enable-metrics``
    added to its flags."""
    inflight, weight_update = MODES[mode]
    trainer = {"weight_update": weight_update, "heldout_every": base.trainer.steps}
    return base.derive(
        cfg={"max_inflight_steps": inflight},
        up={"run_dir": run_dir, "sglang_args": f"{base.up.sglang_args} --enable-metrics".strip()},
        trainer=trainer if transport is None else {**trainer, "weight_transport": transport},
    )


def run_pipeline(args, spec: RunSpec, mode: str) -> tuple[dict, RunSpec, str]:
    """``centerline up --config FILE`` of ``spec`` (``mode_spec``) to its end; returns its figures, the
    spec it ran (as its ``config.toml`` says, launch settings included) and its model."""
    run_dir = spec.up.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_file = run_dir.parent / f"{mode}.toml"
    spec.write(spec_file)
    argv = [PYTHON, "-m", "centerline", "up", "--config", str(spec_file)]
    # the spec resolved the settings variables already; left in, they would beat its file
    env = {k: v for k, v in os.environ.items() if k not in run_spec.setting_variables()}
    log = run_dir / "up.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    progress("up", mode=mode, run_dir=str(run_dir), log=str(log))
    try:
        config, metrics = run_dir / "config.toml", run_dir / "metrics.jsonl"
        while not config.exists():
            _poll(up, log, args.poll)
        ran = run_spec.load(config)
        if len(ran.cfg.services.engine_urls) != 1:
            raise RuntimeError(
                f"the bench measures one SGLang server; the run has {len(ran.cfg.services.engine_urls)} (--engines)"
            )
        engine = ran.cfg.services.engine_urls[0]
        wait_http(f"{engine}/health", "the run's SGLang server", up, log, 600)
        with urllib.request.urlopen(f"{engine}/get_model_info", timeout=10) as resp:
            model = orjson.loads(resp.read())["model_path"]  # asked before the first weight update renames it
        seen: dict[int, float] = {}  # step -> when its line appeared
        while 1 not in seen:
            seen |= _new_steps(metrics, seen)
            _poll(up, log, args.poll)
        progress("startup", mode=mode, engine=engine, model=model, first_step_s=round(seen[1] - started, 1))
        with Scraper(engine, args.poll) as scraper:
            # to the last step: --steps, or the one --train-seconds ended on (then the trainer evaluates)
            while up.poll() is None and spec.trainer.steps not in seen:
                seen |= _new_steps(metrics, seen)
                time.sleep(args.poll)
            seen |= _new_steps(metrics, seen)
        while up.poll() is None:  # the final evaluation and the report
            time.sleep(args.poll)
        if up.returncode != 0:
            raise RuntimeError(f"centerline up exited with status {up.returncode}; see {log}")
    finally:
        if up.poll() is None:  # interrupted: up stops every service it started on SIGTERM
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
    steps = [orjson.loads(line) for line in metrics.read_bytes().splitlines()]
    last = steps[-1]["step"]
    if last <= args.warmup_steps:
        raise RuntimeError(f"the run ended at step {last}, within --warmup-steps {args.warmup_steps}; see {log}")
    window = [s for s in steps if s["step"] > args.warmup_steps]
    start, end = seen[args.warmup_steps], seen[last]
    samples, tokens = sum(s["samples"] for s in window), sum(s["trained_tokens"] for s in window)
    evals = [orjson.loads(line) for line in (run_dir / "eval.jsonl").read_bytes().splitlines()]
    figures = {
        "max_inflight_steps": spec.cfg.training.max_inflight_steps,
        "weight_update": spec.trainer.weight_update,
        "weight_transport": spec.trainer.weight_transport,
        "weight_fallbacks": steps[-1]["weight_fallbacks"],  # so far: the run's own count
        "steps_done": last,
        "steps_wall_s": round(sum(s["step_s"] for s in steps), 3),  # the trainer's own clock, all steps
        "staleness_max": max(s["staleness_max"] for s in steps),
        # the held-out figure up records: exact-match accuracy, or a run of sessions' mean reward
        "accuracy_before": evals[0][heldout_key(evals[0])],
        "accuracy_after": evals[-1][heldout_key(evals[-1])] if evals[-1]["step"] == last else None,
        "pipeline_window_s": round(end - start, 3),
        "pipeline_steps": len(window),
        "samples_total": sum(s["samples"] for s in steps),
        # tasks published again after a stale batch, per task a step trains (docs/design.md section 10)
        "republished_share": round(sum(s["gate_resampled"] for s in steps) / (last * ran.trainer.prompts_per_step), 4),
        "pipeline_samples": samples,
        "pipeline_tokens": tokens,
        "pipeline_samples_per_s": round(samples / (end - start), 3),
        "pipeline_tokens_per_s": round(tokens / (end - start), 3),
        **{
            f"pipeline_{k}_mean": round(sum(s[k] for s in window) / len(window), 4)
            for k in ("step_s", "gather_s", "train_s")
        },
        "weights_s_mean": round(sum(s["weights_s"] for s in window) / len(window), 4),
        "weights_s_max": round(max(s["weights_s"] for s in window), 4),
        **token_staleness(window),
        **duty_cycle(scraper.samples, start, end),
        # the trainer's side: the share of its step time not spent waiting for batches
        "trainer_duty_cycle": round(1 - sum(s["gather_s"] for s in window) / sum(s["step_s"] for s in window), 4),
    }
    progress("pipeline", mode=mode, **figures)
    return figures, ran, model


def label_truth(mode_dir: Path, model: str, logs: Path) -> dict:
    """A mode's run teacher-forced on a fresh engine (``centerline/runs/teacher_force.py``)."""
    from centerline.runs import teacher_force

    engine, server = teacher_force.start_engine(Path(model), logs / "sglang-teacher-force.log")
    try:
        report = teacher_force.check_run(mode_dir, engine)
    except teacher_force.TeacherForceError as exc:
        raise RuntimeError(f"teacher forcing {mode_dir}: {exc}") from None
    finally:
        teacher_force.stop_engine(server)
    figures = {
        "label_checked_tokens": report["total"]["tokens"],
        "label_mismatch_share": report["total"]["share"],
        "label_mismatch_max": round(report["total"].get("max", 0.0), 6),
        "wrong_label_share": report["wrong_label"]["total"]["share"],
    }
    progress("teacher_force", run_dir=str(mode_dir), **figures)
    return figures


def heldout_key(record: dict) -> str:
    """The held-out figure of an ``eval.jsonl`` record: ``eval_accuracy`` (exact match), or
    ``eval_reward`` for a run of sessions (the environment's reward)."""
    return "eval_accuracy" if "eval_accuracy" in record else "eval_reward"


def token_staleness(steps: list[dict]) -> dict:
    """The steps' staleness per trained token (their ``token_staleness_*``), weighted by their trained tokens."""
    tokens = sum(s["trained_tokens"] for s in steps)
    return {
        "token_staleness_mean": round(sum(s["token_staleness_mean"] * s["trained_tokens"] for s in steps) / tokens, 4),
        "token_staleness_max": max(s["token_staleness_max"] for s in steps),
        "token_stale_share": round(sum(s["token_stale_share"] * s["trained_tokens"] for s in steps) / tokens, 4),
        "token_kv_unverified_share": round(
            sum(s["token_kv_unverified_share"] * s["trained_tokens"] for s in steps) / tokens, 4
        ),
    }


def _new_steps(metrics: Path, seen: dict[int, float]) -> dict[int, float]:
    if not metrics.exists():
        return {}
    now = time.monotonic()
    data = metrics.read_bytes()
    lines = data[: data.rfind(b"\n") + 1].splitlines()  # complete lines only
    return {step: now for line in lines[len(seen) :] if (step := orjson.loads(line)["step"]) not in seen}


def _poll(up: subprocess.Popen, log: Path, interval: float) -> None:
    if up.poll() is not None:
        raise RuntimeError(f"centerline up exited with status {up.returncode} before the last step; see {log}")
    time.sleep(interval)


# ---------------------------------------------------------------------------- phase 2: SGLang alone


def request_bodies(config: Config, model: str, dataset: Path, count: int = 256) -> list[bytes]:
    """The worker's native /generate request (``rollout_worker.request.training_body``) for the first ``count``
    prompts of ``dataset``, as the proxy rewrites it."""
    from transformers import AutoTokenizer

    from rollout_worker.request import training_body
    from router_proxy.rewrite import Contract, rewrite_body

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [orjson.loads(line)["prompt"] for line in dataset.read_bytes().splitlines()[:count]]
    contract = Contract.from_config(config)
    return [
        rewrite_body(
            orjson.dumps(training_body(config, list(tok(p)["input_ids"]), config.rollout.n)), "generate", contract
        )
        for p in prompts
    ]


async def closed_loop(url: str, bodies: list[bytes], concurrency: int, warmup: float, seconds: float) -> dict:
    """``concurrency`` clients, each sending its next request on the last answer; counts the
    samples and generated tokens of answers that arrive in ``[warmup, warmup + seconds]``."""
    import aiohttp

    counts = {"requests": 0, "samples": 0, "tokens": 0}
    t0 = time.monotonic()
    start, end = t0 + warmup, t0 + warmup + seconds

    async def client(session, i: int) -> None:
        while time.monotonic() < end:
            async with session.post(
                url, data=bodies[i % len(bodies)], headers={"Content-Type": "application/json"}
            ) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url} answered {resp.status}: {body[:300]!r}")
            i += concurrency
            if start <= time.monotonic() <= end:
                outs = orjson.loads(body)
                outs = outs if isinstance(outs, list) else [outs]
                counts["requests"] += 1
                counts["samples"] += len(outs)
                counts["tokens"] += sum(o["meta_info"]["completion_tokens"] for o in outs)

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(client(session, i) for i in range(concurrency)))
    return {**counts, "start": start, "end": end}


def concurrent_requests(spec: RunSpec) -> int:
    """The most requests the pipeline of ``spec`` has in flight: each worker's resolved ``concurrency``."""
    return spec.up.workers * spec.worker.concurrency


def run_alone(args, spec: RunSpec, model: str, dataset: Path, run_dir: Path, seconds: float) -> dict:
    """A fresh SGLang server of ``model``, the pipeline's requests at its most concurrency, then stopped."""
    concurrency = concurrent_requests(spec)
    bodies = request_bodies(spec.cfg, model, dataset)
    url = f"http://127.0.0.1:{free_port()}"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(run_dir / "logs", {})
    try:
        started = time.monotonic()
        proc = supervisor.start("sglang-alone", sglang_argv(model, url, ["--enable-metrics"]))
        wait_http(f"{url}/health", "SGLang alone", proc, run_dir / "logs" / "sglang-alone.log", 300)
        progress("sglang_alone_ready", url=url, startup_s=round(time.monotonic() - started, 1), concurrency=concurrency)
        with Scraper(url, args.poll) as scraper:
            counts = asyncio.run(closed_loop(f"{url}/generate", bodies, concurrency, args.alone_warmup, seconds))
    finally:
        supervisor.stop()
    figures = {
        "sglang_alone_window_s": round(seconds, 3),
        "sglang_alone_requests": counts["requests"],
        "sglang_alone_samples": counts["samples"],
        "sglang_alone_tokens": counts["tokens"],
        "sglang_alone_samples_per_s": round(counts["samples"] / seconds, 3),
        "sglang_alone_tokens_per_s": round(counts["tokens"] / seconds, 3),
        **{f"sglang_alone_{k}": v for k, v in duty_cycle(scraper.samples, counts["start"], counts["end"]).items()},
    }
    progress("sglang_alone", **figures)
    return figures


# ---------------------------------------------------------------------------- the benchmark


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
        "eval_prompts": spec.up.heldout_prompts,
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
