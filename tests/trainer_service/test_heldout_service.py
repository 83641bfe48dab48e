"""Held-out evaluation in `centerline trainer`, end to end (docs/design.md section 9): embedded NATS,
the session's real SGLang server, the trainer, and the stand-in worker, which samples held-out
tasks as it samples training tasks. The rounds are written to heldout_metrics.jsonl at step 0, every
--heldout-every steps and after the last; a held-out batch is never trained."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import orjson
import pytest
from nats.js.errors import NotFoundError
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from centerline.nats_server import EmbeddedNats
from centerline.toy.tokenizer import VOCAB_SIZE
from shared.wire import decode_batch
from tests.processes import wait_until
from tests.trainer_service.service_stack import FLAGS, StandInWorker, Trainer, consumer_info, write_dataset

pytestmark = pytest.mark.integration

STEPS, EVERY, ROWS = 3, 2, 3


@pytest.fixture(autouse=True)
def no_trainer_outlives_its_test():
    """A test that fails midway leaves no trainer behind to take the next test's CPU and NATS."""
    yield
    Trainer.kill_all()


def lines(path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_heldout_rounds_are_recorded_at_step_0_every_heldout_every_and_the_last_never_trained(
    tmp_path, sglang, model_dir
):
    run_dir = tmp_path / "run"
    heldout = write_dataset(tmp_path / "heldout.jsonl", size=ROWS)
    with EmbeddedNats(tmp_path / "nats") as nats:
        with StandInWorker(nats.url, sglang.url, VOCAB_SIZE) as worker:
            trainer = Trainer(
                run_dir,
                model_dir,
                write_dataset(tmp_path / "tasks.jsonl"),
                nats.url,
                sglang.url,
                "--steps",
                str(STEPS),
                "--heldout-dataset",
                str(heldout),
                "--heldout-every",
                str(EVERY),
                *FLAGS,
                nproc=1,
            )
            code = trainer.wait(240)
        info = asyncio.run(consumer_info(nats.url))
    assert worker.error is None, worker.error
    assert code == 0, trainer.log()
    evals = lines(run_dir / "heldout_metrics.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 3] and all(e["heldout_rows"] == ROWS for e in evals)
    # each round's figure is the mean reward of the one sample per row the worker published for it
    published = {bid: decode_batch(data) for bid, data in worker.published.items()}
    for e in evals:
        rewards = [float(b.rewards[0]) for b in published.values() if f"/heldout/{e['step']}/" in b.task_id]
        assert len(rewards) == ROWS and e["heldout_reward"] == pytest.approx(np.mean(rewards))
        assert e["heldout_version_min"] >= e["version"] == (0 if e["step"] == 0 else e["step"])
    # never trained: no held-out batch in a step or the ledger, every step its 2 groups of 4 samples
    heldout_ids = {bid for bid, b in published.items() if "/heldout/" in b.task_id}
    assert len(heldout_ids) == 3 * ROWS
    steps = lines(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3] and all(s["samples"] == 8 for s in steps)
    assert not heldout_ids & {bid for s in steps for bid in s["batch_ids"]}
    state = orjson.loads((run_dir / "checkpoints" / f"step-{STEPS:06d}" / "state.json").read_bytes())
    assert not any("/heldout/" in task for task in state["ledger"])
    assert (info.num_ack_pending, info.num_pending) == (0, 0)  # every held-out batch acked once recorded
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("heldout_reward")] == [
        (e["step"], float(np.float32(e["heldout_reward"]))) for e in evals
    ]


def test_a_trainer_killed_holding_a_heldout_batch_records_its_round_once_after_restart(tmp_path, sglang, model_dir):
    """Round 0's first row is in, its second held back: the trainer holds the first unacked, and is
    killed. The next start schedules round 0 again (deduplicated: nothing is sampled twice), gets
    the first row's batch redelivered and the second once released, and records round 0 once."""
    run_dir, release = tmp_path / "run", threading.Event()
    heldout = write_dataset(tmp_path / "heldout.jsonl", size=2)
    blocked = lambda task: task.task_id.endswith("/heldout/0/1") and not release.is_set()  # noqa: E731
    flags = ("--steps", str(STEPS), "--heldout-dataset", str(heldout), "--heldout-every", str(EVERY), *FLAGS)
    dataset = write_dataset(tmp_path / "tasks.jsonl")
    with EmbeddedNats(tmp_path / "nats") as nats:
        with StandInWorker(nats.url, sglang.url, VOCAB_SIZE, blocked=blocked) as worker:
            trainer = Trainer(run_dir, model_dir, dataset, nats.url, sglang.url, *flags, nproc=1)

            def holding_the_first_row():
                try:
                    return asyncio.run(consumer_info(nats.url)).num_ack_pending == 1
                except NotFoundError:  # the trainer has not made its streams and consumer yet
                    return False

            wait_until(holding_the_first_row, 180, "the trainer holding round 0's first row", trainer.proc)
            trainer.kill()
            assert not (run_dir / "heldout_metrics.jsonl").exists()  # nothing recorded: the round lacks a row
            release.set()
            again = Trainer(run_dir, model_dir, dataset, nats.url, sglang.url, *flags, nproc=1)
            code = again.wait(240)
        info = asyncio.run(consumer_info(nats.url))
    assert worker.error is None, worker.error
    assert code == 0, again.log()
    evals = lines(run_dir / "heldout_metrics.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 3]  # round 0 once, after the restart
    published = [decode_batch(data) for data in worker.published.values()]
    round_0 = [float(b.rewards[0]) for b in published if "/heldout/0/" in b.task_id]
    assert len(round_0) == 2  # scheduled twice, sampled once: the second publication was a duplicate
    assert evals[0]["heldout_reward"] == pytest.approx(np.mean(round_0)) and evals[0]["heldout_rows"] == 2
    assert (info.num_ack_pending, info.num_pending) == (0, 0)
