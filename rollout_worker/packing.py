"""Engine responses -> samples -> wire-format batches.

The worker asks the proxy for the binary answer (``Accept: application/x-centerline-arrays``):
the arrays the proxy parsed out of SGLang's JSON and audited (``shared/response_arrays.py``),
so the worker reads them as views and parses no JSON. They hold sampled ids and log-probs,
``K`` candidate slots per token (``selected``: the unfiltered top-``K``; ``support``: the
realized support with its renormalised log-probs, which is then also the sampled token's),
each sample's weight version (``"default"``, the initial weights, is 0), finish reason and
text. ``samples_from_response`` reads SGLang's JSON into the same arrays, for tools and tests.

Rows shorter than ``K`` keep their leading slots and leave the rest empty (``-1`` / ``-inf``)
for the contract to judge; nothing is padded into a full row or repaired here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared import response_arrays, sglang_response
from shared.contract import ContractViolation
from shared.response_arrays import ResponseArrays
from shared.task import PromptTask
from shared.wire import Batch


class ResponseError(ValueError):
    """A response the worker cannot turn into samples; the message names the field."""


@dataclass
class Sample:
    """One sampled response of a group: L tokens, K candidate slots per token."""

    text: str  # the decoded response (stop token stripped by the engine), what rewards read
    response_ids: np.ndarray  # int32 [L]
    sampled_logprobs: np.ndarray  # float32 [L]
    cand_ids: np.ndarray  # int32 [L, K], -1 = empty slot
    cand_logprobs: np.ndarray  # float32 [L, K], -inf = empty slot
    weight_version: int
    finish_reason: str | None = None


def samples_from_arrays(found: ResponseArrays) -> list[Sample]:
    """Every sample of a response, from its arrays (the proxy's binary answer, decoded)."""
    bounds = found.offsets.tolist()
    return [
        Sample(
            text=found.texts[i],
            response_ids=found.response_ids[a:b],
            sampled_logprobs=found.sampled_logprobs[a:b],
            cand_ids=found.cand_ids[a:b],
            cand_logprobs=found.cand_logprobs[a:b],
            weight_version=found.weight_versions[i],
            finish_reason=found.finish_reasons[i],
        )
        for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]


def samples_from_response(doc, *, endpoint: str, mode: str, k: int) -> list[Sample]:
    """Every sample of a native (``endpoint="generate"``) or chat response body (parsed JSON): the
    samples of the same arrays as the proxy's binary answer."""
    try:
        metas = sglang_response.response_metas(doc, endpoint)
        found = response_arrays.from_parsed(doc, metas, endpoint, mode=mode, k=k)
    except ContractViolation as exc:
        raise ResponseError(str(exc)) from None
    return samples_from_arrays(found)


def pack_group(
    task: PromptTask,
    prompt_ids: list[int],
    samples: list[Sample],
    rewards: np.ndarray,
    advantages: np.ndarray,
    *,
    producer: str,
    mode: str,
    k: int,
    temperature: float,
    top_p: float,
    top_k: int,
) -> list[Batch]:
    """One batch per weight version of the group, in version order.

    ``batch_id`` is the ``task_id`` when one version sampled the whole group, else
    ``f"{task_id}/w{version}"``: a redelivered task re-publishes the same ids and JetStream
    drops the copy. Sample ``i`` of the group is ``f"{task_id}/{i}"`` in every batch.
    """
    versions = sorted({s.weight_version for s in samples})
    batches = []
    for version in versions:
        idx = [i for i, s in enumerate(samples) if s.weight_version == version]
        part = [samples[i] for i in idx]
        lengths = [len(s.response_ids) for s in part]
        offsets = np.zeros(len(part) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        batches.append(
            Batch(
                batch_id=task.task_id if len(versions) == 1 else f"{task.task_id}/w{version}",
                producer=producer,
                weight_version=version,
                mode=mode,
                k=k,
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k),
                sample_ids=[f"{task.task_id}/{i}" for i in idx],
                group_ids=[task.group_id] * len(part),
                rewards=np.asarray(rewards, dtype=np.float32)[idx],
                advantages=np.asarray(advantages, dtype=np.float32)[idx],
                offsets=offsets,
                prompt_offsets=np.arange(len(part) + 1, dtype=np.int64) * len(prompt),
                prompt_ids=np.tile(prompt, len(part)),
                response_ids=_cat([s.response_ids for s in part], np.int32, (0,)),
                sampled_logprobs=_cat([s.sampled_logprobs for s in part], np.float32, (0,)),
                loss_mask=np.ones(int(offsets[-1]), dtype=np.uint8),  # every generated token is trained
                cand_ids=_cat([s.cand_ids for s in part], np.int32, (0, k)),
                cand_logprobs=_cat([s.cand_logprobs for s in part], np.float32, (0, k)),
            )
        )
    return batches


def _cat(arrays: list[np.ndarray], dtype, empty_shape: tuple) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(empty_shape, dtype=dtype)
