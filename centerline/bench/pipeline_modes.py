"""Phase 1 of ``centerline bench pipeline`` (``centerline/bench/pipeline.py`` says what it
measures): each mode's ``centerline up`` run, watched to its end, and its figures.

A mode is a ``centerline up`` run with a ``max_inflight_steps`` and the trainer's ``weight_update``
(docs/design.md section 8): ``drain`` is the asynchronous default pipeline (``2``: the engine
samples the next step while the trainer trains, so a batch is at most one weight version stale
and score centering corrects for it) with updates that wait for the generations in flight;
``in-flight`` the same with ``weight_update = retract``, the default (pause, load, flush the
prefix cache, recompute the requests in flight: the generations go on, a response may span an
update); ``in-place`` the same with ``weight_update = in_place`` (no flush, no recompute: tokens
may rest on KV of older weights than their label); ``on-policy`` is ``--max-inflight-steps 1``
(the engine samples a step's batches, then waits while the trainer trains on them). A mode may
also name its weight transport (the trainer's ``weight_transport``, docs/design.md section 8,
transports); it reports the transport it ran and ``weight_fallbacks``, the versions an engine
loaded from disk instead (the run's last step's count).

Each run is its own process, every service real, SGLang started with ``--enable-metrics``, and
trains for ``--train-seconds`` (the trainer starts no step after that; at most ``--steps``),
then the trainer evaluates ``--heldout-prompts`` held-out prompts (docs/design.md section 9), as it
did before training. The measured window runs from the end of step ``--warmup-steps`` to the end
of the last step, as this process sees lines appear in ``metrics.jsonl`` (polled every ``--poll``
s), so start-up, the first batches and the evaluations are outside it. Samples and tokens are the
trainer's own counts for the steps in the window (``samples``, ``trained_tokens``; every generated
token is trained); ``weights_s`` the trainer's time per step to load the new version into the
engine and announce it; staleness per trained token the steps' ``token_staleness_*``, weighted by
their trained tokens; the duty cycle SGLang's, over the window (``duty_cycle.py``).

``label_truth`` (``--teacher-force``) then checks a mode's labels
(``centerline/runs/teacher_force.py``): one fresh SGLang server of the model, without a prefix
cache, loads every weight version still on disk and forces the tokens labelled with it;
``label_mismatch_share`` is the share of those tokens whose recorded log-prob is more than 1e-3
from the forced one (``label_checked_tokens`` of them), beside ``token_kv_unverified_share``, the
trainer's own bound, and ``wrong_label_share``, the same tokens under the neighbouring version
(what the check can tell apart).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import orjson

from centerline.bench import progress
from centerline.bench.duty_cycle import Scraper, duty_cycle
from centerline.runs.report import load_heldout
from centerline.up import run_spec
from centerline.up.processes import PYTHON, wait_http
from centerline.up.run_spec import RunSpec
from shared import heldout_record

# each a `centerline up` run with this max_inflight_steps and the trainer's weight_update
MODES = {
    "on-policy": (1, "retract"),
    "drain": (2, "drain"),
    "in-flight": (2, "retract"),
    "in-place": (2, "in_place"),
}


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
    progress("pipeline", "up", mode=mode, run_dir=str(run_dir), log=str(log))
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
        progress("pipeline", "startup", mode=mode, engine=engine, model=model, first_step_s=round(seen[1] - started, 1))
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
    evals = load_heldout(run_dir)
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
    progress("pipeline", "pipeline", mode=mode, **figures)
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
    progress("pipeline", "teacher_force", run_dir=str(mode_dir), **figures)
    return figures


def heldout_key(record: dict) -> str:
    """The held-out figure of a held-out record (``shared/heldout_record.py``): ``heldout_accuracy``
    (exact match), or ``heldout_reward`` for a run of sessions (the environment's reward)."""
    return heldout_record.ACCURACY if heldout_record.ACCURACY in record else heldout_record.REWARD


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
