"""Responses -> arrays -> contract: each defect caught by rule, garbage never escapes as another error."""

import json
import math

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router_proxy.audit import audit_body, full_audit, quick_accept
from router_proxy.bench import native_response
from shared import candidate_scan, sglang_response
from shared.candidate_scan import Scanned
from shared.contract import ContractViolation
from shared.sglang_response import native_metas

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
        else:
            result = full_audit(native_metas(orjson.loads(body)), mode=mode, k=k, vocab_size=VOCAB)
    except ContractViolation as v:
        return ("fail", v.to_dict())
    return ("ok", result.samples, result.tokens)


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
# Values at and around the contract's tolerances, where summation order could decide.
EDGES = [TOL, TOL * (1 + 1e-12), TOL * (1 - 1e-12), 2 * TOL, 0.0, 1e-300, -1e-300, 0.5, -0.5, 1e-7, -1e-7]


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


# The scanned path (shared/candidate_scan.py, for large bodies) against the full orjson parse.


# Each scanner built here: the C one must be (make setup compiles it), the numpy one always is.
SCANNERS = ("c", "numpy")


def test_the_c_scanner_is_built_and_used():
    assert candidate_scan._rowscan is not None, "shared/_rowscan.c is not built: pip install -e . with a C compiler"
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


def agree(results: list) -> None:
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
    agree(all_ways(body, mode=mode, k=k))


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
    agree(all_ways(body, mode="selected", k=8))


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
    agree(all_ways(body, mode="selected", k=8))


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
