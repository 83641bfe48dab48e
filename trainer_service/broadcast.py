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

gloo binds the trainer's end of a group to one network interface, by default the one this host's
name resolves to. On a host with several networks (compose puts the trainer on NATS's network and on
the engines', docs/operations.md) that may be one the engine cannot reach, and the join hangs to
its deadline: the trainer binds the interface its route to the engine leaves by
(``interface_towards``), unless ``GLOO_SOCKET_IFNAME`` says otherwise.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta

import psutil
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


GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"  # read by gloo as a group is made (torch's ProcessGroupGloo)
_binding = threading.Lock()
_joining = 0  # joins under way with the variable set by ``_gloo_interface``


@contextlib.contextmanager
def _gloo_interface(interface: str | None):
    """``GLOO_SOCKET_IFNAME`` set to ``interface`` while groups are being made (several engines
    join at once; each group reads it as it is made, then connects), unless the operator set it;
    removed when the last join ends."""
    global _joining
    with _binding:
        mine = interface is not None and (_joining > 0 or not os.environ.get(GLOO_INTERFACE))
        if mine:
            os.environ.setdefault(GLOO_INTERFACE, interface)
            _joining += 1
    try:
        yield
    finally:
        if mine:
            with _binding:
                _joining -= 1
                if _joining == 0:
                    del os.environ[GLOO_INTERFACE]


def interface_towards(host: str) -> str | None:
    """The name of this machine's network interface that its route to ``host`` (a name or an
    IPv4 address) leaves by; None when ``host`` does not resolve or no interface holds the
    route's source address. No packet is sent: connecting a UDP socket only picks the route."""
    try:
        address = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            source = probe.getsockname()[0]
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == source for a in addresses):
            return name
    return None


class Group:
    """Rank 0 of a two-rank group with one engine. ``serve`` opens the store (the engine may be
    told its port at once), ``join`` completes the group once the engine joins (blocking, up to
    ``timeout``), ``send`` broadcasts one bucket, ``close`` drops the group. ``interface``: the
    network interface gloo binds (``interface_towards`` the engine); None: gloo's own choice."""

    def __init__(self, host: str, backend: str, timeout: float, group_name: str, interface: str | None = None):
        self.backend, self.group_name, self.interface = backend, group_name, interface
        self.timeout = timedelta(seconds=timeout)
        # wait_for_workers=False: the constructor returns at once, the engine connects later
        self.store = dist.TCPStore(host, 0, 2, is_master=True, timeout=self.timeout, wait_for_workers=False)
        self.port = self.store.port
        self.pg = None

    def join(self) -> None:
        # The engine's gloo keys carry the group's name: the trainer's group has the engine's name
        # (names are global in torch.distributed: one per engine, ``group_name``).
        with _gloo_interface(self.interface if self.backend == "gloo" else None):
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
