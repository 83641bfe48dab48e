"""`centerline init-model --out DIR`: write the default small byte-level causal LM.

The directory is a plain HF model (config.json, generation_config.json,
model.safetensors, tokenizer files), so it loads in transformers and in SGLang, on the CPU
and (head dimension 64) in SGLang's GPU attention backends alike. Weights are random, drawn from
`--seed`; the same seed gives the same bytes. Nothing is downloaded. `--sft --task NAME` trains
the weights briefly on a toy task first (`centerline/toy/sft.py`) so RL starts from a policy with
some reward; the settings are recorded in `centerline_model.json`, and a directory already holding a model made with the
same settings is left as it is. `--heldout` prints the warm start's held-out figure at temperature 1
(exact match; a multi-turn task's mean reward, each conversation played as its environment plays
it; `--eval`, its old name, is read for one release); `upper` is the default run's task because its
start is neither "never" nor "always".

    centerline init-model --out runs/model --seed 0
    centerline init-model --sft --task upper --out runs/upper
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from centerline.toy.tokenizer import EOS, IM_END, PAD, SPECIALS, VOCAB_SIZE, save_tokenizer

# ~0.86 M parameters: large enough to have structure, small enough for 2 CPU cores.
HIDDEN = 128
LAYERS = 4
HEADS = 2  # head dimension 64: one that SGLang's GPU attention backends (FlashInfer, FA3) all accept
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


SETTINGS_FILE = "centerline_model.json"


def write_model_dir(out: Path, seed: int, sft=None) -> Path:
    """Write config, safetensors weights and tokenizer for `seed` into `out`, after the
    warm start `sft` (an `centerline.toy.sft.SftSettings`) when given."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model = build_model(seed)
    if sft is not None:
        from centerline.toy.sft import train

        train(model, sft, seed)
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
    parser.add_argument(
        "--sft", action="store_true", help="warm-start on a toy task before writing (centerline/toy/sft.py)"
    )
    parser.add_argument("--task", default=None, help="toy task of the warm start (centerline/toy/dataset.py)")
    parser.add_argument("--sft-steps", type=int, default=0, help="AdamW steps; 0 = the task's default")
    parser.add_argument("--sft-lr", type=float, default=3e-3, help="peak learning rate (linear decay to 0)")
    parser.add_argument(
        "--heldout",
        action="store_true",
        help="after --sft, print held-out exact match at temperature 1 (old name --eval, read for one release)",
    )
    parser.add_argument("--eval", action="store_true", help=argparse.SUPPRESS)  # --heldout's old name
    args = parser.parse_args(argv)
    if args.eval:
        print(f"{parser.prog}: warning: --eval is deprecated; use --heldout", file=sys.stderr)
    sft = None
    if args.sft:
        from centerline.toy.dataset import TASKS
        from centerline.toy.sft import SftSettings, resolved

        if args.task not in TASKS:
            parser.error(f"--sft needs --task, one of {sorted(TASKS)}")
        sft = resolved(SftSettings(task=args.task, steps=args.sft_steps, learning_rate=args.sft_lr))
    settings = {"seed": args.seed, "sft": sft.to_dict() if sft else None}
    record = args.out / SETTINGS_FILE
    if record.exists() and (args.out / "model.safetensors").exists() and json.loads(record.read_text()) == settings:
        # the weights are the settings'; the tokenizer files are this release's (a chat template
        # that learned to render tools reaches a model made before it)
        save_tokenizer(args.out)
        print(f"{args.out} already holds this model ({json.dumps(settings)}); nothing to do")
        return 0
    record.unlink(missing_ok=True)  # a half-written directory must not pass as cached
    path = write_model_dir(args.out, args.seed, sft)
    record.write_text(json.dumps(settings, sort_keys=True) + "\n")
    print(f"wrote {path} (seed {args.seed}, vocab {VOCAB_SIZE}{', sft ' + json.dumps(sft.to_dict()) if sft else ''})")
    if sft is not None and (args.heldout or args.eval):
        from centerline.toy.sft import evaluate, evaluate_calc, evaluate_chat

        if sft.task == "calc":
            print(json.dumps({"task": sft.task, **evaluate_calc(build_model_from(path))}))
        elif sft.form == "chat":
            print(json.dumps({"task": sft.task, "heldout_reward_t1": evaluate_chat(build_model_from(path), sft.task)}))
        else:
            print(json.dumps({"task": sft.task, "heldout_exact_match_t1": evaluate(build_model_from(path), sft.task)}))
    return 0


def build_model_from(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path)).eval()
