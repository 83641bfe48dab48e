"""The trainer's task publisher: dataset lines to prompt tasks, deterministic by seed, bounded ahead."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import orjson
import pytest

from shared import names
from shared.task import PromptTask
from trainer_service.tasks import DatasetError, TaskPublisher, load_dataset


class Recorder:
    def __init__(self):
        self.sent = []

    async def publish(self, subject, data, headers=None, timeout=None):
        self.sent.append((subject, PromptTask.from_bytes(data), headers))


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
    return TaskPublisher(load_dataset(dataset), run_id="r1", seed=seed, prompts_per_step=3, n=4, next_step=next_step)


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
    (task,) = TaskPublisher(load_dataset(path), run_id="r", seed=0, prompts_per_step=1, n=2).tasks(0)
    assert (task.environment, task.meta) == ("envs:chat", {"level": 2})
    assert PromptTask.from_bytes(task.to_bytes()) == task


def test_a_line_without_a_required_field_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"prompt": "a", "answer": "b", "reward": "exact"}\n{"prompt": "a", "answer": 3, "reward": "exact"}\n'
    )
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: field 'answer' is 3"):
        load_dataset(path)


def test_a_stale_batch_has_its_task_published_again_numbered_after_its_attempt(dataset):
    pub, js = publisher(dataset), Recorder()
    stale = SimpleNamespace(batch_id="r1/4/2#3", task_id="r1/4/2", attempt=3)
    assert asyncio.run(pub.resample(js, stale)) is True
    [(subject, task, headers)] = js.sent
    assert subject == names.PROMPTS_SUBJECT and headers == {names.MSG_ID_HEADER: "r1/4/2/after-3"}
    assert task == replace(pub.tasks(4)[2], attempts_before=3)
    assert pub.next_step == 0  # the data cursor does not move


@pytest.mark.parametrize("task_id", ["r2/4/2", "r1/4/3", "r1/4", "r1/x/0", "batch/r1/4/2"])
def test_a_task_of_another_run_or_out_of_range_is_not_published_again(dataset, task_id):
    pub, js = publisher(dataset), Recorder()
    assert pub.task(task_id) is None
    assert asyncio.run(pub.resample(js, SimpleNamespace(batch_id=task_id, task_id=task_id, attempt=1))) is False
    assert js.sent == []
