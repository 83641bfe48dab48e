"""`centerline up --model M --dataset D --reward module:function`: a user's own run on a real Hugging
Face model, every service a real process (NATS, SGLang, the router, the proxy, a worker, the trainer).
One run holds both kinds of row: a plain prompt, and a row naming an environment, whose samples are
two-turn sessions (one `up` of the real model costs over a minute here, so they share it)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys

import numpy as np
import orjson
import pytest

from centerline.nats_server import EmbeddedNats
from shared import names
from shared.contract import check_batch
from shared.wire import decode_batch
from tests.processes import ENV, REPO, stored_messages
from tests.real_model.conftest import VOCAB

pytestmark = [pytest.mark.real_model, pytest.mark.integration, pytest.mark.slow]

# At temperature 0.7 the model names Berlin or Rome in about half its answers of 8 tokens, so a
# group of 4 samples has unequal rewards with probability about 0.9: the 6 groups of a run all
# equal (no gradient at all) about once in 10^5 runs. Italy's row is a two-turn session
# (tests/real_model/environments.py).
ENVIRONMENT = "tests.real_model.environments:capital_twice"
ROWS = [
    {"prompt": "What is the capital of Germany?", "answer": "Berlin"},
    {
        "prompt": "What is the capital of Italy?",
        "answer": "Rome",
        "meta": {"continent": "Europe"},
        "environment": ENVIRONMENT,
    },
    {"prompt": "What is the capital of France?", "answer": "Paris", "split": "heldout"},
]
REWARD = "tests.real_model.rewards:contains_answer"


@pytest.mark.timeout(600)
def test_up_trains_a_real_model_on_a_users_dataset_and_reward(real_model, tmp_path):
    dataset = tmp_path / "capitals.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "centerline", "up", "--model", str(real_model), "--dataset", str(dataset)]
    argv += ["--reward", REWARD, "--steps", "3", "--run-dir", str(run_dir)]
    # one of each service, 2 prompts x 4 samples of 8 tokens a step: about 80 s on 2 cores
    argv += ["--workers", "1", "--engines", "1", "--trainer-ranks", "1", "--prompts-per-step", "2"]
    argv += [
        "--rollout-n",
        "4",
        "--rollout-max-new-tokens",
        "8",
        "--rollout-temperature",
        "0.7",
        "--learning-rate",
        "1e-5",
    ]
    proc = subprocess.Popen(argv, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # up stops every service it started
        _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 0, stderr[-4000:]

    steps = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["gate_accepted"] == 2 and s["gate_rejected"] == {} and s["samples"] == 8 for s in steps)
    assert [s["version"] for s in steps] == [1, 2, 3]
    assert any(s["grad_norm"] > 0 for s in steps)  # the real model was trained, not only sampled
    evals = [orjson.loads(line) for line in (run_dir / "heldout_metrics.jsonl").read_bytes().splitlines()]
    assert [e["step"] for e in evals] == [0, 3] and all(e["heldout_rows"] == 1 for e in evals)
    assert all(e["heldout_reward"] in (0.0, 1.0) for e in evals)  # one held-out row, a 0/1 reward
    heldout = [orjson.loads(line) for line in (run_dir / "heldout.jsonl").read_bytes().splitlines()]
    assert heldout == [{"prompt": "What is the capital of France?", "answer": "Paris", "reward": REWARD}]

    trained = [orjson.loads(line) for line in (run_dir / "train.jsonl").read_bytes().splitlines()]
    assert trained == [
        {"prompt": "What is the capital of Germany?", "answer": "Berlin", "reward": REWARD},
        {
            "prompt": "What is the capital of Italy?",
            "answer": "Rome",
            "reward": REWARD,
            "environment": ENVIRONMENT,
            "continent": "Europe",
        },
    ]
    config = (run_dir / "config.toml").read_text()
    assert "\n[worker]\n" in config and "chat_template = true" in config  # auto: the model has a template
    assert f'model = "{real_model}"' in config
    page = (run_dir / "report.html").read_text()
    assert "batches accepted / rejected</td><td>6 / 0" in page
    source = f'the rows of {dataset} marked "split": "heldout" (or "eval")'
    assert f"held-out rows</td><td>1: {source} (reward {REWARD})".replace('"', "&quot;") in page
    assert (run_dir / "plots" / "heldout_reward.png").exists()

    # what was sampled: every batch one group of 4, Germany's one turn each, Italy's two turns
    # (a sampled run, the template's tokens of the user's next message, a sampled run)
    nats = EmbeddedNats(run_dir / "nats").start()
    try:
        batches = [decode_batch(m.data) for m in asyncio.run(stored_messages(nats.url, names.ROLLOUTS_STREAM))]
    finally:
        nats.stop()
    shapes = []
    for batch in batches:
        check_batch(batch, vocab_size=VOCAB)
        if "/heldout/" in batch.task_id:  # France's row, sampled once at steps 0 and 3, never trained
            assert batch.num_samples == 1
            continue
        assert batch.num_samples == 4
        runs = set()
        for i in range(batch.num_samples):
            mask = batch.loss_mask[batch.sample_slice(i)]
            starts = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)  # where a sampled run starts
            runs.add(len(starts))
            assert 0 < mask.sum() <= len(starts) * 8  # turns of at most 8 tokens
        assert len(runs) == 1, runs  # a group is all sessions or all single turns
        shapes.append(runs.pop())
    assert shapes.count(1) >= 3 and shapes.count(2) >= 3 and len(shapes) == shapes.count(1) + shapes.count(2)
    # 540 MB of weights per version and per checkpoint: not kept among the test session's files
    shutil.rmtree(run_dir / "checkpoints")
    shutil.rmtree(run_dir / "weights")
