"""SmolLM2-135M-Instruct served by real SGLang behind the real router (smg 0.3.2): the probe, the
proxy's audit of K = 128 rows over its 49152-token vocabulary, and the worker's batches with the
chat template as SGLang renders it and <|im_end|> ending each response."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import aiohttp
import numpy as np
import pytest

from rollout_worker.main import load_tokenizer
from rollout_worker.worker import Worker
from shared import response_arrays
from shared.config import Config
from shared.settings import WorkerSettings
from shared.task import PromptTask
from tests.processes import ENV, REPO, Process, free_port, http, wait_until
from tests.real_model.conftest import IM_END, VOCAB

pytestmark = [pytest.mark.real_model, pytest.mark.integration]

K = 128
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # the model's answer, 8 tokens with <|im_end|>
# Nearly greedy, so the answer above is what each sample says; the contract holds at any temperature.
TEMPERATURE = 0.05


def probe(upstream: str, *flags: str) -> tuple[int, dict]:
    run = subprocess.run(
        [sys.executable, "-m", "centerline", "probe", "--upstream", upstream, "--k", str(K), "--json", *flags],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return run.returncode, json.loads(run.stdout)


def test_probe_at_k128_on_generate_through_the_router_passes_and_learns_the_vocabulary(real_router):
    rc, report = probe(real_router.url, "--endpoint", "generate")
    assert (rc, report["compatible"], report["vocab_size"], report["cause"]) == (0, True, VOCAB, None), report


def test_probe_at_k128_on_chat_through_the_router_is_refused_naming_its_cap_of_20(real_router):
    rc, report = probe(real_router.url, "--endpoint", "chat")
    assert (rc, report["compatible"]) == (1, False)
    assert report["cause"].startswith("router rejects top_logprobs above 20 (chat top_logprobs=128 answered 400")
    assert report["cause"].endswith("use --rollout-endpoint generate or K <= 20")


@pytest.fixture(scope="module")
def proxies(real_router, real_sglang, tmp_path_factory):
    """``{"router": url, "server": url}``: a ready `centerline proxy` in front of the router (native
    /generate) and one in front of the server itself (chat: the router caps it at 20 and drops
    token ids), both sampling at ``TEMPERATURE``."""
    logs = tmp_path_factory.mktemp("proxies")
    started, urls = [], {}
    try:
        for name, upstream in (("router", real_router.url), ("server", real_sglang.url)):
            port = free_port()
            argv = [sys.executable, "-m", "centerline", "proxy", "--upstream", upstream, "--port", str(port)]
            proc = Process([*argv, "--rollout-temperature", str(TEMPERATURE)], logs / f"proxy-{name}.log")
            started.append(proc)
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda url=url: http("GET", url + "/ready", timeout=5)[0] == 200, 180, "proxy", proc.proc)
            urls[name] = url
        yield urls
    finally:
        for proc in started:
            proc.stop()


def test_the_proxy_audits_k128_rows_over_the_49152_token_vocabulary(proxies, real_model):
    url = proxies["router"]
    assert http("GET", url + "/get_model_info")[1]["vocab_size"] == VOCAB
    tokenizer, _ = load_tokenizer(str(real_model), chat_template=True)
    body = {
        "input_ids": tokenizer.encode(QUESTION),
        "sampling_params": {"n": 2, "max_new_tokens": 16, "temperature": TEMPERATURE},
    }
    req = urllib.request.Request(
        url + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Accept": response_arrays.MEDIA_TYPE},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["Content-Type"] == response_arrays.MEDIA_TYPE
        found = response_arrays.decode(resp.read())
    n = int(found.offsets[-1])
    assert found.cand_ids.shape == (n, K) and found.cand_logprobs.shape == (n, K)
    assert all(len(set(row)) == K for row in found.cand_ids.tolist())  # K distinct ids, no empty slot
    assert found.cand_ids.min() >= 0 and found.cand_ids.max() < VOCAB
    assert found.cand_ids.max() > 32768  # rows reach deep into the vocabulary, beyond any toy's
    assert np.isfinite(found.cand_logprobs).all() and (found.cand_logprobs <= 0).all()
    sampled_in_row = (found.cand_ids == found.response_ids[:, None]).any(axis=1)
    assert sampled_in_row.all()  # nearly greedy: each sampled token is among its row's head


def run_worker(proxy_url: str, real_model, endpoint: str, reward: str, answer: str):
    """The worker's own ``process`` of one task (sample through the proxy, score, pack, check the
    contract at the real vocabulary), without NATS."""
    cfg = Config(
        proxy_url=proxy_url,
        rollout_endpoint=endpoint,
        rollout_temperature=TEMPERATURE,
        rollout_max_new_tokens=16,
        rollout_n=2,
    )
    tokenizer, hf = load_tokenizer(str(real_model), chat_template=True)
    worker = Worker(cfg, WorkerSettings(worker_id="test", vocab_size=VOCAB), tokenizer)
    task = PromptTask("t/0/0", "t/0/0", QUESTION, answer, reward, 2, 0)

    async def go():
        async with aiohttp.ClientSession() as session:
            worker.session = session
            return await worker.process(task)

    return asyncio.run(go()), tokenizer, hf


@pytest.mark.parametrize("endpoint", ["generate", "chat"])
def test_the_workers_batch_holds_the_prompt_as_sglang_rendered_it_and_im_end_ends_each_response(
    proxies, real_model, endpoint
):
    """On native /generate the worker renders the chat template; on chat SGLang does and the worker
    trains on SGLang's ids: the same ids either way. Each response ends with <|im_end|>, which is
    trained on (the model learns to stop) and cut from the text the reward reads."""
    url = proxies["router" if endpoint == "generate" else "server"]
    outcome, tokenizer, hf = run_worker(url, real_model, endpoint, "exact", ANSWER)
    (batch,) = outcome.batches
    rendered = tokenizer.encode_chat(QUESTION)
    assert tokenizer.encode(QUESTION) == rendered  # chat_template on: the generate path renders it too
    assert batch.prompt_offsets.tolist() == [0, len(rendered), 2 * len(rendered)]
    assert batch.prompt_ids.tolist() == rendered * 2
    assert hf.decode(rendered).endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    bounds = batch.offsets.tolist()
    responses = [batch.response_ids[a:b].tolist() for a, b in zip(bounds, bounds[1:])]
    # What was sampled is up to SGLang (it ignores seeds on the CPU), so each response is judged by
    # its shape: <|im_end|> only as its last token, or the 16-token budget used up without it.
    for response in responses:
        assert IM_END not in response[:-1], response
        assert response[-1] == IM_END or len(response) == 16, response
    assert batch.loss_mask.tolist() == [1] * sum(map(len, responses))  # <|im_end|> trained on
    # exact match on the text without <|im_end|>: the reward never sees the end-of-turn token
    texts = [hf.decode([t for t in response if t != IM_END]) for response in responses]
    assert batch.rewards.tolist() == [float(text == ANSWER) for text in texts], texts
