"""The proxy as a process in front of the upstream double: rewrite, audit verdicts, eval pass-through, admin 403."""

import json
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.integration
K = ["--rollout-top-logprobs-num", "128"]


def http(method, url, body=None):
    req = urllib.request.Request(
        url,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def post(url: str, body: dict, headers: dict | None = None):
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


@pytest.fixture
def double(start, kinds):
    return start(kinds.Double)


@pytest.fixture
def proxy(start, double, kinds):
    """The proxy once its first capability probe is over: the probe's own requests to the double
    would otherwise take an answer a test set with ``double.next``."""
    proxy = start(kinds.ProxyProcess, double.url, *K)
    proxy.wait_probed()
    return proxy


def test_compatible_upstream_makes_the_proxy_ready(proxy):
    status, body = proxy.wait_probed()
    assert (status, body["ready"], body["cause"]) == (200, True, None)


def test_training_request_is_rewritten_and_its_valid_response_passes(proxy, double):
    status, body, headers = post(
        proxy.url + "/generate",
        {"text": "a", "top_logprobs_num": 5, "return_logprob": False, "sampling_params": {"max_new_tokens": 3}},
    )
    assert status == 200 and headers["x-centerline-audit"] == "ok"
    assert len(body["meta_info"]["output_top_logprobs"]) == 3
    sent = double.last()
    assert (sent["return_logprob"], sent["top_logprobs_num"], sent["sampling_params"]["temperature"]) == (
        True,
        128,
        1.0,
    )


def test_method_breaking_setting_gets_400_naming_the_field(proxy, double):
    status, body, _ = post(proxy.url + "/generate", {"text": "a", "sampling_params": {"min_p": 0.1}})
    assert status == 400 and body["error"]["field"] == "sampling_params.min_p"


def test_eval_request_passes_untouched(proxy, double):
    request = {
        "text": "a",
        "top_logprobs_num": 3,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0.3},
    }
    status, body, headers = post(proxy.url + "/generate", request, {"X-Centerline-Eval": "1"})
    assert status == 200 and "x-centerline-audit" not in headers
    assert double.last() == request
    assert [len(r) for r in body["meta_info"]["output_top_logprobs"]] == [3, 3]


@pytest.mark.parametrize(
    "path",
    [
        "/update_weights_from_disk",
        "/flush_cache",
        "/pause_generation",
        "/continue_generation",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/abort_request",
        "/init_weights_update_group",
        "/shutdown",
        "/workers",
        "/workers/abc",
    ],
)
def test_admin_path_is_forbidden(proxy, path):
    status, body = http("POST", proxy.url + path, {})
    assert status == 403 and body["error"]["rule"] == "admin_forbidden"


def test_truncating_upstream_gets_502_short_row_per_request(start, kinds):
    double = start(kinds.Double, "--truncate", "20")
    proxy = start(kinds.ProxyProcess, double.url, *K)
    status, body, _ = post(proxy.url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 3}})
    assert status == 502
    error = body["error"]
    assert (error["rule"], error["row"], error["expected"], error["found"]) == ("short_row", 0, 128, 20)
    status, ready = proxy.wait_probed()
    assert status == 503 and ready["cause"].startswith("truncates candidate rows to 20 (expected 128)")


def test_observe_mode_passes_a_defect_with_a_verdict_header(start, kinds):
    double = start(kinds.Double, "--truncate", "20")
    proxy = start(kinds.ProxyProcess, double.url, *K, "--proxy-audit-mode", "observe")
    status, body, headers = post(proxy.url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(body["meta_info"]["output_top_logprobs"][0]) == 20
    assert headers["x-centerline-audit"] == "fail; rule=short_row; sample=0; row=0; expected=128; found=20"


GARBAGE = [
    "{",
    "[1,2",
    '{"meta_info": {"output_token_logprobs": [["NaN", 3, null]]}}',
    '{"meta_info": {}}',
    "null",
    '{"meta_info": {"output_token_logprobs": [[-0.5, "3", null]]}}',
    '"just a string"',
    "[]",
]


def test_malformed_upstream_bodies_are_502_with_a_rule_in_enforce_mode(proxy, double):
    for text in GARBAGE:
        double.next(text)
        status, body, _ = post(proxy.url + "/generate", {"text": "a"})
        assert (status, body["error"]["rule"]) == (502, "malformed_response"), text


def test_upstream_error_status_is_502_upstream_status(proxy, double):
    double.next('{"error": {"message": "boom"}}', status=500)
    status, body, _ = post(proxy.url + "/generate", {"text": "a"})
    assert (status, body["error"]["rule"], body["error"]["found"]) == (502, "upstream_status", 500)


def test_metrics_count_requests_and_verdicts(proxy, double):
    post(proxy.url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2}})
    double.next("{")
    post(proxy.url + "/generate", {"text": "a"})
    with urllib.request.urlopen(proxy.url + "/metrics") as resp:
        text = resp.read().decode()
    assert 'centerline_proxy_requests_total{endpoint="generate",kind="training"} 2.0' in text
    assert 'centerline_proxy_audit_verdicts_total{verdict="ok"} 1.0' in text
    assert 'centerline_proxy_audit_verdicts_total{verdict="malformed_response"} 1.0' in text
    assert "centerline_proxy_added_latency_seconds_count 2.0" in text


# ---------------------------------------------------------------------------- the binary answer

ACCEPT_ARRAYS = {"Accept": "application/x-centerline-arrays"}


def post_raw(url: str, body: dict, headers: dict | None = None) -> tuple[int, str, bytes, dict]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read(), dict(exc.headers)


def test_a_plain_client_gets_sglangs_bytes_and_an_arrays_client_the_same_response_as_arrays(proxy, double):
    from centerline.synth import native_response
    from router_proxy import answer
    from shared import response_arrays

    upstream = native_response(5, 128, 300).decode()
    request = {"text": "a", "sampling_params": {"max_new_tokens": 5}}
    double.next(upstream)
    status, ctype, plain, _ = post_raw(proxy.url + "/generate", request, {"Accept": "application/json, */*"})
    assert (status, ctype, plain) == (200, "application/json; charset=utf-8", upstream.encode())  # the double's
    double.next(upstream)
    status, ctype, binary, headers = post_raw(proxy.url + "/generate", request, ACCEPT_ARRAYS)
    assert (status, ctype, headers["x-centerline-audit"]) == (200, "application/x-centerline-arrays", "ok")
    found = response_arrays.decode(binary)
    expected = answer.from_body(plain, "generate", mode="selected", k=128)
    assert (found.texts, found.weight_versions, found.finish_reasons) == (["xxxxx"], [0], ["length"])
    for name in response_arrays.ARRAYS:
        assert getattr(found, name).tobytes() == getattr(expected, name).tobytes(), name


def test_a_failing_audit_is_the_same_json_502_whatever_the_client_accepts(start, kinds):
    double = start(kinds.Double, "--truncate", "20")
    proxy = start(kinds.ProxyProcess, double.url, *K)
    request = {"text": "a", "sampling_params": {"max_new_tokens": 3}}
    plain = post_raw(proxy.url + "/generate", request)
    binary = post_raw(proxy.url + "/generate", request, ACCEPT_ARRAYS)
    assert plain[:3] == binary[:3] and plain[:2] == (502, "application/json")
    assert json.loads(binary[2])["error"]["rule"] == "short_row"


def test_an_eval_request_accepting_arrays_still_passes_untouched_as_json(proxy, double):
    request = {"text": "a", "top_logprobs_num": 3, "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    status, ctype, body, headers = post_raw(
        proxy.url + "/generate", request, {"X-Centerline-Eval": "1", **ACCEPT_ARRAYS}
    )
    assert (status, ctype, "x-centerline-audit" in headers) == (200, "application/json; charset=utf-8", False)
    assert double.last() == request and len(json.loads(body)["meta_info"]["output_top_logprobs"]) == 2


def test_observe_mode_hands_an_arrays_client_the_defective_arrays_with_the_verdict(start, kinds):
    from shared import response_arrays

    double = start(kinds.Double, "--truncate", "20")
    proxy = start(kinds.ProxyProcess, double.url, *K, "--proxy-audit-mode", "observe")
    status, ctype, body, headers = post_raw(
        proxy.url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2}}, ACCEPT_ARRAYS
    )
    assert (status, ctype) == (200, "application/x-centerline-arrays")
    assert headers["x-centerline-audit"].startswith("fail; rule=short_row")
    found = response_arrays.decode(body)
    assert found.cand_ids.shape == (2, 128) and (found.cand_ids[:, 20:] == -1).all()
