"""Tool calls against the real stack on the toy model: the real ``openai`` client with ``tools``,
the worker's session endpoint, native /generate at K = 128 through the proxy and smg 0.3.2 to the
session's real SGLang server. The toy model's ChatML template renders tools and calls in the hermes
format, so ``auto`` chooses hermes; its random weights sample whatever they sample, and every
answer must be what SGLang's hermes parser makes of it (the parser's own cases, with given ids:
test_tool_calls.py; a model that calls: tests/real_model/test_tool_calls.py)."""

from __future__ import annotations

import logging

import pytest

from tests.real_model import environments
from tests.rollout_worker.test_session_stack import IM_END, proxy, run_task  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("sglang")]


def test_a_tool_agent_on_the_toy_model_gets_what_hermes_parses_and_trains_the_sampled_ids(
    proxy,  # noqa: F811
    model_dir,
    monkeypatch,
    caplog,
):
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    environments.TOOL_SESSIONS.clear()
    caplog.set_level(logging.INFO, logger="centerline.worker")
    outcome, turns, hf = run_task(proxy.url, model_dir, "tests.real_model.environments:adds_with_a_tool", monkeypatch)
    assert "--rollout-tool-call-parser auto chose 'hermes' from the chat template" in caplog.text
    (batch,) = outcome.batches
    calls = errors = 0
    for record in environments.TOOL_SESSIONS:
        sid = record["answers"][0].id.split("-")[1]  # chatcmpl-<session id>-<turn>: the routing key
        for answer, (_, arrays) in zip(record["answers"], turns[sid], strict=True):
            sampled = arrays.response_ids.tolist()
            text = hf.decode(sampled[:-1] if sampled[-1] == IM_END else sampled, skip_special_tokens=False)
            normal, parsed = FunctionCallParser([Tool.model_validate(environments.ADD)], "hermes").parse_non_stream(
                text
            )
            choice = answer.choices[0]
            error = getattr(choice, "tool_call_error", None)
            if error is None:
                assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == [
                    (c.name, c.parameters) for c in parsed
                ]
                assert choice.message.content == ((normal or None) if parsed else text)
            else:
                assert choice.message.content == text and choice.message.tool_calls is None
            calls += len(choice.message.tool_calls or [])
            errors += error is not None
    assert (sum(batch.tool_calls), sum(batch.tool_call_parse_errors)) == (calls, errors)
    for i in range(batch.num_samples):
        prompt = hf.decode(batch.prompt_ids[batch.prompt_offsets[i] : batch.prompt_offsets[i + 1]].tolist())
        # the worked examples' calls (content null) and results, rendered into the first prompt, untrained
        assert prompt.startswith("<|im_start|>system\n# Tools\n<tools>\n")
        assert (
            '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>' in prompt
        )
        assert "<|im_start|>tool\n2<|im_end|>\n" in prompt
        part = batch.sample_slice(i)
        ids = batch.prompt_ids[batch.prompt_offsets[i] : batch.prompt_offsets[i + 1]].tolist()
        ids += batch.response_ids[part].tolist()
        (session_turns,) = [t for t in turns.values() if ids == t[-1][0] + t[-1][1].response_ids.tolist()]
        returned = sum((arrays.response_ids.tolist() for _, arrays in session_turns), [])
        assert batch.response_ids[part][batch.loss_mask[part].astype(bool)].tolist() == returned
