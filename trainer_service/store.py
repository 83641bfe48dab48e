"""The trainer's side of a bounded store (docs/design.md section 3): ROLLOUTS has a byte cap and refuses
new batches when full, so no batch leaves it untrained; the trainer makes room by purging the batches
it is done with, and a publish of its own that a full store refuses is tried again later, never the
end of the trainer.

- ``trim`` runs after each commit: while ROLLOUTS holds more than its cap less ``room`` (the steps in
  flight, at their largest), it purges its oldest messages, never one above the trainer consumer's ack
  floor (every message up to it is trained, dead-lettered or dropped, and durable in the run).
- ``unless_full`` awaits a publish of tasks; a ``StoreFull`` refusal is logged by name and counted, and
  the trainer goes on: the step's tasks are published again at the next step, the next ones when a
  step starves again (their ``Nats-Msg-Id`` deduplicates what was stored); a held-out round missing
  tasks is given up after ``--heldout-timeout``.
"""

from __future__ import annotations

import logging
import math

from shared import names
from shared.nats_client import StoreFull
from shared.streams import sample_max_bytes

log = logging.getLogger("centerline.trainer.store")


def room(cfg, prompts_per_step: int) -> int:
    """Bytes ``trim`` keeps free: the steps in flight (``max_inflight_steps`` + 1) at their largest
    (``shared.streams.sample_max_bytes``), what a trainer that stopped leaves the workers to publish."""
    return (cfg.training.max_inflight_steps + 1) * prompts_per_step * cfg.rollout.n * sample_max_bytes(cfg.rollout)


async def trim(js, cap: int, room: int) -> int:
    """Purge trained messages from the start of ROLLOUTS until it holds at most ``cap - room`` bytes, or
    up to the trainer consumer's ack floor, whichever comes first; returns how many messages went."""
    state = (await js.stream_info(names.ROLLOUTS_STREAM)).state
    keep = max(0, cap - room)
    if state.bytes <= keep or not state.messages:
        return 0
    floor = (await js.consumer_info(names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)).ack_floor.stream_seq
    if floor < state.first_seq:
        return 0  # nothing settled: the trainer holds it all, or has not reached it
    # sizes of single messages are not known without reading them: the average over the stream
    excess = math.ceil((state.bytes - keep) / (state.bytes / state.messages))
    cut = min(floor + 1, state.first_seq + excess)
    await js.purge_stream(names.ROLLOUTS_STREAM, seq=cut)
    after = (await js.stream_info(names.ROLLOUTS_STREAM)).state
    gone = after.first_seq - state.first_seq  # a prefix went; workers may have published meanwhile
    log.info(
        "ROLLOUTS trimmed: %d settled messages before sequence %d purged, %d of its %d-byte cap in use "
        "(the trainer's ack floor is %d)",
        gone,
        cut,
        after.bytes,
        cap,
        floor,
    )
    return gone


async def unless_full(publish, what: str, counts) -> bool:
    """Await ``publish``; False, with a warning that names ``what`` and the refusal and ``counts["store_full"]``
    one more, when JetStream refused it for a full store (the trainer goes on: what is stored gets trained
    and trimmed)."""
    try:
        await publish
    except StoreFull as exc:
        counts["store_full"] += 1
        log.warning("%s not published: %s", what, exc)
        return False
    return True
