"""The probe and the proxy against SGLang set up as real deployments are: an API key on the
server and the router, sampling defaults from the model's generation_config.json and from
--preferred-sampling-params, no vocab_size anywhere, and a K above the vocabulary that would
take the server down. Real SGLang and the real router throughout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import orjson
import pytest

from router_proxy.rewrite import Contract, rewrite_body
from tests.processes import ENV, REPO, Router, SGLangProcess, free_port, http, wait_until

pytestmark = pytest.mark.integration

KEY = "test-upstream-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
VOCAB = 260
# Filters and penalties a real model or deployment sets; every one is overridable by a request.
MODEL_DEFAULTS = {"top_k": 5, "min_p": 0.3, "repetition_penalty": 1.5, "temperature": 0.7, "top_p": 0.8}
PREFERRED = {"top_k": 5, "min_p": 0.3, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5}


@pytest.fixture(scope="module")
def deployment(model_dir, tmp_path_factory):
    """SGLang with --api-key and filtering defaults (model and server), the router with the same key."""
    root = tmp_path_factory.mktemp("deployment")
    model = root / "model"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, **MODEL_DEFAULTS}))
    server = SGLangProcess(
        model, root / "sglang.log", "--api-key", KEY, "--preferred-sampling-params", json.dumps(PREFERRED)
    )
    try:
        router = Router(root / "router.log", [server.url], api_key=KEY)
    except Exception:
        server.stop()
        raise
    yield server, router
    router.stop()
    server.stop()


def probe(upstream: str, *flags: str, env: dict | None = None) -> tuple[int, dict]:
    run = subprocess.run(
        [sys.executable, "-m", "centerline", "probe", "--upstream", upstream, "--json", *flags],
        cwd=REPO,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return run.returncode, json.loads(run.stdout)


def sampled(server: SGLangProcess, path: str, raw: dict, endpoint: str, headers: dict) -> dict:
    """The ``meta_info`` of ``raw`` as the proxy rewrites it (K = 20, unfiltered)."""
    body = rewrite_body(orjson.dumps(raw), endpoint, Contract(20, 1.0, 1.0, -1, "selected", endpoint))
    status, out = http("POST", server.url + path, orjson.loads(body), headers=headers)
    assert status == 200, out
    return out["choices"][0]["meta_info"] if endpoint == "chat" else out["meta_info"]


NATIVE = {"input_ids": [104, 105], "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "ignore_eos": True}


@pytest.mark.parametrize(
    ("path", "endpoint", "raw"), [("/generate", "generate", NATIVE), ("/v1/chat/completions", "chat", CHAT)]
)
def test_training_requests_sample_outside_the_default_top_k(deployment, path, endpoint, raw):
    """The defaults keep every draw among each row's 5 most likely tokens (the next test shows it);
    a training request states top_k -1 and min_p 0, so its draws leave them. The random model
    puts about 0.7 of its mass outside the top 5, so 16 draws all inside would have p < 1e-8."""
    server, _ = deployment
    meta = sampled(server, path, raw, endpoint, AUTH)
    ranks = [
        [c[1] for c in row].index(t[1]) if t[1] in [c[1] for c in row] else len(row)
        for t, row in zip(meta["output_token_logprobs"], meta["output_top_logprobs"])
    ]
    assert len(ranks) == 16 and max(ranks) >= PREFERRED["top_k"], ranks


def test_training_request_log_probs_equal_a_plain_servers_for_the_same_tokens(deployment, sglang, model_dir):
    """No penalty reaches the sampled distribution: the log-prob of each sampled token equals what a
    server without any defaults gives the same sequence (same weights, teacher forcing)."""
    server, _ = deployment
    meta = sampled(server, "/generate", NATIVE, "generate", AUTH)
    out = [t[1] for t in meta["output_token_logprobs"]]
    prompt = NATIVE["input_ids"]
    body = {
        "input_ids": prompt + out,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": len(prompt) - 1,
    }
    status, plain = http("POST", sglang.url + "/generate", body)
    assert status == 200, plain
    forced = plain["meta_info"]["input_token_logprobs"][1:]  # the window's first position has no log-prob
    # input_token_logprobs names the model's pad token (259 here, which a random model samples about
    # once in 260 draws) as id 0, with the pad token's log-prob (docs/sglang.md)
    pad = json.loads((model_dir / "config.json").read_text())["pad_token_id"]
    assert [t[1] for t in forced] == [0 if t == pad else t for t in out]
    # float32 prefill (teacher forcing) and decode differ by ~1e-5; the penalties set here move log-probs by > 1e-2
    assert [t[0] for t in forced] == pytest.approx([t[0] for t in meta["output_token_logprobs"]], abs=5e-5)


def test_a_request_leaving_settings_unset_samples_with_the_server_defaults(deployment):
    """The defect the rewrite removes, shown on the same server: unset settings are filled in."""
    server, _ = deployment
    body = {
        "input_ids": [104, 105],
        "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "temperature": 1.0},
        "return_logprob": True,
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "selected",
    }
    status, out = http("POST", server.url + "/generate", body, headers=AUTH)
    assert status == 200, out
    assert max(len(r) for r in out["meta_info"]["output_token_sampling_mask"]) <= PREFERRED["top_k"]


def test_probe_without_key_names_the_missing_api_key(deployment):
    _, router = deployment
    rc, report = probe(router.url, "--k", "128")
    assert rc == 1
    assert report["checks"][0]["name"] == "upstream reachable" and not report["checks"][0]["ok"]
    assert "CENTERLINE_UPSTREAM_API_KEY" in report["cause"] and "401" in report["cause"]


def test_probe_with_the_key_learns_the_vocabulary_and_passes_through_the_router(deployment):
    _, router = deployment
    rc, report = probe(router.url, "--k", "128", env={"CENTERLINE_UPSTREAM_API_KEY": KEY})
    assert (rc, report["compatible"], report["vocab_size"]) == (0, True, VOCAB), report


def test_proxy_with_its_upstream_key_becomes_ready_and_never_shows_the_key(deployment, tmp_path):
    _, router = deployment
    port = free_port()
    log = tmp_path / "proxy.log"
    cmd = [sys.executable, "-m", "centerline", "proxy", "--upstream", router.url, "--port", str(port)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env={**ENV, "CENTERLINE_UPSTREAM_API_KEY": KEY}, stdout=open(log, "wb"), stderr=subprocess.STDOUT
    )
    try:
        url = f"http://127.0.0.1:{port}"
        status, ready = wait_until(
            lambda: (lambda r: r if r[0] == 200 else None)(http("GET", url + "/ready", timeout=5)),
            120,
            "proxy ready",
            proc,
        )
        assert ready["ready"] is True
        assert http("GET", url + "/get_model_info")[1]["vocab_size"] == VOCAB
        body = {"input_ids": [104, 105], "sampling_params": {"max_new_tokens": 4}}
        status, out = http("POST", url + "/generate", body)
        assert status == 200 and len(out["meta_info"]["output_top_logprobs"][0]) == 128
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    assert KEY not in log.read_text()


def test_probe_refuses_k_above_the_vocabulary_before_sending_anything(sglang):
    rc, report = probe(sglang.url, "--k", "300")
    assert rc == 1
    failed = [c for c in report["checks"] if not c["ok"]]
    assert [c["name"] for c in failed] == ["K within the vocabulary"]
    assert "K=300" in report["cause"] and f"vocabulary of {VOCAB}" in report["cause"]
    assert http("GET", sglang.url + "/health", timeout=5)[0] == 200  # the server is alive


def test_proxy_refuses_a_client_k_above_the_vocabulary_and_the_server_lives(sglang, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "centerline", "proxy", "--upstream", sglang.url, "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=open(tmp_path / "proxy.log", "wb"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http("GET", url + "/liveness", timeout=5)[0] == 200, 60, "proxy", proc)
        body = {
            "input_ids": [104],
            "sampling_params": {"max_new_tokens": 2},
            "return_logprob": True,
            "top_logprobs_num": 300,
        }
        status, out = http("POST", url + "/generate", body, headers={"X-Centerline-Eval": "1"})
        assert status == 400
        assert out["error"]["field"] == "top_logprobs_num" and out["error"]["limit"] == VOCAB
        assert "vocabulary of 260" in out["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    assert http("GET", sglang.url + "/health", timeout=5)[0] == 200


@pytest.fixture
def proxy_to(tmp_path):
    """``proxy_to(upstream)``: a `centerline proxy` process in front of ``upstream``, live; stopped after the test."""
    procs = []

    def start(upstream: str) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "centerline", "proxy", "--upstream", upstream, "--port", str(port)]
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=ENV, stdout=open(tmp_path / f"proxy{len(procs)}.log", "wb"), stderr=subprocess.STDOUT
        )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http("GET", url + "/liveness", timeout=5)[0] == 200, 60, "proxy", proc)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=15)


def test_a_request_sglang_refuses_keeps_its_400_and_sglangs_message(sglang, proxy_to):
    """Deterministic refusals are not upstream failures: retried, they would be refused again."""
    url = proxy_to(sglang.url)
    status, out = http("POST", url + "/generate", {"input_ids": [104] * 1100, "sampling_params": {"max_new_tokens": 2}})
    assert status == 400
    assert out["error"]["rule"] == "upstream_refused" and out["error"]["found"] == 400
    assert "1100" in out["error"]["message"] and "context length" in out["error"]["message"].lower(), out


def test_a_response_the_engine_cut_below_its_budget_is_never_passed(sglang, proxy_to):
    """SGLang lowers max_new_tokens to what its context leaves after the prompt (its scheduler keeps a
    token more than its tokenizer manager checks), answers 200 and a length finish at the lowered
    budget: a response cut short by the engine, which the proxy blocks, naming both budgets."""
    body = {"input_ids": [104] * 1000, "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}
    status, direct = http("POST", sglang.url + "/generate", body)
    assert status == 200 and direct["meta_info"]["finish_reason"] == {"type": "length", "length": 22}, direct
    assert direct["meta_info"]["completion_tokens"] == 22
    status, out = http("POST", proxy_to(sglang.url) + "/generate", body)
    assert status == 502, out
    assert (out["error"]["rule"], out["error"]["expected"], out["error"]["found"]) == ("length_clipped", 24, 22)
    fits = {"input_ids": [104] * 1000, "sampling_params": {"max_new_tokens": 22, "ignore_eos": True}}
    status, out = http("POST", proxy_to(sglang.url) + "/generate", fits)
    assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 22}, out


def test_an_aborted_sample_is_never_passed_as_a_training_response(sglang, proxy_to):
    """SGLang answers an aborted request with 200 and the output so far; the proxy blocks it."""
    import threading

    url = proxy_to(sglang.url)
    answer = {}
    body = {"input_ids": [104, 105], "rid": "to-abort", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    thread = threading.Thread(target=lambda: answer.update(reply=http("POST", url + "/generate", body, timeout=120)))
    thread.start()
    # abort the request once SGLang runs it: repeat until the answer came back
    wait_until(
        lambda: http("POST", sglang.url + "/abort_request", {"rid": "to-abort"})[0] == 200 and not thread.is_alive(),
        60,
        "abort",
    )
    thread.join()
    status, out = answer["reply"]
    assert status == 502 and out["error"]["rule"] == "sample_aborted" and out["error"]["sample"] == 0, out


def test_chat_training_responses_carry_the_prompt_ids_sglang_rendered(sglang, proxy_to, model_dir):
    """The worker trains on these ids, not on its own rendering of the chat template."""
    from transformers import AutoTokenizer

    from router_proxy.sglang_response import prompt_token_ids

    url = proxy_to(sglang.url)
    messages = [{"role": "user", "content": "hello"}]
    status, out = http(
        "POST", url + "/v1/chat/completions", {"model": "default", "messages": messages, "max_tokens": 3, "n": 2}
    )
    assert status == 200, out
    rendered = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert prompt_token_ids(out) == rendered
    assert [c["prompt_token_ids"] for c in out["choices"]] == [rendered, rendered]
    assert out["choices"][0]["meta_info"]["prompt_tokens"] == len(rendered)


def test_probe_of_chat_checks_the_prompt_ids_come_back(sglang):
    rc, report = probe(sglang.url, "--k", "20", "--endpoint", "chat")
    assert rc == 0, report
    assert [c["name"] for c in report["checks"] if c["name"] == "prompt ids returned"] == ["prompt ids returned"]


def test_a_restarted_server_samples_as_version_0_whatever_it_served_before(sglang, proxy_to, model_dir):
    """SGLang forgets its weight version on a restart ("default") and serves its --model-path again:
    the trainer's initial weights. The worker records them as version 0, never as the last one."""
    from tests.json_samples import samples_from_response

    status, reply = http(
        "POST", sglang.url + "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "7"}
    )
    assert status == 200 and reply["success"], reply
    logged = len(sglang.log())
    sglang.stop()
    # stopped with its process group, the server either drains on its own SIGTERM or, when its
    # scheduler exits first, takes that exit for a crash (SIGQUIT); which comes first is up to
    # the OS. On the crash path the CPU recipe turns off the diagnostics it would sleep 5 s for
    # (docs/sglang.md).
    stopping = sglang.log()[logged:]
    assert "SIGQUIT received" in stopping or "Gracefully exiting" in stopping, stopping[-3000:]
    assert "before crash diagnostics" not in stopping, stopping[-3000:]
    sglang.start()
    url = proxy_to(sglang.url)
    status, out = http(
        "POST", url + "/generate", {"input_ids": [104, 105], "sampling_params": {"max_new_tokens": 3, "n": 2}}
    )
    assert status == 200, out
    assert [item["meta_info"]["weight_version"] for item in out] == ["default", "default"]
    samples = samples_from_response(out, endpoint="generate", mode="selected", k=128)
    assert [s.weight_version for s in samples] == [0, 0]
