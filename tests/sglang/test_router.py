"""sglang-router 0.3.2 (`smg launch`, default settings) in front of the shared SGLang server:
it registers the server from the server's own model directory, and routes native /generate
with K = 128 candidates per token unchanged."""

from __future__ import annotations

import re

import pytest

from tests.processes import http, wait_until

pytestmark = pytest.mark.integration

ANSI = re.compile(r"\x1b\[[0-9;]*m")
VOLATILE = ("id", "e2e_latency", "response_sent_to_client_ts")  # differ between any two requests


def test_router_registers_the_server_with_its_local_tokenizer_and_no_download(sglang, sglang_router, model_dir):
    status, out = http("GET", sglang_router.url + "/workers")
    (worker,) = out["workers"]
    assert (status, worker["url"], worker["is_healthy"], worker["model_id"]) == (200, sglang.url, True, str(model_dir))
    assert worker["metadata"]["model_path"] == worker["metadata"]["served_model_name"] == str(model_dir)
    # the router registers a worker's tokenizer in a workflow of its own, which may end after it routes
    registered = f"Successfully registered tokenizer '{model_dir}'"
    log = wait_until(
        lambda: (lambda text: text if registered in text else None)(ANSI.sub("", sglang_router.log())),
        60,
        "the router's tokenizer registration line",
        sglang_router.proc,
    )
    assert f"Loading tokenizer '{model_dir}' from source: {model_dir}" in log
    assert not [line for line in log.splitlines() if re.search(r"download|huggingface|hf_hub", line, re.I)]


def test_routed_generate_with_k128_equals_a_direct_request(sglang, sglang_router):
    # greedy, and the prompt cached before either request: the two differ only in who sent them
    body = {
        "input_ids": list(b"routed or not"),
        "return_logprob": True,
        "top_logprobs_num": 128,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    assert http("POST", sglang.url + "/generate", body)[0] == 200
    (status, routed), (direct_status, direct) = (
        http("POST", sglang_router.url + "/generate", body),
        http("POST", sglang.url + "/generate", body),
    )
    assert (status, direct_status) == (200, 200), (routed, direct)
    for volatile in VOLATILE:
        routed["meta_info"].pop(volatile), direct["meta_info"].pop(volatile)
    assert routed == direct
    assert [len(row) for row in routed["meta_info"]["output_top_logprobs"]] == [128] * 6


def test_routed_2d_batch_returns_one_object_per_sequence(sglang, sglang_router):
    body = {
        "input_ids": [list(b"one"), list(b"two!")],
        "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},  # a sampled EOS would end a row early
        "return_logprob": True,
        "top_logprobs_num": 128,
    }
    status, out = http("POST", sglang_router.url + "/generate", body)
    assert status == 200 and [o["meta_info"]["prompt_tokens"] for o in out] == [3, 4]
    assert all([len(row) for row in o["meta_info"]["output_top_logprobs"]] == [128, 128] for o in out)


def test_router_drops_the_sampling_mask_fields(sglang, sglang_router):
    """Support mode cannot go through this router (the proxy's probe reports it): it re-serialises
    /generate without return_sampling_mask and sampling_logprobs_mode, so the server, asked
    for no mask, returns none (a request with them straight to the server gets one)."""
    body = {
        "input_ids": list(b"mask"),
        "return_logprob": True,
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "support",
        "sampling_params": {"max_new_tokens": 2, "top_k": 20, "ignore_eos": True},
    }
    status, routed = http("POST", sglang_router.url + "/generate", body)
    assert status == 200 and len(routed["meta_info"]["output_token_logprobs"]) == 2
    assert "output_token_sampling_mask" not in routed["meta_info"]
    assert [
        len(row) for row in http("POST", sglang.url + "/generate", body)[1]["meta_info"]["output_token_sampling_mask"]
    ] == [20, 20]


def test_router_does_not_route_admin_endpoints(sglang, sglang_router, model_dir):
    """Weight updates go to each server directly (the trainer does so); the router has no route for them."""
    body = {"model_path": str(model_dir), "weight_version": "routed"}
    assert http("POST", sglang_router.url + "/update_weights_from_disk", body)[0] == 404
    assert sglang.weight_version() == "default"


def test_router_rejects_chat_min_tokens_below_1_which_sglang_accepts(sglang, sglang_router):
    """sglang-router 0.3.2 validates chat min_tokens as at least 1; SGLang's own default is 0. A
    chat request through the router can state min_tokens only by leaving it out."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "min_tokens": 0}
    status, out = http("POST", sglang_router.url + "/v1/chat/completions", body)
    assert (status, out["error"]["type"], out["error"]["code"]) == (400, "invalid_request_error", 400)
    # the router prints the range as a Rust map, its keys in no fixed order
    assert out["error"]["message"] in (
        'min_tokens: Validation error: range [{"min": Number(1), "value": Number(0)}]',
        'min_tokens: Validation error: range [{"value": Number(0), "min": Number(1)}]',
    )
    assert http("POST", sglang.url + "/v1/chat/completions", body)[0] == 200
    assert (
        http("POST", sglang_router.url + "/v1/chat/completions", {k: v for k, v in body.items() if k != "min_tokens"})[
            0
        ]
        == 200
    )
