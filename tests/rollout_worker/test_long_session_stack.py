"""A long agent session end to end on real parts (issue 38; docs/design.md section 3): a session whose
tool result is ~21k tokens, sampled by a real SGLang server (the default byte-level model, its positions
raised to 32k: its weights do not depend on them) through the proxy at K = 128, makes a sample of more
than 20 MiB. The worker publishes it in pieces on a real nats-server (8 MiB ``max_payload``), the
trainer's gate puts it together and checks it whole, ``train_step`` trains it, and the commit acks every
piece: trained exactly once, nothing dead-lettered, nothing left to deliver."""

from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import numpy as np
import openai
import pytest

from centerline.nats_server import EmbeddedNats
from rollout_worker.main import load_tokenizer
from rollout_worker.worker import Worker
from shared import names, pieces
from shared.config import Config
from shared.nats_client import connect, pull_consumer
from shared.settings import WorkerSettings
from shared.streams import ensure_streams
from shared.task import PromptTask
from tests.processes import SGLangProcess, stored_messages
from tests.router_proxy.conftest import ProxyProcess
from trainer_service.gate import Gate
from trainer_service.model import load_model
from trainer_service.step import make_optimizer, train_step

pytestmark = [pytest.mark.integration, pytest.mark.slow]

K, VOCAB, POSITIONS = 128, 260, 32768
TOOL_RESULT = 21_000  # bytes of the tool's answer, one token each: 21k tokens x (13 + 8K) bytes > 20 MiB
CFG = dict(rollout_top_logprobs_num=K, rollout_max_new_tokens=8, rollout_session_max_tokens=24576, rollout_n=1)


async def long_tool_result(client: openai.AsyncOpenAI, task) -> float:
    """One turn, a tool's long answer (a file read), one more turn."""
    messages = [{"role": "user", "content": task.prompt}]
    reply = await client.chat.completions.create(model="default", messages=messages, max_tokens=8)
    listing = "".join(f"{i:06d} line of the file\n" for i in range(TOOL_RESULT // 22 + 1))[:TOOL_RESULT]
    messages += [reply.choices[0].message.model_dump(), {"role": "tool", "tool_call_id": "c1", "content": listing}]
    await client.chat.completions.create(model="default", messages=messages, max_tokens=8)
    return 1.0


@pytest.fixture(scope="module")
def long_stack(tmp_path_factory, model_dir):
    """The default model with 32k positions, its own SGLang server holding 32k tokens, a proxy at K."""
    root = tmp_path_factory.mktemp("long")
    model = shutil.copytree(model_dir, root / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": POSITIONS}))
    engine = SGLangProcess(model, root / "sglang.log", "--max-total-tokens", str(POSITIONS))
    proxy = None
    try:
        proxy = ProxyProcess(
            root / "proxy.log", engine.url, "--vocab-size", str(VOCAB), "--rollout-top-logprobs-num", str(K)
        )
        status, body = proxy.wait_probed()
        assert status == 200, body
        yield model, proxy.url
    finally:
        if proxy is not None:
            proxy.stop()
        engine.stop()


def test_a_session_with_a_long_tool_result_over_20_mib_is_trained_exactly_once(long_stack, tmp_path):
    model_path, proxy_url = long_stack
    task = PromptTask(
        "r1/0/0", "r1/g0", "Read the file.", "", "exact", 1, 0, environment=f"{__name__}:long_tool_result"
    )

    async def main():
        with EmbeddedNats(tmp_path / "nats") as server:
            cfg = Config(nats_url=server.url, proxy_url=proxy_url, **CFG)
            tokenizer, _ = load_tokenizer(str(model_path))
            worker = Worker(cfg, WorkerSettings(worker_id="w1", vocab_size=VOCAB), tokenizer)
            worker.nc = await connect(server.url)
            worker.js = js = worker.nc.jetstream()
            await ensure_streams(js)
            await js.publish(names.PROMPTS_SUBJECT, task.to_bytes(), headers={names.MSG_ID_HEADER: task.task_id})
            tasks = await pull_consumer(
                js, names.PROMPTS_STREAM, names.WORKERS_CONSUMER, filter_subject=names.PROMPTS_SUBJECT
            )
            (msg,) = await tasks.fetch(1, timeout=5.0)
            async with aiohttp.ClientSession() as http:
                worker.session = http
                await worker.handle(msg)
            stored = await stored_messages(server.url, names.ROLLOUTS_STREAM)
            trainer = await pull_consumer(
                js, names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER, filter_subject=names.ROLLOUTS_SUBJECT
            )
            gate = Gate(js, trainer, vocab_size=VOCAB, cfg=cfg, ledger={}, run_id="r1")
            held = await gate.gather(1, 0, timeout=60.0, stopping=asyncio.Event())
            model = load_model(str(model_path))
            metrics = train_step(model, make_optimizer(model), held[0].batch)
            await gate.commit(0)
            infos = [
                await js.consumer_info(names.PROMPTS_STREAM, names.WORKERS_CONSUMER),
                await js.consumer_info(names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER),
            ]
            dead = (await js.stream_info(names.DLQ_STREAM)).state.messages
            await worker.nc.close()
            return stored, held, metrics, gate.ledger, gate.take_counts(), infos, dead, server.max_payload

    stored, held, metrics, ledger, counts, infos, dead, max_payload = asyncio.run(main())
    (h,) = held
    batch = h.batch
    size = len(bytes(h.msg.data))
    assert size > 20 << 20 and batch.num_tokens > TOOL_RESULT  # the sample: more than 20 MiB at K = 128
    assert [m.headers[pieces.PIECE_HEADER] for m in stored] == [f"{i}/{len(stored)}" for i in range(len(stored))]
    assert len(stored) == pieces.pieces_per_part(size, max_payload) and all(len(m.data) <= max_payload for m in stored)
    mask = batch.loss_mask.astype(bool)
    assert mask.sum() <= 16 and (batch.cand_ids[~mask] == -1).all()  # two replies trained, the tool's answer not
    assert metrics["samples"] == 1 and metrics["trained_tokens"] == int(mask.sum())
    assert np.isfinite(metrics["loss"]) and metrics["step_skipped_nonfinite"] == 0
    assert ledger == {"r1/0/0": {"attempt": 1, "step": 0, "parts": {batch.batch_id: 1}}}
    assert counts == {"accepted": 1} and dead == 0
    assert [(i.num_pending, i.num_ack_pending, i.num_redelivered) for i in infos] == [(0, 0, 0), (0, 0, 0)]
