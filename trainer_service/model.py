"""The trained policy as an HF-format causal LM directory: load it, wrap it for
torch.distributed (DDP or FSDP2), save it back so SGLang and the embedded engine load it.

Nothing is downloaded: directories are read with ``local_files_only=True``.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from trainer_service.distributed import in_process_group, is_main

STRATEGIES = ("ddp", "fsdp2")


def load_model(path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The causal LM in ``path`` (config + safetensors), in training mode."""
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return model.to(device).train()


def wrap_model(model, strategy: str = "ddp"):
    """DDP or FSDP2 (``fully_shard`` on each decoder layer, then the root) when a process
    group is up; the model itself otherwise. Both average gradients over ranks, which
    ``trainer_service.step`` compensates for."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}; expected one of {STRATEGIES}")
    if not in_process_group():
        return model
    if strategy == "ddp":
        device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def unwrap(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def full_state_dict(model) -> dict:
    """Unsharded parameters on the CPU. A collective under FSDP2: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_model(model, path: str) -> None:
    """Write ``model`` as an HF directory at ``path`` (rank 0 writes; all ranks must call)."""
    state = full_state_dict(model)
    if is_main():
        unwrap(model).save_pretrained(path, state_dict=state)
