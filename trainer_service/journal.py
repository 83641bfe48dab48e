"""The trained batches of the steps since the last checkpoint, so a restart trains them again
(docs/design.md section 10, "Checkpoints every N steps").

With ``--checkpoint-every N`` a step that does not checkpoint writes its record before its
batches are acked: ``<run_dir>/journal/step-000008.bin``, step index 7's parts (each part's
stream sequence and wire bytes, in arrival order) and the task publisher's cursor after it,
msgpack, written to a temporary name, fsynced and renamed. A restart loads the last checkpoint
(step c) and trains the records of steps c, c+1, ... again, in order, from the very batches
they trained on; their ledger entries come back with them, so the ledger agrees with the
weights. A checkpoint removes the records it covers. A record past a gap (its predecessor
missing) is never trained: the chain stops at the first step it lacks.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgpack

from shared.wire import decode_batch
from trainer_service.checkpoint import fsync_dir
from trainer_service.ledger import HeldPart

PREFIX = "step-"


def path_of(root: Path, step: int) -> Path:
    """The record of step index ``step`` (the state after it is ``step + 1``)."""
    return root / f"{PREFIX}{step + 1:06d}.bin"


def write(root: Path, step: int, next_task_step: int, held: list[HeldPart]) -> Path:
    """Rank 0: make step index ``step``'s record durable (before its batches are acked)."""
    from shared.wire import encode_batch

    root.mkdir(parents=True, exist_ok=True)
    record = {
        "step": step,
        "next_task_step": next_task_step,
        "parts": [[h.seq, encode_batch(h.batch)] for h in held],
    }
    final = path_of(root, step)
    tmp = final.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(msgpack.packb(record, use_bin_type=True))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    fsync_dir(root)
    return final


def pending(root: Path, after: int) -> list[tuple[int, int, list[HeldPart]]]:
    """The records from step index ``after`` on, in order, without a gap: each as
    ``(step, next_task_step, held)``, the parts as the gate held them (no message: they were acked)."""
    out = []
    step = after
    while (path := path_of(root, step)).is_file():
        record = msgpack.unpackb(path.read_bytes(), raw=False)
        if record["step"] != step:
            raise ValueError(f"{path} holds step {record['step']}, expected {step}; remove the journal directory")
        held = [HeldPart(None, decode_batch(data), int(seq)) for seq, data in record["parts"]]
        out.append((step, int(record["next_task_step"]), held))
        step += 1
    return out


def prune(root: Path, upto: int) -> None:
    """Remove the records a checkpoint after ``upto`` completed steps covers, and temporary files."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        covered = p.name.startswith(PREFIX) and p.suffix == ".bin" and int(p.stem[len(PREFIX) :]) <= upto
        if covered or p.suffix == ".tmp":
            p.unlink(missing_ok=True)
