"""Tool calls on SmolLM2-135M-Instruct: its own chat template renders no tools and fails on a null
content, so the sessions render with deploy/chat_templates/smollm2-tools.jinja
(``--rollout-chat-template``), whose <tool_call> blocks make ``auto`` choose the hermes parser. An
agent with the real ``openai`` client (tests/real_model/environments.py:adds_with_a_tool) through a
proxy, smg 0.3.2 and real SGLang at temperature 0.3, where the model calls add after two worked
examples: every reply is what SGLang's hermes parser makes of the sampled text, the history sent
back with tool_calls and tool results extends the session, and the trained ids are the sampled ids."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import pytest

from rollout_worker import environment
from rollout_worker.main import load_tokenizer
from rollout_worker.worker import Worker
from shared.config import Config
from shared.contract import check_batch
from shared.settings import WorkerSettings
from shared.task import PromptTask
from tests.processes import Process, free_port, http, wait_until
from tests.real_model import environments
from tests.real_model.conftest import IM_END, VOCAB

pytestmark = [pytest.mark.real_model, pytest.mark.integration]

K, TEMPERATURE = 128, 0.3
TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "chat_templates" / "smollm2-tools.jinja"


@pytest.fixture(scope="module")
def proxy_url(real_router, tmp_path_factory):
    """A ready `centerline proxy` at K = 128 and temperature 0.3 in front of the router."""
    port = free_port()
    argv = [sys.executable, "-m", "centerline", "proxy", "--upstream", real_router.url, "--port", str(port)]
    argv += ["--rollout-top-logprobs-num", str(K), "--rollout-temperature", str(TEMPERATURE)]
    proc = Process(argv, tmp_path_factory.mktemp("proxy") / "proxy.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http("GET", url + "/ready", timeout=5)[0] == 200, 180, "proxy", proc.proc)
        yield url
    finally:
        proc.stop()


def test_smollm2s_own_template_cannot_render_a_reply_that_only_calls_a_tool(real_model):
    _, hf = load_tokenizer(str(real_model))
    with pytest.raises(TypeError):
        hf.apply_chat_template(environments._shot(0, 1, 1), tokenize=False)


def test_an_agent_calling_a_tool_on_the_real_model_gets_what_the_hermes_parser_parses_and_trains_the_sampled_ids(
    proxy_url, real_model, monkeypatch
):
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    environments.TOOL_SESSIONS.clear()
    cfg = Config(
        proxy_url=proxy_url,
        rollout_top_logprobs_num=K,
        rollout_temperature=TEMPERATURE,
        rollout_max_new_tokens=40,
        rollout_n=2,
        rollout_chat_template=str(TEMPLATE),
    )
    tokenizer, hf = load_tokenizer(str(real_model))
    worker = Worker(cfg, WorkerSettings(worker_id="test", vocab_size=VOCAB), tokenizer)
    turns: dict[str, list] = {}
    real = environment.proxy_generate

    async def recording(http, url, body, routing_key):
        arrays = await real(http, url, body, routing_key)
        turns.setdefault(routing_key, []).append((body["input_ids"], arrays.response_ids.tolist()))
        return arrays

    monkeypatch.setattr(environment, "proxy_generate", recording)
    task = PromptTask(
        "t/0/0",
        "t/g0",
        "What is 2 + 3?",
        "5",
        "exact",
        2,
        0,
        environment="tests.real_model.environments:adds_with_a_tool",
    )

    async def go():
        async with aiohttp.ClientSession() as session:
            worker.session = session
            return await worker.process(task, attempt=1)

    outcome = asyncio.run(go())
    (batch,) = outcome.batches
    check_batch(batch, vocab_size=VOCAB, current_version=0, max_staleness=0)
    calls = errors = 0
    for record in environments.TOOL_SESSIONS:
        sid = record["answers"][0].id.split("-")[1]  # chatcmpl-<session id>-<turn>: the routing key
        for answer, (_, sampled) in zip(record["answers"], turns[sid], strict=True):
            text = hf.decode(sampled[:-1] if sampled[-1] == IM_END else sampled, skip_special_tokens=False)
            normal, parsed = FunctionCallParser([Tool.model_validate(environments.ADD)], "hermes").parse_non_stream(
                text
            )
            choice = answer.choices[0]
            error = getattr(choice, "tool_call_error", None)
            if error is None:
                got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
                assert got == [(c.name, c.parameters) for c in parsed]
                assert choice.message.content == ((normal or None) if parsed else text)
            else:  # answered as text: the sampled text, markup and all
                assert choice.message.content == text and choice.message.tool_calls is None
            calls += len(choice.message.tool_calls or [])
            errors += error is not None
    assert (sum(batch.tool_calls), sum(batch.tool_call_parse_errors)) == (calls, errors)
    assert calls >= 1  # at 0.3 after two worked examples, SmolLM2 calls add (the history then went back whole)
    # a session's tokens end with its last turn's input and what SGLang returned for it
    by_tokens = {tuple(t[-1][0] + t[-1][1]): t for t in turns.values()}
    for i in range(batch.num_samples):
        part = batch.sample_slice(i)
        prompt = batch.prompt_ids[batch.prompt_offsets[i] : batch.prompt_offsets[i + 1]].tolist()
        ids, mask = prompt + batch.response_ids[part].tolist(), batch.loss_mask[part].astype(bool)
        session_turns = by_tokens[tuple(ids)]
        assert batch.response_ids[part][mask].tolist() == sum((s for _, s in session_turns), [])
        for inputs, sampled in session_turns:  # each turn continued every token so far, none re-tokenized
            assert ids[: len(inputs)] == inputs and ids[len(inputs) : len(inputs) + len(sampled)] == sampled
