"""Held-out evaluation in the gate, without servers (docs/design.md section 9): a held-out batch goes
to its round, never to a step; each row counts once; a round is recorded once, then acked."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import orjson
import pytest

from centerline.synth import make_batch
from shared import names
from shared.task import PromptTask, TaskError
from shared.wire import encode_batch
from tests.trainer_service.test_gate import CFG, VOCAB, K, Msg, Recorder, batch
from trainer_service.admission import HELDOUT, HOLD, REJECT, GateSettings, admission
from trainer_service.gate import Gate
from trainer_service.heldout import HeldoutRounds, figure_name, heldout_id, heldout_step
from trainer_service.ledger import GroupLedger
from trainer_service.tasks import Example

ROWS = [Example("ab=", "ba", "exact", {"id": 0}), Example("cd=", "dc", "exact", {"id": 1})]


def heldout_batch(step: int, row: int, reward: float, version: int = 3, attempt: int = 1, seq_id: str = ""):
    """One sample of held-out row ``row`` of step ``step``'s round, scored ``reward``, as a worker packs it."""
    task_id = heldout_id("r1", step, row)
    b = make_batch(samples=1, tokens_per_sample=3, k=K, vocab_size=VOCAB, batch_id=f"{task_id}/a{attempt}{seq_id}")
    return replace(
        b,
        task_id=task_id,
        attempt=attempt,
        weight_version=version,
        token_versions=np.full_like(b.token_versions, version),
        rewards=np.array([reward], np.float32),
        advantages=np.zeros(1, np.float32),
    )


def heldout_rounds(recorded: list, rows=ROWS) -> HeldoutRounds:
    return HeldoutRounds(rows, run_id="r1", attempts_before=0, every=2, timeout=60.0, record=recorded.append)


def gate_with(heldout: HeldoutRounds) -> tuple[Gate, Recorder]:
    rec = Recorder()
    return Gate(rec, rec, vocab_size=VOCAB, cfg=CFG, ledger={}, heldout=heldout), rec


def test_heldout_ids_name_their_step_and_training_ids_none():
    assert heldout_id("r1", 25, 3) == "r1/heldout/25/3"
    assert heldout_step("r1/heldout/25/3") == 25
    assert [heldout_step(t) for t in ("r1/25/3", "heldout/25/3", "r1/heldout/x/3", "a/b/heldout/1/2")] == [None] * 4


def test_heldout_tasks_are_the_rows_once_each_marked_heldout():
    tasks = heldout_rounds([]).tasks(4)
    assert [(t.task_id, t.prompt, t.answer, t.n, t.step, t.purpose) for t in tasks] == [
        ("r1/heldout/4/0", "ab=", "ba", 1, 4, "heldout"),
        ("r1/heldout/4/1", "cd=", "dc", 1, 4, "heldout"),
    ]
    assert PromptTask.from_bytes(tasks[0].to_bytes()) == tasks[0]  # the marker travels in the task


def test_a_task_with_an_unknown_purpose_is_refused_by_name():
    task = orjson.loads(heldout_rounds([]).tasks(0)[0].to_bytes()) | {"purpose": "eval"}
    with pytest.raises(TaskError, match=r"task field 'purpose' is 'eval', expected one of 'train', 'heldout'"):
        PromptTask.from_bytes(orjson.dumps(task))


def test_the_figure_is_accuracy_for_exact_single_turn_rows_else_mean_reward():
    assert figure_name(ROWS) == "heldout_accuracy"
    assert figure_name([*ROWS, Example("x", "y", "prefix", {})]) == "heldout_reward"
    assert figure_name([Example("x", "y", "exact", {}, environment="chain")]) == "heldout_reward"


def test_a_heldout_batch_never_reaches_a_step_whatever_its_age():
    settings = GateSettings(VOCAB, CFG)
    stale = heldout_batch(0, 0, 1.0, version=0)  # 3 versions behind a trainer at 3, --max-staleness 1
    verdict = admission(encode_batch(stale), 5, 3, groups=GroupLedger({}), settings=settings)
    assert (verdict.action, verdict.batch_id) == (HELDOUT, stale.batch_id)
    training = admission(encode_batch(batch()), 6, 3, groups=GroupLedger({}), settings=settings)
    assert training.action == HOLD  # the same gate holds a training batch for the step


def test_a_heldout_batch_that_breaks_the_contract_is_rejected_not_scored():
    bad = heldout_batch(0, 0, 1.0)
    cand, cand_lp = np.array(bad.cand_ids), np.array(bad.cand_logprobs)
    cand[0, -1], cand_lp[0, -1] = -1, -np.inf  # a short candidate row
    short = replace(bad, cand_ids=cand, cand_logprobs=cand_lp)
    verdict = admission(encode_batch(short), 5, 3, groups=GroupLedger({}), settings=GateSettings(VOCAB, CFG))
    assert (verdict.action, verdict.rule) == (REJECT, "short_row")


def test_a_round_is_recorded_once_every_row_has_a_result_then_acked():
    recorded = []
    heldout = heldout_rounds(recorded)
    g, rec = gate_with(heldout)
    asyncio.run(heldout.schedule(rec, 2, version=1))
    assert [(s, orjson.loads(d)["purpose"]) for s, d, _ in rec.published] == [
        (names.PROMPTS_SUBJECT, "heldout"),
        (names.PROMPTS_SUBJECT, "heldout"),
    ]
    train = Msg(encode_batch(batch()), seq=10)
    first = Msg(encode_batch(heldout_batch(2, 0, 1.0, version=1)), seq=11)
    asyncio.run(g.admit(train, 3))
    asyncio.run(g.admit(first, 3))
    asyncio.run(g.evaluated())
    assert recorded == [] and rec.acked == []  # one row of two: held, unacked
    second = Msg(encode_batch(heldout_batch(2, 1, 0.0, version=2)), seq=12)
    asyncio.run(g.admit(second, 3))
    asyncio.run(g.evaluated())
    [record] = recorded
    assert {k: v for k, v in record.items() if k != "heldout_s"} == {
        "step": 2,
        "heldout_accuracy": 0.5,
        "heldout_rows": 2,
        "version": 1,
        "heldout_version_min": 1,
        "heldout_version_max": 2,
    }
    assert rec.acked == [first, second]  # acked once recorded
    assert list(g.held) == [batch().batch_id]  # only the training batch is held for the step
    assert g.take_counts() == {"accepted": 1}


def test_each_row_counts_once_and_a_closed_rounds_batches_are_dropped():
    recorded = []
    heldout = heldout_rounds(recorded, rows=ROWS[:1])
    g, rec = gate_with(heldout)
    asyncio.run(heldout.schedule(rec, 0, version=0))
    one = Msg(encode_batch(heldout_batch(0, 0, 1.0)), seq=3)
    again = Msg(encode_batch(heldout_batch(0, 0, 1.0)), seq=3)  # the same message redelivered while held
    other = Msg(encode_batch(heldout_batch(0, 0, 0.0, attempt=2)), seq=4)  # another attempt of the row
    asyncio.run(g.admit(one, 0))
    asyncio.run(g.admit(again, 0))
    asyncio.run(g.admit(other, 0))
    assert rec.acked == [other]  # dropped: its row has a result
    asyncio.run(g.evaluated())
    assert [r["heldout_accuracy"] for r in recorded] == [1.0]
    late = Msg(encode_batch(heldout_batch(0, 0, 0.0, attempt=3)), seq=5)
    asyncio.run(g.admit(late, 0))  # its round is recorded
    asyncio.run(heldout.schedule(rec, 0, version=0))  # a recorded round is never scheduled again
    asyncio.run(g.evaluated())
    assert len(recorded) == 1 and rec.acked == [other, one, late]
    assert g.take_counts() == {"dropped:heldout_duplicate": 1, "dropped:heldout_late": 1}


def test_a_heldout_batch_without_heldout_rounds_is_dropped_never_held():
    rec = Recorder()
    g = Gate(rec, rec, vocab_size=VOCAB, cfg=CFG, ledger={})
    msg = Msg(encode_batch(heldout_batch(0, 0, 1.0)), seq=3)
    asyncio.run(g.admit(msg, 3))
    assert g.held == {} and rec.acked == [msg]
    assert g.take_counts() == {"dropped:heldout_late": 1}


def test_a_round_short_of_rows_past_its_timeout_is_given_up_unrecorded(monkeypatch):
    recorded = []
    heldout = heldout_rounds(recorded)
    g, rec = gate_with(heldout)
    asyncio.run(heldout.schedule(rec, 0, version=0))
    msg = Msg(encode_batch(heldout_batch(0, 0, 1.0)), seq=3)
    asyncio.run(g.admit(msg, 0))
    heldout.rounds[0].started -= 61.0  # scheduled 61 s ago: past the 60 s timeout
    asyncio.run(g.evaluated())
    assert recorded == [] and heldout.rounds == {} and rec.acked == [msg]
    assert 0 in heldout.closed


def test_a_restarted_trainer_reopens_only_its_own_steps_round_never_an_older_one_with_new_weights(tmp_path):
    path = tmp_path / "heldout_metrics.jsonl"
    path.write_bytes(b'{"step": 0, "heldout_accuracy": 0.5}\n{"step": 2, "heldout_accuracy": 0.5}\n{"step": 4, "he')
    heldout, rec = heldout_rounds([]), Recorder()
    heldout.recorded(tmp_path)
    asyncio.run(heldout.reopen(rec, 5, version=5))
    # 0 and 2 recorded; 4's line was cut short by the crash, but weights of version 5 would sample it now
    assert heldout.rounds == {} and rec.published == [] and 4 in heldout.closed
    heldout2, rec2 = heldout_rounds([]), Recorder()
    heldout2.recorded(tmp_path)
    asyncio.run(heldout2.reopen(rec2, 6, version=6))  # restarted at a due step: that step's round, at its own weights
    assert sorted(heldout2.rounds) == [6] and heldout2.rounds[6].version == 6
    assert {orjson.loads(d)["task_id"] for _, d, _ in rec2.published} == {"r1/heldout/6/0", "r1/heldout/6/1"}
    assert [heldout.due(s, 5) for s in range(6)] == [True, False, True, False, True, True]


def test_a_run_of_an_earlier_release_has_its_eval_jsonl_rounds_closed_with_those_of_heldout_metrics(tmp_path):
    (tmp_path / "eval.jsonl").write_bytes(b'{"step": 0, "eval_accuracy": 0.5}\n{"step": 2, "eval_accuracy": 0.5}\n')
    (tmp_path / "heldout_metrics.jsonl").write_bytes(b'{"step": 4, "heldout_accuracy": 0.5}\n')
    heldout, rec = heldout_rounds([]), Recorder()
    heldout.recorded(tmp_path)
    assert heldout.closed == {0, 2, 4}
    asyncio.run(heldout.reopen(rec, 4, version=4))  # resumed at step 4, its round recorded already: not again
    assert heldout.rounds == {} and rec.published == []
