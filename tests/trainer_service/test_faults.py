"""The trainer under injected faults (issue #8 items 2, 4 and 5): rank 0 killed at each
failpoint of a step, a poison batch, a consumer crashing on a message, steps slower than the
ack wait. Real processes throughout: nats-server, an engine, the trainer under torchrun with
2 gloo ranks, the stand-in rollout worker of ``service_stack``.

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

from engine.tokenizer import VOCAB_SIZE
from shared import names
from shared.nats import EmbeddedNats, connect, pull_consumer
from tests.processes import ENV, REPO, EngineProcess, init_model, wait_until
from tests.trainer_service.service_stack import (TORCHRUN, StandInWorker, Trainer, consumer_info, dead_letters, fault,
                                                 write_dataset)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FLAGS = ("--prompts-per-step", "2", "--rollout-n", "4", "--max-staleness", "1", "--ack-wait", "3",
         "--step-timeout", "60", "--learning-rate", "1e-3", "--keep-checkpoints", "0")  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer-faults")
    model = init_model(tmp / "model", seed=0)
    engine = EngineProcess(model, tmp / "engine.log")
    yield tmp, model, engine
    Trainer.kill_all()
    engine.stop()


def metrics_lines(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


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
CRASHES = (("trainer.train", 2), ("trainer.before_checkpoint", 3), ("trainer.after_acks", 3), ("trainer.after_checkpoint", 4))
STEPS = 5


def test_rank_0_killed_at_every_failpoint_trains_each_batch_once_bit_for_bit(stack):
    tmp, model, engine = stack
    run_dir, dataset = tmp / "run-crashes", write_dataset(tmp / "tasks-crashes.jsonl")
    with EmbeddedNats(tmp / "nats-crashes") as nats, StandInWorker(nats.url, engine.url, VOCAB_SIZE) as worker:
        for failpoint, step in CRASHES:
            trainer = Trainer(run_dir, model, dataset, nats.url, engine.url, "--steps", str(STEPS), *FLAGS,
                              failpoints=f"{failpoint}@{step}=kill")  # fmt: skip
            crash_at(trainer, failpoint, step)
        last = Trainer(run_dir, model, dataset, nats.url, engine.url, "--steps", str(STEPS), *FLAGS)
        assert last.wait(240) == 0, last.log()
        info = asyncio.run(consumer_info(nats.url))
        letters = asyncio.run(dead_letters(nats.url))
        record = subprocess.run([sys.executable, "-m", "centerline", "record", "--stream", names.ROLLOUTS_STREAM, "--from-seq", "1",
                                 "--out", str(tmp / "crashes.clrec"), "--nats-url", nats.url], cwd=REPO, env=ENV,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
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
    assert Counter(step for _, step in state["ledger"].values()) == {s: 2 for s in range(STEPS)}
    # The 2 batches of step 4 were checkpointed but not acked: redelivered, and dropped as trained.
    assert sum(line.get("gate_duplicate", 0) for line in lines) == 2
    assert (info.num_ack_pending, info.num_pending, len(letters)) == (0, 0, 0)
    assert state["version"] == STEPS

    # An uninterrupted run over the same batches: every step after step 1 (the last state no
    # fault touched) replayed from its checkpoint in one go, on 2 ranks as the trainer ran.
    replayed = tmp / "run-uninterrupted"
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "centerline", "replay", str(tmp / "crashes.clrec"),
           "--train", "--checkpoint", str(run_dir / "checkpoints" / "step-000001"), "--steps-from", str(run_dir / "metrics.jsonl"),
           "--run-dir", str(replayed)]  # fmt: skip
    replay = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0, replay.stderr[-3000:]
    again = metrics_lines(replayed)
    assert [line["step"] for line in again] == list(range(2, STEPS + 1))
    for mine, theirs in zip(again, lines[1:]):
        assert (mine["loss"], mine["grad_norm"], mine["batch_ids"]) == (theirs["loss"], theirs["grad_norm"], theirs["batch_ids"])
    final = ("checkpoints", f"step-{STEPS:06d}", "model", "model.safetensors")
    assert replayed.joinpath(*final).read_bytes() == run_dir.joinpath(*final).read_bytes()
    summary("trainer crashes", faults=len(CRASHES), published=len(worker.published), acked=len(worker.published),
            trained=len(trained), dead_lettered=len(letters), lost=len(set(worker.published) - set(trained)),
            duplicated=len(trained) - len(set(trained)), redelivered_and_dropped=2)  # fmt: skip
