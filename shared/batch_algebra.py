"""Batch algebra: a batch's samples selected, batches concatenated, a batch cut into shards.

Every operation keeps a batch's invariants (docs/design.md section 3): the per-token arrays stay
aligned with ``offsets``, the prompts with ``prompt_offsets``, both rebased to start at 0, and
every per-sample field (ids, rewards, advantages, finish reasons, tool calls) follows its sample.

- ``select_samples``: some samples of a batch, in a given order. The worker splits a batch by
  sample to fit ``max_payload`` (``rollout_worker/publish.py``); each trainer rank takes its shard.
- ``concat_batches``: the step's global batch from the parts the gate held
  (``trainer_service/commit.py``).
- ``assign_shards``: which samples each rank trains, balanced by tokens (docs/design.md section 6,
  "Shards"). A sample costs its prompt plus its response tokens (the forward pass runs over both).
  The samples are assigned longest first, each to the rank with the fewest tokens so far (the
  lowest rank on a tie): greedy bin packing, within one longest sample of the best balance. A
  rank's samples keep their order in the batch.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

import numpy as np

from shared.wire import ARRAY_FIELDS, Batch


def select_samples(batch: Batch, indices: slice | list[int] | np.ndarray) -> Batch:
    """The samples ``indices`` of ``batch`` as a new batch, offsets rebased to start at 0.

    A step-1 slice returns views of ``batch``'s per-token arrays; other selections copy.
    Batch-level fields (``batch_id`` included) are unchanged.
    """
    count = batch.num_samples
    if isinstance(indices, slice) and indices.step in (None, 1):
        start, stop, _ = indices.indices(count)
        idx = np.arange(start, max(start, stop))
        offsets = np.asarray(batch.offsets[start : start + len(idx) + 1], dtype=np.int64)
        prompt_offsets = np.asarray(batch.prompt_offsets[start : start + len(idx) + 1], dtype=np.int64)
        tok, prm = slice(int(offsets[0]), int(offsets[-1])), slice(int(prompt_offsets[0]), int(prompt_offsets[-1]))
        offsets, prompt_offsets = offsets - offsets[0], prompt_offsets - prompt_offsets[0]
    else:
        idx = np.arange(count)[indices] if isinstance(indices, slice) else np.asarray(indices, dtype=np.int64)
        tok, offsets = _gather(np.asarray(batch.offsets, dtype=np.int64), idx)
        prm, prompt_offsets = _gather(np.asarray(batch.prompt_offsets, dtype=np.int64), idx)
    return replace(
        batch,
        sample_ids=[batch.sample_ids[i] for i in idx.tolist()],
        group_ids=[batch.group_ids[i] for i in idx.tolist()],
        finish_reasons=[batch.finish_reasons[i] for i in idx.tolist()] if batch.finish_reasons else [],
        tool_calls=[batch.tool_calls[i] for i in idx.tolist()] if batch.tool_calls else [],
        tool_call_parse_errors=[batch.tool_call_parse_errors[i] for i in idx.tolist()]
        if batch.tool_call_parse_errors
        else [],
        rewards=batch.rewards[idx],
        advantages=batch.advantages[idx],
        offsets=offsets,
        prompt_offsets=prompt_offsets,
        prompt_ids=batch.prompt_ids[prm],
        response_ids=batch.response_ids[tok],
        sampled_logprobs=batch.sampled_logprobs[tok],
        loss_mask=batch.loss_mask[tok],
        token_versions=batch.token_versions[tok],
        cand_ids=batch.cand_ids[tok],
        cand_logprobs=batch.cand_logprobs[tok],
        extra=dict(batch.extra),
    )


def _gather(offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat element indices of the segments ``idx`` of ``offsets``, and the rebased offsets."""
    starts, lengths = offsets[idx], offsets[idx + 1] - offsets[idx]
    new_offsets = np.zeros(len(idx) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    flat = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1], dtype=np.int64)
    return flat, new_offsets


def concat_batches(batches: list[Batch], batch_id: str) -> Batch:
    """One global batch from accepted batches (same mode, K and sampling settings, which the
    gate enforces); offsets are rebased, ``extra["batch_ids"]`` lists the parts in order. It
    belongs to no task: ``task_id`` is ``batch_id``, one attempt, one part."""
    first = batches[0]
    arrays = {}
    for name in ARRAY_FIELDS:
        if name in ("offsets", "prompt_offsets"):
            continue
        arrays[name] = np.concatenate([getattr(b, name) for b in batches])
    for name in ("offsets", "prompt_offsets"):
        lengths = np.concatenate([np.diff(getattr(b, name)) for b in batches])
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        arrays[name] = offsets
    return Batch(
        batch_id=batch_id,
        producer="trainer",
        task_id=batch_id,
        attempt=1,
        parts=1,
        weight_version=max(b.weight_version for b in batches),  # the newest token's, as in every batch
        mode=first.mode,
        k=first.k,
        temperature=first.temperature,
        top_p=first.top_p,
        top_k=first.top_k,
        sample_ids=[s for b in batches for s in b.sample_ids],
        group_ids=[g for b in batches for g in b.group_ids],
        extra={"batch_ids": [b.batch_id for b in batches]},
        **arrays,
    )


def assign_shards(batch: Batch, world: int) -> list[list[int]]:
    """The samples of each of ``world`` ranks (indices into ``batch``, in batch order), balanced by
    tokens (module docstring); ``select_samples(batch, assign_shards(batch, world)[rank])`` is a
    rank's shard."""
    if batch.num_samples < world:
        raise ValueError(
            f"the batch has {batch.num_samples} samples for {world} ranks; every rank needs at least one "
            "(raise the rollout batch size or run fewer ranks)"
        )
    tokens = np.diff(batch.prompt_offsets) + np.diff(batch.offsets)  # each sample's, through the model
    order = sorted(range(batch.num_samples), key=lambda i: (-int(tokens[i]), i))
    bins: list[tuple[int, int]] = [(0, r) for r in range(world)]  # (tokens so far, rank)
    out: list[list[int]] = [[] for _ in range(world)]
    for i in order:
        load, rank = heapq.heappop(bins)
        out[rank].append(i)
        heapq.heappush(bins, (load + int(tokens[i]), rank))
    return [sorted(samples) for samples in out]
