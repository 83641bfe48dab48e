"""The built-in tool task ``calc`` (shared/toy_tasks.py): a three-digit sum the model answers by
calling ``add``, played through the session endpoint with the toy template's hermes calls parsed by
SGLang's parser. The engine answers each turn with given ids (tests/rollout_worker/test_session.py's
stand-in); what the model learns is `centerline up --task calc` (docs/results.md)."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from centerline.toy.sft import calc_call
from centerline.toy.tokenizer import save_tokenizer
from rollout_worker import environment
from rollout_worker.chat_template import ChatTemplate
from rollout_worker.worker import Tokenizer, Worker
from shared.config import Config
from shared.contract import sample_turns
from shared.settings import WorkerSettings
from shared.task import PromptTask
from shared.toy_tasks import CALC_ILL_FORMED, CALC_MAX_TOKENS, run_add
from tests.rollout_worker.test_session import IM_END, VOCAB, Engine, K, text_ids

PROMPT, ANSWER = "347+589=", "936"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> ChatTemplate:
    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(out)
    return ChatTemplate(AutoTokenizer.from_pretrained(str(out)))


def play(template, monkeypatch, replies: list[tuple[str, str]]):
    """One ``calc`` session of the worker (n=1), its turns answered with ``replies`` (text, finish);
    returns the outcome and the engine (each turn's input ids)."""
    engine = Engine([(text_ids(text) + ([IM_END] if finish == "stop" else []), finish) for text, finish in replies])

    async def fake(http, url, body, routing_key):
        return await engine(body["input_ids"], body["sampling_params"]["max_new_tokens"], None)

    monkeypatch.setattr(environment, "proxy_generate", fake)
    cfg = Config(rollout_top_logprobs_num=K, rollout_max_new_tokens=CALC_MAX_TOKENS, rollout_n=1)
    worker = Worker(cfg, WorkerSettings(worker_id="w", vocab_size=VOCAB), Tokenizer(None, None, chat=template.tok))
    task = PromptTask("run/0/1", "run/g1", PROMPT, ANSWER, "exact", 1, 0, environment="calc")
    return asyncio.run(worker.process(task, attempt=1)), engine


def tool_results(template, engine) -> list[str]:
    return [
        template.decode(ids).split("<|im_start|>tool\n")[-1].split("<|im_end|>")[0]
        for ids, _, _ in engine.inputs
        if "<|im_start|>tool\n" in template.decode(ids)
    ]


def test_a_call_to_add_then_its_result_answered_scores_one(template, monkeypatch):
    call, _ = calc_call(PROMPT)
    outcome, engine = play(template, monkeypatch, [(call, "stop"), (ANSWER, "stop")])
    assert outcome.rewards.tolist() == [1.0]
    assert tool_results(template, engine) == ["936"]  # the tool's result, injected before turn 2
    assert [limit for _, limit, _ in engine.inputs] == [CALC_MAX_TOKENS, CALC_MAX_TOKENS]
    assert template.decode(engine.inputs[0][0]).startswith("<|im_start|>system\n# Tools\n<tools>\nadd(a, b)\n</tools>")
    [batch] = outcome.batches
    assert sample_turns(batch) == [2] and (batch.tool_calls, batch.tool_call_parse_errors) == ([1], [0])
    # trained: exactly the sampled tokens of both turns, the call's markup included
    assert int(batch.loss_mask.sum()) == len(text_ids(call)) + 1 + len(text_ids(ANSWER)) + 1


def test_a_call_that_does_not_parse_ends_the_session_at_the_ill_formed_reward(template, monkeypatch):
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 347, "b": }}\n</tool_call>'
    outcome, engine = play(template, monkeypatch, [(broken, "stop")])
    assert outcome.rewards.tolist() == [CALC_ILL_FORMED] == [-1.0] and len(engine.inputs) == 1
    [batch] = outcome.batches
    assert (batch.tool_calls, batch.tool_call_parse_errors) == ([0], [1])


@pytest.mark.parametrize(
    "reply, finish",
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 347, "b": 5', "length"),  # cut by max_tokens
        ('<tool_call>\n{"name": "mul", "arguments": {"a": 347, "b": 589}}\n</tool_call>', "stop"),  # not offered
    ],
)
def test_a_cut_call_or_one_to_a_tool_not_offered_is_ill_formed_too(template, monkeypatch, reply, finish):
    outcome, engine = play(template, monkeypatch, [(reply, finish)])
    assert outcome.rewards.tolist() == [CALC_ILL_FORMED] and len(engine.inputs) == 1
    assert (outcome.batches[0].tool_calls, outcome.batches[0].tool_call_parse_errors) == ([0], [1])


def test_a_wrong_call_gets_the_tools_own_result_and_a_retry(template, monkeypatch):
    wrong = '<tool_call>\n{"name": "add", "arguments": {"a": "347", "b": 589}}\n</tool_call>'
    call, _ = calc_call(PROMPT)
    outcome, engine = play(template, monkeypatch, [(wrong, "stop"), (call, "stop"), (ANSWER, "stop")])
    assert tool_results(template, engine) == ["error: a and b must be integers", "936"]
    assert outcome.rewards.tolist() == [1.0] and outcome.batches[0].tool_calls == [2]


def test_an_answer_without_a_call_is_judged_as_it_is(template, monkeypatch):
    outcome, _ = play(template, monkeypatch, [("936", "stop")])
    assert outcome.rewards.tolist() == [1.0] and outcome.batches[0].tool_calls == [0]
    outcome, _ = play(template, monkeypatch, [("935", "stop")])
    assert outcome.rewards.tolist() == [0.0]


@pytest.mark.parametrize(
    "arguments, result",
    [
        ('{"a": 1, "b": 2}', "3"),
        ('{"a": 999, "b": 999}', "1998"),
        ('{"a": 1}', "error: a and b must be integers"),
        ('{"a": 1.5, "b": 2}', "error: a and b must be integers"),
        ('{"a": true, "b": 2}', "error: a and b must be integers"),
        ("[1, 2]", "error: a and b must be integers"),
        ("{a: 1}", "error: arguments are not JSON"),
    ],
)
def test_the_add_tool(arguments, result):
    assert run_add(arguments) == result
