"""The sampling contract: what every training request samples with and every batch records
(docs/design.md sections 4, 5 and 7).

The worker states these settings in its requests and writes them into each batch, its session
endpoint accepts a request's own only at these values, and the proxy rewrites every training
request to them. Each setting SGLang's sampler reads but the contract leaves off is stated at its
``NEUTRAL`` value, the one that leaves the distribution alone.
"""

from __future__ import annotations

from dataclasses import dataclass

# The settings the contract leaves off, at the value that changes nothing. Left unset, the server
# fills them from its own defaults (docs/design.md section 7); any other value is refused by name.
NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class Sampling:
    """The run's sampling, as ``--rollout-*`` sets it: ``cfg.rollout.sampling`` (shared/settings.py)."""

    k: int  # candidates recorded per token (--rollout-top-logprobs-num)
    temperature: float  # the trainer divides its logits by it (--rollout-temperature)
    top_p: float  # 1.0 = no nucleus filter (--rollout-top-p)
    top_k: int  # -1 = no top-k filter (--rollout-top-k)
    mode: str  # "selected": unfiltered, the top-K head; "support": filtered, the realized support
