"""How an environment's OpenAI client reaches its session (rollout_worker/session_transport.py): in
process by default, no socket; over loopback HTTP for an agent out of process; both answer alike,
outside the chat route too; a client's timeout leaves its turn going, and the task's end cancels
what is still running. The engine is the stand-in of test_session.py (the real one:
tests/rollout_worker/test_session_stack.py)."""

from __future__ import annotations

import argparse
import asyncio
import re
import socket

import openai
import pytest

from rollout_worker.session_transport import IN_PROCESS_URL, SessionChat, SessionClients
from shared.config import Config, add_arguments, parse_args
from shared.settings import WorkerSettings
from tests.rollout_worker import session_environments
from tests.rollout_worker.test_session import IM_END, Engine, process, serve, session, template, text_ids  # noqa: F401

FIRST = [{"role": "user", "content": "a"}]


class NoSockets(socket.socket):
    def __init__(self, *args, **kwargs):
        raise AssertionError("a socket was opened")


def test_in_process_a_session_is_turned_without_a_socket_and_its_base_url_names_no_host(template, monkeypatch):  # noqa: F811
    async def go():
        engine = Engine([(text_ids("hi") + [IM_END], "stop")])
        endpoint, s, client = await serve(template, engine, transport="in-process")
        try:
            with monkeypatch.context() as m:
                m.setattr(socket, "socket", NoSockets)  # after the loop made its own
                reply = await client.chat.completions.create(model="default", messages=FIRST)
            return endpoint, s, client, reply
        finally:
            await client.close()
            await endpoint.close()

    endpoint, s, client, reply = asyncio.run(go())
    assert str(client.base_url) == f"{IN_PROCESS_URL}/sessions/s1/v1/" and endpoint.endpoint is None
    assert reply.choices[0].message.content == "hi" and s.turns == 1 and endpoint.failures == []


def test_both_transports_answer_outside_the_chat_route_with_named_json_errors(template, transport):  # noqa: F811
    async def go():
        endpoint, s, client = await serve(template, Engine([]), transport=transport)
        try:
            with pytest.raises(openai.NotFoundError) as listed:
                await client.models.list()
            with pytest.raises(openai.APIStatusError) as got:
                await client.get("/chat/completions", cast_to=object)
            unknown = await endpoint.chat.handle("POST", "/sessions/nope/v1/chat/completions", b"{}")
            return listed.value, got.value, unknown, endpoint
        finally:
            await client.close()
            await endpoint.close()

    listed, got, unknown, endpoint = asyncio.run(go())
    assert (listed.status_code, listed.code) == (404, "not_found")
    assert listed.body["message"] == (
        "GET /sessions/s1/v1/models: the session endpoint serves only POST /sessions/<id>/v1/chat/completions"
    )
    assert (got.status_code, got.code) == (405, "method_not_allowed")
    assert unknown == (
        404,
        b'{"error":{"message":"no session \'nope\' on this worker","type":"invalid_request_error",'
        b'"code":"session_not_found","param":null}}',
    )
    assert endpoint.failures == []  # nothing of a session was refused


def test_a_turn_past_the_clients_timeout_goes_on_and_the_tasks_end_cancels_what_still_runs(template, transport):  # noqa: F811
    """The client gets APITimeoutError and the turn completes in the session, as a server completes a
    request whose client hung up; a turn still waiting for the engine when the task's sessions end
    is cancelled, and the session keeps its complete turns only."""
    events = []

    class Held(Engine):
        def __init__(self, replies):
            super().__init__(replies)
            self.release, self.answered = asyncio.Event(), asyncio.Event()

        async def __call__(self, input_ids, max_new_tokens, stop):
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                events.append("cancelled")
                raise
            arrays = await super().__call__(input_ids, max_new_tokens, stop)
            self.answered.set()
            return arrays

    async def go():
        engine = Held([(text_ids("hi") + [IM_END], "stop")])
        endpoint, s, client = await serve(template, engine, transport=transport)
        try:
            with pytest.raises(openai.APITimeoutError):
                await client.with_options(timeout=0.05).chat.completions.create(model="default", messages=FIRST)
            engine.release.set()
            await engine.answered.wait()  # the turn went on, to the session's end of it
            turns_after_timeout = s.turns
            engine.release.clear()
            engine.replies.append((text_ids("yo") + [IM_END], "stop"))
            second = [*FIRST, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "b"}]
            with pytest.raises(openai.APITimeoutError):
                await client.with_options(timeout=0.05).chat.completions.create(model="default", messages=second)
        finally:
            await client.close()
            await endpoint.close()  # the second turn still waits for the engine
        return s, endpoint, turns_after_timeout

    s, endpoint, turns_after_timeout = asyncio.run(go())
    assert turns_after_timeout == 1 and s.turns == 1 and events == ["cancelled"]
    assert endpoint.failures == [] and s.trajectory().loss_mask.sum() == 3


def test_the_workers_setting_chooses_the_transport_and_loopback_serves_an_agent_out_of_process(
    template,  # noqa: F811
    monkeypatch,
):
    session_environments.BASE_URLS.clear()
    engine = Engine([(text_ids("hello") + [IM_END], "stop")])
    outcome = process(template, monkeypatch, "hands_its_base_url_to_an_agent", engine, n=1, transport="loopback")
    assert outcome.rewards.tolist() == [5.0] and outcome.tokens == 6  # the agent's turn, trained
    (base,) = session_environments.BASE_URLS
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/sessions/[0-9a-f]{32}/v1/", base)
    process(template, monkeypatch, "records_its_base_url", Engine([(text_ids("hi") + [IM_END], "stop")]), n=1)
    assert re.fullmatch(r"http://in-process/sessions/[0-9a-f]{32}/v1/", session_environments.BASE_URLS[-1])


def test_the_session_transport_is_a_worker_flag_in_process_by_default():
    parser = argparse.ArgumentParser()
    add_arguments(parser, WorkerSettings)
    assert parse_args(parser, [], section=WorkerSettings)[2].session_transport == "in-process"
    assert parse_args(parser, ["--session-transport", "loopback"], section=WorkerSettings)[2].session_transport == (
        "loopback"
    )
    with pytest.raises(ValueError, match=r"^session_transport: is 'socket'; use one of in-process, loopback$"):
        SessionClients(SessionChat(Config()), "socket", timeout=1)
