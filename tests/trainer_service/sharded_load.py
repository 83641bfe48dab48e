"""FSDP2's load on several ranks, under torchrun: ``build_model`` (rank 0 reads the weights, the
other ranks build the model on the meta device and receive their slices), then a training step;
then the same step on the model loaded whole on every rank and sharded (``wrap_model(load_model())``).
Both with activation checkpointing, applied before sharding as the trainer does (``prepare_model``).
The harness of test_sharded_load.py.

Every rank but 0 is given ``--config-only``, a directory with the model's config and no weights,
for ``build_model``. Each rank writes ``OUT/rank-R.pt``: its local shard of every parameter, its
buffers, whether the tied head and embedding are one parameter, whether activation checkpointing
is on, and how far its peak resident memory grew during ``build_model`` (``ru_maxrss``, bytes).
Rank 0 writes both models after the step (``OUT/sharded/``, ``OUT/whole/``) and both steps'
metrics (``OUT/metrics.json``).

    torchrun --nproc-per-node 2 -m tests.trainer_service.sharded_load --model DIR --config-only DIR2 \
        --batch batch.bin --out OUT
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint.state_dict  # imported before the memory baseline, as the next two
import torch.distributed.fsdp
import transformers.models.llama.modeling_llama  # noqa: F401
from torch.distributed.tensor import DTensor

from shared.wire import decode_batch
from trainer_service.distributed import device, in_world, is_main, rank_and_world
from trainer_service.model import build_model, load_model, save_model, wrap_model
from trainer_service.step import Memory, make_optimizer, prepare_model, train_step


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.trainer_service.sharded_load", description=__doc__)
    parser.add_argument("--model", required=True, help="HF-format model directory")
    parser.add_argument("--config-only", required=True, help="the same model's config.json alone (ranks but 0)")
    parser.add_argument("--batch", required=True, help="a wire format v2 batch")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)

    def step(model, name: str) -> dict:
        metrics = train_step(model, make_optimizer(model, "adamw", 1e-3), decode_batch(Path(args.batch).read_bytes()))
        save_model(model, str(out / name))
        return metrics

    def prepare(model):
        return prepare_model(model, Memory(activation_checkpointing=True))

    def body() -> int:
        rank = rank_and_world()[0]
        before = peak_rss_bytes()
        path = args.model if is_main() else args.config_only
        model = build_model(path, "fsdp2", device=device(), prepare=prepare)
        grown = peak_rss_bytes() - before
        shards = {
            n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()
        }
        torch.save(
            {
                "shards": shards,
                "buffers": {n: b.clone() for n, b in model.named_buffers()},
                "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                "checkpointing": model.is_gradient_checkpointing,
                "rss_grown": grown,
            },
            out / f"rank-{rank}.pt",
        )
        sharded = step(model, "sharded")
        whole = step(wrap_model(prepare(load_model(args.model, device=device())), "fsdp2"), "whole")
        if is_main():
            (out / "metrics.json").write_text(json.dumps({"sharded": sharded, "whole": whole}))
        return 0

    return in_world(body)


if __name__ == "__main__":
    sys.exit(main())
