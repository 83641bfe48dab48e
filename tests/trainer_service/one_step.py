"""Training steps from wire-format batch files, under torchrun or alone: load the model,
``train_step`` on each batch in turn, save the updated model and (rank 0) the steps' metrics as a
JSON list. The harness of test_distributed.py, which compares 1 and 2 ranks.

    torchrun --nproc-per-node 2 -m tests.trainer_service.one_step --model DIR --batch batch.bin --out DIR2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from shared.wire import decode_batch
from trainer_service.distributed import device, in_world, is_main
from trainer_service.model import STRATEGIES, load_model, save_model, wrap_model
from trainer_service.step import LossSettings, make_optimizer, train_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.trainer_service.one_step", description=__doc__)
    parser.add_argument("--model", required=True, help="HF-format model directory to start from")
    parser.add_argument(
        "--batch", required=True, action="append", help="a wire format v2 batch (encode_batch bytes); repeat for steps"
    )
    parser.add_argument("--out", required=True, help="directory for the updated model")
    parser.add_argument("--metrics", help="write the metrics of each step here as a JSON list (rank 0)")
    parser.add_argument("--strategy", default="ddp", choices=STRATEGIES)
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="the model's parameters")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        batches = [decode_batch(Path(path).read_bytes()) for path in args.batch]
        model = wrap_model(load_model(args.model, dtype=getattr(torch, args.dtype), device=device()), args.strategy)
        optimizer = make_optimizer(model, args.optimizer, args.lr)
        metrics = [train_step(model, optimizer, batch, LossSettings(), max_grad_norm=1.0) for batch in batches]
        save_model(model, args.out)
        if args.metrics and is_main():
            with open(args.metrics, "w") as fh:
                json.dump(metrics, fh)
        return 0

    return in_world(body)


if __name__ == "__main__":
    sys.exit(main())
