"""Environments: user code that drives multi-turn sessions through an OpenAI chat client
(docs/design.md section 12).

    async def environment(client: openai.AsyncOpenAI, task: PromptTask) -> float

A task that names an environment (``PromptTask.environment``, ``"module:function"`` or a built-in
of ``shared/toy_tasks.py``, ``chain`` or ``calc``; loaded by ``rollout_worker/user_code.py``) runs
``task.n`` sessions of it at once. Each gets a real ``openai.AsyncOpenAI`` whose base URL is its own
session (``/sessions/<id>/v1``) and whose transport hands each request to the session in this
process (the worker's ``session_transport``, ``in-process``; ``loopback`` serves the sessions on a
loopback HTTP endpoint instead, for an agent out of process: ``rollout_worker/session_transport.py``).
Each turn is one native /generate through the proxy (``rollout_worker/session.py``, ``ProxyTurn``),
with the header ``X-SMG-Routing-Key: <session id>`` so a router that routes by key keeps a session
on one engine.
The environment returns the session's reward; the group's sessions become one batch, a sample
each, with GRPO advantages over the group.

Failures: an engine or proxy failure in any turn fails the task as transient (it is sampled
again, whole, with new sessions); a request the proxy refuses, a turn the endpoint refuses for
good (a template that fails or does not extend the session, an invalid request, an unsupported
setting: ``rollout_worker/openai_chat.py``) or any exception inside a turn, an environment that
raises or returns no finite reward, a session with no turn, a batch that breaks the contract fail
it for good (whatever the environment made of the answer), and so do sessions not all back
within the worker's ``environment_timeout`` (cancelled). A history the session did not have and
a turn past the session's budget are refused and logged only: the environment may go on or
finish. A session is trained whole or not at all.

Tool calls: a request's ``tools`` go to the chat template and the reply is parsed by SGLang's parsers
(``rollout_worker/tool_calls.py``) into ``message.tool_calls`` (``finish_reason`` "tool_calls"); a
call that does not parse is answered as text with the failure in ``choices[0].tool_call_error``.

Left out: streaming, ``n`` above 1 per request, sampling settings of the environment's own (the
run's are used, others refused).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import uuid
from collections.abc import Callable

import aiohttp
import numpy as np

from rollout_worker.chat_template import ChatTemplate
from rollout_worker.failures import Rejected
from rollout_worker.proxy_call import post
from rollout_worker.request import generate_body
from rollout_worker.session import Session
from rollout_worker.session_transport import SessionChat, SessionClients
from rollout_worker.user_code import load_function
from shared.config import Config
from shared.response_arrays import ResponseArrays
from shared.task import PromptTask
from shared.toy_tasks import ENVIRONMENTS

log = logging.getLogger("centerline.worker")


class EnvironmentLoadError(ValueError):
    """An environment that cannot be found; the message names it and what to check."""


@functools.lru_cache(maxsize=64)
def load_environment(spec: str) -> Callable:
    """The coroutine function ``spec`` names: a built-in (``shared/toy_tasks.py``) or ``module:function``."""
    return load_function("environment", spec, ENVIRONMENTS, EnvironmentLoadError, coroutine=True)


async def proxy_generate(http: aiohttp.ClientSession, proxy_url: str, body: dict, routing_key: str) -> ResponseArrays:
    """A session's turn: one native /generate through the proxy, on the session's ``routing_key``."""
    return await post(http, proxy_url.rstrip("/") + "/generate", body, routing_key)


class ProxyTurn:
    """A session's engine call: each turn one native /generate of the run's sampling through the proxy
    at ``cfg.services.proxy_url``, on the session's routing key, so a router that routes by key keeps the
    session on one engine (``Session.generate`` is its ``generate``)."""

    def __init__(self, cfg: Config, http: aiohttp.ClientSession, routing_key: str):
        self.cfg, self.http, self.routing_key = cfg, http, routing_key

    async def generate(self, input_ids: list[int], max_new_tokens: int, stop: list[str] | None) -> ResponseArrays:
        body = generate_body(self.cfg, input_ids, max_new_tokens=max_new_tokens, stop=stop)
        return await proxy_generate(self.http, self.cfg.services.proxy_url, body, routing_key=self.routing_key)


def finite_reward(result) -> float | None:
    """An environment's return value as a reward: a real number, numpy's included (a scalar or a
    0-d array), that is finite; None for anything else."""
    if isinstance(result, np.ndarray) and result.ndim == 0:
        result = result[()]
    if isinstance(result, (bool, np.bool_)) or not isinstance(result, (int, float, np.integer, np.floating)):
        return None
    value = float(result)
    return value if math.isfinite(value) else None


async def play_sessions(
    cfg: Config,
    http: aiohttp.ClientSession,
    tokenizer,
    task: PromptTask,
    n: int,
    timeout: float,
    between_turns: Callable[[int], None] | None = None,
    deadline: float | None = None,
    transport: str = "in-process",
) -> list[tuple[Session, float]]:
    """``n`` sessions of the task's environment at once, each with its own OpenAI client over
    ``transport`` (``rollout_worker/session_transport.py``: in process, or a loopback endpoint),
    rendered with ``tokenizer``'s chat template (an HF tokenizer) and turned through the proxy at
    ``cfg.services.proxy_url``; each session with its reward. Raises ``Transient`` or ``Rejected`` as
    ``Worker.process`` does, ``Rejected`` too when the sessions are not all back within ``deadline``
    seconds (they are cancelled). The worker plays them for training and held-out tasks alike
    (``Worker.sample_sessions``, which passes its failpoint as ``between_turns``: see ``Session``;
    docs/design.md section 9)."""
    try:
        environment = load_environment(task.environment)
    except EnvironmentLoadError as exc:
        raise Rejected(str(exc)) from None
    template = ChatTemplate.for_run(tokenizer, cfg)  # Rejected where there is no template
    chat = SessionChat(cfg)

    def new_session() -> Session:
        sid = uuid.uuid4().hex  # a new one each attempt: a retried task never resumes a session
        return Session(
            sid,
            template,
            ProxyTurn(cfg, http, sid).generate,
            k=cfg.rollout.top_logprobs_num,
            budget=cfg.rollout.session_max_tokens,
            between_turns=between_turns,
        )

    returned = []

    async def run(clients: SessionClients, session: Session) -> float:
        client = clients.client(session)
        try:
            reward = await environment(client, task)
            returned.append(session)
            return reward
        finally:
            await client.close()

    sessions = [new_session() for _ in range(n)]
    try:
        async with SessionClients(chat, transport, timeout, sessions=n) as clients:
            # a hung environment would hold the task, and its worker slot, for good (docs/design.md section 12)
            async with asyncio.timeout(deadline):
                results = await asyncio.gather(*(run(clients, s) for s in sessions), return_exceptions=True)
    except TimeoutError:
        raise Rejected(
            f"environment {task.environment!r}: {n - len(returned)} of {n} sessions had not returned within "
            f"--environment-timeout {deadline:g} s, and were cancelled; nothing of the task is published. Make it "
            "return each session's reward, or raise --environment-timeout (unset, it is --request-timeout x "
            "ceil(--rollout-session-max-tokens / --rollout-max-new-tokens))"
        ) from None
    if chat.failures:  # a kept failure first (an engine's, a fatal refusal), whatever the environment made of it
        raise chat.failures[0]
    played = []
    for session, result in zip(sessions, results):
        if isinstance(result, BaseException):
            if isinstance(result, asyncio.CancelledError):
                raise result
            raise Rejected(f"environment {task.environment!r} failed in session {session.id}: {result!r}") from None
        reward = finite_reward(result)
        if reward is None:
            raise Rejected(f"environment {task.environment!r} returned {result!r}, expected a finite reward (a float)")
        if not session.turns:
            raise Rejected(f"environment {task.environment!r} returned without a turn in session {session.id}")
        if session.finish is not None:
            fields = {
                "task_id": task.task_id,
                "session": session.id,
                "turns": session.turns,
                "tokens": len(session.ids),
            }
            log.info("session ended at its token budget after its last complete turn", extra={"fields": fields})
        played.append((session, reward))
    return played
