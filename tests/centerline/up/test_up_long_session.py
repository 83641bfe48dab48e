"""`centerline up` with an agent of a user's own whose tool result is long (issue 38): a file read of
21,000 bytes, 21k tokens of the toy model, makes each session a sample of more than 20 MiB at the
default K = 128. Run with the documented flags only (README, docs/extending.md: An environment), the
engines sized for the session budget by `up` (centerline/up/engine_context.py), each sample travels
in pieces and is trained once, whole: read back as a user would, from the run's stream
(`centerline record --jsonl`, pieces joined), its checkpoint's ledger and its metrics."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from centerline.nats_server import EmbeddedNats
from shared import names, pieces
from tests.processes import ENV, stored_messages

pytestmark = [pytest.mark.integration, pytest.mark.slow]

READER = '''
import json

READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a text file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
FILE = "".join(f"{i:06d} GET /index.html 200\\n" for i in range(1000))[:21_000]  # 21k bytes: 21k tokens


async def reader(client, task):
    """Asks, reads the file with its tool (the first call's result, or one of its own), answers."""
    messages = [{"role": "user", "content": task.prompt}]
    reply = await client.chat.completions.create(model="default", messages=messages, tools=[READ_FILE], max_tokens=4)
    message = reply.choices[0].message
    messages.append(message.model_dump())
    ids = [c.id for c in message.tool_calls or []] or ["read-0"]
    messages.append({"role": "tool", "tool_call_id": ids[0], "content": FILE})
    messages += [{"role": "tool", "tool_call_id": i, "content": "one file at a time"} for i in ids[1:]]
    answer = await client.chat.completions.create(model="default", messages=messages, tools=[READ_FILE], max_tokens=4)
    with open("sessions.jsonl", "a") as fh:
        fh.write(json.dumps({"task_id": task.task_id, "tool_result": len(FILE)}) + "\\n")
    return 1.0 if task.answer in (answer.choices[0].message.content or "") else 0.0
'''
TOOL_RESULT, N, K = 21_000, 1, 128  # one session: each of 21k tokens takes ~30 s of prefill here
BUDGET = 24576  # the session's tokens: a prompt, two replies and the file, well inside


def centerline(cwd: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "centerline", *argv]
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(900)  # about 5 minutes alone on 2 cores: the engine's start, the prefill, the step
def test_up_trains_a_user_agents_long_tool_result_over_20_mib_exactly_once(tmp_path, toy_models):
    (tmp_path / "mymod.py").write_text(READER)
    (tmp_path / "rows.jsonl").write_text(
        '{"prompt": "How many requests in access.log returned 200?", "answer": "1000"}\n'
    )
    run_dir = tmp_path / "run"
    up = centerline(
        tmp_path,  # the environment is imported from the directory up runs in
        "up",
        "--dataset",
        "rows.jsonl",  # one training row, no held-out row: no evaluation sessions
        "--environment",
        "mymod:reader",
        "--rollout-session-max-tokens",
        str(BUDGET),
        "--rollout-max-new-tokens",
        "4",
        "--rollout-n",
        str(N),
        "--steps",
        "1",
        "--prompts-per-step",
        "1",
        "--max-inflight-steps",
        "1",  # no step's tasks sampled ahead: the run samples exactly the one group it trains
        "--workers",
        "1",
        "--trainer-ranks",
        "1",
        "--model-dir",
        str(toy_models),
        "--run-dir",
        str(run_dir),
        timeout=900,
    )
    assert up.returncode == 0, up.stderr[-4000:]
    sessions = [orjson.loads(line) for line in (tmp_path / "sessions.jsonl").read_bytes().splitlines()]
    assert len(sessions) == N and {s["tool_result"] for s in sessions} == {TOOL_RESULT}

    (step,) = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert step["step"] == 1 and step["samples"] == N and step["turns_mean"] == 2.0
    assert step["gate_accepted"] == 1 and step["gate_rejected"] == {}
    assert step["injected_tokens"] > N * TOOL_RESULT  # the file, untrained, in every session
    assert 0 < step["sampled_tokens"] <= N * 2 * 4  # two replies of at most 4 tokens each, trained

    nats = EmbeddedNats(run_dir / "nats").start()  # the run's JetStream store, served again
    try:
        listed = centerline(tmp_path, "record", "--stream", "ROLLOUTS", "--jsonl", "--nats-url", nats.url)
        stored = asyncio.run(stored_messages(nats.url, names.ROLLOUTS_STREAM))
        dead = asyncio.run(stored_messages(nats.url, names.DLQ_STREAM))
    finally:
        nats.stop()
    assert listed.returncode == 0, listed.stderr
    assert dead == []  # nothing dead-lettered
    (whole,) = [orjson.loads(line) for line in listed.stdout.splitlines()]  # one batch, its pieces joined
    batch = whole["batch"]
    assert whole["bytes"] > N * (20 << 20) and batch["k"] == K and batch["samples"] == N
    assert batch["turns"] == [2] * N and batch["injected_tokens"] > N * TOOL_RESULT
    assert batch["sampled_tokens"] + batch["injected_tokens"] == batch["tokens"] > N * TOOL_RESULT
    assert batch["sampled_tokens"] == step["sampled_tokens"]
    # carried in pieces of at most max_payload bytes, each stored once
    assert len(stored) == pieces.pieces_per_part(whole["bytes"], max(len(m.data) for m in stored)) > 1
    assert [m.headers[pieces.PIECE_HEADER] for m in stored] == [f"{i}/{len(stored)}" for i in range(len(stored))]
    assert {m.headers[pieces.OF_HEADER] for m in stored} == {batch["batch_id"]}

    # the checkpoint's ledger: the task trained once, under one attempt, with this one part
    checkpoint = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    ledger = orjson.loads((checkpoint / "state.json").read_bytes())["ledger"]
    assert list(ledger) == [batch["task_id"]]
    assert ledger[batch["task_id"]]["attempt"] == batch["attempt"] == 1
    assert list(ledger[batch["task_id"]]["parts"]) == [batch["batch_id"]]
