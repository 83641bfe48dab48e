"""The proxy's limits and what it keeps from the upstream: request body size (413), requested
K (400), the configured K at start-up, and a client's Authorization header (never forwarded)."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys

import pytest

from tests.processes import ENV, REPO

pytestmark = pytest.mark.integration
LIMIT = 4096
FLAGS = [
    "--rollout-top-logprobs-num",
    "8",
    "--vocab-size",
    "300",
    "--max-request-body-bytes",
    str(LIMIT),
    "--max-top-logprobs-num",
    "64",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, kinds):
    logs = tmp_path_factory.mktemp("limits")
    double = kinds.Double(logs / "double.log")
    try:
        proxy = kinds.ProxyProcess(logs / "proxy.log", double.url, *FLAGS)
    except Exception:
        double.stop()
        raise
    yield proxy, double
    proxy.stop()
    double.stop()


def post(url: str, path: str, body: bytes, headers: dict | None = None):
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def padded(size: int) -> bytes:
    """A valid /generate request body of exactly ``size`` bytes."""
    head = b'{"text": "a", "sampling_params": {"max_new_tokens": 1}, "pad": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def raw_exchange(url: str, request: bytes) -> bytes:
    """Send ``request`` on a fresh connection; everything the proxy sends back until it closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_request_body_at_the_limit_is_served(stack):
    proxy, _ = stack
    status, body = post(proxy.url, "/generate", padded(LIMIT))
    assert status == 200, body


def test_request_body_above_the_limit_is_413_naming_the_limit_and_the_flag(stack):
    proxy, double = stack
    before = double.last()
    status, body = post(proxy.url, "/generate", padded(LIMIT + 1))
    assert (status, body) == (
        413,
        {
            "error": {
                "rule": "request_too_large",
                "limit": LIMIT,
                "message": f"the request body is {LIMIT + 1} bytes (Content-Length), above the proxy's limit of "
                f"{LIMIT} bytes (--max-request-body-bytes)",
            }
        },
    )
    assert double.last() == before  # never forwarded


def test_chunked_body_above_the_limit_is_413_once_it_crosses_the_limit(stack):
    proxy, _ = stack
    chunk = b"x" * 1000
    request = (
        b"POST /generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n" % (len(chunk), chunk) * 5
        + b"0\r\n\r\n"
    )
    answer = raw_exchange(proxy.url, request)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n") and b"connection: close" in head
    assert (
        json.loads(body)["error"]["message"]
        == f"the request body exceeds {LIMIT} bytes, above the proxy's limit of {LIMIT} bytes "
        "(--max-request-body-bytes)"
    )


def test_expect_continue_above_the_limit_is_413_before_the_body_is_sent(stack):
    proxy, _ = stack
    answer = raw_exchange(
        proxy.url, b"POST /generate HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 999999\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in answer


@pytest.mark.parametrize(
    "path, body, field, value",
    [
        ("/generate", {"text": "a", "top_logprobs_num": 65}, "top_logprobs_num", 65),
        ("/generate", {"text": ["a", "b"], "top_logprobs_num": [8, 100000]}, "top_logprobs_num", 100000),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 1e9},
            "top_logprobs",
            1e9,
        ),
    ],
)
@pytest.mark.parametrize("evaluation", [False, True], ids=["training", "eval"])
def test_requested_k_above_the_limit_is_400_naming_field_value_and_limit(stack, path, body, field, value, evaluation):
    proxy, double = stack
    before = double.last()
    status, answer = post(proxy.url, path, json.dumps(body).encode(), {"X-Centerline-Eval": "1"} if evaluation else {})
    assert (status, answer) == (
        400,
        {
            "error": {
                "rule": "request_rejected",
                "field": field,
                "value": value,
                "limit": 64,
                "message": f"{field}: is {value}, above the proxy's limit of 64 candidates per token "
                "(--max-top-logprobs-num)",
            }
        },
    )
    assert double.last() == before


def test_requested_k_at_the_limit_passes_an_eval_request_untouched(stack):
    proxy, double = stack
    request = {"text": "a", "top_logprobs_num": 64, "return_logprob": True, "sampling_params": {"max_new_tokens": 1}}
    status, answer = post(proxy.url, "/generate", json.dumps(request).encode(), {"X-Centerline-Eval": "1"})
    assert status == 200 and len(answer["meta_info"]["output_top_logprobs"][0]) == 64
    assert double.last() == request


def test_client_authorization_never_reaches_the_upstream(stack):
    proxy, double = stack
    for headers in (
        {"Authorization": "Bearer engine-admin-key"},
        {"Authorization": "Bearer x", "X-Centerline-Eval": "1"},
    ):
        status, _ = post(
            proxy.url,
            "/generate",
            json.dumps({"text": "a", "sampling_params": {"max_new_tokens": 1}}).encode(),
            headers,
        )
        assert status == 200
        assert "authorization" not in double.last_headers()


def test_a_sessions_routing_key_reaches_the_upstream(stack):
    """smg routes by X-SMG-Routing-Key: the proxy forwards it, so a session's turns can keep to one engine."""
    proxy, double = stack
    body = json.dumps({"text": "a", "sampling_params": {"max_new_tokens": 1}}).encode()
    status, _ = post(proxy.url, "/generate", body, {"X-SMG-Routing-Key": "session-7"})
    assert status == 200 and double.last_headers()["x-smg-routing-key"] == "session-7"


def test_configured_k_above_the_vocabulary_is_503_and_nothing_is_sent(tmp_path, kinds):
    double = kinds.Double(tmp_path / "double.log")
    try:
        proxy = kinds.ProxyProcess(
            tmp_path / "proxy.log", double.url, "--rollout-top-logprobs-num", "16", "--vocab-size", "10"
        )
        try:
            before = double.last()
            status, body = post(proxy.url, "/generate", json.dumps({"text": "a"}).encode())
            assert double.last() == before  # never forwarded
        finally:
            proxy.stop()
    finally:
        double.stop()
    assert (status, body) == (
        503,
        {
            "error": {
                "rule": "k_above_vocab",
                "message": "the proxy's --rollout-top-logprobs-num: K=16 is above the model's vocabulary of 10: SGLang "
                "takes its server down on a top_logprobs_num above the vocabulary, so nothing is sent; lower K to at "
                "most 10, and restart the proxy",
                "expected": 10,
                "found": 16,
            }
        },
    )


def test_configured_k_above_the_limit_refuses_to_start():
    cmd = [
        sys.executable,
        "-m",
        "centerline",
        "proxy",
        "--upstream",
        "http://127.0.0.1:9",
        "--rollout-top-logprobs-num",
        "2048",
    ]
    out = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (
        2,
        "centerline proxy: --rollout-top-logprobs-num 2048: above --max-top-logprobs-num 1024; raise the limit or "
        "lower K",
    )


def test_a_limit_that_is_not_positive_refuses_to_start():
    cmd = [
        sys.executable,
        "-m",
        "centerline",
        "proxy",
        "--upstream",
        "http://127.0.0.1:9",
        "--max-request-body-bytes",
        "0",
    ]
    out = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (
        2,
        "centerline proxy: --max-request-body-bytes 0: must be > 0 (also settable as "
        "CENTERLINE_PROXY_MAX_REQUEST_BODY_BYTES or proxy.max_request_body_bytes in the TOML file)",
    )
