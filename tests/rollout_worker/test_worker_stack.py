"""`centerline worker` end to end: embedded NATS, the session's real SGLang server, the proxy
in front of it and worker processes.

Tasks go onto prompts.tasks; the groups that arrive on rollouts.batches are decoded and
checked against the contract, their rewards recomputed from the sampled bytes and their
advantages from the rewards. Synchronisation is by polling with deadlines, never sleeping.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nats.errors
import numpy as np
import pytest

from centerline.nats_server import EmbeddedNats
from shared import names
from shared.contract import check_batch
from shared.nats_client import connect
from shared.streams import ensure_streams
from shared.task import PromptTask
from shared.wire import decode_batch
from tests import processes
from tests.router_proxy.conftest import ProxyProcess

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("sglang")]

REPO = Path(__file__).resolve().parents[2]

K = 16
VOCAB = 260
CONFIG = ["--rollout-top-logprobs-num", str(K)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, sglang_server, model_dir):
    """NATS with the streams and a ready proxy in front of the shared SGLang server (random
    seed-0 model, also the workers' tokenizer), for the module."""
    root = tmp_path_factory.mktemp("stack")
    engine = sglang_server.serve(model_dir)
    server = EmbeddedNats(root / "nats").start()
    asyncio.run(_ensure(server.url))
    proxy = None
    try:
        proxy = ProxyProcess(root / "proxy.log", engine.url, "--vocab-size", str(VOCAB), *CONFIG)
        status, body = proxy.wait_probed()
        assert status == 200, body
        yield type("Stack", (), {"nats": server.url, "proxy": proxy.url, "model": model_dir})
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()


async def _ensure(url: str) -> None:
    nc = await connect(url)
    await ensure_streams(nc.jetstream())
    await nc.close()


class WorkerProcess:
    def __init__(self, stack, log_path: Path, *flags: str, env: dict | None = None):
        """``env``: variables added to the worker's environment (a failpoint: ``CENTERLINE_FAILPOINTS``)."""
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "centerline",
            "worker",
            "--proxy-url",
            stack.proxy,
            "--nats-url",
            stack.nats,
            "--vocab-size",
            str(VOCAB),
            "--tokenizer",
            str(stack.model),
            *CONFIG,
            *flags,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env={**processes.ENV, **(env or {})}, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, deadline: float = 60.0) -> None:
        processes.wait_until(lambda: '"worker ready"' in self.log(), deadline, f"worker\n{self.log()}", self.proc)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def workers(stack, tmp_path):
    started: list[WorkerProcess] = []

    def start(*flags: str) -> WorkerProcess:
        w = WorkerProcess(stack, tmp_path / f"worker{len(started)}.log", *flags)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def _tasks(run: str, count: int, n: int) -> list[PromptTask]:
    prompts = ["up abc=", "rev hello=", "copy xyz=", "add 2+3="]
    answers = ["ABC", "olleh", "xyz", "5"]
    return [
        PromptTask(
            task_id=f"{run}/0/{i}",
            group_id=f"{run}/g{i}",
            prompt=prompts[i % 4],
            answer=answers[i % 4],
            reward="exact",
            n=n,
            step=0,
        )
        for i in range(count)
    ]


async def _publish_tasks(url: str, tasks: list[PromptTask]) -> None:
    nc = await connect(url)
    js = nc.jetstream()
    for t in tasks:
        await js.publish(names.PROMPTS_SUBJECT, t.to_bytes(), headers={names.MSG_ID_HEADER: t.task_id})
    await nc.close()


async def _collect(url: str, run: str, want_groups: int, deadline_s: float, settle_s: float = 0.0):
    """Batches of this run on rollouts.batches, once ``want_groups`` groups are there (plus ``settle_s``
    of further polling, to see duplicates that should not come)."""
    nc = await connect(url)
    js = nc.jetstream()
    sub = await js.pull_subscribe(
        names.ROLLOUTS_SUBJECT, durable=f"t{uuid.uuid4().hex[:8]}", stream=names.ROLLOUTS_STREAM
    )
    batches, end, settled = [], time.monotonic() + deadline_s, None
    try:
        while time.monotonic() < end:
            try:
                msgs = await sub.fetch(10, timeout=0.5)
            except (TimeoutError, nats.errors.TimeoutError):
                msgs = []
            for m in msgs:
                b = decode_batch(bytes(m.data))
                if b.batch_id.startswith(run + "/"):
                    assert m.headers[names.MSG_ID_HEADER] == b.batch_id
                    batches.append(b)
                await m.ack()
            if len({g for b in batches for g in b.group_ids}) >= want_groups:
                settled = settled or time.monotonic() + settle_s
                if time.monotonic() >= settled:
                    break
        return batches
    finally:
        await nc.close()


async def _consumer_info(url: str):
    nc = await connect(url)
    try:
        return await nc.jetstream().consumer_info(names.PROMPTS_STREAM, names.WORKERS_CONSUMER)
    finally:
        await nc.close()


def _check_group(batch, task: PromptTask) -> None:
    check_batch(batch, vocab_size=VOCAB)
    assert batch.num_samples == task.n and batch.k == K and batch.mode == "selected"
    attempt_id = task.task_id if batch.attempt == 1 else f"{task.task_id}#{batch.attempt}"  # design.md section 4
    assert batch.batch_id == attempt_id and batch.group_ids == [task.group_id] * task.n
    assert batch.weight_version == 0 and (batch.temperature, batch.top_p, batch.top_k) == (1.0, 1.0, -1)
    prompt = list(task.prompt.encode())
    for i in range(task.n):
        ids = batch.response_ids[batch.sample_slice(i)].tolist()
        text = bytes(t for t in ids if t < 256)  # the engine's text skips special tokens (and the stop)
        assert batch.prompt_ids[batch.prompt_offsets[i] : batch.prompt_offsets[i + 1]].tolist() == prompt
        assert batch.rewards[i] == (1.0 if text == task.answer.encode() else 0.0)
    np.testing.assert_allclose(batch.advantages, batch.rewards - batch.rewards.mean(), atol=1e-6)
    assert batch.loss_mask.tolist() == [1] * batch.num_tokens


def test_two_workers_publish_each_task_group_once_and_drain_the_queue(stack, workers):
    run = f"r{uuid.uuid4().hex[:6]}"
    tasks = _tasks(run, 6, n=3)
    pool = [workers("--rollout-max-new-tokens", "8", "--worker-id", f"w{i}") for i in range(2)]
    for w in pool:
        w.wait_ready()
    asyncio.run(_publish_tasks(stack.nats, tasks))
    batches = asyncio.run(_collect(stack.nats, run, len(tasks), deadline_s=60))
    assert sorted(b.batch_id for b in batches) == sorted(t.task_id for t in tasks)
    for task in tasks:
        _check_group(next(b for b in batches if b.batch_id == task.task_id), task)

    def drained():
        info = asyncio.run(_consumer_info(stack.nats))
        return info.num_pending == 0 and info.num_ack_pending == 0

    processes.wait_until(drained, 20, "task queue drained and acked")
    assert [w.stop() for w in pool] == [0, 0]  # SIGTERM: clean exit
    done = [line for w in pool for line in w.log().splitlines() if '"task done"' in line]
    assert len(done) == len(tasks) and all('"reward_mean"' in line and '"weight_version": 0' in line for line in done)


def test_a_task_naming_an_environment_is_published_as_one_batch_of_its_sessions(stack, workers):
    """`centerline worker` runs the environment's sessions (three turns each, through its loopback
    chat endpoint and the proxy) and publishes one batch for the group: a sample per session."""
    run = f"e{uuid.uuid4().hex[:6]}"
    env = "tests.rollout_worker.session_environments:three_turns"
    task = PromptTask(f"{run}/0/0", f"{run}/g0", "Say hi.", "", "exact", 2, 0, environment=env)
    worker = workers("--rollout-max-new-tokens", "8", "--worker-id", "sessions")
    worker.wait_ready()
    asyncio.run(_publish_tasks(stack.nats, [task]))
    (batch,) = asyncio.run(_collect(stack.nats, run, 1, deadline_s=90))
    check_batch(batch, vocab_size=VOCAB)
    assert (batch.batch_id, batch.task_id, batch.num_samples) == (task.task_id, task.task_id, 2)
    assert (batch.attempt, batch.parts) == (1, 1)
    mask = batch.loss_mask.astype(bool)
    assert 6 <= mask.sum() <= 2 * 3 * 8 and (~mask).sum() > 0  # three turns of at most 8 tokens, template between
    assert (batch.cand_ids[~mask] == -1).all() and (batch.cand_ids[mask] >= 0).all()
    assert '"task done"' in worker.log() and f'"task_id": "{task.task_id}"' in worker.log()


def test_a_task_of_a_killed_worker_is_redelivered_and_published_once(stack, workers):
    run = f"k{uuid.uuid4().hex[:6]}"
    (task,) = _tasks(run, 1, n=4)
    flags = ("--rollout-max-new-tokens", "400", "--ack-wait", "2", "--concurrency", "1")
    victim = workers(*flags, "--worker-id", "victim")
    victim.wait_ready()
    asyncio.run(_publish_tasks(stack.nats, [task]))
    processes.wait_until(
        lambda: asyncio.run(_consumer_info(stack.nats)).num_ack_pending == 1, 20, "task taken by the victim"
    )
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    rescuer = workers(*flags, "--worker-id", "rescuer")
    batches = asyncio.run(_collect(stack.nats, run, 1, deadline_s=90, settle_s=1.0))
    # the rescuer's is attempt 2, under its own id (docs/design.md section 4); a batch the victim
    # published before it died is attempt 1's, which the trainer drops once attempt 2 is trained
    assert [b.batch_id for b in batches][-1:] == [f"{task.task_id}#2"] and batches[-1].attempt == 2
    assert [b.batch_id for b in batches[:-1]] in ([], [task.task_id])
    _check_group(batches[-1], task)
    info = asyncio.run(_consumer_info(stack.nats))
    assert info.num_ack_pending == 0 and info.num_pending == 0
    assert f'"task_id": "{task.task_id}"' in rescuer.log() and '"task done"' in rescuer.log()


def test_a_task_sglang_refuses_is_dead_lettered_at_once_with_sglangs_message(stack, workers):
    """A prompt longer than the model's context: SGLang answers 400, the proxy keeps it, and the
    worker dead-letters the task on its first delivery instead of retrying it max_deliver times."""
    run = f"x{uuid.uuid4().hex[:6]}"
    task = PromptTask(
        task_id=f"{run}/0/0",
        group_id=f"{run}/g0",
        prompt="up " + "a" * 1100 + "=",
        answer="A",
        reward="exact",
        n=2,
        step=0,
    )
    worker = workers("--rollout-max-new-tokens", "4", "--worker-id", "w-refused")
    worker.wait_ready()
    asyncio.run(_publish_tasks(stack.nats, [task]))

    def dead_lettered():
        return [
            m for m in asyncio.run(processes.stored_messages(stack.nats, names.DLQ_STREAM)) if m.data == task.to_bytes()
        ]

    (entry,) = processes.wait_until(dead_lettered, 60, "the task in the DLQ")
    assert entry.headers["Centerline-Kind"] == "task" and entry.headers["Centerline-Producer"] == "w-refused"
    assert (
        "400" in entry.headers["Centerline-Reason"] and "context length" in entry.headers["Centerline-Reason"].lower()
    )
    info = asyncio.run(_consumer_info(stack.nats))
    assert (info.num_ack_pending, info.num_pending, info.num_redelivered) == (0, 0, 0)
    assert worker.log().count(f'"task_id": "{task.task_id}"') == 1  # one delivery, one rejection
