"""Multi-turn sessions on SmolLM2-135M-Instruct: its BPE tokenizer and ChatML template (with the
system prompt it injects), K = 128 over its 49152-token vocabulary, through a proxy, smg 0.3.2
and real SGLang; the same checks as the toy model's (tests/rollout_worker/test_session_stack.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import orjson
import pytest

from shared import names
from shared.contract import check_batch
from shared.nats_server import EmbeddedNats
from shared.wire import decode_batch
from tests.processes import ENV, REPO, Process, free_port, http, stored_messages, wait_until
from tests.real_model.conftest import IM_END, VOCAB
from tests.rollout_worker import session_environments
from tests.rollout_worker.test_session_stack import K, check_three_turns, run_task

pytestmark = [pytest.mark.real_model, pytest.mark.integration]


@pytest.fixture(scope="module")
def proxy_url(real_router, tmp_path_factory):
    """A ready `centerline proxy` at K = 128 in front of the router (native /generate)."""
    port = free_port()
    argv = [sys.executable, "-m", "centerline", "proxy", "--upstream", real_router.url, "--port", str(port)]
    proc = Process([*argv, "--rollout-top-logprobs-num", str(K)], tmp_path_factory.mktemp("proxy") / "proxy.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http("GET", url + "/ready", timeout=5)[0] == 200, 180, "proxy", proc.proc)
        yield url
    finally:
        proc.stop()


def test_a_three_turn_session_on_the_real_model_trains_exactly_the_ids_sglang_returned(
    proxy_url, real_model, monkeypatch
):
    session_environments.RECORDED.clear()
    env = "tests.rollout_worker.session_environments:three_turns"
    outcome, turns, hf = run_task(proxy_url, real_model, env, monkeypatch, vocab=VOCAB)
    check_three_turns(outcome, turns, hf, vocab=VOCAB, im_end=IM_END)
    (batch,) = outcome.batches
    assert batch.cand_ids.max() > 32768  # rows reach deep into the real vocabulary


ENVIRONMENT = "tests.real_model.environments:capital_twice"
ROWS = [
    {"prompt": "What is the capital of Germany?", "answer": "Berlin", "environment": ENVIRONMENT},
    {"prompt": "What is the capital of Italy?", "answer": "Rome", "environment": ENVIRONMENT},
    {"prompt": "What is the capital of France?", "answer": "Paris", "split": "eval"},
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_trains_the_real_model_on_two_turn_sessions_of_the_rows_environment(real_model, tmp_path):
    """`centerline up --dataset` with rows naming an environment: every sample a two-turn session,
    every batch the group's sessions, trained by the trainer like any other."""
    dataset = tmp_path / "capitals.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "centerline", "up", "--model", str(real_model), "--dataset", str(dataset)]
    argv += ["--reward", "tests.real_model.rewards:contains_answer", "--steps", "2", "--run-dir", str(run_dir)]
    argv += ["--workers", "1", "--engines", "1", "--trainer-ranks", "1", "--prompts-per-step", "2"]
    argv += ["--rollout-n", "4", "--rollout-max-new-tokens", "8", "--rollout-temperature", "0.7"]
    run = subprocess.run([*argv, "--learning-rate", "1e-5"], cwd=REPO, env=ENV, capture_output=True, timeout=480)
    assert run.returncode == 0, run.stderr[-4000:]
    steps = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["gate_accepted"] == 2 and s["gate_rejected"] == {} and s["samples"] == 8 for s in steps)
    assert any(s["grad_norm"] > 0 for s in steps)
    nats = EmbeddedNats(run_dir / "nats").start()
    try:
        batches = [decode_batch(m.data) for m in asyncio.run(stored_messages(nats.url, names.ROLLOUTS_STREAM))]
    finally:
        nats.stop()
    assert batches and all(b.num_samples == 4 for b in batches)
    for batch in batches:
        check_batch(batch, vocab_size=VOCAB)
        for i in range(batch.num_samples):
            mask = batch.loss_mask[batch.sample_slice(i)]
            turns = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)  # where a sampled run starts
            assert len(turns) == 2 and mask.sum() <= 2 * 8  # two turns of at most 8 tokens, the template between
    trained = {s["step"]: s["trained_tokens"] for s in steps}
    assert all(0 < t <= 2 * 4 * 2 * 8 for t in trained.values())
