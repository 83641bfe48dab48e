"""POST /update_weights_from_disk with a weight_version: what the trainer does after every step.
The next request is served by the new weights and names the new version; /model_info reports it.
(The ``sglang`` fixture puts the shared server back on ``model_dir`` at "default".)"""

from __future__ import annotations

import pytest
import torch

from tests.processes import http

pytestmark = pytest.mark.integration

PROMPT = list(b"weights under test")
TOL = 5e-5  # greedy (temperature 1 log-probs) from a float32 server; see test_logprobs.py


def served(url: str) -> dict:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True}
    status, out = http("POST", url + "/generate", body)
    assert status == 200, out
    return out


def error_against(logits_of, out: dict) -> float:
    """Largest difference between the served log-probs and log_softmax of ``logits_of``'s logits."""
    ids = out["output_ids"]
    expected = torch.log_softmax(logits_of(PROMPT + ids)[len(PROMPT) - 1 : -1], -1)[
        torch.arange(len(ids)), torch.tensor(ids)
    ]
    return max(abs(lp - float(e)) for (lp, _, _), e in zip(out["meta_info"]["output_token_logprobs"], expected))


def test_initial_weight_version_is_default(sglang, model_dir):
    status, info = http("GET", sglang.url + "/model_info")
    assert (status, info["weight_version"], info["model_path"]) == (200, "default", str(model_dir))
    assert "vocab_size" not in info  # the proxy and the probe need --vocab-size
    assert served(sglang.url)["meta_info"]["weight_version"] == "default"


def test_weight_update_switches_weights_and_the_reported_version(sglang, model_dir, other_model_dir, reference):
    before = served(sglang.url)
    assert error_against(reference.default, before) < TOL
    status, reply = http(
        "POST", sglang.url + "/update_weights_from_disk", {"model_path": str(other_model_dir), "weight_version": "1"}
    )
    assert (status, reply) == (
        200,
        {
            "success": True,
            "message": "Succeeded to update model weights. Weight version updated to 1.",
            "num_paused_requests": 0,
        },
    )
    after = served(sglang.url)
    assert after["meta_info"]["weight_version"] == "1"
    assert error_against(reference(other_model_dir), after) < TOL < error_against(reference.default, after)
    status, info = http("GET", sglang.url + "/model_info")
    assert (info["weight_version"], info["model_path"], info["tokenizer_path"]) == (
        "1",
        str(other_model_dir),
        str(model_dir),
    )


def test_weight_update_from_a_missing_directory_is_400_and_keeps_serving(sglang, tmp_path):
    status, reply = http(
        "POST", sglang.url + "/update_weights_from_disk", {"model_path": str(tmp_path / "nope"), "weight_version": "4"}
    )
    assert (status, reply["success"]) == (400, False)
    assert reply["message"].startswith("Failed to get weights iterator")
    assert sglang.weight_version() == "default"
    assert served(sglang.url)["meta_info"]["weight_version"] == "default"
