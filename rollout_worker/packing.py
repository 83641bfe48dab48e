"""Engine responses -> samples -> wire-format batches.

A response of the proxy is SGLang's: native ``/generate`` returns one object per sample
(a list when ``n > 1``), chat returns ``choices`` each with a native ``meta_info``. Both are
read by ``shared/sglang_response.py``, the parser the proxy audits with: sampled ids and
log-probs, ``K`` candidate slots per token (``selected``: the unfiltered top-``K``;
``support``: the realized support with its renormalised log-probs, which is then also the
sampled token's), the weight version (``"default"``, the initial weights, is 0), the finish
reason and the text.

Rows shorter than ``K`` keep their leading slots and leave the rest empty (``-1`` / ``-inf``)
for the contract to judge; nothing is padded into a full row or repaired here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared import sglang_response
from shared.contract import ContractViolation
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


def samples_from_response(doc, *, endpoint: str, mode: str, k: int) -> list[Sample]:
    """Every sample of a native (``endpoint="generate"``) or chat response body (parsed JSON),
    read by ``shared.sglang_response``, the parser the proxy audits with."""
    try:
        metas = sglang_response.response_metas(doc, endpoint)
        ids, logprobs, _, cand_ids, cand_logprobs, offsets = sglang_response.to_arrays(metas, mode=mode, k=k)
        versions = sglang_response.weight_versions(metas)
    except ContractViolation as exc:
        raise ResponseError(str(exc)) from None
    texts = sglang_response.response_texts(doc, endpoint)
    reasons = sglang_response.finish_reasons(metas)
    ids, logprobs = ids.astype(np.int32), logprobs.astype(np.float32)
    cand_ids, cand_logprobs = cand_ids.astype(np.int32), cand_logprobs.astype(np.float32)
    bounds = offsets.tolist()
    return [
        Sample(
            text=texts[i],
            response_ids=ids[a:b],
            sampled_logprobs=logprobs[a:b],
            cand_ids=cand_ids[a:b],
            cand_logprobs=cand_logprobs[a:b],
            weight_version=versions[i],
            finish_reason=reasons[i],
        )
        for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]


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
