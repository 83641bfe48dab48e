"""The real sglang-router (0.3.2, `smg launch`) registers the engine and routes /generate."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ANSI = re.compile(r"\x1b\[[0-9;]*m")
VOLATILE = ("id", "e2e_latency")  # differ between any two requests


def smg_binary() -> str:
    path = Path(sys.executable).parent / "smg"
    found = str(path) if path.exists() else shutil.which("smg")
    assert found, "sglang-router==0.3.2 (the `smg` binary) is required"
    return found


@pytest.fixture(scope="module")
def router(tools, engine, tmp_path_factory):
    port, metrics_port = tools.free_port(), tools.free_port()
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    cmd = [smg_binary(), "launch", "--worker-urls", engine.url, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(metrics_port), "--prometheus-host", "127.0.0.1", "--policy", "round_robin",
           "--disable-circuit-breaker", "--disable-health-check", "--log-level", "info"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=tools.env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def worker_registered():
        status, out = tools.http("GET", url + "/workers", timeout=2)
        return status == 200 and any(w["url"] == engine.url and w["is_healthy"] for w in out["workers"])

    try:
        tools.wait_until(worker_registered, 60, "router worker registration", proc)
        yield url, log_path
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_router_registers_the_engine_with_its_local_tokenizer(tools, router, engine, model_dir):
    url, log_path = router
    status, out = tools.http("GET", url + "/workers")
    (worker,) = [w for w in out["workers"] if w["url"] == engine.url]
    assert worker["metadata"]["model_path"] == str(model_dir.resolve())
    assert worker["model_id"] == model_dir.name
    log = ANSI.sub("", log_path.read_text())
    assert f"from source: {model_dir.resolve()}" in log
    assert "Successfully registered tokenizer" in log
    assert not [line for line in log.splitlines() if re.search(r"download|huggingface|hf_hub", line, re.I)]


def test_routed_generate_with_k128_equals_a_direct_request(tools, router, engine):
    url, _ = router
    body = {"input_ids": list(b"routed or not"), "return_logprob": True, "top_logprobs_num": 128,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.8, "sampling_seed": 42, "ignore_eos": True}}  # fmt: skip
    status, routed = tools.http("POST", url + "/generate", body)
    assert status == 200, routed
    status, direct = tools.http("POST", engine.url + "/generate", body)
    assert status == 200, direct
    for volatile in VOLATILE:
        routed["meta_info"].pop(volatile), direct["meta_info"].pop(volatile)
    assert routed == direct
    assert all(len(row) == 128 for row in routed["meta_info"]["output_top_logprobs"])


def test_routed_2d_batch_returns_one_object_per_sequence(tools, router):
    url, _ = router
    body = {"input_ids": [list(b"one"), list(b"two!")], "sampling_params": {"max_new_tokens": 2, "sampling_seed": 1},
            "return_logprob": True, "top_logprobs_num": 128}  # fmt: skip
    status, out = tools.http("POST", url + "/generate", body)
    assert status == 200 and [o["meta_info"]["prompt_tokens"] for o in out] == [3, 4]
