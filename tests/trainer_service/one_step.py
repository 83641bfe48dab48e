"""Training steps from wire-format batch files, under torchrun or alone: load the model,
``train_step`` on each batch in turn, save the updated model and (rank 0) the steps' metrics as a
JSON list. The harness of test_distributed.py, which compares 1 and 2 ranks.

``--scatter``: rank 0 alone reads the batches and sends each rank its shard the way the
trainer does (``trainer_service.distributed.scatter_shards``). ``--probe DIR``: each rank writes
``DIR/rank-R.json``, what it did towards devices and collectives (``tests.trainer_service.probe``):
the device it bound, the backend it asked for, the device of every tensor of every collective,
and the sample ids it trained. ``--save-each``: the model after each step is also saved, under
``OUT/step-N`` (N from 1), so one launch shows the model at every step.

    torchrun --nproc-per-node 2 -m tests.trainer_service.one_step --model DIR --batch batch.bin --out DIR2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from shared.batch_algebra import assign_shards, select_samples
from shared.wire import decode_batch
from trainer_service.distributed import device, in_world, is_main, rank_and_world, scatter_shards
from trainer_service.model import STRATEGIES, build_model, save_model
from trainer_service.policy import StepCommand
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
    parser.add_argument("--scatter", action="store_true", help="rank 0 sends each rank its shard only")
    parser.add_argument("--probe", help="directory for each rank's record of devices and collectives")
    parser.add_argument("--save-each", action="store_true", help="also save the model after each step, OUT/step-N")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    probe = None
    if args.probe:
        from tests.trainer_service.probe import Probe

        probe = Probe(Path(args.probe))

    def body() -> int:
        model = build_model(args.model, args.strategy, dtype=getattr(torch, args.dtype), device=device())
        optimizer = make_optimizer(model, args.optimizer, args.lr)
        metrics = []
        for path in args.batch:
            if args.scatter:
                cmd = StepCommand(0, 0, False, Path(path).read_bytes() if is_main() else None)
                batch = decode_batch(scatter_shards(cmd if is_main() else None).batch)
            else:
                batch = decode_batch(Path(path).read_bytes())
            if probe is not None:  # the samples this rank trains
                rank, world = rank_and_world()
                probe.trained(
                    batch.sample_ids
                    if args.scatter
                    else select_samples(batch, assign_shards(batch, world)[rank]).sample_ids
                )
            local = {"local": True} if args.scatter else {}  # a shard already
            metrics.append(train_step(model, optimizer, batch, LossSettings(), max_grad_norm=1.0, **local))
            if args.save_each:
                save_model(model, str(Path(args.out) / f"step-{len(metrics)}"))
        save_model(model, args.out)
        if args.metrics and is_main():
            with open(args.metrics, "w") as fh:
                json.dump(metrics, fh)
        if probe is not None:
            probe.write(model)
        return 0

    return in_world(body)


if __name__ == "__main__":
    sys.exit(main())
