"""Toy tasks, `centerline dataset`, and the SFT warm start's cache."""

from __future__ import annotations

import json
import re

import orjson
import pytest

from centerline.toy.dataset import TASKS, examples, is_heldout
from centerline.toy.dataset import main as dataset_main
from shared.task import PromptTask


def solve(prompt: str) -> str:
    """An independent reading of each prompt format."""
    if re.fullmatch(r"\d\+\d( \+\d){1,3}", prompt):  # chain: the running sums
        total, sums = 0, []
        for word in prompt.split():
            total = (total + sum(int(x) for x in word.split("+") if x)) % 10
            sums.append(str(total))
        return " ".join(sums)
    if summands := re.fullmatch(r"(\d{1,3})\+(\d{1,3})=", prompt):  # calc
        return str(int(summands[1]) + int(summands[2]))
    op, arg = re.fullmatch(r"(\w+) (.+)=", prompt).groups()
    if op == "add":
        a, b = arg.split("+")
        return str(int(a) + int(b))
    return {"rev": arg[::-1], "copy": arg, "up": arg.upper()}[op]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_toy_example_answers_its_prompt(task):
    for prompt, answer in examples(task, 200, seed=3):
        assert solve(prompt) == answer
        assert prompt.isascii() and 1 <= len(answer) <= (11 if task == "chain" else 5)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_train_and_heldout_splits_are_deterministic_and_disjoint(task):
    train, held = examples(task, 300, seed=0), examples(task, 100, seed=0, split="heldout")
    assert train == examples(task, 300, seed=0) and train != examples(task, 300, seed=1)
    assert all(is_heldout(p) for p, _ in held) and not any(is_heldout(p) for p, _ in train)
    assert not {p for p, _ in train} & {p for p, _ in held}


def test_dataset_command_writes_jsonl_rows_the_trainer_can_turn_into_tasks(tmp_path):
    out = tmp_path / "d.jsonl"
    assert dataset_main(["--task", "reverse", "--n", "5", "--seed", "2", "--out", str(out), "--split", "heldout"]) == 0
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(rows) == 5 and rows[0]["id"] == "reverse/heldout/2/0"
    assert [(r["prompt"], r["answer"]) for r in rows] == examples("reverse", 5, 2, "heldout")
    assert {r["reward"] for r in rows} == {"exact"} and {r["split"] for r in rows} == {"heldout"}
    task = PromptTask(
        task_id="run/0/0",
        group_id="g",
        prompt=rows[0]["prompt"],
        answer=rows[0]["answer"],
        reward=rows[0]["reward"],
        n=4,
        step=0,
    )
    assert PromptTask.from_bytes(task.to_bytes()) == task
    again = tmp_path / "e.jsonl"
    dataset_main(["--task", "reverse", "--n", "5", "--seed", "2", "--out", str(again), "--split", "heldout"])
    assert again.read_bytes() == out.read_bytes()


def test_init_model_sft_is_cached_by_its_settings(tmp_path, capsys):
    from centerline.toy.model_init import SETTINGS_FILE
    from centerline.toy.model_init import main as init_main

    out = tmp_path / "m"
    flags = ["--out", str(out), "--sft", "--task", "copy", "--sft-steps", "3"]
    assert init_main(flags) == 0
    weights = (out / "model.safetensors").read_bytes()
    assert json.loads((out / SETTINGS_FILE).read_text())["sft"]["steps"] == 3
    capsys.readouterr()
    # a model made by an older release: its weights are kept, its tokenizer files made anew
    config = out / "tokenizer_config.json"
    config.write_text(config.read_text().replace("<tool_call>", "<old>"))
    assert init_main(flags) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert (out / "model.safetensors").read_bytes() == weights
    assert "<tool_call>" in config.read_text() and "<old>" not in config.read_text()
    assert init_main(["--out", str(out), "--sft", "--task", "copy", "--sft-steps", "4"]) == 0
    assert (out / "model.safetensors").read_bytes() != weights
    assert init_main(flags) == 0  # back to 3 steps: the same bytes as the first time (deterministic)
    assert (out / "model.safetensors").read_bytes() == weights


def test_sft_lowers_the_answer_loss():
    from centerline.toy.model_init import build_model
    from centerline.toy.sft import SftSettings, train

    losses = train(build_model(0), SftSettings(task="upper", steps=30), seed=0)
    assert losses[-1] < 0.6 * losses[0]


def test_chain_has_two_to_four_steps_each_restated_with_the_true_sum():
    from shared.toy_tasks import chain_turns

    assert chain_turns("3+4 +5 +2", "7 2 4") == [("3+4", "3+4", "7"), ("+5", "7+5", "2"), ("+2", "2+2", "4")]
    assert {len(p.split()) for p, _ in examples("chain", 300, seed=0)} == {2, 3, 4}
    with pytest.raises(
        ValueError, match=r"a chain task's prompt 'up abc=' and answer 'ABC' must have one word per step"
    ):
        chain_turns("up abc=", "ABC")


def test_the_dataset_command_names_the_environment_in_each_row(tmp_path):
    out = tmp_path / "c.jsonl"
    assert dataset_main(["--task", "chain", "--n", "3", "--environment", "chain", "--out", str(out)]) == 0
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["environment"] for r in rows] == ["chain"] * 3
    dataset_main(["--task", "copy", "--n", "3", "--out", str(out)])
    assert not any("environment" in orjson.loads(line) for line in out.read_bytes().splitlines())


def test_the_chat_warm_start_trains_on_the_replies_of_the_template_rendered_conversation(tmp_path):
    """A chain example is the conversation exactly as the chat template renders it (what a session
    holds), labels on each reply and its <|im_end|> only; a later message is sometimes restated."""
    import random

    from transformers import AutoTokenizer

    from centerline.toy.sft import IM_END_ID
    from centerline.toy.sft import chain_conversation as conversation
    from centerline.toy.tokenizer import save_tokenizer

    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    rng = random.Random(1)
    seen = set()
    for _ in range(20):
        ids, labels = conversation("3+4 +5 +2", "7 2 4", rng)
        users = tok.decode(ids).split("<|im_start|>user\n")[1:]
        users = [u.split("<|im_end|>")[0] for u in users]
        seen.add(tuple(users))
        messages = []
        for user, want in zip(users, ["7", "2", "4"]):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": want}]
        rendered = tok.apply_chat_template(messages, tokenize=False)
        assert tok.decode(ids) == rendered.removesuffix("\n")  # the session holds no "\n" after the last reply
        trained = [i for i, label in zip(ids, labels) if label != -100]
        assert trained == [*b"7", IM_END_ID, *b"2", IM_END_ID, *b"4", IM_END_ID]
        assert all(label in (-100, i) for i, label in zip(ids, labels))
    assert {users[0] for users in seen} == {"3+4"}
    assert {users[1] for users in seen} == {"+5", "7+5"} and {users[2] for users in seen} == {"+2", "2+2"}


def test_the_calc_warm_start_trains_on_the_call_and_the_answer_of_the_template_rendered_session(tmp_path):
    """A calc example is the session as the saved tokenizer's template renders it with the add tool
    offered, the call in the form SGLang's hermes parser parses back to the prompt's numbers; labels on
    the call and the answer (each with its <|im_end|>) only."""
    import random

    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from transformers import AutoTokenizer

    from centerline.toy.sft import IM_END_ID, calc_conversation
    from centerline.toy.tokenizer import save_tokenizer
    from shared.toy_tasks import ADD_TOOL

    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids, labels = calc_conversation("7+905=", "912", random.Random(0))
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 7, "b": 905}}}
    messages = [
        {"role": "user", "content": "7+905="},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "912"},
        {"role": "assistant", "content": "912"},
    ]
    rendered = tok.apply_chat_template(messages, tools=[ADD_TOOL], tokenize=False)
    assert tok.decode(ids) == rendered.removesuffix("\n")
    trained = [i for i, label in zip(ids, labels) if label != -100]
    cut = trained.index(IM_END_ID)
    assert trained[cut + 1 :] == [*b"912", IM_END_ID] and trained[-1] == IM_END_ID
    _, [parsed] = FunctionCallParser([Tool.model_validate(ADD_TOOL)], "hermes").parse_non_stream(
        tok.decode(trained[:cut])
    )
    assert (parsed.name, json.loads(parsed.parameters)) == ("add", {"a": 7, "b": 905})
    assert all(label in (-100, i) for i, label in zip(ids, labels))
    # one example in three answers at once, without the tool: the prompt rendered, the sum trained
    direct = [calc_conversation("7+905=", "912", random.Random(seed)) for seed in range(30)]
    first = tok.apply_chat_template(messages[:1], tools=[ADD_TOOL], tokenize=False, add_generation_prompt=True)
    at_once = [(i, lab) for i, lab in direct if tok.decode(i) == first + "912<|im_end|>"]
    assert len(at_once) == sum(random.Random(seed).random() < 1 / 3 for seed in range(30)) > 0
    assert all([t for t, lab in zip(i, labels) if lab != -100] == [*b"912", IM_END_ID] for i, labels in at_once)


def test_the_chat_form_is_part_of_the_cached_models_settings():
    from centerline.toy.sft import SftSettings, resolved

    assert resolved(SftSettings(task="chain")).to_dict() == {
        "task": "chain",
        "form": "chat",
        "steps": 300,
        "batch_size": 32,
        "learning_rate": 3e-3,
        "weight_decay": 0.0,
    }
    assert resolved(SftSettings(task="upper")).form == "completion"


def test_init_model_eval_is_the_old_name_of_heldout_read_with_a_warning(tmp_path, capsys):
    from centerline.toy.model_init import main as init_main

    flags = ["--sft", "--task", "copy", "--sft-steps", "3"]
    assert init_main([*flags, "--out", str(tmp_path / "new"), "--heldout"]) == 0
    new = capsys.readouterr()
    assert init_main([*flags, "--out", str(tmp_path / "old"), "--eval"]) == 0
    old = capsys.readouterr()
    figure = new.out.splitlines()[-1]
    assert json.loads(figure)["task"] == "copy" and "heldout_exact_match_t1" in json.loads(figure)
    assert old.out.splitlines()[-1] == figure  # the same settings, the same model and figure
    warning = "centerline init-model: warning: --eval is deprecated; use --heldout\n"
    assert old.err.startswith(warning) and warning not in new.err  # then transformers' progress bars
