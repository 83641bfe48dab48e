"""The ledger is bounded (trainer_service/ledger.py): it keeps the tasks of the last
``kept_task_steps`` task steps, and a part of an older task is refused as ``expired_task`` before
the ledger is asked, so that forgetting a task can never train it twice."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from centerline.synth import make_batch
from shared import names
from shared.config import Config
from shared.wire import encode_batch
from tests.trainer_service.test_gate import Msg, Recorder
from trainer_service.admission import EXPIRED_TASK, HOLD, REJECT, GateSettings, admission
from trainer_service.commit import TrainerState, commit_step
from trainer_service.gate import Gate
from trainer_service.ledger import (
    LEDGER_TASK_STEPS,
    GroupLedger,
    HeldPart,
    first_kept_step,
    kept_entries,
    kept_task_steps,
    task_step,
)

VOCAB, K = 64, 8
CFG = Config(rollout_top_logprobs_num=K, rollout_n=4, max_staleness=1)


def part(task: str, attempt: int = 1, version: int = 3, parts: int = 1):
    batch = make_batch(
        samples=4, tokens_per_sample=3, k=K, vocab_size=VOCAB, batch_id=f"{task}#{attempt}", weight_version=version
    )
    return replace(batch, task_id=task, attempt=attempt, parts=parts)


def entry(step: int) -> dict:
    return {"attempt": 1, "step": step, "parts": {"x": 1}}


def test_a_task_id_names_the_task_step_it_was_published_for():
    assert [task_step(t) for t in ["run/12/3", "run/0/0", "run/heldout/4/1", "b-0", "run/x/1"]] == [
        12,
        0,
        None,
        None,
        None,
    ]


def test_the_ledger_keeps_hundreds_of_task_steps_and_more_when_tasks_live_longer():
    assert kept_task_steps(1, 2) == LEDGER_TASK_STEPS == 256
    assert kept_task_steps(30, 2, weight_sync_interval=1) == 8 * (31 + 3) == 272
    assert kept_task_steps(4, 8, weight_sync_interval=4) == 8 * (5 + 9 * 4) == 328
    assert first_kept_step(100, 256) == 0 and first_kept_step(1000, 256) == 744


def test_forgetting_keeps_the_tasks_of_the_first_kept_step_on_and_ids_without_a_step():
    ledger = {"r/3/0": entry(3), "r/4/0": entry(4), "r/5/1": entry(5), "replayed-7": entry(1)}
    assert sorted(kept_entries(ledger, 4)) == ["r/4/0", "r/5/1", "replayed-7"]


def test_a_part_of_a_task_older_than_the_ledger_keeps_is_refused_before_the_ledger_is_asked():
    groups = GroupLedger({"r/9/0": entry(9)}, first_step=10)
    settings = GateSettings(VOCAB, CFG, "r")
    old = admission(encode_batch(part("r/9/0")), 7, 3, groups=groups, settings=settings)
    assert (old.action, old.rule) == (REJECT, EXPIRED_TASK)  # not DUPLICATE, though the ledger still has it
    assert old.reason == (
        "'r/9/0#1' is of task 'r/9/0', published for task step 9; the ledger keeps the tasks of task step 10 on, "
        "so whether it was trained is no longer known: never trained"
    )
    kept = admission(encode_batch(part("r/10/0")), 8, 3, groups=groups, settings=settings)
    assert kept.action == HOLD
    heldout = admission(encode_batch(part("r/heldout/2/0")), 9, 3, groups=groups, settings=settings)
    assert heldout.action == "heldout"  # a held-out round is not a training task: never expired


def test_a_commit_forgets_old_tasks_and_dead_letters_their_pending_parts_never_republishing():
    rec = Recorder()
    published_again = []

    async def resample(batch):
        published_again.append(batch.task_id)
        return True

    g = Gate(rec, rec, vocab_size=VOCAB, cfg=CFG, ledger={"r/1/0": entry(1)}, resample=resample, run_id="r")
    pending = Msg(encode_batch(part("r/2/0", parts=2)), seq=5)  # half of a split group of task step 2
    whole = Msg(encode_batch(part("r/3/0")), seq=6)
    asyncio.run(g.admit(pending, 3))
    asyncio.run(g.admit(whole, 3))
    asyncio.run(g.commit(7, first_task_step=3))
    assert sorted(g.groups.ledger) == ["r/3/0"]  # trained now; r/1/0 forgotten
    assert g.groups.pending == {} and published_again == []
    [(subject, data, headers)] = rec.published
    assert (subject, data, headers["rule"]) == (names.DLQ_SUBJECT, pending.data, EXPIRED_TASK)
    assert rec.acked == [whole, pending]
    # the other half arrives later: refused by name, its task not published again
    asyncio.run(g.admit(Msg(encode_batch(replace(part("r/2/0", parts=2), batch_id="r/2/0#1b")), seq=8), 3))
    assert [h["rule"] for _, _, h in rec.published] == [EXPIRED_TASK, EXPIRED_TASK] and published_again == []


class Policy:
    world_size = 1

    def run(self, command, state):
        return {"loss": 0.0}, None


def test_a_long_run_keeps_the_ledger_of_a_bounded_number_of_task_steps():
    """Three times the kept task steps, 8 tasks each: the checkpointed ledger and the gate's hold
    the last kept task steps' tasks, not every task of the run."""
    kept = kept_task_steps(1, 1)
    steps = 3 * kept
    state, groups = TrainerState(run_id="r"), GroupLedger({})
    for step in range(steps):
        held = [HeldPart(None, part(f"r/{step}/{i}"), seq=8 * step + i) for i in range(8)]
        for h in held:
            assert groups.hold(h, 0.0)
        after = commit_step(
            Policy(),
            state,
            held,
            weight_sync_interval=1,
            next_task_step=step + 2,
            first_task_step=first_kept_step(step + 2, kept),
        ).after
        groups.commit(step)
        groups.forget_before(first_kept_step(step + 2, kept))
        assert groups.ledger == after.ledger
        state = after
    # the kept task steps but the newest trained (``steps`` is published, not yet trained)
    assert len(state.ledger) == 8 * (kept - 1)
    assert min(task_step(t) for t in state.ledger) == steps + 1 - kept
