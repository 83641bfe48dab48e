"""Sessions, token in, token out: the history a turn must extend, the template's tokens between
turns, budgets, the trajectory as one sample, and the chat endpoint an environment's OpenAI
client talks to. The engine here is a stand-in that answers each turn with given ids (the real
one: tests/rollout_worker/test_session_stack.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from centerline.toy.tokenizer import save_tokenizer
from rollout_worker.chat_template import ChatTemplate
from rollout_worker.packing import pack_trajectories
from rollout_worker.session import Session
from rollout_worker.session_errors import SessionBudgetError, SessionHistoryError, SessionTemplateError
from rollout_worker.session_transport import SessionChat, SessionClients
from rollout_worker.worker import Rejected, Transient
from shared.config import Config
from shared.contract import check_batch
from shared.response_arrays import ResponseArrays
from shared.sampling import Sampling
from shared.task import PromptTask

K, VOCAB, IM_END, EOS = 4, 260, 258, 256


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> ChatTemplate:
    """The default model's byte-level tokenizer with its ChatML template."""
    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(out)
    return ChatTemplate(AutoTokenizer.from_pretrained(str(out)))


class Engine:
    """Answers turn i with ``replies[i]`` (ids, finish reason) at weight version ``version``: a row
    of K distinct candidates led by the sampled token; records each turn's input ids."""

    def __init__(self, replies, version: int = 0, fail: Exception | None = None, cached=None):
        self.replies, self.version, self.fail, self.inputs = list(replies), version, fail, []
        self.cached = list(cached) if cached is not None else None  # each turn's cached_tokens, as SGLang says

    async def __call__(self, input_ids, max_new_tokens, stop):
        self.inputs.append((list(input_ids), max_new_tokens, stop))
        if self.fail is not None:
            raise self.fail
        ids, finish = self.replies.pop(0)
        n = len(ids)
        cand = np.array([[t, *[(t + j) % 256 for j in range(1, K)]] for t in ids], np.int32).reshape(n, K)
        lps = np.tile(np.float32([-0.1, -4.0, -4.0, -4.0]), (n, 1))
        return ResponseArrays(
            texts=[""],
            finish_reasons=[finish],
            weight_versions=[self.version],
            prompt_ids=None,
            offsets=np.array([0, n], np.int64),
            response_ids=np.array(ids, np.int32),
            sampled_logprobs=np.full(n, -0.1, np.float32),
            cand_ids=cand,
            cand_logprobs=lps,
            cached_tokens=[self.cached.pop(0)] if self.cached is not None else None,
        )


def text_ids(text: str) -> list[int]:
    return list(text.encode())


def session(template, engine, budget: int = 1024) -> Session:
    return Session("s1", template, engine, k=K, budget=budget)


def turn(s: Session, messages, max_new_tokens: int = 16):
    return asyncio.run(s.turn(messages, max_new_tokens=max_new_tokens))


def three_turns(template):
    engine = Engine(
        [
            (text_ids("hi") + [IM_END], "stop"),
            (text_ids("ok!"), "length"),  # cut off: the template closes the turn itself
            (text_ids("bye") + [IM_END], "stop"),
        ]
    )
    s = session(template, engine)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"}]
    replies = []
    for user in ("b", "c", None):
        reply = turn(s, messages)
        replies.append(reply)
        messages = [*messages, {"role": "assistant", "content": reply.content}]
        if user is not None:
            messages.append({"role": "user", "content": user})
    return s, engine, replies, messages


def test_three_turns_train_exactly_the_sampled_ids_with_the_templates_tokens_between_them(template):
    s, engine, replies, final = three_turns(template)
    assert [r.content for r in replies] == ["hi", "ok!", "bye"]  # less <|im_end|>, which the template writes
    assert [r.finish_reason for r in replies] == ["stop", "length", "stop"]
    t = s.trajectory()
    first = template.encode(template.render(final[:2]))
    assert t.prompt_ids.tolist() == first == engine.inputs[0][0]
    ids = t.prompt_ids.tolist() + t.response_ids.tolist()
    # each turn's input is every token so far: nothing re-tokenized
    sampled = [text_ids("hi") + [IM_END], text_ids("ok!"), text_ids("bye") + [IM_END]]
    for i, (inputs, _, _) in enumerate(engine.inputs):
        assert ids[: len(inputs)] == inputs and ids[len(inputs) : len(inputs) + len(sampled[i])] == sampled[i]
    assert ids[-len(sampled[2]) :] == sampled[2]
    trained = [tok for tok, m in zip(t.response_ids.tolist(), t.loss_mask.tolist()) if m]
    assert trained == sum(sampled, [])  # loss mask 1 exactly on the sampled ids
    assert template.decode(ids) + "\n" == template.tok.apply_chat_template(final, tokenize=False)
    untrained = t.loss_mask == 0
    assert (t.cand_ids[untrained] == -1).all() and (t.cand_logprobs[untrained] == -np.inf).all()
    assert (t.cand_ids[~untrained] >= 0).all() and (t.sampled_logprobs[untrained] == 0).all()
    # turn 2 was cut off: <|im_end|> after it is the template's, untrained
    after_ok = len(engine.inputs[1][0]) + len(sampled[1]) - len(first)
    assert (t.response_ids[after_ok], t.loss_mask[after_ok]) == (IM_END, 0)


def test_a_trajectory_is_one_sample_of_a_batch_that_passes_the_contract(template):
    s, _, _, _ = three_turns(template)
    other, _, _, _ = three_turns(template)
    task = PromptTask("run/0/1", "run/g1", "", "", "exact", 2, 0, environment="m:f")
    rewards = np.array([1.0, 0.0])
    settings = dict(producer="w", sampling=Sampling(k=K, temperature=1.0, top_p=1.0, top_k=-1, mode="selected"))
    batch = pack_trajectories(task, [s.trajectory(), other.trajectory()], rewards, rewards - 0.5, attempt=2, **settings)
    check_batch(batch, vocab_size=VOCAB, current_version=0, max_staleness=0)
    assert (batch.batch_id, batch.task_id, batch.attempt, batch.num_samples) == ("run/0/1#2", "run/0/1", 2, 2)
    assert batch.prompt_offsets.tolist() == [0, len(s.trajectory().prompt_ids), 2 * len(s.trajectory().prompt_ids)]


def test_each_token_keeps_the_version_that_sampled_it(template):
    engine = Engine([(text_ids("x") + [IM_END], "stop"), (text_ids("y") + [IM_END], "stop")], version=3)
    s = session(template, engine)
    reply = turn(s, [{"role": "user", "content": "a"}])
    engine.version = 4  # an update between the turns
    turn(
        s,
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": reply.content},
            {"role": "user", "content": "b"},
        ],
    )
    t = s.trajectory()
    assert sorted(set(t.token_versions[t.loss_mask == 1].tolist())) == [3, 4]
    assert t.token_versions[t.loss_mask == 1].tolist() == [3, 3, 4, 4]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: [{**m[0], "content": "A"}, *m[1:]], r"^message 0 differs from the session's history"),
        (lambda m: [m[0], {**m[1], "content": "other"}, *m[2:]], r"^message 1 differs"),
        (lambda m: [m[1], m[0], *m[2:]], r"^message 0 differs"),
        (lambda m: m[:2], r"adds no message"),
        (lambda m: m[:1], r"a past message was dropped"),
    ],
)
def test_a_history_the_session_did_not_have_is_refused_by_name(template, edit, message):
    engine = Engine([(text_ids("hi") + [IM_END], "stop"), (text_ids("x"), "stop")])
    s = session(template, engine)
    reply = turn(s, [{"role": "user", "content": "a"}])
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": reply.content}]
    with pytest.raises(SessionHistoryError, match=message):
        turn(s, edit([*messages, {"role": "user", "content": "b"}]))
    assert len(engine.inputs) == 1  # nothing sent
    # what an OpenAI client sends back of a reply (nulls, text parts) is the same message
    given = [messages[0], {**messages[1], "refusal": None, "tool_calls": None}, {"role": "user", "content": "b"}]
    given[1]["content"] = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    turn(s, given)


def test_a_template_that_rewrites_a_past_turn_is_refused_by_name(template):
    class Forgetful(ChatTemplate):
        """Drops past assistant content, as reasoning templates drop past thinking."""

        def render(self, messages, tools=None, variables=None):
            shown = [m if m["role"] != "assistant" else {**m, "content": ""} for m in messages]
            return super().render(shown, tools, variables)

    s = session(Forgetful(template.tok), Engine([(text_ids("hi") + [IM_END], "stop")]))
    reply = turn(s, [{"role": "user", "content": "a"}])
    again = [{"role": "user", "content": "a"}, {"role": "assistant", "content": reply.content}]
    with pytest.raises(
        SessionTemplateError, match=r"renders the history differently from the tokens the session holds"
    ):
        turn(s, [*again, {"role": "user", "content": "b"}])


def test_a_turn_that_could_pass_the_session_budget_is_not_run_and_the_session_ends(template):
    engine = Engine([(text_ids("hi") + [IM_END], "stop")])
    first = [{"role": "user", "content": "a"}]
    prompt = len(template.encode(template.render(first)))
    s = session(template, engine, budget=prompt + 3 + 30)
    reply = turn(s, first, max_new_tokens=16)
    assert reply.finish_reason == "stop" and s.finish is None
    more = [*first, {"role": "assistant", "content": reply.content}, {"role": "user", "content": "b"}]
    with pytest.raises(SessionBudgetError, match=r"would pass the session token budget of .* after its last complete"):
        turn(s, more, max_new_tokens=16)
    assert s.finish == "session_budget" and len(engine.inputs) == 1
    assert s.trajectory().loss_mask.sum() == 3  # the completed turn is kept whole
    with pytest.raises(SessionBudgetError, match=r"has ended \(session_budget\)"):
        turn(s, more, max_new_tokens=1)


def test_a_reply_ended_by_another_special_token_keeps_it_and_the_template_still_extends(template):
    """<|endoftext|> is no end of turn for ChatML: it stays in the reply, and the template closes the turn."""
    s = session(template, Engine([(text_ids("x") + [EOS], "stop"), (text_ids("y"), "length")]))
    reply = turn(s, [{"role": "user", "content": "a"}])
    assert reply.content == "x<|endoftext|>"
    turn(
        s,
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": reply.content},
            {"role": "user", "content": "b"},
        ],
    )
    assert s.trajectory().loss_mask.sum() == 3


# ---------------------------------------------------------------------------- the chat endpoint


def serve(template, engine, cfg: Config | None = None, budget: int = 1024, transport: str = "in-process"):
    """``(endpoint, session, client)`` inside a running loop: the task's clients over ``transport``
    (``failures``, ``close()``) as the worker makes them, and one session's client."""

    async def start():
        endpoint = SessionClients(SessionChat(cfg or Config(rollout_max_new_tokens=16)), transport, timeout=60)
        await endpoint.start()
        s = session(template, engine, budget)
        return endpoint, s, endpoint.client(s)

    return start()


def test_an_openai_client_drives_a_session_through_the_endpoint(template, transport):
    async def go():
        endpoint, s, client = await serve(
            template, Engine([(text_ids("hi") + [IM_END], "stop"), (text_ids("yo"), "length")]), transport=transport
        )
        try:
            messages = [{"role": "user", "content": "a"}]
            first = await client.chat.completions.create(model="default", messages=messages, max_tokens=8)
            messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "b"}]
            second = await client.chat.completions.create(model="default", messages=messages, stop=["\n"])
            with pytest.raises(openai.BadRequestError) as edited:
                await client.chat.completions.create(model="default", messages=[{"role": "user", "content": "z"}])
            return first, second, edited.value, s
        finally:
            await client.close()
            await endpoint.close()

    first, second, edited, s = asyncio.run(go())
    assert (first.choices[0].message.content, first.choices[0].finish_reason) == ("hi", "stop")
    assert (first.usage.completion_tokens, first.usage.prompt_tokens) == (3, len(s.trajectory().prompt_ids))
    assert (second.choices[0].message.content, second.choices[0].finish_reason) == ("yo", "length")
    assert edited.code == "session_history" and "message 0 differs from the session's history" in edited.body["message"]
    assert s.turns == 2


def test_each_turn_says_the_prompt_tokens_sglangs_prefix_cache_served(template, transport):
    """SGLang's cached_tokens of each turn: in the answer's usage (OpenAI's prompt_tokens_details) and on
    the session, whose turns 2 and later are what session affinity is measured by."""

    async def go():
        engine = Engine([(text_ids("hi") + [IM_END], "stop"), (text_ids("yo"), "length")], cached=[0, 9])
        endpoint, s, client = await serve(template, engine, transport=transport)
        try:
            messages = [{"role": "user", "content": "a"}]
            first = await client.chat.completions.create(model="default", messages=messages)
            assert s.later_turns_cache() is None  # no turn 2 yet
            messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "b"}]
            second = await client.chat.completions.create(model="default", messages=messages)
            return first, second, s
        finally:
            await client.close()
            await endpoint.close()

    first, second, s = asyncio.run(go())
    assert (first.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens_details.cached_tokens) == (0, 9)
    assert s.turn_cached_tokens == [0, 9] and s.later_turns_cache() == (second.usage.prompt_tokens, 9)
    quiet = session(template, Engine([(text_ids("hi"), "stop"), (text_ids("yo"), "stop")]))  # SGLang said nothing
    turn(quiet, [{"role": "user", "content": "a"}])
    second = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "hi"}]
    second.append({"role": "user", "content": "b"})
    turn(quiet, second)
    assert quiet.turn_cached_tokens == [None, None] and quiet.later_turns_cache() is None


def test_the_endpoint_passes_the_per_turn_limit_and_stop_strings_and_refuses_other_sampling(template, transport):
    async def go():
        engine = Engine([(text_ids("hi"), "length")])
        endpoint, s, client = await serve(template, engine, transport=transport)
        try:
            await client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "a"}], max_completion_tokens=99, stop="."
            )
            refusals = []
            for extra in ({"temperature": 0.5}, {"n": 2}, {"presence_penalty": 1.0}):
                with pytest.raises(openai.BadRequestError) as err:
                    await client.chat.completions.create(
                        model="default", messages=[{"role": "user", "content": "a"}], **extra
                    )
                refusals.append(err.value)
            return engine, refusals
        finally:
            await client.close()
            await endpoint.close()

    engine, refusals = asyncio.run(go())
    assert engine.inputs[0][1:] == (16, ["."])  # the run's per-turn cap wins over a larger max_completion_tokens
    assert [r.code for r in refusals] == ["unsupported_setting"] * 3
    assert "temperature: is 0.5, the run samples at 1.0" in refusals[0].body["message"]


def test_an_engine_failure_is_answered_503_and_kept_for_the_task(template, transport):
    async def go():
        endpoint, _, client = await serve(
            template, Engine([], fail=Transient("proxy unreachable")), transport=transport
        )
        try:
            with pytest.raises(openai.InternalServerError) as err:
                await client.chat.completions.create(model="default", messages=[{"role": "user", "content": "a"}])
            return endpoint, err.value
        finally:
            await client.close()
            await endpoint.close()

    endpoint, err = asyncio.run(go())
    assert err.status_code == 503 and err.code == "engine_failed"
    assert [str(f) for f in endpoint.failures] == ["proxy unreachable"]


def test_a_turn_past_the_budget_is_openais_context_length_exceeded(template, transport):
    async def go():
        endpoint, s, client = await serve(template, Engine([]), budget=20, transport=transport)
        try:
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="default", messages=[{"role": "user", "content": "a"}])
            return err.value, s
        finally:
            await client.close()
            await endpoint.close()

    err, s = asyncio.run(go())
    assert err.code == "context_length_exceeded" and "session token budget of 20" in err.body["message"]
    assert s.finish == "session_budget"


# ---------------------------------------------------------------------------- a task's sessions

ENVS = "tests.rollout_worker.session_environments"


def process(
    template,
    monkeypatch,
    env: str,
    engine: Engine,
    n: int = 2,
    prompt: str = "a",
    answer: str = "",
    transport: str = "in-process",
):
    """The worker's ``process`` of a task naming ``env`` (a function of session_environments.py, or a
    built-in environment), its turns answered by ``engine``, its sessions' clients over ``transport``
    (the worker's ``session_transport``)."""
    from rollout_worker import environment
    from rollout_worker.worker import Tokenizer, Worker
    from shared.settings import WorkerSettings

    async def fake(http, url, body, routing_key):
        params = body["sampling_params"]
        assert body["top_logprobs_num"] == K and body["return_logprob"] is True and params["n"] == 1
        return await engine(body["input_ids"], params["max_new_tokens"], params.get("stop"))

    monkeypatch.setattr(environment, "proxy_generate", fake)
    cfg = Config(rollout_top_logprobs_num=K, rollout_max_new_tokens=16, rollout_n=n)
    settings = WorkerSettings(worker_id="w", vocab_size=VOCAB, session_transport=transport)
    worker = Worker(cfg, settings, Tokenizer(None, None, chat=template.tok))
    from shared.toy_tasks import ENVIRONMENTS

    environment = env if env in ENVIRONMENTS else f"{ENVS}:{env}"
    task = PromptTask("run/0/4", "run/g4", prompt, answer, "exact", n, 0, environment=environment)
    return asyncio.run(worker.process(task, attempt=3))


def test_a_task_naming_an_environment_runs_n_sessions_into_one_batch_with_group_advantages(
    template, monkeypatch, transport
):
    engine = Engine([(text_ids("hi") + [IM_END], "stop"), (text_ids("hello") + [IM_END], "stop")])
    outcome = process(template, monkeypatch, "one_turn", engine, transport=transport)
    (batch,) = outcome.batches
    check_batch(batch, vocab_size=VOCAB)
    assert (batch.task_id, batch.attempt, batch.parts, batch.num_samples) == ("run/0/4", 3, 1, 2)
    assert sorted(outcome.rewards.tolist()) == [2.0, 5.0] and sorted(batch.advantages.tolist()) == [-1.5, 1.5]
    assert outcome.tokens == 3 + 6 == int(batch.loss_mask.sum())


def test_a_tasks_outcome_counts_its_sessions_later_turns_prompt_and_cached_tokens(template, monkeypatch):
    """What the worker's metrics add up (centerline_worker_session_later_*): turns 2 and later only."""
    from rollout_worker.main import WorkerMetrics

    replies = [(text_ids("a") + [IM_END], "stop"), (text_ids("b") + [IM_END], "stop"), (text_ids("c"), "length")]
    engine = Engine(replies, cached=[0, 5, 9])
    outcome = process(template, monkeypatch, "three_turns_with_a_fault", engine, n=1)
    later = sum(len(ids) for ids, _, _ in engine.inputs[1:])
    assert outcome.later_turns_cache == (later, 5 + 9)
    metrics = WorkerMetrics()
    metrics.done(outcome, 1.0)
    value = metrics.registry.get_sample_value
    assert value("centerline_worker_session_later_prompt_tokens_total") == later
    assert value("centerline_worker_session_later_cached_tokens_total") == 14


def test_the_chain_environment_scores_each_step_and_restates_the_sum_after_a_wrong_answer(template, monkeypatch):
    """The built-in ``chain``: one turn per step; after the wrong "1" the user restates the true
    value ("2+2"), after a right answer only the next number; the reward is the share right."""
    from shared.contract import sample_turns

    replies = [(text_ids("7") + [IM_END], "stop"), (text_ids("1") + [IM_END], "stop"), (text_ids("45"), "length")]
    engine = Engine(replies)
    outcome = process(template, monkeypatch, "chain", engine, n=1, prompt="3+4 +5 +2", answer="7 2 4")
    assert outcome.rewards.tolist() == [1 / 3]  # "7" right, "1" wrong, "45" wrong (cut off by its limit)
    users = [template.decode(ids).split("<|im_start|>user\n")[-1].split("<|im_end|>")[0] for ids, _, _ in engine.inputs]
    assert users == ["3+4", "+5", "2+2"]
    assert [limit for _, limit, _ in engine.inputs] == [8, 8, 8]  # the environment's max_tokens
    [batch] = outcome.batches
    assert sample_turns(batch) == [3] and batch.finish_reasons == ["length"]


def test_an_engine_failure_in_a_turn_fails_the_task_as_transient_whatever_the_environment_does(
    template, monkeypatch, transport
):
    with pytest.raises(Transient, match="proxy unreachable"):
        process(
            template,
            monkeypatch,
            "shrugs_off_errors",
            Engine([], fail=Transient("proxy unreachable")),
            transport=transport,
        )


@pytest.mark.parametrize(
    "env, refused, message",
    [
        ("raises", False, r"environment '.*:raises' failed in session \w+: RuntimeError\('the environment broke'\)"),
        ("returns_nan", False, r"returned nan, expected a finite reward"),
        ("no_turn", False, r"returned without a turn in session"),
        ("shrugs_off_errors", True, r"^the proxy refused it$"),  # the proxy's refusal, whatever the environment did
        ("not_async", False, r"is not an async function"),
        ("missing", False, r"cannot be loaded"),
    ],
)
def test_an_environment_that_fails_or_gives_no_reward_or_no_turn_rejects_the_task_by_name(
    template, monkeypatch, env, refused, message, transport
):
    from rollout_worker.worker import Rejected

    replies = [(text_ids("hi") + [IM_END], "stop")] * 2
    engine = Engine(replies, fail=Rejected("the proxy refused it") if refused else None)
    with pytest.raises(Rejected, match=message):
        process(template, monkeypatch, env, engine, transport=transport)


def test_a_session_budget_that_leaves_no_room_for_a_turn_is_refused_naming_both_settings():
    from shared.config import ConfigError, resolve

    def built(**values):
        return resolve(env={}, defaults=values)

    with pytest.raises(ConfigError, match=r"^--rollout-session-max-tokens 16: .* above --rollout-max-new-tokens$"):
        built(rollout_session_max_tokens=16, rollout_max_new_tokens=16)
    assert built().rollout.session_max_tokens == 1024


def test_an_engine_failure_after_a_complete_turn_still_fails_the_task_whole(template, monkeypatch):
    """A session is trained whole or not at all: a failure in turn 3 discards turns 1 and 2."""

    class FailsThirdTurn(Engine):
        async def __call__(self, input_ids, max_new_tokens, stop):
            if len(self.inputs) == 2:
                self.fail = Transient("SGLang went away")
            return await super().__call__(input_ids, max_new_tokens, stop)

    replies = [(text_ids("hi") + [IM_END], "stop")] * 4
    with pytest.raises(Transient, match="SGLang went away"):
        process(template, monkeypatch, "three_turns", FailsThirdTurn(replies), n=1)


@pytest.mark.parametrize(
    "status, ctype, body, kind, message",
    [
        (400, "application/json", b'{"error": "top_p"}', "Rejected", r"refused the request with 400"),
        (502, "application/json", b'{"error": {"rule": "short_row"}}', "Transient", r"answered 502"),
        (
            502,
            "application/json",
            b'{"error": {"rule": "upstream_too_large"}}',
            "Rejected",
            r"cut off an upstream answer above its --max-upstream-response-bytes",
        ),
        (
            502,
            "application/json",
            b'{"error": {"rule": "length_clipped", "message": "sample 0 finished \'length\' at 22 tokens"}}',
            "Rejected",
            r"the proxy refused the engine's answer: .*length_clipped.*at 22 tokens",
        ),
        (
            502,
            "application/json",
            b'{"error": {"rule": "prompt_over_engine_limit"}}',
            "Rejected",
            r"the proxy refused the engine's answer: .*prompt_over_engine_limit",
        ),
        (502, "application/json", b'{"error": {"rule": "sample_aborted"}}', "Transient", r"answered 502"),
        (503, "application/json", b"{}", "Transient", r"answered 503"),
        (200, "application/json", b"{}", "Transient", r"not application/x-centerline-arrays"),
        (200, "application/x-centerline-arrays", b"\x80", "Transient", r"unusable response from the proxy"),
    ],
)
def test_the_proxys_answers_map_to_transient_or_rejected(status, ctype, body, kind, message):
    import aiohttp
    from aiohttp import web

    from rollout_worker import worker
    from rollout_worker.environment import proxy_generate

    seen = {}

    async def answer(request):
        seen["key"] = request.headers.get("X-SMG-Routing-Key")
        return web.Response(status=status, body=body, content_type=ctype)

    async def go():
        app = web.Application()
        app.router.add_post("/generate", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as http:
                with pytest.raises(getattr(worker, kind), match=message):
                    await proxy_generate(http, url, {"input_ids": [1]}, routing_key="sess-1")
                await runner.cleanup()
                with pytest.raises(Transient, match="generate"):  # unreachable
                    await proxy_generate(http, url, {"input_ids": [1]}, routing_key="sess-1")
        finally:
            await runner.cleanup()

    asyncio.run(go())
    assert seen["key"] == "sess-1"


def test_tools_go_to_the_chat_template_that_takes_them(tmp_path):
    """A template that lists the tools first: the session's first prompt holds them, every turn
    renders them the same way, so the history still extends."""
    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.chat_template = (
        "{% if tools %}{{ '<|im_start|>system\\ntools: ' + (tools | map(attribute='function.name') | join(',')) "
        "+ '<|im_end|>\\n' }}{% endif %}" + tok.chat_template
    )
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    engine = Engine([(text_ids("3") + [IM_END], "stop"), (text_ids("5") + [IM_END], "stop")])
    s = session(ChatTemplate(tok), engine)
    first = [{"role": "user", "content": "1+2"}]
    reply = asyncio.run(s.turn(first, max_new_tokens=4, tools=tools))
    again = [*first, {"role": "assistant", "content": reply.content}, {"role": "user", "content": "2+3"}]
    asyncio.run(s.turn(again, max_new_tokens=4, tools=tools))
    assert bytes(t for t in engine.inputs[0][0] if t < 256).startswith(b"system\ntools: add")
    with pytest.raises(SessionTemplateError):  # the tools dropped: the rendering no longer extends the session
        asyncio.run(
            s.turn([*again, {"role": "assistant", "content": "5"}, {"role": "user", "content": "x"}], max_new_tokens=4)
        )


def test_between_turns_runs_as_each_later_turn_arrives_before_it_is_sampled(template):
    """The hook of the failpoint ``worker.between_turns``: turn n's number (2 and later), before
    the engine sees anything of that turn."""
    engine = Engine([(text_ids(t) + [IM_END], "stop") for t in ("x", "y", "z")])
    seen = []
    s = Session("s1", template, engine, k=K, budget=1024, between_turns=lambda n: seen.append((n, len(engine.inputs))))
    messages = [{"role": "user", "content": "a"}]
    for user in ("b", "c", None):
        reply = turn(s, messages)
        messages = [*messages, {"role": "assistant", "content": reply.content}]
        if user is not None:
            messages.append({"role": "user", "content": user})
    assert seen == [(2, 1), (3, 2)]


def test_a_workers_sessions_pass_the_failpoint_between_turns(template, monkeypatch):
    """``sample_sessions`` hits ``worker.between_turns`` with the arriving turn's number, once per
    later turn of each session (the built-in chain: a 3-step problem is 3 turns)."""
    from shared import faults

    hits = []
    monkeypatch.setattr(faults, "hit", lambda name, step=None: hits.append((name, step)))
    engine = Engine([(text_ids("7") + [IM_END], "stop")] * 6)
    outcome = process(template, monkeypatch, "chain", engine, n=2, prompt="3+4 +5 +2", answer="7 2 4")
    assert outcome.batches[0].num_samples == 2
    assert sorted(hits) == [("worker.between_turns", 2)] * 2 + [("worker.between_turns", 3)] * 2


# ---------------------------------------------------------------------------- refusals, fatal and recoverable


def dummy_prefix_template() -> ChatTemplate:
    """A sentencepiece-style (Llama) tokenizer: byte-fallback pieces and a dummy prefix space ("▁",
    id 256) before the first piece of each text it encodes, which its decoder strips at the start;
    the same ChatML template and specials (<|endoftext|> 257, <|im_start|> 258, <|im_end|> 259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from centerline.toy.tokenizer import CHAT_TEMPLATE, EOS, IM_END, IM_START, PAD, SPECIALS

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"\u2581": 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    return ChatTemplate(fast)


def test_a_tokenizer_with_a_dummy_prefix_space_is_refused_in_context_and_replies_decode_in_context():
    """The new messages' ids decode alone to their text (the leading "▁" is stripped at the start),
    but after the session's tokens they read " \\n<|im_start|>...": the session refuses the turn rather
    than train on a space the template never wrote. A reply that starts with "▁" reads " hi" in context."""
    sp = dummy_prefix_template()
    engine = Engine([([256, 104, 105, 259], "stop"), ([120], "stop")])  # "▁hi<|im_end|>"
    s = session(sp, engine)
    reply = turn(s, [{"role": "user", "content": "a"}])
    assert reply.content == " hi" and s.text == sp.decode(s.ids)
    again = [{"role": "user", "content": "a"}, {"role": "assistant", "content": reply.content}]
    suffix = sp.render([*again, {"role": "user", "content": "b"}])[len(s.text) :]
    assert sp.decode(sp.encode(suffix)) == suffix  # what the check on the suffix alone accepts
    with pytest.raises(SessionTemplateError, match=r"does not survive tokenization: .* to ' \\n<\|im_start\|>user"):
        turn(s, [*again, {"role": "user", "content": "b"}])
    assert len(engine.inputs) == 1  # nothing sent


def endpoint_request(template, engine, cfg: Config | None = None, budget: int = 1024, transport="in-process", **kwargs):
    """``(endpoint, error or completion)`` of one request with ``kwargs`` through a session's client."""

    async def go():
        endpoint, _, client = await serve(template, engine, cfg, budget, transport)
        try:
            try:
                return endpoint, await client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": "a"}], **kwargs
                )
            except openai.APIStatusError as err:
                return endpoint, err
        finally:
            await client.close()
            await endpoint.close()

    return asyncio.run(go())


@pytest.mark.parametrize(
    "kwargs, code, message",
    [
        ({"seed": 7}, "unsupported_setting", "seed: is 7; the run samples with the engine's own randomness"),
        ({"logprobs": True}, "unsupported_setting", "logprobs: is True; the endpoint answers no log-probs"),
        ({"top_logprobs": 5}, "unsupported_setting", "top_logprobs: is 5; the endpoint answers no log-probs"),
        ({"tool_choice": "required"}, "unsupported_setting", "tool_choice: is required; the endpoint parses the calls"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "add"}}},
            "invalid_request",
            "tool_choice: names the function 'add', not among the request's tools (no tools)",
        ),
        ({"parallel_tool_calls": False}, "unsupported_setting", "parallel_tool_calls: is False; the endpoint parses"),
        ({"stream": True}, "unsupported_setting", "stream: is True; a session's turn is answered whole"),
        ({"response_format": {"type": "json_object"}}, "unsupported_setting", "response_format: is {'type': 'json_o"),
        ({"reasoning_effort": "low"}, "unsupported_setting", "reasoning_effort: is low; a template that reads it"),
        ({"logit_bias": {"5": 1}}, "unsupported_setting", "logit_bias: is {'5': 1}; it changes the distribution"),
        ({"frequency_penalty": 0.5}, "unsupported_setting", "frequency_penalty: is 0.5; it changes the distribution"),
        ({"n": 2}, "unsupported_setting", "n: is 2; a session's turn is one reply"),
        ({"top_p": 0.5}, "unsupported_setting", "top_p: is 0.5, the run samples at 1.0 (--rollout-top-p)"),
        ({"extra_body": {"top_k": 5}}, "unsupported_setting", "top_k: is 5, the run samples at -1 (--rollout-top-k)"),
        ({"extra_body": {"min_tokens": 2}}, "unsupported_setting", "min_tokens: is 2; it changes the distribution"),
        ({"extra_body": {"regex": "a+"}}, "unsupported_setting", "regex: not a chat-completions field this endpoint"),
        (
            {"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}},
            "unsupported_setting",
            "chat_template_kwargs: ['add_generation_prompt'] are arguments the endpoint sets itself",
        ),
        ({"max_tokens": 0}, "invalid_request", "max_tokens: is 0, expected a positive integer"),
        ({"extra_body": {"temperature": "hot"}}, "invalid_request", "temperature: is 'hot', expected a number"),
        ({"extra_body": {"stop": 5}}, "invalid_request", "stop: is 5, expected a string or a list of strings"),
        ({"extra_body": {"messages": [1]}}, "invalid_request", "messages: a message must be an object with a role"),
        (
            {"extra_body": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}},
            "unsupported_setting",
            "messages: content parts other than text are not supported",
        ),
    ],
)
def test_a_request_the_endpoint_does_not_honour_is_refused_by_name_and_kept_to_fail_the_task(
    template, kwargs, code, message, transport
):
    engine = Engine([])
    endpoint, err = endpoint_request(template, engine, transport=transport, **kwargs)
    assert (err.status_code, err.code) == (400, code)
    assert err.body["message"].startswith(message) and err.body["message"].endswith("; the task will be rejected")
    assert engine.inputs == []  # nothing sampled
    (kept,) = endpoint.failures
    assert (
        isinstance(kept, Rejected)
        and str(kept)
        == f"session s1 refused a turn ({code}): " + err.body["message"][: -len("; the task will be rejected")]
    )


def test_neutral_and_run_settings_are_accepted_and_chat_template_kwargs_reach_the_template(tmp_path, transport):
    """What a harness sends by default (OpenAI's neutral values, the run's own sampling, who calls)
    takes the turn as if unset; ``chat_template_kwargs`` are the template's variables."""
    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.chat_template = "{% if persona %}<|im_start|>system\n{{ persona }}<|im_end|>\n{% endif %}" + tok.chat_template
    engine = Engine([(text_ids("hi") + [IM_END], "stop")])
    neutral = dict(
        temperature=1.0,
        top_p=1.0,
        n=1,
        logprobs=False,
        top_logprobs=0,
        tool_choice="auto",
        parallel_tool_calls=True,
        stream=False,
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        response_format={"type": "text"},
        store=False,
        service_tier="auto",
        modalities=["text"],
        user="harness-1",
        metadata={"run": "r"},
        prompt_cache_key="k",
        safety_identifier="u",
    )
    extra = {"top_k": -1, "min_tokens": 0, "repetition_penalty": 1.0, "chat_template_kwargs": {"persona": "terse"}}
    endpoint, reply = endpoint_request(ChatTemplate(tok), engine, transport=transport, extra_body=extra, **neutral)
    assert reply.choices[0].message.content == "hi" and endpoint.failures == []
    assert engine.inputs[0][0][:15] == [257, *text_ids("system\nterse"), IM_END, *text_ids("\n")]


def test_any_exception_inside_a_turn_is_answered_as_a_named_json_error_and_kept_to_fail_the_task(template, transport):
    endpoint, err = endpoint_request(template, Engine([], fail=RuntimeError("the stand-in broke")), transport=transport)
    assert (type(err), err.status_code, err.code) == (openai.InternalServerError, 500, "internal_error")
    reason = "session s1: the turn failed: RuntimeError: the stand-in broke"
    assert err.body["message"] == reason + "; the task will be rejected"
    assert [str(f) for f in endpoint.failures] == [reason + " (internal_error)"]
    assert isinstance(endpoint.failures[0], Rejected)


def test_a_history_and_a_budget_refusal_are_logged_and_leave_the_session_trainable(template, caplog, transport):
    """The environment may catch these and go on or finish: nothing is kept to fail the task."""

    async def go():
        engine = Engine([(text_ids("hi") + [IM_END], "stop")])
        first = [{"role": "user", "content": "a"}]
        budget = len(template.encode(template.render(first))) + 3 + 30
        endpoint, s, client = await serve(template, engine, budget=budget, transport=transport)
        codes = []
        try:
            reply = await client.chat.completions.create(model="default", messages=first)
            for messages in (
                [{"role": "user", "content": "edited"}, reply.choices[0].message.model_dump()],
                [*first, reply.choices[0].message.model_dump(), {"role": "user", "content": "b"}],
            ):
                with pytest.raises(openai.BadRequestError) as err:
                    await client.chat.completions.create(model="default", messages=messages)
                codes.append(err.value.code)
            return endpoint, s, codes
        finally:
            await client.close()
            await endpoint.close()

    with caplog.at_level("INFO", logger="centerline.worker"):
        endpoint, s, codes = asyncio.run(go())
    assert codes == ["session_history", "context_length_exceeded"] and endpoint.failures == []
    logged = [(r.getMessage(), r.fields["code"]) for r in caplog.records if r.name == "centerline.worker"]
    assert logged == [
        ("a session's turn was refused; the environment may go on", "session_history"),
        ("a session's turn was refused; the environment may go on", "context_length_exceeded"),
    ]
    assert s.trajectory().loss_mask.sum() == 3  # the complete turn


@pytest.mark.parametrize(
    "value, reward",
    [
        (np.float32(0.25), 0.25),
        (np.float64(0.5), 0.5),
        (np.array(0.75), 0.75),
        (np.array(2, np.int64), 2.0),
        (np.int64(3), 3.0),
    ],
)
def test_a_numpy_reward_is_taken_as_a_float(template, monkeypatch, value, reward):
    from tests.rollout_worker import session_environments

    monkeypatch.setattr(session_environments, "RETURNS", [value])
    engine = Engine([(text_ids("hi") + [IM_END], "stop")] * 2)
    outcome = process(template, monkeypatch, "returns_given", engine)
    assert outcome.rewards.tolist() == [reward, reward]


@pytest.mark.parametrize("value", [np.array([0.25]), np.float32("nan"), np.float64("inf"), np.bool_(True), "0.5", None])
def test_a_reward_that_is_not_one_finite_number_rejects_the_task_by_name(template, monkeypatch, value):
    from tests.rollout_worker import session_environments

    monkeypatch.setattr(session_environments, "RETURNS", [value])
    engine = Engine([(text_ids("hi") + [IM_END], "stop")] * 2)
    with pytest.raises(Rejected, match=r"returned .*, expected a finite reward \(a float\)$"):
        process(template, monkeypatch, "returns_given", engine)
