"""Batches published to a real nats-server, recorded with `centerline record` and trained offline by
`centerline replay --train` from the tiny model's first checkpoint: how the poison tests show that a
recorded batch cannot crash-loop the trainer."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import torch

from centerline.nats_server import EmbeddedNats
from shared import names
from shared.nats_client import connect, publish_acked
from shared.streams import ensure_streams
from shared.wire import Batch, encode_batch
from tests.processes import ENV, REPO
from trainer_service import checkpoint
from trainer_service.commit import TrainerState
from trainer_service.model import load_model
from trainer_service.step import make_optimizer


async def publish(url: str, *batches: Batch) -> None:
    """Each batch on ``rollouts.batches``, its batch id as ``Nats-Msg-Id``, in order."""
    nc = await connect(url)
    js = nc.jetstream()
    await ensure_streams(js)
    for b in batches:
        headers = {names.MSG_ID_HEADER: b.batch_id}
        await publish_acked(js, names.ROLLOUTS_SUBJECT, encode_batch(b), headers, what=b.batch_id)
    await nc.close()


def replay_recorded(
    tmp_path: Path, model_dir: Path, batches: list[Batch], *, k: int, learning_rate: float
) -> tuple[subprocess.CompletedProcess, Path]:
    """``batches`` recorded from a real stream, then ``replay --train`` one batch a step from the
    model's state before its first step; the replay's process and that start checkpoint. Its run
    directory is ``tmp_path / "replayed"``."""
    with EmbeddedNats(tmp_path / "nats") as server:
        asyncio.run(publish(server.url, *batches))
        record = subprocess.run(
            [sys.executable, "-m", "centerline", "record", "--stream", "ROLLOUTS", "--from-seq", "1"]
            + ["--out", str(tmp_path / "seg.clrec"), "--nats-url", server.url],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert record.returncode == 0, record.stderr
    model = load_model(model_dir)
    torch.manual_seed(0)
    start = checkpoint.save(
        tmp_path / "run" / "checkpoints",
        model,
        make_optimizer(model, "adamw", learning_rate),
        TrainerState(run_id="r").to_dict(),
    )
    replay = subprocess.run(
        [sys.executable, "-m", "centerline", "replay", str(tmp_path / "seg.clrec"), "--train"]
        + ["--checkpoint", str(start), "--run-dir", str(tmp_path / "replayed"), "--batches-per-step", "1"]
        + ["--rollout-top-logprobs-num", str(k)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return replay, start
