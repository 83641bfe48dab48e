"""Held-out evaluation in `centerline trainer`, end to end (docs/design.md section 9): embedded NATS,
the session's real SGLang server, the trainer, and the stand-in worker, which samples held-out
tasks as it samples training tasks. The rounds are written to eval.jsonl at step 0, every
--eval-every steps and after the last; a held-out batch is never trained."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from centerline.nats_server import EmbeddedNats
from centerline.tokenizer import VOCAB_SIZE
from shared.wire import decode_batch
from tests.trainer_service.service_stack import FLAGS, StandInWorker, Trainer, consumer_info, write_dataset

pytestmark = pytest.mark.integration

STEPS, EVERY, ROWS = 3, 2, 3


def lines(path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_heldout_rounds_are_recorded_at_step_0_every_eval_every_and_the_last_never_trained(tmp_path, sglang, model_dir):
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
                "--eval-every",
                str(EVERY),
                *FLAGS,
                nproc=1,
            )
            code = trainer.wait(240)
        info = asyncio.run(consumer_info(nats.url))
    assert worker.error is None, worker.error
    assert code == 0, trainer.log()
    evals = lines(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 3] and all(e["eval_rows"] == ROWS for e in evals)
    # each round's figure is the mean reward of the one sample per row the worker published for it
    published = {bid: decode_batch(data) for bid, data in worker.published.items()}
    for e in evals:
        rewards = [float(b.rewards[0]) for b in published.values() if f"/heldout/{e['step']}/" in b.task_id]
        assert len(rewards) == ROWS and e["eval_reward"] == pytest.approx(np.mean(rewards))
        assert e["eval_version_min"] >= e["version"] == (0 if e["step"] == 0 else e["step"])
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
    assert [(e.step, e.value) for e in events.Scalars("eval_reward")] == [
        (e["step"], float(np.float32(e["eval_reward"]))) for e in evals
    ]
