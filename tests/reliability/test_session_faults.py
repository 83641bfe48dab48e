"""A session's worker dies between two turns (issue #22, Faults): a worker running a task's
sessions (the toy task ``chain`` with its built-in environment: 2-4 turns a session) is SIGKILLed
as a session's turn 2 arrives (failpoint ``worker.between_turns@2=kill``, one task at a time), one
turn answered and nothing published. The task comes back after ``ack_wait`` to the other worker,
started with it, as attempt 2 in new sessions, and the trainer (asynchronous default) trains every
group once, whole: nothing lost, nothing dropped but a late second attempt, no group twice.
Prints one ``RELIABILITY`` line (``pytest -s``)."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from shared import names
from shared.contract import sample_turns
from shared.faults import ENV
from shared.wire import decode_batch
from tests.reliability.topology import PROMPTS_PER_STEP, ROLLOUT_N, run_accounting, stream_messages

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 2


def test_a_worker_killed_between_two_turns_of_a_session_leaves_every_group_trained_once_whole(topology):
    topology.task, topology.environment = "chain", "chain"
    dying = topology.add_worker("w0", "--concurrency", "1", env={ENV: "worker.between_turns@2=kill"})
    spare = topology.add_worker("w1")
    dying.wait_ready()
    spare.wait_ready()
    trainer = topology.start_trainer(STEPS)
    assert dying.proc.wait(timeout=120) == -9, dying.log()[-3000:]
    assert "failpoint worker.between_turns at step 2: kill" in dying.log()
    code = trainer.wait(240)
    assert code == 0, trainer.log()
    topology.wait_drained()
    figures, run = run_accounting(topology.nats, topology.run_dir, STEPS, topology.workers)
    stored = [decode_batch(bytes(data)) for _, _, data in asyncio.run(stream_messages(topology.nats))]
    figures.faults = 1
    print("\n" + figures.summary("session-between-turns"))

    assert '"task done"' not in dying.log()  # the dying worker published nothing
    # Stored beyond the trained groups: only another attempt of a trained task, which the gate drops
    # as duplicate_attempt. With a 3 s ack_wait on two cores a whole suite loads, a task's heartbeat
    # can come late and the task go to w1 twice.
    extra = len(stored) - STEPS * PROMPTS_PER_STEP
    assert {b.producer for b in stored} == {"w1"} and extra >= 0
    assert figures.dropped == ({"duplicate_attempt": extra} if extra else {})
    [task] = [t for t, attempts in run["attempts"].items() if attempts != {1}]
    assert run["attempts"][task] == {2} and run["state"]["ledger"][task]["attempt"] == 2
    assert [(b.batch_id, b.parts) for b in stored if b.task_id == task][0] == (f"{task}#2", 1)  # attempt 2 first
    assert figures.trained == STEPS * PROMPTS_PER_STEP and figures.published == figures.acked == len(stored)
    assert (figures.lost, figures.duplicated, figures.dead_lettered, figures.groups_twice) == (0, 0, 0, 0)
    assert run["ledger_matches_stream"] and set(run["trained"]) == run["expected"]
    assert all(n == 1 for n in run["trained"].values()) and len(run["trained"]) == STEPS * PROMPTS_PER_STEP * ROLLOUT_N
    tokenizer = AutoTokenizer.from_pretrained(str(topology.model))
    for batch in stored:  # every session whole: its chain problem's 2-4 turns, a user message between two
        turns = sample_turns(batch)
        users = [
            tokenizer.decode(batch.response_ids[batch.sample_slice(i)].tolist()).count("<|im_start|>user")
            for i in range(batch.num_samples)
        ]
        assert batch.num_samples == ROLLOUT_N and len(set(turns)) == 1 and 2 <= turns[0] <= 4, (batch.task_id, turns)
        assert [t - 1 for t in turns] == users, (batch.task_id, turns, users)
    assert run["consumers"] == {names.WORKERS_CONSUMER: (0, 0), names.TRAINER_CONSUMER: (0, 0)}
