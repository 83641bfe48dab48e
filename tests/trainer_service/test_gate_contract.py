"""A batch that would crash the trainer's forward, at the gate: a real nats-server, the real gate,
a real training step on the tiny model of tests/trainer_service/conftest.py, and `centerline
replay --train` over a recorded segment that holds such a batch.

Each poison passes every rule but the one named (docs/design.md section 5): the gate dead-letters
it by that rule, once, and the good batch published after it is trained.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import orjson
import pytest

from centerline.nats_server import EmbeddedNats
from centerline.synth import make_batch
from shared import names
from shared.config import Config
from shared.nats_client import connect, pull_consumer
from shared.settings import TrainerSettings
from shared.wire import Batch, encode_batch
from tests.processes import stored_messages
from tests.trainer_service.conftest import VOCAB
from tests.trainer_service.replayed import publish, replay_recorded
from trainer_service.commit import TrainerState, commit_step
from trainer_service.gate import Gate
from trainer_service.policy import Policy

pytestmark = pytest.mark.integration

K, SAMPLES, TOKENS, PROMPT = 8, 4, 5, 4
CFG = Config(rollout_top_logprobs_num=K, rollout_n=SAMPLES)
PER_TOKEN = ("response_ids", "sampled_logprobs", "loss_mask", "token_versions", "cand_ids", "cand_logprobs")


def valid(batch_id: str, seed: int = 0) -> Batch:
    return make_batch(
        samples=SAMPLES,
        tokens_per_sample=TOKENS,
        k=K,
        vocab_size=VOCAB,
        batch_id=batch_id,
        seed=seed,
        prompt_len=PROMPT,
    )


def poison(kind: str) -> Batch:
    """A valid batch but for one defect the forward cannot take (docs/design.md section 5)."""
    batch = valid("poison", seed=1)
    if kind in ("prompt id = vocab", "prompt id = -1"):  # the embedding raises IndexError
        ids = np.array(batch.prompt_ids)
        ids[PROMPT + 2] = VOCAB if kind == "prompt id = vocab" else -1
        return replace(batch, prompt_ids=ids)
    if kind == "empty prompt":  # step.micro_batch_inputs raises ValueError
        offsets = np.array(batch.prompt_offsets)
        offsets[2:] -= PROMPT  # sample 1's prompt tokens removed
        return replace(batch, prompt_offsets=offsets, prompt_ids=np.delete(batch.prompt_ids, range(PROMPT, 2 * PROMPT)))
    # "no response tokens": a micro-batch without one has no logits (RuntimeError in the loss)
    empty = {name: np.array(getattr(batch, name)[:0]) for name in PER_TOKEN}
    return replace(batch, offsets=np.zeros(SAMPLES + 1, np.int64), **empty)


POISONS = [
    ("prompt id = vocab", "bad_prompt_token"),
    ("prompt id = -1", "bad_prompt_token"),
    ("empty prompt", "empty_prompt"),
    ("no response tokens", "empty_response"),
]


@pytest.mark.parametrize(("kind", "rule"), POISONS)
def test_a_batch_the_forward_cannot_take_is_dead_lettered_by_rule_and_the_next_good_batch_trains(
    tmp_path, tiny_model_dir, kind, rule
):
    bad, good = poison(kind), valid("good")

    async def gate_then_step(url: str):
        await publish(url, bad, good)
        nc = await connect(url)
        js = nc.jetstream()
        consumer = await pull_consumer(
            js, names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER, filter_subject=names.ROLLOUTS_SUBJECT
        )
        gate = Gate(js, consumer, vocab_size=VOCAB, cfg=CFG, ledger={})
        held = await gate.gather(SAMPLES, 0, timeout=30, stopping=asyncio.Event())
        policy = Policy(TrainerSettings(model=tiny_model_dir, run_dir=tmp_path / "run"), CFG, None)
        step = await asyncio.to_thread(
            commit_step, policy, TrainerState(run_id="r"), held, weight_sync_interval=1, next_task_step=0
        )
        await gate.commit(0)
        info = await js.consumer_info(names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
        await nc.close()
        return held, step, gate.take_counts(), info

    with EmbeddedNats(tmp_path / "nats") as server:
        held, step, counts, info = asyncio.run(gate_then_step(server.url))
        letters = asyncio.run(stored_messages(server.url, names.DLQ_STREAM))
    assert [h.batch.batch_id for h in held] == ["good"]
    [letter] = letters
    assert (letter.headers["rule"], letter.headers["batch_id"], letter.data) == (rule, "poison", encode_batch(bad))
    assert letter.headers["reason"].startswith("sample ") and f"({rule})" in letter.headers["reason"]
    assert counts == {f"rejected:{rule}": 1, "accepted": 1}
    # The good batch trained; nothing is left to come back (the poison was acked after its dead letter).
    assert (step.after.step, list(step.after.ledger), step.metrics["trained_tokens"]) == (1, ["good"], 20)
    assert (info.num_ack_pending, info.num_pending, info.num_redelivered) == (0, 0, 0)


def test_replaying_a_recorded_poison_rejects_it_by_rule_and_trains_the_good_batch_after_it(tmp_path, tiny_model_dir):
    bad, good = poison("prompt id = vocab"), valid("good")
    replay, _ = replay_recorded(tmp_path, tiny_model_dir, [bad, good], k=K, learning_rate=CFG.training.learning_rate)
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert "batch poison (seq 1) rejected (bad_prompt_token): sample 1 ('poison:s1') prompt position 2" in replay.stderr
    [line] = [orjson.loads(s) for s in (tmp_path / "replayed" / "metrics.jsonl").read_bytes().splitlines()]
    assert (line["step"], line["batch_ids"], line["trained_tokens"]) == (1, ["good"], 20)
    assert (line["gate_accepted"], line["gate_rejected"]) == (1, {"bad_prompt_token": 1})
