"""Responses -> arrays -> contract: each defect caught by rule, garbage never escapes as another error."""

import json
import math

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router_proxy.audit import audit_body
from router_proxy.bench import native_response
from shared.contract import ContractViolation

VOCAB = 300


def valid(tokens: int = 6, k: int = 128) -> dict:
    return orjson.loads(native_response(tokens, k, VOCAB))


def audit(doc, *, endpoint="generate", mode="selected", k=128):
    return audit_body(json.dumps(doc).encode() if not isinstance(doc, bytes) else doc, endpoint=endpoint, mode=mode, k=k, vocab_size=VOCAB)


def violation(doc, **kw) -> ContractViolation:
    with pytest.raises(ContractViolation) as info:
        audit(doc, **kw)
    return info.value


def test_valid_native_response_passes():
    result = audit(valid())
    assert (result.samples, result.tokens) == (1, 6)


def test_batched_native_response_audits_every_sample():
    result = audit([valid(3), valid(5)])
    assert (result.samples, result.tokens) == (2, 8)


def test_rows_truncated_to_20_are_short_rows():
    doc = valid()
    doc["meta_info"]["output_top_logprobs"] = [row[:20] for row in doc["meta_info"]["output_top_logprobs"]]
    v = violation(doc)
    assert (v.rule, v.sample, v.row, v.expected, v.found) == ("short_row", 0, 0, 128, 20)
    assert "caps top_logprobs at 20" in str(v)


def test_missing_top_logprobs_are_short_rows_of_zero():
    doc = valid()
    del doc["meta_info"]["output_top_logprobs"]
    v = violation(doc)
    assert (v.rule, v.expected, v.found) == ("short_row", 128, 0)


def test_support_mode_without_sampling_mask_names_the_dropped_fields():
    v = violation(valid(), mode="support")
    assert v.rule == "support_mass"
    assert "dropped sampling_logprobs_mode/return_sampling_mask" in str(v)


def test_valid_support_response_passes():
    doc = valid(k=8)
    meta = doc["meta_info"]
    rows = [row[:4] for row in meta["output_top_logprobs"]]
    meta["output_token_sampling_mask"] = [[e[1] for e in r] for r in rows]
    lps = []
    for r in rows:
        z = math.log(sum(math.exp(e[0]) for e in r))
        lps.append([e[0] - z for e in r])
    meta["output_token_sampling_logprobs"] = lps
    meta["output_token_logprobs"] = [[lp[0], r[0][1], None] for lp, r in zip(lps, rows)]
    assert audit(doc, mode="support", k=8).tokens == 6


def test_chat_without_meta_info_says_token_ids_are_missing():
    chat = {"choices": [{"index": 0, "message": {"content": "x"}, "logprobs": {"content": []}, "meta_info": None}]}
    v = violation(chat, endpoint="chat")
    assert v.rule == "missing_token_ids"
    assert "no token ids" in str(v)


def test_chat_with_meta_info_is_audited_like_native():
    chat = {"choices": [{"index": 0, "meta_info": valid()["meta_info"]}]}
    assert audit(chat, endpoint="chat").tokens == 6


def test_more_candidates_than_k_is_a_shape_defect():
    v = violation(valid(k=128), k=64)
    assert (v.rule, v.expected, v.found) == ("shape", 64, 128)


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"",
        b'{"text": "x"}',
        b'{"meta_info": 5}',
        b'{"meta_info": {"output_token_logprobs": 7}}',
        b'{"meta_info": {"output_token_logprobs": [[-0.1, "5", null]]}}',
        b'{"meta_info": {"output_token_logprobs": [["NaN", 5, null]]}}',
        b'{"meta_info": {"output_token_logprobs": [[-0.1, true, null]]}}',
        b'{"meta_info": {"output_token_logprobs": [[-0.1]]}}',
        b'{"meta_info": {"output_token_logprobs": [5]}}',
        b'{"meta_info": {"output_token_logprobs": [[-0.1, 99999999999999999999999, null]]}}',
        b'{"meta_info": {"output_token_logprobs": [[-0.1, 5, null]], "output_top_logprobs": [[[-0.1, 5, null]], []]}}',
        b"[]",
        b"null",
    ],
)
def test_malformed_response_is_named_malformed(body):
    v = violation(body)
    assert v.rule == "malformed_response"


JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.sampled_from(["NaN", "-Infinity", "0.5"]),
                 st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(junk=JUNK, row=st.integers(0, 5), col=st.integers(0, 127), slot=st.integers(0, 1), where=st.sampled_from(["top", "sampled"]))
def test_a_wrongly_typed_number_anywhere_is_malformed(junk, row, col, slot, where):
    doc = valid()
    meta = doc["meta_info"]
    entry = meta["output_top_logprobs"][row][col] if where == "top" else meta["output_token_logprobs"][row]
    entry[slot] = junk
    assert violation(doc).rule == "malformed_response"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["meta_info", "output_token_logprobs", "output_top_logprobs", "choices", "x"]), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(doc=JSON, endpoint=st.sampled_from(["generate", "chat"]), mode=st.sampled_from(["selected", "support"]))
def test_arbitrary_json_is_a_violation_or_an_empty_valid_response(doc, endpoint, mode):
    try:
        result = audit(doc, endpoint=endpoint, mode=mode)
    except ContractViolation as v:
        assert v.rule in {"malformed_response", "missing_token_ids", "short_row", "support_mass", "shape", "bad_token",
                          "bad_candidate", "non_finite", "positive_logprob", "padding", "duplicate_candidate", "row_mass",
                          "sampled_not_in_support", "sampled_mismatch"}  # fmt: skip
    else:
        assert result.tokens == 0
