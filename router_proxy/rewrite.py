"""Training requests rewritten to the candidate contract (docs/design.md section 7).

The proxy owns the log-prob fields of a training request: whatever the client sent for them
is replaced by what the configured contract needs, and every sampling setting is stated
(``_set_sampling``), so nothing is left for the server to fill from its defaults. Sampling settings that would change
the
distribution the trainer assumes (another temperature, min-p, penalties, constrained
decoding, streaming that cannot be audited) are refused with ``RequestRejected``, which
names the field; the server turns it into HTTP 400.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import orjson

from shared.config import Config
from shared.contract import k_above_vocab
from shared.sampling import NEUTRAL, Sampling

SGLANG_TOP_K_ALL = 1 << 30  # SGLang's "no top-k filter" default

# The log-prob fields the proxy sets or removes; a client's value for them never reaches the upstream.
NATIVE_OWNED = ("return_logprob", "top_logprobs_num", "return_sampling_mask", "sampling_logprobs_mode")
CHAT_OWNED = (
    "logprobs",
    "top_logprobs",
    "return_meta_info",
    "return_prompt_token_ids",
    "return_sampling_mask",
    "sampling_logprobs_mode",
)


class RequestRejected(ValueError):
    """A request the contract or a proxy limit cannot honour; ``field`` is its dotted path in the body,
    ``value`` and ``limit`` the numbers compared when a limit refused it."""

    def __init__(self, field: str, message: str, *, value=None, limit=None):
        super().__init__(f"{field}: {message}")
        self.field, self.value, self.limit = field, value, limit

    def to_dict(self) -> dict:
        error = {"rule": "request_rejected", "field": self.field, "message": str(self)}
        if self.limit is not None:
            error.update(value=self.value, limit=self.limit)
        return {"error": error}


@dataclass(frozen=True)
class Contract(Sampling):
    """The run's sampling (``shared/sampling.py``), which every training request samples with and
    every response must carry, and the endpoint the probe checks."""

    endpoint: str  # "generate" | "chat"

    @classmethod
    def from_config(cls, cfg: Config) -> Contract:
        return cls(**asdict(cfg.rollout.sampling), endpoint=cfg.rollout.endpoint)


@dataclass(frozen=True)
class Rewritten:
    """A training request as the proxy sends it, and the length budget it asked for (None: unset), which
    the audit holds the answer's length finishes to (``sglang_response.check_not_clipped``)."""

    body: bytes
    max_new_tokens: int | None


def rewrite_body(
    raw: bytes, endpoint: str, contract: Contract, *, max_k: int | None = None, vocab_size: int | None = None
) -> bytes:
    """The request body ``raw`` for ``endpoint`` ("generate" | "chat") rewritten to ``contract``;
    a client's K above ``max_k`` is refused even though the contract's K replaces it
    (``vocab_size``, when ``max_k`` is the vocabulary, names it in the refusal)."""
    return rewrite_request(raw, endpoint, contract, max_k=max_k, vocab_size=vocab_size).body


def rewrite_request(
    raw: bytes, endpoint: str, contract: Contract, *, max_k: int | None = None, vocab_size: int | None = None
) -> Rewritten:
    """``rewrite_body``'s request, with the length budget it asks for."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestRejected("body", f"not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise RequestRejected("body", f"expected a JSON object, found {type(body).__name__}")
    if max_k is not None:
        check_k(body, endpoint, max_k, vocab_size)
    if endpoint == "generate":
        rewrite_generate(body, contract)
        budget = body["sampling_params"].get("max_new_tokens")
    else:
        rewrite_chat(body, contract)
        budget = body.get("max_completion_tokens", body.get("max_tokens"))
    return Rewritten(orjson.dumps(body), budget if type(budget) is int else None)


def check_k(body: dict, endpoint: str, max_k: int, vocab_size: int | None = None) -> None:
    """Refuse a requested K (native ``top_logprobs_num``, one or a list; chat ``top_logprobs``)
    above ``max_k``: every candidate costs the upstream and the proxy memory per token, and
    one above the vocabulary (``max_k == vocab_size``) takes an SGLang 0.5.23 server down."""
    name = "top_logprobs_num" if endpoint == "generate" else "top_logprobs"
    value = body.get(name)
    for k in value if isinstance(value, list) else (value,):
        if isinstance(k, (int, float)) and not isinstance(k, bool) and k > max_k:
            too_many = k_above_vocab(k, vocab_size) if max_k == vocab_size else None
            why = (
                too_many or f"is {k}, above the proxy's limit of {max_k} candidates per token (--max-top-logprobs-num)"
            )
            raise RequestRejected(name, why, value=k, limit=max_k)


def check_eval_body(raw: bytes, endpoint: str, max_k: int, vocab_size: int | None = None) -> None:
    """The limits an evaluation request (otherwise forwarded untouched) must respect; a body
    that is not a JSON object is left to the upstream to refuse."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return
    if isinstance(body, dict):
        check_k(body, endpoint, max_k, vocab_size)


def rewrite_generate(body: dict, c: Contract) -> None:
    """Native /generate, in place: ``return_logprob`` plus top-K or the support fields."""
    if body.get("stream"):
        raise RequestRejected(
            "stream", "a streamed response cannot be audited before it reaches the client; send stream=false"
        )
    if body.get("custom_logit_processor"):
        raise RequestRejected(
            "custom_logit_processor", "a custom logit processor changes the sampling distribution the trainer assumes"
        )
    params = body.get("sampling_params")
    if params is None:
        params = body["sampling_params"] = {}
    if not isinstance(params, dict):
        raise RequestRejected("sampling_params", "expected one JSON object (the same sampling for every prompt)")
    _check_sampling(params, c, prefix="sampling_params.")
    for name in ("json_schema", "regex", "ebnf", "structural_tag"):
        if params.get(name) is not None:
            raise RequestRejected(
                f"sampling_params.{name}",
                "constrained decoding samples from a masked distribution the candidates do not describe",
            )
    _set_sampling(params, c, min_tokens="min_new_tokens")
    for name in NATIVE_OWNED:
        body.pop(name, None)
    body["return_logprob"] = True
    if c.mode == "selected":
        body["top_logprobs_num"] = c.k
    else:
        body["return_sampling_mask"] = True
        body["sampling_logprobs_mode"] = "support"


def rewrite_chat(body: dict, c: Contract) -> None:
    """/v1/chat/completions, in place: ``logprobs``, top-K or the support fields, and ``return_meta_info`` for token
    ids."""
    if body.get("stream"):
        raise RequestRejected(
            "stream", "a streamed response cannot be audited before it reaches the client; send stream=false"
        )
    _check_sampling(body, c, prefix="")
    for name in ("regex", "ebnf", "json_schema"):
        if body.get(name) is not None:
            raise RequestRejected(
                name, "constrained decoding samples from a masked distribution the candidates do not describe"
            )
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
        raise RequestRejected(
            "response_format", 'structured output is constrained decoding; only {"type": "text"} is allowed'
        )
    _set_sampling(body, c, min_tokens=None)
    for name in CHAT_OWNED:
        body.pop(name, None)
    body["logprobs"] = True
    body["return_meta_info"] = True  # the native meta_info carries the token ids chat output lacks
    body["return_prompt_token_ids"] = True  # the prompt as SGLang rendered it, which is what is trained
    if c.mode == "selected":
        body["top_logprobs"] = c.k
    else:
        body["return_sampling_mask"] = True
        body["sampling_logprobs_mode"] = "support"


def _check_sampling(params: dict, c: Contract, *, prefix: str) -> None:
    """Refuse any setting that changes the sampled distribution away from the contract's."""

    def number(name: str):
        value = params.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RequestRejected(prefix + name, f"expected a number, found {value!r}")
        return value

    t = number("temperature")
    if t is not None and abs(t - c.temperature) > 1e-9:
        raise RequestRejected(
            prefix + "temperature",
            f"is {t}, the contract samples at {c.temperature} (--rollout-temperature); the trainer divides its logits "
            "by that value",
        )
    p = number("top_p")
    if p is not None and abs(p - c.top_p) > 1e-9:
        raise RequestRejected(prefix + "top_p", f"is {p}, the contract samples with top_p {c.top_p} (--rollout-top-p)")
    k = number("top_k")
    off = (-1, SGLANG_TOP_K_ALL)
    if k is not None and not (k == c.top_k or (c.top_k == -1 and k in off)):
        raise RequestRejected(prefix + "top_k", f"is {k}, the contract samples with top_k {c.top_k} (--rollout-top-k)")
    if number("min_p") not in (None, NEUTRAL["min_p"]):
        raise RequestRejected(
            prefix + "min_p",
            f"is {params['min_p']}; min-p filtering is not supported by the contract (its support is not recorded)",
        )
    for name, neutral in NEUTRAL.items():
        if name != "min_p" and number(name) not in (None, neutral):
            raise RequestRejected(
                prefix + name,
                f"is {params[name]}; penalties change the sampled distribution, only {neutral:g} is allowed",
            )
    if params.get("logit_bias"):
        raise RequestRejected(
            prefix + "logit_bias", "a logit bias changes the sampled distribution the candidates describe"
        )
    for name in ("min_new_tokens", "min_tokens"):
        if number(name) not in (None, 0):
            raise RequestRejected(
                prefix + name,
                f"is {params[name]}; a minimum length masks the end-of-sequence token, a distribution the candidates "
                "do not describe",
            )


# Settings of --preferred-sampling-params that change neither what is sampled nor what its
# candidates describe; any other one there cannot be overridden through a router (it drops
# logit_bias, custom_params, ...), so the probe refuses such an upstream.
HARMLESS_DEFAULTS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "n",
        "sampling_seed",
        "stream_interval",
    }
)
STATED = frozenset({"temperature", "top_p", "top_k", *NEUTRAL, "min_new_tokens"})


def _set_sampling(params: dict, c: Contract, *, min_tokens: str | None) -> None:
    """State every setting SGLang's sampler reads: one left unset is filled by the server, native
    /generate from --preferred-sampling-params, chat from the model's generation_config.json
    (--sampling-defaults model, SGLang's default), so a Qwen model would sample with top_k 20 while
    the batch records unfiltered candidates (``min_tokens``: the minimum length's name on this endpoint;
    None on chat, where sglang-router 0.3.2 refuses ``min_tokens`` 0 and SGLang's chat layer
    states its own 0 for a request without one)."""
    params["temperature"] = c.temperature
    params["top_p"] = c.top_p
    params["top_k"] = c.top_k if c.top_k > 0 else -1  # -1: SGLang's "whole vocabulary"
    params.update(NEUTRAL)
    if min_tokens is not None:
        params[min_tokens] = 0
