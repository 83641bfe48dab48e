"""Responses -> arrays -> contract: each defect caught by rule, garbage never escapes as another error."""

import json
import math

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from centerline.synth import native_response
from router_proxy import candidate_scan, sglang_response
from router_proxy.audit import audit_body, checked_arrays, quick_accept
from router_proxy.candidate_scan import Scanned
from router_proxy.sglang_response import native_metas
from shared import response_arrays
from shared.contract import ContractViolation

VOCAB = 300


def valid(tokens: int = 6, k: int = 128) -> dict:
    return orjson.loads(native_response(tokens, k, VOCAB))


def audit(doc, *, endpoint="generate", mode="selected", k=128):
    return audit_body(
        json.dumps(doc).encode() if not isinstance(doc, bytes) else doc,
        endpoint=endpoint,
        mode=mode,
        k=k,
        vocab_size=VOCAB,
    )


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


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=5),
    st.sampled_from(["NaN", "-Infinity", "0.5"]),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(
    junk=JUNK,
    row=st.integers(0, 5),
    col=st.integers(0, 127),
    slot=st.integers(0, 1),
    where=st.sampled_from(["top", "sampled"]),
)
def test_a_wrongly_typed_number_anywhere_is_malformed(junk, row, col, slot, where):
    doc = valid()
    meta = doc["meta_info"]
    entry = meta["output_top_logprobs"][row][col] if where == "top" else meta["output_token_logprobs"][row]
    entry[slot] = junk
    assert violation(doc).rule == "malformed_response"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["meta_info", "output_token_logprobs", "output_top_logprobs", "choices", "x"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(doc=JSON, endpoint=st.sampled_from(["generate", "chat"]), mode=st.sampled_from(["selected", "support"]))
def test_arbitrary_json_is_a_violation_or_an_empty_valid_response(doc, endpoint, mode):
    try:
        result = audit(doc, endpoint=endpoint, mode=mode)
    except ContractViolation as v:
        assert v.rule in {
            "malformed_response",
            "missing_token_ids",
            "short_row",
            "support_mass",
            "shape",
            "bad_token",
            "bad_candidate",
            "non_finite",
            "positive_logprob",
            "padding",
            "duplicate_candidate",
            "row_mass",
            "sampled_not_in_support",
            "sampled_mismatch",
        }
    else:
        assert result.tokens == 0


# quick_accept (the pure-Python path for small responses) against the numpy path it stands in for.


def outcome(doc: dict, *, mode: str, k: int, quick: bool):
    """``audit_body`` with or without the quick path: ("ok", samples, tokens) or ("fail", the error dict)."""
    body = json.dumps(doc).encode()  # json, not orjson: it writes integers beyond 64 bits
    try:
        if quick:
            result = audit_body(body, endpoint="generate", mode=mode, k=k, vocab_size=VOCAB)
            return ("ok", result.samples, result.tokens)
        metas = native_metas(orjson.loads(body))
        ids = checked_arrays(metas, mode=mode, k=k, vocab_size=VOCAB)[0]  # the numpy way: arrays, then check_rows
    except ContractViolation as v:
        return ("fail", v.to_dict())
    return ("ok", len(metas), int(ids.shape[0]))


def support(doc: dict, width: int) -> dict:
    """``doc`` turned into a valid support-mode response: each row's first ``width`` candidates, renormalised."""
    meta = doc["meta_info"]
    rows = [row[:width] for row in meta.pop("output_top_logprobs")]
    lps = [[e[0] - math.log(sum(math.exp(c[0]) for c in r)) for e in r] for r in rows]
    meta["output_token_sampling_mask"] = [[e[1] for e in r] for r in rows]
    meta["output_token_sampling_logprobs"] = lps
    meta["output_token_logprobs"] = [
        [lp[0] - 0.3, r[0][1], None] for lp, r in zip(lps, rows)
    ]  # unfiltered: lower than the support one
    return doc


TOL = 1e-5
# Values at and around the contract's tolerances, where summation order or float32's rounding (the audit
# judges float32 values) could decide, and past float32's range.
EDGES = [TOL, TOL * (1 + 1e-12), TOL * (1 - 1e-12), 2 * TOL, 0.0, 1e-300, -1e-300, 0.5, -0.5, 1e-7, -1e-7]
EDGES += [TOL * 0.8, TOL * 0.95, TOL * 1.05, 1e300, 3.4028235677973366e38, 3.4028234663852886e38]


@st.composite
def mutated(draw):
    mode = draw(st.sampled_from(["selected", "support"]))
    k = draw(st.sampled_from([4, 8, 16]))
    doc = orjson.loads(native_response(draw(st.integers(0, 5)), k, VOCAB, seed=draw(st.integers(0, 3))))
    if mode == "support":
        doc = support(doc, draw(st.integers(1, k)))
    meta = doc["meta_info"]
    rows = meta["output_top_logprobs" if mode == "selected" else "output_token_sampling_mask"]
    n = len(meta["output_token_logprobs"])
    kind = draw(
        st.sampled_from(
            ["none", "sampled_lp", "sampled_id", "cand_lp", "cand_id", "mass", "drop", "width", "field", "type"]
        )
    )
    if kind == "none" or n == 0:
        return doc, mode, k
    i = draw(st.integers(0, n - 1))
    j = draw(st.integers(0, len(rows[i]) - 1))
    edge, sign = draw(st.sampled_from(EDGES)), draw(st.sampled_from([1, -1]))
    junk = draw(st.sampled_from([None, True, 1, 0, -1, "0.5", 1.5, -1.5, VOCAB, VOCAB - 1, 2**70, []]))
    if kind == "sampled_lp":
        meta["output_token_logprobs"][i][0] = draw(
            st.sampled_from([edge * sign, meta["output_token_logprobs"][i][0] + edge * sign, junk])
        )
    elif kind == "sampled_id":
        meta["output_token_logprobs"][i][1] = draw(
            st.sampled_from([junk, rows[i][j][1] if mode == "selected" else rows[i][j]])
        )
    elif kind in ("cand_lp", "cand_id", "mass"):
        if mode == "selected":
            entry = rows[i][j]
            value = {
                "cand_lp": draw(st.sampled_from([edge * sign, entry[0] + edge * sign, junk])),
                "cand_id": junk
                if draw(st.booleans())
                else rows[i][(j + 1) % len(rows[i])][1],  # a duplicate when the row has 2+
                "mass": math.log(
                    max(1e-300, 1 + edge * sign - sum(math.exp(e[0]) for e in rows[i]) + math.exp(entry[0]))
                ),
            }[kind]
            entry[0 if kind != "cand_id" else 1] = value
        elif kind == "cand_id":
            rows[i][j] = junk if draw(st.booleans()) else rows[i][(j + 1) % len(rows[i])]
        else:
            lps = meta["output_token_sampling_logprobs"][i]
            lps[j] = draw(st.sampled_from([lps[j] + edge * sign, edge * sign, junk]))
    elif kind == "drop":
        del rows[i][j]
    elif kind == "width":
        target = meta["output_token_logprobs"][i] if draw(st.booleans()) or mode == "support" else rows[i][j]
        target.pop() if draw(st.booleans()) else target.append(None)
    elif kind == "field":
        name = draw(
            st.sampled_from(
                [
                    "output_token_logprobs",
                    "output_top_logprobs",
                    "output_token_sampling_mask",
                    "output_token_sampling_logprobs",
                ]
            )
        )
        meta[name] = draw(st.sampled_from([None, [], junk, (meta.get(name) or [])[:-1]]))
    else:
        rows[i] = junk
    return doc, mode, k


@settings(max_examples=1500, deadline=None)
@given(case=mutated())
def test_quick_path_gives_the_numpy_verdict(case):
    doc, mode, k = case
    assert outcome(doc, mode=mode, k=k, quick=True) == outcome(doc, mode=mode, k=k, quick=False)


@pytest.mark.parametrize("mode", ["selected", "support"])
def test_quick_path_accepts_valid_small_responses(mode):
    doc = orjson.loads(native_response(4, 8, VOCAB))
    doc = support(doc, 5) if mode == "support" else doc
    assert quick_accept(native_metas(doc), mode=mode, k=8, vocab_size=VOCAB) == 4


@pytest.mark.parametrize("ctype", [b"application/json", b"application/json; charset=utf-8", b"Application/JSON"])
def test_json_content_type_is_audited(ctype):
    assert (
        audit_body(
            json.dumps(valid()).encode(),
            endpoint="generate",
            mode="selected",
            k=128,
            vocab_size=VOCAB,
            content_type=ctype,
        ).tokens
        == 6
    )


@pytest.mark.parametrize(
    "ctype, shown", [(b"text/html", "'text/html'"), (b"", "'none'"), (b"application/jsonx", "'application/jsonx'")]
)
def test_another_content_type_is_malformed_even_with_a_valid_body(ctype, shown):
    with pytest.raises(ContractViolation) as info:
        audit_body(
            json.dumps(valid()).encode(),
            endpoint="generate",
            mode="selected",
            k=128,
            vocab_size=VOCAB,
            content_type=ctype,
        )
    assert (info.value.rule, str(info.value)) == (
        "malformed_response",
        f"the upstream answered content-type {shown}, expected application/json",
    )


# What a worker receives is what was audited: the audit judges the values as they travel, in the
# wire dtypes (int32 ids, float32 log-probs), and the fields the binary answer carries besides.

FLT_MAX = 3.4028234663852886e38
FLT_MIDPOINT = 2.0**128 - 2.0**103  # halfway from float32's largest finite value to 2**128: rounds to inf


def both_answers(doc, **kw) -> list:
    """The verdict of the JSON answer and of the binary one: ("ok", tokens) or (rule, message)."""
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    out = []
    for arrays in (False, True):
        try:
            result = audit_body(
                body,
                endpoint=kw.get("endpoint", "generate"),
                mode=kw.get("mode", "selected"),
                k=kw.get("k", 8),
                vocab_size=VOCAB,
                arrays=arrays,
            )
            out.append(("ok", result.tokens))
        except ContractViolation as v:
            out.append((v.rule, str(v)))
    return out


def test_a_finish_reason_of_another_type_is_malformed_in_both_answers():
    # found by fuzz/fuzz_proxy_audit.py: it passed, and its binary answer did not decode
    doc = orjson.loads(native_response(1, 8, VOCAB))
    doc["meta_info"]["finish_reason"] = {"type": 1}
    expected = (
        "malformed_response",
        "sample 0: meta_info.finish_reason is {'type': 1}, expected null or SGLang's object "
        '{"type": "stop" | "length" | "abort", ...}',
    )
    assert both_answers(doc) == [expected, expected]


@pytest.mark.parametrize("reason", ["stop", {"type": "eos"}, {"type": None}, {}, ["stop"], True, 0])
def test_a_finish_reason_not_of_sglangs_shape_is_malformed(reason):
    doc = orjson.loads(native_response(1, 8, VOCAB))
    doc["meta_info"]["finish_reason"] = reason
    assert [rule for rule, _ in both_answers(doc)] == ["malformed_response", "malformed_response"]


@pytest.mark.parametrize(
    "reason, travels",
    [
        (None, None),
        ({"type": "stop", "matched": 2}, "stop"),
        ({"type": "stop", "matched": "\n"}, "stop"),
        ({"type": "length", "length": 1}, "length"),
    ],
)
def test_sglangs_finish_reasons_pass_and_travel_as_their_type(reason, travels):
    doc = orjson.loads(native_response(1, 8, VOCAB))
    doc["meta_info"]["finish_reason"] = reason
    result = audit_body(orjson.dumps(doc), endpoint="generate", mode="selected", k=8, vocab_size=VOCAB, arrays=True)
    assert response_arrays.decode(result.reply).finish_reasons == [travels]


@pytest.mark.parametrize(
    "reason, max_new_tokens, rule",
    [
        ({"type": "length", "length": 8}, 8, "ok"),  # the run's own budget: a length finish it asked for
        ({"type": "length", "length": 8}, None, "ok"),  # no budget stated: nothing to hold it to
        ({"type": "stop", "matched": 2}, 20, "ok"),  # stopped early by itself
        ({"type": "length", "length": 8}, 10, "length_clipped"),  # the engine lowered the budget
    ],
)
def test_a_length_finish_below_the_requests_budget_is_clipped_in_both_answers(reason, max_new_tokens, rule):
    doc = orjson.loads(native_response(1, 8, VOCAB))
    doc["meta_info"]["finish_reason"] = reason
    found = []
    for arrays in (False, True):
        try:
            audit_body(
                orjson.dumps(doc),
                endpoint="generate",
                mode="selected",
                k=8,
                vocab_size=VOCAB,
                arrays=arrays,
                max_new_tokens=max_new_tokens,
            )
            found.append("ok")
        except ContractViolation as v:
            found.append(v.rule)
            assert (v.sample, v.expected, v.found) == (0, 10, 8)
            assert str(v).startswith("sample 0 finished 'length' at 8 tokens, below the request's max_new_tokens 10")
            assert "--context-length" in str(v) and "--rollout-max-new-tokens" in str(v)
    assert found == [rule, rule]


@pytest.mark.parametrize(
    "message, rule",
    [
        ("Request prompt exceeds the KV memory budget: input_len=3000.", "prompt_over_engine_limit"),
        (
            "Input length (3000 tokens) exceeds the maximum allowed length (2042 tokens). Use a shorter input or "
            "enable --allow-auto-truncate.",
            "prompt_over_engine_limit",
        ),
        ("Abort in waiting queue", "sample_aborted"),
        (None, "sample_aborted"),
    ],
)
def test_an_abort_for_a_prompt_the_engine_cannot_hold_is_told_from_a_retryable_one(message, rule):
    doc = orjson.loads(native_response(1, 8, VOCAB))
    doc["meta_info"]["finish_reason"] = {"type": "abort", "message": message}
    assert [r for r, _ in both_answers(doc)] == [rule, rule]


def test_a_log_prob_below_float32s_range_is_malformed_in_both_answers():
    # found by fuzz/fuzz_proxy_audit.py: it passed, and travelled as -inf, an empty slot beside a real id
    doc = orjson.loads(native_response(2, 8, VOCAB, seed=1))
    doc["meta_info"]["output_top_logprobs"][0][-1][0] = -1e300
    expected = (
        "malformed_response",
        "sample 0 row 0: output_top_logprobs log-prob -1e+300 is beyond float32's range, the wire format's log-prob "
        "dtype: it would travel as -inf",
    )
    assert both_answers(doc) == [expected, expected]
    v = violation(doc, k=8)
    assert (v.sample, v.row, v.found) == (0, 0, -1e300)


def test_float32s_rounding_to_inf_is_where_a_log_prob_stops_surviving():
    doc = orjson.loads(native_response(2, 8, VOCAB, seed=1))
    rows = doc["meta_info"]["output_top_logprobs"]
    rows[1][-1][0] = -FLT_MIDPOINT
    v = violation(doc, k=8)
    assert (v.rule, v.sample, v.row, v.found) == ("malformed_response", 0, 1, -FLT_MIDPOINT)
    rows[1][-1][0] = -math.nextafter(FLT_MIDPOINT, 0)  # rounds to float32's largest finite value instead
    result = audit_body(orjson.dumps(doc), endpoint="generate", mode="selected", k=8, vocab_size=VOCAB, arrays=True)
    assert response_arrays.decode(result.reply).cand_logprobs[1, -1] == np.float32(-FLT_MAX)


@pytest.mark.parametrize(
    "where, field",
    [("sampled", "output_token_logprobs"), ("support", "output_token_sampling_logprobs")],
)
def test_a_log_prob_beyond_float32_is_named_by_its_field(where, field):
    doc = orjson.loads(native_response(3, 8, VOCAB))
    mode = "selected"
    if where == "sampled":  # the sampled token is its row's head: its candidate too
        doc["meta_info"]["output_token_logprobs"][2][0] = -1e39
        doc["meta_info"]["output_top_logprobs"][2][0][0] = -1e39
    else:
        doc, mode = support(doc, 4), "support"
        doc["meta_info"]["output_token_sampling_logprobs"][2][3] = -1e39
    v = violation(doc, mode=mode, k=8)
    assert (v.rule, v.sample, v.row, v.found) == ("malformed_response", 0, 2, -1e39)
    assert str(v).startswith(f"sample 0 row 2: {field} log-prob -1e+39 is beyond float32's range")


@pytest.mark.parametrize("where", ["sampled", "candidate"])
def test_an_id_beyond_int32_is_malformed_rather_than_wrapped(where):
    doc = valid(tokens=2, k=8)
    meta = doc["meta_info"]
    if where == "sampled":  # 2**32 + id would wrap to id itself
        meta["output_token_logprobs"][1][1] += 2**32
        field = "output_token_logprobs"
    else:
        meta["output_top_logprobs"][1][3][1] += 2**32
        field = "output_top_logprobs"
    v = violation(doc, k=8)
    assert (v.rule, v.sample, v.row) == ("malformed_response", 0, 1)
    assert str(v) == f"sample 0 row 1: {field} id {v.found} is outside int32, the wire format's id dtype: it would wrap"


def test_a_sampled_log_prob_equal_to_its_candidates_in_float64_but_not_in_float32_is_a_mismatch():
    # 8.9e-6 apart as sent, 1.53e-5 apart as float32, which the worker's and the trainer's checks read
    doc = orjson.loads(native_response(1, 8, VOCAB))
    doc["meta_info"]["output_token_logprobs"][0][0] = -100.0000039
    doc["meta_info"]["output_top_logprobs"][0][0][0] = -99.999995
    v = violation(doc, k=8)
    assert (v.rule, v.sample, v.row, v.expected, v.found) == (
        "sampled_mismatch",
        0,
        0,
        float(np.float32(-100.0000039)),
        float(np.float32(-99.999995)),
    )


@pytest.mark.parametrize("text", [5, True, ["x"], {"text": "x"}])
def test_a_text_that_is_not_a_string_is_malformed(text):
    doc = valid(tokens=1, k=8)
    doc["text"] = text
    expected = f"sample 0: text is {type(text).__name__}, expected a string or null"
    assert both_answers(doc) == [("malformed_response", expected)] * 2


def test_a_chat_message_that_is_not_an_object_is_malformed():
    chat = {"choices": [{"index": 0, "message": "x", "meta_info": valid(tokens=1, k=8)["meta_info"]}]}
    expected = ("malformed_response", "choices[0].message is str, expected an object")
    assert both_answers(chat, endpoint="chat") == [expected, expected]


def test_a_chat_message_without_content_travels_as_an_empty_text():
    chat = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None},
                "meta_info": valid(tokens=1, k=8)["meta_info"],
            }
        ]
    }
    result = audit_body(json.dumps(chat).encode(), endpoint="chat", mode="selected", k=8, vocab_size=VOCAB, arrays=True)
    assert response_arrays.decode(result.reply).texts == [""]


@pytest.mark.parametrize("version", [1.5, True, 3, " 3", "+3", "3_0", "\u0663", "-1", "", "1" * 20, "0" * 5000])
def test_a_weight_version_not_sglangs_string_of_an_int_refuses_only_the_binary_answer(version):
    doc = valid(tokens=1, k=8)
    doc["meta_info"]["weight_version"] = version
    expected = (
        f"sample 0: meta_info.weight_version is {repr(version)[:80]}, expected 'default' or a string of an int "
        "(up to 19 ASCII digits: the trainer names versions 0, 1, ...)"
    )
    assert both_answers(doc) == [("ok", 1), ("malformed_response", expected)]


@pytest.mark.parametrize("version, travels", [("default", 0), ("0", 0), ("17", 17), ("9" * 19, 10**19 - 1)])
def test_sglangs_weight_versions_travel_as_ints(version, travels):
    doc = valid(tokens=1, k=8)
    doc["meta_info"]["weight_version"] = version
    result = audit_body(
        json.dumps(doc).encode(), endpoint="generate", mode="selected", k=8, vocab_size=VOCAB, arrays=True
    )
    assert response_arrays.decode(result.reply).weight_versions == [travels]


# The scanned path (router_proxy/candidate_scan.py, for large bodies) against the full orjson parse.


# Each scanner built here: the C one must be (make setup compiles it), the numpy one always is.
SCANNERS = ("c", "numpy")


def test_the_c_scanner_is_built_and_used():
    assert candidate_scan._rowscan is not None, (
        "router_proxy/_rowscan.c is not built: pip install -e . with a C compiler"
    )
    assert candidate_scan.SCANNER == "c"


def all_ways(body: bytes, *, mode: str, k: int) -> list:
    """``audit_body`` of ``body`` scanned by each scanner, then parsed whole: (verdict, arrays) each."""
    results = []
    for scanner, threshold in [(name, 0) for name in SCANNERS] + [(candidate_scan.SCANNER, 1 << 62)]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sglang_response, "SCAN_MIN_BYTES", threshold)
            patch.setattr(candidate_scan, "SCANNER", scanner)
            results.append(_audited(body, mode=mode, k=k))
    return results


def assert_every_scanner_matches_the_full_parse(results: list) -> None:
    *scanned, full = results
    for name, result in zip(SCANNERS, scanned):
        assert result == full, name


def _audited(body: bytes, *, mode: str, k: int):
    try:
        result = audit_body(body, endpoint="generate", mode=mode, k=k, vocab_size=VOCAB)
        _, metas = sglang_response.parse_body(body, "generate", mode=mode, k=k)
        arrays = sglang_response.to_arrays(metas, mode=mode, k=k)
        return ("ok", result.samples, result.tokens), [a.tobytes() for a in arrays]
    except ContractViolation as v:
        return ("fail", v.to_dict()), None


def compact(doc) -> bytes:
    """SGLang's layout (orjson, no spaces); json where orjson cannot (integers beyond 64 bits)."""
    try:
        return orjson.dumps(doc)
    except TypeError:
        return json.dumps(doc, separators=(",", ":")).encode()


# Bytes a hostile upstream might put anywhere in the candidate rows.
EDITS = st.sampled_from([b"", b" ", b"0", b"9", b"-", b"+", b".", b"e", b"E", b",", b"[", b"]", b"n", b'"', b"x"])


@settings(max_examples=600, deadline=None)
@given(case=mutated(), edit=st.tuples(st.integers(0, 10**9), st.integers(0, 3), EDITS), edited=st.booleans())
def test_scanned_path_gives_the_full_parse_verdict_and_arrays(case, edit, edited):
    doc, mode, k = case
    body = compact(doc)
    if edited:  # a byte edit inside the candidate rows (or wherever they would be)
        at, drop, text = edit
        start = max(body.find(b'"output_top_logprobs"'), 0)
        at = start + at % max(len(body) - start, 1)
        body = body[:at] + text + body[at + drop :]
    assert_every_scanner_matches_the_full_parse(all_ways(body, mode=mode, k=k))


NUMBERS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(-50, 0),
    st.floats(-1e-3, 0),
    st.integers(-(10**20), 10**20),
    st.sampled_from([0.0, -0.0, 0, 1e-300, -5e-324, 1e300, -1e22, -1e23]),
)


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(NUMBERS, min_size=8, max_size=8), spaced=st.booleans(), writer=st.sampled_from(["orjson", "json"])
)
def test_scanned_log_probs_are_the_full_parse_floats_bit_for_bit(values, spaced, writer):
    doc = valid(tokens=2, k=8)
    meta = doc["meta_info"]
    for row in meta["output_top_logprobs"]:
        for entry, value in zip(row, values):
            entry[0] = value
    if writer == "orjson":
        body = compact(doc)
    else:
        body = json.dumps(doc, separators=(", ", ": ") if spaced else (",", ":")).encode()
    assert_every_scanner_matches_the_full_parse(all_ways(body, mode="selected", k=8))


def test_large_valid_response_takes_the_scanned_path():
    body = native_response(600, 128, VOCAB)
    assert len(body) >= sglang_response.SCAN_MIN_BYTES
    _, metas = sglang_response.parse_body(body, "generate", mode="selected", k=128)
    assert isinstance(metas[0]["output_top_logprobs"], Scanned)
    assert audit(body).tokens == 600


@pytest.mark.parametrize(
    "text",
    [
        b'{"text":"\\"output_top_logprobs\\":[[[-0.5,1,null]]]","meta_info":MI}',  # the key inside a string
        b'{"meta_info":MI,"x":{"output_top_logprobs":[[[-0.5,1,null]]]}}',  # the key elsewhere
        b'{"meta_info":MI,"meta_info":MI}',  # a duplicate key
        b'[{"meta_info":MI},{"meta_info":{"output_token_logprobs":[]}}]',  # a sample without rows
    ],
)
def test_scan_never_vouches_for_rows_it_cannot_place(text):
    meta = orjson.dumps(valid(tokens=3, k=8)["meta_info"])
    body = text.replace(b"MI", meta)
    assert_every_scanner_matches_the_full_parse(all_ways(body, mode="selected", k=8))


@settings(max_examples=500, deadline=None)
@given(
    rows=st.lists(
        st.lists(
            st.tuples(NUMBERS.filter(lambda v: abs(v) < 2**53), st.integers(-(2**40), 2**40)), min_size=3, max_size=3
        ),
        min_size=1,
        max_size=6,
    )
)
def test_each_scanner_reads_every_compact_row_orjson_writes_bit_for_bit(rows):
    body = b'{"output_top_logprobs":' + orjson.dumps([[[lp, i, None] for lp, i in row] for row in rows]) + b"}"
    expect_ids = np.array([[i for _, i in row] for row in rows], np.int64)
    expect_logprobs = np.array([[float(lp) for lp, _ in row] for row in rows])  # an int log-prob reads as float(int)
    for scanner in SCANNERS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(candidate_scan, "SCANNER", scanner)
            found = candidate_scan.cut(body, 3)
        if scanner == "numpy" and any(len(str(i)) > 7 for row in rows for _, i in row):
            assert found is None  # it reads ids of up to 7 characters; the general parse reads the rest
            continue
        assert found is not None, scanner
        rest, (scanned,) = found
        assert candidate_scan.marker_index(orjson.loads(rest)["output_top_logprobs"]) == 0
        assert scanned.ids.tolist() == expect_ids.tolist(), scanner
        assert scanned.logprobs.view(np.int64).tolist() == expect_logprobs.view(np.int64).tolist(), scanner


@pytest.mark.parametrize("value", [-1e300, -FLT_MIDPOINT, -math.nextafter(FLT_MIDPOINT, 0), -1e38])
def test_every_scanner_and_the_full_parse_judge_float32_alike(value):
    doc = valid(tokens=300, k=8)  # large enough to be scanned
    doc["meta_info"]["output_top_logprobs"][299][5][0] = value
    body = orjson.dumps(doc)
    assert len(body) >= sglang_response.SCAN_MIN_BYTES
    results = all_ways(body, mode="selected", k=8)
    assert_every_scanner_matches_the_full_parse(results)
    assert results[-1][0][0] == ("fail" if value <= -FLT_MIDPOINT else "ok")
