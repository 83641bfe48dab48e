"""SGLang 0.5.23's own JSON contract types (`sglang/api/v1/api_types.py`, loaded standalone)
accept the request shapes this project sends and decode what the real server answers.

Gaps in those types, checked against the server in test_logprobs.py instead:
`GenerateRequest` has no `sampling_logprobs_mode` (it lives in `srt/managers/io_struct.py`),
and `GenerateMetaInfo` has no `output_token_sampling_mask` / `output_token_sampling_logprobs`.
`ListModelsResponse` describes SGLang's native `{"models": [...]}`, not the OpenAI
`/v1/models` list, so only its `ModelCard` applies.
"""

from __future__ import annotations

import pytest

from tests.processes import http

pytestmark = pytest.mark.integration

PROMPT = list(b"refereed")
# what sglang-router 0.3.2 adds to every /generate it re-serialises (../shared/reference/sglang-protocol.md)
ROUTER_FIELDS = {
    "model": None,
    "background": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
    "return_text_in_logprobs": False,
}
REQUESTS = {
    "1-D ids": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}},
    "2-D ids": {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": {"max_new_tokens": 2, "n": 2}},
    "text": {"text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    "text list": {"text": ["a", "bc"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]},
    "top-K log-probs": {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 3,
            "top_p": 0.9,
            "top_k": 50,
            "min_p": 0.01,
            "stop_token_ids": [256],
            "ignore_eos": False,
        },
        "return_logprob": True,
        "top_logprobs_num": 128,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
        "rid": "req-1",
    },
    "support mode": {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 2, "top_k": 20},
        "return_logprob": True,
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "support",
    },
    "router re-serialised": {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 2},
        "return_logprob": True,
        "top_logprobs_num": 128,
        **ROUTER_FIELDS,
    },
}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_request_shapes_pass_sglangs_contract_and_responses_decode(sglang, api_types, name):
    body = REQUESTS[name]
    api_types.GenerateRequest.from_json_value(body)
    status, out = http("POST", sglang.url + "/generate", body)
    assert status == 200, out
    for item in out if isinstance(out, list) else [out]:
        response = api_types.GenerateResponse.from_json_value(item)
        meta = response.meta_info
        assert (meta.id, meta.weight_version) == (item["meta_info"]["id"], "default")
        assert response.output_ids == item["output_ids"] and meta.completion_tokens == len(item["output_ids"])
        if body.get("return_logprob"):
            assert [e.token_id for e in meta.output_token_logprobs] == item["output_ids"]
            assert meta.output_token_logprobs_length == len(item["output_ids"])


def test_unknown_sampling_param_is_400_with_sglangs_contract_error(sglang, api_types):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "bogus": 1}}
    with pytest.raises(api_types.JsonContractError) as expected:
        api_types.GenerateRequest.from_json_value(body)
    assert str(expected.value).startswith("unknown field `bogus`, expected one of `max_new_tokens`, `stop`")
    # a plain string under "error", unlike the {"error": {"message": ...}} of the scheduler's refusals
    assert http("POST", sglang.url + "/generate", body) == (400, {"error": str(expected.value)})


def test_unknown_top_level_field_is_ignored(sglang):
    status, out = http(
        "POST",
        sglang.url + "/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "something_new": {"x": 1}},
    )
    assert status == 200 and len(out["output_ids"]) == 2


def test_info_endpoints_decode_with_sglangs_types(sglang, model_dir, api_types):
    for path in ("/model_info", "/get_model_info"):
        status, out = http("GET", sglang.url + path)
        info = api_types.GetModelInfoResponse.from_json_value(out)
        assert (status, info.is_generation, info.weight_version) == (200, True, "default")
        assert info.model_path == info.tokenizer_path == str(model_dir)
    for path in ("/server_info", "/get_server_info"):
        status, out = http("GET", sglang.url + path)
        info = api_types.GetServerInfoResponse.from_json_value(out)
        assert (status, info.tokenizer_path, out["version"]) == (200, str(model_dir), "0.5.23")
    status, out = http("GET", sglang.url + "/v1/models")
    card = api_types.ModelCard.from_json_value(out["data"][0])
    assert (status, out["object"], card.id, card.root, card.max_model_len) == (
        200,
        "list",
        str(model_dir),
        str(model_dir),
        1024,
    )
