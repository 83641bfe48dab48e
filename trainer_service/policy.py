"""The policy being trained, as every rank holds it: model, optimizer, and what each rank does
for one step (train on the global batch, save the weights version, save the checkpoint).

Rank 0 decides every step and sends each rank its ``StepCommand`` with that rank's shard of
the global batch only (``trainer_service.shards``, balanced by tokens; ``scatter_object_list``:
the encoded shard travels as bytes); the other ranks sit in ``follow_rank0`` and do exactly the same
collectives in the same order. A command without a batch tells them to stop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shared import faults
from shared.settings import TrainerSettings
from shared.wire import decode_batch
from trainer_service import checkpoint
from trainer_service.distributed import device, is_main, rank_and_world, scatter_shards
from trainer_service.model import build_model, unwrap
from trainer_service.schedule import lr_factor, set_lr
from trainer_service.step import Memory, make_optimizer, prepare_model, train_step
from trainer_service.weights import save_version

log = logging.getLogger("centerline.trainer")


@dataclass(frozen=True, slots=True)
class StepCommand:
    step: int  # index of the step being trained (0-based); the checkpoint after it is step + 1
    version: int  # weight version once this step is done
    sync: bool  # write weights version ``version`` this step
    # the global batch, or a rank's shard of it (wire format v2, docs/design.md section 4); None = stop
    batch: bytes | None
    checkpoint: bool = True  # save the checkpoint after this step (``--checkpoint-every``)


class Policy:
    def __init__(self, settings: TrainerSettings, cfg, resume: Path | None):
        """The trainer's ``settings`` whole (``model``: version 0; ``run_dir``: where versions and
        checkpoints go; the step's ``strategy``, ``max_grad_norm``, ``micro_batch_tokens``,
        ``keep_checkpoints``) and the shared ``cfg``; ``resume``: a checkpoint to start from."""
        self.settings, self.initial, self.run_dir = settings, settings.model, settings.run_dir
        torch.manual_seed(cfg.training.seed)
        start = resume / "model" if resume else settings.model
        self.memory = Memory.from_settings(settings)
        self.model = build_model(
            str(start), settings.strategy, device=device(), prepare=lambda model: prepare_model(model, self.memory)
        )
        rank, world = rank_and_world()
        log.info("rank %d of %d trains on %s", rank, world, next(self.model.parameters()).device)
        self.base_lr = cfg.training.learning_rate  # each step's rate: trainer_service/schedule.py
        self.optimizer = make_optimizer(self.model, "adamw", cfg.training.learning_rate)
        if resume is not None:
            checkpoint.load_training_state(resume, self.model, self.optimizer)
        self.loss = cfg.loss  # the loss and its options, whole (shared/settings.py)

    @property
    def world_size(self) -> int:
        return rank_and_world()[1]

    @property
    def vocab_size(self) -> int:
        return int(unwrap(self.model).config.vocab_size)

    def run(self, cmd: StepCommand, state: dict | None = None) -> tuple[dict, Path | None]:
        """Train one step and make it durable. Rank 0 passes the checkpoint ``state``.

        Returns the step's metrics with timings (``train_s``, ``save_s``), and the directory
        of the weight version written this step (None without ``cmd.sync``). The checkpoint
        keeps the metrics too (``state["metrics"]``), so a crash between the checkpoint and
        the metrics line loses no line (``Metrics.recover``)."""
        if is_main():  # each rank gets its shard only; rank 0 keeps its own
            cmd = scatter_shards(cmd)
        lr = self.base_lr * lr_factor(
            cmd.step,
            warmup=self.settings.lr_warmup_steps,
            schedule=self.settings.lr_schedule,
            total=self.settings.steps,
            min_ratio=self.settings.lr_min_ratio,
        )
        set_lr(self.optimizer, lr)
        t0 = time.perf_counter()
        metrics = train_step(
            self.model,
            self.optimizer,
            decode_batch(cmd.batch),
            self.loss,
            max_grad_norm=self.settings.max_grad_norm or None,  # 0: no clipping
            micro_batch_tokens=self.settings.micro_batch_tokens,
            local=True,
            memory=self.memory,
        )
        t1 = time.perf_counter()
        rank0 = is_main()  # failpoints fire on rank 0 only, as in a crash of its machine
        if rank0:
            faults.hit("trainer.train", cmd.step + 1)
        weights = save_version(self.run_dir / "weights", cmd.version, self.model, self.initial) if cmd.sync else None
        if rank0:
            faults.hit("trainer.before_checkpoint", cmd.step + 1)
        state = {**state, "metrics": metrics} if state else {"step": cmd.step + 1}
        if cmd.checkpoint:
            checkpoint.save(
                self.run_dir / "checkpoints",
                self.model,
                self.optimizer,
                state,
                weights_dir=weights,
                keep=self.settings.keep_checkpoints,
            )
        return {**metrics, "lr": lr, "train_s": t1 - t0, "save_s": time.perf_counter() - t1}, weights

    def follow_rank0(self) -> None:
        """Ranks other than 0: run each step rank 0 sends until it sends stop."""
        while (cmd := scatter_shards(None)).batch is not None:
            self.run(cmd)
        dist.barrier()  # leave together: a rank tearing gloo down while another still talks aborts

    def stop(self) -> None:
        if rank_and_world()[1] > 1:
            scatter_shards(StepCommand(-1, -1, False, None))
            dist.barrier()
