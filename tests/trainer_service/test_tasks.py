"""The trainer's task publisher: dataset lines to prompt tasks, deterministic by seed, bounded ahead."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from types import SimpleNamespace

import orjson
import pytest
from nats.js.api import PubAck

from shared import names
from shared.task import ATTEMPT_BLOCK, PromptTask, TaskError
from trainer_service.tasks import (
    AttemptBlocks,
    DatasetError,
    TaskPublisher,
    attempts_base,
    load_dataset,
    times_republished,
)


class Recorder:
    """Stands in for JetStream: keeps what is published, answers as its duplicate window would."""

    def __init__(self):
        self.sent = []

    async def publish(self, subject, data, headers=None, timeout=None):
        duplicate = any(h == headers for _, _, h in self.sent) or None
        if not duplicate:
            self.sent.append((subject, PromptTask.from_bytes(data), headers))
        return PubAck(stream=names.PROMPTS_STREAM, seq=len(self.sent), duplicate=duplicate)


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"id": f"t/{i}", "prompt": f"rev w{i}=", "answer": f"{i}w", "reward": "exact", "task": "reverse"}
        for i in range(5)
    ]
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n\n")
    return path


def publisher(dataset, seed=0, next_step=0) -> TaskPublisher:
    """A trainer's publisher; each one made for the same dataset is a later start of the same run."""
    blocks = AttemptBlocks(dataset.with_name("attempt_blocks"))
    return TaskPublisher(
        load_dataset(dataset), run_id="r1", seed=seed, prompts_per_step=3, n=4, blocks=blocks, next_step=next_step
    )


def test_extra_keys_go_to_meta_and_ids_name_run_step_index(dataset):
    tasks = publisher(dataset).tasks(2)
    assert [t.task_id for t in tasks] == ["r1/2/0", "r1/2/1", "r1/2/2"]
    assert all(t.group_id == t.task_id and t.n == 4 and t.step == 2 and t.reward == "exact" for t in tasks)
    assert all(t.meta == {"id": t.meta["id"], "task": "reverse"} for t in tasks)


def test_order_is_a_function_of_seed_and_step_covering_each_epoch(dataset):
    a, b, c = publisher(dataset, seed=0), publisher(dataset, seed=0), publisher(dataset, seed=1)
    first = [t.meta["id"] for s in range(5) for t in a.tasks(s)]  # 15 positions = 3 epochs of 5
    assert first == [t.meta["id"] for s in range(5) for t in b.tasks(s)]
    assert first != [t.meta["id"] for s in range(5) for t in c.tasks(s)]
    for epoch in range(3):
        assert sorted(first[5 * epoch : 5 * epoch + 5]) == [f"t/{i}" for i in range(5)]


def test_publishes_at_most_inflight_steps_ahead_with_task_id_as_msg_id(dataset):
    d, js = publisher(dataset), Recorder()
    assert asyncio.run(d.publish_until(js, trained_steps=0, inflight=2, last_step=10)) == 6
    assert asyncio.run(d.publish_until(js, trained_steps=0, inflight=2, last_step=10)) == 0
    assert asyncio.run(d.publish_until(js, trained_steps=1, inflight=2, last_step=10)) == 3
    assert asyncio.run(d.publish_until(js, trained_steps=9, inflight=2, last_step=4)) == 3  # never past the last step
    assert d.next_step == 4
    assert all(
        subject == names.PROMPTS_SUBJECT and headers == {names.MSG_ID_HEADER: t.task_id}
        for subject, t, headers in js.sent
    )
    assert [t.step for _, t, _ in js.sent] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_a_line_naming_an_environment_makes_its_tasks_sessions(tmp_path):
    path = tmp_path / "d.jsonl"
    row = {"prompt": "p", "answer": "a", "reward": "exact", "environment": "envs:chat", "level": 2}
    path.write_bytes(orjson.dumps(row) + b"\n" + orjson.dumps({**row, "environment": 3}) + b"\n")
    with pytest.raises(DatasetError, match=r"d.jsonl:2: field 'environment' is 3, expected 'module:function'"):
        load_dataset(path)
    path.write_bytes(orjson.dumps(row) + b"\n")
    blocks = AttemptBlocks(tmp_path / "attempt_blocks")
    (task,) = TaskPublisher(load_dataset(path), run_id="r", seed=0, prompts_per_step=1, n=2, blocks=blocks).tasks(0)
    assert (task.environment, task.meta) == ("envs:chat", {"level": 2})
    assert PromptTask.from_bytes(task.to_bytes()) == task


def test_a_line_without_a_required_field_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"prompt": "a", "answer": "b", "reward": "exact"}\n{"prompt": "a", "answer": 3, "reward": "exact"}\n'
    )
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: field 'answer' is 3"):
        load_dataset(path)


def test_a_stale_batch_has_its_task_published_again_in_a_block_of_its_own_once(dataset):
    pub, js = publisher(dataset), Recorder()
    stale = SimpleNamespace(batch_id="r1/4/2#3", task_id="r1/4/2", attempt=3)
    assert asyncio.run(pub.resample(js, stale)) is True
    [(subject, task, headers)] = js.sent
    assert subject == names.PROMPTS_SUBJECT and headers == {names.MSG_ID_HEADER: "r1/4/2/after-3"}
    # block 1 (block 0 is this start's), published again once: attempts 11001 on
    assert task == replace(pub.tasks(4)[2], attempts_before=11000) and task.attempt(1) == 11001
    assert times_republished(task.attempt(1)) == 1
    assert pub.next_step == 0  # the data cursor does not move
    # the stale part again (its ack was lost): not published twice, no block taken
    assert asyncio.run(pub.resample(js, stale)) is False and len(js.sent) == 1
    # a later start finds it stored already (the crash came before the stale part's ack): not counted again
    assert asyncio.run(publisher(dataset).resample(js, stale)) is False and len(js.sent) == 1


def test_every_publication_of_a_task_samples_under_attempt_numbers_of_its_own(dataset):
    """Two starts of one run (the second before any checkpoint, past the duplicate window) and a
    task of each published again: no two of them share an attempt number, whatever their deliveries."""
    first, js = publisher(dataset), Recorder()
    asyncio.run(first.publish_next(js))
    stale = SimpleNamespace(batch_id="r1/0/1", task_id="r1/0/1", attempt=1)
    asyncio.run(first.resample(js, stale))
    second = publisher(dataset)  # restarted: the same tasks, the next block
    js_again = Recorder()  # past the duplicate window
    asyncio.run(second.publish_next(js_again))
    again = SimpleNamespace(batch_id="r1/0/1#11001", task_id="r1/0/1", attempt=11001)
    asyncio.run(second.resample(js_again, again))
    copies = [t for _, t, _ in js.sent + js_again.sent if t.task_id == "r1/0/1"]
    assert [t.attempts_before for t in copies] == [0, 11000, 20000, 32000]
    numbers = [{t.attempt(d) for d in range(1, ATTEMPT_BLOCK)} for t in copies]
    assert all(a.isdisjoint(b) for a, b in itertools.combinations(numbers, 2))
    assert [times_republished(t.attempt(1)) for t in copies] == [0, 1, 0, 2]
    assert AttemptBlocks(dataset.with_name("attempt_blocks")).next == 4


def test_a_delivery_past_the_numbers_its_publication_reserved_is_refused():
    task = PromptTask("r/0/0", "r/0/0", "p", "a", "exact", n=2, step=0, attempts_before=attempts_base(3, 1))
    assert (task.attempt(1), task.attempt(ATTEMPT_BLOCK - 1)) == (31001, 31999)
    with pytest.raises(TaskError, match=r"delivery 1000 of task 'r/0/0' is past the 999 its publication reserved"):
        task.attempt(ATTEMPT_BLOCK)


@pytest.mark.parametrize("task_id", ["r2/4/2", "r1/4/3", "r1/4", "r1/x/0", "batch/r1/4/2"])
def test_a_task_of_another_run_or_out_of_range_is_not_published_again(dataset, task_id):
    pub, js = publisher(dataset), Recorder()
    assert pub.task(task_id) is None
    assert asyncio.run(pub.resample(js, SimpleNamespace(batch_id=task_id, task_id=task_id, attempt=1))) is False
    assert js.sent == []
