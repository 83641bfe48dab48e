"""`centerline replay`: a record file (``centerline record``) back into NATS, into the trainer's
steps offline, or printed for people.

- ``--to URL``: JetStream-publish every message with its recorded headers (``Nats-Msg-Id``
  included, so the duplicate window still drops what the stream already holds) to its
  subject, or to ``--subject``. The streams are ensured first, as every service does.
- ``--jsonl``: one summary line per message (subject, seq, headers, batch summary).
- ``--train``: the trainer's steps on exactly the recorded batches, with no NATS and no
  engine: the checkpoint's model, optimizer and state (version, ledger), the trainer's
  admission (``trainer_service.admission.admission``: contract, staleness against the replayed
  version, ledger, settings) and its commit of a step (``trainer_service.commit``), under
  torchrun as many ranks as the trainer had (rank 0 reads the file and sends each step, as
  in the trainer). Steps are grouped as
  ``--steps-from RUN_DIR/metrics.jsonl`` lists them (``batch_ids`` of each step after the
  checkpoint's; by default the ``metrics.jsonl`` of the checkpoint's run directory), else
  every ``--batches-per-step`` accepted batches in recorded order.
  Writes ``RUN_DIR/metrics.jsonl`` (same fields as the trainer's), weights and checkpoints.
  The configuration defaults to the ``config.toml`` of the checkpoint's run directory, which
  holds every setting of the run: the shared ones and the whole ``[trainer]`` table, which the
  replay restores (a step's ``strategy``, ``max_grad_norm``, ``threads``, ``weight_sync_interval``,
  ``micro_batch_tokens``; ``keep_checkpoints``; ``tensorboard`` and ``wandb``); a flag still
  overrides one of those. Only what names the original run is replaced: the model is the
  checkpoint's, the run directory ``--run-dir``, and no ``/metrics`` port is served.

    centerline replay seg.clrec --to nats://127.0.0.1:4222
    centerline replay seg.clrec --jsonl
    torchrun --standalone --nproc-per-node 2 -m centerline replay seg.clrec --train \\
        --checkpoint runs/x/checkpoints/step-000002 --run-dir runs/x-replay

Left out: the gate counts of messages a ``--steps-from`` step does not list (the original
gather may have rejected or dropped others on the way), and gather/weight-sync timings.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

import orjson

from centerline.runs.record import Message, RecordFileError, ignore_client_errors, joined, print_summary, read_record
from shared import config as shared_config
from shared import logs
from shared.nats_auth import CredentialsError
from shared.settings import ReplaySettings, TrainerSettings

# The trainer settings `centerline replay --train` has flags for: those of a step, of its checkpoints and of
# its metrics. It takes every setting from the run's [trainer] table; a flag overrides one of these.
TRAINER_REPLAY_FIELDS = (
    "strategy",
    "max_grad_norm",
    "threads",
    "weight_sync_interval",
    "micro_batch_tokens",
    "pack_samples",
    "dtype",
    "activation_checkpointing",
    "loss_chunk_tokens",
    "keep_checkpoints",
    "tensorboard",
    "wandb",
    "wandb_project",
)

log = logging.getLogger("centerline.runs.replay")


class ReplayError(RuntimeError):
    """A replay that cannot reproduce the run as asked; the message says what is missing."""


def parse(argv: list[str]):
    """``(args, settings)``: the namespace (file, mode, ``config``) and ``ReplaySettings``. With
    ``--train`` and no ``--config``, ``args.config`` is the checkpoint's run's ``config.toml``."""
    parser = argparse.ArgumentParser(prog="centerline replay", description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path, help="a record file written by centerline record")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to", metavar="URL", help="republish every message to this NATS server")
    mode.add_argument("--jsonl", action="store_true", help="print one summary JSON line per message")
    mode.add_argument("--train", action="store_true", help="run the trainer's steps on the recorded batches")
    shared_config.add_arguments(parser, ReplaySettings)
    shared_config.add_arguments(
        parser,
        TrainerSettings,
        only=TRAINER_REPLAY_FIELDS,
        shared=False,
        title="--train: the trainer's settings of a step (default: the [trainer] table of the run's config.toml)",
    )
    args = parser.parse_args(argv)
    try:
        settings = shared_config.resolve_section(ReplaySettings, args)
    except shared_config.ConfigError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    if args.train and settings.checkpoint is None:
        parser.error("--train needs --checkpoint DIR")
    if settings.subject and not args.to:
        parser.error("--subject applies to --to")
    if args.train and not hasattr(args, "config"):
        default = settings.checkpoint.resolve().parent.parent / "config.toml"
        if default.is_file():
            args.config = str(default)
    grouped = settings.steps_from is not None or "batches_per_step" in vars(args) or settings.batches_per_step != 1
    if args.train and not grouped:  # the steps as the run trained them, from its metrics.jsonl
        metrics = settings.checkpoint.resolve().parent.parent / "metrics.jsonl"
        if metrics.is_file():
            settings = settings.model_copy(update={"steps_from": metrics})
    return args, settings


def main(argv: list[str]) -> int:
    args, settings = parse(argv)
    logs.setup("replay")
    try:
        if args.train:
            return train(args.file, settings, *run_settings(args))
        _, messages = read_record(args.file)
        if args.jsonl:
            for msg in joined(messages):
                print_summary(msg)
            return 0
        from nats.errors import NoServersError

        try:
            print(orjson.dumps(asyncio.run(republish(messages, args.to, settings.subject))).decode())
        except NoServersError:
            raise ReplayError(f"no NATS server at {args.to} (--to)") from None
        return 0
    except (RecordFileError, ReplayError, shared_config.ConfigError, CredentialsError, OSError) as exc:
        print(f"centerline replay: {exc}", file=sys.stderr)
        return 2


def run_settings(args) -> tuple[shared_config.Config, TrainerSettings]:
    """The shared settings and the trainer's, from the flags (``TRAINER_REPLAY_FIELDS`` of the
    trainer's), the environment and the run's ``config.toml`` (``args.config``), in that order."""
    cfg = shared_config.resolve(args)
    return cfg, shared_config.resolve_section(TrainerSettings, args, cfg=cfg, only=TRAINER_REPLAY_FIELDS)


async def republish(messages: list[Message], url: str, subject: str | None) -> dict:
    """JetStream-publish each message with its headers; counts what the streams stored."""
    from shared.nats_client import connect
    from shared.streams import ensure_streams

    nc = await connect(url, name="centerline-replay", max_reconnect_attempts=3, error_cb=ignore_client_errors)
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        stored = duplicates = 0
        for msg in messages:
            ack = await js.publish(subject or msg.subject, msg.data, headers=msg.headers or None, timeout=10.0)
            duplicates += bool(ack.duplicate)
            stored += not ack.duplicate
        return {"published": len(messages), "stored": stored, "duplicates": duplicates, "to": url}
    finally:
        await nc.close()


# ---------------------------------------------------------------------------- --train


def step_groups(messages: list[Message], state: dict, steps_from: Path, limit: int | None) -> list[list[Message]]:
    """The recorded messages of each step after the checkpoint's, as ``steps_from`` lists them."""
    from shared import names
    from shared.msgpack_arrays import WireError
    from shared.wire import decode_batch

    by_step = {}
    for _number, line in enumerate(steps_from.read_bytes().splitlines(), 1):
        record = orjson.loads(line) if line.strip() else {}
        if "batch_ids" in record:
            by_step[record["step"]] = record["batch_ids"]
    index: dict[str, Message] = {}
    for msg in messages:
        batch_id = msg.headers.get(names.MSG_ID_HEADER)
        if batch_id is None:
            try:
                batch_id = decode_batch(msg.data).batch_id
            except WireError:
                continue
        index.setdefault(batch_id, msg)  # the first copy: a later one with the same id is a re-publish
    groups, step = [], state["step"] + 1
    while step in by_step and (limit is None or len(groups) < limit):
        missing = [b for b in by_step[step] if b not in index]
        if missing:
            if not groups:
                raise ReplayError(
                    f"step {step} of {steps_from} trained batch {missing[0]!r}, which is not in the "
                    "record file; record a sequence range that covers it"
                )
            log.info("step %d needs batch %s, not recorded: replay ends after step %d", step, missing[0], step - 1)
            break
        groups.append([index[b] for b in by_step[step]])
        step += 1
    if not groups:
        raise ReplayError(f"{steps_from} lists no step {step} (the checkpoint holds {state['step']} steps)")
    return groups


def replayed(trainer: TrainerSettings, settings: ReplaySettings, run_dir: Path) -> TrainerSettings:
    """The run's trainer settings as the replay runs them: every one kept but what names the
    original run (its initial model, its run directory) and the ``/metrics`` port, which an
    offline replay does not serve."""
    return trainer.model_copy(update={"model": settings.checkpoint / "model", "run_dir": run_dir, "metrics_port": None})


def train(file: Path, settings: ReplaySettings, cfg, trainer: TrainerSettings) -> int:
    """The replayed steps, with the shared settings ``cfg`` and the run's trainer settings."""
    import torch
    from transformers.utils import logging as hf_logging

    from trainer_service.distributed import broadcast_from_main, in_world, is_main
    from trainer_service.policy import Policy

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf_logging.disable_progress_bar()
    torch.set_num_threads(trainer.threads)
    run_dir = settings.run_dir or file.with_suffix(".replay")
    trainer = replayed(trainer, settings, run_dir)

    def body() -> int:
        main_rank = is_main()
        plan, problem = None, None
        if main_rank:  # rank 0 reads everything; a problem stops every rank before any collective
            try:
                plan = plan_replay(file, settings, run_dir)
            except (RecordFileError, ReplayError, OSError, ValueError) as exc:
                problem = str(exc)
        problem = broadcast_from_main(problem)
        if problem is not None:
            if main_rank:
                print(f"centerline replay: {problem}", file=sys.stderr)
            return 2
        policy = Policy(trainer, cfg, resume=settings.checkpoint)
        if not main_rank:
            policy.follow_rank0()
            return 0
        try:
            replay_steps(file, settings, trainer, cfg, policy, *plan)
        finally:
            policy.stop()
        return 0

    return in_world(body)


def plan_replay(file: Path, settings: ReplaySettings, run_dir: Path):
    """Rank 0, before any collective: the messages, the checkpoint state and the step groups."""
    from trainer_service import checkpoint

    if (run_dir / "metrics.jsonl").exists():
        raise ReplayError(f"{run_dir / 'metrics.jsonl'} exists; choose another --run-dir or remove it")
    if not (settings.checkpoint / "state.json").is_file():
        raise ReplayError(
            f"{settings.checkpoint} is not a complete checkpoint (no state.json); "
            "expected <run_dir>/checkpoints/step-NNNNNN"
        )
    messages = joined(read_record(file)[1])
    state = checkpoint.load_state(settings.checkpoint)
    groups = step_groups(messages, state, settings.steps_from, settings.steps) if settings.steps_from else None
    run_dir.mkdir(parents=True, exist_ok=True)
    return messages, state, groups


def replay_steps(
    file: Path, replay: ReplaySettings, trainer: TrainerSettings, cfg, policy, messages, saved, groups_of
) -> None:
    """Rank 0: the trainer's step loop (``trainer_service.service.drive``) over recorded batches,
    with its admission and its commit of a step; no DLQ, no acks, no engines."""
    from collections import Counter

    from trainer_service.admission import DROP, DUPLICATE, EXPIRED_TASK, HOLD, REJECT, GateSettings, admission
    from trainer_service.commit import LedgerFormatError, TrainerState, commit_step, step_record
    from trainer_service.ledger import GroupLedger, HeldPart, first_kept_step, kept_task_steps
    from trainer_service.metrics import Metrics

    try:
        state = TrainerState.from_dict(saved, str(replay.checkpoint))
    except LedgerFormatError as exc:
        raise ReplayError(str(exc)) from None
    settings = GateSettings(policy.vocab_size, cfg)
    kept = kept_task_steps(cfg.training.max_inflight_steps, cfg.training.max_staleness, trainer.weight_sync_interval)
    groups, counts = GroupLedger(dict(state.ledger), first_kept_step(state.next_task_step, kept)), Counter()
    metrics = Metrics(trainer)
    stream = iter(messages)
    for n in range(len(groups_of) if groups_of is not None else sys.maxsize):
        if replay.steps is not None and n >= replay.steps:
            break
        t0 = time.perf_counter()
        want = len(groups_of[n]) if groups_of is not None else replay.batches_per_step
        for msg in groups_of[n] if groups_of is not None else stream:
            verdict = admission(msg.data, msg.seq, state.version, groups=groups, settings=settings)
            if verdict.action == HOLD:
                groups.hold(HeldPart(None, verdict.batch, msg.seq), 0.0)  # a whole group joins the step
                counts["accepted"] += 1
            elif verdict.action == DUPLICATE:
                counts["duplicate"] += 1  # trained before the checkpoint
            elif verdict.action == DROP:
                counts[f"dropped:{verdict.rule}"] += 1
                log.info("batch %s (seq %d) dropped (%s): %s", verdict.batch_id, msg.seq, verdict.rule, verdict.reason)
            elif verdict.action == REJECT:
                counts[f"rejected:{verdict.rule}"] += 1
                if verdict.batch is None:
                    log.warning("message seq %d is not a batch: %s", msg.seq, verdict.reason)
                else:
                    log.warning(
                        "batch %s (seq %d) rejected (%s): %s", verdict.batch_id, msg.seq, verdict.rule, verdict.reason
                    )
            if len(groups.held) >= want:
                break
        held = list(groups.held.values())
        if len(held) < want:
            if groups_of is not None:
                raise ReplayError(
                    f"step {state.step + 1}: the gate accepted {len(held)} of the {want} batches the original "
                    f"step trained ({dict(counts)}); see the warnings above"
                )
            if held:
                log.info("%d batches left over, fewer than --batches-per-step %d: not trained", len(held), want)
            break
        next_task_step = max(state.next_task_step, state.step + 1)
        step = commit_step(
            policy,
            state,
            held,
            weight_sync_interval=trainer.weight_sync_interval,
            next_task_step=next_task_step,
            first_task_step=first_kept_step(next_task_step, kept),
        )
        groups.commit(state.step)  # the ledger now equals step.after's; other attempts' pending parts are gone
        for h in groups.forget_before(first_kept_step(next_task_step, kept)):
            counts[f"rejected:{EXPIRED_TASK}"] += 1
            log.warning(
                "batch %s (seq %d) rejected (%s): pending, older than the ledger keeps",
                h.batch.batch_id,
                h.seq,
                EXPIRED_TASK,
            )
        gate, counts = metrics.gate(counts), Counter()
        timings = {"step_s": time.perf_counter() - t0}
        metrics.step(step_record(step, gate, timings, weight_update=trainer.weight_update, replay_of=str(file)))
        state = step.after
