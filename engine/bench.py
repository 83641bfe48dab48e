"""`centerline bench engine --json`: generated tokens/s of the embedded engine.

Starts a real engine subprocess on the default model (made in a temporary directory),
sends identical /generate requests (top_logprobs_num=128, fixed length, seeded) at
concurrency 1 and 16 over HTTP, and runs the same requests one at a time in a plain loop
in this process (HF forward with a KV cache, log_softmax, top-128 and a seeded draw per
token, no server) as the baseline. Prints one JSON object; `speedup_c16` is engine
tokens/s at concurrency 16 over the plain loop's.

    centerline bench engine --json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

K = 128


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _requests(n: int, max_new_tokens: int) -> list[dict]:
    return [
        {
            "input_ids": list(f"benchmark prompt {i:03d}".encode()),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": K,
        }
        for i in range(n)
    ]


def _engine_tokens_per_s(url: str, bodies: list[dict], concurrency: int) -> float:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda b: _post(url + "/generate", b), bodies))
    elapsed = time.perf_counter() - start
    return sum(len(o["output_ids"]) for o in outs) / elapsed


def _plain_loop_tokens_per_s(model_dir: Path, bodies: list[dict], dtype: str) -> float:
    """The baseline: each request alone, prefill then one cached forward per token."""
    import torch

    from engine.batch import CACHE
    from engine.server import load_model

    model = load_model(str(model_dir), dtype)
    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for body in bodies:
            gen = torch.Generator().manual_seed(body["sampling_params"]["sampling_seed"])
            ids = torch.tensor([body["input_ids"]])
            cache = None
            for _ in range(body["sampling_params"]["max_new_tokens"]):
                out = model(input_ids=ids, use_cache=True, **({CACHE: cache} if cache is not None else {}))
                cache = out[CACHE]
                logprobs = torch.log_softmax(out.logits[0, -1], dim=-1)
                torch.topk(logprobs, K).values.tolist()
                ids = torch.multinomial(logprobs.exp(), 1, generator=gen).view(1, 1)
                tokens += 1
    return tokens / (time.perf_counter() - start)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_engine(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="centerline bench engine", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (default: init-model seed 0 in a temp dir)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    torch.set_num_threads(1)  # as the engine's default --threads
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from engine.model_init import write_model_dir

            model_dir = write_model_dir(Path(tmp) / "model", seed=0)
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "centerline", "engine", "--model", str(model_dir), "--port", str(port), "--dtype", args.dtype]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the engine did not start") from None
                    time.sleep(0.2)
            bodies = _requests(args.requests, args.max_new_tokens)
            _engine_tokens_per_s(url, bodies[:2], 2)  # warm-up
            c1 = _engine_tokens_per_s(url, bodies[: max(4, args.requests // 4)], 1)
            c16 = _engine_tokens_per_s(url, bodies, 16)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        baseline = _plain_loop_tokens_per_s(model_dir, bodies[: max(4, args.requests // 4)], args.dtype)
    result = {
        "bench": "engine",
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "top_logprobs_num": K,
        "tokens_per_s_c1": round(c1, 1),
        "tokens_per_s_c16": round(c16, 1),
        "plain_loop_tokens_per_s": round(baseline, 1),
        "speedup_c1": round(c1 / baseline, 2),
        "speedup_c16": round(c16 / baseline, 2),
    }
    print(json.dumps(result))
    return 0
