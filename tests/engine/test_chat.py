"""/v1/chat/completions: OpenAI shape plus SGLang's return_meta_info / input_ids / return_token_ids."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

pytestmark = pytest.mark.integration


def test_chat_logprobs_have_openai_shape_and_match_meta_info(tools, engine, model_dir, reference):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.6,
            "seed": 3, "logprobs": True, "top_logprobs": 5, "return_meta_info": True, "return_token_ids": True,
            "ignore_eos": True}  # fmt: skip
    status, out = tools.http("POST", engine.url + "/v1/chat/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tok.encode(tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False))
    assert choice["prompt_token_ids"] == prompt
    ids = choice["response_token_ids"]
    assert len(ids) == 4 and choice["finish_reason"] == "length"
    meta = choice["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids
    logits = reference.default(prompt + ids)[len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits / 0.6, dim=-1)
    for i, entry in enumerate(choice["logprobs"]["content"]):
        assert set(entry) == {"token", "bytes", "logprob", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert abs(entry["logprob"] - float(ref[i, ids[i]])) < 1e-5
        assert [e["logprob"] for e in entry["top_logprobs"]] == [v for v, _, _ in meta["output_top_logprobs"][i]]
        assert len(entry["top_logprobs"]) == 5
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 4, "total_tokens": len(prompt) + 4,
                            "prompt_tokens_details": None}  # fmt: skip
    assert out["metadata"] == {"weight_version": "0"}


def test_chat_accepts_pretokenized_input_ids(tools, engine):
    body = {"input_ids": [104, 105], "max_completion_tokens": 2, "temperature": 0, "return_token_ids": True,
            "top_k": 5, "min_p": 0.0}  # fmt: skip
    status, chat = tools.http("POST", engine.url + "/v1/chat/completions", body)
    status2, native = tools.http("POST", engine.url + "/generate",
                                 {"input_ids": [104, 105], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})  # fmt: skip
    assert status == status2 == 200
    assert chat["choices"][0]["response_token_ids"] == native["output_ids"]
