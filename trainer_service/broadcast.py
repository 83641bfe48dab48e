"""The trainer's end of SGLang's distributed weight update: a process group of two, the trainer
(rank 0) and one engine (rank 1), per engine, and the flattened buckets rank 0 broadcasts in it
(docs/design.md section 8, distributed transport).

SGLang joins such a group on ``POST /init_weights_update_group`` (``init_custom_process_group``
in ``sglang/srt/utils/common.py``: a TCP store at ``master_address:master_port`` served by rank 0,
under the prefix ``group_name``) and receives a bucket on ``POST /update_weights_from_distributed``
with ``load_format: "flattened_bucket"`` (``FlattenedTensorBucket.empty``: the named tensors' bytes
back to back, in the order of ``names``). The same code runs gloo on the CPU and NCCL on CUDA:
only ``backend`` differs, and the tensors' device.

One group per engine, not one for all: an engine that restarts joins again alone, and one that
fails mid-broadcast breaks only its own group. The store is served before the engine is asked to
join, so the engine never waits for a store that is not there; the trainer's side of the join and
each broadcast run on a thread with a deadline (``timeout``) while the HTTP call runs beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world


def group_name(index: int) -> str:
    """The group of the ``index``-th engine: a name that a restarted trainer uses again, so it
    destroys the group a killed one left in the engine before the engine joins anew."""
    return f"centerline_weights_{index}"


@dataclass
class Bucket:
    """Tensors sent in one broadcast: their names, dtypes (``"float32"``), shapes and bytes."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    flat: torch.Tensor  # uint8, the tensors' bytes back to back

    @property
    def nbytes(self) -> int:
        return self.flat.numel()


def buckets(tensors: dict[str, torch.Tensor], limit_bytes: int, device: str = "cpu") -> list[Bucket]:
    """``tensors`` in buckets of at most ``limit_bytes`` (a tensor larger than that travels alone),
    each of one dtype (SGLang's receive bucket wants every tensor aligned to its dtype)."""
    out: list[Bucket] = []
    pending: list[tuple[str, torch.Tensor]] = []

    def close() -> None:
        if pending:
            flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in pending])
            out.append(
                Bucket(
                    [n for n, _ in pending],
                    [str(t.dtype).removeprefix("torch.") for _, t in pending],
                    [list(t.shape) for _, t in pending],
                    flat.to(device),
                )
            )
            pending.clear()

    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if pending and (size + nbytes > limit_bytes or tensor.dtype != pending[0][1].dtype):
            close()
            size = 0
        pending.append((name, tensor))
        size += nbytes
    close()
    return out


class Group:
    """Rank 0 of a two-rank group with one engine. ``serve`` opens the store (the engine may be
    told its port at once), ``join`` completes the group once the engine joins (blocking, up to
    ``timeout``), ``send`` broadcasts one bucket, ``close`` drops the group."""

    def __init__(self, host: str, backend: str, timeout: float, group_name: str):
        self.backend, self.group_name = backend, group_name
        self.timeout = timedelta(seconds=timeout)
        # wait_for_workers=False: the constructor returns at once, the engine connects later
        self.store = dist.TCPStore(host, 0, 2, is_master=True, timeout=self.timeout, wait_for_workers=False)
        self.port = self.store.port
        self.pg = None

    def join(self) -> None:
        # The engine's gloo keys carry the group's name: the trainer's group has the engine's name
        # (names are global in torch.distributed: one per engine, ``group_name``).
        self.pg, _ = _new_process_group_helper(
            2,
            0,
            [],
            self.backend,
            PrefixStore(self.group_name, self.store),
            group_name=self.group_name,
            timeout=self.timeout,
        )
        _world.pg_group_ranks[self.pg] = {0: 0, 1: 1}

    def send(self, bucket: Bucket) -> None:
        dist.broadcast(bucket.flat, src=0, group=self.pg)

    def close(self) -> None:
        if self.pg is not None:
            pg, self.pg = self.pg, None
            try:
                dist.destroy_process_group(pg)
            except (RuntimeError, ValueError, KeyError):  # the group broke: nothing left to tear down
                pass
        self.store = None


def backend_for(device: str) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones."""
    return "nccl" if device.startswith("cuda") else "gloo"
