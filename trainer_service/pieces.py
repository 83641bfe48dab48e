"""The gate's side of pieces (``shared/pieces.py``; docs/design.md section 3), without I/O: a part of a
batch larger than a message is gathered piece by piece, by ``batch_id`` (pieces of several parts may
interleave), and answered with nothing yet, a ``Whole`` message once every piece is there and the
whole matches its digest, or a ``Broken`` verdict naming the pieces to dead-letter and why. A whole is
acked, nak'ed and kept alive as one message: every piece at once. Memory: a whole holds its part once
(its pieces' bytes are dropped), and no part above ``max_bytes`` is gathered at all.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace

from shared.pieces import MSG_ID_HEADER, Piece, parse

# the rules a piece is dead-lettered under
PIECE_DIGEST, PIECE_SHAPE, DUPLICATE_PIECE = "piece_digest", "piece_shape", "duplicate_piece"
SAMPLE_TOO_LARGE, INCOMPLETE_SAMPLE = "sample_too_large", "incomplete_sample"


@dataclass
class Whole:
    """The pieces of one part, put back together: ``data`` is the part, ``metadata`` its first piece's
    (so its stream sequence is the first piece's), and every ack, nak or in-progress goes to each piece."""

    pieces: list  # the piece messages, in order
    data: bytes
    headers: dict
    metadata: object
    sizes: list[int]  # each piece's bytes: the DLQ gets the pieces back

    async def ack_sync(self, timeout: float = 5.0) -> None:
        for m in self.pieces:
            await m.ack_sync(timeout=timeout)

    async def nak(self, delay: float | None = None) -> None:
        for m in self.pieces:
            await m.nak(delay=delay)

    async def in_progress(self) -> None:
        for m in self.pieces:
            await m.in_progress()

    def dead_letters(self) -> list[tuple[int, object, bytes]]:
        """``(stream sequence, piece message, its bytes)`` for each piece: a whole is dead-lettered piece by piece."""
        out, at = [], 0
        for m, size in zip(self.pieces, self.sizes):
            out.append((_seq(m), m, self.data[at : at + size]))
            at += size
        return out


@dataclass(frozen=True)
class Broken:
    """Pieces that can never make a part: dead-letter each of ``msgs`` under ``rule``."""

    batch_id: str
    rule: str
    reason: str
    msgs: list


@dataclass
class _Gathering:
    piece: Piece  # the first piece's headers: every other must agree
    first: float  # the gate's clock when its first piece arrived
    got: dict[int, object] = field(default_factory=dict)  # index -> piece message


class Pieces:
    """The parts being put back together, by ``batch_id``; ``max_bytes`` the largest whole accepted."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.open: dict[str, _Gathering] = {}

    def messages(self) -> list:
        """Every piece held, to keep alive."""
        return [m for g in self.open.values() for m in g.got.values()]

    def release(self) -> list:
        """Forget every piece held and return them (to be nak'ed)."""
        out, self.open = self.messages(), {}
        return out

    def add(self, msg, now: float) -> object:
        """Take a message: one that is no piece comes back as it is; a piece gives None while its part is
        incomplete (or it repeats a piece held), a ``Whole`` once every piece is there and matches the
        digest, else ``Broken``. ``now``: the gate's clock, that ``expired`` measures by."""
        try:
            p = parse(msg.headers)
        except ValueError as exc:
            return Broken((msg.headers or {}).get("Centerline-Piece-Of", ""), PIECE_SHAPE, str(exc), [msg])
        if p is None:
            return msg
        bid = p.batch_id
        if p.length > self.max_bytes:
            reason = (
                f"part {bid!r} is {p.length} bytes in {p.count} pieces, above --max-sample-bytes {self.max_bytes}: "
                "never trained; raise it (on workers and trainer alike), or lower --rollout-session-max-tokens or K"
            )
            return Broken(bid, SAMPLE_TOO_LARGE, reason, [msg])
        g = self.open.setdefault(bid, _Gathering(p, now))
        if p._replace(index=0) != g.piece._replace(index=0):
            del self.open[bid]
            reason = (
                f"piece {p.index}/{p.count} of part {bid!r} says the part is {p.length} bytes with digest "
                f"{p.digest[:16]}..., its pieces held say {g.piece.count} pieces of {g.piece.length} bytes with "
                f"digest {g.piece.digest[:16]}...: two different parts under one batch_id"
            )
            return Broken(bid, PIECE_DIGEST, reason, [*g.got.values(), msg])
        held = g.got.get(p.index)
        if held is not None:
            if _seq(held) == _seq(msg):
                return None  # a redelivery of the piece held: the held copy is acked with the whole
            if bytes(held.data) == bytes(msg.data):  # re-published outside the duplicate window
                return Broken(bid, DUPLICATE_PIECE, f"piece {p.index}/{p.count} of part {bid!r} arrived twice", [msg])
            del self.open[bid]
            reason = f"piece {p.index}/{p.count} of part {bid!r} arrived twice with different bytes"
            return Broken(bid, PIECE_DIGEST, reason, [*g.got.values(), msg])
        g.got[p.index] = msg
        if len(g.got) < p.count:
            return None
        del self.open[bid]
        return _whole(p, [g.got[i] for i in range(p.count)])

    def expired(self, now: float, after: float) -> list[Broken]:
        """The parts whose first piece arrived ``after`` seconds before ``now`` and are still short of pieces."""
        out = []
        for bid, g in list(self.open.items()):
            if now - g.first >= after:
                del self.open[bid]
                reason = (
                    f"part {bid!r} has {g.piece.count} pieces and {len(g.got)} arrived while the gate fetched for "
                    f"{after:g}s: a part short of a piece is never trained (its worker died between two publishes)"
                )
                out.append(Broken(bid, INCOMPLETE_SAMPLE, reason, list(g.got.values())))
        return out


def _whole(p: Piece, pieces: list) -> Whole | Broken:
    data = b"".join(bytes(m.data) for m in pieces)
    found = hashlib.sha256(data).hexdigest()
    if len(data) != p.length or found != p.digest:
        reason = (
            f"the {p.count} pieces of part {p.batch_id!r} make {len(data)} bytes with sha256 {found[:16]}..., "
            f"their headers say {p.length} bytes with {p.digest[:16]}...: a piece was corrupted; never trained"
        )
        return Broken(p.batch_id, PIECE_DIGEST, reason, pieces)
    sizes = [len(m.data) for m in pieces]
    for m in pieces:
        m.data = b""  # held once, in the whole
    first = pieces[0].metadata
    meta = SimpleNamespace(sequence=first.sequence, num_delivered=first.num_delivered)
    return Whole(pieces, data, {MSG_ID_HEADER: p.batch_id}, meta, sizes)


def _seq(msg) -> int:
    return msg.metadata.sequence.stream
