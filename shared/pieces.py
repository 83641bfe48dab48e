"""A message larger than ``max_payload`` carried in pieces (docs/design.md section 3): the worker cuts
one encoded part of a batch into pieces that each fit a message (``cut``); the trainer's gate reads
where each belongs (``parse``), puts them back together and checks the whole against its digest
before the contract sees anything (``trainer_service/pieces.py``).

Each piece is a plain slice of the encoded part, its headers say where it belongs:

    Nats-Msg-Id           <batch_id>#<i>/<n>  (a re-publish deduplicates piece by piece)
    Centerline-Piece      <i>/<n>            (0-based index, count)
    Centerline-Piece-Of   <batch_id>
    Centerline-Piece-Sum  sha256 hex of the whole part, then ":" and its length in bytes
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

PIECE_HEADER, OF_HEADER, SUM_HEADER = "Centerline-Piece", "Centerline-Piece-Of", "Centerline-Piece-Sum"
MSG_ID_HEADER = "Nats-Msg-Id"
# Bytes of a message kept free for headers (Nats-Msg-Id, the pieces', DLQ reasons): max_payload counts them too.
HEADER_ROOM = 4096


def pieces_per_part(part_bytes: int, max_payload: int) -> int:
    """Messages a part of ``part_bytes`` bytes takes at the server's ``max_payload``: 1 where it fits."""
    return max(1, -(-part_bytes // (max_payload - HEADER_ROOM)))


class Piece(NamedTuple):
    batch_id: str  # the part's
    index: int
    count: int
    digest: str  # sha256 hex of the whole part
    length: int  # bytes of the whole part

    @property
    def msg_id(self) -> str:
        return f"{self.batch_id}#{self.index}/{self.count}"

    def headers(self) -> dict[str, str]:
        return {
            MSG_ID_HEADER: self.msg_id,
            PIECE_HEADER: f"{self.index}/{self.count}",
            OF_HEADER: self.batch_id,
            SUM_HEADER: f"{self.digest}:{self.length}",
        }


def cut(data: bytes, batch_id: str, max_bytes: int) -> list[tuple[str, bytes, dict[str, str]]]:
    """``data`` as ``(msg_id, piece, headers)`` messages of at most ``max_bytes`` bytes each, in order."""
    n, digest = -(-len(data) // max_bytes), hashlib.sha256(data).hexdigest()
    pieces = [Piece(batch_id, i, n, digest, len(data)) for i in range(n)]
    return [(p.msg_id, data[p.index * max_bytes : (p.index + 1) * max_bytes], p.headers()) for p in pieces]


def parse(headers: dict | None) -> Piece | None:
    """Where a message's piece belongs, None for a message that is no piece; ``ValueError`` naming the
    headers when they do not say it."""
    h = headers or {}
    if PIECE_HEADER not in h:
        return None
    try:
        index, count = (int(x) for x in h[PIECE_HEADER].split("/"))
        digest, length = h[SUM_HEADER].rsplit(":", 1)
        piece = Piece(h[OF_HEADER], index, count, digest, int(length))
    except (KeyError, ValueError):
        raise ValueError(
            f"piece headers {PIECE_HEADER}={h.get(PIECE_HEADER)!r} {OF_HEADER}={h.get(OF_HEADER)!r} "
            f"{SUM_HEADER}={h.get(SUM_HEADER)!r} are not <index>/<count>, a batch_id and <sha256>:<bytes>"
        ) from None
    if not (piece.batch_id and 0 <= index < count):
        raise ValueError(f"piece {index}/{count} of part {piece.batch_id!r} is out of range")
    return piece
