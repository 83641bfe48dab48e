"""Atomic training checkpoints: a step is resumable only once its directory is complete.

Layout under ``<run_dir>/checkpoints/``::

    step-000007/          the state after 7 completed steps (steps 0..6)
      model/              HF directory (config.json, model.safetensors, tokenizer files)
      state/              model and optimizer state, torch.distributed.checkpoint: each rank
                          writes its own shards (FSDP2) and reads them back on resume
      state.json          step, version, data cursor, run id, ledger {task_id: {attempt, step, parts}}
    .tmp-step-000008/     being written; ignored and removed at start-up

A checkpoint is written into ``.tmp-step-N``, every file and the directory fsynced, then
renamed to ``step-N`` and the parent fsynced, so a crash leaves either the old or the new
checkpoint, never half of one. The last ``keep`` checkpoints are kept (``KEEP`` unless the
trainer's ``--keep-checkpoints`` says otherwise). Saving is a
collective: every rank calls ``save`` and writes its shards of ``state/``; rank 0 writes the
rest and publishes the directory once every rank's shards are written (the save's last
collective). A checkpoint of an older release holds ``optimizer.pt`` (the full optimizer
state) instead of ``state/``; it is read as before.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer_service.distributed import in_process_group, is_main
from trainer_service.model import save_model

KEEP = 2
PREFIX = "step-"


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and every directory, deepest first."""
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(root))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: Path, final: Path) -> None:
    """Make a fully written ``tmp`` appear as ``final`` in one rename (crash-safe)."""
    fsync_tree(tmp)
    if final.exists():  # a previous attempt at the same step committed; replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def training_state(model, optimizer) -> dict:
    """The model's and the optimizer's state as this rank holds them (its shards under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def save(root: Path, model, optimizer, state: dict, *, weights_dir: Path | None = None, keep: int = KEEP) -> Path:
    """Write checkpoint ``step-{state['step']}``; all ranks call, rank 0 writes and returns its path.

    ``weights_dir``: an HF directory already holding exactly this model (the weights
    version saved this step); its files are hard-linked instead of saved a second time.
    ``keep``: how many complete checkpoints to keep, newest first (0 keeps all).
    """
    final = root / f"{PREFIX}{state['step']:06d}"
    tmp = root / f".tmp-{final.name}"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if in_process_group():
        dist.barrier()  # the directory exists before any rank writes into it
    if weights_dir is not None:
        if is_main():
            (tmp / "model").mkdir()
            for f in weights_dir.iterdir():
                os.link(f, tmp / "model" / f.name)
    else:
        save_model(model, str(tmp / "model"))
    dcp.save(training_state(model, optimizer), checkpoint_id=tmp / "state", no_dist=not in_process_group())
    if is_main():
        (tmp / "state.json").write_bytes(orjson.dumps(state))
        publish_dir(tmp, final)
        for old in complete(root)[:-keep] if keep else []:
            shutil.rmtree(old, ignore_errors=True)
    return final


def complete(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / "state.json").is_file())


def latest(root: Path) -> Path | None:
    found = complete(root)
    return found[-1] if found else None


def remove_partial(root: Path) -> None:
    """Drop ``.tmp-*`` directories a crash left behind (rank 0, at start-up)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)


def load_state(path: Path) -> dict:
    return orjson.loads((path / "state.json").read_bytes())


def load_training_state(path: Path, model, optimizer) -> None:
    """Restore the model and optimizer state of checkpoint ``path`` (every rank calls and reads
    its own shards); an older checkpoint's ``optimizer.pt``: the optimizer state from that file."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict, set_state_dict

    if (path / "optimizer.pt").is_file():
        state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
        return
    state = training_state(model, optimizer)
    dcp.load(state, checkpoint_id=path / "state", no_dist=not in_process_group())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
