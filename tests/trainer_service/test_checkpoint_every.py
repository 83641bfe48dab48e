"""`--checkpoint-every` under crashes (docs/design.md section 10, "Checkpoints every N steps"):
rank 0 of a 2-rank trainer killed between checkpoints, with and without the step's acks, and
before the first checkpoint; the steps since the last checkpoint are trained again from their
journal records, every batch is trained exactly once and the ledger agrees. Real processes as
in test_faults.py."""

from __future__ import annotations

import asyncio
from collections import Counter

import orjson
import pytest

from centerline.nats_server import EmbeddedNats
from centerline.toy.tokenizer import VOCAB_SIZE
from tests.processes import metrics_lines
from tests.trainer_service.service_stack import StandInWorker, Trainer, consumer_info, dead_letters, write_dataset
from tests.trainer_service.test_faults import FLAGS, crash_at, stack  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS, EVERY = 5, 3  # checkpoints after steps 3 and 5; steps 1, 2 and 4 are journalled
CRASHES = (
    ("trainer.after_acks", 2),  # steps 1 and 2 journalled and acked, no checkpoint yet
    ("trainer.after_checkpoint", 4),  # step 4 journalled, its batches not acked: redelivered
)


def test_rank_0_killed_between_checkpoints_retrains_the_journalled_steps_and_each_batch_once(stack):  # noqa: F811
    tmp, model, engine = stack
    run_dir, dataset = tmp / "run-every", write_dataset(tmp / "tasks-every.jsonl")
    flags = ("--steps", str(STEPS), "--checkpoint-every", str(EVERY), *FLAGS)
    with EmbeddedNats(tmp / "nats-every") as nats, StandInWorker(nats.url, engine.url, VOCAB_SIZE) as worker:
        for failpoint, step in CRASHES:
            trainer = Trainer(
                run_dir, model, dataset, nats.url, engine.url, *flags, failpoints=f"{failpoint}@{step}=kill"
            )
            crash_at(trainer, failpoint, step)
        assert sorted(p.name for p in (run_dir / "journal").iterdir()) == ["step-000004.bin"]
        assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-")] == ["step-000003"]
        last = Trainer(run_dir, model, dataset, nats.url, engine.url, *flags)
        assert last.wait(240) == 0, last.log()
        info = asyncio.run(consumer_info(nats.url))
        letters = asyncio.run(dead_letters(nats.url))
    assert worker.error is None, worker.error

    lines = metrics_lines(run_dir)
    trained = [bid for line in lines for bid in line["batch_ids"]]
    state = orjson.loads((run_dir / "checkpoints" / f"step-{STEPS:06d}" / "state.json").read_bytes())
    # one line a step; steps 1, 2 (no checkpoint) and 4 (after checkpoint 3) trained again from the journal
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert [line.get("retrained", False) for line in lines] == [True, True, False, True, False]
    assert sorted(trained) == sorted(worker.published) and len(set(trained)) == len(trained) == 2 * STEPS
    assert list(state["ledger"]) == trained
    assert Counter(entry["step"] for entry in state["ledger"].values()) == {s: 2 for s in range(STEPS)}
    # step 4's 2 batches were journalled, not acked: redelivered and dropped as trained
    assert sum(line.get("gate_duplicate", 0) for line in lines) == 2
    assert (info.num_ack_pending, info.num_pending, len(letters)) == (0, 0, 0)
    assert state["version"] == STEPS
    assert list((run_dir / "journal").iterdir()) == []
