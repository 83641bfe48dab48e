"""The whole system, small, for fault tests: the embedded NATS server, the session's real
SGLang server (tests/conftest.py), the proxy, any number of real ``centerline worker``
processes (added, SIGTERMed or SIGKILLed while the run goes on) and the trainer under
torchrun with 2 gloo ranks, on a toy dataset.

Settings are the short ones of the trainer's tests (2 prompt groups of 4 samples per step,
K = 16) with a 3 s ``--ack-wait`` on both consumers, so a task or batch whose holder died
comes back within seconds. ``run_accounting`` reads what a run left in NATS, in its metrics
and in its last checkpoint, and returns the figures the reliability tests assert and print
(``Figures.summary``). Faults at exact protocol points come from ``relay.py``.

Reused, not copied: the process helpers of ``tests/processes.py``, the proxy of
``tests/router_proxy/conftest.py``, the worker process of
``tests/rollout_worker/test_worker_stack.py`` and the trainer of
``tests/trainer_service/service_stack.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from nats.js.errors import NotFoundError

from centerline.nats_server import EmbeddedNats, NatsCluster
from centerline.toy.dataset import examples
from centerline.toy.tokenizer import VOCAB_SIZE
from shared import names
from shared.nats_client import connect
from shared.streams import StreamLimits, ensure_streams
from shared.wire import decode_batch
from tests.processes import SGLangProcess, stored_messages
from tests.rollout_worker.test_worker_stack import CONFIG, WorkerProcess
from tests.router_proxy.conftest import ProxyProcess
from tests.trainer_service.service_stack import Trainer, dead_letters

ACK_WAIT = "3"  # seconds, workers and trainer alike: a dead holder's message is back this fast
PROMPTS_PER_STEP, ROLLOUT_N = 2, 4
# The asynchronous default (--max-inflight-steps 2): with tasks a step ahead, the other batches
# fill a step while a fault holds one back, and steps here last about 0.1 s, so a batch held
# back a second can be more than --max-staleness versions old when it arrives. It is then
# dropped as stale (dead-lettered with rule stale, counted under ``dropped``, never as lost)
# and the trainer publishes its task again as a new attempt, so every group is still trained once.
TRAINER_FLAGS = (
    "--prompts-per-step",
    str(PROMPTS_PER_STEP),
    "--rollout-n",
    str(ROLLOUT_N),
    "--ack-wait",
    ACK_WAIT,
    "--step-timeout",
    "180",
    "--learning-rate",
    "1e-3",
)
WORKER_FLAGS = ("--rollout-max-new-tokens", "6", "--ack-wait", ACK_WAIT, "--nak-delay", "0.5", "--shutdown-grace", "30")


class Upstream:
    """The proxy in front of the shared SGLang server (random seed-0 model), shared by the tests
    of this package: no NATS of its own (the proxy publishes no audit events here), and every
    trainer starts by loading its own version 0 into the server."""

    def __init__(self, root: Path, engine: SGLangProcess, model: Path):
        self.engine, self.model = engine, model  # WorkerProcess reads its tokenizer from model
        self.proxy_process = ProxyProcess(root / "proxy.log", engine.url, "--vocab-size", str(VOCAB_SIZE), *CONFIG)
        try:
            status, body = self.proxy_process.wait_probed()
            assert status == 200, body
        except BaseException:
            self.close()
            raise
        self.proxy = self.proxy_process.url

    def close(self) -> None:
        self.proxy_process.stop()


class Topology:
    """One test's deployment: its own NATS server (file storage, ``sync_interval: always``,
    monitoring on a free port) in ``dir``, workers and trainers added by the test.

    ``nats`` is the server's URL and ``proxy``/``model`` the upstream's, which is what
    ``WorkerProcess`` reads; ``server`` is the ``EmbeddedNats`` a test kills and restarts
    (same data directory, same port).
    """

    def __init__(
        self, dir: Path, upstream: Upstream, server: NatsCluster | None = None, max_payload: int | None = None
    ):
        """``server``: a started NATS cluster to run on instead (streams with 3 replicas);
        ``max_payload``: the embedded server's, where a test needs batches split by size."""
        self.dir, self.upstream = dir, upstream
        self.proxy, self.model = upstream.proxy, upstream.model
        self.task, self.environment = "copy", ""  # the dataset's toy task; a test may set them before start_trainer
        limits = {"max_payload": max_payload} if max_payload else {}
        self.server = server if server is not None else EmbeddedNats(dir / "nats", http_port=0, **limits).start()
        self.replicas = min(3, len(server.nodes)) if server is not None else None
        self.nats = self.server.url
        self.workers: list[WorkerProcess] = []
        self.trainers: list[Trainer] = []
        asyncio.run(_ensure(self.nats, self.replicas))

    def dataset(self, size: int = 64) -> Path:
        """The trainer's dataset: ``size`` rows of the toy task ``task`` (``copy``), each naming
        ``environment`` where set (multi-turn sessions: ``chain``)."""
        path = self.dir / "tasks.jsonl"
        named = {"environment": self.environment} if self.environment else {}
        rows = [{"prompt": p, "answer": a, "reward": "exact", **named} for p, a in examples(self.task, size, seed=0)]
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        return path

    def add_worker(self, name: str, *flags: str, nats_url: str | None = None, env: dict | None = None) -> WorkerProcess:
        """Start ``centerline worker --worker-id name``; ``nats_url`` routes it through a relay,
        ``env`` adds to its environment (a failpoint)."""
        extra = ("--nats-url", nats_url) if nats_url else ()
        worker = WorkerProcess(
            self, self.dir / f"worker-{name}.log", *WORKER_FLAGS, "--worker-id", name, *extra, *flags, env=env
        )
        self.workers.append(worker)
        return worker

    def start_trainer(self, steps: int, *flags: str, nats_url: str | None = None, failpoints: str = "") -> Trainer:
        """``centerline trainer`` under torchrun, 2 ranks; ``nats_url`` routes it through a relay,
        ``failpoints`` arms ``CENTERLINE_FAILPOINTS``."""
        trainer = Trainer(
            self.dir / "run",
            self.model,
            self.dataset(),
            nats_url or self.nats,
            self.upstream.engine.url,
            "--steps",
            str(steps),
            *TRAINER_FLAGS,
            *(("--nats-stream-replicas", str(self.replicas)) if self.replicas else ()),
            *flags,
            failpoints=failpoints,
        )
        self.trainers.append(trainer)
        return trainer

    @property
    def run_dir(self) -> Path:
        return self.dir / "run"

    def steps_done(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(path.read_bytes().splitlines()) if path.exists() else 0

    def wait_drained(self, deadline_s: float = 30.0) -> dict:
        """``consumers()`` once no task and no batch is pending or unacked, or no task is and the
        trainers have exited, or as it is after ``deadline_s`` (the test asserts on ``leftovers``).
        A task whose ack a fault took comes back ``ack_wait`` after its worker gave up on the ack,
        possibly after the run's last step; it is sampled again and acked, and its new attempt's
        batches are dropped as duplicates by a trainer still running, or left for the next."""
        end = time.monotonic() + deadline_s
        while True:
            found = asyncio.run(consumers(self.nats))
            if all(v == (0, 0) for v in found.values()) or time.monotonic() > end:
                return found
            if self.trainers_done() and found.get(names.WORKERS_CONSUMER) == (0, 0):
                return found  # a batch stored after the trainer's last step stays (``leftovers``)
            time.sleep(0.2)  # polling interval, not synchronisation

    def trainers_done(self) -> bool:
        return all(t.proc.poll() is not None for t in self.trainers)

    def close(self) -> None:
        for trainer in self.trainers:
            trainer.kill()
        nodes = getattr(self.server, "nodes", [self.server])
        nats_down = all(node.proc is None or node.proc.poll() is not None for node in nodes)
        for worker in self.workers:
            if (
                nats_down and worker.proc.poll() is None
            ):  # SIGTERM would wait out its publish retries (30 s) for nothing
                worker.proc.kill()
                worker.proc.wait()
            worker.stop()
        self.server.stop()


def server_sync_always(server: EmbeddedNats) -> bool:
    """What the running server reports on /varz (its monitoring port): JetStream fsyncs before every ack."""
    with urllib.request.urlopen(f"http://{server.host}:{server.http_port}/varz", timeout=5) as resp:
        return json.loads(resp.read())["jetstream"]["config"].get("sync_always", False)


async def _ensure(url: str, replicas: int | None = None) -> None:
    nc = await connect(url)
    await ensure_streams(nc.jetstream(), StreamLimits(replicas=replicas))
    await nc.close()


# ---------------------------------------------------------------------------- accounting


@dataclass
class Figures:
    """What one reliability run did, in the terms of the issue's closing note (None: not applicable)."""

    faults: int = 0  # faults injected
    published: int | None = None  # batch messages stored in rollouts.batches
    acked: int | None = None  # batches whose publish JetStream acknowledged
    trained: int | None = None  # batches trained (every step's batch_ids)
    dead_lettered: int | None = None  # messages in rollouts.dlq for a defect (any rule but stale)
    dropped: dict | None = None  # batches deliberately not trained, by rule: stale (dead-lettered), duplicate_attempt
    lost: int | None = None  # acked batches missing from the stream or neither trained, dropped nor dead-lettered,
    # or expected samples never trained
    duplicated: int | None = None  # batch_ids stored twice, or samples trained more than once
    groups_twice: int | None = None  # task groups trained under more than one attempt or batch id repeat
    notes: dict = field(default_factory=dict)

    def summary(self, test: str) -> str:
        """One line for the closing note; ``pytest -s`` shows it."""
        show = lambda v: "-" if v is None else v  # noqa: E731
        counts = " ".join(
            f"{k}={show(getattr(self, k))}"
            for k in (
                "faults",
                "published",
                "acked",
                "trained",
                "dead_lettered",
                "dropped",
                "lost",
                "duplicated",
                "groups_twice",
            )
        )
        return f"RELIABILITY {test}: {counts}" + "".join(f" {k}={v}" for k, v in self.notes.items())


async def stream_messages(nats_url: str, stream: str = names.ROLLOUTS_STREAM) -> list:
    """Every message of ``stream`` in sequence order, as (sequence, headers, data)."""
    return [(m.seq, m.headers or {}, m.data) for m in await stored_messages(nats_url, stream)]


async def consumers(nats_url: str, delivered: dict | None = None) -> dict:
    """``{consumer: (num_pending, num_ack_pending)}`` of the workers' and the trainer's consumers,
    those that exist; ``delivered``, if given, gets each one's last delivered stream sequence."""
    nc = await connect(nats_url)
    js = nc.jetstream()
    try:
        out = {}
        for stream, durable in (
            (names.PROMPTS_STREAM, names.WORKERS_CONSUMER),
            (names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER),
        ):
            try:
                info = await js.consumer_info(stream, durable)
            except NotFoundError:
                continue
            out[durable] = (info.num_pending, info.num_ack_pending)
            if delivered is not None:
                delivered[durable] = info.delivered.stream_seq
        return out
    finally:
        await nc.close()


def leftovers(run: dict) -> list[str]:
    """What a finished run left behind that it should not have, in words ([] when nothing).

    No task may be pending or held, and no batch held. A batch may be stored and never
    delivered to the trainer only as another attempt of a task the run trained: a task whose
    ack a fault took comes back after ``ack_wait`` and is sampled again, possibly after the
    trainer's last step; a trainer would drop that attempt as ``duplicate_attempt``."""
    found, ledger = run["consumers"], run["state"]["ledger"]
    out = [
        f"{durable}: {pending} pending, {unacked} unacked"
        for durable, (pending, unacked) in found.items()
        if durable == names.WORKERS_CONSUMER and (pending, unacked) != (0, 0)
    ]
    pending, unacked = found.get(names.TRAINER_CONSUMER, (0, 0))
    if unacked:
        out.append(f"{names.TRAINER_CONSUMER}: {unacked} batches delivered and not acked")
    backlog = run["backlog"]
    if pending != len(backlog):
        out.append(f"{names.TRAINER_CONSUMER}: {pending} pending, {len(backlog)} stored past its last delivery")
    out += [
        f"{b.batch_id}: never delivered, and the run trained no other attempt of task {b.task_id!r}"
        for b in backlog
        if b.task_id not in ledger or ledger[b.task_id]["attempt"] == b.attempt
    ]
    return out


def published_and_acked(workers: list[WorkerProcess]) -> set[str]:
    """batch_ids whose publish JetStream acknowledged, from the workers' logs: those of a
    ``task done`` line, and those of a ``task ack lost`` line (stored, the task's own ack lost)."""
    return {
        bid
        for w in workers
        for line in w.log().splitlines()
        if line.startswith("{")
        and json.loads(line)["msg"] in ("task done", "task ack lost; its batches are stored, the task will come back")
        for bid in json.loads(line)["batches"]
    }


def run_accounting(nats_url: str, run_dir: Path, steps: int, workers: list[WorkerProcess]) -> tuple[Figures, dict]:
    """Figures of a finished trainer run, and the details the tests assert on.

    Expected: every sample ``f"{run_id}/{step}/{j}/{i}"`` of steps ``0..steps-1`` trained
    exactly once, under one attempt of its task (samples are counted, not batch ids), each
    batch_id stored once, no dead letter but those dropped as stale, nothing pending. What was
    trained is read from every step's ``batch_ids`` in ``metrics.jsonl``, repeats included (the
    ledger, a map by task, would hide a group trained twice); the stored copy of a batch is the
    one at the ledger's stream sequence. Lost: an acked batch not stored, or stored and neither
    trained, dead-lettered, nor of a task trained under another attempt (dropped as
    ``duplicate_attempt``); or an expected sample never trained. A worker logs an attempt's
    batch id, the stream holds its parts (``T/a-b`` when split by size).
    """
    state = orjson.loads((run_dir / "checkpoints" / f"step-{steps:06d}" / "state.json").read_bytes())
    run_id, ledger = state["run_id"], state["ledger"]
    parts = {bid: seq for entry in ledger.values() for bid, seq in entry["parts"].items()}
    stored = [(seq, decode_batch(bytes(data))) for seq, _, data in asyncio.run(stream_messages(nats_url))]
    by_seq = {seq: batch for seq, batch in stored}
    by_id = {b.batch_id: b for _, b in reversed(stored)}  # the first copy of each id
    by_id.update({bid: by_seq[seq] for bid, seq in parts.items() if seq in by_seq})
    ids = Counter(b.batch_id for _, b in stored)
    lines = [orjson.loads(x) for x in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    batches = [bid for m in lines for bid in m["batch_ids"]]
    trained = Counter(s for bid in batches for s in by_id[bid].sample_ids)
    attempts: dict[str, set] = {}
    for bid in batches:
        attempts.setdefault(by_id[bid].task_id, set()).add(by_id[bid].attempt)
    expected = {
        f"{run_id}/{s}/{j}/{i}" for s in range(steps) for j in range(PROMPTS_PER_STEP) for i in range(ROLLOUT_N)
    }
    acked = published_and_acked(workers)
    dlq = asyncio.run(dead_letters(nats_url))
    stale = [h for h, _ in dlq if h.get("rule") == "stale"]
    dropped = Counter({"stale": len(stale)} if stale else {})
    for m in lines:
        dropped.update(m.get("gate_dropped", {}))
    settled = set(batches) | {h.get("batch_id") for h, _ in dlq}
    superseded = {bid for bid, b in by_id.items() if b.task_id in ledger and ledger[b.task_id]["attempt"] != b.attempt}
    parts_of: dict[str, set] = {}  # the attempt's batch id a worker logs -> the ids of its stored parts
    for bid, b in by_id.items():
        parts_of.setdefault(b.task_id if b.attempt == 1 else f"{b.task_id}#{b.attempt}", set()).add(bid)
    unsettled = {whole for whole in acked & set(parts_of) if parts_of[whole] - settled - superseded}
    figures = Figures(
        published=len(stored),
        acked=len(acked),
        trained=len(batches),
        dead_lettered=len(dlq) - len(stale),
        dropped=dict(dropped),
        lost=len(expected - set(trained)) + len(acked - set(parts_of)) + len(unsettled),
        duplicated=sum(n - 1 for n in trained.values()) + sum(n - 1 for n in ids.values()),
        groups_twice=sum(len(a) > 1 for a in attempts.values())
        + len({by_id[bid].task_id for bid, n in Counter(batches).items() if n > 1}),
    )
    if dlq:  # why, in the RELIABILITY line: the gate's rule and reason headers
        figures.notes["dead_letters"] = [
            f"{h.get('batch_id')} {h.get('rule')}: {h.get('reason', '')[:300]}" for h, _ in dlq
        ]
    delivered: dict = {}  # each consumer's last delivered stream sequence, filled by consumers()
    ledger_ok = set(parts) == set(batches) and all(by_seq[seq].batch_id == bid for bid, seq in parts.items())
    details = {
        "state": state,
        "trained": trained,
        "expected": expected,
        "acked": acked,
        "stored_ids": ids,
        "metrics": lines,
        "consumers": asyncio.run(consumers(nats_url, delivered)),
        "backlog": [b for seq, b in stored if seq > delivered.get(names.TRAINER_CONSUMER, 0)],
        "ledger_matches_stream": ledger_ok,
        "producers": {bid: b.producer for bid, b in by_id.items()},
        "attempts": attempts,
        "parts_of": parts_of,
    }
    return figures, details
