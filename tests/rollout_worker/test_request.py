"""The training request a worker sends (the proxy adds the log-prob fields)."""

from __future__ import annotations

from rollout_worker.worker import Tokenizer, Worker
from shared.config import Config
from shared.settings import WorkerSettings
from shared.task import PromptTask

TASK = PromptTask(task_id="t/0/0", group_id="g", prompt="up ab=", answer="AB", reward="exact", n=4, step=0)


def worker(**cfg) -> Worker:
    return Worker(
        Config(**cfg),
        WorkerSettings(worker_id="w", vocab_size=260),
        Tokenizer(lambda p: list(p.encode()), lambda p: list(p.encode())),
    )


def test_native_request_is_one_generate_call_with_n_samples_and_the_configured_sampling():
    body = worker(rollout_max_new_tokens=12).request_body(TASK, [117, 112])
    assert body == {
        "input_ids": [117, 112],
        "sampling_params": {"n": 4, "max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0},
    }


def test_filtered_request_carries_top_k_and_top_p():
    body = worker(rollout_top_k=8, rollout_top_p=0.9, rollout_logprobs_mode="support").request_body(TASK, [1])
    assert body["sampling_params"]["top_k"] == 8 and body["sampling_params"]["top_p"] == 0.9


def test_chat_request_sends_the_prompt_as_the_user_turn():
    body = worker(rollout_endpoint="chat").request_body(TASK, [1])
    assert body["messages"] == [{"role": "user", "content": "up ab="}] and body["n"] == 4 and body["max_tokens"] == 16
