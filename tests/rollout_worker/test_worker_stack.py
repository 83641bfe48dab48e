"""`centerline worker` end to end: embedded NATS, the session's real SGLang server, the proxy
in front of it and worker processes.

Tasks go onto prompts.tasks; the groups that arrive on rollouts.batches are decoded and
checked against the contract, their rewards recomputed from the sampled bytes and their
advantages from the rewards. Synchronisation is by polling with deadlines, never sleeping.
"""

from __future__ import annotations

import asyncio
import re
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
from centerline.ports import free_port
from shared import names
from shared.contract import ContractViolation, check_batch
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


def _task_done(worker: WorkerProcess, task_id: str) -> bool:
    """Whether ``worker`` logged ``task done`` for ``task_id`` (after the batch is stored and the task acked)."""
    return any('"task done"' in line and f'"task_id": "{task_id}"' in line for line in worker.log().splitlines())


def _wait_drained(url: str):
    """The workers' consumer once nothing is pending or unacked: a worker acks or TERMs a task after
    publishing its batch or its dead letter, so a test that has seen those waits for this."""
    return processes.wait_until(
        lambda: (lambda i: i if (i.num_pending, i.num_ack_pending) == (0, 0) else None)(
            asyncio.run(_consumer_info(url))
        ),
        30,
        "no task pending or unacked",
    )


def _dead_letters(url: str, data: bytes | None = None) -> list:
    """The DLQ's entries (those whose bytes are ``data``, if given)."""
    stored = asyncio.run(processes.stored_messages(url, names.DLQ_STREAM))
    return [m for m in stored if data is None or m.data == data]


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
    # the worker logs the task done after the batch is stored and the task acked: wait for the line
    processes.wait_until(lambda: _task_done(worker, task.task_id), 30, f"task done {task.task_id}", worker.proc)


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
    # the rescuer acks the task after publishing its batch, and logs it after the ack
    _wait_drained(stack.nats)
    processes.wait_until(lambda: _task_done(rescuer, task.task_id), 30, f"task done {task.task_id}", rescuer.proc)


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

    (entry,) = processes.wait_until(lambda: _dead_letters(stack.nats, task.to_bytes()), 60, "the task in the DLQ")
    assert entry.headers["Centerline-Kind"] == "task" and entry.headers["Centerline-Producer"] == "w-refused"
    assert (
        "400" in entry.headers["Centerline-Reason"] and "context length" in entry.headers["Centerline-Reason"].lower()
    )
    assert _wait_drained(stack.nats).num_redelivered == 0  # TERMed once its dead letter is stored
    assert worker.log().count(f'"task_id": "{task.task_id}"') == 1  # one delivery, one rejection


def test_an_environment_that_never_returns_is_dead_lettered_at_its_deadline_and_frees_its_slot(stack, workers):
    """Sessions that never return are cancelled at the worker's deadline, here its default from
    the turn timeout and the budget (3 s x ceil(48 / 16) turns = 9 s): nothing is published, the
    task is dead-lettered with the reason, and the worker's one slot takes the next task."""
    run = f"h{uuid.uuid4().hex[:6]}"
    env = "tests.rollout_worker.fault_environments:hangs_after_a_turn"
    hung = PromptTask(f"{run}/0/0", f"{run}/g0", "Hi", "", "exact", 2, 0, environment=env)
    (after,) = _tasks(run, 1, n=2)
    after = PromptTask(f"{run}/0/1", f"{run}/g1", after.prompt, after.answer, "exact", 2, 0)
    flags = ("--concurrency", "1", "--request-timeout", "3", "--rollout-max-new-tokens", "16")
    worker = workers(*flags, "--rollout-session-max-tokens", "48", "--worker-id", "w-hang")
    worker.wait_ready()
    asyncio.run(_publish_tasks(stack.nats, [hung, after]))
    batches = asyncio.run(_collect(stack.nats, run, 1, deadline_s=90, settle_s=1.0))
    assert [b.batch_id for b in batches] == [after.task_id]  # nothing of the hung task
    (entry,) = processes.wait_until(lambda: _dead_letters(stack.nats, hung.to_bytes()), 10, "the hung task's DLQ entry")
    assert (entry.headers["Centerline-Kind"], entry.headers["Centerline-Producer"]) == ("task", "w-hang")
    assert entry.headers["Centerline-Reason"] == (
        f"environment {env!r}: 2 of 2 sessions had not returned within --environment-timeout 9 s, and were "
        "cancelled; nothing of the task is published. Make it return each session's reward, or raise "
        "--environment-timeout (unset, it is --request-timeout x ceil(--rollout-session-max-tokens / "
        "--rollout-max-new-tokens))"
    )
    assert _wait_drained(stack.nats).num_redelivered == 0


def _unrenderable_tokenizer(model_dir: Path, out: Path) -> Path:
    """The model's tokenizer with a chat template that raises on a prompt holding "unrenderable"."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    fails = (
        "{% if 'unrenderable' in messages[0]['content'] %}"
        "{{ raise_exception('cannot render ' + messages[0]['content']) }}{% endif %}"
    )
    tok.chat_template = fails + tok.chat_template
    tok.save_pretrained(str(out))
    return out


def _task_outcomes(metrics_url: str) -> dict[str, float]:
    """``centerline_worker_tasks_total`` by outcome, from the worker's /metrics."""
    _, text = processes.http("GET", metrics_url, timeout=5)
    found = re.findall(r'^centerline_worker_tasks_total\{outcome="(\w+)"\} (\S+)$', text, re.M)
    return {outcome: float(value) for outcome, value in found}


def test_an_unexpected_exception_in_a_task_is_dead_lettered_at_once_with_its_type_and_message(stack, workers, tmp_path):
    """A chat template that cannot render the task's prompt raises jinja2's TemplateError, which is
    no failure family of the worker's: the task is TERMed on its first delivery and dead-lettered
    with the exception's type and message, counted as ``error``; the next task is sampled as usual."""
    run = f"u{uuid.uuid4().hex[:6]}"
    broken = PromptTask(f"{run}/0/0", f"{run}/g0", "copy (unrenderable)=", "x", "exact", 2, 0)
    (after,) = _tasks(run, 1, n=2)
    after = PromptTask(f"{run}/0/1", f"{run}/g1", after.prompt, after.answer, "exact", 2, 0)
    port = free_port()
    tokenizer = _unrenderable_tokenizer(stack.model, tmp_path / "tokenizer")
    flags = ("--tokenizer", str(tokenizer), "--chat-template", "--metrics-port", str(port), "--concurrency", "1")
    worker = workers(*flags, "--rollout-max-new-tokens", "8", "--worker-id", "w-defect")
    worker.wait_ready()
    asyncio.run(_publish_tasks(stack.nats, [broken, after]))
    batches = asyncio.run(_collect(stack.nats, run, 1, deadline_s=60, settle_s=1.0))
    assert [b.batch_id for b in batches] == [after.task_id]
    check_batch(batches[0], vocab_size=VOCAB)
    (entry,) = processes.wait_until(lambda: _dead_letters(stack.nats, broken.to_bytes()), 10, "the task's DLQ entry")
    assert (entry.headers["Centerline-Kind"], entry.headers["Centerline-Producer"]) == ("task", "w-defect")
    assert (
        entry.headers["Centerline-Reason"] == f"unexpected TemplateError in the worker: cannot render {broken.prompt}"
    )
    assert _wait_drained(stack.nats).num_redelivered == 0  # TERMed on its first delivery, never looped
    metrics = f"http://127.0.0.1:{port}/metrics"
    want = {"error": 1.0, "ok": 1.0}  # counted once the task is done, after its ack: wait for it
    assert processes.wait_until(lambda: _task_outcomes(metrics) == want, 30, f"task outcomes {want}", worker.proc)


def test_a_batch_that_breaks_the_workers_contract_check_is_dead_lettered_whole(stack, workers):
    """The worker checks its own batch against the contract before publishing: with a vocabulary
    smaller than the ids SGLang samples (--vocab-size 100 against the model's 260) the batch breaks
    it; it goes to the DLQ whole with the contract's rule and message, nothing to ROLLOUTS."""
    run = f"c{uuid.uuid4().hex[:6]}"
    task = PromptTask(f"{run}/0/0", f"{run}/g0", "ABC=", "ABC", "exact", 2, 0)  # prompt ids below 100
    worker = workers("--rollout-max-new-tokens", "8", "--vocab-size", "100", "--worker-id", "w-contract")
    worker.wait_ready()
    asyncio.run(_publish_tasks(stack.nats, [task]))

    def dead_lettered():
        return [m for m in _dead_letters(stack.nats) if m.headers.get("Centerline-Producer") == "w-contract"]

    (entry,) = processes.wait_until(dead_lettered, 60, "the batch in the DLQ")
    assert entry.headers["Centerline-Kind"] == "batch"
    batch = decode_batch(bytes(entry.data))
    assert (batch.batch_id, batch.task_id, batch.num_samples, batch.producer) == (
        task.task_id,
        task.task_id,
        2,
        "w-contract",
    )
    check_batch(batch, vocab_size=VOCAB)  # whole and sound for the model's vocabulary
    with pytest.raises(ContractViolation) as broken:
        check_batch(batch, vocab_size=100)
    reason = f"batch {task.task_id!r} breaks the contract ({broken.value.rule}): {broken.value}"
    assert entry.headers["Centerline-Reason"] == reason
    assert _wait_drained(stack.nats).num_redelivered == 0
    assert asyncio.run(_collect(stack.nats, run, 1, deadline_s=2)) == []


def test_a_contract_breaking_batch_above_max_payload_dead_letters_its_task(stack, tmp_path):
    """A batch too large for one message (a server with max_payload 8 KiB) cannot go to the DLQ
    whole: its task does, the reason naming the batch's size, so the rejection is never lost."""
    server = EmbeddedNats(tmp_path / "nats", max_payload=8192).start()
    worker = None
    try:
        asyncio.run(_ensure(server.url))
        small = type("Stack", (), {"nats": server.url, "proxy": stack.proxy, "model": stack.model})
        flags = ("--rollout-max-new-tokens", "32", "--vocab-size", "100", "--worker-id", "w-large")
        worker = WorkerProcess(small, tmp_path / "worker.log", *flags)
        worker.wait_ready()
        task = PromptTask("large/0/0", "large/g0", "ABC=", "ABC", "exact", 4, 0)
        asyncio.run(_publish_tasks(server.url, [task]))
        (entry,) = processes.wait_until(lambda: _dead_letters(server.url), 60, "the task in the DLQ", worker.proc)
        assert (entry.headers["Centerline-Kind"], bytes(entry.data)) == ("task", task.to_bytes())
        reason = entry.headers["Centerline-Reason"]
        assert re.fullmatch(
            rf"batch '{task.task_id}' breaks the contract \(\w+\): .+ \(the batch, (\d+) bytes, "
            r"exceeds max_payload: its task is dead-lettered instead\)",
            reason,
        ), reason
        assert int(re.search(r"the batch, (\d+) bytes", reason)[1]) > 8192 - 4096
        assert _wait_drained(server.url).num_redelivered == 0
    finally:
        if worker is not None:
            worker.stop()
        server.stop()
