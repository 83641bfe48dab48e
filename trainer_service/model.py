"""The trained policy as an HF-format causal LM directory: load it, wrap it for
torch.distributed (DDP or FSDP2), save it back so SGLang and the embedded engine load it.

Under FSDP2 on several ranks no rank holds the whole model on its device: rank 0 alone reads
the weights, on the CPU, and sends each rank its slices (``build_model``; docs/design.md
section 6, "Loading"). Nothing is downloaded: directories are read with ``local_files_only=True``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from trainer_service.distributed import in_process_group, is_main, rank_and_world

STRATEGIES = ("ddp", "fsdp2")


def load_model(path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The causal LM in ``path`` (config + safetensors), in training mode."""
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return model.to(device).train()


def build_model(
    path: str,
    strategy: str = "ddp",
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    prepare: Callable = lambda model: model,
):
    """The causal LM in ``path`` as every rank trains it: loaded, ``prepare``d (activation
    checkpointing), wrapped for ``strategy`` (``wrap_model``).

    FSDP2 on several ranks: rank 0 loads the model on the CPU; every rank builds it from the
    config on the meta device, shards it (``fully_shard``) and allocates its own shards on
    ``device``; rank 0 then broadcasts the state dict tensor by tensor and each rank keeps its
    slices (``set_model_state_dict``, ``broadcast_from_rank0``), so no rank other than 0 reads the
    weights and none holds them whole on ``device``. Tied weights stay one parameter. A collective
    there: every rank calls it."""
    if strategy != "fsdp2" or rank_and_world()[1] == 1:
        return wrap_model(prepare(load_model(path, dtype=dtype, device=device)), strategy)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    whole = load_model(path, dtype=dtype) if is_main() else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, local_files_only=True), dtype=dtype)
    if whole is not None:  # rank 0 writes the weight versions: the generation settings of ``path``
        model.generation_config = whole.generation_config
    model = wrap_model(prepare(model.train()), strategy)
    model.to_empty(device=device)
    state = whole.state_dict() if whole is not None else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    broadcast_buffers(model, whole)
    return model


@torch.no_grad()
def broadcast_buffers(model, whole) -> None:
    """Rank 0's values (from ``whole``, its loaded model) of ``model``'s non-persistent buffers
    (rotary ``inv_freq``: not in a state dict, left uninitialised by ``to_empty``) on every rank."""
    for name, buffer in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf in model.get_submodule(owner)._non_persistent_buffers_set:
            if whole is not None:
                buffer.copy_(whole.get_buffer(name))
            dist.broadcast(buffer, src=0)


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
