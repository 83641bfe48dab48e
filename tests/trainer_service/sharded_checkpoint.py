"""A sharded checkpoint under torchrun: train a step, save the checkpoint (each rank its own
shards), train a second step; then a fresh model and optimizer restored from the checkpoint
train the same second step. Writes both models (``straight/``, ``resumed/``). The harness of
test_checkpoint.py's multi-rank test.

    torchrun --nproc-per-node 2 -m tests.trainer_service.sharded_checkpoint --model DIR --batch b.bin --out DIR2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.wire import decode_batch
from trainer_service import checkpoint
from trainer_service.distributed import device, in_world
from trainer_service.model import STRATEGIES, build_model, save_model
from trainer_service.step import make_optimizer, train_step


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.trainer_service.sharded_checkpoint", description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="fsdp2", choices=STRATEGIES)
    args = parser.parse_args()
    out = Path(args.out)

    def fresh():
        model = build_model(args.model, args.strategy, device=device())
        return model, make_optimizer(model, "adamw", 1e-3)

    def body() -> int:
        batch = decode_batch(Path(args.batch).read_bytes())
        model, optimizer = fresh()
        train_step(model, optimizer, batch)
        saved = checkpoint.save(out / "checkpoints", model, optimizer, {"step": 1})
        train_step(model, optimizer, batch)
        save_model(model, str(out / "straight"))
        resumed, resumed_optimizer = fresh()
        checkpoint.load_training_state(saved, resumed, resumed_optimizer)
        train_step(resumed, resumed_optimizer, batch)
        save_model(resumed, str(out / "resumed"))
        return 0

    return in_world(body)


if __name__ == "__main__":
    sys.exit(main())
