"""A long session against the real stack (the fixtures of tests/rollout_worker/test_session_stack.py):
20 turns of the random byte-level model, whose replies hold any bytes (a UTF-8 character cut at a turn's
end, special tokens mid-reply), each reply decoded in the window of ``DECODE_CONTEXT`` tokens exactly as
the whole conversation decodes it (docs/design.md section 12)."""

from __future__ import annotations

import openai
import pytest

from tests.rollout_worker.test_session_stack import IM_END, proxy, run_task  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("sglang")]

TURNS = 20
REPLIES: dict[str, list[str]] = {}  # session id -> each reply's content, as the environment got it


async def twenty_turns(client: openai.AsyncOpenAI, task) -> float:
    sid = str(client.base_url).rstrip("/").split("/")[-2]
    messages = [{"role": "user", "content": task.prompt}]
    for t in range(TURNS):
        reply = await client.chat.completions.create(model="default", messages=messages, max_tokens=8)
        REPLIES.setdefault(sid, []).append(reply.choices[0].message.content)
        messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": f"t{t}"}]
    return 1.0


def test_a_long_sessions_replies_read_as_the_whole_conversation_decodes_them(proxy, model_dir, monkeypatch):  # noqa: F811
    REPLIES.clear()
    outcome, turns, hf = run_task(proxy.url, model_dir, f"{__name__}:twenty_turns", monkeypatch)
    assert len(outcome.batches) == 1 and sorted(len(t) for t in turns.values()) == [TURNS, TURNS]
    for sid, answers in turns.items():
        for t, (input_ids, arrays) in enumerate(answers):
            sampled = arrays.response_ids.tolist()
            before = hf.decode(input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            whole = hf.decode(input_ids + sampled, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            assert whole.startswith(before)
            expected = whole[len(before) :]
            if sampled and sampled[-1] == IM_END:  # the end-of-turn token the template writes itself
                expected = expected[: -len("<|im_end|>")]
            assert REPLIES[sid][t] == expected
            if t + 1 < len(answers):  # the next turn extends this one: nothing re-tokenized
                assert answers[t + 1][0][: len(input_ids) + len(sampled)] == input_ids + sampled
