"""What a rank does towards devices and collectives, recorded by a real gloo run of
``tests.trainer_service.one_step --probe DIR`` (test_devices.py reads it).

The run believes it has one GPU per rank until its process group exists: ``torch.cuda`` says
it is available with ``WORLD_SIZE`` devices and records ``set_device`` instead of binding;
``init_process_group`` records the backend asked for, puts ``torch.cuda`` back, and starts
the real group on gloo (this machine has no NCCL). Every ``torch.distributed`` collective the
run calls from Python is wrapped: the device of each tensor it carries is recorded, and an
object collective records the device torch would stage it on under the backend asked for
(CPU when that backend serves CPU tensors, else the current GPU: cuda:0 unless bound).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

TENSOR_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "scatter",
    "gather",
    "send",
    "recv",
)
OBJECT_COLLECTIVES = ("broadcast_object_list", "scatter_object_list", "all_gather_object", "gather_object", "barrier")


def served(backend: str) -> list[str]:
    """The device types a backend string serves: ``"nccl"`` CUDA only, ``"gloo"`` both,
    ``"cpu:gloo,cuda:nccl"`` what it names."""
    if ":" in backend:
        return sorted(pair.split(":")[0] for pair in backend.split(","))
    return {"nccl": ["cuda"], "gloo": ["cpu", "cuda"]}.get(backend, [])


def tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []


class Probe:
    def __init__(self, out: Path):
        self.out = out
        self.record = {"set_device": [], "backend": None, "collectives": [], "trained": []}
        self._fake_cuda()
        for name in (*TENSOR_COLLECTIVES, *OBJECT_COLLECTIVES):
            self._wrap(name)

    def _fake_cuda(self) -> None:
        saved = {name: getattr(torch.cuda, name) for name in ("is_available", "device_count", "set_device")}
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: int(os.environ.get("WORLD_SIZE", 1))
        torch.cuda.set_device = lambda index: self.record["set_device"].append(torch.device("cuda", index).index)
        real_init = dist.init_process_group

        def init(backend=None, **kwargs):
            self.record["backend"] = backend
            for name, fn in saved.items():
                setattr(torch.cuda, name, fn)
            dist.init_process_group = real_init
            return real_init("gloo", **kwargs)

        dist.init_process_group = init

    def _wrap(self, name: str) -> None:
        real = getattr(dist, name)

        def wrapped(*args, **kwargs):
            if name in OBJECT_COLLECTIVES:
                cpu = "cpu" in served(self.record["backend"] or "gloo")
                bound = self.record["set_device"][-1] if self.record["set_device"] else 0
                devices = ["cpu" if cpu else f"cuda:{bound}"]
            else:
                devices = [str(t.device) for t in tensors([*args, *kwargs.values()])]
            self.record["collectives"].append({"op": name, "devices": devices})
            return real(*args, **kwargs)

        setattr(dist, name, wrapped)

    def trained(self, sample_ids: list[str]) -> None:
        self.record["trained"].append(list(sample_ids))

    def write(self, model) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.record.update(
            rank=rank,
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            param_device=str(next(model.parameters()).device),
        )
        (self.out / f"rank-{rank}.json").write_text(json.dumps(self.record))
