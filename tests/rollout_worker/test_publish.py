"""Splitting a batch by sample to fit max_payload: offsets rebased, every sample once, deterministic."""

import dataclasses

import numpy as np
import pytest

from centerline.synth import make_batch
from rollout_worker.publish import PayloadTooLargeError, select_samples, split_batch
from shared.contract import check_batch
from shared.wire import ARRAY_FIELDS, Batch, decode_batch, encode_batch

VOCAB = 64


def ragged_batch(lengths: list[int], *, k: int = 8, batch_id: str = "rb") -> Batch:
    """A valid batch whose sample ``i`` has ``lengths[i]`` response tokens and ``i % 3 + 1`` prompt tokens."""
    parts = [
        make_batch(
            samples=1,
            tokens_per_sample=n,
            k=k,
            vocab_size=VOCAB,
            seed=i,
            batch_id=f"{batch_id}-{i}",
            prompt_len=i % 3 + 1,
        )
        for i, n in enumerate(lengths)
    ]
    cat = {name: np.concatenate([getattr(p, name) for p in parts]) for name in ARRAY_FIELDS if "offsets" not in name}
    return dataclasses.replace(
        parts[0],
        batch_id=batch_id,
        sample_ids=[f"{batch_id}:s{i}" for i in range(len(lengths))],
        group_ids=[f"{batch_id}:g{i // 2}" for i in range(len(lengths))],
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        prompt_offsets=np.concatenate([[0], np.cumsum([i % 3 + 1 for i in range(len(lengths))])]).astype(np.int64),
        **cat,
    )


def sample_payloads(batch: Batch) -> dict[str, bytes]:
    """Every sample of ``batch`` as bytes, keyed by sample id: equal for equal samples across splits."""
    one = lambda i: encode_batch(dataclasses.replace(select_samples(batch, [i]), batch_id="x", parts=1))  # noqa: E731
    return {sid: one(i) for i, sid in enumerate(batch.sample_ids)}


def test_select_samples_rebases_offsets_and_keeps_every_array_of_the_chosen_samples():
    batch = ragged_batch([3, 1, 5, 2])
    for picked in (slice(1, 3), [2, 0], slice(None, None, 2)):
        sub = select_samples(batch, picked)
        order = list(range(4))[picked] if isinstance(picked, slice) else picked
        assert sub.sample_ids == [batch.sample_ids[i] for i in order]
        assert sub.offsets[0] == 0 and sub.prompt_offsets[0] == 0
        for j, i in enumerate(order):
            assert np.array_equal(sub.cand_ids[sub.sample_slice(j)], batch.cand_ids[batch.sample_slice(i)])
            assert np.array_equal(sub.response_ids[sub.sample_slice(j)], batch.response_ids[batch.sample_slice(i)])
            got = sub.prompt_ids[sub.prompt_offsets[j] : sub.prompt_offsets[j + 1]]
            assert np.array_equal(got, batch.prompt_ids[batch.prompt_offsets[i] : batch.prompt_offsets[i + 1]])
            assert sub.rewards[j] == batch.rewards[i] and sub.advantages[j] == batch.advantages[i]
        check_batch(decode_batch(encode_batch(sub)), vocab_size=VOCAB)


def test_select_samples_of_nothing_is_an_empty_valid_batch():
    sub = select_samples(ragged_batch([2, 3]), slice(1, 1))
    assert sub.num_samples == 0 and sub.num_tokens == 0 and sub.offsets.tolist() == [0]
    assert decode_batch(encode_batch(sub)).num_samples == 0


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
