"""/v1/chat/completions on real SGLang: OpenAI log-probs plus SGLang's return_meta_info and
return_token_ids, which carry the token ids the proxy's chat audit needs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from tests.processes import http

pytestmark = pytest.mark.integration


def test_chat_logprobs_have_openai_shape_and_equal_meta_info_and_the_reference(sglang, model_dir, reference):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0.6,
        "logprobs": True,
        "top_logprobs": 5,
        "return_meta_info": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    status, out = http("POST", sglang.url + "/v1/chat/completions", body)
    assert status == 200, out
    (choice,) = out["choices"]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tok.encode(
        tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    ids = choice["response_token_ids"]
    assert (choice["prompt_token_ids"], len(ids), choice["finish_reason"]) == (prompt, 4, "length")
    meta = choice["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids
    ref = torch.log_softmax(reference.default(prompt + ids)[len(prompt) - 1 : -1] / 0.6, dim=-1)
    for i, entry in enumerate(choice["logprobs"]["content"]):
        assert set(entry) == {"token", "bytes", "logprob", "top_logprobs"}
        # one token per byte: a token's bytes are its id, whatever UTF-8 makes of them in "token"
        assert entry["bytes"] == ([ids[i]] if ids[i] < 256 else list(tok.decode([ids[i]]).encode()))
        assert entry["logprob"] == meta["output_token_logprobs"][i][0]
        assert abs(entry["logprob"] - float(ref[i, ids[i]])) < 5e-5 / 0.6  # tolerance: test_logprobs.py
        assert [e["logprob"] for e in entry["top_logprobs"]] == [v for v, _, _ in meta["output_top_logprobs"][i]]
        assert len(entry["top_logprobs"]) == 5
    assert out["usage"]["prompt_tokens"] == len(prompt) and out["usage"]["completion_tokens"] == 4
    assert out["metadata"]["weight_version"] == "default"
