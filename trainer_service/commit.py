"""The commit of one training step, the same in the trainer and in ``centerline replay --train``.

From the batches the gate holds for a step: their concatenation is trained on every rank, the
weight version written when the step syncs, and the checkpoint saved with the state after the
step (``TrainerState``: the ledger then holds the step's task groups). ``step_record`` is the
step's line of ``metrics.jsonl``. Acking the batches and loading the weights into the engines
stay with the trainer (docs/design.md section 10: acks only once the checkpoint is durable).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared.batch_algebra import concat_batches
from shared.contract import sample_turns
from shared.wire import REWARD_COMPONENTS, encode_batch
from trainer_service import journal
from trainer_service.ledger import HeldPart, kept_entries, ledger_entries
from trainer_service.policy import StepCommand

log = logging.getLogger("centerline.trainer")

LEDGER_OF = "tasks"  # state.json's "ledger_of": what its ledger is keyed by (before: batch ids, no such key)


class LedgerFormatError(ValueError):
    """A checkpoint whose ledger this release cannot read; the message names the checkpoint and the way on."""


@dataclass(frozen=True, slots=True)
class TrainerState:
    """What a checkpoint's ``state.json`` holds besides the last step's metrics."""

    step: int = 0  # completed steps
    version: int = 0  # weight version the trainer holds
    next_task_step: int = 0  # the task publisher's cursor (trainer_service/tasks.py)
    run_id: str = ""
    # task_id -> {"attempt", "step", "parts": {batch_id: stream sequence}} (trainer_service/ledger.py)
    ledger: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, state: dict, where: str = "the checkpoint") -> TrainerState:
        """The state saved in ``state.json``; a ledger of batch ids (written before exactly-once per
        task group) is refused: it cannot say which task groups were trained, nor under which attempt."""
        if state.get("ledger_of") != LEDGER_OF:
            raise LedgerFormatError(
                f"{where}: its ledger is keyed by batch id (ledger_of is {state.get('ledger_of')!r}, this release "
                f"reads {LEDGER_OF!r}: one entry per task group trained, with its attempt and parts); resume it with "
                "the release that wrote it, or start a new run directory (docs/design.md section 10)"
            )
        return cls(state["step"], state["version"], state["next_task_step"], state["run_id"], state["ledger"])

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "version": self.version,
            "next_task_step": self.next_task_step,
            "run_id": self.run_id,
            "ledger_of": LEDGER_OF,
            "ledger": self.ledger,
        }


@dataclass(frozen=True, slots=True)
class Step:
    """One trained and checkpointed step."""

    before: TrainerState
    after: TrainerState  # what the step's checkpoint holds
    held: list[HeldPart]  # the step's batches, in arrival order
    metrics: dict  # the policy's: loss metrics, grad norm, train_s, save_s
    weights: Path | None  # the weight version written this step, None when it did not sync


def commit_step(
    policy,
    state: TrainerState,
    held: list[HeldPart],
    *,
    weight_sync_interval: int,
    next_task_step: int,
    first_task_step: int = 0,
    checkpoint_every: int = 1,
    last_step: int | None = None,
    journal_dir: Path | None = None,
) -> Step:
    """Rank 0: train on ``held`` (every part of each of its task groups; every rank follows), write
    the weights when the step syncs, make the step durable; returns the step with the state after it.

    Durable: the checkpoint, saved every ``checkpoint_every`` steps and after ``last_step``
    (removing the journal records it covers); between checkpoints the step's record in
    ``journal_dir`` (trainer_service/journal.py), from which a restart trains it again. The ledger
    after it keeps the tasks of ``first_task_step`` on (trainer_service/ledger.py)."""
    step = state.step
    sync = (step + 1) % weight_sync_interval == 0
    checkpoint = journal_dir is None or (step + 1) % checkpoint_every == 0 or step + 1 == last_step
    batch = concat_batches([h.batch for h in held], batch_id=f"{state.run_id}/step-{step}")
    after = TrainerState(
        step=step + 1,
        version=state.version + sync,
        next_task_step=next_task_step,
        run_id=state.run_id,
        ledger=kept_entries({**state.ledger, **ledger_entries(held, step)}, first_task_step),
    )
    metrics, weights = policy.run(
        StepCommand(step, after.version, sync, encode_batch(batch), checkpoint=checkpoint), after.to_dict()
    )
    if journal_dir is not None:
        if checkpoint:
            journal.prune(journal_dir, after.step)
        else:
            journal.write(journal_dir, step, next_task_step, held)
    if metrics.get("step_skipped_nonfinite"):
        ids = [h.batch.batch_id for h in held]
        log.error(
            "step %d skipped: its loss (%s) or total gradient norm (%s) is not finite; the weights are unchanged "
            "and its task groups are consumed untrained (docs/design.md section 6); batches %s",
            after.step,
            metrics["loss"],
            metrics["grad_norm"],
            ids,
            extra={"fields": {"step": after.step, "batch_ids": ids}},
        )
    return Step(state, after, held, metrics, weights)


def step_record(step: Step, gate: dict, timings: dict, *, weight_update: str, **extra) -> dict:
    """The step's line of ``metrics.jsonl``: ``step`` counts completed steps, like ``--steps``
    (the first step logs step 1); staleness is per sample, in versions behind the trainer, of the
    sample's oldest trained token (the one the gate judges); the samples' turns and tokens
    (``sample_shape``); staleness per trained token (``token_staleness``); and the share of trained
    tokens whose label the weight update cannot vouch for (``kv_unverified``)."""
    staleness = [step.before.version - version for h in step.held for version in sample_versions(h.batch)]
    return {
        "step": step.after.step,
        "version": step.after.version,
        **step.metrics,
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": max(staleness),
        **token_staleness([h.batch for h in step.held], step.before.version),
        "token_kv_unverified_share": kv_unverified([h.batch for h in step.held], weight_update),
        **sample_shape([h.batch for h in step.held]),
        **reward_components([h.batch for h in step.held]),
        **gate,
        **timings,
        "batch_ids": [h.batch.batch_id for h in step.held],
        **extra,
    }


def sample_shape(batches) -> dict:
    """What the step's samples were: ``turns_mean``, the mean of each sample's turns (its runs of
    sampled tokens: 1 for a plain response, a session's turns otherwise); ``sampled_tokens`` (loss
    mask 1) and ``injected_tokens`` (a session's template, user and tool tokens between turns,
    loss mask 0) of the responses; ``finish``, the samples by finish reason ("stop", "length",
    "session_budget"; none for a batch that records none); where the batches are sessions',
    ``tool_calls`` parsed from their replies and ``tool_call_parse_errors``, the replies whose call
    markup did not parse (docs/design.md section 12)."""
    turns, sampled, injected, finish, tools = [], 0, 0, {}, {}
    for batch in batches:
        for name in ("tool_calls", "tool_call_parse_errors"):
            if getattr(batch, name):
                tools[name] = tools.get(name, 0) + sum(getattr(batch, name))
        sampled += int(batch.loss_mask.sum())
        injected += int(batch.loss_mask.size - batch.loss_mask.sum())
        turns += sample_turns(batch)
        for reason in batch.finish_reasons:
            finish[reason] = finish.get(reason, 0) + 1
    return {
        "turns_mean": sum(turns) / len(turns) if turns else 0.0,
        "sampled_tokens": sampled,
        "injected_tokens": injected,
        "finish": dict(sorted(finish.items())),
        **tools,
    }


def reward_components(batches) -> dict:
    """``reward_components``: where the step's groups were scored by weighted reward components
    (``rollout_worker/rewards.py``), each component's mean over the step's groups, by its name
    (one part of a task's group carries the group's means: the first of its task's parts counts)."""
    sums, counts, seen = {}, {}, set()
    for batch in batches:
        means = batch.extra.get(REWARD_COMPONENTS)
        if not isinstance(means, dict) or batch.task_id in seen:
            continue
        seen.add(batch.task_id)
        for name, value in means.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                sums[name] = sums.get(name, 0.0) + float(value)
                counts[name] = counts.get(name, 0) + 1
    return {REWARD_COMPONENTS: {name: sums[name] / counts[name] for name in sorted(sums)}} if sums else {}


def sample_versions(batch) -> list[int]:
    """Each sample's oldest trained token's weight version (``weight_version`` where it trains none)."""
    out = []
    for i in range(batch.num_samples):
        part = batch.sample_slice(i)
        trained = batch.token_versions[part][batch.loss_mask[part].astype(bool)]
        out.append(int(trained.min()) if trained.size else batch.weight_version)
    return out


def kv_unverified(batches, weight_update: str) -> float:
    """The share of trained tokens that may rest on KV computed under older weights than their label
    (docs/design.md section 8): 0 by construction under ``retract`` and ``drain``, which flush the
    prefix cache with every load and recompute (or finish) the requests in flight; under ``in_place``
    every token labelled with a version an update loaded (above 0), an upper bound: the prefix cache
    and the requests in flight keep KV of older versions under the new label."""
    if weight_update != "in_place":
        return 0.0
    trained = [batch.token_versions[batch.loss_mask.astype(bool)] for batch in batches]
    total = sum(t.size for t in trained)
    return sum(int((t > 0).sum()) for t in trained) / total if total else 0.0


def token_staleness(batches, version: int) -> dict:
    """Staleness per trained token (loss mask 1), in versions behind the trainer's ``version``:
    ``token_staleness_mean``, ``token_staleness_max``, and ``token_stale_share``, the share of
    trained tokens more than one version behind (a response that spans an update has tokens of
    two versions; under the asynchronous default one version behind is the usual case)."""
    total, summed, worst, over = 0, 0, 0, 0
    for batch in batches:
        trained = batch.token_versions[batch.loss_mask.astype(bool)]
        if not trained.size:
            continue
        behind = version - trained.astype(np.int64)
        total += int(behind.size)
        summed += int(behind.sum())
        worst = max(worst, int(behind.max()))
        over += int((behind > 1).sum())
    return {
        "token_staleness_mean": summed / total if total else 0.0,
        "token_staleness_max": worst,
        "token_stale_share": over / total if total else 0.0,
    }
