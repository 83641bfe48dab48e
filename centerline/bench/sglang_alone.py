"""Phase 2 of ``centerline bench pipeline`` (``centerline/bench/pipeline.py`` says what it
measures): SGLang alone, the ceiling the pipeline's rates are divided by.

After ``up`` has stopped, a fresh ``centerline sglang`` of the same model (weights of step 0, the
same recipe and flags) gets the requests the workers send, as the proxy rewrites them
(``router_proxy.rewrite``: the run's ``rollout_n``, ``max_new_tokens``, temperature,
``top_logprobs_num = K``; prompts of the run's dataset, tokenized as the worker does), straight to
the server, from ``workers x`` the worker's ``concurrency`` closed-loop clients: the most requests
the pipeline can have in flight. Completions in ``--alone-seconds`` (default: as long as the
pipeline's window) after ``--alone-warmup`` s count; the rest of the machine is idle then. Its duty
cycle is measured as the pipeline's (``duty_cycle.py``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson

from centerline.bench import progress
from centerline.bench.duty_cycle import Scraper, duty_cycle
from centerline.ports import free_port
from centerline.up.processes import Supervisor, sglang_argv, wait_http
from centerline.up.run_spec import RunSpec
from shared.config import Config


def request_bodies(config: Config, model: str, dataset: Path, count: int = 256) -> list[bytes]:
    """The worker's native /generate request (``rollout_worker.request.training_body``) for the first ``count``
    prompts of ``dataset``, as the proxy rewrites it."""
    from transformers import AutoTokenizer

    from rollout_worker.request import training_body
    from router_proxy.rewrite import Contract, rewrite_body

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [orjson.loads(line)["prompt"] for line in dataset.read_bytes().splitlines()[:count]]
    contract = Contract.from_config(config)
    return [
        rewrite_body(
            orjson.dumps(training_body(config, list(tok(p)["input_ids"]), config.rollout.n)), "generate", contract
        )
        for p in prompts
    ]


async def closed_loop(url: str, bodies: list[bytes], concurrency: int, warmup: float, seconds: float) -> dict:
    """``concurrency`` clients, each sending its next request on the last answer; counts the
    samples and generated tokens of answers that arrive in ``[warmup, warmup + seconds]``."""
    import aiohttp

    counts = {"requests": 0, "samples": 0, "tokens": 0}
    t0 = time.monotonic()
    start, end = t0 + warmup, t0 + warmup + seconds

    async def client(session, i: int) -> None:
        while time.monotonic() < end:
            async with session.post(
                url, data=bodies[i % len(bodies)], headers={"Content-Type": "application/json"}
            ) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url} answered {resp.status}: {body[:300]!r}")
            i += concurrency
            if start <= time.monotonic() <= end:
                outs = orjson.loads(body)
                outs = outs if isinstance(outs, list) else [outs]
                counts["requests"] += 1
                counts["samples"] += len(outs)
                counts["tokens"] += sum(o["meta_info"]["completion_tokens"] for o in outs)

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(client(session, i) for i in range(concurrency)))
    return {**counts, "start": start, "end": end}


def concurrent_requests(spec: RunSpec) -> int:
    """The most requests the pipeline of ``spec`` has in flight: each worker's resolved ``concurrency``."""
    return spec.up.workers * spec.worker.concurrency


def run_alone(args, spec: RunSpec, model: str, dataset: Path, run_dir: Path, seconds: float) -> dict:
    """A fresh SGLang server of ``model``, the pipeline's requests at its most concurrency, then stopped."""
    concurrency = concurrent_requests(spec)
    bodies = request_bodies(spec.cfg, model, dataset)
    url = f"http://127.0.0.1:{free_port()}"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(run_dir / "logs", {})
    try:
        started = time.monotonic()
        proc = supervisor.start("sglang-alone", sglang_argv(model, url, ["--enable-metrics"]))
        wait_http(f"{url}/health", "SGLang alone", proc, run_dir / "logs" / "sglang-alone.log", 300)
        progress(
            "pipeline",
            "sglang_alone_ready",
            url=url,
            startup_s=round(time.monotonic() - started, 1),
            concurrency=concurrency,
        )
        with Scraper(url, args.poll) as scraper:
            counts = asyncio.run(closed_loop(f"{url}/generate", bodies, concurrency, args.alone_warmup, seconds))
    finally:
        supervisor.stop()
    figures = {
        "sglang_alone_window_s": round(seconds, 3),
        "sglang_alone_requests": counts["requests"],
        "sglang_alone_samples": counts["samples"],
        "sglang_alone_tokens": counts["tokens"],
        "sglang_alone_samples_per_s": round(counts["samples"] / seconds, 3),
        "sglang_alone_tokens_per_s": round(counts["tokens"] / seconds, 3),
        **{f"sglang_alone_{k}": v for k, v in duty_cycle(scraper.samples, counts["start"], counts["end"]).items()},
    }
    progress("pipeline", "sglang_alone", **figures)
    return figures
