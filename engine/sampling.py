"""Sampling for a batch of rows, with SGLang's log-prob semantics.

For each row (one sequence at one position) with temperature T:
- the returned log-probs are `log_softmax(logits / T)` over the whole vocabulary
  (SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB unset): not renormalised by any filter;
- the filter is SGLang's torch sampler (`layers/sampler.py`,
  `top_k_top_p_min_p_sampling_from_probs_torch`): sort the probabilities descending, drop
  ranks >= top_k, drop entries whose exclusive cumulative mass exceeds top_p (joint with
  top-k, both on the unfiltered cumsum), then drop entries below `min_p * max_prob`;
- the token is drawn from what the filter kept, by the row's own torch.Generator, so a
  sequence's draws do not depend on which other sequences share the batch;
- the support is the kept set in descending-probability order, with log-probs
  renormalised over it (`log(w / sum w)`); the sampled token's support log-prob is the
  "selected" value.
Temperature 0 means greedy, mapped as SGLang does to T = 1 and top_k = 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TOP_K_ALL = 1 << 30
SAMPLING_EPS = 1e-6


@dataclass
class SamplingSpec:
    """Per-sequence sampling settings after SGLang's normalisation (greedy -> T=1, k=1)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    top_logprobs_num: int = 0  # K of the top-K list per position; 0 = none
    want_mask: bool = False  # record the filter's support per position
    generator: torch.Generator = field(default_factory=torch.Generator)

    @classmethod
    def make(cls, temperature: float, top_p: float, top_k: int, min_p: float, seed: int, **kw):
        if 0 <= temperature < SAMPLING_EPS:
            temperature, top_k = 1.0, 1
        if top_k == -1:
            top_k = TOP_K_ALL
        gen = torch.Generator()
        gen.manual_seed(seed)
        return cls(temperature, top_p, top_k, min_p, generator=gen, **kw)


@dataclass
class RowResult:
    """What one row produced: plain Python values, ready for JSON."""

    token: int
    logprob: float
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    mask_ids: list[int] | None = None
    mask_logprobs: list[float] | None = None
    selected_logprob: float | None = None  # the sampled token's log-prob within the support


def filter_sorted(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    """Sort `probs` [R, V] descending and zero what the filter drops.

    Returns (weights [R, V] in sorted order, token ids [R, V]); kept entries are a prefix.
    """
    sorted_p, ids = probs.sort(dim=-1, descending=True, stable=True)
    exclusive = torch.cumsum(sorted_p, dim=-1) - sorted_p
    rank = torch.arange(probs.shape[-1]).view(1, -1)
    drop = (rank >= top_k.view(-1, 1)) | (exclusive > top_p.view(-1, 1))
    weights = sorted_p.masked_fill(drop, 0.0)
    threshold = weights[:, :1] * min_p.view(-1, 1)
    weights = weights.masked_fill(weights < threshold, 0.0)
    return weights, ids


def sample_rows(logits: torch.Tensor, specs: list[SamplingSpec]) -> list[RowResult]:
    """Sample one token for each row of `logits` [R, V] with its spec."""
    temps = torch.tensor([s.temperature for s in specs], dtype=logits.dtype)
    logprobs = torch.log_softmax(logits / temps.view(-1, 1), dim=-1)
    probs = torch.softmax(logits / temps.view(-1, 1), dim=-1)
    weights, ids = filter_sorted(
        probs,
        torch.tensor([s.top_k for s in specs]),
        torch.tensor([s.top_p for s in specs], dtype=logits.dtype),
        torch.tensor([s.min_p for s in specs], dtype=logits.dtype),
    )
    picks = [
        0 if s.top_k == 1 else int(torch.multinomial(weights[r], 1, generator=s.generator))
        for r, s in enumerate(specs)
    ]
    tokens = ids[torch.arange(len(specs)), torch.tensor(picks)]
    token_lps = logprobs.gather(1, tokens.view(-1, 1)).view(-1)

    k_max = min(max(s.top_logprobs_num for s in specs), logits.shape[-1])
    if k_max > 0:
        top_vals, top_ids = torch.topk(logprobs, k_max, dim=-1, sorted=True)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()

    want_mask = any(s.want_mask for s in specs)
    if want_mask:
        lengths = (weights > 0).sum(dim=-1).tolist()
        support_lps = torch.log(weights / weights.sum(dim=-1, keepdim=True))

    results = []
    for r, (spec, token, lp) in enumerate(zip(specs, tokens.tolist(), token_lps.tolist())):
        row = RowResult(token=token, logprob=lp)
        k = min(spec.top_logprobs_num, logits.shape[-1])
        if k > 0:
            row.top_ids, row.top_logprobs = top_ids[r][:k], top_vals[r][:k]
        if spec.want_mask:
            n = lengths[r]
            row.mask_ids = ids[r, :n].tolist()
            row.mask_logprobs = support_lps[r, :n].tolist()
            row.selected_logprob = row.mask_logprobs[picks[r]]
        results.append(row)
    return results
