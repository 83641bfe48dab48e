"""`centerline up --environment mymod:fn` end to end with an environment of a user's own, written
into the directory `up` runs in: every task runs as two-turn sessions, the held-out figure plays
the environment too, and the recorded stream holds one sample per session (prompt = the first
turn's prompt, response = the rest, loss mask 1 exactly on the replies, per-token versions),
read back with `centerline record` and `centerline replay --jsonl`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from transformers import AutoTokenizer

from centerline.nats_server import EmbeddedNats
from centerline.runs.record import read_record
from shared.contract import check_batch
from shared.wire import decode_batch
from tests.processes import ENV

ENVIRONMENT = '''
import json
import os

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conversations.jsonl")


async def two_turns(client, task):
    """Two turns with a user message between them; each session's conversation logged."""
    messages = [{"role": "user", "content": task.prompt}]
    for then in ("again", None):
        reply = await client.chat.completions.create(model="default", messages=messages, max_tokens=4)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if then is not None:
            messages.append({"role": "user", "content": then})
    with open(LOG, "a") as fh:
        fh.write(json.dumps({"task_id": task.task_id, "messages": messages}) + "\\n")
    return float(len(messages[-1]["content"]) % 2)
'''
STEPS, PROMPTS, N = 2, 2, 2


def centerline(cwd: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "centerline", *argv]
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.integration
@pytest.mark.slow
def test_up_trains_an_environment_of_ones_own_and_its_stream_reads_back_as_sessions(tmp_path, toy_models):
    (tmp_path / "mymod.py").write_text(ENVIRONMENT)
    run_dir = tmp_path / "run"
    up = centerline(
        tmp_path,  # the environment is imported from the directory up runs in
        "up",
        "--environment",
        "mymod:two_turns",
        "--task",
        "copy",
        "--steps",
        str(STEPS),
        "--workers",
        "1",
        "--trainer-ranks",
        "1",
        "--prompts-per-step",
        str(PROMPTS),
        "--rollout-n",
        str(N),
        "--heldout-prompts",
        "3",
        "--heldout-every",
        str(STEPS),
        "--model-dir",
        str(toy_models),
        "--run-dir",
        str(run_dir),
        timeout=600,
    )
    assert up.returncode == 0, up.stderr[-4000:]

    steps = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["turns_mean"] == 2.0 and s["injected_tokens"] > 0 and s["gate_rejected"] == {}
        assert sum(s["finish"].values()) == s["samples"] == PROMPTS * N
    evals = [orjson.loads(line) for line in (run_dir / "heldout_metrics.jsonl").read_bytes().splitlines()]
    assert [e["step"] for e in evals] == [0, STEPS] and all("heldout_reward" in e for e in evals)
    conversations = [orjson.loads(line) for line in (tmp_path / "conversations.jsonl").read_bytes().splitlines()]
    held_out = [c for c in conversations if "/heldout/" in c["task_id"]]  # the trainer's held-out tasks
    assert len(held_out) == 3 * 2  # every held-out row played by the environment, at each evaluation

    nats = EmbeddedNats(run_dir / "nats").start()  # the run's JetStream store, served again
    try:
        seg = tmp_path / "seg.clrec"
        record = centerline(tmp_path, "record", "--stream", "ROLLOUTS", "--from-seq", "1", "--out", str(seg),
                            "--nats-url", nats.url)  # fmt: skip
        assert record.returncode == 0, record.stderr
        listed = centerline(tmp_path, "record", "--stream", "ROLLOUTS", "--jsonl", "--nats-url", nats.url)
        assert listed.returncode == 0, listed.stderr
    finally:
        nats.stop()
    replayed = centerline(tmp_path, "replay", str(seg), "--jsonl")
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout == listed.stdout  # the same summaries, from the stream and from the file
    summaries = [orjson.loads(line)["batch"] for line in replayed.stdout.splitlines()]
    # the held-out sessions' batches (one session each) travel the stream beside the training groups
    assert sorted(b["task_id"].split("/", 1)[1] for b in summaries if "/heldout/" in b["task_id"]) == [
        f"heldout/{step}/{row}" for step in (0, STEPS) for row in range(3)
    ]
    assert all(b["samples"] == 1 for b in summaries if "/heldout/" in b["task_id"])
    summaries = [b for b in summaries if "/heldout/" not in b["task_id"]]
    assert len(summaries) >= STEPS * PROMPTS
    for b in summaries:
        assert b["samples"] == N and b["turns"] == [2] * N and len(b["finish_reasons"]) == N
        assert b["sampled_tokens"] + b["injected_tokens"] == b["tokens"] and b["injected_tokens"] > 0

    template = AutoTokenizer.from_pretrained(str(toy_models / "sft-copy-seed0"))

    def render(messages) -> str:
        return template.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def text(ids) -> str:
        return template.decode(list(ids), skip_special_tokens=False)

    _, messages = read_record(seg)
    for message in messages:
        batch = decode_batch(message.data)
        check_batch(batch, vocab_size=len(template))  # complete rows on the replies, empty ones between
        mine = [c["messages"] for c in conversations if c["task_id"] == batch.task_id]
        for i in range(batch.num_samples):
            part = batch.sample_slice(i)
            prompt = text(batch.prompt_ids[batch.prompt_offsets[i] : batch.prompt_offsets[i + 1]])
            response, mask = batch.response_ids[part], batch.loss_mask[part].astype(bool)
            whole = prompt + text(response)
            # the conversation this sample is: the template's rendering of it, the last reply as sampled
            conversation = next(
                c
                for c in mine
                if whole.startswith(render(c[:-1]))
                and whole.removeprefix(render(c[:-1])) in (c[-1]["content"], c[-1]["content"] + "<|im_end|>")
            )
            assert prompt == render(conversation[:1])  # the first turn's prompt
            # loss mask 1 exactly on the two replies: two runs, the template and "again" between
            runs = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
            assert len(runs) == 4 and runs[0] == 0
            first, second = text(response[runs[0] : runs[1]]), text(response[runs[2] : runs[3]])
            assert first.removesuffix("<|im_end|>") == conversation[1]["content"]
            assert second.removesuffix("<|im_end|>") == conversation[3]["content"]
            assert "<|im_start|>user\nagain" in text(response[runs[1] : runs[2]])
            versions = batch.token_versions[part]
            assert (versions[~mask] == 0).all() and (versions[mask] <= batch.weight_version).all()
            assert (batch.cand_ids[part][~mask] == -1).all() and (batch.cand_ids[part][mask] >= 0).all()
