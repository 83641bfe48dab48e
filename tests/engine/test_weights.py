"""POST /update_weights_from_disk: the next request is served by the new weights."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration

PROMPT = list(b"weights under test")


def test_weight_update_changes_logprobs_and_reported_version(tools, start_engine, model_dir, other_model_dir, reference):
    engine = start_engine(model_dir, "--weight-version", "0")
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True}

    def served():
        status, out = tools.http("POST", engine.url + "/generate", body)
        assert status == 200, out
        return out

    def expected(model, out):
        logits = model(PROMPT + out["output_ids"])[len(PROMPT) - 1 : -1]
        return torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor(out["output_ids"])].tolist()

    before = served()
    assert before["meta_info"]["weight_version"] == "0"
    assert max(abs(a[0] - b) for a, b in zip(before["meta_info"]["output_token_logprobs"], expected(reference.default, before))) < 1e-5

    status, reply = tools.http("POST", engine.url + "/update_weights_from_disk",
                               {"model_path": str(other_model_dir), "weight_version": "1"})  # fmt: skip
    assert status == 200 and reply["success"] is True

    after = served()
    assert after["meta_info"]["weight_version"] == "1"
    new_model = reference(other_model_dir)
    assert max(abs(a[0] - b) for a, b in zip(after["meta_info"]["output_token_logprobs"], expected(new_model, after))) < 1e-5
    assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    status, info = tools.http("GET", engine.url + "/model_info")
    assert info["weight_version"] == "1" and info["model_path"] == str(other_model_dir.resolve())
    assert info["tokenizer_path"] == str(model_dir.resolve())


def test_weight_update_from_a_missing_directory_fails_and_keeps_serving(tools, start_engine, model_dir, tmp_path):
    engine = start_engine(model_dir, "--weight-version", "3")
    status, reply = tools.http("POST", engine.url + "/update_weights_from_disk",
                               {"model_path": str(tmp_path / "nope"), "weight_version": "4"})  # fmt: skip
    assert status == 400 and reply["success"] is False
    status, info = tools.http("GET", engine.url + "/model_info")
    assert info["weight_version"] == "3"
