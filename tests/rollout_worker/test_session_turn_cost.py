"""What a session's turn costs in the worker (docs/design.md section 12): it decodes its new tokens and
``DECODE_CONTEXT`` before them, never the history; a failed turn leaves the session as its last
complete turn; each turn records the seconds of its stages. The engine here is the stand-in of
tests/rollout_worker/test_session.py (the real one: tests/rollout_worker/test_session_stack.py)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from transformers import AutoTokenizer

from centerline.toy.tokenizer import save_tokenizer
from rollout_worker.chat_template import ChatTemplate
from rollout_worker.session import DECODE_CONTEXT, STAGES, Session
from rollout_worker.worker import Transient
from tests.rollout_worker.test_session import IM_END, VOCAB, Engine, K, dummy_prefix_template, serve, text_ids


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> ChatTemplate:
    """The default model's byte-level tokenizer with its ChatML template."""
    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(out)
    return ChatTemplate(AutoTokenizer.from_pretrained(str(out)))


def recording(template: ChatTemplate) -> tuple[ChatTemplate, list[int]]:
    """``template`` whose decode records how many ids each call decodes."""
    decoded: list[int] = []
    decode = template.decode

    def counted(ids):
        decoded.append(len(ids))
        return decode(ids)

    template.decode = counted
    return template, decoded


def play(template: ChatTemplate, turns: int, reply: list[int]):
    """A session of ``turns`` turns, each user message "u<i>", each reply ``reply``; per turn, the
    ids it decoded and its new ids' count; the session and its final messages."""
    template, decoded = recording(template)
    s = Session("s1", template, Engine([(reply, "stop")] * turns), k=K, budget=1 << 20)
    messages, per_turn = [], []
    for i in range(turns):
        messages.append({"role": "user", "content": f"u{i}"})
        held = len(s.ids)
        decoded.clear()
        answer = asyncio.run(s.turn(messages, max_new_tokens=16))
        new = s.turn_prompt_tokens[-1] - held
        per_turn.append((list(decoded), new))
        assert s.text == template.decode(s.ids)  # the text held is what the ids held decode to
        messages.append({"role": "assistant", "content": answer.content})
    return s, messages, per_turn


def test_a_turn_decodes_its_new_tokens_and_a_window_before_them_whatever_the_history(tmp_path):
    """40 turns: from the turn whose history passes DECODE_CONTEXT tokens on, every turn decodes the same
    counts (its new ids and the reply after DECODE_CONTEXT tokens, the end-of-turn token alone), and the
    session holds exactly what the whole conversation tokenizes to."""
    out = tmp_path / "tok"
    save_tokenizer(out)
    template = ChatTemplate(AutoTokenizer.from_pretrained(str(out)))
    reply = text_ids("hi") + [IM_END]
    s, messages, per_turn = play(template, 40, reply)
    for decoded, new in per_turn[1:]:
        assert decoded == [DECODE_CONTEXT + new, DECODE_CONTEXT, DECODE_CONTEXT, DECODE_CONTEXT + len(reply), 1]
    whole = template.encode(template.tok.apply_chat_template(messages, tokenize=False))
    assert s.ids + template.encode("\n") == whole  # the template writes "\n" after the last <|im_end|>


def test_a_dummy_prefix_tokenizer_decodes_replies_in_context_through_the_window():
    """Sentencepiece's "▁" before a reply reads as the space it is after the tokens before it, turn
    after turn, with the window as with the whole history."""
    sp = dummy_prefix_template()
    s = Session("s1", sp, Engine([([256, 104, 105, 259], "stop")]), k=K, budget=1 << 20)  # "▁hi<|im_end|>"
    reply = asyncio.run(s.turn([{"role": "user", "content": "a"}], max_new_tokens=8))
    assert len(s.ids) > DECODE_CONTEXT and reply.content == " hi" and s.text == sp.decode(s.ids)


def test_a_failed_turn_leaves_the_session_as_its_last_complete_turn(template):
    engine = Engine([(text_ids("hi") + [IM_END], "stop")])
    s = Session("s1", template, engine, k=K, budget=1024)
    messages = [{"role": "user", "content": "a"}]
    reply = asyncio.run(s.turn(messages, max_new_tokens=8))
    ids, text, before = list(s.ids), s.text, s.trajectory()
    engine.fail = Transient("the engine went away")
    messages += [reply.history_message(), {"role": "user", "content": "b"}]
    with pytest.raises(Transient, match="the engine went away"):
        asyncio.run(s.turn(messages, max_new_tokens=8))
    assert len(engine.inputs[1][0]) > len(ids)  # the turn was sent with its new ids
    after = s.trajectory()
    assert (s.ids, s.text, s.turns, len(s.turn_stages)) == (ids, text, 1, 1)
    assert after.response_ids.tolist() == before.response_ids.tolist()
    assert after.loss_mask.tolist() == before.loss_mask.tolist() and after.cand_ids.shape == before.cand_ids.shape


def test_each_turn_records_the_seconds_of_its_stages_and_the_endpoints_own(template, transport):
    async def go():
        engine = Engine([(text_ids("hi") + [IM_END], "stop"), (text_ids("yo"), "length")])
        endpoint, s, client = await serve(template, engine, transport=transport)
        try:
            messages = [{"role": "user", "content": "a"}]
            first = await client.chat.completions.create(model="default", messages=messages)
            messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "b"}]
            await client.chat.completions.create(model="default", messages=messages)
            with pytest.raises(openai.BadRequestError):  # a refused turn records nothing
                await client.chat.completions.create(model="default", messages=messages[:1])
            return s
        finally:
            await client.close()
            await endpoint.close()

    s = asyncio.run(go())
    assert len(s.turn_stages) == 2
    for stages in s.turn_stages:
        assert list(stages) == [*STAGES, "endpoint"] and all(0 <= v < 5 for v in stages.values())


CLOSED: list[asyncio.Event] = []


async def closes_its_client(client: openai.AsyncOpenAI, task) -> float:
    """The first session closes its client after one turn; the other takes a second turn after that."""
    first = not CLOSED
    if first:
        CLOSED.append(asyncio.Event())
    messages = [{"role": "user", "content": "a"}]
    reply = await client.chat.completions.create(model="default", messages=messages)
    if first:
        await client.close()
        CLOSED[0].set()
        return 1.0
    await CLOSED[0].wait()
    messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "b"}]
    await client.chat.completions.create(model="default", messages=messages)
    return 2.0


def test_a_session_that_closes_its_client_leaves_the_other_sessions_of_the_task_theirs(
    template, monkeypatch, transport
):
    """A task's sessions share one connection pool (no CA certificates loaded per session); an
    environment closing its client closes its own only."""
    from rollout_worker import environment
    from rollout_worker.worker import Tokenizer, Worker
    from shared.config import Config
    from shared.settings import WorkerSettings
    from shared.task import PromptTask

    engine = Engine([(text_ids("hi") + [IM_END], "stop")] * 3)

    async def fake(http, url, body, routing_key):
        return await engine(body["input_ids"], body["sampling_params"]["max_new_tokens"], None)

    monkeypatch.setattr(environment, "proxy_generate", fake)
    CLOSED.clear()
    cfg = Config(rollout_top_logprobs_num=K, rollout_max_new_tokens=16, rollout_n=2)
    settings = WorkerSettings(worker_id="w", vocab_size=VOCAB, session_transport=transport)
    worker = Worker(cfg, settings, Tokenizer(None, None, chat=template.tok))
    task = PromptTask("run/0/4", "run/g4", "a", "", "exact", 2, 0, environment=f"{__name__}:closes_its_client")
    outcome = asyncio.run(worker.process(task, attempt=1))
    (batch,) = outcome.batches
    assert sorted(outcome.rewards.tolist()) == [1.0, 2.0] and batch.num_samples == 2
    assert outcome.tokens == 3 * 3  # three turns of "hi<|im_end|>", every one sampled and trained
