"""Splitting a batch by sample to fit max_payload: offsets rebased, every sample once, deterministic."""

import dataclasses

import pytest

from rollout_worker.publish import PayloadTooLargeError, split_batch
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


def test_a_single_sample_over_the_limit_raises_naming_max_payload():
    batch = ragged_batch([2, 200, 3], k=16)
    with pytest.raises(PayloadTooLargeError, match=r"max_payload") as err:
        split_batch(batch, 8000)
    assert "rb:s1" in str(err.value) and "8000" in str(err.value)
