"""Atomic training checkpoints: a step is resumable only once its directory is complete.

Layout under ``<run_dir>/checkpoints/``::

    step-000007/          the state after 7 completed steps (steps 0..6)
      model/              HF directory (config.json, model.safetensors, tokenizer files)
      optimizer.pt        full (unsharded) optimizer state, torch.save
      state.json          step, version, data cursor, run id, ledger {task_id: {attempt, step, parts}}
    .tmp-step-000008/     being written; ignored and removed at start-up

A checkpoint is written into ``.tmp-step-N``, every file and the directory fsynced, then
renamed to ``step-N`` and the parent fsynced, so a crash leaves either the old or the new
checkpoint, never half of one. The last ``keep`` checkpoints are kept (``KEEP`` unless the
trainer's ``--keep-checkpoints`` says otherwise). Saving is a
collective (FSDP2 gathers the full state): every rank calls ``save``, rank 0 writes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson
import torch

from trainer_service.distributed import is_main
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


def optimizer_state(model, optimizer) -> dict:
    """The unsharded optimizer state on the CPU (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


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
    if weights_dir is not None:
        if is_main():
            (tmp / "model").mkdir()
            for f in weights_dir.iterdir():
                os.link(f, tmp / "model" / f.name)
    else:
        save_model(model, str(tmp / "model"))
    optim = optimizer_state(model, optimizer)
    if is_main():
        torch.save(optim, tmp / "optimizer.pt")
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


def load_optimizer(path: Path, model, optimizer) -> None:
    """Restore the optimizer state saved in checkpoint ``path`` (every rank reads the file)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
