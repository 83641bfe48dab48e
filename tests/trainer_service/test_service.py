"""`centerline trainer` end to end: embedded NATS, the session's real SGLang server (the trainer
loads each weight version into it), the trainer under torchrun with 2 gloo ranks, and a
stand-in rollout worker publishing synthetic valid batches.

One run (`faulty_run`) carries the faults of the contract and two re-published batches;
each test asserts one behaviour of it. `test_sigkill_*` runs the trainer twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import threading
import time
from pathlib import Path

import orjson
import pytest

from centerline.nats_server import EmbeddedNats
from centerline.toy.tokenizer import VOCAB_SIZE
from shared.wire import encode_batch as encode
from tests.processes import free_port, http, wait_until
from tests.trainer_service.service_stack import (
    FLAGS,
    StandInWorker,
    Trainer,
    consumer_info,
    dead_letters,
    fault,
    last_weights_event,
    write_dataset,
)

pytestmark = pytest.mark.integration

STEPS = 4
EXPECTED_RULES = {
    "short_row": "short_row",
    "nan_advantage": "non_finite",
    "duplicate_candidate": "duplicate_candidate",
    "stale": "stale",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    """NATS for the module and the model the shared SGLang server serves (the trainer's version 0)."""
    tmp = tmp_path_factory.mktemp("trainer-stack")
    nats = EmbeddedNats(tmp / "nats").start()
    yield tmp, nats, model_dir
    Trainer.kill_all()
    nats.stop()


def metrics_lines(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def final_state(run_dir) -> dict:
    return orjson.loads((run_dir / "checkpoints" / f"step-{STEPS:06d}" / "state.json").read_bytes())


@pytest.fixture(scope="module")
def faulty_run(stack, sglang_server):
    """4 steps of 2 groups x 4 samples; faults and re-published batches on the side. The
    engine's weight version is read as the run ends (a later test's ``sglang`` puts it back)."""
    tmp, nats, model = stack
    engine = sglang_server.serve(model)
    injected = {}  # batch_id -> expected rule

    async def inject(worker, task, batch):
        step, index = map(int, task.task_id.split("/")[1:])
        if (step, index) == (0, 0):
            for kind in ("short_row", "nan_advantage", "duplicate_candidate"):
                bad = fault(batch, kind)
                await worker.publish_raw(bad.batch_id, encode(bad), bad.batch_id)
                injected[bad.batch_id] = EXPECTED_RULES[kind]
        if (step, index) == (1, 1):  # step 1 holds batch (1, 0) and waits for this task's batch
            held = task.task_id.replace("/1/1", "/1/0")
            await worker.publish_raw(held, worker.published[held], held + "/again")
            injected[held + "/again"] = "duplicate_batch"
        if (step, index) == (2, 0):
            assert batch.weight_version == 2  # trainer at version 2 with --max-staleness 1
            bad = fault(batch, "stale", version=0)
            await worker.publish_raw(bad.batch_id, encode(bad), bad.batch_id)
            injected[bad.batch_id] = "stale"
            first = task.task_id.replace("/2/0", "/0/0")  # trained in step 0: in the ledger now
            await worker.publish_raw(first, worker.published[first], first + "/again")
            injected[first + "/again"] = "duplicate_batch"

    run_dir = tmp / "run-faulty"
    with StandInWorker(nats.url, engine.url, VOCAB_SIZE, inject=inject) as worker:
        trainer = Trainer(
            run_dir, model, write_dataset(tmp / "tasks.jsonl"), nats.url, engine.url, "--steps", str(STEPS), *FLAGS
        )
        start = time.monotonic()
        code = trainer.wait(240)
        elapsed = time.monotonic() - start
    assert worker.error is None, worker.error
    assert code == 0, trainer.log()
    return run_dir, worker, injected, engine.weight_version(), nats, elapsed


def test_steps_advance_engine_version_and_leave_nothing_unacked(faulty_run):
    run_dir, worker, _, engine_version, nats, elapsed = faulty_run
    lines = metrics_lines(run_dir)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert [m["version"] for m in lines] == list(range(1, STEPS + 1))
    assert all(m["samples"] == 8 and m["trained_tokens"] == 8 * 5 for m in lines)
    assert engine_version == str(STEPS)
    info = asyncio.run(consumer_info(nats.url))
    assert (info.num_ack_pending, info.num_pending) == (0, 0)
    event = asyncio.run(last_weights_event(nats.url))
    assert event["version"] == STEPS and Path(event["path"]) == (run_dir / "weights" / f"v{STEPS:06d}").resolve()
    assert event["sha256"] == hashlib.sha256((Path(event["path"]) / "model.safetensors").read_bytes()).hexdigest()
    print(
        f"\n{STEPS} steps in {elapsed:.1f}s; per step:",
        [{k: round(m[k], 3) for k in ("gather_s", "train_s", "save_s", "weights_s", "step_s")} for m in lines],
    )


def test_faulty_batches_are_dead_lettered_by_rule_and_never_trained(faulty_run):
    run_dir, worker, injected, _, nats, _ = faulty_run
    letters = {
        headers["batch_id"] + ("/again" if headers["rule"] == "duplicate_batch" else ""): (headers, data)
        for headers, data in asyncio.run(dead_letters(nats.url))
    }
    assert {bid: h["rule"] for bid, (h, _) in letters.items()} == injected
    for bid, (headers, data) in letters.items():
        assert data == worker.extra[bid]  # the same bytes
        assert headers["reason"]
    trained = [bid for m in metrics_lines(run_dir) for bid in m["batch_ids"]]
    assert sorted(trained) == sorted(worker.published)  # every valid batch, nothing else
    assert set(final_state(run_dir)["ledger"]) == set(worker.published)
    rejected = {}
    for m in metrics_lines(run_dir):
        for rule, n in m["gate_rejected"].items():
            rejected[rule] = rejected.get(rule, 0) + n
    assert rejected == {"short_row": 1, "non_finite": 1, "duplicate_candidate": 1, "stale": 1, "duplicate_batch": 2}


def test_batch_published_twice_is_trained_once(faulty_run):
    run_dir, worker, injected, _, _, _ = faulty_run
    again = [bid.removesuffix("/again") for bid, rule in injected.items() if rule == "duplicate_batch"]
    assert again
    trained = [bid for m in metrics_lines(run_dir) for bid in m["batch_ids"]]
    for bid in again:
        assert trained.count(bid) == 1
        assert final_state(run_dir)["ledger"][bid]["step"] == int(bid.split("/")[1])  # in its own step, not again later


def test_sigkill_mid_step_resumes_with_ledger_intact(stack, sglang):
    (tmp, nats, model), engine = stack, sglang
    release = threading.Event()
    # Step 2 gets its first group only, so the trainer is killed holding one unacked batch.
    blocked = lambda task: task.task_id.endswith("/2/1") and not release.is_set()  # noqa: E731
    run_dir = tmp / "run-killed"
    dataset = write_dataset(tmp / "tasks-killed.jsonl")
    flags = ("--steps", str(STEPS), "--strategy", "fsdp2", *FLAGS)  # resume must restore sharded optimizer state
    port = free_port()

    def holding_step_2_batch():
        return len(metrics_lines(run_dir)) == 2 and asyncio.run(consumer_info(nats.url)).num_ack_pending == 1

    with StandInWorker(nats.url, engine.url, VOCAB_SIZE, blocked=blocked) as worker:
        trainer = Trainer(run_dir, model, dataset, nats.url, engine.url, *flags, "--metrics-port", str(port))
        wait_until(holding_step_2_batch, 180, "step 2 holding its first batch", trainer.proc)
        status, scraped = http("GET", f"http://127.0.0.1:{port}/metrics")
        trainer.kill()
        release.set()
        again = Trainer(run_dir, model, dataset, nats.url, engine.url, *flags)
        code = again.wait(240)
    assert code == 0, again.log()
    assert status == 200
    assert "centerline_trainer_step 2.0" in scraped and "centerline_trainer_gate_accepted_total 4.0" in scraped
    assert worker.error is None, worker.error
    assert [m["step"] for m in metrics_lines(run_dir)] == list(range(1, STEPS + 1))  # the counter continued at 3
    state = final_state(run_dir)
    assert state["step"] == STEPS and state["version"] == STEPS
    # No batch skipped, none trained twice: the ledger holds each published batch once, and
    # every step trained exactly its two groups (step 2 the redelivered one among them).
    assert set(state["ledger"]) == set(worker.published)
    assert sorted(entry["step"] for entry in state["ledger"].values()) == [s for s in range(STEPS) for _ in range(2)]
    assert engine.weight_version() == str(STEPS)
    info = asyncio.run(consumer_info(nats.url))
    assert (info.num_ack_pending, info.num_pending) == (0, 0)


def test_sigterm_while_gathering_exits_0_without_acking_the_held_batch(stack, sglang):
    """Plain process (no torchrun): world size 1."""
    (tmp, _, model), engine = stack, sglang
    with EmbeddedNats(tmp / "nats-sigterm") as nats:  # its own stream: the nak'ed batch stays behind
        release = threading.Event()
        blocked = lambda task: task.task_id.endswith("/1/1") and not release.is_set()  # noqa: E731
        run_dir = tmp / "run-sigterm"

        def holding_step_1_batch():
            return len(metrics_lines(run_dir)) == 1 and asyncio.run(consumer_info(nats.url)).num_ack_pending == 1

        with StandInWorker(nats.url, engine.url, VOCAB_SIZE, blocked=blocked) as worker:
            trainer = Trainer(
                run_dir,
                model,
                write_dataset(tmp / "tasks-sigterm.jsonl"),
                nats.url,
                engine.url,
                "--steps",
                str(STEPS),
                *FLAGS,
                nproc=1,
            )
            wait_until(holding_step_1_batch, 180, "step 1 holding its first batch", trainer.proc)
            trainer.proc.send_signal(signal.SIGTERM)
            code = trainer.wait(60)
            release.set()
        info = asyncio.run(consumer_info(nats.url))
    assert code == 0, trainer.log()
    held_seq = 3  # stream order: batches (0,0), (0,1), then (1,0)
    assert info.ack_floor.stream_seq == held_seq - 1  # (1, 0) was not acked
    state = orjson.loads((run_dir / "checkpoints" / "step-000001" / "state.json").read_bytes())
    assert sorted(state["ledger"]) == sorted(bid for bid in worker.published if "/0/" in bid)
    assert not (run_dir / "checkpoints" / "step-000002").exists()


def test_sigterm_while_training_commits_the_step_and_leaves_the_engines_alone(stack, sglang):
    """A stop lands while step 2 trains (a failpoint holds it there 8 s): the step is committed,
    and its weights are not sent to the engines, which are being stopped with the trainer in a
    real shutdown; the next start sends them first thing."""
    (tmp, _, model), engine = stack, sglang
    with EmbeddedNats(tmp / "nats-sigterm-training") as nats:
        run_dir = tmp / "run-sigterm-training"
        with StandInWorker(nats.url, engine.url, VOCAB_SIZE):
            trainer = Trainer(
                run_dir,
                model,
                write_dataset(tmp / "tasks-sigterm-training.jsonl"),
                nats.url,
                engine.url,
                "--steps",
                str(STEPS),
                *FLAGS,
                nproc=1,
                failpoints="trainer.train@2=sleep:8",
            )
            wait_until(
                lambda: "failpoint trainer.train at step 2" in trainer.log(), 180, "step 2 training", trainer.proc
            )
            trainer.proc.send_signal(signal.SIGTERM)
            code = trainer.wait(60)
    assert code == 0, trainer.log()
    assert [r["step"] for r in metrics_lines(run_dir)] == [1, 2]  # step 2 finished and committed
    assert (run_dir / "checkpoints" / "step-000002").exists()
    assert engine.weight_version() == "1"  # version 2 was not sent


def test_weight_sync_interval_publishes_every_second_step(stack, sglang):
    (tmp, nats, model), engine = stack, sglang
    run_dir = tmp / "run-interval"
    with StandInWorker(nats.url, engine.url, VOCAB_SIZE):
        trainer = Trainer(
            run_dir,
            model,
            write_dataset(tmp / "tasks-interval.jsonl"),
            nats.url,
            engine.url,
            "--steps",
            str(STEPS),
            "--weight-sync-interval",
            "2",
            *FLAGS,
            nproc=1,
        )
        code = trainer.wait(240)
    assert code == 0, trainer.log()
    assert [m["version"] for m in metrics_lines(run_dir)] == [0, 1, 1, 2]
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v000001", "v000002"]
    assert engine.weight_version() == "2"
    assert final_state(run_dir)["version"] == 2
