"""The proxy's settings and the probe's (tables ``[proxy]``, ``[probe]``): the contract-enforcing
proxy and one check of an upstream against a contract."""

from __future__ import annotations

import warnings
from typing import ClassVar, Literal

from pydantic import Field

from shared.settings_base import LAUNCHED, CommandSettings, refuse_if

# Proxy limits, defaults of the proxy's flags and of the classes in router_proxy that enforce them.
MAX_REQUEST_BODY_BYTES = 32 << 20  # a training request is prompts and settings: 32 MiB is ~4M tokens as input_ids
MAX_UPSTREAM_RESPONSE_BYTES = 256 << 20  # K=128 rows of 30-byte entries: ~4 KB a token, so ~65k tokens per answer
MAX_TOP_LOGPROBS_NUM = 1024  # K a request may ask for; the contract's default is 128


class ProxySettings(CommandSettings):
    """``centerline proxy``: the contract-enforcing proxy (router_proxy/server.py)."""

    name: ClassVar[str] = "proxy"
    command: ClassVar[str] = "centerline proxy"
    required: ClassVar[tuple[str, ...]] = ("upstream",)

    upstream: str | None = Field(None, description="SGLang router or server URL. Required.", json_schema_extra=LAUNCHED)
    host: str = Field("127.0.0.1", description="Address to serve on.")
    port: int = Field(30010, description="Port to serve on.", json_schema_extra=LAUNCHED)
    vocab_size: int | None = Field(
        None, gt=0, description="Used when the upstream's /model_info reports no vocabulary size."
    )
    upstream_timeout: float = Field(1800.0, gt=0, description="Seconds per upstream request.")
    max_request_body_bytes: int = Field(
        MAX_REQUEST_BODY_BYTES, gt=0, description="Larger request bodies are refused with 413."
    )
    max_upstream_response_bytes: int = Field(
        MAX_UPSTREAM_RESPONSE_BYTES,
        gt=0,
        description="Larger upstream answers are cut off and become 502 upstream_too_large (a worker dead-letters "
        "the task, never retries it). Checked at start-up against --rollout-n x --rollout-max-new-tokens tokens of "
        "K + 1 entries of ~30 bytes.",
    )
    max_top_logprobs_num: int = Field(
        MAX_TOP_LOGPROBS_NUM,
        gt=0,
        description="Largest K (top_logprobs_num, top_logprobs) a request may ask for; above it: 400.",
    )

    def check_with(self, cfg) -> None:
        rollout = cfg.rollout
        k = rollout.top_logprobs_num
        # one request's n answers of the longest reply, each token's K + 1 entries of ~30 JSON bytes
        answer = rollout.n * rollout.max_new_tokens * 30 * (k + 1)
        refuse_if(
            answer > self.max_upstream_response_bytes,
            "max_upstream_response_bytes",
            self.max_upstream_response_bytes,
            f"an answer of --rollout-n {rollout.n} x --rollout-max-new-tokens {rollout.max_new_tokens} "
            f"tokens at K={k} is about {answer} bytes and would be cut off every time; raise it, or lower them",
        )
        refuse_if(
            k > self.max_top_logprobs_num,
            "rollout_top_logprobs_num",
            k,
            f"above --max-top-logprobs-num {self.max_top_logprobs_num}; raise the limit or lower K",
        )


warnings.filterwarnings("ignore", 'Field name "json" in "ProbeSettings" shadows', UserWarning)  # the flag --json


class ProbeSettings(CommandSettings):
    """``centerline probe``: one check of an upstream against a contract (router_proxy/probe.py)."""

    name: ClassVar[str] = "probe"
    command: ClassVar[str] = "centerline probe"
    required: ClassVar[tuple[str, ...]] = ("upstream",)

    upstream: str | None = Field(None, description="SGLang router or server URL. Required.")
    k: int = Field(128, gt=0, description="Candidates per token (--rollout-top-logprobs-num).")
    endpoint: Literal["generate", "chat"] = Field("generate", description="SGLang endpoint to probe.")
    mode: Literal["selected", "support"] = Field("selected", description="Logprobs mode (--rollout-logprobs-mode).")
    temperature: float = Field(1.0, description="Sampling temperature of the canary request.")
    top_p: float = Field(1.0, description="Top-p filter of the canary request.")
    top_k: int | None = Field(None, description="Top-k filter; unset: K in support mode, -1 (off) otherwise.")
    vocab_size: int | None = Field(None, gt=0, description="Used when the upstream does not report it.")
    timeout: float = Field(60.0, gt=0, description="Seconds for the canary request.")
    json: bool = Field(False, description="Print the report as one JSON object.")
