"""Per-token weight versions (router_proxy/versions.py ``token_versions``): SGLang's
``meta_info.weight_versions`` spans ``{version, start, end}`` travel through the proxy's audit
and its binary answer into the batch's ``token_versions``; a span list that does not cover the
sample's output positions exactly is a named ``malformed_response``, never repaired."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from rollout_worker.packing import samples_from_arrays
from router_proxy import answer
from router_proxy.audit import audit_body
from shared import response_arrays
from shared.contract import ContractViolation, check_batch
from shared.msgpack_arrays import WireError
from shared.wire import decode_batch, encode_batch
from tests.rollout_worker.test_packing import VOCAB, K, native, pack

ROW = [(-0.5, 65), (-1.5, 66), (-2.5, 67)]


def item(n: int, spans, version: str = "5", text: str = "A") -> dict:
    """A native item of ``n`` tokens (65 each) whose meta_info carries ``spans`` (None: no field)."""
    doc = native([(-0.5, 65)] * n, tops=[ROW] * n, version=version, text=text)
    if spans is not None:
        doc["meta_info"]["weight_versions"] = spans
    return doc


def span(version: str, start: int, end: int) -> dict:
    return {"version": version, "start": start, "end": end}


def through_proxy(doc) -> list:
    result = audit_body(orjson.dumps(doc), endpoint="generate", mode="selected", k=K, vocab_size=VOCAB, arrays=True)
    return samples_from_arrays(response_arrays.decode(result.reply))


def test_a_response_that_spans_an_update_carries_each_tokens_version_into_the_batch():
    spanning = item(5, [span("4", 0, 2), span("5", 2, 5)])
    whole = item(2, [span("default", 0, 2)], version="default", text="B")
    samples = through_proxy([spanning, whole])
    assert [s.token_versions.tolist() for s in samples] == [[4, 4, 5, 5, 5], [0, 0]]
    assert [s.weight_version for s in samples] == [5, 0]
    batch = decode_batch(encode_batch(pack(samples)))
    assert batch.token_versions.tolist() == [4, 4, 5, 5, 5, 0, 0] and batch.weight_version == 5
    check_batch(batch, vocab_size=VOCAB, current_version=5, max_staleness=5)
    err = pytest.raises(ContractViolation, check_batch, batch, vocab_size=VOCAB, current_version=5, max_staleness=4)
    assert (err.value.rule, err.value.found) == ("stale", 5)  # the oldest trained token, version 0


def test_a_sample_without_spans_is_one_version_on_every_token():
    assert answer.from_body(orjson.dumps([item(3, None)]), "generate", mode="selected", k=K).token_versions is None
    (sample,) = through_proxy([item(3, None, version="7")])
    assert sample.token_versions.tolist() == [7, 7, 7]
    mixed = through_proxy([item(2, None, version="7"), item(1, [span("7", 0, 1)], version="7")])
    assert [s.token_versions.tolist() for s in mixed] == [[7, 7], [7]]


def test_three_spans_and_a_sample_of_no_tokens():
    doc = [item(4, [span("1", 0, 1), span("2", 1, 3), span("3", 3, 4)], version="3"), item(0, [span("3", 0, 0)], "3")]
    samples = through_proxy(doc)
    assert [s.token_versions.tolist() for s in samples] == [[1, 2, 2, 3], []]


@pytest.mark.parametrize(
    "spans, message",
    [
        ([], r"sample 0: meta_info.weight_versions is \[\], expected spans"),
        ("5", r"meta_info.weight_versions is '5', expected spans"),
        ([["5", 0, 3]], r"weight_versions\[0\] is \['5', 0, 3\], expected spans"),
        ([span("5", 1, 3)], r"weight_versions\[0\] is 1..3 after a span ending at 0"),
        ([span("4", 0, 1), span("5", 2, 3)], r"weight_versions\[1\] is 2..3 after a span ending at 1"),
        ([span("4", 0, 2), span("5", 1, 3)], r"weight_versions\[1\] is 1..3 after a span ending at 2"),
        ([span("4", 0, 1), span("5", 1, 1), span("5", 1, 3)], r"weight_versions\[1\] is 1..1 after a span ending"),
        ([span("5", 0, 2)], r"weight_versions ends at 2, the sample has 3 tokens"),
        ([span("5", 0, 4)], r"weight_versions ends at 4, the sample has 3 tokens"),
        ([{"version": "5", "start": 0, "end": 3.0}], r"weight_versions\[0\] has start 0 and end 3.0, expected ints"),
        ([{"version": "5", "start": 0}], r"weight_versions\[0\] has start 0 and end None, expected ints"),
        ([span("v5", 0, 3)], r"weight_versions\[0\].version is 'v5', expected 'default' or a string of an int"),
        ([span("4", 0, 3)], r"weight_versions' last span names version 4, meta_info.weight_version 5"),
        ([span("3000000000", 0, 3)], r"a token's weight version 3000000000 is beyond int32"),
    ],
)
def test_a_malformed_span_list_refuses_the_binary_answer_by_name(spans, message):
    """As for a sample's weight_version (test_audit.py): the spans travel in the binary answer only,
    so a JSON client is handed SGLang's body, and a worker a named malformed_response."""
    version = "3000000000" if "3000000000" in message else "5"
    body = orjson.dumps([item(3, spans, version=version)])
    assert audit_body(body, endpoint="generate", mode="selected", k=K, vocab_size=VOCAB).samples == 1
    with pytest.raises(ContractViolation, match=message) as err:
        audit_body(body, endpoint="generate", mode="selected", k=K, vocab_size=VOCAB, arrays=True)
    assert err.value.rule == "malformed_response"


def test_the_binary_answer_refuses_token_versions_of_another_length():
    good = answer.from_body(orjson.dumps([item(3, [span("5", 0, 3)])]), "generate", mode="selected", k=K)
    assert good.token_versions.tolist() == [5, 5, 5]
    good.token_versions = np.array([5, 5], np.int32)
    with pytest.raises(WireError, match=r"token_versions of shape \(2,\), expected \[N\]=3"):
        response_arrays.decode(response_arrays.encode(good))
