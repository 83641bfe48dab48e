"""A worker's long sample on a real nats-server (docs/design.md section 3): one above ``max_payload``
is published in pieces and its task acked; one above ``--max-sample-bytes`` is dead-lettered and
TERMed once, naming the setting, never NAKed to ``max_deliver``. The sampling is a fixed batch (the
worker's ``process``), so the publish path is what runs."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from centerline.nats_server import EmbeddedNats
from centerline.synth import make_batch
from rollout_worker.worker import Outcome, Tokenizer, Worker
from shared import names
from shared.config import Config
from shared.nats_client import connect, pull_consumer
from shared.settings import WorkerSettings
from shared.streams import ensure_streams
from shared.task import PromptTask
from tests.processes import stored_messages

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # rows of the fault table (docs/operations.md)

K, VOCAB, N = 8, 64, 2
MAX_PAYLOAD = 64 << 10
TASK = PromptTask(task_id="r1/0/0", group_id="r1/g0", prompt="x", answer="y", reward="exact", n=N, step=0)


class Sampled(Worker):
    """A worker whose sampling gives ``N`` samples of ``tokens`` response tokens each."""

    tokens = 0

    async def process(self, task: PromptTask, attempt: int = 1) -> Outcome:
        batch = make_batch(samples=N, tokens_per_sample=self.tokens, k=K, vocab_size=VOCAB)
        batch = replace(batch, batch_id=f"{task.task_id}/a{attempt}", task_id=task.task_id, attempt=attempt)
        return Outcome([batch], np.zeros(N, np.float32), N * self.tokens)


def handle_one(tmp_path, tokens: int, max_sample_bytes: int, terminated: int = 0):
    """Publish ``TASK``, have a worker handle its one delivery; the streams and the consumer after (once
    JetStream's ``terminated`` advisories are stored)."""

    async def main():
        with EmbeddedNats(tmp_path / "nats", max_payload=MAX_PAYLOAD) as server:
            # a session budget the start-up check lets through (shared/settings.py): the sample of
            # ``tokens`` tokens goes past it only at run time, where the worker must catch it
            budget = min(Config().rollout.session_max_tokens, (max_sample_bytes - 4096) // (13 + 8 * K))
            cfg = Config(
                nats_url=server.url,
                rollout_top_logprobs_num=K,
                max_sample_bytes=max_sample_bytes,
                rollout_session_max_tokens=budget,
            )
            worker = Sampled(cfg, WorkerSettings(worker_id="w1", vocab_size=VOCAB), Tokenizer(None, None))
            worker.tokens = tokens
            worker.nc = await connect(server.url)
            worker.js = worker.nc.jetstream()
            await ensure_streams(worker.js)
            await worker.js.publish(names.PROMPTS_SUBJECT, TASK.to_bytes(), headers={names.MSG_ID_HEADER: "r1/0/0"})
            consumer = await pull_consumer(
                worker.js, names.PROMPTS_STREAM, names.WORKERS_CONSUMER, filter_subject=names.PROMPTS_SUBJECT
            )
            (msg,) = await consumer.fetch(1, timeout=5.0)
            await worker.handle(msg)
            await worker.nc.flush()
            info = await worker.js.consumer_info(names.PROMPTS_STREAM, names.WORKERS_CONSUMER)
            while info.num_ack_pending and info.num_redelivered == 0:  # a TERM is not acknowledged: until applied
                info = await worker.js.consumer_info(names.PROMPTS_STREAM, names.WORKERS_CONSUMER)
            advisories = await stored_messages(server.url, names.ADVISORIES_STREAM)
            while len(advisories) < terminated:  # JetStream stores its advisory once it applied the TERM
                advisories = await stored_messages(server.url, names.ADVISORIES_STREAM)
            rollouts = await stored_messages(server.url, names.ROLLOUTS_STREAM)
            letters = await stored_messages(server.url, names.DLQ_STREAM)
            await worker.nc.close()
            return info, rollouts, letters, advisories

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_a_sample_above_max_payload_is_published_in_pieces_and_its_task_acked(tmp_path):
    info, rollouts, letters, advisories = handle_one(tmp_path, tokens=1200, max_sample_bytes=1 << 20)
    assert [m.headers["Nats-Msg-Id"] for m in rollouts] == [
        "r1/0/0/a1/0-1#0/2",
        "r1/0/0/a1/0-1#1/2",
        "r1/0/0/a1/1-2#0/2",
        "r1/0/0/a1/1-2#1/2",
    ]
    assert all(len(m.data) <= MAX_PAYLOAD for m in rollouts) and letters == [] and advisories == []
    assert (info.num_pending, info.num_ack_pending, info.num_redelivered) == (0, 0, 0)


def test_a_sample_above_max_sample_bytes_is_dead_lettered_and_termed_once_by_name(tmp_path):
    info, rollouts, letters, advisories = handle_one(tmp_path, tokens=1200, max_sample_bytes=50_000, terminated=1)
    assert rollouts == []  # nothing of the batch published
    (letter,) = letters
    assert letter.data == TASK.to_bytes() and letter.headers["Centerline-Kind"] == "task"
    assert "of one sample is" in letter.headers["Centerline-Reason"]
    assert "above --max-sample-bytes 50000" in letter.headers["Centerline-Reason"]
    # TERMed: not pending, not waiting for an ack, never delivered again
    assert (info.num_pending, info.num_ack_pending, info.num_redelivered) == (0, 0, 0)
    assert [m.subject.split(".")[4] for m in advisories] == ["MSG_TERMINATED"]
