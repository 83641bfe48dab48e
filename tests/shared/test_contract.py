"""The completeness contract: each rule, violated alone, is reported by name with its sample and row."""

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from centerline.synth import make_batch
from shared.contract import RULES, ContractViolation, check_batch, k_above_vocab
from tests.rounding import U32, sum_tolerance

VOCAB = 64


def float32_mass_tolerance(logprobs) -> float:
    """How far the contract's float32 row mass (K exps, each within an ulp, then their sum) may be
    from the exact mass of the same float32 log-probs."""
    return sum_tolerance(float(np.exp(logprobs.astype(np.float64)).sum()), len(logprobs) + 1, U32)


def selected(**kw):
    return make_batch(samples=4, tokens_per_sample=8, k=8, vocab_size=VOCAB, mode="selected", **kw)


def support(**kw):
    return make_batch(samples=4, tokens_per_sample=8, k=8, vocab_size=VOCAB, mode="support", top_k=5, **kw)


def violation(batch, **kw) -> ContractViolation:
    with pytest.raises(ContractViolation) as info:
        check_batch(batch, vocab_size=kw.pop("vocab_size", VOCAB), **kw)
    return info.value


def edit(batch, name, index, value):
    arr = np.array(getattr(batch, name))
    arr[index] = value
    return replace(batch, **{name: arr})


def row_of(sample, row, tokens_per_sample=8):
    return sample * tokens_per_sample + row


@pytest.mark.parametrize("make", [selected, support])
def test_valid_batches_pass(make):
    check_batch(make(), vocab_size=VOCAB, current_version=0, max_staleness=0, seen=set())


def test_rows_with_fewer_than_k_candidates_pass_when_vocab_is_smaller_than_k():
    batch = make_batch(samples=2, tokens_per_sample=5, k=128, vocab_size=40)
    assert (batch.cand_ids >= 0).sum(axis=1).tolist() == [40] * 10
    check_batch(batch, vocab_size=40)


def test_truncated_row_in_selected_mode_is_short_row():
    batch = make_batch(samples=4, tokens_per_sample=8, k=128, vocab_size=256)
    i = row_of(2, 5)
    ids, lps = np.array(batch.cand_ids), np.array(batch.cand_logprobs)
    ids[i, 37:], lps[i, 37:] = -1, -np.inf
    err = violation(replace(batch, cand_ids=ids, cand_logprobs=lps), vocab_size=256)
    assert (err.rule, err.sample, err.row, err.expected, err.found) == ("short_row", 2, 5, 128, 37)
    assert str(err).startswith("sample 2 row 5 has 37 candidates, expected 128: the upstream or a router truncated")


def test_exactly_twenty_candidates_when_k_is_128_blames_the_router_cap():
    batch = make_batch(samples=1, tokens_per_sample=3, k=128, vocab_size=256)
    ids, lps = np.array(batch.cand_ids), np.array(batch.cand_logprobs)
    ids[:, 20:], lps[:, 20:] = -1, -np.inf
    err = violation(
        replace(batch, cand_ids=ids, cand_logprobs=lps, loss_mask=np.array([0, 1, 1], np.uint8)), vocab_size=256
    )
    assert (err.rule, err.sample, err.row, err.expected, err.found) == ("short_row", 0, 1, 128, 20)
    assert "the router probably caps top_logprobs at 20; run `centerline probe --k 128`" in str(err)


def test_empty_slots_are_allowed_in_untrained_rows():
    batch = selected()
    i = row_of(1, 3)
    ids, lps, mask = np.array(batch.cand_ids), np.array(batch.cand_logprobs), np.array(batch.loss_mask)
    ids[i, :], lps[i, :], mask[i] = -1, -np.inf, 0
    check_batch(replace(batch, cand_ids=ids, cand_logprobs=lps, loss_mask=mask), vocab_size=VOCAB)


@pytest.mark.parametrize("make, rule", [(selected, "short_row"), (support, "support_mass")])
def test_a_trained_token_with_an_empty_row_is_refused_in_either_mode(make, rule):
    batch = make()
    i = row_of(2, 4)
    ids, lps = np.array(batch.cand_ids), np.array(batch.cand_logprobs)
    ids[i, :], lps[i, :] = -1, -np.inf
    err = violation(replace(batch, cand_ids=ids, cand_logprobs=lps))
    assert (err.rule, err.sample, err.row) == (rule, 2, 4)


@pytest.mark.parametrize("make", [selected, support])
def test_a_candidate_row_on_an_untrained_token_is_row_on_untrained_token(make):
    batch = make()
    mask = np.array(batch.loss_mask)
    mask[row_of(3, 6)] = 0
    err = violation(replace(batch, loss_mask=mask))
    assert (err.rule, err.sample, err.row, err.expected) == ("row_on_untrained_token", 3, 6, 0)
    assert str(err).startswith("sample 3 row 6 is not trained (loss_mask 0) yet holds ")


def session_like(**kw):
    """Sample 1 as a session holds it: rows 2-4 a message the template rendered (untrained, empty
    rows, sampled log-prob 0), the tokens after them sampled by version 5, those before by 4."""
    batch = selected(weight_version=5, **kw)
    rows = slice(row_of(1, 2), row_of(1, 5))
    ids, lps, mask = np.array(batch.cand_ids), np.array(batch.cand_logprobs), np.array(batch.loss_mask)
    sampled, versions = np.array(batch.sampled_logprobs), np.array(batch.token_versions)
    ids[rows], lps[rows], mask[rows], sampled[rows] = -1, -np.inf, 0, 0.0
    versions[row_of(1, 0) : row_of(1, 5)] = 4
    return replace(
        batch, cand_ids=ids, cand_logprobs=lps, loss_mask=mask, sampled_logprobs=sampled, token_versions=versions
    )


def test_a_session_sample_with_untrained_template_tokens_and_two_versions_passes():
    check_batch(session_like(), vocab_size=VOCAB, current_version=6, max_staleness=2)


def test_staleness_is_judged_on_the_oldest_trained_token():
    err = violation(session_like(), current_version=6, max_staleness=1)
    assert (err.rule, err.expected, err.found) == ("stale", 1, 2)  # rows 0-1 of sample 1, version 4
    assert str(err).startswith("batch's oldest trained token, sampled by weights 4, is 2 versions old")
    versions = np.array(session_like().token_versions)
    versions[row_of(1, 2) : row_of(1, 5)] = 0  # untrained tokens: their version does not count
    versions[row_of(1, 0) : row_of(1, 2)] = 5
    check_batch(replace(session_like(), token_versions=versions), vocab_size=VOCAB, current_version=6, max_staleness=1)


@pytest.mark.parametrize("version", [6, -1])
def test_a_token_newer_than_the_batch_or_negative_is_token_version(version):
    batch = session_like()
    versions = np.array(batch.token_versions)
    versions[row_of(2, 7)] = version
    err = violation(replace(batch, token_versions=versions))
    assert (err.rule, err.sample, err.row, err.expected, err.found) == ("token_version", 2, 7, 5, version)
    assert f"was sampled by weight version {version}, outside [0, 5]" in str(err)


@pytest.mark.parametrize(
    "versions, message",
    [
        (np.zeros(32, np.int64), "token_versions must be a int32 array, found int64"),
        (np.zeros(31, np.int32), "token_versions has shape [31], expected [32]"),
    ],
)
def test_token_versions_of_another_dtype_or_shape_are_rule_shape(versions, message):
    err = violation(replace(selected(), token_versions=versions))
    assert err.rule == "shape" and message in str(err)


@pytest.mark.parametrize("field", ["attempt", "parts"])
def test_an_attempt_or_part_count_below_one_is_rule_shape(field):
    err = violation(replace(selected(), **{field: 0}))
    assert err.rule == "shape" and "expected both at least 1" in str(err)


def test_duplicate_candidate_is_named():
    batch = selected()
    i = row_of(3, 2)
    ids = np.array(batch.cand_ids)
    ids[i, 6] = ids[i, 1]
    err = violation(replace(batch, cand_ids=ids))
    assert (err.rule, err.sample, err.row, err.found) == ("duplicate_candidate", 3, 2, int(ids[i, 1]))


@pytest.mark.parametrize(
    "name, index, value",
    [
        ("sampled_logprobs", row_of(1, 4), np.nan),
        ("cand_logprobs", (row_of(2, 0), 3), np.nan),
        ("cand_logprobs", (row_of(0, 7), 0), np.inf),
        ("cand_logprobs", (row_of(3, 1), 2), -np.inf),  # a real candidate with -inf
    ],
)
def test_non_finite_logprob_is_named_with_its_row(name, index, value):
    batch = edit(selected(), name, index, value)
    i = index[0] if isinstance(index, tuple) else index
    err = violation(batch)
    assert (err.rule, err.sample, err.row) == ("non_finite", i // 8, i % 8)


@pytest.mark.parametrize("name", ["rewards", "advantages"])
def test_non_finite_reward_or_advantage_names_the_sample(name):
    err = violation(edit(selected(), name, 2, np.nan))
    assert (err.rule, err.sample, err.row) == ("non_finite", 2, None)
    assert f"{name}[2]" in str(err)


def test_padding_with_a_logprob_is_rejected():
    batch = selected()
    i = row_of(1, 1)
    ids, mask = np.array(batch.cand_ids), np.array(batch.loss_mask)
    ids[i, 7], mask[i] = -1, 0  # the slot claims to be empty but still carries a log-prob
    err = violation(replace(batch, cand_ids=ids, loss_mask=mask))
    assert (err.rule, err.sample, err.row) == ("padding", 1, 1)


def test_positive_logprob_is_rejected():
    err = violation(edit(selected(), "cand_logprobs", (row_of(2, 6), 4), 0.5))
    assert (err.rule, err.sample, err.row, err.found) == ("positive_logprob", 2, 6, 0.5)


def test_row_mass_above_one_is_rejected():
    batch = selected()
    i = row_of(0, 2)
    lps = np.array(batch.cand_logprobs)
    lps[i] = np.log(np.full(8, 0.2, np.float32))  # mass 1.6
    lps[i, 0] = batch.sampled_logprobs[i] if batch.cand_ids[i, 0] == batch.response_ids[i] else lps[i, 0]
    err = violation(replace(batch, cand_logprobs=lps))
    assert (err.rule, err.sample, err.row, err.expected) == ("row_mass", 0, 2, 1.0)
    assert abs(err.found - float(np.exp(lps[i].astype(np.float64)).sum())) <= float32_mass_tolerance(lps[i])


def test_support_mass_not_one_is_rejected():
    batch = support()
    i = row_of(3, 3)
    lps, slp = np.array(batch.cand_logprobs), np.array(batch.sampled_logprobs)
    lps[i, :5] -= 0.01  # mass 0.990; keep sampled log-prob consistent so only the mass is wrong
    slp[i] -= 0.01
    err = violation(replace(batch, cand_logprobs=lps, sampled_logprobs=slp))
    assert (err.rule, err.sample, err.row) == ("support_mass", 3, 3)
    assert abs(err.found - float(np.exp(lps[i].astype(np.float64)).sum())) <= float32_mass_tolerance(lps[i])


def test_empty_support_blames_dropped_support_fields():
    batch = support()
    ids, lps = np.array(batch.cand_ids), np.array(batch.cand_logprobs)
    ids[:], lps[:] = -1, -np.inf
    err = violation(replace(batch, cand_ids=ids, cand_logprobs=lps))
    assert (err.rule, err.sample, err.row, err.found) == ("support_mass", 0, 0, 0.0)
    assert "dropped sampling_logprobs_mode/return_sampling_mask" in str(err)


def test_sampled_token_outside_support_is_rejected():
    batch = support()
    i = row_of(2, 4)
    outside = next(v for v in range(VOCAB) if v not in batch.cand_ids[i])
    err = violation(edit(batch, "response_ids", i, outside))
    assert (err.rule, err.sample, err.row, err.found) == ("sampled_not_in_support", 2, 4, outside)


def test_sampled_token_outside_the_head_is_fine_in_selected_mode():
    batch = selected()
    i = row_of(1, 0)
    outside = next(v for v in range(VOCAB) if v not in batch.cand_ids[i])
    batch = edit(edit(batch, "response_ids", i, outside), "sampled_logprobs", i, -9.0)
    check_batch(batch, vocab_size=VOCAB)


def test_sampled_logprob_mismatch_is_rejected():
    batch = selected()
    i = row_of(2, 2)
    err = violation(edit(batch, "sampled_logprobs", i, batch.sampled_logprobs[i] - 1e-3))
    assert (err.rule, err.sample, err.row) == ("sampled_mismatch", 2, 2)
    expected = float(batch.sampled_logprobs[i]) - 1e-3
    assert abs(err.expected - expected) <= sum_tolerance(abs(expected), 1, U32)  # one float32 rounding


def test_sampled_logprob_within_tolerance_passes():
    batch = selected()
    i = row_of(2, 2)
    check_batch(edit(batch, "sampled_logprobs", i, batch.sampled_logprobs[i] - 5e-6), vocab_size=VOCAB)


@pytest.mark.parametrize(
    "name, index, value, rule",
    [
        ("response_ids", row_of(0, 3), VOCAB, "bad_token"),
        ("cand_ids", (row_of(1, 6), 2), VOCAB + 5, "bad_candidate"),
        ("cand_ids", (row_of(1, 6), 2), -7, "bad_candidate"),
    ],
)
def test_ids_outside_the_vocabulary_are_rejected(name, index, value, rule):
    i = index[0] if isinstance(index, tuple) else index
    err = violation(edit(selected(), name, index, value))
    assert (err.rule, err.sample, err.row, err.found) == (rule, i // 8, i % 8, value)


@pytest.mark.parametrize("value", [VOCAB, -1, 2**31 - 1])
def test_a_prompt_id_outside_the_vocabulary_is_bad_prompt_token_with_sample_position_value_and_fix(value):
    err = violation(edit(selected(), "prompt_ids", 2 * 3 + 1, value))  # sample 2's second prompt token
    assert (err.rule, err.sample, err.row, err.found) == ("bad_prompt_token", 2, 1, value)
    assert str(err) == (
        f"sample 2 ('batch-0:s2') prompt position 1 has token id {value}, outside [0, 64) (bad_prompt_token): it "
        "was tokenized for another vocabulary than the trainer's model; run workers and trainer with the same "
        "model and tokenizer"
    )


def test_the_last_prompt_id_of_the_vocabulary_passes():
    check_batch(edit(selected(), "prompt_ids", 11, VOCAB - 1), vocab_size=VOCAB)


PER_TOKEN = ("response_ids", "sampled_logprobs", "loss_mask", "token_versions", "cand_ids", "cand_logprobs")


def without_tokens(batch, sample: int, part: str):
    """``batch`` with every token of sample ``sample``'s ``part`` ("prompt" or "response") removed."""
    offsets, names = ("prompt_offsets", ["prompt_ids"]) if part == "prompt" else ("offsets", PER_TOKEN)
    bounds = getattr(batch, offsets)
    keep = np.r_[0 : bounds[sample], bounds[sample + 1] : bounds[-1]]
    lengths = np.diff(bounds)
    lengths[sample] = 0
    return replace(
        batch,
        **{name: np.array(getattr(batch, name)[keep]) for name in names},
        **{offsets: np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)},
    )


def test_a_sample_with_an_empty_prompt_is_empty_prompt_naming_it_and_the_fix():
    err = violation(without_tokens(selected(), 1, "prompt"))
    assert (err.rule, err.sample, err.row, err.expected, err.found) == ("empty_prompt", 1, None, 1, 0)
    assert str(err) == (
        "sample 1 ('batch-0:s1') has an empty prompt: no position predicts its first response token (empty_prompt); "
        "a task's prompt must render to at least one token; check the worker's tokenizer and chat template"
    )


def test_a_sample_with_no_response_token_is_empty_response_naming_it_and_the_fix():
    batch = without_tokens(selected(), 3, "response")
    assert batch.offsets.tolist() == [0, 8, 16, 24, 24]
    err = violation(batch)
    assert (err.rule, err.sample, err.row, err.expected, err.found) == ("empty_response", 3, None, 1, 0)
    assert str(err) == (
        "sample 3 ('batch-0:s3') has no response token: nothing to train, and a micro-batch of such samples has no "
        "logits (empty_response); a sample holds at least the one token SGLang sampled; sample the group again "
        "rather than pack it"
    )


def test_stale_batch_is_rejected_with_the_age():
    err = violation(selected(weight_version=3), current_version=6, max_staleness=2)
    assert (err.rule, err.expected, err.found) == ("stale", 2, 3)
    check_batch(selected(weight_version=4), vocab_size=VOCAB, current_version=6, max_staleness=2)


@pytest.mark.parametrize("version", [-1, 7])
def test_unknown_version_is_rejected(version):
    err = violation(selected(weight_version=version), current_version=6, max_staleness=2)
    assert (err.rule, err.found) == ("unknown_version", version)


def test_duplicate_batch_is_rejected():
    err = violation(selected(batch_id="b-17"), seen={"b-17"})
    assert (err.rule, err.found) == ("duplicate_batch", "b-17")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: replace(b, offsets=np.array([0, 8, 4, 24, 32])), "offsets must rise monotonically"),
        (
            lambda b: replace(b, offsets=np.array([0, 8, 16, 24, 31])),
            "offsets must rise monotonically from 0 to 32",
        ),
        (
            lambda b: replace(b, cand_ids=b.cand_ids[:, :7], cand_logprobs=b.cand_logprobs[:, :7]),
            "cand_ids has shape [32, 7], expected [32, 8]",
        ),
        (lambda b: replace(b, rewards=b.rewards[:3]), "rewards has shape [3], expected [4]"),
        (
            lambda b: replace(b, cand_ids=b.cand_ids.astype(np.int64)),
            "cand_ids must be a int32 array, found int64",
        ),
        (lambda b: replace(b, mode="full"), "mode is 'full'"),
        (lambda b: replace(b, group_ids=["g"]), "1 group_ids for 4 sample_ids"),
        (
            lambda b: replace(b, finish_reasons=["stop"]),
            "1 finish_reasons for 4 sample_ids (one per sample, or none)",
        ),
        (lambda b: replace(b, loss_mask=np.full(32, 2, np.uint8)), "loss_mask holds values other than 0 and 1"),
        (
            lambda b: replace(b, prompt_offsets=np.array([0, 3, 6, 9, 13])),
            "prompt_offsets must rise monotonically from 0 to 12",
        ),
    ],
)
def test_shape_defects_are_rule_shape(change, message):
    err = violation(change(selected()))
    assert err.rule == "shape"
    assert message in str(err)


def test_every_rule_is_named_in_the_design_documents_rules_list():
    design = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    section = design[design.index("## 5. The completeness contract") : design.index("## 6. ")]
    named = set(re.findall(r"`([a-z_]+)`", section))
    assert set(RULES) - named == set()
    assert {"bad_prompt_token", "empty_prompt", "empty_response"} <= set(RULES)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["selected", "support"]), st.integers(1, 40), st.integers(2, 300))
def test_batches_from_real_distributions_pass(seed, mode, k, vocab):
    top_k = min(k, vocab) if mode == "support" else -1
    check_batch(
        make_batch(samples=3, tokens_per_sample=4, k=k, vocab_size=vocab, mode=mode, top_k=top_k, seed=seed),
        vocab_size=vocab,
    )


def test_k_above_the_vocabulary_is_refused_naming_both_and_the_fix():
    assert k_above_vocab(300, 260) == (
        "K=300 is above the model's vocabulary of 260: SGLang takes its server down on a top_logprobs_num above "
        "the vocabulary, so nothing is sent; lower K to at most 260"
    )


@pytest.mark.parametrize(("k", "vocab", "mode"), [(260, 260, "selected"), (8, 260, "selected"), (300, 260, "support")])
def test_k_at_most_the_vocabulary_or_in_support_mode_may_be_asked(k, vocab, mode):
    assert k_above_vocab(k, vocab, mode) is None
