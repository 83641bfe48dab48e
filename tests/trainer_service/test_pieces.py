"""Pieces of a part larger than a message: cut by the worker (shared/pieces.py), put back together by
the gate (trainer_service/pieces.py), checked whole against the digest before the contract sees anything."""

from __future__ import annotations

import asyncio
import hashlib
import os
from types import SimpleNamespace

from shared.pieces import HEADER_ROOM, cut, pieces_per_part
from trainer_service.pieces import (
    DUPLICATE_PIECE,
    INCOMPLETE_SAMPLE,
    PIECE_DIGEST,
    PIECE_SHAPE,
    SAMPLE_TOO_LARGE,
    Broken,
    Pieces,
    Whole,
)

DATA = os.urandom(2500)


class Msg(SimpleNamespace):
    """A delivered message: what the gate reads of a nats-py Msg, and its acks recorded."""

    def __init__(self, data: bytes, headers: dict, seq: int):
        super().__init__(data=data, headers=headers, metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq)))
        self.metadata.num_delivered = 1
        self.done: list[str] = []

    async def ack_sync(self, timeout: float = 5.0) -> None:
        self.done.append("ack")

    async def nak(self, delay=None) -> None:
        self.done.append("nak")

    async def in_progress(self) -> None:
        self.done.append("wip")


def delivered(data: bytes, batch_id: str, first_seq: int, max_bytes: int = 1000) -> list[Msg]:
    return [Msg(d, h, first_seq + i) for i, (_, d, h) in enumerate(cut(data, batch_id, max_bytes))]


def test_a_part_is_cut_into_pieces_that_fit_each_with_its_index_count_and_the_wholes_digest():
    out = cut(DATA, "t/1/b", 1000)
    assert [m for m, _, _ in out] == ["t/1/b#0/3", "t/1/b#1/3", "t/1/b#2/3"]
    assert [len(d) for _, d, _ in out] == [1000, 1000, 500]
    assert out[2][2] == {
        "Nats-Msg-Id": "t/1/b#2/3",
        "Centerline-Piece": "2/3",
        "Centerline-Piece-Of": "t/1/b",
        "Centerline-Piece-Sum": f"{hashlib.sha256(DATA).hexdigest()}:2500",
    }


def test_every_piece_there_in_any_order_makes_the_whole_once_at_its_first_pieces_sequence():
    p = Pieces(10_000)
    a, b, c = delivered(DATA, "t/1/b", 7)
    assert p.add(c, 0.0) is None and p.add(a, 0.0) is None
    whole = p.add(b, 0.0)
    assert isinstance(whole, Whole)
    assert whole.data == DATA and whole.headers == {"Nats-Msg-Id": "t/1/b"}
    assert whole.metadata.sequence.stream == 7 and whole.pieces == [a, b, c]
    assert p.open == {} and p.messages() == []


def test_a_whole_is_acked_nacked_and_kept_alive_as_every_piece():
    p = Pieces(10_000)
    msgs = delivered(DATA, "t/1/b", 1)
    whole = [p.add(m, 0.0) for m in msgs][-1]
    asyncio.run(whole.in_progress())
    asyncio.run(whole.ack_sync())
    asyncio.run(whole.nak())
    assert [m.done for m in msgs] == [["wip", "ack", "nak"]] * 3


def test_a_whole_gives_its_pieces_back_for_the_dlq_with_their_own_sequences():
    p = Pieces(10_000)
    msgs = delivered(DATA, "t/1/b", 4)
    whole = [p.add(m, 0.0) for m in msgs][-1]
    letters = whole.dead_letters()
    assert [(seq, m) for seq, m, _ in letters] == [(4, msgs[0]), (5, msgs[1]), (6, msgs[2])]
    assert b"".join(d for _, _, d in letters) == DATA


def test_pieces_of_two_parts_interleaved_make_both_wholes():
    other = os.urandom(1800)
    p = Pieces(10_000)
    mine, theirs = delivered(DATA, "t/1/a", 1), delivered(other, "u/1/a", 10)
    got = [p.add(m, 0.0) for pair in zip(mine, theirs) for m in pair] + [p.add(mine[2], 0.0)]
    wholes = [g for g in got if g is not None]
    assert [(w.headers["Nats-Msg-Id"], w.data) for w in wholes] == [("u/1/a", other), ("t/1/a", DATA)]


def test_a_missing_piece_holds_the_others_until_the_expiry_then_breaks_them_all_as_incomplete_sample():
    p = Pieces(10_000)
    a, _, c = delivered(DATA, "t/1/b", 1)
    assert p.add(a, 5.0) is None and p.add(c, 6.0) is None
    assert p.messages() == [a, c]
    assert p.expired(64.9, 60.0) == []
    (broken,) = p.expired(65.0, 60.0)
    assert (broken.batch_id, broken.rule, broken.msgs) == ("t/1/b", INCOMPLETE_SAMPLE, [a, c])
    assert "3 pieces and 2 arrived" in broken.reason
    assert p.open == {}


def test_a_corrupted_piece_is_caught_by_the_digest_and_every_piece_of_the_part_broken():
    p = Pieces(10_000)
    a, b, c = delivered(DATA, "t/1/b", 1)
    b.data = bytes([b.data[0] ^ 1]) + b.data[1:]
    assert p.add(a, 0.0) is None and p.add(b, 0.0) is None
    broken = p.add(c, 0.0)
    assert isinstance(broken, Broken)
    assert (broken.rule, broken.msgs) == (PIECE_DIGEST, [a, b, c])
    assert "a piece was corrupted" in broken.reason and p.open == {}


def test_a_redelivered_piece_is_ignored_and_the_whole_made_once():
    p = Pieces(10_000)
    a, b, c = delivered(DATA, "t/1/b", 1)
    again = Msg(a.data, a.headers, a.metadata.sequence.stream)
    assert [p.add(m, 0.0) for m in (a, again, b)] == [None, None, None]
    whole = p.add(c, 0.0)
    assert whole.pieces == [a, b, c]


def test_a_piece_published_twice_under_two_sequences_is_broken_alone_as_a_duplicate():
    p = Pieces(10_000)
    a, b, c = delivered(DATA, "t/1/b", 1)
    twice = Msg(a.data, a.headers, 99)
    assert p.add(a, 0.0) is None
    broken = p.add(twice, 0.0)
    assert (broken.rule, broken.msgs) == (DUPLICATE_PIECE, [twice])
    assert p.add(b, 0.0) is None and isinstance(p.add(c, 0.0), Whole)


def test_pieces_of_two_different_parts_under_one_batch_id_break_the_part():
    p = Pieces(10_000)
    a = delivered(DATA, "t/1/b", 1)[0]
    x = delivered(os.urandom(2500), "t/1/b", 50)[1]
    assert p.add(a, 0.0) is None
    broken = p.add(x, 0.0)
    assert (broken.rule, broken.msgs) == (PIECE_DIGEST, [a, x])
    assert "two different parts under one batch_id" in broken.reason


def test_a_part_above_the_ceiling_is_refused_by_name_at_its_first_piece():
    p = Pieces(2000)
    a = delivered(DATA, "t/1/b", 1)[0]
    broken = p.add(a, 0.0)
    assert (broken.rule, broken.msgs) == (SAMPLE_TOO_LARGE, [a])
    assert "2500 bytes in 3 pieces, above --max-sample-bytes 2000" in broken.reason and p.open == {}


def test_a_piece_whose_headers_do_not_parse_is_refused_by_name():
    p = Pieces(10_000)
    a = delivered(DATA, "t/1/b", 1)[0]
    a.headers = {**a.headers, "Centerline-Piece": "first"}
    broken = p.add(a, 0.0)
    assert (broken.rule, broken.msgs) == (PIECE_SHAPE, [a])
    assert "'first'" in broken.reason


def test_a_message_that_is_no_piece_comes_back_as_it_is():
    plain = Msg(b"batch", {"Nats-Msg-Id": "t/1/b"}, 3)
    assert Pieces(10_000).add(plain, 0.0) is plain


def test_release_gives_back_every_piece_held():
    p = Pieces(10_000)
    a, b, _ = delivered(DATA, "t/1/b", 1)
    p.add(a, 0.0), p.add(b, 0.0)
    assert p.release() == [a, b] and p.open == {}


def test_a_part_takes_as_many_messages_as_its_bytes_need_at_max_payload_less_header_room():
    limit = (8 << 20) - HEADER_ROOM
    assert [pieces_per_part(n, 8 << 20) for n in (1, limit, limit + 1, 21 << 20)] == [1, 1, 2, 3]
