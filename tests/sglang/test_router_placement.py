"""Where the real SGLang router (smg 0.3.2), as `centerline up` runs it (``router_argv``: ``--policy
manual --assignment-mode min_group``), puts sessions: two real SGLang servers, the shared one and
the one that counts its requests (``--enable-metrics``), native /generate with
``X-SMG-Routing-Key`` as the proxy forwards a session's key (docs/design.md section 12)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from centerline.bench.sessions import engine_requests
from tests.processes import Router, http

pytestmark = pytest.mark.integration

SESSIONS, TURNS = 8, 3


def turn(router_url: str, session: int, input_ids: list[int], max_new_tokens: int) -> dict:
    """One turn of ``session``: its whole history as input ids, its key in the header."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True},
    }
    status, out = http("POST", router_url + "/generate", body, headers={"X-SMG-Routing-Key": f"session-{session}"})
    assert status == 200, out
    return out


def test_sessions_in_flight_are_spread_evenly_and_each_stays_on_its_engine(sglang, keyed_sglang, tmp_path):
    router = Router(tmp_path / "router.log", [sglang.url, keyed_sglang.url])
    try:
        # every first turn at once, each sampling long enough to be in flight while the others are
        # placed: min_group puts each new key on the engine with fewer keys in flight, so 4 and 4
        before = engine_requests(keyed_sglang.url)
        prompts = [[ord("a") + s, *b" said the session"] for s in range(SESSIONS)]
        with ThreadPoolExecutor(SESSIONS) as pool:
            firsts = list(pool.map(lambda s: turn(router.url, s, prompts[s], 32), range(SESSIONS)))
        assert engine_requests(keyed_sglang.url) - before == SESSIONS // 2

        # the later turns, one at a time: the counting engine counts a turn exactly when it holds the
        # turn's session, and each turn finds all its history cached but the last sampled token (whose
        # KV no forward pass wrote), which only the engine of the session's earlier turns holds
        on_counting_engine = []
        for s in range(SESSIONS):
            history = prompts[s] + firsts[s]["output_ids"]
            counted = []
            for _ in range(1, TURNS):
                before = engine_requests(keyed_sglang.url)
                out = turn(router.url, s, history + list(b" and"), 4)
                counted.append(engine_requests(keyed_sglang.url) - before)
                assert out["meta_info"]["cached_tokens"] == len(history) - 1
                history = history + list(b" and") + out["output_ids"]
            assert counted in ([0] * (TURNS - 1), [1] * (TURNS - 1))
            on_counting_engine.append(counted[0])
        assert sum(on_counting_engine) == SESSIONS // 2
    finally:
        router.stop()
