"""Datasets as users keep them (centerline/up/dataset_files.py, user_task.py): parquet, CSV, a
save_to_disk directory, read with the datasets library; columns renamed by settings; chat rows
(a system prompt, several turns) rendered by the model's chat template; a bad row named by file,
row, field and fix before anything starts."""

from __future__ import annotations

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from centerline.up.user_task import Keys, Row, UserTaskError, chat_template_on, load_rows, load_task
from centerline.up.user_task import write_trainer_dataset as write_trainer
from rollout_worker.main import load_tokenizer
from rollout_worker.worker import Tokenizer, Worker
from shared.config import Config
from shared.settings import WorkerSettings
from tests.centerline.up.test_user_task import up_watched
from tests.processes import REPO
from trainer_service.tasks import load_dataset

CHAT = [
    {"role": "system", "content": "Answer with one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris"},
    {"role": "user", "content": "And of Italy?"},
]


def parquet(path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_a_parquet_file_with_chat_rows_is_read_with_its_messages_and_meta(tmp_path):
    path = parquet(
        tmp_path / "chat.parquet",
        [
            {"messages": CHAT, "answer": "Rome", "source": "capitals", "split": None},
            {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4", "source": None, "split": "eval"},
        ],
    )
    task = load_task(path, None)
    assert task.train == [Row("And of Italy?", "Rome", {"source": "capitals"}, messages=tuple(CHAT))]
    assert task.heldout == [Row("2+2?", "4", {}, "eval", messages=({"role": "user", "content": "2+2?"},))]
    out = tmp_path / "train.jsonl"
    write_trainer(task.train, "exact", out)
    (example,) = load_dataset(out)  # the trainer's reader: the messages reach the task's meta
    assert (example.prompt, example.answer, example.meta) == (
        "And of Italy?",
        "Rome",
        {"source": "capitals", "messages": CHAT},
    )


def test_chat_rows_are_rendered_by_the_models_chat_template_for_every_endpoint(model_dir):
    tokenizer, hf = load_tokenizer(str(model_dir))  # the worker's own tokenizer
    expected = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert "Answer with one word." in expected and "Paris" in expected  # the system prompt and every turn
    assert tokenizer.encode_chat(CHAT) == list(hf(expected, add_special_tokens=False)["input_ids"])
    from shared.task import PromptTask

    task = PromptTask("t/0/0", "g", "And of Italy?", "Rome", "exact", 2, 0, meta={"messages": CHAT})
    worker = Worker(
        Config(rollout_endpoint="chat"), WorkerSettings(worker_id="w", vocab_size=260), Tokenizer(None, None)
    )
    assert worker.request_body(task, [1])["messages"] == CHAT


def test_columns_are_renamed_by_the_settings_and_a_csv_number_answer_is_its_text(tmp_path):
    path = tmp_path / "gsm.csv"
    path.write_text("question,solution,level\nWhat is 2+3?,5,easy\nWhat is 7+1?,8,hard\n")
    rows = load_rows(path, Keys(prompt="question", answer="solution"))
    assert rows == [Row("What is 2+3?", "5", {"level": "easy"}), Row("What is 7+1?", "8", {"level": "hard"})]
    with pytest.raises(UserTaskError) as err:
        load_rows(path)
    assert str(err.value) == (
        f"{path} row 0: field 'prompt' is None, expected a string (every row needs 'prompt' or 'messages', and "
        "'answer'; --dataset-prompt-key names another column)"
    )


def test_a_save_to_disk_dataset_dict_trains_on_train_and_holds_out_test(tmp_path):
    data = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}], "answer": "a"}]),
            "test": datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "yo"}], "answer": "b"}]),
        }
    )
    data.save_to_disk(str(tmp_path / "dd"))
    task = load_task(tmp_path / "dd", None)
    assert task.train == [Row("hi", "a", messages=({"role": "user", "content": "hi"},))]  # TRL's conversational form
    assert task.heldout == [Row("yo", "b", messages=({"role": "user", "content": "yo"},))]
    assert task.heldout_source == f"the held-out split of {tmp_path / 'dd'} (test or validation, the first there)"
    datasets.Dataset.from_list([{"prompt": "p", "answer": "a"}]).save_to_disk(str(tmp_path / "one"))
    assert load_rows(tmp_path / "one") == [Row("p", "a")]
    datasets.DatasetDict({"dev": data["train"]}).save_to_disk(str(tmp_path / "nodev"))
    with pytest.raises(UserTaskError, match=r"a DatasetDict with splits \['dev'\] and no 'train'; name the split"):
        load_rows(tmp_path / "nodev")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserTaskError, match="a directory, but no datasets save_to_disk output"):
        load_rows(tmp_path / "empty")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "a"},
            "row 1: field 'messages' ends with a message of role 'assistant'; the model answers the last message",
        ),
        (
            {"messages": [{"role": "robot", "content": "q"}], "answer": "a"},
            "row 1: field 'messages'[0] has role 'robot'; give a list of {'role': 'system' | 'user'",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}], "prompt": "q", "answer": "a"},
            "row 1: the row has both 'prompt' and 'messages'; keep one",
        ),
    ],
)
def test_a_bad_chat_row_names_the_file_row_field_and_fix(tmp_path, row, message):
    good = {"messages": [{"role": "user", "content": "ok"}], "prompt": None, "answer": "a"}  # Arrow: every column
    path = parquet(tmp_path / "d.parquet", [good, row])
    with pytest.raises(UserTaskError) as err:
        load_rows(path)
    assert f"{path} {message}" in str(err.value)


def test_a_file_datasets_cannot_read_is_named_with_the_fix(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(UserTaskError, match=rf"dataset {bad}: the datasets library cannot read it as parquet .*; give"):
        load_rows(bad)


def test_chat_rows_need_a_chat_template(model_dir):
    assert chat_template_on("auto", model_dir, toy=False, chat_rows="d.parquet") is True
    with pytest.raises(UserTaskError, match="--chat-template off: rows of d.parquet hold messages"):
        chat_template_on("off", model_dir, toy=False, chat_rows="d.parquet")


def test_up_stops_at_a_bad_parquet_chat_row_before_starting_anything(tmp_path):
    data = parquet(
        tmp_path / "d.parquet",
        [
            {"messages": CHAT, "answer": "Rome"},
            {"messages": [*CHAT, {"role": "assistant", "content": "x"}], "answer": "a"},
        ],
    )
    run, started = up_watched(["--dataset", data, "--model", str(tmp_path), "--run-dir", str(tmp_path / "run")], REPO)
    assert run.returncode == 1
    assert f"centerline up: {data} row 1: field 'messages' ends with a message of role 'assistant'" in run.stderr
    assert started == []  # no process (NATS, SGLang, a service, init-model) and no port


ASYNC_REWARD = '''
import asyncio


async def judge(text, task):
    """An async reward of a user's own: awaited by the worker."""
    await asyncio.sleep(0)
    return float(len(task.meta["messages"])) + (1.0 if task.answer in text else 0.0)
'''


@pytest.mark.integration
@pytest.mark.slow
def test_up_trains_a_parquet_of_chat_rows_with_an_async_reward_of_ones_own(tmp_path, toy_models):
    import subprocess
    import sys

    import orjson

    from tests.processes import ENV

    (tmp_path / "myreward.py").write_text(ASYNC_REWARD)
    data = parquet(
        tmp_path / "chat.parquet",
        [{"messages": CHAT, "answer": "Rome", "split": "train"}] * 3
        + [{"messages": CHAT[:2], "answer": "Paris", "split": "eval"}],
    )
    run_dir = tmp_path / "run"
    flags = ["--dataset", data, "--reward", "myreward:judge", "--steps", "2", "--workers", "1", "--trainer-ranks", "1"]
    flags += ["--prompts-per-step", "2", "--rollout-n", "2", "--heldout-every", "2", "--model-dir", str(toy_models)]
    up = subprocess.run(
        [sys.executable, "-m", "centerline", "up", *flags, "--run-dir", str(run_dir)],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert up.returncode == 0, up.stderr[-4000:]
    rows = [orjson.loads(line) for line in (run_dir / "train.jsonl").read_bytes().splitlines()]
    assert [(r["prompt"], r["messages"], r["reward"]) for r in rows] == [("And of Italy?", CHAT, "myreward:judge")] * 3
    steps = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["gate_rejected"] == {} for s in steps)
    assert all(4.0 <= s["reward_mean"] <= 5.0 for s in steps)  # four messages: the async reward's 4, +1 if right
    evals = [orjson.loads(line) for line in (run_dir / "heldout_metrics.jsonl").read_bytes().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and all(2.0 <= e["heldout_reward"] <= 3.0 for e in evals)
