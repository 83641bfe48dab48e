"""Weight updates against real SGLang: draining (weight_update drain), /update_weights_from_disk
waits for the generations in flight, so a call that times out on the trainer's side may still be
carried out. The trainer asks the engine which version it serves before calling an update failed.
In-flight updates: tests/trainer_service/test_weight_update.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.processes import http, wait_until
from trainer_service.weights import WeightPublisher

pytestmark = pytest.mark.integration


def test_an_update_that_times_out_while_sglang_finishes_a_generation_counts_once_it_is_served(sglang, model_dir):
    body = {"input_ids": [104, 105], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    generation = threading.Thread(target=lambda: http("POST", sglang.url + "/generate", body, timeout=120))
    generation.start()
    wait_until(
        lambda: http("GET", sglang.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 1, 30, "generation running"
    )

    async def update():
        # far shorter than the generation, which a draining update waits for
        publisher = WeightPublisher(None, [sglang.url], attempts=1, timeout=1.0, mode="drain")
        try:
            return await publisher.update(sglang.url, 5, model_dir)
        finally:
            await publisher.close()

    try:
        assert asyncio.run(update()) is True
        assert sglang.weight_version() == "5"
    finally:
        generation.join()


def test_an_engine_that_restarted_is_sent_the_latest_version_again(sglang, model_dir):
    """A restart makes SGLang serve its initial weights ("default"); the trainer's watch finds it
    behind and loads the latest version into it, and leaves an engine that is current alone."""

    async def scenario():
        publisher = WeightPublisher(None, [sglang.url], attempts=1)
        try:
            assert await publisher.catch_up(sglang.url) is False  # nothing published yet
            assert await publisher.update(sglang.url, 3, model_dir) is True
            publisher.latest = (3, model_dir)  # what publish() records (no NATS here)
            current = await publisher.catch_up(sglang.url)
            await asyncio.to_thread(sglang.stop)
            await asyncio.to_thread(sglang.start)
            restarted = await publisher.serving(sglang.url)
            caught_up = await publisher.catch_up(sglang.url)
            return current, restarted, caught_up, publisher.catch_ups, await publisher.serving(sglang.url)
        finally:
            await publisher.close()

    assert asyncio.run(scenario()) == (False, "default", True, 1, "3")
