"""The distributed weight transport and the proof of an engine's weights against real SGLang
(trainer_service/transport.py, proof.py; docs/design.md section 8): a version broadcast in
buckets lands mid-generation under the retract pause with its label, the engine's
/weights_checker checksum is the one the trainer computes for the version, weights loaded behind
the trainer's back are caught, and a trainer killed mid-broadcast leaves the engine to the
watchdog and a dead group that the next trainer replaces."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import torch

from tests.processes import ENV, REPO, http, wait_until
from tests.trainer_service.test_weight_update import TOKENS, generate_across_an_update
from trainer_service import proof
from trainer_service.weights import WeightPublisher

pytestmark = pytest.mark.integration

BUCKET = 1 << 20  # the toy model's 3.6 MB in four buckets


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, make_model):
    """Weights unlike the served ones (seed 1): a version that really changes the engine."""
    return make_model(tmp_path_factory.mktemp("other") / "seed1", 1)


def publisher(url: str, **kwargs) -> WeightPublisher:
    return WeightPublisher(None, [url], attempts=1, transport="distributed", bucket_bytes=BUCKET, **kwargs)


def engine_checksum(url: str) -> dict:
    status, reply = http("POST", url + "/weights_checker", {"action": "checksum"})
    assert status == 200, reply
    return reply


def test_the_trainers_checksum_of_a_version_is_the_engines(sglang, model_dir):
    """SGLang's own hashing over the fused, padded layout the engine holds: equal, tensor by tensor."""
    expected = proof.checksums(proof.load_tensors(model_dir), torch.float32)
    reply = engine_checksum(sglang.url)
    assert proof.differing(expected, reply) == []
    assert proof.engine_checksum(expected) == reply["per_engine_checksum"]
    assert len(expected) == 27  # embed, 4 x (qkv, o, gate_up, down, 2 norms), norm, lm_head


def test_a_broadcast_version_lands_mid_generation_and_is_proved(sglang, other_model):
    loaded, figures = [], {}

    async def update():
        engines = publisher(sglang.url)
        try:
            engines.latest = (7, other_model)
            loaded.append(await engines.update(sglang.url, 7, other_model))
            figures.update(engines.figures())
        finally:
            await engines.close()

    meta, took = generate_across_an_update(sglang.url, lambda: asyncio.run(update()))
    assert loaded == [True] and sglang.weight_version() == "7"
    assert figures == {"weights_verified": 1, "weight_mismatches": 0, "weight_fallbacks": 0}
    assert took < 10, f"the update waited {took:.1f} s, as long as the generation (it drained)"
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "7"], spans
    assert 0 < spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == TOKENS, spans
    expected = proof.checksums(proof.load_tensors(other_model), torch.float32)
    assert proof.differing(expected, engine_checksum(sglang.url)) == []


def test_weights_loaded_behind_the_trainers_back_are_caught_and_relabelled(sglang, model_dir, other_model):
    async def run():
        engines = publisher(sglang.url)
        try:
            engines.latest = (3, other_model)
            assert await engines.update(sglang.url, 3, other_model)
            assert engines.figures()["weights_verified"] == 1
            # anyone with the admin key loads other weights under the version's label
            status, reply = http(
                "POST", sglang.url + "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "3"}
            )
            assert status == 200 and reply["success"], reply
            caught = await engines.reprove(sglang.url)
            serving = sglang.weight_version()
            figures = engines.figures()
            caught_up = await engines.catch_up(sglang.url)  # the watcher loads the version again
            return caught, serving, figures, caught_up, engines.figures()
        finally:
            await engines.close()

    caught, serving, figures, caught_up, after = asyncio.run(run())
    assert caught is False and serving == proof.UNTRUSTED
    assert figures == {"weights_verified": 0, "weight_mismatches": 1, "weight_fallbacks": 0}
    assert caught_up is True and sglang.weight_version() == "3"
    assert after == {"weights_verified": 1, "weight_mismatches": 1, "weight_fallbacks": 0}


KILLED_TRAINER = """
import asyncio, sys
from pathlib import Path
from trainer_service.weights import WeightPublisher

async def main():
    engines = WeightPublisher(None, [sys.argv[1]], attempts=1, transport="distributed", bucket_bytes=1 << 20)
    await engines.update(sys.argv[1], 9, Path(sys.argv[2]))

asyncio.run(main())
"""


def test_a_trainer_killed_mid_broadcast_leaves_no_engine_paused_nor_in_a_dead_group(sglang, other_model):
    """Killed after the first bucket: the engine's call fails as its peer's sockets close, the
    watchdog of ``centerline sglang`` continues it (--continue-after 10 s), and the next trainer
    destroys the dead group, joins a new one and sends its version."""
    trainer = subprocess.run(
        [sys.executable, "-c", KILLED_TRAINER, sglang.url, str(other_model)],
        cwd=REPO,
        env={**ENV, "CENTERLINE_FAILPOINTS": "trainer.broadcast@9=kill"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    killed_at = time.monotonic()
    assert trainer.returncode == -9, trainer.stderr
    assert "failpoint trainer.broadcast at step 9: kill" in trainer.stderr
    wait_until(lambda: http("GET", sglang.url + "/ready")[0] == 200, 30, "the watchdog continuing the engine")
    assert time.monotonic() - killed_at < 20

    async def next_trainer():
        engines = publisher(sglang.url)
        try:
            engines.latest = (10, other_model)
            return await engines.update(sglang.url, 10, other_model), engines.figures()
        finally:
            await engines.close()

    assert asyncio.run(next_trainer()) == (True, {"weights_verified": 1, "weight_mismatches": 0, "weight_fallbacks": 0})
    assert sglang.weight_version() == "10"
