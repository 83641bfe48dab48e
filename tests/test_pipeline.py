"""The pipeline end to end with every real part: embedded NATS, a real SGLang server behind
the SGLang router, the proxy, two rollout workers and a 2-rank trainer under torchrun (the
session's `centerline up` run).

After the run the JetStream store is opened again to check what the services left behind:
every trained batch passes the contract, the server's weight version advanced (later
batches were sampled by later weights), and nothing is pending or unacknowledged.
"""

import asyncio

import orjson
import pytest

from centerline.nats_server import EmbeddedNats
from shared import names
from shared.contract import check_batch
from shared.nats_client import connect
from shared.wire import decode_batch


async def stream_state(url: str) -> dict:
    nc = await connect(url)
    js = nc.jetstream()
    try:
        rollouts = await js.stream_info(names.ROLLOUTS_STREAM)
        batches = [
            decode_batch((await js.get_msg(names.ROLLOUTS_STREAM, seq)).data)
            for seq in range(rollouts.state.first_seq, rollouts.state.last_seq + 1)
        ]
        return {
            "batches": batches,
            "dlq": (await js.stream_info(names.DLQ_STREAM)).state.messages,
            "prompts_left": (await js.stream_info(names.PROMPTS_STREAM)).state.messages,
            "trainer": await js.consumer_info(names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER),
            "workers": await js.consumer_info(names.PROMPTS_STREAM, names.WORKERS_CONSUMER),
            "weights": orjson.loads((await js.get_last_msg(names.WEIGHTS_STREAM, names.WEIGHTS_SUBJECT)).data),
        }
    finally:
        await nc.close()


@pytest.mark.integration
@pytest.mark.slow
def test_two_workers_and_two_trainer_ranks_train_on_verified_batches_only(up_run):
    run_dir, steps_run = up_run.run_dir, up_run.steps
    per_step = up_run.prompts_per_step * up_run.rollout_n
    steps = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, steps_run + 1))
    assert [s["version"] for s in steps] == list(range(1, steps_run + 1))
    assert all(s["samples"] == per_step and s["gate_rejected"] == {} for s in steps)
    done = [
        line
        for i in range(2)
        for line in (run_dir / "logs" / f"worker-{i}.log").read_text().splitlines()
        if '"msg": "task done"' in line
    ]
    # one log line per finished task, each task once: the training tasks, and the held-out rows'
    # (8 rows at steps 0, 2 and 3; docs/design.md section 9)
    assert sum('"purpose": "train"' in line for line in done) == steps_run * up_run.prompts_per_step
    assert sum('"purpose": "heldout"' in line for line in done) == 8 * 3

    nats = EmbeddedNats(run_dir / "nats").start()
    try:
        state = asyncio.run(stream_state(nats.url))
    finally:
        nats.stop()
    trained = {bid for s in steps for bid in s["batch_ids"]}
    by_id = {b.batch_id: b for b in state["batches"]}
    assert trained <= set(by_id)
    vocab = orjson.loads((up_run.model_dir / "config.json").read_bytes())["vocab_size"]
    for batch_id in trained:
        check_batch(by_id[batch_id], vocab_size=vocab)  # raises ContractViolation if anything got through
    # SGLang served each new version: step s trained batches sampled by weights s-1 at the latest.
    versions = {s["step"]: {by_id[b].weight_version for b in s["batch_ids"]} for s in steps}
    assert max(versions[steps_run]) >= 1 and all(max(v) <= step - 1 for step, v in versions.items())
    assert state["weights"]["version"] == steps_run
    assert state["dlq"] == 0
    assert (state["trainer"].num_ack_pending, state["trainer"].num_pending) == (0, 0)
    assert (state["workers"].num_ack_pending, state["prompts_left"]) == (0, 0)
