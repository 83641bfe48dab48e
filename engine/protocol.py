"""Native `/generate` of SGLang 0.5.23: request validation and response shapes.

Requests: `input_ids` (1-D, or 2-D for a batch) or `text` (str or list); one
`sampling_params` object or one per batch item. Unknown `sampling_params` keys are
rejected with 400 and serde's text, as SGLang's JSON contract does; unknown top-level keys
(the router's `model: null`, `background: false`, ...) are ignored. Fields the engine
cannot honour (penalties, constrained decoding, streaming, ...) are rejected by name
rather than silently ignored. Responses: `{text, output_ids, meta_info}`, a list for a
batch or n > 1 (ordered item by item, then sample by sample), with SGLang's meta_info
keys (see ../shared/reference/sglang-protocol.md section 1).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from engine.sampling import SamplingSpec
from engine.scheduler import Sequence


class RequestError(ValueError):
    """A request the engine refuses; answered as HTTP 400 `{"error": {"message": ...}}`."""


# SGLang 0.5.23 `sglang.api.v1.SamplingParams` fields, in its order (the 400 text lists them).
SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip
# Known fields the engine does not implement: accepted only at their no-op values.
UNSUPPORTED_SAMPLING = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "stop_regex": None, "logit_bias": {}, "custom_params": None,
    "beam_width": None, "watermark": None, "choice": [],
}  # fmt: skip
# Top-level /generate fields that would change the answer and are not implemented.
UNSUPPORTED_TOP_LEVEL = ("input_embeds", "token_ids_logprob", "image_data", "video_data", "audio_data",
                         "lora_path", "custom_logit_processor", "session_params", "return_routed_experts")  # fmt: skip


@dataclass
class EngineInfo:
    """What request parsing needs to know about the served model."""

    vocab_size: int
    eos_ids: set[int]
    max_context: int
    sampling_mask_max_tokens: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int], bool], str]  # (ids, skip_special_tokens)
    token_text: Callable[[int], str]
    next_seed: Callable[[], int]


@dataclass
class Options:
    """How one sequence's response is rendered."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_sampling_mask: bool = False
    support_mode: bool = False
    text_in_logprobs: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


def unknown_field(key: str, fields: tuple[str, ...]) -> RequestError:
    listed = ", ".join(f"`{f}`" for f in fields)
    return RequestError(f"unknown field `{key}`, expected one of {listed}")


def _typed(name: str, value: Any, kind: type | tuple, what: str):
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise RequestError(f"{name}: expected {what}, got {value!r}")
    if not isinstance(value, kind):
        raise RequestError(f"{name}: expected {what}, got {value!r}")
    return value


def parse_sampling(sp: Any) -> dict:
    """Validate one sampling_params object; returns it with SGLang's defaults filled in."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise RequestError(f"invalid type: sampling_params must be an object, got {sp!r}")
    for key in sp:
        if key not in SAMPLING_FIELDS:
            raise unknown_field(key, SAMPLING_FIELDS)
    for key, noop in UNSUPPORTED_SAMPLING.items():
        if sp.get(key) is not None and sp[key] != noop:
            raise RequestError(f"sampling_params.{key}={sp[key]!r} is not supported by the embedded engine")
    get = lambda k, d: d if sp.get(k) is None else sp[k]  # noqa: E731 (null = default, as SGLang)
    out = {
        "max_new_tokens": _typed("max_new_tokens", get("max_new_tokens", 128), int, "an integer"),
        "temperature": float(_typed("temperature", get("temperature", 1.0), (int, float), "a number")),
        "top_p": float(_typed("top_p", get("top_p", 1.0), (int, float), "a number")),
        "top_k": _typed("top_k", get("top_k", 1 << 30), int, "an integer"),
        "min_p": float(_typed("min_p", get("min_p", 0.0), (int, float), "a number")),
        "n": _typed("n", get("n", 1), int, "an integer"),
        "ignore_eos": _typed("ignore_eos", get("ignore_eos", False), bool, "a boolean"),
        "skip_special_tokens": _typed("skip_special_tokens", get("skip_special_tokens", True), bool, "a boolean"),
        "no_stop_trim": _typed("no_stop_trim", get("no_stop_trim", False), bool, "a boolean"),
        "sampling_seed": get("sampling_seed", None),
        "stop_token_ids": list(get("stop_token_ids", [])),
        "stop": get("stop", []),
    }
    if isinstance(out["stop"], str):
        out["stop"] = [out["stop"]]
    if out["sampling_seed"] is not None:
        _typed("sampling_seed", out["sampling_seed"], int, "an integer")
    if out["max_new_tokens"] < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {out['max_new_tokens']}")
    if out["temperature"] < 0:
        raise RequestError(f"temperature must be non-negative, got {out['temperature']}")
    if not 0 < out["top_p"] <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {out['top_p']}")
    if out["top_k"] < 1 and out["top_k"] != -1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {out['top_k']}")
    if not 0 <= out["min_p"] <= 1:
        raise RequestError(f"min_p must be in [0, 1], got {out['min_p']}")
    if out["n"] < 1:
        raise RequestError(f"n must be at least 1, got {out['n']}")
    return out


def make_sequences(
    prompts: list[list[int]], params: list[dict], opts: Options, info: EngineInfo,
    rid: Any = None, input_logprob_start: int = -1,
) -> list[Sequence]:  # fmt: skip
    """Expand prompts x n into Sequences (item-major, as SGLang orders its outputs)."""
    if opts.top_logprobs_num < 0:
        raise RequestError(f"top_logprobs_num must be non-negative, got {opts.top_logprobs_num}")
    seqs = []
    total = sum(p["n"] for p in params)
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        if not prompt:
            raise RequestError("the input is empty: give at least one token")
        bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < info.vocab_size]
        if bad:
            raise RequestError(f"input token id {bad[0]!r} is out of range [0, {info.vocab_size})")
        if len(prompt) + sp["max_new_tokens"] > info.max_context:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({sp['max_new_tokens']}) exceeds "
                f"the model's context length {info.max_context}; lower max_new_tokens"
            )
        top_k = sp["top_k"] if sp["temperature"] >= 1e-6 else 1
        cap = info.sampling_mask_max_tokens
        if opts.return_sampling_mask and top_k != 1 and not 1 < top_k <= cap:
            raise RequestError(
                f"return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= {cap}; "
                f"got top_k={sp['top_k']}. Lower top_k or increase --sampling-mask-max-tokens."
            )
        stops = set(sp["stop_token_ids"]) | (set() if sp["ignore_eos"] else info.eos_ids)
        for j in range(sp["n"]):
            seed = sp["sampling_seed"] + j if sp["sampling_seed"] is not None else info.next_seed()
            spec = SamplingSpec.make(
                sp["temperature"], sp["top_p"], sp["top_k"], sp["min_p"], seed,
                top_logprobs_num=opts.top_logprobs_num if opts.return_logprob else 0,
                want_mask=opts.return_sampling_mask,
            )  # fmt: skip
            if isinstance(rid, list):
                seq_rid = str(rid[i]) if sp["n"] == 1 else f"{rid[i]}-{j}"
            else:
                seq_rid = str(rid) if rid is not None and total == 1 else uuid.uuid4().hex
            seq = Sequence(seq_rid, list(prompt), spec, sp["max_new_tokens"], stops, list(sp["stop"]), input_logprob_start)
            seq.options = Options(**{**opts.__dict__, "skip_special_tokens": sp["skip_special_tokens"],
                                     "no_stop_trim": sp["no_stop_trim"]})  # fmt: skip
            seqs.append(seq)
    return seqs


def parse_generate(body: Any, info: EngineInfo) -> tuple[list[Sequence], bool]:
    """Validate a /generate body; returns its sequences and whether the reply is a list."""
    if not isinstance(body, dict):
        raise RequestError("invalid type: the body must be a JSON object")
    for key in UNSUPPORTED_TOP_LEVEL:
        if body.get(key):
            raise RequestError(f"{key} is not supported by the embedded engine")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by the embedded engine")
    if body.get("return_hidden_states"):
        raise RequestError("return_hidden_states=true is not supported by the embedded engine")
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise RequestError("give exactly one of input_ids and text")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids or of lists of them")
        batched = isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        if any(not isinstance(p, list) for p in prompts):
            raise RequestError("input_ids mixes token ids and lists; give 1-D or 2-D input_ids")
    else:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if any(not isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a list of strings")
        prompts = [info.encode(t) for t in texts]
    sps = body.get("sampling_params")
    if isinstance(sps, list):
        if len(sps) != len(prompts):
            raise RequestError(f"sampling_params has {len(sps)} entries for {len(prompts)} inputs")
        params = [parse_sampling(sp) for sp in sps]
    else:
        params = [parse_sampling(sps)] * len(prompts)
    mode = body.get("sampling_logprobs_mode")
    mask = bool(body.get("return_sampling_mask") or False)
    if mode not in (None, "selected", "support"):
        raise RequestError(f"sampling_logprobs_mode must be 'selected' or 'support', got {mode!r}")
    if mode is not None and not mask:
        raise RequestError("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
    for key in ("return_logprob", "return_sampling_mask", "return_text_in_logprobs"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise RequestError(f"{key} must be a boolean (lists are not supported), got {body[key]!r}")
    top_n = body.get("top_logprobs_num") or 0
    start = body.get("logprob_start_len")
    start = -1 if start is None else start
    for name, value in (("top_logprobs_num", top_n), ("logprob_start_len", start)):
        _typed(name, value, int, "an integer (lists are not supported)")
    opts = Options(
        return_logprob=bool(body.get("return_logprob")), top_logprobs_num=top_n, return_sampling_mask=mask,
        support_mode=mode == "support", text_in_logprobs=bool(body.get("return_text_in_logprobs")),
    )  # fmt: skip
    start = start if opts.return_logprob else -1
    seqs = make_sequences(prompts, params, opts, info, body.get("rid"), start)
    return seqs, batched or len(seqs) > 1


def output_text(seq: Sequence, info: EngineInfo) -> str:
    """The decoded completion, with a matched stop trimmed unless no_stop_trim (SGLang)."""
    opts: Options = seq.options
    ids = seq.output_ids
    matched = (seq.finish_reason or {}).get("matched")
    if isinstance(matched, int) and not opts.no_stop_trim:
        ids = ids[:-1]
    text = info.decode(ids, opts.skip_special_tokens)
    if isinstance(matched, str) and not opts.no_stop_trim and matched in text:
        text = text[: text.index(matched)]
    return text


def logprob_triples(rows, info: EngineInfo, with_text: bool) -> tuple[list, list]:
    """([logprob, id, text|null] per position, top-K triples per position or null)."""
    text = (lambda t: info.token_text(t)) if with_text else (lambda t: None)
    tokens, tops = [], []
    for row in rows:
        if row is None:  # the first prompt token has no log-prob
            tokens.append([None, None, None])
            tops.append(None)
            continue
        tokens.append([row.logprob, row.token, text(row.token)])
        if row.top_ids is not None:
            tops.append([[lp, t, text(t)] for lp, t in zip(row.top_logprobs, row.top_ids)])
    return tokens, tops


def meta_info(seq: Sequence, info: EngineInfo) -> dict:
    opts: Options = seq.options
    meta = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt_ids),
        "weight_version": seq.weight_version,
        "num_retractions": 0,
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": 0,
        "reasoning_tokens": 0,
    }
    if opts.return_logprob:
        in_tokens, in_tops = logprob_triples(seq.input_rows, info, opts.text_in_logprobs)
        if seq.input_rows and seq.input_rows[0] is None:
            in_tokens[0][1] = seq.prompt_ids[0]
        out_tokens, out_tops = logprob_triples(seq.rows, info, opts.text_in_logprobs)
        meta["input_token_logprobs"] = in_tokens
        meta["output_token_logprobs"] = out_tokens
        meta["output_token_logprobs_length"] = len(out_tokens)
        if opts.top_logprobs_num > 0:
            meta["input_top_logprobs"] = in_tops
            meta["output_top_logprobs"] = out_tops
    if opts.return_sampling_mask:
        meta["output_token_sampling_mask"] = [row.mask_ids for row in seq.rows]
        meta["output_token_sampling_logprobs"] = [
            row.mask_logprobs if opts.support_mode else row.selected_logprob for row in seq.rows
        ]
        meta["output_token_sampling_mask_length"] = len(seq.rows)
    meta["e2e_latency"] = time.perf_counter() - seq.started
    return meta


def generate_response(seq: Sequence, info: EngineInfo) -> dict:
    return {"text": output_text(seq, info), "output_ids": seq.output_ids, "meta_info": meta_info(seq, info)}
