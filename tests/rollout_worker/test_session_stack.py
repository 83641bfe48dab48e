"""Multi-turn sessions against the real stack: an environment driving the real ``openai``
AsyncOpenAI client, the worker's session endpoint, native /generate at K = 128 through the proxy
and the real SGLang router (smg 0.3.2) to the session's real SGLang server (the default byte-level
model, its ChatML template), one batch for the group. No NATS: the worker's own ``process``."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import aiohttp
import numpy as np
import pytest

from centerline.toy.tokenizer import CHAT_TEMPLATE
from rollout_worker import environment
from rollout_worker import worker as worker_module
from rollout_worker.main import load_tokenizer
from rollout_worker.session import message_key
from rollout_worker.worker import Rejected, Transient, Worker
from shared.config import Config
from shared.contract import check_batch
from shared.settings import WorkerSettings
from shared.task import PromptTask
from tests.processes import Router, SGLangProcess
from tests.rollout_worker import session_environments
from tests.router_proxy.conftest import ProxyProcess

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("sglang")]

K, VOCAB, IM_END = 128, 260, 258


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, sglang_server, sglang_router, model_dir):
    """A ready proxy at K = 128 in front of the router in front of the shared server."""
    sglang_server.serve(model_dir)
    proxy = ProxyProcess(
        tmp_path_factory.mktemp("proxy") / "proxy.log",
        sglang_router.url,
        "--vocab-size",
        str(VOCAB),
        "--rollout-top-logprobs-num",
        str(K),
    )
    try:
        status, body = proxy.wait_probed()
        assert status == 200, body
        yield proxy
    finally:
        proxy.stop()


def run_task(
    proxy_url: str,
    model_dir,
    env: str,
    monkeypatch,
    *,
    vocab: int = VOCAB,
    n: int = 2,
    attempt: int = 1,
    chat_template: str | None = None,
):
    """``(outcome, turns, hf)``: the worker's ``process`` of one task naming ``env`` (the model's
    tokenizer, with ``chat_template`` in place of its own if given); ``turns`` maps each routing key
    to the audited answers of its turns, as the proxy returned them."""
    cfg = Config(proxy_url=proxy_url, rollout_top_logprobs_num=K, rollout_max_new_tokens=8, rollout_n=n)
    tokenizer, hf = load_tokenizer(str(model_dir))
    if chat_template is not None:
        hf.chat_template = chat_template
    worker = Worker(cfg, WorkerSettings(worker_id="test", vocab_size=vocab), tokenizer)
    turns: dict[str, list] = {}
    real = environment.proxy_generate

    async def recording(http, url, body, routing_key):
        arrays = await real(http, url, body, routing_key)
        turns.setdefault(routing_key, []).append((body["input_ids"], arrays))
        return arrays

    monkeypatch.setattr(environment, "proxy_generate", recording)
    task = PromptTask("s/0/0", "s/g0", "Say hi.", "", "exact", n, 0, environment=env)

    async def go():
        async with aiohttp.ClientSession() as http:
            worker.session = http
            return await worker.process(task, attempt=attempt)

    return asyncio.run(go()), turns, hf


def sample_ids(batch, i: int) -> list[int]:
    return (
        batch.prompt_ids[batch.prompt_offsets[i] : batch.prompt_offsets[i + 1]].tolist()
        + batch.response_ids[batch.sample_slice(i)].tolist()
    )


def test_a_three_turn_session_trains_exactly_the_ids_sglang_returned(proxy, model_dir, monkeypatch):
    session_environments.RECORDED.clear()
    outcome, turns, hf = run_task(
        proxy.url, model_dir, "tests.rollout_worker.session_environments:three_turns", monkeypatch
    )
    check_three_turns(outcome, turns, hf, vocab=VOCAB, im_end=IM_END)


def check_three_turns(outcome, turns, hf, *, vocab: int, im_end: int) -> None:
    """What ``session_environments.three_turns`` must have made of two sessions, whatever the model."""
    (batch,) = outcome.batches
    check_batch(batch, vocab_size=vocab, current_version=0, max_staleness=0)
    assert (batch.num_samples, batch.task_id, batch.attempt, batch.k) == (2, "s/0/0", 1, K)
    assert len(turns) == 2 and all(len(t) == 3 for t in turns.values())  # 2 sessions, 3 turns each, by routing key
    # a session's tokens end with its last turn's input and what SGLang returned for it
    by_tokens = {tuple(t[-1][0] + t[-1][1].response_ids.tolist()): t for t in turns.values()}
    for i in range(batch.num_samples):
        part = batch.sample_slice(i)
        prompt = batch.prompt_ids[batch.prompt_offsets[i] : batch.prompt_offsets[i + 1]].tolist()
        response, mask = batch.response_ids[part].tolist(), batch.loss_mask[part].astype(bool)
        ids = prompt + response
        session_turns = by_tokens[tuple(ids)]
        sampled = []
        for inputs, arrays in session_turns:
            returned = arrays.response_ids.tolist()
            assert ids[: len(inputs)] == inputs  # each turn continued every token so far, none re-tokenized
            assert ids[len(inputs) : len(inputs) + len(returned)] == returned
            sampled += returned
        assert np.asarray(response)[mask].tolist() == sampled  # trained: exactly SGLang's ids
        cand = batch.cand_ids[part]
        assert (cand[mask] >= 0).all() and all(len(set(row)) == K for row in cand[mask].tolist())
        assert (cand[~mask] == -1).all() and (batch.cand_logprobs[part][~mask] == -np.inf).all()
        assert (batch.token_versions[part] == 0).all()
        for (before, _), (inputs, later) in zip(session_turns, session_turns[1:]):
            # one engine held the history (session affinity): at least the last turn's input came from its cache
            assert len(before) <= later.cached_tokens[0] < len(inputs)
    decoded = [hf.decode(sample_ids(batch, i), skip_special_tokens=False) for i in range(batch.num_samples)]
    for record in session_environments.RECORDED:
        final = [message_key(m) for m in record["messages"]]
        rendered = hf.apply_chat_template(final, tokenize=False)
        # the decoded trajectory is the template's rendering of the conversation, but for what the
        # template writes after the last reply: "\n" after a sampled <|im_end|>, the whole closing after a cut-off one
        (i,) = [i for i, d in enumerate(decoded) if rendered.startswith(d)]
        closing = "\n" if sample_ids(batch, i)[-1] == im_end else "<|im_end|>\n"
        assert decoded[i] + closing == rendered
        refused = record["refused"]
        assert refused is not None and refused.code == "session_history"
        assert "message 1 differs from the session's history" in refused.body["message"]
    rewards = [r for r in outcome.rewards.tolist()]
    assert sorted(rewards) == sorted(
        float(sum(len(a.choices[0].message.content) for a in rec["answers"])) for rec in session_environments.RECORDED
    )


@pytest.mark.slow
def test_a_proxy_killed_mid_session_fails_the_task_as_transient_and_the_retry_runs_new_sessions_whole(
    tmp_path, sglang_router, model_dir, monkeypatch
):
    """Faults (docs/design.md section 12): the proxy dies after a session's first turn; the task fails
    as transient with nothing to publish (turn 1 is not trained alone), and its redelivery, through a
    proxy that is back, samples every turn again in new sessions: trained whole or not at all."""
    flags = ("--vocab-size", str(VOCAB), "--rollout-top-logprobs-num", str(K))
    first = ProxyProcess(tmp_path / "proxy-1.log", sglang_router.url, *flags)
    assert first.wait_probed()[0] == 200
    monkeypatch.setattr(session_environments, "AFTER_FIRST_TURN", [first.proc.kill])
    env = "tests.rollout_worker.session_environments:three_turns_with_a_fault"
    real, answered = environment.proxy_generate, []

    async def recording(http, url, body, routing_key):  # every turn the proxy answered, by routing key
        arrays = await real(http, url, body, routing_key)
        answered.append(routing_key)
        return arrays

    monkeypatch.setattr(environment, "proxy_generate", recording)
    try:
        # refused, or cut off for a turn in flight when it died
        cut = rf"^{re.escape(first.url)}/generate: (ClientConnectorError|ServerDisconnectedError|ClientOSError)\("
        with pytest.raises(Transient, match=cut):
            run_task(first.url, model_dir, env, monkeypatch)
    finally:
        first.stop()
    lost = set(answered)  # sessions of attempt 1 that had a complete first turn before the kill, and no more
    assert lost and len(answered) == len(lost)
    again = ProxyProcess(tmp_path / "proxy-2.log", sglang_router.url, *flags)
    try:
        assert again.wait_probed()[0] == 200
        monkeypatch.setattr(session_environments, "AFTER_FIRST_TURN", [])
        outcome, turns, _ = run_task(again.url, model_dir, env, monkeypatch, attempt=2)
    finally:
        again.stop()
    check_retried_whole(outcome, turns, lost)


def check_retried_whole(outcome, turns, lost: set) -> None:
    """The retry (attempt 2) of a task whose attempt 1 died mid-session: one batch of two new
    sessions, every turn sampled anew, each trained whole on exactly the ids SGLang returned."""
    (batch,) = outcome.batches
    check_batch(batch, vocab_size=VOCAB, current_version=0, max_staleness=0)
    assert (batch.num_samples, batch.attempt) == (2, 2)
    assert len(turns) == 2 and all(len(t) == 3 for t in turns.values())  # two sessions, every turn sampled anew
    assert not lost & set(turns)  # new sessions: nothing of attempt 1 resumed
    for i in range(batch.num_samples):
        part = batch.sample_slice(i)
        ids = sample_ids(batch, i)
        (session_turns,) = [t for t in turns.values() if tuple(ids) == tuple(t[-1][0] + t[-1][1].response_ids.tolist())]
        sampled = [tok for _, arrays in session_turns for tok in arrays.response_ids.tolist()]
        assert batch.response_ids[part][batch.loss_mask[part].astype(bool)].tolist() == sampled


@pytest.mark.slow
def test_an_engine_killed_mid_session_fails_the_task_as_transient_and_the_retry_runs_new_sessions_whole(
    tmp_path, proxy, model_dir, monkeypatch
):
    """Faults (docs/design.md section 12): the SGLang server behind the router and the proxy is
    SIGKILLed (its whole process group) after a session's first turn. Its own server, not the
    session's shared one: the task fails as transient with nothing to publish, whatever turn was
    in flight, and its redelivery, through a router whose engine lives (the shared one), samples
    every turn again in new sessions and is trained whole."""
    engine = SGLangProcess(model_dir, tmp_path / "sglang.log")
    router = proxy_1 = None
    try:
        router = Router(tmp_path / "router.log", [engine.url])
        flags = ("--vocab-size", str(VOCAB), "--rollout-top-logprobs-num", str(K))
        proxy_1 = ProxyProcess(tmp_path / "proxy.log", router.url, *flags)
        assert proxy_1.wait_probed()[0] == 200
        monkeypatch.setattr(
            session_environments, "AFTER_FIRST_TURN", [lambda: os.killpg(engine.proc.pid, signal.SIGKILL)]
        )
        env = "tests.rollout_worker.session_environments:three_turns_with_a_fault"
        real, answered = environment.proxy_generate, []

        async def recording(http, url, body, routing_key):  # every turn the proxy answered, by routing key
            arrays = await real(http, url, body, routing_key)
            answered.append(routing_key)
            return arrays

        monkeypatch.setattr(environment, "proxy_generate", recording)
        # the proxy's answer for an upstream that failed the turn: unreachable (refused, cut off) or the router's 5xx
        with pytest.raises(Transient, match=rf"^{re.escape(proxy_1.url)}/generate answered 5\d\d: ") as failed:
            run_task(proxy_1.url, model_dir, env, monkeypatch)
        print(f"\nattempt 1 failed: {failed.value}")
    finally:
        for part in (proxy_1, router, engine):
            if part is not None:
                part.stop()
    lost = set(answered)  # sessions of attempt 1 that had a complete first turn before the kill, and no more
    assert lost and len(answered) == len(lost)
    monkeypatch.setattr(session_environments, "AFTER_FIRST_TURN", [])
    outcome, turns, _ = run_task(proxy.url, model_dir, env, monkeypatch, attempt=2)
    check_retried_whole(outcome, turns, lost)


# ChatML that shows past replies as a placeholder, as reasoning templates drop past thinking: turn 2's
# rendering no longer extends the tokens the session holds
FORGETFUL = CHAT_TEMPLATE.replace(
    "message['content']", "(message['content'] if message['role'] != 'assistant' else '(a reply)')"
)
# ChatML that raises on a conversation past its first reply (as a template's raise_exception does)
ONE_TURN = "{% if messages | length > 2 %}{{ raise_exception('this template takes one turn') }}{% endif %}"


def reject_swallowed(proxy_url: str, model_dir, monkeypatch, chat_template: str) -> tuple[Rejected, list]:
    """``(the task's rejection, the batches packed)`` of a task whose environment catches the error
    answered for its sessions' second turn and returns a reward anyway."""
    session_environments.CAUGHT.clear()
    real, packed = worker_module.pack_trajectories, []

    def packing(*args, **kwargs):
        packed.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(worker_module, "pack_trajectories", packing)
    env = "tests.rollout_worker.session_environments:swallows_a_refusal"
    with pytest.raises(Rejected) as rejected:
        run_task(proxy_url, model_dir, env, monkeypatch, chat_template=chat_template)
    assert session_environments.CAUGHT == [(400, "session_template")] * 2  # each session's turn 2, caught
    return rejected.value, packed


def test_a_session_template_refusal_the_environment_swallows_rejects_the_task_with_no_batch_packed(
    proxy, model_dir, monkeypatch
):
    """docs/design.md section 12: a session cut short at turn 1 is never trained as if whole."""
    rejected, packed = reject_swallowed(proxy.url, model_dir, monkeypatch, FORGETFUL)
    assert re.fullmatch(
        r"session \w+ refused a turn \(session_template\): session \w+: the chat template renders the history "
        r"differently from the tokens the session holds, from character \d+: .*",
        str(rejected),
    ), str(rejected)
    assert rejected.batch is None and packed == []


def test_a_template_that_raises_inside_a_turn_rejects_the_task_by_name_with_no_batch_packed(
    proxy, model_dir, monkeypatch
):
    rejected, packed = reject_swallowed(proxy.url, model_dir, monkeypatch, ONE_TURN + CHAT_TEMPLATE)
    assert re.fullmatch(
        r"session \w+ refused a turn \(session_template\): the chat template cannot render the conversation: "
        r"TemplateError: this template takes one turn",
        str(rejected),
    ), str(rejected)
    assert rejected.batch is None and packed == []
