"""Each rank's shard of a step's global batch: which samples it trains, balanced by tokens
(docs/design.md section 6, "Shards").

A sample costs its prompt plus its response tokens (the forward pass runs over both). The
samples are assigned longest first, each to the rank with the fewest tokens so far (the lowest
rank on a tie): greedy bin packing, within one longest sample of the best balance. A rank's
samples keep their order in the batch. Rank 0 cuts the batch and sends each rank only its
shard (``scatter_shards``); a rank never holds the whole batch unless it is rank 0.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

import numpy as np

from shared.wire import ARRAY_FIELDS, Batch, decode_batch, encode_batch
from trainer_service.distributed import is_main, rank_and_world, scatter_from_main


def sample_tokens(batch: Batch) -> np.ndarray:
    """Each sample's tokens through the model: its prompt and its response."""
    return np.diff(batch.prompt_offsets) + np.diff(batch.offsets)


def assign(batch: Batch, world: int) -> list[list[int]]:
    """The samples of each of ``world`` ranks (indices into ``batch``, in batch order)."""
    if batch.num_samples < world:
        raise ValueError(
            f"the batch has {batch.num_samples} samples for {world} ranks; every rank needs at least one "
            "(raise the rollout batch size or run fewer ranks)"
        )
    tokens = sample_tokens(batch)
    order = sorted(range(batch.num_samples), key=lambda i: (-int(tokens[i]), i))
    bins: list[tuple[int, int]] = [(0, r) for r in range(world)]  # (tokens so far, rank)
    out: list[list[int]] = [[] for _ in range(world)]
    for i in order:
        load, rank = heapq.heappop(bins)
        out[rank].append(i)
        heapq.heappush(bins, (load + int(tokens[i]), rank))
    return [sorted(samples) for samples in out]


def take(batch: Batch, samples: list[int]) -> Batch:
    """The sub-batch of ``samples`` (indices, in that order): offsets rebased, everything else
    per sample or per token copied; the batch's own fields (id, mode, K, sampling) kept."""
    arrays = {}
    for name, per in (
        ("offsets", ("response_ids", "sampled_logprobs", "loss_mask", "token_versions", "cand_ids", "cand_logprobs")),
        ("prompt_offsets", ("prompt_ids",)),
    ):
        offsets = getattr(batch, name)
        spans = [(int(offsets[i]), int(offsets[i + 1])) for i in samples]
        rebased = np.zeros(len(samples) + 1, np.int64)
        np.cumsum([b - a for a, b in spans], out=rebased[1:])
        arrays[name] = rebased
        for field in per:
            source = getattr(batch, field)
            parts = [source[a:b] for a, b in spans]
            arrays[field] = np.concatenate(parts) if parts else source[:0].copy()
    for name in ("rewards", "advantages"):
        arrays[name] = np.asarray(getattr(batch, name))[samples]
    assert set(arrays) == set(ARRAY_FIELDS)
    per_sample = {
        name: [getattr(batch, name)[i] for i in samples] if getattr(batch, name) else []
        for name in ("sample_ids", "group_ids", "finish_reasons", "tool_calls", "tool_call_parse_errors")
    }
    fields = {
        name: getattr(batch, name)
        for name in Batch.__dataclass_fields__
        if name not in arrays and name not in per_sample
    }
    return Batch(**fields, **arrays, **per_sample)


def split(batch: Batch, world: int) -> list[Batch]:
    """Each rank's shard of ``batch``."""
    return [take(batch, samples) for samples in assign(batch, world)]


def scatter_shards(cmd):
    """This rank's copy of rank 0's step command ``cmd`` (a dataclass whose ``batch`` is the
    encoded global batch, or None to stop), its ``batch`` replaced by the rank's shard: rank 0
    passes ``cmd``, the other ranks None, and each receives its own shard only."""
    world = rank_and_world()[1]
    if world == 1:
        return cmd
    if not is_main():
        return scatter_from_main(None)
    if cmd.batch is None:
        return scatter_from_main([cmd] * world)
    return scatter_from_main([replace(cmd, batch=encode_batch(s)) for s in split(decode_batch(cmd.batch), world)])
