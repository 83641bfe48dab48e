"""An agent written with the OpenAI Agents SDK (examples/agents_sdk.py) driving a session through
the session endpoint with its chat-completions model class: the SDK's own requests, a function tool
called and its result sent back, and the tokens trained exactly the ones sampled. The engine is the
stand-in of test_session.py, answering each turn with given ids (so that the model calls the tool)."""

from __future__ import annotations

from examples import agents_sdk
from shared.config import Config
from shared.task import PromptTask
from tests.rollout_worker.test_session import IM_END, text_ids
from tests.rollout_worker.test_tool_calls import run, tok  # noqa: F401 (the module's fixture)

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def test_an_agents_sdk_agent_calls_its_tool_through_the_session_and_trains_exactly_the_sampled_ids(
    tok,  # noqa: F811
    monkeypatch,
    transport,
):
    calls = []
    real = agents_sdk.add.on_invoke_tool

    async def counted(ctx, arguments):
        calls.append(arguments)
        return await real(ctx, arguments)

    monkeypatch.setattr(agents_sdk.add, "on_invoke_tool", counted)
    sampled = [text_ids(CALL) + [IM_END], text_ids("It is 5.") + [IM_END]]
    task = PromptTask("t/0/0", "g", "What is 2+3?", "5", "exact", 1, 0)

    async def requests(client):
        return await agents_sdk.adder(client, task)

    reward, s, engine, endpoint = run(
        tok, [(ids, "stop") for ids in sampled], requests, Config(rollout_max_new_tokens=48), transport
    )
    assert reward == 1.0 and calls == ['{"a": 2, "b": 3}']  # the SDK ran the tool on the sampled call
    assert endpoint.failures == [] and s.turns == 2 and (s.tool_calls, s.tool_call_parse_errors) == (1, 0)
    t = s.trajectory()
    trained = [i for i, m in zip(t.response_ids.tolist(), t.loss_mask.tolist()) if m]
    assert trained == sampled[0] + sampled[1]  # exactly the sampled ids, the call's markup included
    rendered = s.template.decode(t.prompt_ids.tolist())
    assert rendered == (  # the tool offered to the template, the SDK's instructions as the system prompt
        "<|im_start|>system\n# Tools\n<tools>\nadd(a, b)\n</tools><|im_end|>\n<|im_start|>system\nAnswer with the "
        "sum. Use the add tool.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    between = s.template.decode(engine.inputs[1][0][len(engine.inputs[0][0]) + len(sampled[0]) :])
    assert between == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"  # the tool's result, untrained
