"""Real processes around `centerline trainer` for its integration tests: the embedded NATS
server, a real SGLang server (the tests' shared one), the trainer under torchrun, and a
stand-in rollout worker.

`StandInWorker` plays the rollout worker in a thread of the test process: it pulls prompt
tasks from `prompts.tasks`, reads the engine's weight version from GET /model_info (as a
real worker reads it from the response, SGLang's initial "default" as version 0), and publishes one synthetic
contract-valid batch
per task (ids in the model's vocabulary, one GRPO group). `inject` lets a test publish
extra (faulty or duplicated) messages next to a task's batch.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import orjson

from centerline.synth import make_batch
from rollout_worker.publish import publish_batch
from shared import names
from shared.nats_client import connect, pull_consumer
from shared.streams import ensure_streams
from shared.task import PromptTask
from shared.wire import encode_batch
from tests.processes import ENV, REPO, http, stored_messages

TORCHRUN = Path(sys.executable).with_name("torchrun")
K = 16  # candidates per token in these tests (--rollout-top-logprobs-num)
TOKENS = 5  # response tokens per sample
# The trainer settings of these tests: 2 prompt groups of 4 samples per step, batches at most one
# version stale, a 3 s ack wait so that a dead holder's batch is back within seconds. On-policy
# (one step of tasks at a time, not the default 2): the tests stage their faults at known
# steps and weight versions, which tasks published a step ahead would blur.
FLAGS = ("--prompts-per-step", "2", "--rollout-n", "4", "--max-staleness", "1", "--ack-wait", "3")
FLAGS += ("--step-timeout", "60", "--learning-rate", "1e-3", "--max-inflight-steps", "1")


def write_dataset(path: Path, size: int = 16) -> Path:
    lines = [
        f'{{"prompt": "{a}+{a}=", "answer": "{2 * a}", "reward": "exact_match", "level": {a % 3}}}' for a in range(size)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def task_batch(task: PromptTask, version: int, vocab: int):
    """A valid batch for ``task``: ``task.n`` samples of one group, GRPO advantages."""
    batch = make_batch(
        samples=task.n,
        tokens_per_sample=TOKENS,
        k=K,
        vocab_size=vocab,
        seed=zlib.crc32(task.task_id.encode()),
        weight_version=version,
        batch_id=task.task_id,  # a worker's first attempt (rollout_worker/packing.py batch_id_of)
        prompt_len=4,
    )
    rewards = np.asarray(batch.rewards, np.float32)
    batch.group_ids = [task.group_id] * task.n
    batch.task_id = task.task_id  # named by its task, as a worker's batch is: the trainer refuses other runs
    return replace(batch, advantages=(rewards - rewards.mean()).astype(np.float32))


@dataclass
class StandInWorker:
    nats_url: str
    engine_url: str
    vocab: int
    inject: object = None  # callable(worker, task, batch) -> awaitable, run before the batch is published
    blocked: object = None  # callable(task) -> bool: hold the task's batch back while it returns True
    published: dict = field(default_factory=dict)  # batch_id -> bytes, valid batches
    extra: dict = field(default_factory=dict)  # batch_id -> bytes, injected messages
    error: BaseException | None = None

    def start(self) -> StandInWorker:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def __enter__(self) -> StandInWorker:
        return self.start()

    def __exit__(self, *exc) -> None:
        # Stopped before any assertion is reported: pytest's assertion rewriting parses source
        # with `ast`, which CPython 3.11 can break on while another thread imports.
        self.stop()

    def version(self) -> int:
        version = http("GET", self.engine_url + "/model_info", timeout=30)[1]["weight_version"]
        return 0 if version == "default" else int(version)

    async def _main(self) -> None:
        try:
            nc = await connect(self.nats_url, name="stand-in-worker")
            self.js = nc.jetstream()
            await ensure_streams(self.js)
            tasks = await pull_consumer(
                self.js, names.PROMPTS_STREAM, names.WORKERS_CONSUMER, filter_subject=names.PROMPTS_SUBJECT
            )
            while not self._stop.is_set():
                for msg in await tasks.fetch(1, timeout=0.5):
                    task = PromptTask.from_bytes(msg.data)
                    while self.blocked is not None and self.blocked(task) and not self._stop.is_set():
                        await asyncio.sleep(0.05)  # polling for the test to release the task
                    batch = task_batch(task, await asyncio.to_thread(self.version), self.vocab)
                    if self.inject is not None:
                        await self.inject(self, task, batch)
                    data = encode_batch(batch)
                    await publish_batch(self.js, data, max_payload=nc.max_payload)
                    self.published[batch.batch_id] = data
                    await tasks.ack(msg)
            await nc.close()
        # reported by the test
        except BaseException as exc:  # noqa: BLE001
            self.error = exc

    async def publish_raw(self, batch_id: str, data: bytes, msg_id: str) -> None:
        """Publish ``data`` under its own Nats-Msg-Id, bypassing the duplicate window of ``batch_id``."""
        await self.js.publish(names.ROLLOUTS_SUBJECT, data, headers={names.MSG_ID_HEADER: msg_id})
        self.extra[msg_id] = data


def fault(batch, kind: str, version: int | None = None):
    """``batch`` with one defect of the completeness contract, under a fresh batch_id."""
    cand_ids, cand_lp, adv = np.array(batch.cand_ids), np.array(batch.cand_logprobs), np.array(batch.advantages)
    if kind == "short_row":
        cand_ids[2, -1], cand_lp[2, -1] = -1, -np.inf
    elif kind == "nan_advantage":
        adv[1] = np.nan
    elif kind == "duplicate_candidate":
        cand_ids[3, 1] = cand_ids[3, 0]
    out = replace(batch, cand_ids=cand_ids, cand_logprobs=cand_lp, advantages=adv)
    out.batch_id = f"fault/{kind}/{batch.batch_id}"
    if version is not None:  # every token sampled by ``version``
        out.weight_version = version
        out.token_versions = np.full_like(out.token_versions, version)
    return out


def descendants(pid: int) -> list[int]:
    """Child processes of ``pid``, recursively (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            out += [child, *descendants(child)]
    return out


class Trainer:
    """`centerline trainer` as a process group: under torchrun with ``nproc`` ranks, or plain.
    ``Trainer.kill_all()`` ends every one still running (fixture teardown)."""

    started: list[Trainer] = []

    def __init__(
        self,
        run_dir: Path,
        model: Path,
        dataset: Path,
        nats_url: str,
        engine_url: str,
        *flags: str,
        nproc: int = 2,
        failpoints: str = "",
        node: tuple[int, int, int] | None = None,
    ):
        """``node``: (node rank, nodes, rendezvous port) for one node of a multi-node run, each
        node a torchrun of its own with ``nproc`` ranks; node 0 hosts the rendezvous store on
        127.0.0.1:port, as `torchrun --nnodes N --node-rank R --master-addr --master-port` does on a cluster."""
        self.run_dir, self.log_path = (
            run_dir,
            run_dir.with_suffix(f".{len(list(run_dir.parent.glob(run_dir.name + '.*log')))}.log"),
        )
        # --standalone: the rendezvous store binds a port of its own choosing (no free-port race)
        if node is not None:
            rank, nodes, port = node
            launcher = [str(TORCHRUN), "--nnodes", str(nodes), "--node-rank", str(rank), "--nproc-per-node", str(nproc)]
            launcher += ["--master-addr", "127.0.0.1", "--master-port", str(port), "-m"]
        elif nproc > 1:
            launcher = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), "-m"]
        else:
            launcher = [sys.executable, "-m"]
        cmd = [
            *launcher,
            "centerline",
            "trainer",
            "--model",
            str(model),
            "--dataset",
            str(dataset),
            "--run-dir",
            str(run_dir),
            "--nats-url",
            nats_url,
            "--engine-urls",
            engine_url,
            "--rollout-top-logprobs-num",
            str(K),
            *flags,
        ]
        env = dict(ENV, OMP_NUM_THREADS="1", CENTERLINE_FAILPOINTS=failpoints)
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True
        )
        Trainer.started.append(self)

    @classmethod
    def kill_all(cls) -> None:
        for trainer in cls.started:
            trainer.kill()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"trainer still running after {timeout}s:\n{self.log()}") from None

    def kill(self) -> None:
        """SIGKILL the launcher and every rank at once, as a machine crash would. torchrun starts
        each rank in a session of its own, so the ranks are found as the launcher's descendants."""
        if self.proc.poll() is None:
            for pid in [*descendants(self.proc.pid), self.proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


async def consumer_info(nats_url: str):
    nc = await connect(nats_url)
    try:
        return await nc.jetstream().consumer_info(names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
    finally:
        await nc.close()


async def dead_letters(nats_url: str) -> list:
    """Every message in the DLQ stream as (headers, data)."""
    return [(m.headers or {}, m.data) for m in await stored_messages(nats_url, names.DLQ_STREAM)]


async def last_weights_event(nats_url: str) -> dict:
    nc = await connect(nats_url)
    try:
        msg = await nc.jetstream().get_last_msg(names.WEIGHTS_STREAM, names.WEIGHTS_SUBJECT)
        return orjson.loads(msg.data)
    finally:
        await nc.close()
