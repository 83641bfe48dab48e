"""In-flight weight updates against real SGLang (trainer_service/weights.py, docs/design.md,
weight updates): the trainer pauses the engine, loads the version with its weight_version and
continues it, so a generation in flight goes on and its answer says which version sampled which
tokens (``meta_info.weight_versions``); a trainer killed between pause and continue leaves the
engine to the watchdog of ``centerline sglang``, which continues it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from router_proxy.versions import token_versions
from tests.processes import ENV, REPO, http, wait_until
from trainer_service.weights import WeightPublisher

pytestmark = pytest.mark.integration

TOKENS = 1000  # long enough on the CPU engine that the update lands mid-generation


def generate_across_an_update(url: str, update) -> tuple[dict, float]:
    """One generation of TOKENS tokens with ``update()`` run while it is in flight: its
    meta_info and the seconds the update took."""
    answer: dict = {}
    body = {
        "input_ids": [104, 105],
        "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True},
        "return_logprob": True,
    }
    generation = threading.Thread(target=lambda: answer.update(http("POST", url + "/generate", body, timeout=300)[1]))
    generation.start()
    wait_until(lambda: http("GET", url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 1, 30, "generation running")
    t0 = time.perf_counter()
    update()
    took = time.perf_counter() - t0
    generation.join()
    return answer["meta_info"], took


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_an_update_mid_generation_lands_at_once_and_the_answer_has_two_spans(sglang, model_dir, mode):
    async def update():
        publisher = WeightPublisher(None, [sglang.url], attempts=1, mode=mode)
        try:
            return await publisher.update(sglang.url, 7, model_dir)
        finally:
            await publisher.close()

    loaded = []
    meta, took = generate_across_an_update(sglang.url, lambda: loaded.append(asyncio.run(update())))
    assert loaded == [True] and sglang.weight_version() == "7"
    assert took < 10, f"{mode}: the update waited {took:.1f} s, as long as the generation (it drained)"
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "7"], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == TOKENS, spans
    assert 0 < spans[0]["end"] < TOKENS, spans
    assert meta["weight_version"] == "7" and meta["completion_tokens"] == TOKENS
    # what the proxy reads out of it for the batch: each token's version
    versions = token_versions([meta])
    assert versions.tolist() == [0] * spans[0]["end"] + [7] * (TOKENS - spans[0]["end"])


def test_drain_waits_for_the_generation_and_its_answer_has_one_span(sglang, model_dir):
    async def update():
        publisher = WeightPublisher(None, [sglang.url], attempts=1, mode="drain")
        try:
            return await publisher.update(sglang.url, 8, model_dir)
        finally:
            await publisher.close()

    meta, _ = generate_across_an_update(sglang.url, lambda: asyncio.run(update()))
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": TOKENS}]
    assert sglang.weight_version() == "8"


KILLED_TRAINER = """
import asyncio, sys
from pathlib import Path
from trainer_service.weights import WeightPublisher

async def main():
    publisher = WeightPublisher(None, [sys.argv[1]], attempts=1, mode="in_place")
    await publisher.update(sys.argv[1], 9, Path(sys.argv[2]))

asyncio.run(main())
"""


def test_a_trainer_killed_between_pause_and_continue_leaves_the_engine_to_the_watchdog(sglang, model_dir):
    """The failpoint kills the process that paused the engine before it loads or continues; the
    engine stays paused (/ready 503, the generation in flight held) until the watchdog of
    ``centerline sglang`` continues it after its --continue-after (10 s); the generation then
    finishes under the old weights, which the engine still serves."""
    answer: dict = {}
    body = {"input_ids": [104, 105], "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True}}
    generation = threading.Thread(
        target=lambda: answer.update(http("POST", sglang.url + "/generate", body, timeout=300)[1])
    )
    generation.start()
    wait_until(
        lambda: http("GET", sglang.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 1, 30, "generation running"
    )
    trainer = subprocess.run(
        [sys.executable, "-c", KILLED_TRAINER, sglang.url, str(model_dir)],
        cwd=REPO,
        env={**ENV, "CENTERLINE_FAILPOINTS": "trainer.weights_paused@9=kill"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    paused_at = time.monotonic()
    assert trainer.returncode == -9, trainer.stderr
    assert "failpoint trainer.weights_paused at step 9: kill" in trainer.stderr
    assert http("GET", sglang.url + "/ready")[0] == 503  # paused, nobody to continue it
    wait_until(lambda: http("GET", sglang.url + "/ready")[0] == 200, 30, "the watchdog continuing the engine")
    assert 8 < time.monotonic() - paused_at < 20
    generation.join()
    assert answer["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": TOKENS}]
    assert sglang.weight_version() == "default"
    # the watchdog logs its /continue_generation once answered, after the engine is ready again
    wait_until(
        lambda: (
            "centerline sglang watchdog: " in sglang.log() and "sent /continue_generation, HTTP 200" in sglang.log()
        ),
        30,
        "the watchdog's /continue_generation line",
    )
