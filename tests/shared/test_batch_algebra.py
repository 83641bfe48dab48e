"""Batch algebra (shared/batch_algebra.py): a batch's samples selected, batches concatenated; every
result a valid batch whose samples are the chosen ones, whole and in order. Shards:
tests/trainer_service/test_shards.py."""

import dataclasses

import numpy as np

from centerline.synth import make_batch
from shared.batch_algebra import concat_batches, select_samples
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


def test_concat_batches_is_one_valid_global_batch():
    parts = [
        make_batch(samples=4, tokens_per_sample=3, k=8, vocab_size=VOCAB, batch_id="a", weight_version=3, seed=1),
        make_batch(samples=2, tokens_per_sample=5, k=8, vocab_size=VOCAB, batch_id="b", seed=2, prompt_len=2),
    ]
    whole = concat_batches(parts, batch_id="step-0")
    check_batch(whole, vocab_size=VOCAB)
    assert whole.num_samples == 6 and whole.num_tokens == 4 * 3 + 2 * 5
    assert whole.offsets.tolist() == [0, 3, 6, 9, 12, 17, 22]
    assert whole.prompt_offsets.tolist() == [0, 3, 6, 9, 12, 14, 16]
    assert whole.extra["batch_ids"] == ["a", "b"]
    for i, (part, j) in enumerate([(parts[0], j) for j in range(4)] + [(parts[1], j) for j in range(2)]):
        assert np.array_equal(whole.cand_ids[whole.sample_slice(i)], part.cand_ids[part.sample_slice(j)])
        assert np.array_equal(
            whole.prompt_ids[whole.prompt_offsets[i] : whole.prompt_offsets[i + 1]],
            part.prompt_ids[part.prompt_offsets[j] : part.prompt_offsets[j + 1]],
        )


def test_concatenating_the_selections_of_a_batch_in_order_gives_back_its_samples():
    batch = ragged_batch([3, 1, 5, 2, 4])
    pieces = [select_samples(batch, slice(0, 2)), select_samples(batch, [2, 3, 4])]
    whole = concat_batches(pieces, batch_id="rb")
    for name in ARRAY_FIELDS:
        assert np.array_equal(getattr(whole, name), getattr(batch, name)), name
    assert (whole.sample_ids, whole.group_ids) == (batch.sample_ids, batch.group_ids)
