"""Multi-turn sessions on SmolLM2-135M-Instruct: its BPE tokenizer and ChatML template (with the
system prompt it injects), K = 128 over its 49152-token vocabulary, through a proxy, smg 0.3.2
and real SGLang; the same checks as the toy model's (tests/rollout_worker/test_session_stack.py)."""

from __future__ import annotations

import sys

import pytest

from tests.processes import Process, free_port, http, wait_until
from tests.real_model.conftest import IM_END, VOCAB
from tests.rollout_worker import session_environments
from tests.rollout_worker.test_session_stack import K, check_three_turns, run_task

pytestmark = [pytest.mark.real_model, pytest.mark.integration]


@pytest.fixture(scope="module")
def proxy_url(real_router, tmp_path_factory):
    """A ready `centerline proxy` at K = 128 in front of the router (native /generate)."""
    port = free_port()
    argv = [sys.executable, "-m", "centerline", "proxy", "--upstream", real_router.url, "--port", str(port)]
    proc = Process([*argv, "--rollout-top-logprobs-num", str(K)], tmp_path_factory.mktemp("proxy") / "proxy.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http("GET", url + "/ready", timeout=5)[0] == 200, 180, "proxy", proc.proc)
        yield url
    finally:
        proc.stop()


def test_a_three_turn_session_on_the_real_model_trains_exactly_the_ids_sglang_returned(
    proxy_url, real_model, monkeypatch
):
    session_environments.RECORDED.clear()
    env = "tests.rollout_worker.session_environments:three_turns"
    outcome, turns, hf = run_task(proxy_url, real_model, env, monkeypatch, vocab=VOCAB)
    check_three_turns(outcome, turns, hf, vocab=VOCAB, im_end=IM_END)
    (batch,) = outcome.batches
    assert batch.cand_ids.max() > 32768  # rows reach deep into the real vocabulary
