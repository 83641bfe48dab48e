"""The torch.distributed process group as the trainer uses it, in one place: this process's
rank and the world size, its device, rank 0's value on every rank (or one value per rank), and
a body run inside the group that torchrun set up (or alone, without torchrun).

Devices (docs/design.md section 6, "Devices"): with CUDA each rank binds the GPU of its
``LOCAL_RANK`` before the group exists (``bind_device``), so ``torch.cuda.current_device()``,
which DDP's ``device_ids``, FSDP2's device mesh and NCCL's object staging read, is the rank's
own GPU, never cuda:0 on every rank. The group is ``cpu:gloo,cuda:nccl``: CUDA tensors go
through NCCL, CPU tensors through gloo, and object collectives (a step's command and shard)
travel through gloo in CPU memory, never staged on a GPU. Without CUDA the group is gloo.

Shards (docs/design.md section 6, "Shards"): rank 0 cuts the step's global batch
(``shared.batch_algebra.assign_shards``, balanced by tokens) and sends each rank only its shard
(``scatter_shards``); a rank never holds the whole batch unless it is rank 0.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.batch_algebra import assign_shards, select_samples
from shared.wire import decode_batch, encode_batch


def in_process_group() -> bool:
    """A process group is up (torchrun, even with one rank)."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    if in_process_group():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    """Rank 0: the rank that does all I/O (NATS, HTTP, files other ranks do not share)."""
    return rank_and_world()[0] == 0


def device() -> str:
    """This rank's device: its GPU (``LOCAL_RANK``) when there are GPUs, else the CPU."""
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"


def backend() -> str:
    """The process group's backend per device type (module docstring)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def bind_device() -> None:
    """With CUDA, make this rank's GPU (``LOCAL_RANK``) the current device; nothing without."""
    if not torch.cuda.is_available():
        return
    local, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if local >= count:
        raise RuntimeError(
            f"LOCAL_RANK={local} but this machine shows {count} GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most {count} ranks per node "
            "(torchrun --nproc-per-node) or make more GPUs visible"
        )
    torch.cuda.set_device(local)


def broadcast_from_main(value):
    """Rank 0's ``value`` on every rank."""
    if rank_and_world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def scatter_from_main(values: list | None):
    """Rank r's item of rank 0's ``values`` (one per rank; other ranks pass None): each rank
    receives its own item only."""
    if rank_and_world()[1] == 1:
        return values[0]
    box = [None]
    dist.scatter_object_list(box, values if is_main() else None, src=0)
    return box[0]


def scatter_shards(cmd):
    """This rank's copy of rank 0's step command ``cmd`` (a dataclass whose ``batch`` is the
    encoded global batch, or None to stop), its ``batch`` replaced by the rank's shard: rank 0
    passes ``cmd``, the other ranks None, and each receives its own shard only."""
    world = rank_and_world()[1]
    if world == 1:
        return cmd
    if not is_main():
        return scatter_from_main(None)
    if cmd.batch is None:
        return scatter_from_main([cmd] * world)
    batch = decode_batch(cmd.batch)
    shards = [select_samples(batch, samples) for samples in assign_shards(batch, world)]
    return scatter_from_main([replace(cmd, batch=encode_batch(s)) for s in shards])


def in_world(body, *, timeout: timedelta | None = None) -> int:
    """Run ``body()`` (every rank's exit code) inside the torchrun process group, if any.

    Every rank binds its device first (``bind_device``). A clean end passes one more barrier,
    then the rank leaves with ``os._exit`` (every group has gloo, for CPU tensors): tearing
    gloo down (``destroy_process_group`` or interpreter exit) while a peer still closes its
    sockets can abort the process in C++ ("terminate called without an active exception",
    SIGABRT; seen once in CI on a run that had finished and committed every step). Past the
    barrier no collective is left, every file was closed and fsynced, so nothing is lost.
    """
    if "WORLD_SIZE" not in os.environ:
        return body()
    bind_device()
    dist.init_process_group(backend(), timeout=timeout)
    try:
        code = body()
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
