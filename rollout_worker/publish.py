"""Publishing a candidate batch: split by sample so that each message fits the NATS ``max_payload``,
each part with ``Nats-Msg-Id`` = its ``batch_id`` and a PubAck awaited.

docs/design.md section 3: a message never exceeds the server's ``max_payload``; a producer splits a
group across messages by sample, and a single sample too large for one message is a part of its own
carried in pieces (``shared/pieces.py``), which the trainer puts back together before the contract
sees it. A part above ``max_sample_bytes`` is an error that names the setting. The split is
deterministic, so a re-published batch produces the same message ids and JetStream deduplicates it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np
from nats.js import JetStreamContext
from nats.js.api import PubAck

from shared import names, pieces
from shared.batch_algebra import select_samples
from shared.config import MAX_SAMPLE_BYTES
from shared.nats_client import publish_acked
from shared.pieces import HEADER_ROOM
from shared.wire import Batch, decode_batch, encode_batch


class PayloadTooLargeError(ValueError):
    """A part of one sample exceeds ``max_sample_bytes``: never sent; the message names the setting."""


class Part(NamedTuple):
    batch_id: str  # the Nats-Msg-Id of this message
    data: bytes  # wire format v2


def split_batch(batch: Batch, max_bytes: int) -> list[Part]:
    """Encode ``batch`` as messages of at most ``max_bytes`` each, splitting by sample.

    A batch that fits is one part with its own ``batch_id``. Otherwise consecutive samples
    are packed greedily and part ``[a, b)`` gets ``batch_id = f"{batch_id}/{a}-{b}"``: the
    same batch always splits the same way, so a re-publish deduplicates part by part. Each
    part then says how many its attempt publishes: ``parts`` is the batch's times the split's.
    A sample that cannot fit alone is a part of its own, larger than ``max_bytes``: ``publish_batch``
    sends it in pieces.
    """
    whole = encode_batch(batch)
    if len(whole) <= max_bytes:
        return [Part(batch.batch_id, whole)]
    cost = _sample_bytes(batch)
    # Upper bound of what the empty batch's headers can grow by: 11 arrays x (bin header + 2 shape ints) + 2 lists,
    # and the part count's int.
    fixed = len(encode_batch(select_samples(batch, slice(0, 0)))) + 11 * (3 + 2 * 9) + 2 * 4 + 9
    parts, start, size = [], 0, fixed
    for i, c in enumerate(cost.tolist()):
        if size + c > max_bytes and i > start:
            parts.append((start, i))
            start, size = i, fixed
        size += c
        if size > max_bytes:  # a sample that cannot fit alone: a part of its own, sent in pieces
            parts.append((start, i + 1))
            start, size = i + 1, fixed
    if start < len(cost):
        parts.append((start, len(cost)))
    out = []
    for a, b in parts:
        part = replace(select_samples(batch, slice(a, b)), batch_id=f"{batch.batch_id}/{a}-{b}")
        data = encode_batch(replace(part, parts=batch.parts * len(parts)))
        # the bound above is an upper bound
        assert len(data) <= max_bytes or b - a == 1, (a, b, len(data), max_bytes)
        out.append(Part(f"{batch.batch_id}/{a}-{b}", data))
    return out


def _sample_bytes(batch: Batch) -> np.ndarray:
    """Encoded bytes each sample adds to a batch (exact for arrays, an upper bound for strings)."""
    tokens = np.diff(np.asarray(batch.offsets, dtype=np.int64))
    prompt = np.diff(np.asarray(batch.prompt_offsets, dtype=np.int64))
    k = batch.cand_ids.shape[1] if batch.cand_ids.ndim == 2 else 0
    strings = np.array([len(s.encode()) + len(g.encode()) + 10 for s, g in zip(batch.sample_ids, batch.group_ids)])
    # rewards, advantages (4+4), two offsets (8+8); per token: id, logprob, mask, version, K ids, K logprobs
    return 24 + 4 * prompt + tokens * (13 + 8 * k) + strings.astype(np.int64)


async def publish_batch(
    js: JetStreamContext,
    batch: Batch | bytes,
    *,
    max_payload: int,
    subject: str = names.ROLLOUTS_SUBJECT,
    batch_id: str | None = None,  # only for bytes
    timeout: float = 10.0,
    attempts: int = 3,
    between=None,
    max_sample_bytes: int = MAX_SAMPLE_BYTES,
) -> list[PubAck]:
    """Publish a batch with ``Nats-Msg-Id = batch_id`` and wait for each PubAck (acked = fsynced).

    ``max_payload`` is the server's (``nc.max_payload``); a larger batch is split by sample
    (``split_batch``). Bytes that fit are published unchanged; their ``batch_id`` is read
    from them unless given.
    A publish without PubAck within ``timeout`` is repeated with the same id, ``attempts``
    times in all, then raises ``PublishError``. Returns one PubAck per message;
    ``ack.duplicate`` is True where JetStream already held that id, which is a successful
    publish, not an error. A part larger than a message goes as pieces (``shared.pieces.cut``), one
    PubAck each; one larger than ``max_sample_bytes`` raises ``PayloadTooLargeError`` before anything
    of the batch is published. ``between()``, if given, is called between two messages' publishes (the
    worker's failpoint ``worker.between_parts``).
    """
    limit = max_payload - HEADER_ROOM
    if isinstance(batch, Batch):
        parts = split_batch(batch, limit)
    elif len(batch) <= limit:
        parts = [Part(batch_id or decode_batch(batch).batch_id, bytes(batch))]
    else:
        parts = split_batch(decode_batch(batch), limit)
    messages = []
    for part in parts:
        if len(part.data) > max_sample_bytes:
            raise PayloadTooLargeError(
                f"part {part.batch_id!r} of one sample is {len(part.data)} bytes, above --max-sample-bytes "
                f"{max_sample_bytes}: the trainer would never take it; raise --max-sample-bytes (on workers and "
                "trainer alike), or lower --rollout-session-max-tokens or K"
            )
        if pieces.pieces_per_part(len(part.data), max_payload) == 1:
            messages.append((part.batch_id, part.data, {names.MSG_ID_HEADER: part.batch_id}))
        else:
            messages += pieces.cut(part.data, part.batch_id, limit)
    acks = []
    for i, (msg_id, data, headers) in enumerate(messages):
        if i and between is not None:
            between()
        acks.append(
            await publish_acked(
                js, subject, data, headers, what=f"batch {msg_id!r}", timeout=timeout, attempts=attempts
            )
        )
    return acks
