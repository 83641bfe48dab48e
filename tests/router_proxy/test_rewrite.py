"""Training requests rewritten to the contract; method-breaking settings refused by field."""

import orjson
import pytest

from router_proxy.rewrite import Contract, RequestRejected, rewrite_body

SELECTED = Contract(k=128, temperature=1.0, top_p=1.0, top_k=-1, mode="selected", endpoint="generate")
SUPPORT = Contract(k=128, temperature=0.7, top_p=0.9, top_k=50, mode="support", endpoint="generate")
# What every training request states besides temperature, top_p and top_k, so that SGLang fills
# nothing from --preferred-sampling-params or the model's generation_config.json.
NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}


def rewrite(body: dict, endpoint: str = "generate", contract: Contract = SELECTED) -> dict:
    return orjson.loads(rewrite_body(orjson.dumps(body), endpoint, contract))


def test_generate_selected_overrides_client_logprob_fields():
    sent = rewrite(
        {
            "text": "hi",
            "return_logprob": False,
            "top_logprobs_num": 20,
            "return_sampling_mask": True,
            "sampling_logprobs_mode": "selected",
            "sampling_params": {"max_new_tokens": 5},
        }
    )
    assert sent == {
        "text": "hi",
        "return_logprob": True,
        "top_logprobs_num": 128,
        "sampling_params": {
            "max_new_tokens": 5,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            **NEUTRAL,
            "min_new_tokens": 0,
        },
    }


def test_generate_support_sets_support_fields_and_drops_top_logprobs():
    sent = rewrite(
        {"input_ids": [1, 2], "top_logprobs_num": 5, "sampling_params": {"temperature": 0.7}}, contract=SUPPORT
    )
    assert sent == {
        "input_ids": [1, 2],
        "return_logprob": True,
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "support",
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "top_k": 50, **NEUTRAL, "min_new_tokens": 0},
    }


def test_chat_selected_overrides_client_logprob_fields():
    sent = rewrite({"messages": [], "logprobs": False, "top_logprobs": 3, "return_meta_info": False}, "chat")
    assert sent == {
        "messages": [],
        "logprobs": True,
        "top_logprobs": 128,
        "return_meta_info": True,
        "return_prompt_token_ids": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        **NEUTRAL,
    }


def test_chat_support_sets_support_fields_without_top_logprobs():
    sent = rewrite({"messages": [], "top_logprobs": 3}, "chat", SUPPORT)
    assert sent == {
        "messages": [],
        "logprobs": True,
        "return_meta_info": True,
        "return_prompt_token_ids": True,
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "support",
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        **NEUTRAL,
    }


def test_matching_sampling_settings_are_accepted():
    sent = rewrite(
        {
            "text": "a",
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0, "repetition_penalty": 1.0},
        }
    )
    assert sent["sampling_params"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, **NEUTRAL, "min_new_tokens": 0}


@pytest.mark.parametrize(
    ("body", "endpoint", "field"),
    [
        ({"text": "a", "sampling_params": {"temperature": 0.5}}, "generate", "sampling_params.temperature"),
        ({"text": "a", "sampling_params": {"top_p": 0.9}}, "generate", "sampling_params.top_p"),
        ({"text": "a", "sampling_params": {"top_k": 20}}, "generate", "sampling_params.top_k"),
        ({"text": "a", "sampling_params": {"min_p": 0.1}}, "generate", "sampling_params.min_p"),
        ({"text": "a", "sampling_params": {"frequency_penalty": 0.5}}, "generate", "sampling_params.frequency_penalty"),
        ({"text": "a", "sampling_params": {"presence_penalty": 0.5}}, "generate", "sampling_params.presence_penalty"),
        (
            {"text": "a", "sampling_params": {"repetition_penalty": 1.1}},
            "generate",
            "sampling_params.repetition_penalty",
        ),
        ({"text": "a", "sampling_params": {"regex": "a+"}}, "generate", "sampling_params.regex"),
        ({"text": "a", "sampling_params": {"json_schema": "{}"}}, "generate", "sampling_params.json_schema"),
        ({"text": "a", "sampling_params": {"logit_bias": {"1": 2.0}}}, "generate", "sampling_params.logit_bias"),
        ({"text": "a", "sampling_params": {"temperature": "1.0"}}, "generate", "sampling_params.temperature"),
        ({"text": "a", "stream": True}, "generate", "stream"),
        ({"text": "a", "sampling_params": {"min_new_tokens": 3}}, "generate", "sampling_params.min_new_tokens"),
        ({"messages": [], "min_tokens": 3}, "chat", "min_tokens"),
        ({"messages": [], "temperature": 0.2}, "chat", "temperature"),
        ({"messages": [], "min_p": 0.05}, "chat", "min_p"),
        ({"messages": [], "presence_penalty": 1.0}, "chat", "presence_penalty"),
        ({"messages": [], "response_format": {"type": "json_object"}}, "chat", "response_format"),
        ({"messages": [], "regex": "a"}, "chat", "regex"),
        ({"messages": [], "stream": True}, "chat", "stream"),
    ],
)
def test_method_breaking_setting_is_rejected_naming_the_field(body, endpoint, field):
    with pytest.raises(RequestRejected) as info:
        rewrite(body, endpoint)
    assert info.value.field == field
    assert info.value.to_dict()["error"]["field"] == field


def test_non_object_body_is_rejected():
    with pytest.raises(RequestRejected) as info:
        rewrite_body(b"[1, 2]", "generate", SELECTED)
    assert info.value.field == "body"


@pytest.mark.parametrize("value", [64, [1, 64], "1000000", True, None, [None, "x"], {"k": 10**6}])
def test_requested_k_within_the_limit_or_not_a_number_is_left_to_the_rewrite(value):
    assert rewrite_body(orjson.dumps({"text": "a", "top_logprobs_num": value}), "generate", SELECTED, max_k=64)


def test_requested_k_above_the_limit_names_field_value_and_limit():
    with pytest.raises(RequestRejected) as info:
        rewrite_body(orjson.dumps({"messages": [], "top_logprobs": 65}), "chat", SELECTED, max_k=64)
    assert info.value.to_dict() == {
        "error": {
            "rule": "request_rejected",
            "field": "top_logprobs",
            "value": 65,
            "limit": 64,
            "message": "top_logprobs: is 65, above the proxy's limit of 64 candidates per token "
            "(--max-top-logprobs-num)",
        }
    }


def test_requested_k_above_the_vocabulary_names_it_and_the_fix():
    # The proxy's limit is min(--max-top-logprobs-num, vocabulary): here the vocabulary.
    with pytest.raises(RequestRejected) as info:
        rewrite_body(
            orjson.dumps({"text": "a", "top_logprobs_num": [8, 300]}), "generate", SELECTED, max_k=260, vocab_size=260
        )
    assert info.value.to_dict() == {
        "error": {
            "rule": "request_rejected",
            "field": "top_logprobs_num",
            "value": 300,
            "limit": 260,
            "message": "top_logprobs_num: K=300 is above the model's vocabulary of 260: SGLang takes its server down "
            "on a top_logprobs_num above the vocabulary, so nothing is sent; lower K to at most 260",
        }
    }


@pytest.mark.parametrize(
    ("preferred", "unstated"),
    [
        (None, []),
        ({"top_k": 20, "min_p": 0.1, "repetition_penalty": 1.2, "max_new_tokens": 64, "stop": ["x"]}, []),
        ('{"top_k": 20, "logit_bias": {"5": 2.0}}', ["logit_bias"]),
        ({"json_schema": "{}", "custom_params": {"a": 1}, "temperature": 0.5}, ["custom_params", "json_schema"]),
    ],
)
def test_probe_names_server_defaults_a_request_cannot_override(preferred, unstated):
    from router_proxy.probe import _unstated_defaults

    assert (
        _unstated_defaults(orjson.dumps({"preferred_sampling_params": preferred, "weight_version": "default"}))
        == unstated
    )
