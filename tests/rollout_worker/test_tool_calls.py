"""Tool calls on the session endpoint (docs/design.md section 12): the real ``openai`` client with
``tools``, replies parsed by SGLang's own parsers (hermes, auto-chosen for the toy model's template),
the history sent back with ``tool_calls`` and tool results, ill-formed calls answered as text and
counted, the counts on the batch, the wire and the step record. The engine is the stand-in of
test_session.py, answering each turn with given ids (the real one: test_tool_calls_stack.py)."""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest
from transformers import AutoTokenizer

from centerline.runs.report import summary
from centerline.toy.tokenizer import save_tokenizer
from rollout_worker.chat_template import ChatTemplate
from rollout_worker.session import Session
from rollout_worker.session_transport import SessionChat, SessionClients
from shared.config import Config
from shared.contract import check_batch
from shared.msgpack_arrays import WireError
from shared.wire import decode_batch, encode_batch
from tests.rollout_worker.session_environments import ADD
from tests.rollout_worker.test_session import IM_END, VOCAB, Engine, K, process, text_ids
from trainer_service.commit import sample_shape

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


def run(tok, replies, requests, cfg: Config | None = None, transport: str = "in-process"):
    """Drive one session with the real client over ``transport``, as the worker makes it:
    ``requests(client)`` is a coroutine function given the client; returns ``(its result, the
    session, the engine, the task's clients)``."""
    cfg = cfg or Config(rollout_max_new_tokens=48)
    engine = Engine(replies)

    async def go():
        endpoint = SessionClients(SessionChat(cfg), transport, timeout=60)
        await endpoint.start()
        s = Session("s1", ChatTemplate.for_run(tok, cfg), engine, k=K, budget=1024)
        client = endpoint.client(s)
        try:
            return await requests(client), s, endpoint
        finally:
            await client.close()
            await endpoint.close()

    result, s, endpoint = asyncio.run(go())
    return result, s, engine, endpoint


def ask(client, messages, **kwargs):
    return client.chat.completions.create(model="default", messages=messages, tools=[ADD], **kwargs)


def test_a_reply_that_calls_a_tool_is_answered_with_openais_tool_calls_and_null_content(tok, transport):
    async def requests(client):
        return await ask(client, [{"role": "user", "content": "2+3?"}])

    reply, s, _, _ = run(tok, [(text_ids(CALL) + [IM_END], "stop")], requests, transport=transport)
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.role) == ("tool_calls", None, "assistant")
    (call,) = choice.message.tool_calls
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("add", '{"a": 2, "b": 3}')
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert not hasattr(choice, "tool_call_error") and (s.tool_calls, s.tool_call_parse_errors) == (1, 0)


def test_content_before_a_call_is_the_text_without_its_markup(tok, transport):
    async def requests(client):
        return await ask(client, [{"role": "user", "content": "2+3?"}])

    reply, _, _, _ = run(tok, [(text_ids("Adding.\n" + CALL) + [IM_END], "stop")], requests, transport=transport)
    message = reply.choices[0].message
    assert (message.content, [c.function.name for c in message.tool_calls]) == ("Adding.", ["add"])


def test_the_history_sent_back_with_tool_calls_and_tool_results_extends_the_session_and_trains_the_sampled_ids(
    tok, transport
):
    sampled = [text_ids(CALL) + [IM_END], text_ids("It is 5.") + [IM_END]]

    async def requests(client):
        messages = [{"role": "user", "content": "2+3?"}]
        first = await ask(client, messages)
        (call,) = first.choices[0].message.tool_calls
        messages += [first.choices[0].message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = await ask(client, messages)
        return first, second, [*messages, second.choices[0].message.model_dump()]

    (first, second, final), s, engine, endpoint = run(
        tok, [(ids, "stop") for ids in sampled], requests, transport=transport
    )
    assert (second.choices[0].message.content, second.choices[0].finish_reason) == ("It is 5.", "stop")
    assert endpoint.failures == [] and s.turns == 2
    t = s.trajectory()
    trained = [i for i, m in zip(t.response_ids.tolist(), t.loss_mask.tolist()) if m]
    assert trained == sampled[0] + sampled[1]  # the call's markup included: the ids SGLang returned
    ids = t.prompt_ids.tolist() + t.response_ids.tolist()
    assert engine.inputs[1][0] == ids[: len(engine.inputs[1][0])]  # turn 2's input: every token so far
    # the tool result: the template's tokens between the turns, untrained
    between = s.template.decode(engine.inputs[1][0][len(engine.inputs[0][0]) + len(sampled[0]) :])
    assert between == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    # the arguments as the object they encode, as Hugging Face templates take them
    final[1]["tool_calls"][0]["function"]["arguments"] = {"a": 2, "b": 3}
    assert s.template.decode(ids) + "\n" == tok.apply_chat_template(final, tools=[ADD], tokenize=False)


@pytest.mark.parametrize(
    "text, finish, code, message",
    [
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}\n</tool_call>',
            "stop",
            "tool_call_unparsed",
            "the hermes parser found tool-call markup in the reply and parsed no call from it",
        ),
        (
            '<tool_call>\n{"name": "mul", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
            "stop",
            "tool_call_unknown_function",
            "the reply calls 'mul', not among the request's tools (add); answered as text",
        ),
        (
            '<tool_call>\n{"name": "add", "argu',
            "length",
            "tool_call_cut",
            "the reply holds hermes tool-call markup and was cut by max_tokens (finish_reason length)",
        ),
    ],
)
def test_a_call_that_does_not_parse_is_answered_as_text_with_the_failure_named_and_counted(
    tok, text, finish, code, message, transport
):
    async def requests(client):
        messages = [{"role": "user", "content": "2+3?"}]
        first = await ask(client, messages)
        messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Use the tool."}]
        return first, await ask(client, messages)  # the text reply sent back extends the session

    closing = [IM_END] if finish == "stop" else []
    replies = [(text_ids(text) + closing, finish), (text_ids(CALL) + [IM_END], "stop")]
    (first, second), s, _, endpoint = run(tok, replies, requests, transport=transport)
    choice = first.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, finish)
    assert choice.tool_call_error["code"] == code and choice.tool_call_error["message"].startswith(message)
    assert second.choices[0].finish_reason == "tool_calls" and endpoint.failures == []
    assert (s.tool_calls, s.tool_call_parse_errors) == (1, 1)
    t = s.trajectory()
    assert (t.tool_calls, t.tool_call_parse_errors) == (1, 1)


def test_a_template_that_renders_a_past_call_differently_from_what_was_sampled_is_refused_by_name(tok, transport):
    """Sampled without spaces, the call parses; the template writes it back with spaces, which the
    tokens held are not: never re-tokenized, the task is rejected (docs/design.md section 12)."""
    tight = '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>'

    async def requests(client):
        messages = [{"role": "user", "content": "2+3?"}]
        first = await ask(client, messages)
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        with pytest.raises(openai.BadRequestError) as refused:
            await ask(client, messages)
        return first, refused.value

    (first, refused), _, _, endpoint = run(tok, [(text_ids(tight) + [IM_END], "stop")], requests, transport=transport)
    assert first.choices[0].message.tool_calls[0].function.arguments == '{"a": 2, "b": 3}'
    assert refused.code == "session_template"
    said = refused.body["message"]
    assert "the chat template renders the history differently from the tokens the session holds" in said
    assert 'the session has \'"add","arguments":{"a":2,"b":3}}' in said, said
    assert 'the template \' "add", "arguments": {"a": 2, "b": 3}}' in said and len(endpoint.failures) == 1


def test_a_template_that_drops_a_past_think_block_is_refused_by_name(tok, transport):
    """--rollout-reasoning-parser: the think block is the answer's reasoning_content; the toy template,
    like Qwen3's for past turns, renders a past reply without it."""

    async def requests(client):
        messages = [{"role": "user", "content": "2+3?"}]
        first = await client.chat.completions.create(model="default", messages=messages)
        messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Sure?"}]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="default", messages=messages)
        return first, refused.value

    cfg = Config(rollout_max_new_tokens=48, rollout_reasoning_parser="deepseek-r1")
    replies = [(text_ids("<think>2 and 3</think>It is 5.") + [IM_END], "stop")]
    (first, refused), _, _, _ = run(tok, replies, requests, cfg, transport=transport)
    message = first.choices[0].message
    assert (message.reasoning_content, message.content) == ("2 and 3", "It is 5.")
    assert (
        refused.code == "session_template"
        and "the session has '<think>2 and 3</think>It is 5." in refused.body["message"]
    ), refused.body["message"]


@pytest.mark.parametrize(
    "cfg, kwargs, code, message",
    [
        (
            Config(rollout_tool_call_parser="none"),
            {},
            "unsupported_setting",
            "tools: the run has no tool-call parser for this model's chat template (--rollout-tool-call-parser none",
        ),
        (
            Config(rollout_tool_call_parser="nonesuch"),
            {},
            "unsupported_setting",
            "--rollout-tool-call-parser: is 'nonesuch'; use auto, none or one of SGLang's parsers: ",
        ),
        (Config(), {"tool_choice": "required"}, "unsupported_setting", "tool_choice: is required; the endpoint parses"),
        (
            Config(),
            {"tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "invalid_request",
            "tool_choice: names the function 'mul', not among the request's tools (add)",
        ),
        (Config(), {"tools": [{"type": "function"}]}, "invalid_request", "tools: tools[0] is not a function tool"),
    ],
)
def test_tools_the_run_cannot_parse_are_refused_by_name(tok, cfg, kwargs, code, message, transport):
    async def requests(client):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "2+3?"}], **{"tools": [ADD], **kwargs}
            )
        return refused.value

    refused, s, engine, endpoint = run(tok, [], requests, cfg, transport=transport)
    assert refused.code == code and refused.body["message"].startswith(message), refused.body["message"]
    assert engine.inputs == [] and len(endpoint.failures) == 1  # fatal: nothing sampled, the task rejected


@pytest.mark.parametrize("choice, calls", [("none", 0), ({"type": "function", "function": {"name": "add"}}, 1)])
def test_tool_choice_none_answers_text_and_a_named_function_parses_calls_to_it(tok, choice, calls, transport):
    async def requests(client):
        return await ask(client, [{"role": "user", "content": "2+3?"}], tool_choice=choice)

    reply, s, engine, _ = run(tok, [(text_ids(CALL) + [IM_END], "stop")], requests, transport=transport)
    assert len(reply.choices[0].message.tool_calls or []) == s.tool_calls == calls
    assert b"<tools>" in bytes(i for i in engine.inputs[0][0] if i < 256)  # the template got the tools either way


def test_a_tool_agents_sessions_carry_their_counts_to_the_batch_the_wire_the_step_record_and_the_report(
    tok, monkeypatch
):
    """Two sessions of ``calls_a_tool``: one calls, reads the result and answers; one's call does not
    parse. Counts per sample in the batch, through the wire, summed in the step record."""
    template = ChatTemplate.for_run(tok, Config())
    # the sessions' first turns (the same prompt) get the call and the broken call, in whichever order
    # they arrive; a later turn, the calling session's after its tool result, the answer
    first = Engine([(text_ids(CALL) + [IM_END], "stop"), (text_ids('<tool_call>\n{"name": "add"') + [IM_END], "stop")])
    later, opening = Engine([(text_ids("5") + [IM_END], "stop")]), []

    async def engine(input_ids, max_new_tokens, stop):
        if not opening:  # the first turn's prompt length, the same in both sessions
            opening.append(len(input_ids))
        turn = first if len(input_ids) == opening[0] else later
        return await turn(input_ids, max_new_tokens, stop)

    outcome = process(template, monkeypatch, "calls_a_tool", engine, prompt="2+3?")
    (batch,) = outcome.batches
    check_batch(batch, vocab_size=VOCAB)
    assert sorted(zip(batch.tool_calls, batch.tool_call_parse_errors)) == [(0, 1), (1, 0)]
    assert sorted(outcome.rewards.tolist()) == [0.0, 1.0]
    back = decode_batch(encode_batch(batch))
    assert (back.tool_calls, back.tool_call_parse_errors) == (batch.tool_calls, batch.tool_call_parse_errors)
    shape = sample_shape([back, back])
    assert (shape["tool_calls"], shape["tool_call_parse_errors"]) == (2, 2)
    step = {"step": 1, "loss": 0.0, "turns_mean": 1.5, "injected_tokens": 9, "sampled_tokens": 9, **shape}
    assert ("tool calls parsed / replies whose calls did not parse", "2 / 2") in summary([step])


def test_sessions_count_zero_calls_a_plain_batch_records_none_and_counts_of_the_wrong_length_are_refused(
    tok, monkeypatch
):
    engine = Engine([(text_ids("hi") + [IM_END], "stop")] * 2)
    outcome = process(ChatTemplate.for_run(tok, Config()), monkeypatch, "one_turn", engine)
    (batch,) = outcome.batches
    assert (batch.tool_calls, batch.tool_call_parse_errors) == ([0, 0], [0, 0])  # sessions: counted, none
    batch.tool_calls = [1]
    with pytest.raises(WireError, match="field 'tool_calls' has 1 counts for 2 sample_ids"):
        decode_batch(encode_batch(batch))
    batch.tool_calls, batch.tool_call_parse_errors = [], []
    assert b"tool_calls" not in encode_batch(batch)  # not recorded: not written
    assert "tool_calls" not in sample_shape([batch])
