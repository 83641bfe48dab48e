"""trainer_service.commit without a model: what a step hands the policy and what it records."""

from __future__ import annotations

from pathlib import Path

import pytest

from centerline.synth import make_batch
from shared.wire import decode_batch
from trainer_service.commit import LedgerFormatError, TrainerState, commit_step, step_record
from trainer_service.ledger import HeldPart


class FakePolicy:
    """Records each command and checkpoint state; returns fixed metrics."""

    def __init__(self):
        self.calls = []

    def run(self, cmd, state):
        self.calls.append((cmd, state))
        return {"loss": 0.5, "train_s": 1.0, "save_s": 2.0}, Path("w") if cmd.sync else None


def held(batch_id: str, seq: int, version: int) -> HeldPart:
    batch = make_batch(samples=2, tokens_per_sample=3, k=4, vocab_size=32, batch_id=batch_id, weight_version=version)
    return HeldPart(None, batch, seq)


def test_a_step_checkpoints_the_ledger_with_its_task_groups_and_advances_the_version_when_it_syncs():
    policy = FakePolicy()
    old = {"old": {"attempt": 1, "step": 0, "parts": {"old": 1}}}
    before = TrainerState(step=3, version=2, next_task_step=5, run_id="r", ledger=old)
    step = commit_step(policy, before, [held("a", 10, 2), held("b", 11, 1)], weight_sync_interval=2, next_task_step=6)
    assert step.after == TrainerState(
        4,
        3,
        6,
        "r",
        {
            **old,
            "a": {"attempt": 1, "step": 3, "parts": {"a": 10}},
            "b": {"attempt": 1, "step": 3, "parts": {"b": 11}},
        },
    )
    assert before.ledger == old  # the state before is left as it was
    assert step.after.to_dict()["ledger_of"] == "tasks"
    [(cmd, state)] = policy.calls
    assert (cmd.step, cmd.version, cmd.sync) == (3, 3, True) and state == step.after.to_dict()
    assert decode_batch(cmd.batch).batch_id == "r/step-3" and step.weights == Path("w")


def test_a_step_record_has_the_metrics_staleness_gate_counts_and_batch_ids():
    policy = FakePolicy()
    before = TrainerState(step=0, version=2, run_id="r")
    step = commit_step(policy, before, [held("a", 1, 2), held("b", 2, 1)], weight_sync_interval=2, next_task_step=1)
    assert step.weights is None and step.after.version == 2
    record = step_record(step, {"gate_accepted": 2}, {"step_s": 4.0}, weight_update="retract", replay_of="f")
    assert record == {
        "step": 1,
        "version": 2,
        "loss": 0.5,
        "train_s": 1.0,
        "save_s": 2.0,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "token_staleness_mean": 0.5,  # 6 trained tokens 0 behind, 6 one behind
        "token_staleness_max": 1,
        "token_stale_share": 0.0,
        "token_kv_unverified_share": 0.0,  # retract: every label true by construction
        "turns_mean": 1.0,  # plain responses: one run of sampled tokens each
        "sampled_tokens": 12,
        "injected_tokens": 0,
        "finish": {},  # synthetic batches record none
        "gate_accepted": 2,
        "step_s": 4.0,
        "batch_ids": ["a", "b"],
        "replay_of": "f",
    }


def test_a_checkpoint_with_a_ledger_of_batch_ids_is_refused_by_name():
    saved = {"step": 2, "version": 2, "next_task_step": 3, "run_id": "r", "ledger": {"r/0/0": [5, 0]}}
    with pytest.raises(LedgerFormatError) as err:
        TrainerState.from_dict(saved, "runs/x/checkpoints/step-000002")
    assert str(err.value) == (
        "runs/x/checkpoints/step-000002: its ledger is keyed by batch id (ledger_of is None, this release reads "
        "'tasks': one entry per task group trained, with its attempt and parts); resume it with the release that "
        "wrote it, or start a new run directory (docs/design.md section 10)"
    )
    assert TrainerState.from_dict(TrainerState(step=1, run_id="r").to_dict()) == TrainerState(step=1, run_id="r")


def test_a_step_record_counts_the_sessions_turns_sampled_and_injected_tokens_and_finish_reasons():
    from dataclasses import replace

    import numpy as np

    from trainer_service.commit import sample_shape

    batch = make_batch(samples=2, tokens_per_sample=5, k=4, vocab_size=32)
    # sample 0: two turns (1 1 | 0 | 1 1), sample 1: three (1 | 0 | 1 | 0 0 | 1)
    mask = np.array([1, 1, 0, 1, 1, 1, 0, 1, 0, 1], np.uint8)
    session = replace(batch, loss_mask=mask, finish_reasons=["stop", "session_budget"])
    assert sample_shape([session, batch]) == {
        "turns_mean": (2 + 3 + 1 + 1) / 4,
        "sampled_tokens": 7 + 10,
        "injected_tokens": 3,
        "finish": {"session_budget": 1, "stop": 1},
    }


def test_tokens_labelled_with_a_version_an_in_place_update_loaded_are_counted_as_unverified():
    from dataclasses import replace

    import numpy as np

    from trainer_service.commit import kv_unverified

    batch = make_batch(samples=2, tokens_per_sample=4, k=4, vocab_size=32)
    # versions 0 0 1 1 | 2 2 2 0, the second sample's first token untrained
    session = replace(
        batch,
        token_versions=np.array([0, 0, 1, 1, 2, 2, 2, 0], np.int32),
        loss_mask=np.array([1, 1, 1, 1, 0, 1, 1, 1], np.uint8),
        weight_version=2,
    )
    # in place, a token of a version an update loaded may rest on KV of an older one: 4 of the 7 trained
    assert kv_unverified([session], "in_place") == 4 / 7
    # retract and drain flush the prefix cache with each load and recompute or finish what is in flight
    assert kv_unverified([session], "retract") == kv_unverified([session], "drain") == 0.0
    assert kv_unverified([], "in_place") == 0.0
