"""Phase 1 of ``centerline bench sessions`` (``centerline/bench/sessions.py`` says what it measures):
sessions of random user messages, each turn sent by the real ``openai.AsyncOpenAI`` client over a
session transport as a worker makes it for an environment, and the figures of their turns."""

from __future__ import annotations

import asyncio
import statistics
import string
import time

import httpx
import numpy as np
import orjson

from centerline.bench.cpu import CpuClock, engines_ms_per_token
from centerline.bench.turn_stages import mean_ms, session_stages


def words(rng: np.random.Generator, n: int) -> str:
    """``n`` random lowercase letters and spaces, ``n`` tokens of the byte-level toy model."""
    letters = np.array(list(string.ascii_lowercase + " "))
    return "".join(rng.choice(letters, n)).strip() or "a"


async def run_sessions(args, proxy_url: str, model: str, seed: int, transport: str, cpu: CpuClock) -> dict:
    """Phase 1 at one proxy: ``args.sessions`` sessions of ``args.turns`` turns, each driven by its
    OpenAI client over ``transport`` as a worker makes it; their turns' figures, and the CPU seconds
    the turns took (``cpu``, started as the first turn and stopped as the last ends)."""
    import importlib

    import aiohttp

    from rollout_worker.environment import ProxyTurn
    from rollout_worker.main import load_tokenizer
    from rollout_worker.session import ChatTemplate, Session
    from rollout_worker.session_transport import SessionChat, SessionClients
    from shared.config import Config

    cfg = Config(
        proxy_url=proxy_url,
        rollout_top_logprobs_num=args.k,
        rollout_max_new_tokens=args.max_tokens,
        rollout_session_max_tokens=args.session_max_tokens,
    )
    _, hf = load_tokenizer(model)
    template = ChatTemplate(hf)
    rng = np.random.default_rng(seed)
    texts = [[words(rng, args.user_tokens) for _ in range(args.turns)] for _ in range(args.sessions)]
    turns: list[dict] = []
    kept: dict[int, tuple] = {}  # each session's messages (as its client last sent them, the reply) and answers
    gate = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def one(clients: SessionClients, i: int) -> None:
            async with gate:
                sid = f"bench-{seed}-{i}"
                session = Session(
                    sid, template, ProxyTurn(cfg, http, sid).generate, k=args.k, budget=args.session_max_tokens
                )
                client = clients.client(session)
                messages, held, answers = [], 0, []  # held: the session's tokens before the turn
                try:
                    for t in range(args.turns):
                        messages.append({"role": "user", "content": texts[i][t]})
                        started = time.perf_counter()
                        reply = await client.chat.completions.create(
                            model="default", messages=messages, max_tokens=args.max_tokens
                        )
                        seconds = time.perf_counter() - started
                        usage = reply.usage
                        details = usage.prompt_tokens_details
                        turns.append(
                            {
                                "turn": t,
                                "seconds": seconds,
                                "prompt_tokens": usage.prompt_tokens,
                                "completion_tokens": usage.completion_tokens,
                                "cached_tokens": details.cached_tokens if details is not None else None,
                                "held_tokens": held,
                                "stages": dict(session.turn_stages[-1]),  # the endpoint's and the session's
                            }
                        )
                        held = usage.prompt_tokens + usage.completion_tokens
                        messages.append(reply.choices[0].message.model_dump())
                        answers.append(orjson.dumps(reply.model_dump(mode="json")))
                finally:
                    await client.close()
                kept[i] = messages, answers

        # the client imports its chat resource on first use (about half a second here, once a process):
        # done before the clock starts, so the first turns measured are turns, not the import
        importlib.import_module("openai.resources.chat")
        async with SessionClients(SessionChat(cfg), transport, 600, sessions=args.concurrency) as clients:
            cpu.start()
            started = time.perf_counter()
            await asyncio.gather(*(one(clients, i) for i in range(args.sessions)))
            wall = time.perf_counter() - started
            cpu_s = cpu.stop()
            if clients.failures:
                raise RuntimeError(f"a session's turn failed ({transport}): {clients.failures[0]}")
    messages, answers = kept[0]
    return {
        "turns": turns,
        "wall_s": wall,
        "cpu_s": cpu_s,
        "transform_s": await client_transform(messages, args),
        "client_cpu_s": await client_cpu(messages, answers, args),
    }


async def client_transform(messages: list, args) -> list[float | None]:
    """The OpenAI client's own request transform (``openai._utils.async_maybe_transform``, which walks
    every message of a request) of each turn's request of one session, timed after the phase, outside
    any turn: the part of the client's time that grows with the history; None each where this
    ``openai`` has no such function (it is the client's own, not its interface)."""
    try:
        from openai._utils import async_maybe_transform
        from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming
    except ImportError:
        return [None] * args.turns
    out = []
    for t in range(args.turns):
        body = {"messages": messages[: 2 * t + 1], "model": "default", "max_tokens": args.max_tokens}
        started = time.perf_counter()
        for _ in range(5):
            await async_maybe_transform(body, CompletionCreateParamsNonStreaming)
        out.append((time.perf_counter() - started) / 5)
    return out


class Canned(httpx.AsyncBaseTransport):
    """Answers every request at once with ``body``: an OpenAI client with nothing behind it."""

    def __init__(self):
        self.body = b""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        return httpx.Response(200, headers=[(b"content-type", b"application/json")], content=self.body, request=request)


async def client_cpu(messages: list, answers: list[bytes], args) -> list[float]:
    """CPU seconds the environment's ``openai.AsyncOpenAI`` itself spends on each turn's request of one
    session (building and transforming the request, its ``httpx`` round, parsing the answer), replayed
    after the phase over a transport that answers the turn's own answer at once (mean of 5): the part
    of a turn's CPU that is the client's, not the session path's."""
    import openai

    canned = Canned()
    http = httpx.AsyncClient(transport=canned)
    client = openai.AsyncOpenAI(base_url="http://canned/v1", api_key="unused", max_retries=0, http_client=http)
    out = []
    try:
        for t in range(args.turns):
            canned.body = answers[t]
            request = {"model": "default", "messages": messages[: 2 * t + 1], "max_tokens": args.max_tokens}
            await client.chat.completions.create(**request)  # the first of a shape builds the client's caches
            started = time.process_time()
            for _ in range(5):
                await client.chat.completions.create(**request)
            out.append((time.process_time() - started) / 5)
    finally:
        await client.close()
    return out


def session_figures(played: dict, per_engine: list[int], before: dict, after: dict) -> dict:
    turns = played["turns"]
    later = [t for t in turns if t["turn"] > 0]
    prompt = sum(t["prompt_tokens"] for t in later)
    cached = sum(t["cached_tokens"] or 0 for t in later)
    held = sum(t["held_tokens"] for t in later)
    tokens = sum(t["completion_tokens"] for t in turns)
    # only the engine of a session's previous turn holds its last reply: a later turn served all its
    # history but the last sampled token (whose KV no forward pass wrote) went to that engine
    stayed = sum((t["cached_tokens"] or 0) >= t["held_tokens"] - 1 for t in later)
    return {
        "turns": len(turns),
        "turn_ms_mean": mean_ms([t["seconds"] for t in turns]),
        "turn_ms_p50": round(1000 * statistics.median(t["seconds"] for t in turns), 3),
        "later_turn_ms_mean": mean_ms([t["seconds"] for t in later]),
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "sampled_tokens": tokens,
        "tokens_per_s": round(tokens / played["wall_s"], 3),
        "later_turns_prompt_tokens": prompt,
        "later_turns_cached_tokens": cached,
        "cache_share_later_turns": round(cached / prompt, 4) if prompt else 0.0,
        "later_turns_history_tokens": held,
        "history_cache_share_later_turns": round(cached / held, 4) if held else 0.0,
        "same_engine_share_later_turns": round(stayed / len(later), 4) if later else 0.0,
        "requests_per_engine": per_engine,
        "wall_s": round(played["wall_s"], 3),
        "stages_ms": session_stages(turns, before, after),
        "cpu_s": played["cpu_s"],
        "bench_process_cpu_ms_per_turn": round(1000 * played["cpu_s"]["bench_process"] / len(turns), 3),
        "engines_cpu_ms_per_sampled_token": engines_ms_per_token(played["cpu_s"], tokens),
    }
