"""A user's own task for `centerline up`: dataset rows, held-out rows, reward and chat template, each
bad input refused at start-up with the file, line, field and fix."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import orjson
import pytest

from centerline.up.user_task import (
    Row,
    UserTaskError,
    chat_template_on,
    check_environment,
    check_reward,
    load_rows,
    load_task,
    write_trainer_dataset,
)
from tests.processes import ENV, REPO
from trainer_service.tasks import load_dataset


def write(path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# `centerline up` run with an audit hook (PEP 578) that records every process start and socket
# it binds or connects: a start-up refusal must come before any of them.
WATCHED_UP = """
import json, runpy, sys
started = []
STARTS = {"subprocess.Popen", "os.posix_spawn", "os.exec", "os.fork", "os.system", "socket.bind", "socket.connect"}
def watch(event, args):
    if event in STARTS:
        started.append(f"{event} {args!r:.200}")
sys.addaudithook(watch)
sys.argv = ["centerline", "up", *json.loads(sys.argv[1])]
try:
    runpy.run_module("centerline", run_name="__main__", alter_sys=True)
finally:
    print("STARTED " + json.dumps(started), file=sys.stderr)
"""


def up_watched(flags: list[str], cwd) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`centerline up FLAGS` in ``cwd``: the finished process and every start or socket it made."""
    run = subprocess.run(
        [sys.executable, "-c", WATCHED_UP, json.dumps(flags)],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    *_, last = run.stderr.splitlines() or [""]
    assert last.startswith("STARTED "), run.stderr[-2000:]
    return run, json.loads(last.removeprefix("STARTED "))


def test_rows_keep_prompt_answer_meta_and_split_and_other_keys_join_meta(tmp_path):
    path = write(
        tmp_path / "d.jsonl",
        {"prompt": "2+3?", "answer": "5"},
        "",
        {"prompt": "7+1?", "answer": "8", "meta": {"source": "drill"}, "split": "eval", "id": 7},
    )
    assert load_rows(path) == [Row("2+3?", "5"), Row("7+1?", "8", {"source": "drill", "id": 7}, "eval")]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "d.jsonl:2: not JSON"),
        ('["a"]', "d.jsonl:2: a row is list, expected a JSON object with prompt and answer"),
        ('{"prompt": "p"}', "d.jsonl:2: field 'answer' is None, expected a string"),
        ('{"prompt": 3, "answer": "a"}', "d.jsonl:2: field 'prompt' is 3, expected a string"),
        ('{"prompt": "", "answer": "a"}', "d.jsonl:2: field 'prompt' is empty; give the text the model answers"),
        ('{"promt": "p", "answer": "a"}', "d.jsonl:2: field 'prompt' is None, expected a string"),
        (
            '{"prompt": "p", "answer": "a", "reward": "exact"}',
            "d.jsonl:2: field 'reward' is 'exact'; --reward scores every row, drop the field",
        ),
        ('{"prompt": "p", "answer": "a", "meta": [1]}', "d.jsonl:2: field 'meta' is [1], expected a JSON object"),
        (
            '{"prompt": "p", "answer": "a", "meta": {"answer": "x"}}',
            "d.jsonl:2: meta holds 'answer', also a field of the row; rename it in meta",
        ),
        (
            '{"prompt": "p", "answer": "a", "id": 1, "meta": {"id": 2}}',
            "d.jsonl:2: meta holds 'id', also a field of the row; rename it in meta",
        ),
        (
            '{"prompt": "p", "answer": "a", "split": "test"}',
            "d.jsonl:2: field 'split' is 'test', expected 'train' or 'heldout'",
        ),
    ],
)
def test_a_bad_row_names_the_file_line_field_and_fix(tmp_path, line, message):
    path = write(tmp_path / "d.jsonl", {"prompt": "p", "answer": "a"}, line)
    with pytest.raises(UserTaskError) as err:
        load_rows(path)
    assert message in str(err.value)


def test_an_empty_or_missing_dataset_is_refused(tmp_path):
    with pytest.raises(UserTaskError, match="holds no rows; write one JSON object per line"):
        load_rows(write(tmp_path / "empty.jsonl", ""))
    with pytest.raises(UserTaskError, match=r"dataset .*nothing.jsonl: cannot be read \(No such file or directory\)"):
        load_rows(tmp_path / "nothing.jsonl")


def test_held_out_rows_are_the_heldout_dataset_else_the_marked_rows_else_none(tmp_path):
    plain = write(tmp_path / "plain.jsonl", {"prompt": "a", "answer": "1"})
    marked = write(
        tmp_path / "marked.jsonl",
        {"prompt": "a", "answer": "1"},
        {"prompt": "b", "answer": "2", "split": "heldout"},
        {"prompt": "d", "answer": "4", "split": "eval"},  # the older word, read the same
    )
    other = write(tmp_path / "other.jsonl", {"prompt": "c", "answer": "3", "split": "train"})
    task = load_task(marked, None)
    assert (task.train, task.heldout) == (
        [Row("a", "1")],
        [Row("b", "2", split="heldout"), Row("d", "4", split="eval")],
    )
    assert task.heldout_source == f'the rows of {marked} marked "split": "heldout" (or "eval")'
    task = load_task(marked, other)
    assert (task.train, task.heldout) == ([Row("a", "1")], [Row("c", "3")])  # the marked row is never trained on
    assert task.heldout_source == f"every row of --heldout-dataset {other}"
    task = load_task(plain, None)
    assert task.heldout == []
    assert (
        task.heldout_source
        == f'none: {plain} marks no row "split": "heldout" (or "eval") and --heldout-dataset is unset'
    )
    only_heldout = write(tmp_path / "only.jsonl", {"prompt": "a", "answer": "1", "split": "heldout"})
    with pytest.raises(UserTaskError, match="every row is marked split 'heldout'; leave some rows to train on"):
        load_task(only_heldout, None)


def test_the_trainer_reads_the_training_rows_with_the_reward_and_meta(tmp_path):
    out = tmp_path / "train.jsonl"
    write_trainer_dataset([Row("a", "1", {"source": "drill"}), Row("b", "2")], "tests.rewards:f", out)
    examples = load_dataset(out)
    assert [(e.prompt, e.answer, e.reward, e.meta) for e in examples] == [
        ("a", "1", "tests.rewards:f", {"source": "drill"}),
        ("b", "2", "tests.rewards:f", {}),
    ]


def test_a_reward_that_cannot_be_imported_is_refused_by_name():
    assert check_reward("tests.real_model.rewards:contains_answer") == "tests.real_model.rewards:contains_answer"
    assert check_reward(["exact=1", "tests.real_model.rewards:contains_answer=0.5"]) == (
        "exact=1,tests.real_model.rewards:contains_answer=0.5"
    )
    with pytest.raises(UserTaskError, match=r"--reward nowhere_module:f: reward 'nowhere_module:f' cannot be loaded"):
        check_reward("nowhere_module:f")


def test_up_refuses_a_reward_that_is_neither_built_in_nor_module_function():
    run = subprocess.run(
        [sys.executable, "-m", "centerline", "up", "--reward", "exactly"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "centerline up: --reward exactly: a built-in (exact, prefix) or module:function" in run.stderr


def test_up_stops_at_a_bad_row_before_starting_anything(tmp_path):
    data = write(tmp_path / "d.jsonl", {"prompt": "p", "answer": "a"}, {"prompt": "p", "answer": 5})
    run, started = up_watched(["--dataset", data, "--model", str(tmp_path), "--run-dir", str(tmp_path / "run")], REPO)
    assert run.returncode == 1
    assert f"centerline up: {data}:2: field 'answer' is 5, expected a string" in run.stderr
    assert started == []  # no process (NATS, SGLang, a service, init-model) and no port
    assert list((tmp_path / "run" / "logs").iterdir()) == []  # no service log


def test_the_chat_template_is_auto_on_for_a_user_model_and_off_for_the_toy(model_dir, tmp_path):
    assert chat_template_on("auto", model_dir, toy=False) is True  # the byte-level tokenizer has one
    assert chat_template_on("auto", model_dir, toy=True) is False
    assert chat_template_on("off", model_dir, toy=False) is False
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    config = orjson.loads((bare / "tokenizer_config.json").read_bytes())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_bytes(orjson.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    assert chat_template_on("auto", bare, toy=False) is False
    with pytest.raises(UserTaskError, match=f"--chat-template on: the tokenizer of {bare} has no chat template"):
        chat_template_on("on", bare, toy=False)


def test_a_row_names_its_environment_and_the_runs_environment_is_the_default_of_the_others(tmp_path):
    path = write(
        tmp_path / "d.jsonl", {"prompt": "a", "answer": "1", "environment": "m:own"}, {"prompt": "b", "answer": "2"}
    )
    rows = load_rows(path)
    assert [r.environment for r in rows] == ["m:own", ""] and rows[0].meta == {}
    out = tmp_path / "train.jsonl"
    write_trainer_dataset(rows, "exact", out, environment="m:default")
    assert [e.environment for e in load_dataset(out)] == ["m:own", "m:default"]
    write_trainer_dataset(rows, "exact", out)
    assert [e.environment for e in load_dataset(out)] == ["m:own", ""]
    bad = write(tmp_path / "e.jsonl", {"prompt": "a", "answer": "1", "environment": 3})
    with pytest.raises(
        UserTaskError, match=rf"^{bad}:1: field 'environment' is 3, expected a string 'module:function'"
    ):
        load_rows(bad)


ENVIRONMENT_MODULE = """
async def play(client, task):
    return 1.0

def plain(client, task):
    return 1.0

raise_on_import = None
"""


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "mymod:plain",
            r"--environment mymod:plain: environment 'mymod:plain' is not an async function: write "
            r"`async def plain\(client, task\) -> float`",
        ),
        (
            "mymod:nothing",
            r"--environment mymod:nothing: environment 'mymod:nothing' cannot be loaded: "
            r"AttributeError: .*'nothing'.*; is the module on the worker's PYTHONPATH "
            r"\(the directory `centerline up` runs in\)\?",
        ),
        (
            "nomod:play",
            r"--environment nomod:play: environment 'nomod:play' cannot be loaded: "
            r"ModuleNotFoundError: No module named 'nomod'",
        ),
        ("play", r"--environment play: environment 'play' is neither a built-in \(calc, chain\) nor 'module:function'"),
    ],
)
def test_an_environment_that_is_not_an_importable_async_function_is_refused_by_name(
    tmp_path, monkeypatch, name, message
):
    (tmp_path / "mymod.py").write_text(ENVIRONMENT_MODULE)
    monkeypatch.chdir(tmp_path)  # imported from the directory up runs in, as the workers import it
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check_environment("mymod:play").__name__ == "play"
    assert check_environment("chain").__name__ == "chain"  # the built-in
    with pytest.raises(UserTaskError, match=message):
        check_environment(name)


def test_up_stops_at_an_environment_that_is_not_async_before_starting_anything(tmp_path):
    (tmp_path / "mymod.py").write_text(ENVIRONMENT_MODULE)
    run, started = up_watched(["--environment", "mymod:plain", "--run-dir", str(tmp_path / "run")], tmp_path)
    assert run.returncode == 1
    assert "centerline up: --environment mymod:plain: environment 'mymod:plain' is not an async function" in run.stderr
    assert started == []  # no process and no port
    assert list((tmp_path / "run" / "logs").iterdir()) == []  # no service log


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--environment", "nocolon"],
            "--environment nocolon: a built-in (calc, chain) or module:function, e.g. mymodule:play",
        ),
        (
            ["--environment", "chain"],
            "--environment chain: the built-in environment plays the toy task chain, not "
            "--task upper; add --task chain",
        ),
    ],
)
def test_up_refuses_an_environment_it_cannot_run_naming_the_flag_and_the_fix(tmp_path, flags, message):
    run = subprocess.run(
        [sys.executable, "-m", "centerline", "up", *flags, "--run-dir", str(tmp_path / "run")],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode in (1, 2) and f"centerline up: {message}" in run.stderr, run.stderr
