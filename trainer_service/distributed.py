"""The torch.distributed process group as the trainer uses it, in one place: this process's
rank and the world size, its device, rank 0's value on every rank, and a body run inside the
group that torchrun set up (or alone, without torchrun).
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


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


def broadcast_from_main(value):
    """Rank 0's ``value`` on every rank."""
    if rank_and_world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def in_world(body, *, timeout: timedelta | None = None) -> int:
    """Run ``body()`` (every rank's exit code) inside the torchrun process group, if any.

    A clean end passes one more barrier, then a gloo rank leaves with ``os._exit``: tearing
    gloo down (``destroy_process_group`` or interpreter exit) while a peer still closes its
    sockets can abort the process in C++ ("terminate called without an active exception",
    SIGABRT; seen once in CI on a run that had finished and committed every step). Past the
    barrier no collective is left, every file was closed and fsynced, so nothing is lost.
    """
    if "WORLD_SIZE" not in os.environ:
        return body()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
    try:
        code = body()
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    if dist.get_backend() != "gloo":
        dist.destroy_process_group()
        return code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
