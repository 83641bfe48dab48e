"""Checkpoints every N steps (docs/design.md section 10): a trainer that dies between two
checkpoints trains the steps since the last one again, from the batches they trained on, and
nothing twice; the ledger agrees with the checkpoint. One real Policy on the tiny model, the
trainer's own commit and restart code (trainer_service.service.retrain_journal)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import orjson
import pytest

from shared.config import Config
from shared.settings import TrainerSettings
from tests.trainer_service.conftest import global_batch
from trainer_service import checkpoint, journal
from trainer_service.commit import TrainerState, commit_step
from trainer_service.ledger import LEDGER_TASK_STEPS, HeldPart
from trainer_service.metrics import Metrics
from trainer_service.policy import Policy
from trainer_service.schedule import lr_factor
from trainer_service.service import retrain_journal

STEPS, EVERY = 5, 3
CFG = Config(rollout_top_logprobs_num=8, learning_rate=1e-3)


def parts(step: int) -> list[HeldPart]:
    """Step ``step``'s two task groups, each one part of attempt 1."""
    out = []
    for g in range(2):
        batch = global_batch(samples=2)
        task = f"t{step}-{g}"
        advantages = np.array([1.0 + step, -0.5 - g], np.float32)
        out.append(HeldPart(None, replace(batch, batch_id=task, task_id=task, advantages=advantages), 10 * step + g))
    return out


def settings(run_dir, model) -> TrainerSettings:
    return TrainerSettings(
        model=model,
        run_dir=run_dir,
        steps=STEPS,
        checkpoint_every=EVERY,
        tensorboard=False,
        lr_schedule="cosine",
        lr_warmup_steps=2,
    )


def commit(policy, s: TrainerSettings, state: TrainerState, step: int):
    return commit_step(
        policy,
        state,
        parts(step),
        weight_sync_interval=1,
        next_task_step=step + 1,
        checkpoint_every=s.checkpoint_every,
        last_step=s.steps,
        journal_dir=s.run_dir / "journal",
    )


def run(s: TrainerSettings, steps: range, state: TrainerState | None = None, resume=None) -> tuple[TrainerState, list]:
    policy = Policy(s, CFG, resume)
    state = state or TrainerState(run_id="r")
    done = []
    for n in steps:
        step = commit(policy, s, state, n)
        done.append(step)
        state = step.after
    return state, done


@pytest.mark.integration
def test_a_restart_between_checkpoints_trains_the_journalled_steps_again_and_nothing_twice(tmp_path, tiny_model_dir):
    whole = settings(tmp_path / "whole", tiny_model_dir)
    expected, steps = run(whole, range(STEPS))
    assert [p.name for p in checkpoint.complete(whole.run_dir / "checkpoints")] == ["step-000003", "step-000005"]
    assert list((whole.run_dir / "journal").iterdir()) == []  # the last checkpoint covers every record
    # the rate of each step: warmup over 2 steps, then cosine to 0 at step 5
    assert [s.metrics["lr"] for s in steps] == [
        1e-3 * lr_factor(n, warmup=2, schedule="cosine", total=STEPS, min_ratio=0.0) for n in range(STEPS)
    ]
    assert [s.metrics["lr"] for s in steps][:3] == [5e-4, 1e-3, 1e-3]

    # The same run dies after step 4 (steps 0-3 trained; checkpoint after 3, step index 3 journalled).
    crashed = settings(tmp_path / "crashed", tiny_model_dir)
    run(crashed, range(4))
    records = sorted(p.name for p in (crashed.run_dir / "journal").iterdir())
    assert records == ["step-000004.bin"]
    resume = checkpoint.latest(crashed.run_dir / "checkpoints")
    assert resume.name == "step-000003"
    saved = TrainerState.from_dict(checkpoint.load_state(resume))
    assert sorted(saved.ledger) == [f"t{n}-{g}" for n in range(3) for g in range(2)]

    policy = Policy(crashed, CFG, resume)
    metrics = Metrics(crashed)
    state, retrained = asyncio.run(retrain_journal(crashed, policy, saved, metrics, LEDGER_TASK_STEPS))
    assert retrained == 1 and state.step == 4 and state.next_task_step == 4
    assert state.ledger == {
        **saved.ledger,
        **{f"t3-{g}": {"attempt": 1, "step": 3, "parts": {f"t3-{g}": 30 + g}} for g in range(2)},
    }
    last = commit(policy, crashed, state, 4)
    metrics.close()

    # Every task once, at the step it trained at; weights, optimizer-driven state and ledger
    # as the uninterrupted run's, bit for bit (a step trained twice would move them).
    assert last.after == expected
    final = [run_dir / "checkpoints" / "step-000005" for run_dir in (whole.run_dir, crashed.run_dir)]
    a, b = ((p / "model" / "model.safetensors").read_bytes() for p in final)
    assert a == b
    assert (
        orjson.loads((final[0] / "state.json").read_bytes())["ledger"]
        == orjson.loads((final[1] / "state.json").read_bytes())["ledger"]
    )
    assert list((crashed.run_dir / "journal").iterdir()) == []
    lines = [orjson.loads(line) for line in (crashed.run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [(line["step"], line.get("retrained", False)) for line in lines] == [(4, True)]


def test_a_journal_with_a_gap_stops_at_the_first_step_it_lacks(tmp_path):
    root = tmp_path / "journal"
    for n in (3, 5):
        journal.write(root, n, n + 1, parts(n))
    [(step, cursor, held)] = journal.pending(root, 3)
    assert (step, cursor) == (3, 4) and [(h.batch.batch_id, h.seq) for h in held] == [("t3-0", 30), ("t3-1", 31)]
    assert journal.pending(root, 4) == []
    journal.prune(root, 4)  # a checkpoint after 4 steps covers step index 3
    assert sorted(p.name for p in root.iterdir()) == ["step-000006.bin"]


@pytest.mark.parametrize(
    "schedule, step, factor",
    [
        ("constant", 0, 1 / 4),
        ("constant", 3, 1.0),
        ("constant", 99, 1.0),
        ("cosine", 4, 1.0),  # the first step after the warmup
        ("cosine", 4 + 48, 0.1 + 0.9 * 0.5),  # halfway from 4 to 100: cos(pi/2) = 0
        ("cosine", 100, 0.1),
    ],
)
def test_the_learning_rate_warms_up_then_stays_or_follows_the_cosine(schedule, step, factor):
    assert lr_factor(step, warmup=4, schedule=schedule, total=100, min_ratio=0.1) == pytest.approx(factor, abs=1e-15)
