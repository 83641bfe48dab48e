"""OpenAI `/v1/chat/completions` as SGLang 0.5.23 serves it (non-streaming).

The request maps onto native sampling (`logprobs` + `top_logprobs` -> top_logprobs_num,
`seed` -> sampling_seed, `max_completion_tokens`/`max_tokens` -> max_new_tokens) plus
SGLang's extensions: `input_ids` (a pre-tokenized prompt, no chat template),
`return_meta_info` (the full native meta_info in `choices[i].meta_info`),
`return_token_ids` (`prompt_token_ids` / `response_token_ids` per choice), `top_k`,
`min_p`, `stop_token_ids`, `ignore_eos`, `return_sampling_mask` (needs return_meta_info)
and `sampling_logprobs_mode`. Unknown keys are ignored, like SGLang's pydantic model.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from engine.protocol import EngineInfo, Options, RequestError, make_sequences, meta_info, output_text, parse_sampling
from engine.scheduler import Sequence


def _prompt_ids(body: dict, info: EngineInfo, apply_template: Callable[[list], str]) -> list[int]:
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        if not isinstance(ids, list) or (ids and isinstance(ids[0], list)):
            raise RequestError("input_ids must be a 1-D list of token ids for chat")
        return ids
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    normalised = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str) or not isinstance(m.get("role"), str):
            raise RequestError(f"each message needs a string role and text content, got {m!r}")
        normalised.append({"role": m["role"], "content": content})
    return info.encode(apply_template(normalised))


def parse_chat(body: Any, info: EngineInfo, apply_template: Callable[[list], str]) -> tuple[list[Sequence], dict]:
    """Validate a chat body; returns its sequences and the flags that shape the reply."""
    if not isinstance(body, dict):
        raise RequestError("invalid type: the body must be a JSON object")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by the embedded engine")
    if body.get("return_sampling_mask") and not body.get("return_meta_info"):
        raise RequestError("return_sampling_mask requires return_meta_info=true.")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise RequestError(f"{key}={body[key]!r} is not supported by the embedded engine")
    top = body.get("top_logprobs")
    logprobs = bool(body.get("logprobs"))
    if top is not None and top > 0 and not logprobs:
        raise RequestError("top_logprobs requires logprobs=true")
    prompt = _prompt_ids(body, info, apply_template)
    max_new = body.get("max_completion_tokens")
    if max_new is None:
        max_new = body.get("max_tokens")
    if max_new is None:  # SGLang: unlimited up to the context length
        max_new = max(info.max_context - len(prompt), 0)
    sampling = {
        "max_new_tokens": max_new,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "min_p": body.get("min_p"),
        "n": body.get("n"),
        "sampling_seed": body.get("seed"),
        "stop": body.get("stop"),
        "stop_token_ids": body.get("stop_token_ids"),
        "ignore_eos": body.get("ignore_eos"),
        "skip_special_tokens": body.get("skip_special_tokens"),
        "no_stop_trim": body.get("no_stop_trim"),
        "repetition_penalty": body.get("repetition_penalty"),
        "min_new_tokens": body.get("min_tokens"),
    }
    params = parse_sampling({k: v for k, v in sampling.items() if v is not None})
    mode = body.get("sampling_logprobs_mode")
    if mode not in (None, "selected", "support"):
        raise RequestError(f"sampling_logprobs_mode must be 'selected' or 'support', got {mode!r}")
    opts = Options(
        return_logprob=logprobs, top_logprobs_num=top or 0,
        return_sampling_mask=bool(body.get("return_sampling_mask")), support_mode=mode == "support",
        text_in_logprobs=True,
    )  # fmt: skip
    seqs = make_sequences([prompt], [params], opts, info, body.get("rid"))
    flags = {
        "model": body.get("model"),
        "logprobs": logprobs,
        "return_meta_info": bool(body.get("return_meta_info")),
        "return_token_ids": bool(body.get("return_token_ids")),
        "return_prompt_token_ids": bool(body.get("return_prompt_token_ids")),
    }
    return seqs, flags


def _entry(token_id: int, logprob: float, info: EngineInfo) -> dict:
    text = info.token_text(token_id)
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob}


def _choice_logprobs(seq: Sequence, info: EngineInfo) -> dict:
    content = []
    for row in seq.rows:
        entry = _entry(row.token, row.logprob, info)
        tops = zip(row.top_ids or [], row.top_logprobs or [])
        entry["top_logprobs"] = [_entry(t, lp, info) for t, lp in tops]
        content.append(entry)
    return {"content": content}


def chat_response(seqs: list[Sequence], flags: dict, info: EngineInfo, served_model_name: str) -> dict:
    choices = []
    for index, seq in enumerate(seqs):
        finish = seq.finish_reason or {}
        want_prompt_ids = flags["return_token_ids"] or flags["return_prompt_token_ids"]
        choices.append({
            "index": index,
            "message": {"role": "assistant", "content": output_text(seq, info), "reasoning_content": None,
                        "tool_calls": None},
            "logprobs": _choice_logprobs(seq, info) if flags["logprobs"] else None,
            "finish_reason": finish.get("type"),
            "matched_stop": finish.get("matched"),
            "hidden_states": None,
            "prompt_token_ids": seq.prompt_ids if want_prompt_ids else None,
            "response_token_ids": seq.output_ids if flags["return_token_ids"] else None,
            "meta_info": meta_info(seq, info) if flags["return_meta_info"] else None,
        })  # fmt: skip
    prompt_tokens = len(seqs[0].prompt_ids)
    completion = sum(len(s.output_ids) for s in seqs)
    return {
        "id": seqs[0].rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": flags["model"] or served_model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                  "total_tokens": prompt_tokens + completion, "prompt_tokens_details": None},
        "metadata": {"weight_version": seqs[0].weight_version},
    }  # fmt: skip
