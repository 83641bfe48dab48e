"""`centerline trainer`: drive prompt tasks, gate candidate batches, train, publish weights.

The loop (rank 0 does all NATS and HTTP I/O; other ranks follow its steps):

    publish the tasks of the steps up to max_inflight_steps ahead      tasks.py
    gather whole task groups until the step's samples arrived           gate.py, admission.py
    train on their concatenation, on every rank                         commit.py, policy.py, step.py
    save weights version v+1 and the checkpoint (with the ledger),      commit.py, weights.py, checkpoint.py
      or, between checkpoints, the step's journal record                journal.py
    ack the step's batches                                              gate.py
    load version v+1 on every engine, publish weights.updated           weights.py
    log the step                                                        metrics.py
    evaluate the held-out rows when the step is due (every heldout_every)  heldout.py

Held-out evaluation (``--heldout-dataset``; docs/design.md section 9): before the first step,
after every ``--heldout-every`` steps and after the last, the held-out rows go to the workers as
tasks of one sample; the gate hands their batches to their round, never to a step, and each
round is written to ``heldout_metrics.jsonl`` as the held-out figure of the step that scheduled it. After
the last step the trainer waits for the open rounds (at most ``--heldout-timeout``) before it exits.

A step wants ``--prompts-per-step`` groups of ``rollout_n`` samples; it closes early after
``--step-timeout`` seconds with whatever arrived; with less than one sample per rank it
publishes one more step of tasks every ``--step-timeout`` (groups given up by ``max_deliver``
or terminated by a worker never come). ``--train-seconds`` stops the loop, like ``--steps``,
before the first step that would begin after that many seconds. SIGTERM/SIGINT: a running
step is finished and committed (its weights are not sent to the engines), a step still
gathering is abandoned (its batches are nak'ed, none acked), then the process exits 0.
With ``--checkpoint-every N`` the checkpoint is saved every N steps and after the last; a step
between two is made durable by its journal record (trainer_service/journal.py) before its acks,
and a restart trains the recorded steps again before anything else.

    centerline trainer --model runs/model --dataset runs/tasks.jsonl --run-dir runs/trainer --steps 100
    torchrun --nproc-per-node 2 -m centerline trainer --model ... --strategy fsdp2
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
import tomllib
import uuid
from datetime import timedelta
from pathlib import Path

from shared import config as shared_config
from shared import logs
from shared.contract import k_above_vocab
from shared.settings import SECTIONS, CommandSettings, Config, TrainerSettings

log = logging.getLogger("centerline.trainer")
# what a held-out round's tasks refused by a full store cost (trainer_service/store.py)
HELDOUT_REFUSED = "held-out tasks (their round is given up after --heldout-timeout)"


def parse(argv: list[str]):
    """``(args, cfg, settings)``: the namespace, the shared settings and the trainer's
    (``shared.settings.TrainerSettings``; flags, TOML table ``[trainer]``, ``CENTERLINE_TRAINER_*``)."""
    parser = argparse.ArgumentParser(prog="centerline trainer", description=__doc__.split("\n")[0])
    shared_config.add_arguments(parser, TrainerSettings)
    return shared_config.parse_args(parser, argv, section=TrainerSettings)


async def drive(settings: TrainerSettings, cfg, policy, resume: Path | None) -> int:
    """Rank 0: the training loop of the module docstring."""
    from shared import faults
    from trainer_service import checkpoint, store, weights
    from trainer_service.commit import LedgerFormatError, TrainerState, commit_step, step_record
    from trainer_service.gate import Gate
    from trainer_service.heldout import HeldoutRounds
    from trainer_service.ledger import first_kept_step, kept_task_steps
    from trainer_service.metrics import Metrics
    from trainer_service.tasks import AttemptBlocks, TaskPublisher, load_dataset

    saved = checkpoint.load_state(resume) if resume else None
    try:
        state = TrainerState.from_dict(saved, str(resume)) if saved else TrainerState(run_id=run_id(settings.run_dir))
    except LedgerFormatError as exc:
        log.error("%s", exc)
        policy.stop()
        return 2
    if not candidates_fit(cfg, policy.vocab_size):
        policy.stop()
        return 2
    metrics = Metrics(settings)
    metrics.recover(saved or state.to_dict())  # the line of a step checkpointed just before a crash
    # The steps trained since the last checkpoint, trained again from their journal records.
    # the ledger keeps the tasks of the last `kept` task steps (trainer_service/ledger.py)
    kept = kept_task_steps(cfg.training.max_inflight_steps, cfg.training.max_staleness, settings.weight_sync_interval)
    state, replayed = await retrain_journal(settings, policy, state, metrics, kept)
    stopping = stop_event()
    heldout_rows = load_dataset(settings.heldout_dataset) if settings.heldout_dataset is not None else []
    nc, js, consumer = await open_streams(cfg, settings, heldout_rows=len(heldout_rows))
    tasks = TaskPublisher(
        load_dataset(settings.dataset),
        run_id=state.run_id,
        seed=cfg.training.seed,
        prompts_per_step=settings.prompts_per_step,
        n=cfg.rollout.n,
        # a run directory of an older release: its trainers sampled in block 0
        blocks=AttemptBlocks(settings.run_dir / "attempt_blocks", first=1 if saved or replayed else 0),
        next_step=state.next_task_step,
    )
    heldout = None
    if settings.heldout_dataset is not None:
        heldout = HeldoutRounds(
            heldout_rows,
            run_id=state.run_id,
            attempts_before=tasks.attempts_before,
            every=settings.heldout_every,
            timeout=settings.heldout_timeout,
            record=metrics.heldout,
        )
        heldout.recorded(settings.run_dir)
    gate = Gate(
        js,
        consumer,
        vocab_size=policy.vocab_size,
        cfg=cfg,
        ledger=dict(state.ledger),
        first_task_step=first_kept_step(state.next_task_step, kept),
        ack_wait=settings.ack_wait,
        resample=lambda batch: tasks.resample(js, batch),  # a stale batch's task is sampled again
        max_republishes=settings.max_republishes,
        heldout=heldout,
        run_id=state.run_id,  # another run's batches are foreign_run
    )
    engines = weights.WeightPublisher(
        js,
        cfg.services.engine_urls,
        mode=settings.weight_update,
        transport=settings.weight_transport,
        master_address=settings.weight_master_address,
        bucket_bytes=settings.weight_bucket_mb << 20,
    )
    # Engines serve what this trainer holds, whatever they served before (a restart, a stale engine).
    initial = weights.version_dir(settings.run_dir / "weights", state.version) if state.version else settings.model
    await engines.publish(state.version, initial)
    if heldout is not None:  # step 0's round before training; after a restart, the rounds not yet recorded
        await heldout.reopen(js, state.step, state.version)
    keep_alive = asyncio.create_task(gate.keep_alive(settings.ack_wait / 3))
    catching_up = asyncio.create_task(
        engines.watch(proof_interval=settings.weight_proof_interval)
    )  # an engine that restarted gets the latest weights
    target = settings.prompts_per_step * cfg.rollout.n
    log.info("run %s resumes at step %d, version %d", state.run_id, state.step, state.version)
    deadline = time.monotonic() + settings.train_seconds if settings.train_seconds else float("inf")

    while state.step < settings.steps and not stopping.is_set():
        if time.monotonic() >= deadline:
            log.info("--train-seconds %g have passed: no further step", settings.train_seconds)
            break
        t0 = time.perf_counter()
        # A stop while NATS does not answer must not wait out the publish's retries (and its
        # error): tasks not stored are published again, under the same ids, by the next start.
        # A full store refuses them by name (StoreFull): the step trains what is stored, which frees room.
        publish = tasks.publish_until(js, state.step, cfg.training.max_inflight_steps, settings.steps)
        if not await unless_stopped(
            store.unless_full(publish, "tasks (published at the next step)", gate.counts), stopping
        ):
            break
        held = await gate.gather(
            target,
            state.version,
            settings.step_timeout,
            stopping,
            min_samples=policy.world_size,
            starved=lambda: store.unless_full(
                tasks.publish_next(js), "the next step's tasks (when it starves again)", gate.counts
            ),
        )
        if stopping.is_set():
            await gate.release()  # abandoned: nothing of this step is acked, all of it comes back
            break
        faults.hit("trainer.gathered", state.step + 1)
        t1 = time.perf_counter()
        step = await asyncio.to_thread(
            commit_step,
            policy,
            state,
            held,
            weight_sync_interval=settings.weight_sync_interval,
            next_task_step=tasks.next_step,
            first_task_step=first_kept_step(tasks.next_step, kept),
            checkpoint_every=settings.checkpoint_every,
            last_step=settings.steps,
            journal_dir=settings.run_dir / "journal",
        )
        faults.hit("trainer.after_checkpoint", step.after.step)
        # the step is durable (its checkpoint, or its journal record): ack its batches, drop other attempts
        await gate.commit(state.step, first_kept_step(tasks.next_step, kept))
        faults.hit("trainer.after_acks", step.after.step)
        await trim(js, gate.counts, settings, cfg)
        t2 = time.perf_counter()
        # Stopping: the engines are being stopped too, and a new start loads this version into
        # them first thing; an update now could only wait on servers that are going away.
        if step.weights is not None and not stopping.is_set():
            await engines.publish(step.after.version, step.weights)
        timings = {"gather_s": t1 - t0, "weights_s": time.perf_counter() - t2, "step_s": time.perf_counter() - t0}
        record = step_record(
            step, metrics.gate(gate.take_counts()), timings, weight_update=settings.weight_update, **engines.figures()
        )
        metrics.weight_failures.set(engines.failures)
        metrics.weight_catch_ups.set(engines.catch_ups)
        figures = engines.figures()
        metrics.weights_verified.set(figures["weights_verified"])
        metrics.weight_mismatches.set(figures["weight_mismatches"])
        metrics.step(record)
        state = step.after
        if heldout is not None and heldout.due(state.step, settings.steps) and not stopping.is_set():
            await store.unless_full(heldout.schedule(js, state.step, state.version), HELDOUT_REFUSED, gate.counts)

    if heldout is not None and not stopping.is_set():  # after the last step (--train-seconds too)
        await store.unless_full(heldout.schedule(js, state.step, state.version), HELDOUT_REFUSED, gate.counts)
        await gate.finish_heldout(stopping)

    keep_alive.cancel()
    catching_up.cancel()
    log.info("stopped after %d steps at version %d", state.step, state.version)
    metrics.close()
    try:
        await engines.close()
        await nc.flush(timeout=5)  # naks are plain publishes; acks were confirmed one by one
        await nc.close()
    # NATS down at the end: what was not acked comes back after ack_wait
    except Exception as exc:  # noqa: BLE001
        log.warning("NATS unreachable while stopping (%r); batches not acked are redelivered after --ack-wait", exc)
    finally:
        policy.stop()  # last: the other ranks then leave with this one
    return 0


async def retrain_journal(settings: TrainerSettings, policy, state, metrics, kept: int):
    """Train again the steps the journal holds past the checkpoint ``state`` came from (every
    rank follows), each from the parts it trained on, the ledger keeping ``kept`` task steps; returns
    the state after them and how many."""
    from trainer_service import journal
    from trainer_service.commit import commit_step, step_record
    from trainer_service.ledger import first_kept_step

    records = journal.pending(settings.run_dir / "journal", state.step)
    for index, next_task_step, held in records:
        log.warning("step %d was trained after the last checkpoint: trained again from its journal record", index + 1)
        step = await asyncio.to_thread(
            commit_step,
            policy,
            state,
            held,
            weight_sync_interval=settings.weight_sync_interval,
            next_task_step=next_task_step,
            first_task_step=first_kept_step(next_task_step, kept),
            checkpoint_every=settings.checkpoint_every,
            last_step=settings.steps,
            journal_dir=settings.run_dir / "journal",
        )
        metrics.step(step_record(step, {}, {}, weight_update=settings.weight_update, retrained=True))
        state = step.after
    return state, len(records)


def candidates_fit(cfg, vocab_size: int) -> bool:
    """Whether the configured K may be asked of SGLang (``shared.contract.k_above_vocab``); logs why not."""
    too_many = k_above_vocab(cfg.rollout.top_logprobs_num, vocab_size, cfg.rollout.logprobs_mode)
    if too_many:
        log.error("--rollout-top-logprobs-num: %s", too_many)
    return too_many is None


async def unless_stopped(work, stopping: asyncio.Event) -> bool:
    """Await ``work``, or cancel it when ``stopping`` is set first; whether it finished."""
    job, stop = asyncio.ensure_future(work), asyncio.ensure_future(stopping.wait())
    done, _ = await asyncio.wait({job, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if job not in done:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)  # let it unwind before the stream closes
        return False
    job.result()  # its error, if it failed on its own
    return True


async def trim(js, counts, settings: TrainerSettings, cfg) -> None:
    """Purge trained batches from ROLLOUTS where it nears its cap (``trainer_service/store.py``), keeping
    room for the steps in flight at their largest; NATS not answering only postpones it."""
    import nats.errors

    from trainer_service import store

    try:
        room = store.room(cfg, settings.prompts_per_step)
        counts["store_trimmed"] += await store.trim(js, settings.store_caps(cfg)[0], room)
    except nats.errors.Error as exc:
        log.warning(
            "ROLLOUTS not trimmed this step (%r): may this NATS user purge ROLLOUTS? (centerline/nats_users.py)", exc
        )


def stop_event() -> asyncio.Event:
    """Set on SIGTERM or SIGINT: the loop finishes a running step, abandons a gathering one."""
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
    return stopping


async def open_streams(cfg, settings: TrainerSettings, heldout_rows: int = 0):
    """Connect, make sure the streams exist (byte caps from the settings: ``TrainerSettings.store_caps``),
    bind the trainer's durable consumer of batches (``max_ack_pending`` from the step's size:
    ``gate.max_ack_pending``)."""
    from shared import names
    from shared.nats_client import connect, pull_consumer
    from shared.pieces import pieces_per_part
    from shared.streams import StreamLimits, ensure_streams, sample_max_bytes
    from trainer_service.gate import max_ack_pending

    nc = await connect(cfg.services.nats_url, name="centerline-trainer")
    js = nc.jetstream()
    rollouts, dlq = settings.store_caps(cfg)
    limits = StreamLimits(replicas=cfg.services.nats_stream_replicas, rollouts_max_bytes=rollouts, dlq_max_bytes=dlq)
    await ensure_streams(js, limits)
    consumer = await pull_consumer(
        js,
        names.ROLLOUTS_STREAM,
        names.TRAINER_CONSUMER,
        filter_subject=names.ROLLOUTS_SUBJECT,
        ack_wait=settings.ack_wait,
        max_deliver=settings.max_deliver,
        max_ack_pending=max_ack_pending(
            settings.prompts_per_step,
            cfg.rollout.n,
            cfg.training.max_inflight_steps,
            heldout_rows,
            pieces_per_part(sample_max_bytes(cfg.rollout), nc.max_payload),
        ),
    )
    return nc, js, consumer


def run_id(run_dir: Path) -> str:
    """The run's id, made once per run directory: a trainer restarted before its first
    checkpoint publishes the same task ids again (deduplicated), so the tasks and batches of
    its first attempt are not trained under a second id beside those of the second."""
    path = run_dir / "run_id"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(uuid.uuid4().hex[:12] + "\n")
        os.replace(tmp, path)
    return path.read_text().strip()


def write_run_config(path: Path, args: argparse.Namespace, cfg: Config, *sections: CommandSettings) -> None:
    """Write the run's ``config.toml`` (atomically: other services may be reading it): the
    resolved settings, and the other commands' tables of the file this command read. A file
    that says exactly that already is left alone: the run spec `centerline up` wrote, which
    this command was started with, is written once."""
    read = shared_config.load_toml(vars(args)["config"]) if "config" in vars(args) else {}
    tables = {name: values for name, values in read.items() if name in SECTIONS}
    text = shared_config.to_toml(cfg, *sections, tables=tables)
    if path.exists() and tomllib.loads(path.read_text()) == tomllib.loads(text):
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    args, cfg, settings = parse(argv)
    logs.setup("trainer")
    import torch
    from transformers.utils import logging as hf_logging

    from trainer_service import checkpoint
    from trainer_service.distributed import broadcast_from_main, in_world, is_main
    from trainer_service.policy import Policy

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf_logging.disable_progress_bar()  # one "Writing model shards" bar per step and rank otherwise
    torch.set_num_threads(settings.threads)

    def body() -> int:
        main_rank = is_main()
        if main_rank:
            settings.run_dir.mkdir(parents=True, exist_ok=True)
            write_run_config(settings.run_dir / "config.toml", args, cfg, settings)
            checkpoint.remove_partial(settings.run_dir / "checkpoints")
        resume = broadcast_from_main(checkpoint.latest(settings.run_dir / "checkpoints") if main_rank else None)
        policy = Policy(settings, cfg, resume)
        if not main_rank:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)  # rank 0 decides when to stop and tells this rank
            policy.follow_rank0()
            return 0
        return asyncio.run(drive(settings, cfg, policy, resume))

    # Other ranks wait in a broadcast while rank 0 gathers batches, which lasts as long as the workers need.
    return in_world(body, timeout=timedelta(hours=24))
