"""Phase 2 of ``centerline bench sessions`` (``centerline/bench/sessions.py`` says what it measures):
the baseline, every turn of phase 1 again as one native /generate of the same token counts, with
random prompt ids, no session and no routing key."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import orjson

from centerline.bench.cpu import CpuClock
from centerline.bench.turn_stages import mean_ms


async def run_single(args, proxy_url: str, shapes: list[dict], vocab: int, cpu: CpuClock) -> dict:
    """Phase 2: one native /generate per turn of ``shapes`` (``turn``, ``prompt_tokens``,
    ``completion_tokens``), random prompt ids, no routing key; each request's figures with its turn,
    and the CPU seconds the requests took (``cpu``)."""
    import aiohttp

    from shared import response_arrays

    rng = np.random.default_rng(1 << 20)
    sampling = {"n": 1, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True}
    bodies = [
        (
            shape["turn"],
            orjson.dumps(
                {
                    "input_ids": rng.integers(0, min(vocab, 256), shape["prompt_tokens"]).tolist(),
                    "sampling_params": {**sampling, "max_new_tokens": max(shape["completion_tokens"], 1)},
                    "return_logprob": True,
                    "top_logprobs_num": args.k,
                }
            ),
        )
        for shape in shapes
    ]
    headers = {"Content-Type": "application/json", "Accept": response_arrays.MEDIA_TYPE}
    requests: list[dict] = []
    gate = asyncio.Semaphore(min(args.concurrency, args.sessions))  # as many in flight as phase 1 had
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def one(turn: int, body: bytes) -> None:
            async with gate:
                started = time.perf_counter()
                async with http.post(f"{proxy_url}/generate", data=body, headers=headers) as resp:
                    answer = await resp.read()
                    if resp.status != 200 or resp.content_type != response_arrays.MEDIA_TYPE:
                        raise RuntimeError(f"{proxy_url}/generate answered {resp.status}: {answer[:300]!r}")
                seconds = time.perf_counter() - started
                decoded = response_arrays.decode(answer)
                tokens, cached = int(decoded.response_ids.shape[0]), (decoded.cached_tokens or [0])[0] or 0
                requests.append({"turn": turn, "seconds": seconds, "tokens": tokens, "cached": cached})

        cpu.start()
        started = time.perf_counter()
        await asyncio.gather(*(one(turn, body) for turn, body in bodies))
        wall = time.perf_counter() - started
        cpu_s = cpu.stop()
    return {"requests": requests, "wall_s": wall, "cpu_s": cpu_s}


def single_by_turn(requests: list[dict]) -> list[float]:
    """Mean milliseconds of the single requests that replayed each turn index, in turn order."""
    return [mean_ms([r["seconds"] for r in requests if r["turn"] == t]) for t in sorted({r["turn"] for r in requests})]
