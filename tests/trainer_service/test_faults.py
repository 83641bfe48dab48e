"""The trainer under injected faults (issue #8 items 2, 4 and 5): rank 0 killed at each
failpoint of a step, a poison batch, a consumer crashing on a message, steps slower than the
ack wait. Real processes throughout: nats-server, the session's real SGLang server, the
trainer under torchrun with 2 gloo ranks, the stand-in rollout worker of ``service_stack``.

A failpoint (``shared/faults.py``) makes rank 0 SIGKILL itself at an exact place of a step;
the test then kills what is left of the process group, as a lost machine would leave it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter

import orjson
import pytest
from nats.js.errors import NotFoundError

from centerline.nats_server import EmbeddedNats
from centerline.toy.tokenizer import VOCAB_SIZE
from shared import names
from shared.nats_client import connect, pull_consumer
from shared.wire import encode_batch
from tests.processes import ENV, REPO, metrics_lines, stored_messages, wait_until
from tests.trainer_service import service_stack
from tests.trainer_service.service_stack import (
    TORCHRUN,
    StandInWorker,
    Trainer,
    consumer_info,
    dead_letters,
    fault,
    write_dataset,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FLAGS = (*service_stack.FLAGS, "--keep-checkpoints", "0")  # every checkpoint kept: the tests read them


@pytest.fixture
def stack(tmp_path, sglang, model_dir):
    """A directory of the test's own, the model the shared SGLang server serves (the trainer's version 0), the
    server."""
    yield tmp_path, model_dir, sglang
    Trainer.kill_all()


def state_at(run_dir, step: int) -> dict:
    return orjson.loads((run_dir / "checkpoints" / f"step-{step:06d}" / "state.json").read_bytes())


def crash_at(trainer: Trainer, failpoint: str, step: int) -> None:
    """Wait until rank 0 reached ``failpoint`` of ``step`` and killed itself, then kill the rest."""
    line = f"failpoint {failpoint} at step {step}: kill"
    wait_until(lambda: line in trainer.log_path.read_text(errors="replace"), 180, line, trainer.proc)
    trainer.kill()


def summary(name: str, **figures) -> None:
    print(f"\n[reliability] {name}: " + " ".join(f"{k}={v}" for k, v in figures.items()))


# The places a crash can hit a step, in the order a step passes them, and the step each kills.
CRASHES = (
    ("trainer.train", 2),
    ("trainer.before_checkpoint", 3),
    ("trainer.after_acks", 3),
    ("trainer.after_checkpoint", 4),
)
STEPS = 5


def test_rank_0_killed_at_every_failpoint_trains_each_batch_once_bit_for_bit(stack):
    tmp, model, engine = stack
    run_dir, dataset = tmp / "run-crashes", write_dataset(tmp / "tasks-crashes.jsonl")
    with EmbeddedNats(tmp / "nats-crashes") as nats, StandInWorker(nats.url, engine.url, VOCAB_SIZE) as worker:
        for failpoint, step in CRASHES:
            trainer = Trainer(
                run_dir,
                model,
                dataset,
                nats.url,
                engine.url,
                "--steps",
                str(STEPS),
                *FLAGS,
                failpoints=f"{failpoint}@{step}=kill",
            )
            crash_at(trainer, failpoint, step)
        last = Trainer(run_dir, model, dataset, nats.url, engine.url, "--steps", str(STEPS), *FLAGS)
        assert last.wait(240) == 0, last.log()
        info = asyncio.run(consumer_info(nats.url))
        letters = asyncio.run(dead_letters(nats.url))
        record = subprocess.run(
            [
                sys.executable,
                "-m",
                "centerline",
                "record",
                "--stream",
                names.ROLLOUTS_STREAM,
                "--from-seq",
                "1",
                "--out",
                str(tmp / "crashes.clrec"),
                "--nats-url",
                nats.url,
            ],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert record.returncode == 0, record.stderr
    assert worker.error is None, worker.error

    lines = metrics_lines(run_dir)
    trained = [bid for line in lines for bid in line["batch_ids"]]
    state = state_at(run_dir, STEPS)
    # Every committed step has exactly one metrics line (those of steps 3 and 4 rebuilt from their checkpoints),
    # every published batch was trained exactly once, each step trained its 2 groups.
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert [line.get("recovered", False) for line in lines] == [False, False, True, True, False]
    assert sorted(trained) == sorted(worker.published) and len(set(trained)) == len(trained) == 2 * STEPS
    assert list(state["ledger"]) == trained  # the ledger in training order
    assert Counter(entry["step"] for entry in state["ledger"].values()) == {s: 2 for s in range(STEPS)}
    # The 2 batches of step 4 were checkpointed but not acked: redelivered, and dropped as trained.
    assert sum(line.get("gate_duplicate", 0) for line in lines) == 2
    assert (info.num_ack_pending, info.num_pending, len(letters)) == (0, 0, 0)
    assert state["version"] == STEPS

    # An uninterrupted run over the same batches: every step after step 1 (the last state no
    # fault touched) replayed from its checkpoint in one go, on 2 ranks as the trainer ran.
    replayed = tmp / "run-uninterrupted"
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "centerline",
        "replay",
        str(tmp / "crashes.clrec"),
        "--train",
        "--checkpoint",
        str(run_dir / "checkpoints" / "step-000001"),
        "--steps-from",
        str(run_dir / "metrics.jsonl"),
        "--run-dir",
        str(replayed),
    ]
    replay = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0, replay.stderr[-3000:]
    again = metrics_lines(replayed)
    assert [line["step"] for line in again] == list(range(2, STEPS + 1))
    for mine, theirs in zip(again, lines[1:]):
        assert (mine["loss"], mine["grad_norm"], mine["batch_ids"]) == (
            theirs["loss"],
            theirs["grad_norm"],
            theirs["batch_ids"],
        )
    final = ("checkpoints", f"step-{STEPS:06d}", "model", "model.safetensors")
    assert replayed.joinpath(*final).read_bytes() == run_dir.joinpath(*final).read_bytes()
    summary(
        "trainer crashes",
        faults=len(CRASHES),
        published=len(worker.published),
        acked=len(worker.published),
        trained=len(trained),
        dead_lettered=len(letters),
        lost=len(set(worker.published) - set(trained)),
        duplicated=len(trained) - len(set(trained)),
        redelivered_and_dropped=2,
    )


def test_a_poison_batch_is_dead_lettered_once_across_a_crash_and_never_stalls_the_steps(stack):
    tmp, model, engine = stack
    run_dir, dataset = tmp / "run-poison", write_dataset(tmp / "tasks-poison.jsonl")
    poison = {}

    async def inject(worker, task, batch):
        if task.task_id.endswith("/0/0"):
            bad = fault(batch, "short_row")
            await worker.publish_raw(bad.batch_id, encode_batch(bad), bad.batch_id)
            poison[bad.batch_id] = worker.extra[bad.batch_id]

    with (
        EmbeddedNats(tmp / "nats-poison") as nats,
        StandInWorker(nats.url, engine.url, VOCAB_SIZE, inject=inject) as worker,
    ):
        # The DLQ holds the poison, the crash comes before its ack: it is delivered again.
        first = Trainer(
            run_dir, model, dataset, nats.url, engine.url, "--steps", "2", *FLAGS, failpoints="trainer.rejected=kill"
        )
        crash_at(first, "trainer.rejected", None)
        again = Trainer(run_dir, model, dataset, nats.url, engine.url, "--steps", "2", *FLAGS)
        assert again.wait(240) == 0, again.log()
        letters = asyncio.run(dead_letters(nats.url))
        info = asyncio.run(consumer_info(nats.url))
    assert worker.error is None, worker.error
    lines = metrics_lines(run_dir)
    trained = [bid for line in lines for bid in line["batch_ids"]]
    assert [line["step"] for line in lines] == [1, 2] and sorted(trained) == sorted(worker.published)
    ((headers, data),) = letters  # once, though rejected twice
    ((poison_id, poison_bytes),) = poison.items()
    assert (headers["rule"], headers["batch_id"], data) == ("short_row", poison_id, poison_bytes)
    assert headers["reason"].startswith("sample 0 row 2 has 15 candidates, expected 16")
    assert [line["gate_rejected"] for line in lines] == [{"short_row": 1}, {}]
    assert (info.num_ack_pending, info.num_pending) == (0, 0)
    summary(
        "poison batch",
        faults=2,
        published=len(worker.published) + 1,
        acked=len(worker.published) + 1,
        trained=len(trained),
        dead_lettered=len(letters),
        lost=0,
        duplicated=len(trained) - len(set(trained)),
    )


async def advisories(nats_url: str) -> list[tuple[str, dict]]:
    return [(m.subject, orjson.loads(m.data)) for m in await stored_messages(nats_url, names.ADVISORIES_STREAM)]


def test_batches_a_trainer_crashes_on_reach_max_deliver_and_the_advisory_is_kept(stack):
    tmp, model, engine = stack
    run_dir, dataset = tmp / "run-max-deliver", write_dataset(tmp / "tasks-max-deliver.jsonl")
    flags = (*FLAGS, "--max-deliver", "2", "--max-inflight-steps", "2")  # tasks of steps 1 and 2 are out from the start
    with EmbeddedNats(tmp / "nats-max-deliver") as nats, StandInWorker(nats.url, engine.url, VOCAB_SIZE) as worker:
        for _ in range(2):  # the trainer dies holding step 1's batches, twice
            crash_at(
                Trainer(
                    run_dir,
                    model,
                    dataset,
                    nats.url,
                    engine.url,
                    "--steps",
                    "2",
                    *flags,
                    failpoints="trainer.gathered@1=kill",
                ),
                "trainer.gathered",
                1,
            )
        # Step 1 trains the tasks published for step 2; step 2 has none left, starves for
        # --step-timeout 5 and publishes the tasks of one more step.
        last = Trainer(run_dir, model, dataset, nats.url, engine.url, "--steps", "2", *flags, "--step-timeout", "5")
        assert last.wait(240) == 0, last.log()
        given_up = asyncio.run(advisories(nats.url))
    assert worker.error is None, worker.error
    first_step = sorted(bid for bid in worker.published if "/0/" in bid)
    assert [subject for subject, _ in given_up] == [
        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{names.ROLLOUTS_STREAM}.{names.TRAINER_CONSUMER}"
    ] * 2
    assert sorted(a["stream_seq"] for _, a in given_up) == [1, 2] and {a["deliveries"] for _, a in given_up} == {2}
    trained = [bid for line in metrics_lines(run_dir) for bid in line["batch_ids"]]
    # The run went on without them; they are accounted for in ADVISORIES, not silently gone.
    assert trained == sorted(bid for bid in worker.published if "/1/" in bid) + sorted(
        bid for bid in worker.published if "/2/" in bid
    )
    assert "are rollout workers running? (were tasks given up?" in last.log()
    summary(
        "max_deliver",
        faults=2,
        published=len(worker.published),
        trained=len(trained),
        given_up_with_advisory=len(given_up),
        lost_unseen=len(set(worker.published) - set(trained) - set(first_step)),
        duplicated=len(trained) - len(set(trained)),
    )


def test_a_step_slower_than_the_ack_wait_is_not_redelivered(stack):
    """Step 1 holds its first batch while it waits 3 ack waits for the second (fetching all
    along, so an expired batch would be handed out again), then trains for 8 s."""
    tmp, model, engine = stack
    run_dir, dataset = tmp / "run-slow", write_dataset(tmp / "tasks-slow.jsonl")
    hold_until = []
    blocked = lambda task: task.task_id.endswith("/0/1") and (not hold_until or time.monotonic() < hold_until[0])  # noqa: E731
    with (
        EmbeddedNats(tmp / "nats-slow") as nats,
        StandInWorker(nats.url, engine.url, VOCAB_SIZE, blocked=blocked) as worker,
    ):
        trainer = Trainer(
            run_dir, model, dataset, nats.url, engine.url, "--steps", "2", *FLAGS, failpoints="trainer.train@1=sleep:8"
        )
        wait_until(lambda: holding(nats.url) == 1, 180, "step 1 holding its first batch", trainer.proc)
        hold_until.append(time.monotonic() + 9.0)
        assert trainer.wait(240) == 0, trainer.log()
        info = asyncio.run(consumer_info(nats.url))
    assert worker.error is None, worker.error
    lines = metrics_lines(run_dir)
    assert lines[0]["gather_s"] > 9 and lines[0]["save_s"] > 8  # both far beyond --ack-wait 3
    # Deliveries, counting redeliveries (consumer_seq), equal messages: each was delivered once.
    assert (info.delivered.consumer_seq, info.delivered.stream_seq, len(worker.published)) == (4, 4, 4)
    assert sum(line["gate_duplicate"] for line in lines) == 0


def holding(nats_url: str) -> int:
    """Batches the trainer holds unacked (0 before its consumer exists)."""
    try:
        return asyncio.run(consumer_info(nats_url)).num_ack_pending
    except NotFoundError:
        return 0


def test_the_batch_a_dead_trainer_held_is_redelivered_within_the_ack_wait(stack):
    tmp, model, engine = stack
    ack_wait = 3.0
    run_dir, dataset = tmp / "run-redeliver", write_dataset(tmp / "tasks-redeliver.jsonl")
    blocked = lambda task: task.task_id.endswith("/0/1")  # noqa: E731  step 1 holds its first group only
    with EmbeddedNats(tmp / "nats-redeliver") as nats, StandInWorker(nats.url, engine.url, VOCAB_SIZE, blocked=blocked):
        trainer = Trainer(run_dir, model, dataset, nats.url, engine.url, "--steps", "1", *FLAGS)
        wait_until(lambda: holding(nats.url) == 1, 180, "step 1 holding a batch", trainer.proc)
        trainer.kill()
        killed = time.monotonic()

        async def redelivered():
            nc = await connect(nats.url)
            try:
                consumer = await pull_consumer(
                    nc.jetstream(),
                    names.ROLLOUTS_STREAM,
                    names.TRAINER_CONSUMER,
                    filter_subject=names.ROLLOUTS_SUBJECT,
                    ack_wait=ack_wait,
                )
                (msg,) = await consumer.fetch(1, timeout=ack_wait + 10)
                return time.monotonic() - killed, msg.metadata.num_delivered
            finally:
                await nc.close()

        elapsed, deliveries = asyncio.run(redelivered())
    # In-progress acks every ack_wait/3 kept it while the trainer lived; after its death the
    # server hands it out again no later than ack_wait after the last one.
    assert deliveries == 2
    assert elapsed <= ack_wait + 0.5, elapsed
    print(f"\n[reliability] redelivery after trainer death: {elapsed:.2f}s (ack_wait {ack_wait}s)")
