"""Engine responses -> samples -> wire-format batches.

The worker asks the proxy for the binary answer (``Accept: application/x-centerline-arrays``):
the arrays the proxy parsed out of SGLang's JSON and audited (``shared/response_arrays.py``),
so the worker reads them as views and parses no JSON. They hold sampled ids and log-probs,
``K`` candidate slots per token (``selected``: the unfiltered top-``K``; ``support``: the
realized support with its renormalised log-probs, which is then also the sampled token's),
each sample's weight version (``"default"``, the initial weights, is 0) and each token's
(SGLang's ``meta_info.weight_versions`` spans: a response that spans an update is sampled by
two versions), finish reason and text.

Rows shorter than ``K`` keep their leading slots and leave the rest empty (``-1`` / ``-inf``)
for the contract to judge; nothing is padded into a full row or repaired here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.response_arrays import ResponseArrays
from shared.sampling import Sampling
from shared.task import PromptTask
from shared.wire import Batch


@dataclass
class Sample:
    """One sampled response of a group: L tokens, K candidate slots per token."""

    text: str  # the decoded response (stop token stripped by the engine), what rewards read
    response_ids: np.ndarray  # int32 [L]
    sampled_logprobs: np.ndarray  # float32 [L]
    cand_ids: np.ndarray  # int32 [L, K], -1 = empty slot
    cand_logprobs: np.ndarray  # float32 [L, K], -inf = empty slot
    weight_version: int  # the newest token's, the version SGLang served when it finished
    finish_reason: str | None = None
    token_versions: np.ndarray | None = None  # int32 [L], each token's version; None: weight_version on all

    def versions(self) -> np.ndarray:
        """Each token's weight version, int32 [L]."""
        if self.token_versions is not None:
            return np.asarray(self.token_versions, np.int32)
        return np.full(len(self.response_ids), self.weight_version, np.int32)


def samples_from_arrays(arrays: ResponseArrays) -> list[Sample]:
    """Every sample of a response, from its arrays (the proxy's binary answer, decoded)."""
    bounds = arrays.offsets.tolist()
    versions = arrays.versions_of_tokens()
    return [
        Sample(
            text=arrays.texts[i],
            response_ids=arrays.response_ids[a:b],
            sampled_logprobs=arrays.sampled_logprobs[a:b],
            cand_ids=arrays.cand_ids[a:b],
            cand_logprobs=arrays.cand_logprobs[a:b],
            weight_version=arrays.weight_versions[i],
            finish_reason=arrays.finish_reasons[i],
            token_versions=versions[a:b],
        )
        for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]


@dataclass
class Trajectory:
    """One sample as it is trained: a prompt and the L tokens after it. A plain response is all
    sampled tokens; a session's holds the template's tokens of every later message too, untrained
    (loss mask 0, an empty candidate row, sampled log-prob 0)."""

    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [L]
    sampled_logprobs: np.ndarray  # float32 [L]
    loss_mask: np.ndarray  # uint8 [L], 1 exactly on the tokens SGLang sampled
    token_versions: np.ndarray  # int32 [L], the weight version that sampled each token
    cand_ids: np.ndarray  # int32 [L, K], -1 = empty slot
    cand_logprobs: np.ndarray  # float32 [L, K], -inf = empty slot
    finish_reason: str = "stop"  # "stop" | "length" (a session: its last turn's) | "session_budget"
    tool_calls: int | None = None  # a session's: the calls parsed from its replies; None: not a session
    tool_call_parse_errors: int | None = None  # a session's: the replies whose call markup did not parse

    @classmethod
    def of_sample(cls, prompt_ids, s: Sample) -> Trajectory:
        """A plain response: every token sampled, each by its own weight version (SGLang's spans)."""
        n = len(s.response_ids)
        return cls(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            response_ids=s.response_ids,
            sampled_logprobs=s.sampled_logprobs,
            loss_mask=np.ones(n, np.uint8),
            token_versions=s.versions(),
            cand_ids=s.cand_ids,
            cand_logprobs=s.cand_logprobs,
            finish_reason=s.finish_reason or "stop",
        )


def batch_id_of(task_id: str, attempt: int) -> str:
    """The batch id (and ``Nats-Msg-Id``) of an attempt's group: the task id for the first,
    ``f"{task_id}#{attempt}"`` for a later one (docs/design.md section 10)."""
    return task_id if attempt == 1 else f"{task_id}#{attempt}"


def pack_trajectories(
    task: PromptTask,
    trajectories: list[Trajectory],
    rewards: np.ndarray,
    advantages: np.ndarray,
    *,
    attempt: int = 1,
    producer: str,
    sampling: Sampling,
) -> Batch:
    """The group's one batch (wire format v2): ``task_id`` is the task's and ``batch_id`` its
    attempt's (``batch_id_of``), so a publish repeated within an attempt is dropped by JetStream
    and another attempt's parts never mix with this one's; sample ``i`` is ``f"{task_id}/{i}"``.
    Each token carries the version that sampled it, and the batch the newest of them, so one batch
    holds a group however many weight versions sampled it. ``attempt`` is the task's
    (``attempts_before`` + the message's delivery); ``parts`` is 1 until the publisher splits the
    batch by size. ``sampling`` is the run's, which the batch records for the trainer to check."""
    k = sampling.k
    lengths = [len(t.response_ids) for t in trajectories]
    offsets = np.zeros(len(trajectories) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    prompt_offsets = np.zeros(len(trajectories) + 1, dtype=np.int64)
    np.cumsum([len(t.prompt_ids) for t in trajectories], out=prompt_offsets[1:])
    token_versions = _cat([t.token_versions for t in trajectories], np.int32, (0,))
    return Batch(
        batch_id=batch_id_of(task.task_id, attempt),
        producer=producer,
        task_id=task.task_id,
        attempt=int(attempt),
        parts=1,
        weight_version=int(token_versions.max()) if token_versions.size else 0,
        mode=sampling.mode,
        k=k,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=int(sampling.top_k),
        sample_ids=[f"{task.task_id}/{i}" for i in range(len(trajectories))],
        group_ids=[task.group_id] * len(trajectories),
        finish_reasons=[t.finish_reason for t in trajectories],
        tool_calls=_counts([t.tool_calls for t in trajectories]),
        tool_call_parse_errors=_counts([t.tool_call_parse_errors for t in trajectories]),
        rewards=np.asarray(rewards, dtype=np.float32),
        advantages=np.asarray(advantages, dtype=np.float32),
        offsets=offsets,
        prompt_offsets=prompt_offsets,
        prompt_ids=_cat([t.prompt_ids for t in trajectories], np.int32, (0,)),
        response_ids=_cat([t.response_ids for t in trajectories], np.int32, (0,)),
        sampled_logprobs=_cat([t.sampled_logprobs for t in trajectories], np.float32, (0,)),
        loss_mask=_cat([t.loss_mask for t in trajectories], np.uint8, (0,)),
        token_versions=token_versions,
        cand_ids=_cat([t.cand_ids for t in trajectories], np.int32, (0, k)),
        cand_logprobs=_cat([t.cand_logprobs for t in trajectories], np.float32, (0, k)),
    )


def _counts(counts: list[int | None]) -> list[int]:
    """One count per sample, or none where a sample records none (plain responses)."""
    return [] if None in counts else list(counts)


def _cat(arrays: list[np.ndarray], dtype, empty_shape: tuple) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(empty_shape, dtype=dtype)
