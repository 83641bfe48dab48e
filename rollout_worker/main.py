"""`centerline worker`: a stateless rollout worker (docs/design.md section 2); run any number of them.

    centerline worker --proxy-url http://127.0.0.1:30010 --nats-url nats://127.0.0.1:4222 \
        [--tokenizer DIR] [--vocab-size V] [--ack-wait 30] [--concurrency 8] [--metrics-port P] [config flags]

The tokenizer (prompt -> ids) is ``--tokenizer``, else the ``tokenizer_path`` the proxy's
upstream reports on /get_model_info; with ``--chat-template`` a prompt for native /generate is
rendered with its chat template as one user message (the chat endpoint has SGLang render it).
The vocabulary size (for the contract check) is ``--vocab-size``, else ``vocab_size`` from the
proxy's /get_model_info (the proxy adds what it learned from SGLang), else the tokenizer
directory's config.json. K above the vocabulary is refused at start. Logs are JSON lines on
stderr, one ``task done`` line per task. SIGTERM or Ctrl-C: stop fetching, finish the tasks in
flight within ``--shutdown-grace`` (NAK the rest), exit 0. Heavy imports (transformers, the
worker loop) happen after argument parsing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

from shared import logs
from shared.config import add_arguments, parse_args
from shared.contract import k_above_vocab
from shared.settings import WorkerSettings

log = logging.getLogger("centerline.worker")


class WorkerMetrics:
    """Prometheus metrics of one worker, on its own registry."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.tasks = Counter(
            "centerline_worker_tasks",
            "Tasks finished, by outcome (ok, nak, store_full: nak'ed for a full store, rejected, error: an "
            "unexpected exception, ack_lost)",
            ["outcome"],
            registry=self.registry,
        )
        self.samples = Counter("centerline_worker_samples", "Samples published", registry=self.registry)
        self.tokens = Counter("centerline_worker_tokens", "Response tokens published", registry=self.registry)
        self.reward = Histogram(
            "centerline_worker_reward", "Per-sample reward", buckets=(0, 0.25, 0.5, 0.75, 1.0), registry=self.registry
        )
        self.latency = Histogram("centerline_worker_task_seconds", "Task latency, fetch to ack", registry=self.registry)
        # Session affinity at work: the later turns' prompt tokens, and those the prefix cache served
        self.session_prompt_tokens = Counter(
            "centerline_worker_session_later_prompt_tokens",
            "Prompt tokens of sessions' turns 2 and later",
            registry=self.registry,
        )
        self.session_cached_tokens = Counter(
            "centerline_worker_session_later_cached_tokens",
            "Of those, the tokens SGLang's prefix cache served (meta_info.cached_tokens)",
            registry=self.registry,
        )
        self.weight_version = Gauge(
            "centerline_worker_weight_version", "Weight version of the last published batch", registry=self.registry
        )

    def done(self, outcome, latency: float) -> None:
        self.tasks.labels("ok").inc()
        self.samples.inc(int(outcome.rewards.size))
        self.tokens.inc(outcome.tokens)
        self.session_prompt_tokens.inc(outcome.later_turns_cache[0])
        self.session_cached_tokens.inc(outcome.later_turns_cache[1])
        for r in outcome.rewards.tolist():
            self.reward.observe(r)
        self.latency.observe(latency)
        self.weight_version.set(max(b.weight_version for b in outcome.batches))


def model_info(proxy_url: str, deadline_s: float = 120.0) -> dict:
    """/get_model_info through the proxy (forwarded to the upstream), retried until the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(proxy_url.rstrip("/") + "/get_model_info", timeout=5) as resp:
                return json.loads(resp.read())
        except (OSError, ValueError) as exc:
            if time.monotonic() > end:
                raise RuntimeError(f"{proxy_url}/get_model_info unreachable for {deadline_s}s: {exc}") from None
            time.sleep(0.5)


def load_tokenizer(path: str, chat_template: bool = False):
    """``(Tokenizer, hf_tokenizer)``. With ``chat_template`` a native /generate prompt is rendered
    with the tokenizer's chat template too (one user message, the generation prompt added)."""
    from transformers import AutoTokenizer

    from rollout_worker.worker import Tokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if chat_template and not tok.chat_template:
        raise ValueError(
            f"--chat-template: the tokenizer at {path} has no chat template; turn worker.chat_template off or give "
            "a tokenizer that has one (--tokenizer)"
        )

    def encode_chat(prompt: str | list[dict]) -> list[int]:
        """A prompt as one user message, or a dataset row's messages (a system prompt, several turns)."""
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def encode(prompt: str) -> list[int]:
        return list(tok(prompt)["input_ids"])

    return Tokenizer(encode=encode_chat if chat_template else encode, encode_chat=encode_chat, chat=tok), tok


def vocab_size_of(info: dict, tokenizer_path: str | None) -> int | None:
    for where in (info, info.get("hf_config"), info.get("config")):
        value = where.get("vocab_size") if isinstance(where, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    config = Path(tokenizer_path or "") / "config.json"
    if tokenizer_path and config.exists():
        return json.loads(config.read_text()).get("vocab_size")
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="centerline worker", description=__doc__.split("\n")[0])
    add_arguments(parser, WorkerSettings)
    _, cfg, settings = parse_args(parser, argv, section=WorkerSettings)
    logs.setup("worker")

    info = {} if settings.tokenizer and settings.vocab_size else model_info(cfg.services.proxy_url)
    tokenizer_path = settings.tokenizer or info.get("tokenizer_path") or info.get("model_path")
    if not tokenizer_path:
        print(
            "centerline worker: no tokenizer: pass --tokenizer DIR (the upstream reports no tokenizer_path)",
            file=sys.stderr,
        )
        return 2
    try:
        tokenizer, hf_tok = load_tokenizer(tokenizer_path, settings.chat_template)
    except ValueError as exc:
        print(f"centerline worker: {exc}", file=sys.stderr)
        return 2
    vocab = settings.vocab_size or vocab_size_of(info, tokenizer_path) or len(hf_tok)
    too_many = k_above_vocab(cfg.rollout.top_logprobs_num, vocab, cfg.rollout.logprobs_mode)
    if too_many:
        print(f"centerline worker: --rollout-top-logprobs-num: {too_many}", file=sys.stderr)
        return 2

    from rollout_worker.worker import Worker

    # What this process found out, in the settings' own fields: the worker takes them whole.
    worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    settings = settings.model_copy(update={"worker_id": worker_id, "vocab_size": vocab})
    metrics = WorkerMetrics()
    if settings.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, addr=settings.metrics_host, registry=metrics.registry)
    return asyncio.run(_run(Worker(cfg, settings, tokenizer, metrics)))


async def _run(worker) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stopping.set)
    from shared.nats_auth import CredentialsError
    from shared.streams import StreamConfigError

    try:
        await worker.run()
    except (CredentialsError, StreamConfigError) as exc:  # a setting to fix, not a crash: one line, no traceback
        print(f"centerline worker: {exc}", file=sys.stderr)
        return 1
    return 0
