"""``centerline worker`` refuses at start what it can know is wrong before it connects to anything."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.processes import ENV, REPO

pytestmark = pytest.mark.integration  # starts the worker process


def test_k_above_the_vocabulary_refuses_to_start(model_dir):
    cmd = [sys.executable, "-m", "centerline", "worker", "--tokenizer", str(model_dir), "--vocab-size", "260"]
    cmd += [
        "--rollout-top-logprobs-num",
        "300",
        "--proxy-url",
        "http://127.0.0.1:9",
        "--nats-url",
        "nats://127.0.0.1:9",
    ]
    out = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (
        2,
        "centerline worker: --rollout-top-logprobs-num: K=300 is above the model's vocabulary of 260: SGLang takes "
        "its server down on a top_logprobs_num above the vocabulary, so nothing is sent; lower K to at most 260",
    )
