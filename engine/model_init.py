"""`centerline init-model --out DIR`: write the default small byte-level causal LM.

The directory is a plain HF model (config.json, generation_config.json,
model.safetensors, tokenizer files), so it loads in transformers, in SGLang and in the
embedded engine alike. Weights are random, drawn from `--seed`; the same seed gives the
same bytes. Nothing is downloaded. Left out on purpose (a later issue): `--sft` warm start,
which will train these weights briefly before writing them (see `build_model`).

    centerline init-model --out runs/model --seed 0
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.tokenizer import EOS, IM_END, PAD, SPECIALS, VOCAB_SIZE, save_tokenizer

# ~0.86 M parameters: large enough to have structure, small enough for 2 CPU cores.
HIDDEN = 128
LAYERS = 4
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 384
MAX_POSITIONS = 1024
# Wider than HF's 0.02 so a random model's next-token distributions are peaked enough for
# top-p / top-k filtering to cut a real tail.
INIT_RANGE = 0.15


def special_id(token: str) -> int:
    return 256 + SPECIALS.index(token)


def model_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_RANGE,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=[special_id(EOS), special_id(IM_END)],
        pad_token_id=special_id(PAD),
        torch_dtype="float32",
    )


def build_model(seed: int):
    """A randomly initialised LlamaForCausalLM, a pure function of `seed` (the place a
    warm start will hook in)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(model_config())
    return model.to(torch.float32).eval()


def write_model_dir(out: Path, seed: int) -> Path:
    """Write config, safetensors weights and tokenizer for `seed` into `out`."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model = build_model(seed)
    model.generation_config = GenerationConfig(
        eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id
    )
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(out)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="centerline init-model", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write (created)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    args = parser.parse_args(argv)
    path = write_model_dir(args.out, args.seed)
    print(f"wrote {path} (seed {args.seed}, vocab {VOCAB_SIZE})")
    return 0
