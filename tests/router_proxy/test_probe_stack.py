"""The probe and the proxy's readiness against real SGLang 0.5.23, directly and behind sglang-router 0.3.2."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def probe(url: str, k: int, endpoint: str, mode: str, vocab: int) -> tuple[int, dict]:
    cmd = [
        sys.executable,
        "-m",
        "centerline",
        "probe",
        "--upstream",
        url,
        "--k",
        str(k),
        "--endpoint",
        endpoint,
        "--mode",
        mode,
        "--vocab-size",
        str(vocab),
        "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize(
    ("endpoint", "mode"), [("generate", "selected"), ("generate", "support"), ("chat", "selected"), ("chat", "support")]
)
def test_every_configuration_is_compatible_directly_against_sglang(sglang_stack, endpoint, mode):
    rc, report = probe(sglang_stack.server, 128, endpoint, mode, sglang_stack.vocab)
    assert (rc, report["compatible"], report["cause"]) == (0, True, None)


def test_router_native_unfiltered_k128_is_compatible(sglang_stack):
    rc, report = probe(sglang_stack.router, 128, "generate", "selected", sglang_stack.vocab)
    assert (rc, report["compatible"]) == (0, True)


def test_router_chat_k128_is_reported_as_rejecting_top_logprobs_above_20(sglang_stack):
    rc, report = probe(sglang_stack.router, 128, "chat", "selected", sglang_stack.vocab)
    assert rc == 1 and report["cause"].startswith("router rejects top_logprobs above 20")


def test_router_chat_k20_is_reported_as_dropping_token_ids(sglang_stack):
    rc, report = probe(sglang_stack.router, 20, "chat", "selected", sglang_stack.vocab)
    assert rc == 1 and report["cause"].startswith("drops token ids on chat")


@pytest.mark.parametrize("endpoint", ["generate", "chat"])
def test_router_support_mode_is_reported_as_dropping_sampling_logprobs_mode(sglang_stack, endpoint):
    rc, report = probe(sglang_stack.router, 20 if endpoint == "chat" else 128, endpoint, "support", sglang_stack.vocab)
    cause = report["cause"]
    assert rc == 1
    assert cause.startswith("drops sampling_logprobs_mode/return_sampling_mask") or cause.startswith(
        "drops token ids on chat"
    )


def test_probe_table_names_the_cause(sglang_stack):
    cmd = [
        sys.executable,
        "-m",
        "centerline",
        "probe",
        "--upstream",
        sglang_stack.router,
        "--k",
        "128",
        "--endpoint",
        "chat",
        "--vocab-size",
        str(sglang_stack.vocab),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert (
        "FAIL  request accepted" in done.stdout and "INCOMPATIBLE: router rejects top_logprobs above 20" in done.stdout
    )


CONFIGS = {
    "native_selected": (["--rollout-top-logprobs-num", "128"], True, None),
    "chat_k128": (
        ["--rollout-top-logprobs-num", "128", "--rollout-endpoint", "chat"],
        False,
        "router rejects top_logprobs above 20",
    ),
    "native_support": (
        ["--rollout-top-logprobs-num", "128", "--rollout-logprobs-mode", "support", "--rollout-top-k", "40"],
        False,
        "drops sampling_logprobs_mode/return_sampling_mask",
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_proxy_readiness_behind_the_router(sglang_stack, start, kinds, name):
    flags, ready, cause = CONFIGS[name]
    proxy = start(kinds.ProxyProcess, sglang_stack.router, *flags, "--vocab-size", str(sglang_stack.vocab))
    status, body = proxy.wait_probed(120)
    assert (status, body["ready"]) == ((200, True) if ready else (503, False))
    if cause:
        assert body["cause"].startswith(cause)
        assert cause in proxy.log()
    else:
        status, response = kinds.http(
            "POST",
            proxy.url + "/generate",
            {"text": "ab", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
        )
        assert status == 200 and [len(r) for r in response["meta_info"]["output_top_logprobs"]] == [128] * 4
