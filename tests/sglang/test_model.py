"""The default model `centerline init-model` makes, which SGLang serves in these tests and in
`centerline up`: deterministic, offline, HF-format, byte-level, a vocabulary beyond K = 128."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.processes import init_model

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.mark.integration  # the command in a new interpreter
def test_init_model_is_byte_identical_for_the_same_seed(model_dir, tmp_path):
    """The command, in a new interpreter, writes what the session's fixtures made in-process."""
    again = init_model(tmp_path / "again", seed=0)
    for name in FILES:
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_init_model_weights_differ_for_another_seed(model_dir, other_model_dir):
    assert (model_dir / "model.safetensors").read_bytes() != (other_model_dir / "model.safetensors").read_bytes()
    assert (model_dir / "tokenizer.json").read_bytes() == (other_model_dir / "tokenizer.json").read_bytes()


def test_tokenizer_loads_offline_with_one_token_per_byte(model_dir):
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tok) == 260
    assert tok.encode("hé\n", add_special_tokens=False) == [104, 195, 169, 10]
    assert tok.decode([104, 195, 169, 10]) == "hé\n"
    assert tok.eos_token_id == 256
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [258]


def test_model_is_a_small_llama_with_a_vocabulary_beyond_k128(model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    n_params = sum(p.numel() for p in model.parameters())
    assert (model.config.model_type, model.config.vocab_size, model.config.eos_token_id) == ("llama", 260, [256, 258])
    assert 300_000 <= n_params <= 3_000_000
    assert next(model.parameters()).dtype == torch.float32
