"""A slow reward no longer stalls its worker's other tasks: two tasks in one worker's ``process``
against the real stack (SGLang, the router, the proxy at K = 128), one scored by a plain function
that blocks until the other task was scored, the other by an async reward that waits for the slow
one to begin. On the event loop the slow reward would block the other task for its whole 30 s;
off it, the other task is scored, and finishes, while the slow one runs. The fast task's prompt is
a chat row (a system prompt, two turns): the batch's prompt is its chat template's rendering."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rollout_worker.main import load_tokenizer
from rollout_worker.worker import Worker
from shared.config import Config
from shared.settings import WorkerSettings
from shared.task import PromptTask
from shared.wire import REWARD_COMPONENTS, decode_batch, encode_batch
from tests.rollout_worker import reward_functions
from tests.rollout_worker.test_session_stack import VOCAB, K, proxy  # noqa: F401 (the module's fixture)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("sglang")]

M = "tests.rollout_worker.reward_functions"
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Hi."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Say ab."},
]


def test_a_slow_reward_runs_off_the_loop_while_the_other_task_finishes(proxy, model_dir):  # noqa: F811
    cfg = Config(proxy_url=proxy.url, rollout_top_logprobs_num=K, rollout_max_new_tokens=4, rollout_n=2)
    tokenizer, hf = load_tokenizer(str(model_dir))
    worker = Worker(cfg, WorkerSettings(worker_id="test", vocab_size=VOCAB, reward_timeout=60), tokenizer)
    slow = PromptTask("slow/0/0", "g0", "up ab=", "AB", f"{M}:slow_sync", 2, 0)
    fast = PromptTask(
        "fast/0/1", "g1", "Say ab.", "ab", f"{M}:fast_async=1.0,{M}:length=0.5", 2, 0, meta={"messages": CHAT}
    )
    done = {}

    async def timed(task):
        outcome = await worker.process(task)
        done[task.task_id] = asyncio.get_running_loop().time()
        return outcome

    async def go():
        async with aiohttp.ClientSession() as http:
            worker.session = http
            return await asyncio.gather(timed(slow), timed(fast))

    reward_functions.EVENTS.clear()
    slow_out, fast_out = asyncio.run(go())
    events = [(task_id, what) for task_id, what, _ in reward_functions.EVENTS]
    started, ran, ended = (
        ("slow/0/0", "slow reward started"),
        ("fast/0/1", "fast reward ran"),
        ("slow/0/0", "slow reward ended, other scored: True"),
    )
    assert sorted(events) == sorted([started, started, ran, ran, ended, ended])  # one call per response
    # by construction (events, no timing): the fast reward waits for the slow one to begin, the slow
    # one for the fast one to run; on the loop the slow one would end "other scored: False" after 30 s
    assert events.index(started) < events.index(ran) < events.index(ended)
    assert slow_out.rewards.tolist() == [1.0, 1.0]
    (batch,) = fast_out.batches
    texts = [hf.decode(batch.response_ids[batch.sample_slice(i)]) for i in range(2)]
    lengths = [
        float(len(hf.decode(batch.response_ids[batch.sample_slice(i)], skip_special_tokens=True))) for i in range(2)
    ]
    assert fast_out.rewards.tolist() == [1.5 * n for n in lengths], texts
    assert decode_batch(encode_batch(batch)).extra[REWARD_COMPONENTS] == {
        "fast_async": sum(lengths) / 2,
        "length": sum(lengths) / 2,
    }
    rendered = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompt = batch.prompt_ids[batch.prompt_offsets[0] : batch.prompt_offsets[1]].tolist()
    assert prompt == tokenizer.encode_chat(CHAT) and hf.decode(prompt) == rendered
