"""Synthetic but valid candidate batches and SGLang answers, made from a real softmax so every rule holds.

Used by the benchmarks, tests and fuzz seeds; a batch made here passes `check_batch` by construction,
an answer made here passes the proxy's audit.
"""

from __future__ import annotations

import numpy as np
import orjson

from shared.wire import Batch


def make_batch(
    *,
    samples: int = 4,
    tokens_per_sample: int = 8,
    k: int = 8,
    vocab_size: int = 64,
    mode: str = "selected",
    top_k: int = -1,
    seed: int = 0,
    weight_version: int = 0,
    batch_id: str = "batch-0",
    prompt_len: int = 3,
) -> Batch:
    """A valid batch of ``samples`` responses of ``tokens_per_sample`` tokens each.

    In ``selected`` mode each row holds the top-``min(k, vocab)`` ids of a random softmax;
    in ``support`` mode the support is the top-``top_k`` (default ``k``) ids, renormalised.
    """
    rng = np.random.default_rng(seed)
    n = samples * tokens_per_sample
    width = min(k, vocab_size) if mode == "selected" else min(top_k if top_k > 0 else k, vocab_size)
    head = np.empty((n, width), np.int64)
    head_lp = np.empty((n, width), np.float64)
    for start in range(0, n, 256):  # chunks keep [rows, vocab] small for large vocabularies
        logits = rng.standard_normal((min(256, n - start), vocab_size)) * 2.0
        top_logit = logits.max(axis=1, keepdims=True)
        logp = logits - (top_logit + np.log(np.exp(logits - top_logit).sum(axis=1, keepdims=True)))
        top = (
            np.argpartition(-logp, width - 1, axis=1)[:, :width]
            if width < vocab_size
            else np.tile(np.arange(vocab_size), (len(logp), 1))
        )
        top_lp = np.take_along_axis(logp, top, axis=1)
        order = np.argsort(-top_lp, axis=1, kind="stable")
        head[start : start + len(logp)] = np.take_along_axis(top, order, axis=1)
        head_lp[start : start + len(logp)] = np.take_along_axis(top_lp, order, axis=1)
    if mode == "support":
        head_lp = head_lp - np.logaddexp.reduce(head_lp, axis=1, keepdims=True)
    # Sample from the head's renormalised distribution so the sampled token is a candidate.
    p = np.exp(head_lp - np.logaddexp.reduce(head_lp, axis=1, keepdims=True))
    pick = (p.cumsum(axis=1) > rng.random((n, 1))).argmax(axis=1)
    cand_ids = np.full((n, k), -1, np.int32)
    cand_lp = np.full((n, k), -np.inf, np.float32)
    cand_ids[:, :width] = head
    cand_lp[:, :width] = head_lp
    rows = np.arange(n)
    rewards = rng.integers(0, 2, samples).astype(np.float32)
    return Batch(
        batch_id=batch_id,
        producer="synth",
        task_id=batch_id,
        attempt=1,
        parts=1,
        weight_version=weight_version,
        mode=mode,
        k=k,
        temperature=1.0,
        top_p=1.0,
        top_k=top_k,
        sample_ids=[f"{batch_id}:s{i}" for i in range(samples)],
        group_ids=[f"{batch_id}:g{i // 2}" for i in range(samples)],
        rewards=rewards,
        advantages=(rewards - rewards.mean()).astype(np.float32),
        offsets=np.arange(samples + 1, dtype=np.int64) * tokens_per_sample,
        prompt_offsets=np.arange(samples + 1, dtype=np.int64) * prompt_len,
        prompt_ids=rng.integers(0, vocab_size, samples * prompt_len).astype(np.int32),
        response_ids=head[rows, pick].astype(np.int32),
        sampled_logprobs=cand_lp[rows, pick].copy(),
        loss_mask=np.ones(n, np.uint8),
        token_versions=np.full(n, weight_version, np.int32),
        cand_ids=cand_ids,
        cand_logprobs=cand_lp,
    )


def native_response(tokens: int, k: int, vocab_size: int, seed: int = 0) -> bytes:
    """A valid native /generate response: each row is the top-``k`` of a random softmax, the sampled token its head."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((tokens, vocab_size)) * 3
    logp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    top = np.argsort(-logp, axis=1)[:, :k]
    rows = [[[float(logp[i, v]), int(v), None] for v in top[i]] for i in range(tokens)]
    sampled = [[rows[i][0][0], rows[i][0][1], None] for i in range(tokens)]
    meta = {
        "id": "bench",
        "finish_reason": {"type": "length", "length": tokens},
        "prompt_tokens": 3,
        "completion_tokens": tokens,
        "cached_tokens": 0,
        "weight_version": "default",
        "output_token_logprobs": sampled,
        "output_top_logprobs": rows,
    }
    return orjson.dumps({"text": "x" * tokens, "output_ids": [s[1] for s in sampled], "meta_info": meta})
