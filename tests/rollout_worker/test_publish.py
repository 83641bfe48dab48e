"""Splitting a batch by sample to fit max_payload: offsets rebased, every sample once, deterministic; a
sample that cannot fit alone is a part of its own (sent in pieces), up to max_sample_bytes."""

import asyncio
import dataclasses

import pytest

from rollout_worker.publish import HEADER_ROOM, PayloadTooLargeError, publish_batch, split_batch
from shared.batch_algebra import select_samples
from shared.contract import check_batch
from shared.wire import Batch, decode_batch, encode_batch
from tests.shared.test_batch_algebra import VOCAB, ragged_batch


def sample_payloads(batch: Batch) -> dict[str, bytes]:
    """Every sample of ``batch`` as bytes, keyed by sample id: equal for equal samples across splits."""
    one = lambda i: encode_batch(dataclasses.replace(select_samples(batch, [i]), batch_id="x", parts=1))  # noqa: E731
    return {sid: one(i) for i, sid in enumerate(batch.sample_ids)}


def test_a_batch_that_fits_is_one_part_with_its_own_batch_id():
    batch = ragged_batch([4, 4])
    parts = split_batch(batch, 1 << 20)
    assert [(p.batch_id, p.data) for p in parts] == [("rb", encode_batch(batch))]


def test_a_batch_over_the_limit_is_split_by_sample_into_parts_that_fit_with_every_sample_once():
    batch = ragged_batch([30, 5, 17, 1, 44, 9, 23, 12, 1, 38], k=16)
    whole = len(encode_batch(batch))
    limit = whole // 3
    parts = split_batch(batch, limit)
    assert len(parts) >= 3
    assert all(len(p.data) <= limit for p in parts)
    decoded = [decode_batch(p.data) for p in parts]
    assert [d.batch_id for d in decoded] == [p.batch_id for p in parts]
    assert [p.batch_id.split("/")[0] for p in parts] == ["rb"] * len(parts)
    assert [(d.task_id, d.parts) for d in decoded] == [(batch.task_id, len(parts))] * len(parts)  # the attempt's count
    assert sum((d.sample_ids for d in decoded), []) == batch.sample_ids  # each once, in order
    got = {}
    for d in decoded:
        check_batch(d, vocab_size=VOCAB)
        got.update(sample_payloads(d))
    assert got == sample_payloads(batch)
    assert split_batch(batch, limit) == parts  # deterministic, so a re-publish deduplicates


def test_a_single_sample_over_the_limit_is_a_part_of_its_own_to_be_sent_in_pieces():
    batch = ragged_batch([2, 200, 3], k=16)
    parts = split_batch(batch, 8000)
    assert [p.batch_id for p in parts] == ["rb/0-1", "rb/1-2", "rb/2-3"]
    assert [len(p.data) > 8000 for p in parts] == [False, True, False]
    decoded = [decode_batch(p.data) for p in parts]
    assert [(d.sample_ids, d.parts) for d in decoded] == [(["rb:s0"], 3), (["rb:s1"], 3), (["rb:s2"], 3)]
    assert split_batch(batch, 8000) == parts


def test_a_part_above_max_sample_bytes_is_refused_by_name_before_anything_is_published():
    batch = ragged_batch([2, 200, 3], k=16)
    big = len(split_batch(batch, 8000)[1].data)
    with pytest.raises(PayloadTooLargeError, match=r"--max-sample-bytes 20000") as err:
        # no JetStream: a publish would fail on None; the refusal comes first
        asyncio.run(publish_batch(None, batch, max_payload=8000 + HEADER_ROOM, max_sample_bytes=20_000))
    assert f"part 'rb/1-2' of one sample is {big} bytes" in str(err.value)
