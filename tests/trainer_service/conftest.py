"""A tiny seeded causal LM saved as an HF directory, and a valid global batch for it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from centerline.synth import make_batch
from shared.wire import encode_batch

VOCAB = 64  # larger than K = 8, so the proportional tail is exercised


def save_tiny_llama(path, seed: int = 0, tied: bool = False) -> str:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def global_batch(samples: int = 5, tokens_per_sample: int = 6, mode: str = "selected"):
    """A contract-valid batch with varied advantages and one untrained row per sample, as a session's
    template tokens are: loss mask 0, an empty candidate row, sampled log-prob 0."""
    batch = make_batch(
        samples=samples, tokens_per_sample=tokens_per_sample, k=8, vocab_size=VOCAB, mode=mode, seed=3, prompt_len=4
    )
    advantages = np.linspace(-1.0, 1.5, samples).astype(np.float32)
    mask = np.ones(batch.num_tokens, np.uint8)
    untrained = slice(tokens_per_sample - 1, None, tokens_per_sample)
    mask[untrained] = 0
    cand_ids, cand_logprobs, sampled = (
        np.array(a) for a in (batch.cand_ids, batch.cand_logprobs, batch.sampled_logprobs)
    )
    cand_ids[untrained], cand_logprobs[untrained], sampled[untrained] = -1, -np.inf, 0.0
    return replace(
        batch,
        advantages=advantages,
        loss_mask=mask,
        cand_ids=cand_ids,
        cand_logprobs=cand_logprobs,
        sampled_logprobs=sampled,
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    """The distributed tests' directory, tiny model, 5-sample batch file and the model's weights."""
    tmp = tmp_path_factory.mktemp("dist")
    batch_file = tmp / "batch.bin"
    batch_file.write_bytes(encode_batch(global_batch(samples=5)))
    return tmp, tiny_model_dir, batch_file, load_file(Path(tiny_model_dir) / "model.safetensors")
